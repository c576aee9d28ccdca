"""``CifarCNN``: a small convolutional classifier for CIFAR-10 (and its synthetic stand-in)."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import lightning.pytorch as pl
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_amp_plus._checks import check_bool, check_int
from lightning_amp_plus.models import _optim
from lightning_amp_plus.models._optim import OptimizerName, SchedulerName

__all__ = ["CifarCNN"]

# Channels of the three stages, as multiples of `width`.
_STAGES = (1, 2, 4)


class CifarCNN(pl.LightningModule):
    """Three conv-(BatchNorm)-ReLU-pool stages, global average pooling, dropout and a linear classifier.

    Stage ``i`` has ``width * (1, 2, 4)[i]`` channels of 3x3 kernels; the first two halve the image (max pooling,
    rounding up), the last pools it to 1x1 (adaptive), so any image of at least 1x1 pixels fits: 32x32 CIFAR-10 as
    well as the small images of tests. Loss: cross-entropy, computed in fp32 from the logits.

    A batch is ``(images float[B, C, H, W], labels long[B])``. Logged metrics: ``train/loss`` and ``train/acc`` (per
    step and per epoch; the loss on the progress bar), ``val/loss`` and ``val/acc``, ``test/loss`` and ``test/acc``
    (per epoch). Under DDP the epoch values are over every process: the losses are logged with ``sync_dist=True``,
    the accuracies are torchmetrics metrics, which gather their state themselves.

    Args:
        num_classes: output classes (>= 2).
        in_channels: image channels.
        width: channels of the first convolution.
        batch_norm: a BatchNorm after each convolution (the convolutions then have no bias).
        dropout: dropout probability before the classifier.
        optimizer: ``"sgd"`` (with ``momentum``), ``"adam"`` or ``"adamw"``.
        lr: the (peak) learning rate.
        momentum: SGD's momentum; ignored by Adam(W).
        weight_decay: on conv and linear weights only, not on biases or BatchNorm (see
            :func:`~lightning_amp_plus.models._optim.parameter_groups`).
        scheduler: ``"none"``, ``"cosine"``, ``"onecycle"`` or ``"step"``, stepped per optimizer step over the
            Trainer's ``estimated_stepping_batches``.

    Examples:
        >>> import torch
        >>> model = CifarCNN(width=8)
        >>> model(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        width: int = 32,
        batch_norm: bool = True,
        dropout: float = 0.0,
        optimizer: OptimizerName = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        scheduler: SchedulerName = "cosine",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        # The checks return plain Python numbers (a NumPy one too becomes one): save_hyperparameters reads these
        # locals, so the hyperparameters and every checkpoint hold ints and floats that torch.load(weights_only) reads.
        num_classes = check_int(name, "num_classes", num_classes, minimum=2)
        in_channels = check_int(name, "in_channels", in_channels, minimum=1)
        width = check_int(name, "width", width, minimum=1)
        check_bool(name, "batch_norm", batch_norm)
        dropout = _optim.check_dropout(name, dropout)
        lr, weight_decay, momentum = _optim.check_optim_args(name, optimizer, scheduler, lr, weight_decay, momentum)
        self.save_hyperparameters()
        channels = [in_channels, *(width * multiple for multiple in _STAGES)]
        stages: list[nn.Module] = []
        for index, (c_in, c_out) in enumerate(pairwise(channels)):
            last = index == len(_STAGES) - 1
            stages.append(_stage(c_in, c_out, batch_norm, nn.AdaptiveAvgPool2d(1) if last else _halve()))
        self.features = nn.Sequential(*stages)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(channels[-1], num_classes)
        self.train_acc = MulticlassAccuracy(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)
        self.test_acc = MulticlassAccuracy(num_classes)

    @override
    def forward(self, images: Tensor) -> Tensor:
        """The logits ``[B, num_classes]`` of ``images`` ``[B, C, H, W]``."""
        if images.dim() != 4 or images.shape[1] != self.hparams["in_channels"]:
            raise ValueError(
                f"{type(self).__name__} expects images of shape [B, {self.hparams['in_channels']}, H, W], got "
                f"{tuple(images.shape)}. Set in_channels to the images' channel count."
            )
        # With weights held in fp16/bf16 (master-weights training) and no autocast, the input must match them.
        # (The first parameter of `features` is the first convolution's weight.)
        images = images.to(next(self.features.parameters()).dtype)
        features = self.features(images).flatten(1)
        logits: Tensor = self.classifier(self.dropout(features))
        return logits

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, logits, labels = self._loss(batch)
        self.train_acc(logits, labels)
        # sync_dist: under DDP the epoch mean is taken over every process (the step value is averaged too: one
        # scalar all-reduce a step, next to the gradients' own), as Lightning asks of epoch-level tensor metrics.
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits, labels = self._loss(batch)
        self.val_acc.update(logits, labels)
        self.log("val/loss", loss, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, on_epoch=True, prog_bar=True)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, logits, labels = self._loss(batch)
        self.test_acc.update(logits, labels)
        self.log("test/loss", loss, on_epoch=True, sync_dist=True)
        self.log("test/acc", self.test_acc, on_epoch=True)

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        return _optim.configure(self, hp["optimizer"], hp["scheduler"], hp["lr"], hp["weight_decay"], hp["momentum"])

    def _loss(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        images, labels = batch
        # fp16/bf16 logits from autocast: the softmax and the loss in fp32, where they cannot underflow.
        logits = self(images).float()
        return F.cross_entropy(logits, labels), logits.detach(), labels


def _stage(c_in: int, c_out: int, batch_norm: bool, pool: nn.Module) -> nn.Sequential:
    conv = nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=not batch_norm)
    norm: nn.Module = nn.BatchNorm2d(c_out) if batch_norm else nn.Identity()
    return nn.Sequential(conv, norm, nn.ReLU(inplace=True), pool)


def _halve() -> nn.MaxPool2d:
    # ceil_mode: an odd or 1-pixel side still leaves a pixel, so small test images pass all stages.
    return nn.MaxPool2d(kernel_size=2, ceil_mode=True)
