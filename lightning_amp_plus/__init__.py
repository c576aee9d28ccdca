"""lightning-amp-plus: fast, observable mixed-precision training for PyTorch Lightning."""

from lightning_amp_plus.monitor import MixedPrecisionMonitor
from lightning_amp_plus.precision import MixedPrecisionPlugin
from lightning_amp_plus.scaler import DynamicLossScaler

__all__ = ["DynamicLossScaler", "MixedPrecisionMonitor", "MixedPrecisionPlugin"]
__version__ = "0.1.0"
