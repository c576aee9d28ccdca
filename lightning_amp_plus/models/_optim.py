"""The configuration the shipped models share: optimizer and LR-schedule choices, and their argument checks.

``configure_optimizers`` of each model calls :func:`configure`; the argument checks run in the models' constructors
(:func:`check_optim_args`, :func:`check_dropout`, and the rest of :mod:`lightning_amp_plus._checks`), so that a
bad choice fails when the model is built, not when ``fit`` starts.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.types import LRSchedulerConfigType
from torch import nn
from torch.optim import Optimizer

from lightning_amp_plus._checks import check_nonnegative, check_real

__all__ = [
    "OptimizerName",
    "SchedulerName",
    "build_optimizer",
    "build_scheduler",
    "check_dropout",
    "check_optim_args",
    "configure",
    "parameter_groups",
]

OptimizerName = Literal["sgd", "adam", "adamw"]
SchedulerName = Literal["none", "cosine", "onecycle", "step"]
_OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
_SCHEDULERS: tuple[str, ...] = get_args(SchedulerName)
# "step": the classic ResNet recipe, the LR divided by 10 at half and at three quarters of the run.
_STEP_MILESTONES = (0.5, 0.75)
_STEP_GAMMA = 0.1


def check_optim_args(
    owner: str, optimizer: str, scheduler: str, lr: float, weight_decay: float, momentum: float = 0.0
) -> tuple[float, float, float]:
    """Raise a clear error for a choice :func:`configure` cannot build; ``owner`` names the model in the message.

    Returns:
        ``(lr, weight_decay, momentum)`` as Python floats (see :func:`~lightning_amp_plus._checks.check_real`).

    Examples:
        >>> check_optim_args("CifarCNN", "sgd", "cosine", lr=0.05, weight_decay=5e-4, momentum=0.9)
        (0.05, 0.0005, 0.9)
        >>> check_optim_args("CifarCNN", "lamb", "none", lr=0.05, weight_decay=0.0)
        Traceback (most recent call last):
        ...
        ValueError: `CifarCNN(optimizer='lamb')` is not supported: use one of 'sgd', 'adam', 'adamw'.
    """
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"`{owner}(optimizer={optimizer!r})` is not supported: use one of {_quoted(_OPTIMIZERS)}.")
    if scheduler not in _SCHEDULERS:
        raise ValueError(f"`{owner}(scheduler={scheduler!r})` is not supported: use one of {_quoted(_SCHEDULERS)}.")
    return (
        check_real(owner, "lr", lr, "a positive finite number, e.g. 1e-3", lambda number: number > 0),
        check_nonnegative(owner, "weight_decay", weight_decay, hint=" (0 turns it off)"),
        check_real(owner, "momentum", momentum, "in [0, 1), e.g. 0.9 (0 turns it off)", _below_one),
    )


def check_dropout(owner: str, value: object) -> float:
    """``value`` as a Python float; raise unless it is a dropout probability in [0, 1).

    Examples:
        >>> check_dropout("ImdbLSTM", 0)
        0.0
        >>> check_dropout("ImdbLSTM", 1.0)
        Traceback (most recent call last):
        ...
        ValueError: `ImdbLSTM(dropout=1.0)` must be a probability in [0, 1), e.g. 0.1 (0 turns dropout off).
    """
    return check_real(owner, "dropout", value, "a probability in [0, 1), e.g. 0.1 (0 turns dropout off)", _below_one)


def parameter_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split the trainable parameters: weight decay on matrices and kernels only, never on biases or norm scales.

    Decaying a bias or a BatchNorm scale shrinks what normalisation relies on and helps no generalisation (the usual
    practice since Goyal et al. 2017); a parameter with two or more dimensions is a weight.

    Examples:
        >>> groups = parameter_groups(nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)), weight_decay=0.1)
        >>> [(len(g["params"]), g["weight_decay"]) for g in groups]
        [(1, 0.1), (3, 0.0)]
    """
    trainable = [p for p in module.parameters() if p.requires_grad]
    if weight_decay == 0:
        return [{"params": trainable, "weight_decay": 0.0}]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(name: OptimizerName, groups: list[dict[str, Any]], lr: float, momentum: float = 0.9) -> Optimizer:
    """The optimizer called ``name`` over ``groups`` (see :func:`parameter_groups`); ``momentum`` is SGD's only.

    ``"adam"`` adds the decay to the gradient (L2), ``"adamw"`` decouples it (Loshchilov & Hutter).

    Examples:
        >>> build_optimizer("adamw", parameter_groups(nn.Linear(2, 1), 0.01), lr=1e-3)
        AdamW (...
    """
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    raise ValueError(f"optimizer={name!r} is not supported: use one of {_quoted(_OPTIMIZERS)}.")


def build_scheduler(name: SchedulerName, optimizer: Optimizer, total_steps: int) -> LRSchedulerConfigType | None:
    """The LR schedule called ``name`` over ``total_steps`` optimizer steps, as a Lightning scheduler config.

    Every schedule steps per optimizer step (``interval="step"``), so that it spans the run whatever its length in
    epochs: ``"cosine"`` anneals to 0 at ``total_steps``; ``"onecycle"`` warms up over the first 30% to the
    optimizer's LR then anneals (momentum cycled too, as OneCycleLR does); ``"step"`` divides the LR by 10 at half
    and three quarters of the run. ``"none"`` returns ``None``.

    Examples:
        >>> optimizer = build_optimizer("sgd", parameter_groups(nn.Linear(2, 1), 0.0), lr=0.1)
        >>> config = build_scheduler("cosine", optimizer, total_steps=100)
        >>> type(config["scheduler"]).__name__, config["interval"]
        ('CosineAnnealingLR', 'step')
    """
    if name == "none":
        return None
    if not total_steps >= 1:
        raise ValueError(f"scheduler={name!r} needs total_steps >= 1, got {total_steps}.")
    scheduler: torch.optim.lr_scheduler.LRScheduler
    if name == "cosine":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    elif name == "onecycle":
        max_lr = [group["lr"] for group in optimizer.param_groups]
        # Cycling momentum needs a momentum to cycle: SGD's may be 0 (off), Adam's beta1 always is there.
        cycle = not isinstance(optimizer, torch.optim.SGD) or optimizer.defaults["momentum"] > 0
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=max_lr, total_steps=total_steps, cycle_momentum=cycle
        )
    elif name == "step":
        milestones = [max(1, int(fraction * total_steps)) for fraction in _STEP_MILESTONES]
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=_STEP_GAMMA)
    else:
        raise ValueError(f"scheduler={name!r} is not supported: use one of {_quoted(_SCHEDULERS)}.")
    return {"scheduler": scheduler, "interval": "step", "frequency": 1, "name": f"lr-{name}"}


def configure(
    module: pl.LightningModule,
    optimizer: OptimizerName,
    scheduler: SchedulerName,
    lr: float,
    weight_decay: float,
    momentum: float = 0.9,
) -> Any:
    """What ``module.configure_optimizers`` returns: the optimizer, with its schedule when there is one.

    A schedule spans ``module.trainer.estimated_stepping_batches``, which counts gradient accumulation, ``max_steps``,
    ``limit_train_batches`` and devices as Lightning will.

    Examples:
        >>> from lightning_amp_plus.models import CifarCNN
        >>> type(configure(CifarCNN(), "adam", "none", lr=1e-3, weight_decay=0.0)).__name__
        'Adam'
    """
    built = build_optimizer(optimizer, parameter_groups(module, weight_decay), lr=lr, momentum=momentum)
    if scheduler == "none":
        return built
    total = module.trainer.estimated_stepping_batches
    if not math.isfinite(total):
        raise ValueError(
            f"scheduler={scheduler!r} spans the whole run, but this run has no end (max_epochs=-1 and max_steps=-1): "
            "set Trainer(max_steps=...) or Trainer(max_epochs=...), or use scheduler='none'."
        )
    return {"optimizer": built, "lr_scheduler": build_scheduler(scheduler, built, total_steps=int(total))}


def _below_one(number: float) -> bool:
    return 0 <= number < 1


def _quoted(names: tuple[str, ...]) -> str:
    return ", ".join(repr(name) for name in names)
