"""``StepEngine``: the numerics of one optimizer step, held by every front end (Trainer, FSDP, Fabric plugins).

A front end adapts its framework's hooks; the engine does the step, in the order of the recipe:

1. :meth:`StepEngine.scale_loss`: multiply the loss by the scale (fp16) before backward;
2. :meth:`StepEngine.prepare`: unscale, check and measure the gradients, once per optimizer step (the one host read;
   skipped when nothing before the step reads them, so that a fused optimizer unscales in its own kernel);
3. :meth:`StepEngine.clip_by_norm` / :meth:`StepEngine.clip_by_value`: clip with the norm already measured (nothing
   to clip on a step that will be skipped);
4. :meth:`StepEngine.step`: step, or skip when the gradients hold inf/NaN; record one
   :class:`~.outcome.StepResult`;
5. :meth:`StepEngine.end_batch`: move the loss scale once for everything stepped since the last call.

Who owns what: the engine owns the guard (:class:`~.scaler.DynamicLossScaler` for fp16, :class:`~.guard.NonfiniteGuard`
for bf16, or none), the record of recent steps, the LR schedulers it holds while their steps are skipped
(:mod:`~.schedulers`) and, for compensated bf16 weights, each optimizer's :class:`~.compensated.Compensator` (which
takes the place of ``optimizer.step()``). The guard owns each optimizer's stage and the skip counters. The front end
owns the framework's objects (autocast, the model, hooks, checkpoints' keys).

Examples:
    >>> from torch import nn
    >>> from lightning_amp_plus.step.scaler import DynamicLossScaler
    >>> model = nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> engine = StepEngine(DynamicLossScaler(init_scale=2.0**8))
    >>> engine.scale_loss(model(torch.ones(1, 2)).sum()).backward()
    >>> engine.prepare(opt); norm = engine.clip_by_norm(opt, 1.0); _ = engine.step(opt); engine.end_batch()
    >>> engine.recent_steps[-1].skipped, engine.steps_taken
    (False, 1)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_amp_plus.step import schedulers
from lightning_amp_plus.step.guard import GradientGuard
from lightning_amp_plus.step.outcome import StepResult
from lightning_amp_plus.weights.compensated import Compensator, Footprint, Method, footprint

__all__ = ["EngineReadings", "StepEngine"]

_RECENT_STEPS = 1024


class StepEngine:
    """Scale, unscale-check-measure once, clip, step or skip, update once, record (see the module docstring).

    Args:
        guard: the fp16 scaler, the bf16 check, or ``None`` (nothing checked: the step is always taken).
        hold_schedulers: hold an LR scheduler still while every step of its optimizer since its last step was skipped.

        compensation: ``"kahan"`` or ``"stochastic"`` to step bf16 weights with compensated updates (see
            :meth:`compensate`), ``None`` for the optimizers' own steps.
        seed: the seed of the stochastic-rounding streams.

    State: the guard; the recent step results, newest last, and the count of steps taken; each optimizer's position
    and its last recorded result; the scheduler ledger and the held schedulers; the compensators, by optimizer
    position, and a compensation state loaded before they existed.
    """

    def __init__(
        self,
        guard: GradientGuard | None,
        *,
        hold_schedulers: bool = True,
        compensation: Method | None = None,
        seed: int = 0,
    ) -> None:
        self._guard = guard
        self.hold_schedulers = hold_schedulers
        self.recent_steps: deque[StepResult] = deque(maxlen=_RECENT_STEPS)
        """The last optimizer steps' results, newest last (1024 kept)."""
        self.steps_taken = 0
        """Optimizer steps driven (applied or skipped), over every run."""
        self._positions: dict[int, int] = {}
        self._recorded: dict[int, StepResult] = {}
        self._ledger = schedulers.StepLedger()
        self._held: list[Any] = []
        self.compensation = compensation
        self.seed = seed
        self._compensators: dict[int, Compensator] = {}
        self._pending_compensation: list[dict[str, Any] | None] | None = None

    # ------------------------------------------------------------------------------------------------ the guard
    @property
    def guard(self) -> GradientGuard | None:
        """The guard that checks each step (``None``: nothing checked)."""
        return self._guard

    @guard.setter
    def guard(self, guard: GradientGuard | None) -> None:
        previous = self._guard
        if previous is not None and guard is not None and guard is not previous:
            # Replaced after set-up (as users do with Lightning's plugin): the new guard reduces where the old one did
            # and names the same parameters.
            guard.process_group, guard.sharding = previous.process_group, previous.sharding
            guard._names = dict(previous._names)
        self._guard = guard

    def set_optimizers(self, optimizers: Sequence[Optimizer]) -> None:
        """Number the optimizers as the front end lists them (``StepResult.optimizer``); compensate them if asked.

        Raises:
            TypeError: with compensation, an optimizer the compensated update does not implement (named, with the
                supported ones) or options it does not take: refused before any step.
        """
        self._positions = {id(optimizer): index for index, optimizer in enumerate(optimizers)}
        if self.compensation is not None:
            for optimizer in optimizers:
                self.compensator(optimizer)

    def compensator(self, optimizer: Optimizer) -> Compensator:
        """The compensator of ``optimizer``, made (and given any state loaded for it) the first time it is asked."""
        if id(optimizer) not in self._compensators:
            assert self.compensation is not None
            position = self._positions.setdefault(id(optimizer), len(self._positions))
            compensator = Compensator(optimizer, self.compensation, seed=self.seed)
            pending = self._pending_compensation
            if pending is not None and position < len(pending) and pending[position] is not None:
                compensator.load_state_dict(pending[position])  # type: ignore[arg-type]
                pending[position] = None
            self._compensators[id(optimizer)] = compensator
        return self._compensators[id(optimizer)]

    def footprints(self) -> list[Footprint]:
        """Each compensated optimizer's bytes of weights, compensation buffers and state, counted from the tensors."""
        return [footprint(c.optimizer, c) for c in self._compensators.values()]

    # --------------------------------------------------------------------------------------------- the recipe
    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call ``backward()`` on: multiplied by the loss scale under fp16, as it is otherwise."""
        return loss if self._guard is None else self._guard.scale(loss)

    def prepare(self, optimizer: Optimizer) -> None:
        """Unscale, check and measure ``optimizer``'s gradients (once per step; a second call does nothing)."""
        if self._guard is not None:
            self._guard.unscale_(optimizer)

    def clip_by_norm(self, optimizer: Optimizer, max_norm: float) -> float | None:
        """Clip to a global norm of ``max_norm`` with the measured norm (``clip_grad_norm_``'s result, bit for bit).

        Returns:
            The norm before clipping (``None`` without a guard: then ``torch.nn.utils.clip_grad_norm_`` clips).
        """
        if self._guard is None:
            torch.nn.utils.clip_grad_norm_(_params(optimizer), max_norm)
            return None
        return self._guard.clip_grad_norm_(optimizer, max_norm)

    def clip_by_value(self, optimizer: Optimizer, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]``; nothing on a step that will be skipped."""
        self.prepare(optimizer)
        params = [param for param in self.main_params(optimizer) if param.grad is not None]
        if params:  # torch's clip_grad_value_ fails on an empty list (no backward reached the parameters)
            torch.nn.utils.clip_grad_value_(params, clip_value)

    def main_params(self, optimizer: Optimizer) -> list[Tensor]:
        """The parameters whose gradients may be clipped: none on a step whose gradients were found non-finite."""
        if self._guard is not None and self._guard.found_inf(optimizer):
            return []
        return list(_params(optimizer))

    def found_inf(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were found non-finite this step (its step will be skipped)."""
        return self._guard is not None and self._guard.found_inf(optimizer)

    def step(self, optimizer: Optimizer, apply: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Step ``optimizer`` (or run ``apply`` in place of ``optimizer.step``) unless its gradients hold inf/NaN.

        Records the step's :class:`~.outcome.StepResult` (without reading it: on the fused path it is pending).

        Raises:
            FloatingPointError: the guard's skip limit was reached.
        """
        if apply is None and self.compensation is not None:
            if kwargs:
                raise ValueError(f"A compensated step takes no arguments (no closure), got {sorted(kwargs)}.")
            apply = self.compensator(optimizer).step
        if self._guard is None:
            output = optimizer.step(**kwargs) if apply is None else apply()
            self._record(optimizer, StepResult.known(skipped=False, scale=None, grad_norm=None))
            return output
        try:
            if apply is None:
                return self._guard.step(optimizer, **kwargs)
            return self._guard.step_with(optimizer, apply)
        finally:
            result = self._guard.outcome(optimizer)
            if result is not None:
                self._record(optimizer, result)

    def end_batch(self) -> None:
        """Move the loss scale once for every step since the last call (and end the guard's iteration)."""
        if self._guard is not None:
            self._guard.update()

    def discard(self, optimizer: Optimizer) -> None:
        """Forget a check made for a step that does not happen (the next one checks afresh)."""
        if self._guard is not None:
            self._guard.discard(optimizer)

    # ------------------------------------------------------------------------------------------- schedulers
    def hold(self, scheduler: Any) -> None:
        """Hold ``scheduler`` still while every step of its optimizer since its last step was skipped."""
        if self.hold_schedulers and self._guard is not None:
            schedulers.hold(scheduler, self._ledger)
            self._held.append(scheduler)

    def release_schedulers(self) -> None:
        """Give every held scheduler its own ``step`` back."""
        for scheduler in self._held:
            schedulers.release(scheduler)
        self._held.clear()

    @property
    def held_scheduler_steps(self) -> int:
        """Scheduler steps held back because every step of their optimizer since the last one was skipped."""
        return self._ledger.held_steps

    # ------------------------------------------------------------------------------------------------ readings
    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients since the start (0 when nothing is checked)."""
        return 0 if self._guard is None else self._guard.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped."""
        return self._guard is not None and self._guard.last_step_skipped

    @property
    def last_grad_norm(self) -> float | None:
        """The global norm of the unscaled gradients at the last check (``None`` if nothing checks them)."""
        return None if self._guard is None else self._guard.last_grad_norm

    @property
    def last_overflow_params(self) -> list[str]:
        """Names of the parameters whose gradients were non-finite at the last skipped step."""
        return [] if self._guard is None else self._guard.last_overflow_params

    def results_since(self, count: int) -> list[StepResult]:
        """The recorded results of the steps numbered ``count`` and later (``StepResult.index``), oldest first."""
        return [result for result in self.recent_steps if result.index is not None and result.index >= count]

    # ---------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The guard's state, the scheduler steps held and, with compensation, each optimizer's compensator state.

        Plain Python values and tensors only (what ``torch.load(weights_only=True)`` reads).
        """
        state: dict[str, Any] = {
            "held_scheduler_steps": self._ledger.held_steps,
            "scaler": {} if self._guard is None else self._guard.state_dict(),
        }
        if self.compensation is not None:
            by_position = {self._positions[key]: c for key, c in self._compensators.items()}
            slots = max(by_position, default=-1) + 1
            state["compensation"] = [by_position[i].state_dict() if i in by_position else None for i in range(slots)]
        return state

    def load_state_dict(
        self, scaler: dict[str, Any], held_scheduler_steps: int, compensation: list[Any] | None = None
    ) -> None:
        """Restore the guard's state, the count of held scheduler steps and the compensators' states.

        A compensator not made yet (Fabric meets its optimizers at their first step) gets its state when it is.
        """
        if self._guard is not None:
            self._guard.load_state_dict(scaler)
        self._ledger.held_steps = held_scheduler_steps
        if compensation is None:
            return
        by_position = {self._positions[key]: c for key, c in self._compensators.items()}
        pending: list[dict[str, Any] | None] = []
        for position, saved in enumerate(compensation):
            if position in by_position and saved is not None:
                by_position[position].load_state_dict(saved)
                saved = None
            pending.append(saved)
        self._pending_compensation = pending

    # -------------------------------------------------------------------------------------------------- private
    def _record(self, optimizer: Optimizer, result: StepResult) -> None:
        if result is self._recorded.get(id(optimizer)):
            return  # the step failed before the guard's record of it (an error before): recorded already
        self._recorded[id(optimizer)] = result
        if self._held:
            self._ledger.record_outcome(optimizer, result)
        position = self._positions.get(id(optimizer), 0)
        self.recent_steps.append(result.renumbered(self.steps_taken, position))
        self.steps_taken += 1


def _params(optimizer: Optimizer) -> Iterable[Tensor]:
    return (param for group in optimizer.param_groups for param in group["params"])


class EngineReadings:
    """What a front end shows of its :class:`StepEngine` (the same properties on every plugin).

    A front end sets ``self.engine``; these read it and never change it.
    """

    engine: StepEngine

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients since the start (0 when nothing is checked)."""
        return self.engine.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped."""
        return self.engine.last_step_skipped

    @property
    def last_grad_norm(self) -> float | None:
        """The global norm of the unscaled gradients at the last step (measured by the check; ``None`` if unchecked)."""
        return self.engine.last_grad_norm

    @property
    def last_overflow_params(self) -> list[str]:
        """Names of the parameters whose gradients were non-finite at the last skipped step."""
        return self.engine.last_overflow_params

    @property
    def skip_nonfinite(self) -> bool:
        """Whether steps with non-finite gradients are skipped (always for fp16; by default for bf16)."""
        return self.engine.guard is not None

    @property
    def recent_steps(self) -> deque[StepResult]:
        """The last optimizer steps' results, newest last (:class:`~.outcome.StepResult`; up to 1024 kept)."""
        return self.engine.recent_steps

    @property
    def steps_taken(self) -> int:
        """Optimizer steps driven (applied or skipped), over every run."""
        return self.engine.steps_taken

    @property
    def held_scheduler_steps(self) -> int:
        """Scheduler steps held back because every step of their optimizer since the last one was skipped."""
        return self.engine.held_scheduler_steps
