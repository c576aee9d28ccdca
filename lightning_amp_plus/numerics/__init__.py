"""The numerics of mixed precision, with torch only (no Lightning, a test checks it): usable in any training loop.

* :mod:`~lightning_amp_plus.numerics.scaler`: ``DynamicLossScaler``, the loss scaler (``torch.amp.GradScaler``'s API).
* :mod:`~lightning_amp_plus.numerics.policy`, :mod:`~lightning_amp_plus.numerics.device_policy`: the scale policy,
  a small state machine, on the host and on the device.
* :mod:`~lightning_amp_plus.numerics.outcome`: what one optimizer step did, read lazily.
* :mod:`~lightning_amp_plus.numerics.grads`: the passes over gradients (unscale, check, norm, clip).
* :mod:`~lightning_amp_plus.numerics.master`: FP32 master weights with half copies for forward and backward.
* :mod:`~lightning_amp_plus.numerics.schedulers`: holding LR schedulers still while their optimizer's steps are skipped.
* :mod:`~lightning_amp_plus.numerics.checks`, :mod:`~lightning_amp_plus.numerics.float32`: argument checks, float32
  arithmetic on Python floats.
"""
