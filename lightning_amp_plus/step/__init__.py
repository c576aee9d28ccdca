"""The step core: the numerics of one optimizer step, with torch only (no Lightning; a test checks it).

Following one step: :mod:`~lightning_amp_plus.step.engine` (``StepEngine``, the recipe every front end calls) drives
the guard of :mod:`~lightning_amp_plus.step.guard` (check once, skip on inf/NaN, count) and, for fp16,
:mod:`~lightning_amp_plus.step.scaler` (``DynamicLossScaler``, ``torch.amp.GradScaler``'s API), which call the passes
of :mod:`~lightning_amp_plus.step.grads` (unscale, the global norm, clipping). Beside them: the scale policy
(:mod:`~lightning_amp_plus.step.policy`, and :mod:`~lightning_amp_plus.step.device_policy` on the device), the fused
path's unread device values (:mod:`~lightning_amp_plus.step.pending`), what a step did
(:mod:`~lightning_amp_plus.step.outcome`), the skip limit (:mod:`~lightning_amp_plus.step.skips`), gradients spread
over ranks (:mod:`~lightning_amp_plus.step.sharding`), LR schedulers held while steps are skipped
(:mod:`~lightning_amp_plus.step.schedulers`) and float32 arithmetic on host numbers
(:mod:`~lightning_amp_plus.step.float32`).
"""
