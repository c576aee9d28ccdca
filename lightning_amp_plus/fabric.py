"""Lightning Fabric front ends: ``L.Fabric(plugins=[lightning_amp_plus.fabric.MixedPrecisionPlugin()])``.

:class:`MixedPrecisionPlugin` for Fabric's single-device and DDP strategies (and ``ModelParallelStrategy``),
:class:`FSDPMixedPrecisionPlugin` for Fabric's ``FSDPStrategy``. They are the plugins the Trainer's are built on: the
Trainer's ``lightning_amp_plus.MixedPrecisionPlugin`` is this one plus the Trainer's hooks.
"""

from lightning_amp_plus.plugins.fsdp import FabricFSDPMixedPrecisionPlugin as FSDPMixedPrecisionPlugin
from lightning_amp_plus.plugins.precision import FabricMixedPrecisionPlugin as MixedPrecisionPlugin

__all__ = ["FSDPMixedPrecisionPlugin", "MixedPrecisionPlugin"]
