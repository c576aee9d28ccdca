"""The Fabric plugins for ``import lightning_fabric``: ``lightning_fabric.Fabric(plugins=[MixedPrecisionPlugin()])``.

``lightning_fabric`` is Lightning's standalone Fabric package (installed beside ``lightning`` with
``pytorch_lightning``): the same Fabric as ``lightning.fabric``, with its own copy of every class, so it refuses the
plugins of :mod:`lightning_amp_plus.fabric`, which are built on ``lightning.fabric``'s. The names here are the same
plugins built from the same source over ``lightning_fabric``: they behave as the ``lightning`` ones do, and the same
tests run on both. The monitor's :meth:`~lightning_amp_plus.MixedPrecisionMonitor.observe` reads either.

Examples:
    >>> from lightning_amp_plus.lightning_fabric import MixedPrecisionPlugin
    >>> import lightning_fabric
    >>> isinstance(MixedPrecisionPlugin("bf16-mixed", "cpu"), lightning_fabric.plugins.Precision)
    True

Mixing the namespaces is refused by Fabric with a message naming the import to use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same source over lightning.fabric: the same API for a type checker
    from lightning_amp_plus.plugins.fsdp import FabricFSDPMixedPrecisionPlugin as FSDPMixedPrecisionPlugin
    from lightning_amp_plus.plugins.precision import FabricMixedPrecisionPlugin as MixedPrecisionPlugin

__all__ = ["FSDPMixedPrecisionPlugin", "MixedPrecisionPlugin"]

_HOMES = {
    "FSDPMixedPrecisionPlugin": ("plugins.fsdp", "FabricFSDPMixedPrecisionPlugin"),
    "MixedPrecisionPlugin": ("plugins.precision", "FabricMixedPrecisionPlugin"),
}
"""Each name over ``lightning_fabric``: its module and its class there (loaded on first use)."""


def __getattr__(name: str) -> Any:
    from lightning_amp_plus._standalone import public_name  # here: the finder is installed at the first use

    return public_name(__name__, name, _HOMES)


def __dir__() -> list[str]:
    return sorted(__all__)
