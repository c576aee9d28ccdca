"""The step core: the numerics of one optimizer step, with torch only (no Lightning; a test checks it).

Following one step: :mod:`~lightning_amp_plus.step.engine` (``StepEngine``, the recipe every front end calls: check
once, skip on inf/NaN, count, and what a step did, ``StepResult`` or ``PendingStep``), held by every plugin and by
:mod:`~lightning_amp_plus.step.scaler` (``DynamicLossScaler``, ``torch.amp.GradScaler``'s API over the engine); the
passes made when something reads the norm are in :mod:`~lightning_amp_plus.step.grads` (the global norm, clipping).
Beside them: the loss scale's state machine (:mod:`~lightning_amp_plus.step.policy`), the fused path's values on their
way to host memory (:mod:`~lightning_amp_plus.step.pending`), the skip limit's diagnosis
(:mod:`~lightning_amp_plus.step.skips`), gradients spread over ranks (:mod:`~lightning_amp_plus.step.sharding`), LR
schedulers held while steps are skipped (:mod:`~lightning_amp_plus.step.schedulers`), the spike guard
(:mod:`~lightning_amp_plus.step.spikes`), objects kept per optimizer (:mod:`~lightning_amp_plus.step.positions`) and
float32 arithmetic on host numbers (:mod:`~lightning_amp_plus.step.float32`).
"""
