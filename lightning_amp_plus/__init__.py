"""lightning-amp-plus: fast, observable mixed-precision training for PyTorch Lightning.

The public names load on first use (PEP 562): ``import lightning_amp_plus`` alone imports neither torch nor Lightning,
so the ``amp-plus`` command answers ``--help`` at once. ``from lightning_amp_plus import MixedPrecisionPlugin`` works
as usual. A new public name is one line in ``_HOMES`` (where it lives) and one in ``__all__``.

Examples:
    >>> from lightning_amp_plus import DynamicLossScaler
    >>> DynamicLossScaler().get_scale()
    65536.0
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_amp_plus.monitor.callback import MixedPrecisionMonitor
    from lightning_amp_plus.plugins.fsdp import FSDPMixedPrecisionPlugin
    from lightning_amp_plus.plugins.precision import MixedPrecisionPlugin
    from lightning_amp_plus.step.scaler import DynamicLossScaler
    from lightning_amp_plus.step.spikes import SpikeGuard

__all__ = [
    "DynamicLossScaler",
    "FSDPMixedPrecisionPlugin",
    "MixedPrecisionMonitor",
    "MixedPrecisionPlugin",
    "SpikeGuard",
]
__version__ = "0.1.0"

_HOMES = {
    "DynamicLossScaler": "lightning_amp_plus.step.scaler",
    "FSDPMixedPrecisionPlugin": "lightning_amp_plus.plugins.fsdp",
    "MixedPrecisionMonitor": "lightning_amp_plus.monitor.callback",
    "MixedPrecisionPlugin": "lightning_amp_plus.plugins.precision",
    "SpikeGuard": "lightning_amp_plus.step.spikes",
}
"""Each public name and the module it is loaded from on first use."""


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        from importlib import import_module  # here: the package's namespace holds only its public names

        value = getattr(import_module(_HOMES[name]), name)
        globals()[name] = value  # found once; later lookups do not come here
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names and the module's dunder attributes (``__version__``...), not the helpers used to load them."""
    dunders = [name for name in globals() if name.startswith("__") and name.endswith("__")]
    return sorted({*__all__, *dunders})
