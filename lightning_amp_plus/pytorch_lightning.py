"""The Trainer's plugins, the monitor and the shipped models for ``import pytorch_lightning as pl``.

``pytorch_lightning`` is Lightning's standalone package: the same Trainer as ``lightning.pytorch``, with its own copy of
every class, so it refuses plugins and callbacks built on ``lightning.pytorch``'s. The names here are the package's own
classes built from the same source over ``pytorch_lightning`` (and ``lightning_fabric``): they behave as the
``lightning`` ones do, and the same tests run on both. :class:`DynamicLossScaler` and :class:`SpikeGuard` import no
Lightning: they are the package's own, shared.

Examples:
    >>> from lightning_amp_plus.pytorch_lightning import MixedPrecisionPlugin
    >>> import pytorch_lightning as pl
    >>> isinstance(MixedPrecisionPlugin("bf16-mixed", "cpu"), pl.plugins.precision.Precision)
    True

Mixing the namespaces is refused by the Trainer with a message naming the import to use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_amp_plus.step.scaler import DynamicLossScaler
from lightning_amp_plus.step.spikes import SpikeGuard

if TYPE_CHECKING:  # the same source over lightning.pytorch: the same API for a type checker
    from lightning_amp_plus.data import (
        CIFAR10DataModule,
        IMDBDataModule,
        SyntheticCIFAR10DataModule,
        SyntheticIMDBDataModule,
    )
    from lightning_amp_plus.models import CifarCNN, ImdbLSTM
    from lightning_amp_plus.monitor.callback import MixedPrecisionMonitor
    from lightning_amp_plus.plugins.fsdp import FSDPMixedPrecisionPlugin
    from lightning_amp_plus.plugins.precision import MixedPrecisionPlugin, skipped_steps

__all__ = [
    "CIFAR10DataModule",
    "CifarCNN",
    "DynamicLossScaler",
    "FSDPMixedPrecisionPlugin",
    "IMDBDataModule",
    "ImdbLSTM",
    "MixedPrecisionMonitor",
    "MixedPrecisionPlugin",
    "SpikeGuard",
    "SyntheticCIFAR10DataModule",
    "SyntheticIMDBDataModule",
    "skipped_steps",
]

_HOMES = {
    "CIFAR10DataModule": ("data", "CIFAR10DataModule"),
    "IMDBDataModule": ("data", "IMDBDataModule"),
    "SyntheticCIFAR10DataModule": ("data", "SyntheticCIFAR10DataModule"),
    "SyntheticIMDBDataModule": ("data", "SyntheticIMDBDataModule"),
    "CifarCNN": ("models", "CifarCNN"),
    "ImdbLSTM": ("models", "ImdbLSTM"),
    "MixedPrecisionMonitor": ("monitor.callback", "MixedPrecisionMonitor"),
    "FSDPMixedPrecisionPlugin": ("plugins.fsdp", "FSDPMixedPrecisionPlugin"),
    "MixedPrecisionPlugin": ("plugins.precision", "MixedPrecisionPlugin"),
    "skipped_steps": ("plugins.precision", "skipped_steps"),
}
"""Each name over ``pytorch_lightning``: its module and its name there (loaded on first use, as the package's own
names are)."""


def __getattr__(name: str) -> Any:
    from lightning_amp_plus._standalone import public_name  # here: the finder is installed at the first use

    return public_name(__name__, name, _HOMES)


def __dir__() -> list[str]:
    return sorted(__all__)
