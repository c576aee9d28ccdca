"""``StepEngine``: the numerics of one optimizer step, held by every front end and by ``DynamicLossScaler``.

A front end adapts its framework's hooks; the engine does the step, in the order of the recipe:

1. :meth:`StepEngine.scale_loss`: multiply the loss by the loss scale (fp16) before backward;
2. :meth:`StepEngine.prepare`: unscale, check and measure the gradients, once per optimizer step (the step's one host
   read); skipped when nothing before the step reads them, so that a fused optimizer unscales in its own kernel;
3. :meth:`StepEngine.clip_by_norm` / :meth:`StepEngine.clip_by_value`: clip with the norm already measured;
4. :meth:`StepEngine.step`: step, or skip when the gradients hold inf/NaN; record one
   :class:`~.outcome.StepResult`; stop a run that cannot make progress (:class:`~.outcome.SkipCounter`);
5. :meth:`StepEngine.end_batch`: move the loss scale once for every optimizer stepped since the last call.

One optimizer's gradients go through three stages per iteration (:class:`Stage`), and two paths lead through
``step()``:

* the **unscale path** (clipping, hooks that read gradients, any optimizer): the unscale (:func:`~.grads.multiply_`),
  then the global norm (:func:`~.grads.global_norm`), read on the host: the overflow check, the clipping norm and the
  monitored norm in one number; the step is taken or skipped on the host. A step that nothing clips or reads before,
  whose norm nobody asked for (``measure_norm``: a monitor, a spike guard), is checked in GradScaler's one pass
  instead (:func:`~.grads.unscale_checked_`), and measures no norm;
* the **fused path** (``Adam/AdamW/SGD/Adagrad(fused=True)`` stepped with no ``prepare`` first): one read-only pass
  measures the still-scaled gradients, the scale and the overflow flag go to the optimizer as ``grad_scale`` /
  ``found_inf``, its kernel divides and skips on the device, and the step's values wait on the device
  (:class:`~.outcome.PendingReads`) until something reads them: no host read in the step.

Examples:
    >>> from torch import nn
    >>> from lightning_amp_plus.step.policy import LossScale, ScalePolicy
    >>> model = nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> engine = StepEngine(LossScale(ScalePolicy(256.0, 2.0, 0.5, 2000, 1, 1.0, 2.0**24)))
    >>> engine.scale_loss(model(torch.ones(1, 2)).sum()).backward()
    >>> engine.prepare(opt); norm = engine.clip_by_norm(opt, 1.0); _ = engine.step(opt); engine.end_batch()
    >>> engine.recent_steps[-1].skipped, engine.skipped_steps
    (False, 0)
"""

from __future__ import annotations

import enum
import inspect
import math
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_amp_plus._checks import is_int, read_count, require
from lightning_amp_plus.step import fused, schedulers
from lightning_amp_plus.step.float32 import f32
from lightning_amp_plus.step.grads import checked_norm, clip_by_norm_, measure, unscale_checked_
from lightning_amp_plus.step.outcome import (
    BF16_STALL,
    PENDING_MAX,
    SPIKE_STALL,
    PendingReads,
    SkipCounter,
    Stall,
    StepResult,
)
from lightning_amp_plus.step.policy import LossScale
from lightning_amp_plus.step.sharding import Sharding, local_views
from lightning_amp_plus.step.spikes import SpikeGuard, SpikeGuards
from lightning_amp_plus.weights.compensated import Compensators, Method

__all__ = ["Stage", "StepEngine"]

_RECENT_STEPS = 1024
# The loss scale's constants in a scaler state: a saved state with others than this engine's gets a warning.
_CONSTANTS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "max_scale",
              "max_consecutive_skips")  # fmt: skip
# Devices whose kernels take GradScaler's fused protocol (and where the scale policy can run on the device).
_FUSED_DEVICE_TYPES = ("cpu", "cuda")
_TAKES_GRAD_SCALER: dict[type, bool] = {}


class Stage(enum.Enum):
    """Where one optimizer's gradients are between two ``end_batch()`` calls (GradScaler's ``OptState``).

    * ``READY``: nothing done yet this iteration; the gradients are as backward left them (scaled).
    * ``UNSCALED``: unscaled, checked and measured once (``prepare``); clipping may still change them.
    * ``STEPPED``: stepped or skipped; nothing more until ``end_batch()``.
    """

    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclass(eq=False)
class _Pass:
    """One optimizer's gradients in the current iteration: its stage, the parameters checked, the step's result."""

    stage: Stage = Stage.READY
    params: list[Tensor] = field(default_factory=list)
    result: StepResult = field(default_factory=StepResult)


class StepEngine:
    """Scale, check once, clip, step or skip, update once, record (see the module docstring).

    Args:
        loss_scale: the fp16 loss scale, or ``None`` (bf16: nothing to scale).
        check: check each step's gradients and skip on inf/NaN (always, with a loss scale); ``False`` steps blindly.
        max_consecutive_skips: stuck skips in a row after which ``step()`` (or ``end_batch()`` on the fused path)
            raises ``FloatingPointError`` with a diagnosis; ``None`` never.
        compensation: ``"kahan"`` or ``"stochastic"`` to step bf16 weights with compensated updates, ``None`` for the
            optimizers' own steps.
        seed: the seed of the stochastic-rounding streams.
        spike_guard: judge each finite gradient norm (:mod:`~.spikes`): skip a spike (counted, the scale left alone)
            or clip it before any clip of the user's; one guard per optimizer. Needs the check; no fused path.
        measure_norm: measure every check's norm (``StepResult.grad_norm``), as a monitor asks; ``False``: a step that
            nothing clips or reads before is checked in GradScaler's one pass, no norm measured (``grad_norm`` None).

    Attributes:
        held_schedulers: the LR schedulers held still while their optimizer's steps are skipped (``hold``,
            ``release``, ``held_steps``), and the ledger of steps they consult.
        process_group: a ``torch.distributed`` process group over which every rank takes the same skip decision (the
            norm is reduced with MAX; the plugins set it under DDP).
        sharding: set when the gradients are sharded (FSDP, FSDP2): one SUM all-reduce of each rank's weighted squared
            norms gives the global norm and the skip decision everywhere (:mod:`~.sharding`). Replaces the MAX.
        recent_steps: the last optimizer steps' results, newest last (1024 kept).
        spike_guards: each optimizer's :class:`~.spikes.SpikeGuard` (``None`` without a guard).

    State (besides those): each optimizer's pass this iteration, the skip counter, the fused steps not counted yet, the
    count of steps recorded, the optimizers' positions, the parameters' names, the compensators.
    """

    def __init__(
        self,
        loss_scale: LossScale | None = None,
        *,
        check: bool = True,
        max_consecutive_skips: int | None = 50,
        compensation: Method | None = None,
        seed: int = 0,
        spike_guard: SpikeGuard | None = None,
        measure_norm: bool = False,
    ) -> None:
        self.loss_scale = loss_scale
        self.measure_norm = measure_norm
        self.check = check or loss_scale is not None
        require(spike_guard is None or self.check, "spike_guard", spike_guard,
                "needs the gradients checked: drop check=False, or the guard", "StepEngine")  # fmt: skip
        self.spike_guards = None if spike_guard is None else SpikeGuards(spike_guard)
        self.process_group: Any = None
        self.sharding: Sharding | None = None
        self.recent_steps: deque[StepResult] = deque(maxlen=_RECENT_STEPS)
        self._recorded = 0
        self._passes: dict[int, _Pass] = {}
        self._skips = SkipCounter(_skip_limit(max_consecutive_skips))  # the limit lives in the counter
        self._fused = PendingReads()
        self._positions: dict[int, int] = {}
        self._names: dict[int, str] = {}
        self.held_schedulers = schedulers.SchedulerHold()
        self.compensators = None if compensation is None else Compensators(compensation, seed)

    # ------------------------------------------------------------------------------------------------ set-up
    @property
    def max_consecutive_skips(self) -> int | None:
        """Stuck skips in a row that stop the run (``None``: never)."""
        return self._skips.limit

    @max_consecutive_skips.setter
    def max_consecutive_skips(self, value: int | None) -> None:
        self._skips.limit = _skip_limit(value)

    def set_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Number the optimizers as the front end lists them (``StepResult.optimizer``), each as :meth:`track` does."""
        self._positions = {}
        for optimizer in optimizers:
            self.track(optimizer)

    def track(self, optimizer: Optimizer) -> None:
        """Number ``optimizer`` after those known (if it is new); make its compensator if compensating.

        Raises:
            TypeError: with compensation, an optimizer the compensated update does not implement, before any step.
        """
        position = self._position(optimizer)
        if self.compensators is not None:
            self.compensators.of(_innermost(optimizer), position)

    def name_parameters(self, named: nn.Module | Iterable[tuple[str, Tensor]]) -> None:
        """What to call each parameter in diagnostics (a module, or ``named_parameters()`` pairs).

        Without names, parameters are called by their place in the optimizer, e.g. ``param_groups[0][3]``.
        """
        pairs = named.named_parameters() if isinstance(named, nn.Module) else named
        self._names = {id(param): name for name, param in pairs}

    def take_over(self, previous: StepEngine) -> None:
        """Continue where ``previous`` left off (a plugin's scaler replaced).

        Its optimizers, names, ranks, held schedulers, compensators, spike guards, ``measure_norm`` and recent results
        carry over; the skip counts and the scale stay this engine's own.
        """
        self.process_group, self.sharding = previous.process_group, previous.sharding
        self._positions, self._names = dict(previous._positions), dict(previous._names)
        self.held_schedulers, self.compensators = previous.held_schedulers, previous.compensators
        self.spike_guards, self.measure_norm = previous.spike_guards, previous.measure_norm
        self.recent_steps, self._recorded = previous.recent_steps, previous._recorded

    # -------------------------------------------------------------------------------------------- the recipe
    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call ``backward()`` on: multiplied by the loss scale under fp16, as it is otherwise."""
        return loss if self.loss_scale is None else loss * self.loss_scale.tensor(loss.device)

    def prepare(self, optimizer: Optimizer, *, exact: bool = True) -> None:
        """Unscale, check and measure ``optimizer``'s gradients (once per step; a second call does nothing).

        Args:
            optimizer: the optimizer whose gradients to prepare.
            exact: measure the norm as ``clip_grad_norm_`` does, bit for bit (a clip may follow; a second read of the
                gradients); ``False`` when nothing clips: one pass, which measures as it unscales (within float32
                rounding) under ``measure_norm`` or a guard, and else measures none (as :meth:`step` checks itself).

        Raises:
            RuntimeError: ``optimizer`` already stepped this iteration (call ``end_batch()`` first).
        """
        if not self.check:
            return
        step = self._pass(optimizer)
        if step.stage is Stage.STEPPED:
            raise RuntimeError("`unscale_()` was called after `step()` for this optimizer: call `update()` first.")
        if step.stage is Stage.READY:
            self._check(optimizer, step, _params_with_grads(optimizer), exact)

    def clip_by_norm(self, optimizer: Optimizer, max_norm: float) -> float:
        """Clip to a global norm of ``max_norm`` with the measured norm (``clip_grad_norm_``'s result, bit for bit).

        Nothing is multiplied on a step that will be skipped, nor when the norm is under the limit.

        Returns:
            The norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` returns it.
        """
        if not isinstance(max_norm, int | float) or isinstance(max_norm, bool) or not 0 < max_norm < math.inf:
            raise ValueError(f"`clip_grad_norm_(max_norm={max_norm!r})` must be a finite number > 0.")
        if not self.check:
            return float(torch.nn.utils.clip_grad_norm_(_params(optimizer), max_norm))
        self.prepare(optimizer)
        step = self._pass(optimizer)
        norm = step.result.grad_norm
        assert norm is not None  # measured by the check
        if not step.result.skipped:
            grads = [p.grad for p in step.params if p.grad is not None]
            clip_by_norm_(grads if self.sharding is None else local_views(grads), norm, max_norm)
        return norm

    def clip_by_value(self, optimizer: Optimizer, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]``; nothing on a step that will be skipped."""
        params = [param for param in self.main_params(optimizer) if param.grad is not None]
        if params:  # torch's clip_grad_value_ fails on an empty list (no backward reached the parameters)
            torch.nn.utils.clip_grad_value_(params, clip_value)

    def main_params(self, optimizer: Optimizer) -> list[Tensor]:
        """The parameters whose gradients may be clipped (checked first): none on a step that will be skipped."""
        self.prepare(optimizer)
        return [] if self.found_inf(optimizer) else list(_params(optimizer))

    def found_inf(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were found non-finite this iteration (``False`` before a check)."""
        step = self._passes.get(_key(optimizer))
        return step is not None and step.stage is not Stage.READY and step.result.skipped

    def step(self, optimizer: Optimizer, apply: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Step ``optimizer`` (or run ``apply`` in its place) unless its gradients hold inf/NaN; record the result.

        Returns:
            What the step returned, or ``None`` when it was skipped on the host.

        Raises:
            FloatingPointError: the skip limit was reached.
        """
        if "closure" in kwargs:
            raise ValueError(
                "`step(optimizer, closure=...)`: closures are not supported, because the gradients must be checked "
                "before the step. Run the closure yourself, then call `step(optimizer)`."
            )
        if apply is None and self.compensators is not None:
            apply = self.compensators.of(_innermost(optimizer), self._position(optimizer)).step
        if not self.check:
            self._record(optimizer, StepResult.known(skipped=False))
            return optimizer.step(**kwargs) if apply is None else apply()
        step = self._pass(optimizer)
        if step.stage is Stage.STEPPED:
            raise RuntimeError("`step()` was already called for this optimizer: call `update()` first.")
        if step.stage is Stage.READY:
            params = _params_with_grads(optimizer)
            if apply is None and self.spike_guards is None and _takes_fused_path(optimizer, params):
                return self._step_fused(optimizer, step, params, kwargs)
            self._check(optimizer, step, params, exact=False)  # checked here: nothing clips after this
        if self._fused.entries:
            self._count(self._fused.take())  # a limit the fused steps before this one reached
        step.stage = Stage.STEPPED
        self._record(optimizer, step.result)
        if self._skips.count(step.result):
            self._passes.pop(_key(optimizer), None)  # an update() after the error does not count this step
            raise FloatingPointError(self._skips.diagnosis(step.result, self._stall(step.result)))
        if step.result.skipped:
            return None
        stepped = optimizer.step(**kwargs) if apply is None else apply()
        if self.spike_guards is not None and step.result.spike_verdict is not None:
            self.spike_guards.of(self._position(optimizer)).observe(step.result.spike_verdict)
        return stepped

    def end_batch(self, new_scale: float | None = None) -> None:
        """End the iteration: move the loss scale once for every optimizer stepped since the last call.

        Args:
            new_scale: set the scale to this value instead of moving it by the policy (clamped by the caller).

        Raises:
            FloatingPointError: the skip limit was reached by fused steps (learnt here, when it could be).
        """
        results = [step.result for step in self._passes.values() if step.stage is not Stage.READY]
        if self.spike_guards is not None:  # a skipped spike leaves the scale as it was: as if its batch was not seen
            results = [r for r in results if r.spike_verdict is None or r.spike_verdict.action != "skip"]
        self._passes = {}
        pending = len(self._fused.entries)
        if pending and (pending >= PENDING_MAX or self._skips.due_within(pending)):
            self._count(self._fused.take())
        if self.loss_scale is None or (not results and new_scale is None):
            return
        if new_scale is not None:
            self.loss_scale.set(new_scale)
        elif not self._fused.entries and not self.loss_scale.on_device:  # every flag known on the host
            self.loss_scale.update(any(result.skipped for result in results))  # overflows: spike skips left out
        else:  # a flag still on the device, or the scale's state there: the update stays there (no host read)
            flags = self._fused.flags_of(results)  # the iteration's unread flags, a 1.0 for an overflow already read
            self.loss_scale.advance(flags[0] if len(flags) == 1 else torch.stack(flags).amax())

    def discard(self, optimizer: Optimizer) -> None:
        """Forget a check made for a step that does not happen after all (the next one checks afresh)."""
        step = self._passes.get(_key(optimizer))
        if step is not None and step.stage is not Stage.STEPPED:
            del self._passes[_key(optimizer)]

    # --------------------------------------------------------------------------------------------- readings
    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped since the start (restored from checkpoints; reads fused steps' values)."""
        if not self._fused.entries:
            return self._skips.skipped
        return self._skips.with_counted(self._fused.results()).skipped

    def result(self, optimizer: Optimizer) -> StepResult | None:
        """The result of ``optimizer``'s latest step (``None`` before its first)."""
        position = self._positions.get(_key(optimizer))
        return next((result for result in reversed(self.recent_steps) if result.optimizer == position), None)

    # ------------------------------------------------------------------------------------------- checkpoints
    def scaler_state_dict(self) -> dict[str, Any]:
        """The loss scale's state and the skip counters, in plain Python numbers (a ``DynamicLossScaler``'s state).

        Without a loss scale, the counters alone (under the same keys).
        """
        skips = self._skips.with_counted(self._fused.results()) if self._fused.entries else self._skips
        if self.loss_scale is None:
            return skips.counters()
        return {**self.loss_scale.state_dict(), "max_consecutive_skips": self.max_consecutive_skips, **skips.counters()}

    def load_scaler_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`scaler_state_dict` (or a ``torch.amp.GradScaler`` state): scale, trackers, skip counters.

        The constants this engine was built with stay in force; if the saved ones differ, a warning says which.

        Raises:
            TypeError: the state is not a mapping, or a value has the wrong type.
            ValueError: a key is missing or a value is out of range.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"A scaler state's `load_state_dict` expects a dict, got {type(state).__name__}.")
        counters = {key: read_count(state, key, 0) for key in self._skips.counters()}
        if self.loss_scale is not None:
            self.loss_scale.load_state_dict(state)
            _warn_if_built_otherwise(state, self.scaler_state_dict())
        self._passes, self._fused = {}, PendingReads()
        self._skips.restore(counters)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, the scheduler steps held and, with compensation, each optimizer's compensator state."""
        state = {"held_scheduler_steps": self.held_schedulers.held_steps, "scaler": self.scaler_state_dict()}
        if self.compensators is not None:
            state["compensation"] = self.compensators.state_dict()
        if self.spike_guards is not None:
            state["spike_guard"] = self.spike_guards.state_dict()
        return state

    def load_state_dict(
        self, scaler: Mapping[str, Any], held_scheduler_steps: int, compensation: Any = None, spike_guard: Any = None
    ) -> None:
        """Restore :meth:`state_dict`'s parts (a compensator or guard not made yet gets its state when it is).

        A spike guard state is loaded only into an engine with a guard (without one, nothing judges norms).
        """
        self.load_scaler_state_dict(scaler)
        self.held_schedulers.ledger.held_steps = held_scheduler_steps
        if compensation is not None and self.compensators is not None:
            self.compensators.load_state_dict(compensation)
        if spike_guard is not None and self.spike_guards is not None:
            self.spike_guards.load_state_dict(spike_guard)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle between iterations only (as GradScaler): device values are read, parameter references dropped."""
        if self._passes:
            raise RuntimeError("A step engine can be pickled only between iterations: before `scale()` or after "
                               "`update()`.")  # fmt: skip
        for result in [*self._fused.results(), *self.recent_steps]:
            _ = result.overflow_params  # names looked up now: the lookup holds parameters of this process
        state = self.__dict__.copy()
        state.update(_skips=self._skips.with_counted(self._fused.results()), _fused=PendingReads(), _names={})
        return state

    # -------------------------------------------------------------------------------------------- the checks
    def _check(self, optimizer: Optimizer, step: _Pass, params: list[Tensor], exact: bool = True) -> None:
        """The unscale path's pass: unscale, check and, if asked or needed, measure ``params``' gradients; 1 host read.

        ``exact``: the norm is ``clip_grad_norm_``'s bit for bit (a clip may follow: a second read after the unscale);
        otherwise one cache-hot pass measures as it unscales, or, if nothing reads the norm, GradScaler's checks.
        """
        policy = None if self.loss_scale is None else self.loss_scale.settle()
        grads = [p.grad for p in params if p.grad is not None]
        inv_scale = None if policy is None else f32(1.0 / policy.scale)  # rounded once to float32, as GradScaler's
        norm: float | None = None
        if exact or self.measure_norm or self.spike_guards is not None:
            norm = checked_norm(grads, inv_scale, exact, self.sharding, self.process_group)
            # Finite values can square past float32: only inf/NaN skip, as unmeasured (a guard: skipped, no number).
            overflow = not math.isfinite(norm) and (
                self.spike_guards is not None or unscale_checked_(grads, 1.0, self.sharding, self.process_group)
            )
        else:  # nothing reads the norm: GradScaler's one pass checks as it unscales (bf16, no inverse: by exactly 1.0)
            overflow = unscale_checked_(grads, inv_scale or 1.0, self.sharding, self.process_group)
        verdict = None
        if self.spike_guards is not None and norm is not None and not overflow:  # measured, finite
            verdict = self.spike_guards.of(self._position(optimizer)).judge(norm)
            if verdict.action == "clip":  # before any clip of the user's, which then measures the clipped gradients
                norm = _clip_spike(grads, norm if exact else None, verdict.threshold_norm, self)
        skipped = overflow or (verdict is not None and verdict.action == "skip")
        backs_off = overflow and policy is not None and policy.backs_off_on_overflow()
        scale = None if policy is None else policy.scale
        step.result.settle(skipped=skipped, scale=scale, grad_norm=norm, backs_off=backs_off, verdict=verdict)
        if overflow:  # named now, while the gradients are there (a skipped step is rare: the lookup costs a pass)
            step.result._names = _nonfinite_names(self, optimizer, [p for p in params if p.grad is not None], None)
        step.params, step.stage = params, Stage.UNSCALED

    def _step_fused(self, optimizer: Optimizer, step: _Pass, params: list[Tensor], kwargs: dict[str, Any]) -> Any:
        """The fused path (:mod:`~.fused`): a read-only measure, the flag and the scale to the kernel, no host read."""
        grads = [p.grad for p in params if p.grad is not None]
        device = grads[0].device
        zero, one = self._fused.flags(device)
        norms, total = fused.measure_scaled(grads, self.sharding, self.process_group, device)
        flag = torch.where(torch.isfinite(total), zero, one)  # exactly 1.0 or 0.0
        step.stage, step.params = Stage.STEPPED, params
        # The names are looked up later (on request), after zero_grad: the owners of the measured norms are kept now.
        step.result._namer = lambda: _nonfinite_names(self, optimizer, params, norms)
        if self.loss_scale is None:
            self._fused.add(step.result, torch.stack([flag, total]), None)
        else:
            values = torch.cat([flag.reshape(1), total.reshape(1), self.loss_scale.step_values()])
            self._fused.add(step.result, values, self.loss_scale.backs_off)
        self._record(optimizer, step.result)
        scale = None if self.loss_scale is None else self.loss_scale.tensor(device)
        return fused.step_with_flags(optimizer, _innermost(optimizer), scale, flag, kwargs)

    def uses_fused_path(self, optimizer: Optimizer) -> bool:
        """Whether :meth:`step` would now take the fused path for ``optimizer`` (the optimizer unscales itself)."""
        step = self._passes.get(_key(optimizer))
        if not self.check or self.spike_guards is not None or (step is not None and step.stage is not Stage.READY):
            return False
        return _takes_fused_path(optimizer, _params_with_grads(optimizer))

    # -------------------------------------------------------------------------------------- counts, records
    def _count(self, results: list[StepResult]) -> None:
        """Count ``results`` in order; at the limit, raise the diagnosis."""
        for result in results:
            if self._skips.count(result):
                raise FloatingPointError(self._skips.diagnosis(result, self._stall(result)))

    def _stall(self, result: StepResult) -> Stall:
        if result.spike_verdict is not None:
            return SPIKE_STALL
        return BF16_STALL if self.loss_scale is None else self.loss_scale.stall(result.scale)

    def _record(self, optimizer: Optimizer, result: StepResult) -> None:
        key = id(_innermost(optimizer))
        result.index, result.optimizer = self._recorded, self._positions.setdefault(key, len(self._positions))
        self._recorded += 1
        self.recent_steps.append(result)
        if self.held_schedulers.schedulers:  # a held scheduler asks its optimizer's steps (only then are they noted)
            self.held_schedulers.ledger.record_outcome(optimizer, result)

    def _position(self, optimizer: Optimizer) -> int:
        return self._positions.setdefault(_key(optimizer), len(self._positions))

    def _pass(self, optimizer: Optimizer) -> _Pass:
        key = id(_innermost(optimizer))  # get first: building a _Pass (and its StepResult) at every call costs ~10 µs
        return self._passes.get(key) or self._passes.setdefault(key, _Pass())


# ------------------------------------------------------------------------------------------------------- helpers
def _clip_spike(grads: list[Tensor], exact_norm: float | None, limit: float, engine: StepEngine) -> float:
    """Clip ``grads`` as ``clip_grad_norm_(max_norm=limit)`` does, bit for bit; return the clipped gradients' norm.

    ``exact_norm``: their norm as ``clip_grad_norm_`` takes it, or ``None`` to measure it (the check measured within
    float32 rounding). A spike is rare: the passes cost nothing over a run.
    """
    if exact_norm is None:
        exact_norm = checked_norm(grads, None, True, engine.sharding, engine.process_group)
    clip_by_norm_(grads if engine.sharding is None else local_views(grads), exact_norm, limit)
    return checked_norm(grads, None, True, engine.sharding, engine.process_group)


def _skip_limit(value: int | None) -> int | None:
    require(value is None or (is_int(value) and value >= 1), "max_consecutive_skips", value,
            "must be an int >= 1, or None to never stop")  # fmt: skip
    return None if value is None else int(value)


def _warn_if_built_otherwise(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Say which constants a loaded scaler state was built with that differ from this engine's (which stay)."""
    differing = {key: saved[key] for key in _CONSTANTS if key in saved and saved[key] != mine[key]}
    if differing:
        warnings.warn(
            f"The saved scaler was built with {differing}; this one keeps its own "
            f"{ {key: mine[key] for key in differing} }.",
            stacklevel=4,
        )


def _nonfinite_names(engine: StepEngine, optimizer: Optimizer, owners: list[Tensor], norms: Tensor | None) -> list[str]:
    """The names of ``owners`` whose gradient norm is non-finite (a host read, made only for a skipped step)."""
    with torch.no_grad():
        if norms is None:
            grads = [p.grad for p in owners if p.grad is not None]
            norms = measure(grads if engine.sharding is None else local_views(grads), grads[0].device)
    bad = set(torch.nonzero(~torch.isfinite(norms)).flatten().tolist())
    groups = optimizer.param_groups
    places = {id(p): f"param_groups[{g}][{i}]" for g, grp in enumerate(groups) for i, p in enumerate(grp["params"])}
    return [engine._names.get(id(p), places.get(id(p), "?")) for i, p in enumerate(owners) if i in bad]


def _params(optimizer: Optimizer) -> Iterable[Tensor]:
    return (param for group in optimizer.param_groups for param in group["params"])


def _params_with_grads(optimizer: Optimizer) -> list[Tensor]:
    params = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.is_sparse and param.grad.dtype == torch.float16:
                # As GradScaler: duplicates of scaled fp16 values may overflow when summed, so check them summed.
                param.grad = param.grad.coalesce()
            params.append(param)
    return params


def _takes_fused_path(optimizer: Optimizer, params: list[Tensor]) -> bool:
    """Whether ``optimizer`` can unscale and skip inside its own kernel, safely, this step."""
    inner = _innermost(optimizer)
    if not getattr(inner, "_step_supports_amp_scaling", False):
        return False
    kind = type(inner)
    if kind not in _TAKES_GRAD_SCALER:  # GradScaler's old protocol, step(grad_scaler=...): GradScaler itself only
        _TAKES_GRAD_SCALER[kind] = "grad_scaler" in inspect.signature(inner.step).parameters
    if _TAKES_GRAD_SCALER[kind] or not params or any(p.grad is None or p.grad.is_sparse for p in params):
        return False
    if params[0].device.type not in _FUSED_DEVICE_TYPES:
        return False
    # torch's fused SGD with momentum creates its buffers uninitialised on its first step and keeps them even when
    # found_inf skips it: that first step takes the unscale path (skipped on the host, no buffers made).
    return not (isinstance(inner, torch.optim.SGD) and _sgd_buffers_missing(inner))


def _innermost(optimizer: Optimizer) -> Optimizer:
    """The optimizer inside wrappers that expose it as ``.optimizer`` (Lightning's ``LightningOptimizer``, Fabric's)."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def _key(optimizer: Optimizer) -> int:
    """One optimizer however it is wrapped: Lightning hands the hooks its wrapper here and the optimizer there."""
    return id(_innermost(optimizer))


def _sgd_buffers_missing(optimizer: Optimizer) -> bool:
    state = optimizer.state
    return any(
        group["momentum"] != 0 and param.grad is not None and state.get(param, {}).get("momentum_buffer") is None
        for group in optimizer.param_groups
        for param in group["params"]
    )
