"""Data modules for the shipped models: real CIFAR-10 and IMDB, and learnable synthetic stand-ins generated offline.

Names are imported lazily, so that ``import lightning_amp_plus.data`` does not import torchvision until a CIFAR-10
module is used.

Examples:
    >>> from lightning_amp_plus.data import SyntheticCIFAR10DataModule
    >>> SyntheticCIFAR10DataModule.__name__
    'SyntheticCIFAR10DataModule'
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CIFAR10DataModule", "IMDBDataModule", "SyntheticCIFAR10DataModule", "SyntheticIMDBDataModule"]

_HOMES = {
    "CIFAR10DataModule": "lightning_amp_plus.data.cifar",
    "IMDBDataModule": "lightning_amp_plus.data.imdb",
    "SyntheticCIFAR10DataModule": "lightning_amp_plus.data.synthetic",
    "SyntheticIMDBDataModule": "lightning_amp_plus.data.synthetic",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'lightning_amp_plus.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
