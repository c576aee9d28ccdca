"""What the weights are held in, with torch only.

FP32 masters for a model built in half (:mod:`~lightning_amp_plus.weights.master`), modules computing in FP32 inside
autocast (:mod:`~lightning_amp_plus.weights.fp32_modules`), and compensated bf16 weights
(:mod:`~lightning_amp_plus.weights.compensated`: Kahan summation, stochastic rounding).
"""
