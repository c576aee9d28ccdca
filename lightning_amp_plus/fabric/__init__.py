"""Lightning Fabric front ends: ``L.Fabric(plugins=[lightning_amp_plus.fabric.MixedPrecisionPlugin()])``.

:class:`MixedPrecisionPlugin` for Fabric's single-device and DDP strategies (and ``ModelParallelStrategy``),
:class:`FSDPMixedPrecisionPlugin` for Fabric's ``FSDPStrategy``. Both hold the same step engine as the Trainer's
plugins.
"""

from lightning_amp_plus.fabric.fsdp import FSDPMixedPrecisionPlugin
from lightning_amp_plus.fabric.precision import MixedPrecisionPlugin

__all__ = ["FSDPMixedPrecisionPlugin", "MixedPrecisionPlugin"]
