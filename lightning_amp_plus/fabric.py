"""Lightning Fabric front ends: ``L.Fabric(plugins=[lightning_amp_plus.fabric.MixedPrecisionPlugin()])``.

:class:`MixedPrecisionPlugin` for Fabric's single-device and DDP strategies (and ``ModelParallelStrategy``),
:class:`FSDPMixedPrecisionPlugin` for Fabric's ``FSDPStrategy``. Both hold the same step engine as the Trainer's
plugins.
"""

from lightning_amp_plus.plugins.fabric import MixedPrecisionPlugin
from lightning_amp_plus.plugins.fabric_fsdp import FSDPMixedPrecisionPlugin

__all__ = ["FSDPMixedPrecisionPlugin", "MixedPrecisionPlugin"]
