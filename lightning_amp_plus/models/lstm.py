"""``ImdbLSTM``: an LSTM sentiment classifier for IMDB reviews (and their synthetic stand-in)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence
from torchmetrics.classification import BinaryAccuracy
from typing_extensions import override

from lightning_amp_plus._checks import check_bool, check_int, is_int, show
from lightning_amp_plus.models import _optim
from lightning_amp_plus.models._optim import OptimizerName, SchedulerName

__all__ = ["ImdbLSTM"]

Batch = tuple[Tensor, Tensor, Tensor]


class ImdbLSTM(pl.LightningModule):
    """Embedding, a (bidirectional) LSTM over the packed sequences, and a linear layer to one logit.

    The LSTM reads each sequence up to its length only (``pack_padded_sequence``), so padding never reaches the
    state; the classifier sees the last layer's final hidden state, both directions concatenated when
    ``bidirectional``. The loss is ``binary_cross_entropy_with_logits`` in fp32: ``BCELoss`` is refused by CUDA
    autocast, and the sigmoid folded into the loss cannot saturate.

    Runs under fp16/bf16 autocast (CPU and CUDA) and with its weights held in fp16/bf16 outside autocast (as in
    master-weights training): the embeddings are cast to the LSTM's weight dtype before it runs.

    A batch is ``(tokens long[B, T], lengths long[B], labels float[B] or long[B])``, as
    :func:`~lightning_amp_plus.data._collate.pad_collate` makes; a length of 0 is read as one padding token. Logged
    metrics: ``train/loss`` and ``train/acc`` (per step and per epoch; the loss on the progress bar), ``val/loss`` and
    ``val/acc``, ``test/loss`` and ``test/acc`` (per epoch). Under DDP the epoch values are over every process: the
    losses are logged with ``sync_dist=True``, the accuracies are torchmetrics metrics, which gather their state
    themselves.

    Args:
        vocab_size: token ids are ``0 .. vocab_size - 1``.
        embed_dim: embedding size.
        hidden_dim: LSTM hidden size (per direction).
        num_layers: stacked LSTM layers.
        bidirectional: read the sequences both ways.
        dropout: on the embeddings, between LSTM layers and before the classifier.
        pad_index: the padding token id; its embedding is zero and gets no gradient.
        optimizer: ``"adamw"``, ``"adam"`` or ``"sgd"`` (momentum 0.9).
        lr: the (peak) learning rate.
        weight_decay: on embedding, LSTM and linear weight matrices only, not on biases.
        scheduler: ``"none"``, ``"cosine"``, ``"onecycle"`` or ``"step"``, stepped per optimizer step over the
            Trainer's ``estimated_stepping_batches``.

    Examples:
        >>> model = ImdbLSTM(vocab_size=100, embed_dim=8, hidden_dim=16)
        >>> tokens, lengths = torch.tensor([[5, 6, 7], [8, 0, 0]]), torch.tensor([3, 1])
        >>> model(tokens, lengths).shape
        torch.Size([2])
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int = 64,
        hidden_dim: int = 128,
        num_layers: int = 1,
        bidirectional: bool = True,
        dropout: float = 0.0,
        pad_index: int = 0,
        optimizer: OptimizerName = "adamw",
        lr: float = 2e-3,
        weight_decay: float = 0.01,
        scheduler: SchedulerName = "none",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        # Plain Python numbers from the checks, for the hyperparameters save_hyperparameters reads from these locals
        # (see CifarCNN).
        vocab_size = check_int(name, "vocab_size", vocab_size, minimum=2)
        embed_dim = check_int(name, "embed_dim", embed_dim, minimum=1)
        hidden_dim = check_int(name, "hidden_dim", hidden_dim, minimum=1)
        num_layers = check_int(name, "num_layers", num_layers, minimum=1)
        check_bool(name, "bidirectional", bidirectional)
        dropout = _optim.check_dropout(name, dropout)
        if not is_int(pad_index) or not 0 <= pad_index < vocab_size:
            raise ValueError(
                f"`{name}(pad_index={show(pad_index)})` must be a token id in [0, vocab_size={vocab_size}): the id the "
                "collate function pads with (pad_collate's default is 0)."
            )
        pad_index = int(pad_index)
        lr, weight_decay, _ = _optim.check_optim_args(name, optimizer, scheduler, lr, weight_decay)
        self.save_hyperparameters()
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_index)
        # nn.LSTM applies its dropout between layers only, and warns when there is no second layer.
        self.lstm = nn.LSTM(
            embed_dim,
            hidden_dim,
            num_layers=num_layers,
            bidirectional=bidirectional,
            dropout=dropout if num_layers > 1 else 0.0,
            batch_first=True,
        )
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(hidden_dim * (2 if bidirectional else 1), 1)
        self.train_acc = BinaryAccuracy()
        self.val_acc = BinaryAccuracy()
        self.test_acc = BinaryAccuracy()

    @override
    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """The logits ``[B]`` of ``tokens`` ``[B, T]`` whose rows hold ``lengths`` ``[B]`` real tokens."""
        self._check_inputs(tokens, lengths)
        # Outside autocast the LSTM wants its input in its weights' dtype, which the embedding's need not be when
        # weights are held in fp16/bf16 (master-weights training). Under autocast the cast changes nothing: the
        # input is fp32 or already the LSTM's dtype, and CUDA's cuDNN LSTM casts to the autocast dtype itself.
        embedded = self.dropout(self.embedding(tokens)).to(self.lstm.weight_ih_l0.dtype)
        # pack_padded_sequence wants the lengths on the CPU, and refuses 0: an empty row reads its first pad token.
        packed = pack_padded_sequence(embedded, lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False)
        _, (hidden, _) = self._run_lstm(packed)
        # hidden: [num_layers * directions, B, H]; the last layer's directions are the last rows.
        directions = 2 if self.lstm.bidirectional else 1
        # Likewise for the classifier, should it be held in another dtype than the LSTM.
        last = torch.cat(list(hidden[-directions:]), dim=1).to(self.classifier.weight.dtype)
        logits: Tensor = self.classifier(self.dropout(last)).squeeze(1)
        return logits

    def _run_lstm(self, packed: PackedSequence) -> tuple[PackedSequence, tuple[Tensor, Tensor]]:
        if packed.data.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # torch 2.14's oneDNN LSTM fails under CPU autocast for some shapes ("could not create a primitive
            # descriptor", e.g. a batch whose rows all have the same length): run it outside autocast, in the dtype
            # of its weights (the input was cast to it above).
            with torch.autocast("cpu", enabled=False):
                return self.lstm(packed)  # type: ignore[no-any-return]
        return self.lstm(packed)  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss, probabilities, labels = self._loss(batch)
        self.train_acc(probabilities, labels)
        # sync_dist: under DDP the epoch mean is taken over every process (the step value is averaged too: one
        # scalar all-reduce a step, next to the gradients' own), as Lightning asks of epoch-level tensor metrics.
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        loss, probabilities, labels = self._loss(batch)
        self.val_acc.update(probabilities, labels)
        self.log("val/loss", loss, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("val/acc", self.val_acc, on_epoch=True, prog_bar=True)

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        loss, probabilities, labels = self._loss(batch)
        self.test_acc.update(probabilities, labels)
        self.log("test/loss", loss, on_epoch=True, sync_dist=True)
        self.log("test/acc", self.test_acc, on_epoch=True)

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        # SGD's momentum is fixed at the usual 0.9: the LSTM is an Adam(W) model, SGD is there for comparison.
        return _optim.configure(self, hp["optimizer"], hp["scheduler"], hp["lr"], hp["weight_decay"], momentum=0.9)

    def _loss(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        tokens, lengths, labels = batch
        logits = self(tokens, lengths).float()
        # Labels come as float (pad_collate) or long (other collates): the loss wants float, the metric ints.
        loss = F.binary_cross_entropy_with_logits(logits, labels.float())
        return loss, torch.sigmoid(logits.detach()), labels.long()

    def _check_inputs(self, tokens: Tensor, lengths: Tensor) -> None:
        if tokens.dim() != 2 or tokens.is_floating_point():
            raise ValueError(
                f"{type(self).__name__} expects tokens as an integer tensor [B, T], got a {tokens.dim()}-D "
                f"{tokens.dtype} tensor. Batch the sequences with lightning_amp_plus.data._collate.pad_collate."
            )
        if lengths.shape != tokens.shape[:1]:
            raise ValueError(
                f"{type(self).__name__}: lengths has shape {tuple(lengths.shape)}, expected [{tokens.shape[0]}] "
                "(one length per row of tokens)."
            )
