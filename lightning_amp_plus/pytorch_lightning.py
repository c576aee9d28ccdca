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
    "CIFAR10DataModule": "data",
    "IMDBDataModule": "data",
    "SyntheticCIFAR10DataModule": "data",
    "SyntheticIMDBDataModule": "data",
    "CifarCNN": "models",
    "ImdbLSTM": "models",
    "MixedPrecisionMonitor": "monitor.callback",
    "FSDPMixedPrecisionPlugin": "plugins.fsdp",
    "MixedPrecisionPlugin": "plugins.precision",
    "skipped_steps": "plugins.precision",
}
"""Each name over ``pytorch_lightning``, and its module (loaded on first use, as the package's own names are)."""


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        from importlib import import_module

        value = getattr(import_module(f"lightning_amp_plus._standalone.{_HOMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
