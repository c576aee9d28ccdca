"""The numerics of mixed precision, with torch only (no Lightning, a test checks it): usable in any training loop.

Following one optimizer step: :mod:`~lightning_amp_plus.numerics.engine` (``StepEngine``, the recipe every front end
calls), then :mod:`~lightning_amp_plus.numerics.guard` (check once, skip on inf/NaN, count; the bf16 guard) and
:mod:`~lightning_amp_plus.numerics.scaler` (``DynamicLossScaler``, the fp16 guard with ``torch.amp.GradScaler``'s API),
which call :mod:`~lightning_amp_plus.numerics.grads` (unscale, the global norm, clipping).

* :mod:`~lightning_amp_plus.numerics.policy`, :mod:`~lightning_amp_plus.numerics.device_policy`: the scale policy,
  a small state machine, on the host and on the device.
* :mod:`~lightning_amp_plus.numerics.outcome`: ``Stage`` and ``StepResult``, what one optimizer step did.
* :mod:`~lightning_amp_plus.numerics.pending`: the fused path's device flags, read later in one go.
* :mod:`~lightning_amp_plus.numerics.skips`: the skip count and the diagnosis that stops a run going nowhere.
* :mod:`~lightning_amp_plus.numerics.sharding`: gradients spread over ranks (FSDP, FSDP2).
* :mod:`~lightning_amp_plus.numerics.master`: FP32 master weights for models built in half.
* :mod:`~lightning_amp_plus.numerics.fp32_modules`: modules computing in FP32 inside autocast (``keep_fp32``).
* :mod:`~lightning_amp_plus.numerics.compensated`: compensated bf16 weights (Kahan, stochastic rounding).
* :mod:`~lightning_amp_plus.numerics.autopsy`, :mod:`~lightning_amp_plus.numerics.headroom`,
  :mod:`~lightning_amp_plus.numerics.replay`, :mod:`~lightning_amp_plus.numerics.formats`: where an inf/NaN started,
  per-layer headroom, replaying a batch with nothing left behind, the low-precision formats.
* :mod:`~lightning_amp_plus.numerics.schedulers`: holding LR schedulers still while their optimizer's steps are skipped.
* :mod:`~lightning_amp_plus.numerics.checks`, :mod:`~lightning_amp_plus.numerics.float32`: argument checks, float32
  arithmetic on Python floats.
"""
