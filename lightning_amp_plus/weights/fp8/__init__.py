"""FP8 training on torchao: which Linear layers, converted in place, their casts read, and a fallback to bf16.

torch and torchao only (torchao is imported when a model is converted, never when this package is imported):

* :mod:`~lightning_amp_plus.weights.fp8.training`: :class:`FP8Training`, all of it for one run, and everything a
  training step runs beyond bf16-mixed: the forward a converted layer gains (input cast off CUDA, evaluation under
  inference mode, non-finite flags, readings on check steps);
* :mod:`~lightning_amp_plus.weights.fp8.options`: the options, checked;
* :mod:`~lightning_amp_plus.weights.fp8.convert`: eligibility, conversion in place, fallback to a never-converted layer;
* :mod:`~lightning_amp_plus.weights.fp8.casts`: the casts a recipe makes, and what one does to a tensor;
* :mod:`~lightning_amp_plus.weights.fp8.readings`: flushed and subnormal shares per layer and cast, on check steps;
* :mod:`~lightning_amp_plus.weights.fp8.nonfinite`: which layers met a NaN or inf, the origin first;
* :mod:`~lightning_amp_plus.weights.fp8.fallback`: the rule that sends a layer back to bf16.
"""

from lightning_amp_plus.weights.fp8.convert import RECIPES, eligible, fall_back
from lightning_amp_plus.weights.fp8.fallback import FallbackRule
from lightning_amp_plus.weights.fp8.readings import CastReading
from lightning_amp_plus.weights.fp8.training import FP8Check, FP8Training, convert_in_place

__all__ = [
    "RECIPES",
    "CastReading",
    "FP8Check",
    "FP8Training",
    "FallbackRule",
    "convert_in_place",
    "eligible",
    "fall_back",
]
