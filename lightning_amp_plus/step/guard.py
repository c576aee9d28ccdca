"""Step guards: check an optimizer's gradients once per step, skip the step on inf/NaN, count it, record the result.

Two guards share one interface and this code (as Megatron-LM's constant and dynamic grad scalers do):

* :class:`NonfiniteGuard` checks only (bf16, whose range needs no loss scaling): ``scale()`` returns the loss as it is.
* :class:`~lightning_amp_plus.step.scaler.DynamicLossScaler` scales the loss too (fp16) and moves the scale.

One optimizer's gradients go through three stages per iteration (:class:`~.outcome.Stage`): ``READY`` after backward;
``UNSCALED`` once :meth:`GradientGuard.unscale_` has divided them by the scale, checked them and measured their global
norm in one go (the step's one host read); ``STEPPED`` once :meth:`GradientGuard.step` has stepped or skipped.
``update()`` starts the next iteration. Two paths lead through ``step()``:

* the **unscale path** (clipping, hooks that read gradients, any optimizer): unscale, check, measure, then step or skip
  on the host;
* the **fused path** (``Adam/AdamW/SGD/Adagrad(fused=True)`` stepped with no ``unscale_`` first): one read-only pass
  measures the still-scaled gradients; the scale and the overflow flag go to the optimizer as ``grad_scale`` /
  ``found_inf``, its kernel divides and skips on the device, and the flag is read back later with others
  (:mod:`~.pending`), so the step makes no host read.

Reading a counter, :meth:`GradientGuard.outcome`'s fields or the last norm reads pending flags if it must (a host read)
and brings the counters up to date; it never changes what a later call does. A run whose skips cannot be helped
(:mod:`~.skips`) stops in ``step()`` (unscale path) or in ``update()`` (fused path, where it is learnt).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_amp_plus._checks import is_int, read_count, real, require
from lightning_amp_plus.step.float32 import f32
from lightning_amp_plus.step.grads import clip_by_norm_, global_norm, measure, sharded_norm, unscale_
from lightning_amp_plus.step.outcome import Stage, StepRecord, StepResult
from lightning_amp_plus.step.pending import PENDING_MAX, PendingReads, UpdateMark
from lightning_amp_plus.step.sharding import Sharding, local_views, max_across_ranks
from lightning_amp_plus.step.skips import SkipCounter, Stall

__all__ = ["GradientGuard", "NonfiniteGuard"]

# Devices whose kernels take GradScaler's fused protocol (and where the scale policy can run on the device).
_FUSED_DEVICE_TYPES = ("cpu", "cuda")
_TAKES_GRAD_SCALER: dict[type, bool] = {}


@dataclass(eq=False)
class _Pass:
    """One optimizer's gradients in the current iteration."""

    stage: Stage = Stage.READY
    params: list[Tensor] = field(default_factory=list)
    record: StepRecord = field(default_factory=StepRecord)


class GradientGuard:
    """Check, skip, count and record: what both guards do with an optimizer's gradients (see the module docstring).

    State: this iteration's passes (one per optimizer: stage, parameters, record), the last result per optimizer, the
    pending device reads (fused path), the skip counter, the parameter names, the last checked record, and a stop the
    fused path found but has not raised yet. Configuration: :attr:`process_group`, :attr:`sharding`.
    """

    def __init__(self, max_consecutive_skips: int | None = 50) -> None:
        self._passes: dict[int, _Pass] = {}
        self._results: dict[int, StepResult] = {}
        self._pending = PendingReads()
        self._skips = SkipCounter(None)
        self.max_consecutive_skips = max_consecutive_skips
        self._names: dict[int, str] = {}
        self._last_checked: StepRecord | None = None
        self._stop: StepRecord | None = None
        self._flags: dict[torch.device, tuple[Tensor, Tensor]] = {}
        self.process_group: Any = None
        """A ``torch.distributed`` process group over which every rank takes the same skip decision: the norm (NaN
        turned into inf) is reduced with MAX, in the unscale path's host read and on the device on the fused path
        (the plugins set it under DDP). :attr:`last_overflow_params` names this rank's non-finite parameters only."""
        self.sharding: Sharding | None = None
        """Set when the gradients are sharded (FSDP, FSDP2; the plugins set it): each rank measures its shards and one
        SUM all-reduce of the weighted squared norms gives the global norm and the flag on every rank (see
        :mod:`~lightning_amp_plus.step.sharding`). It replaces the MAX reduction of :attr:`process_group`."""

    # ---------------------------------------------------------------------------------------- what each guard does
    def scale(self, outputs: Any) -> Any:
        """The loss (or losses) to call ``backward()`` on."""
        raise NotImplementedError

    def update(self) -> None:
        """End the iteration: move the scale (if any) once for everything stepped since the last call."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The guard's state, in plain Python values."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: Any) -> None:
        """Restore :meth:`state_dict`."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ what subclasses say
    def _host_scale(self) -> float | None:
        """The scale the gradients carry now (``None``: not scaled)."""
        return None

    def _device_scale(self, device: torch.device) -> Tensor | None:
        """The scale as the fused optimizer divides by it, on ``device`` (``None``: not scaled)."""
        return None

    def _backs_off(self) -> bool:
        """Whether an overflow now would lower the scale (then the skip is not stuck)."""
        return False

    def _stall(self, record: StepRecord) -> Stall:
        return Stall(
            "for non-finite gradients",
            "The model produces inf/NaN gradients.",
            "check the inputs and the loss for inf/NaN, lower the learning rate, or clip gradients",
        )

    def _replay_update(self, mark: UpdateMark) -> None:
        """Replay, on the host, an ``update()`` made while its flags were on the device."""

    # ------------------------------------------------------------------------------------------------- counters
    @property
    def max_consecutive_skips(self) -> int | None:
        """Skipped steps in a row that backing off could not help after which the guard raises (``None``: never)."""
        return self._skips.limit

    @max_consecutive_skips.setter
    def max_consecutive_skips(self, value: int | None) -> None:
        require(
            value is None or (is_int(value) and value >= 1),
            "max_consecutive_skips",
            value,
            "must be an int >= 1, or None to never stop",
            type(self).__name__,
        )
        self._skips.limit = None if value is None else int(value)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped since the start (restored from checkpoints)."""
        self._sync()
        return self._skips.skipped

    @property
    def consecutive_skips(self) -> int:
        """Optimizer steps skipped in a row, up to now."""
        self._sync()
        return self._skips.consecutive

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped."""
        self._sync()
        return self._skips.last_skipped

    @property
    def last_grad_norm(self) -> float | None:
        """The global L2 norm of the unscaled gradients at the last check (before clipping; inf on overflow)."""
        self._sync()
        return None if self._last_checked is None else self._last_checked.grad_norm

    @property
    def last_step_scale(self) -> float | None:
        """The scale the last checked gradients had been multiplied by (``None`` when not scaled)."""
        self._sync()
        return None if self._last_checked is None else self._last_checked.scale

    @property
    def last_overflow_params(self) -> list[str]:
        """Names of the parameters whose gradients were non-finite at the last skipped step."""
        self._sync()
        last = self._skips.last_overflow
        return [] if last is None else list(last.names())

    def set_parameter_names(self, named_parameters: nn.Module | Iterable[tuple[str, Tensor]]) -> None:
        """Tell the guard what to call each parameter in diagnostics (a module or ``named_parameters()`` pairs).

        Without names, parameters are called by their place in the optimizer, e.g. ``param_groups[0][3]``.
        """
        pairs = named_parameters.named_parameters() if isinstance(named_parameters, nn.Module) else named_parameters
        self._names = {id(param): name for name, param in pairs}

    # ------------------------------------------------------------------------------------------------ the step
    def unscale_(self, optimizer: Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place, check them and measure their global norm.

        Call it before clipping or inspecting gradients; :meth:`step` does it otherwise. A second call before
        ``update()`` does nothing, so the gradients are unscaled exactly once. This is the step's one host read.
        """
        step = self._pass(optimizer)
        if step.stage is Stage.STEPPED:
            raise RuntimeError(f"`{type(self).__name__}.unscale_()` was called after `step()`: call `update()` first.")
        if step.stage is Stage.READY:
            self._check(optimizer, step, _params_with_grads(optimizer))

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float) -> float:
        """Clip the optimizer's gradients to a global L2 norm of ``max_norm``, with the norm :meth:`unscale_` measured.

        That norm is ``torch.nn.utils.clip_grad_norm_``'s, bit for bit (see :func:`~.grads.global_norm`), and so are
        the clipped gradients. Unscales first if needed. On an overflow step nothing is multiplied (the step will be
        skipped).

        Returns:
            The global norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` returns it.
        """
        limit = real(max_norm)
        if limit is None or limit <= 0:
            raise ValueError(f"`clip_grad_norm_(max_norm={max_norm!r})` must be a finite number > 0.")
        self.unscale_(optimizer)
        step = self._pass(optimizer)
        norm = step.record.grad_norm
        assert norm is not None
        if not step.record.overflow:
            grads = [p.grad for p in step.params if p.grad is not None]
            clip_by_norm_(grads if self.sharding is None else local_views(grads), norm, limit)
        return norm

    def grad_norm(self, optimizer: Optimizer) -> float | None:
        """The unscaled global gradient norm of ``optimizer`` this iteration, or ``None`` before it was measured."""
        step = self._passes.get(id(optimizer))
        if step is None:
            return None
        if step.record.overflow is None and step.stage is Stage.STEPPED:
            self._sync()
        return step.record.grad_norm

    def found_inf(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were found non-finite this iteration (False if not checked yet)."""
        step = self._passes.get(id(optimizer))
        if step is None:
            return False
        if step.record.overflow is None and step.stage is Stage.STEPPED:
            self._sync()
        return bool(step.record.overflow)

    def uses_fused_path(self, optimizer: Optimizer) -> bool:
        """Whether :meth:`step` would now take the fused path for ``optimizer`` (no host read; the optimizer unscales).

        Examples:
            >>> w = nn.Parameter(torch.ones(2)); w.grad = torch.ones(2)
            >>> guard = NonfiniteGuard()
            >>> guard.uses_fused_path(torch.optim.AdamW([w], fused=True)), guard.uses_fused_path(torch.optim.AdamW([w]))
            (True, False)
        """
        step = self._passes.get(id(optimizer))
        if step is not None and step.stage is not Stage.READY:
            return False
        return self._takes_fused_path(optimizer, _params_with_grads(optimizer))

    def outcome(self, optimizer: Optimizer) -> StepResult | None:
        """The :class:`~.outcome.StepResult` of ``optimizer``'s latest :meth:`step` (``None`` before its first)."""
        return self._results.get(id(optimizer))

    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients hold inf/NaN; a skipped step leaves parameters and state untouched.

        Returns:
            What ``optimizer.step`` returned, or ``None`` when the step was skipped on the host.

        Raises:
            FloatingPointError: the skip limit was reached (on the fused path, from ``update()``).
        """
        if "closure" in kwargs or args:
            raise ValueError(
                f"`{type(self).__name__}.step(optimizer, closure=...)`: closures are not supported, because the "
                "gradients must be checked before the step. Run the closure yourself, then call `step(optimizer)`."
            )
        return self.step_with(optimizer, lambda: optimizer.step(**kwargs), fused_kwargs=kwargs)

    def step_with(
        self, optimizer: Optimizer, apply: Callable[[], Any], *, fused_kwargs: dict[str, Any] | None = None
    ) -> Any:
        """:meth:`step`, with ``apply()`` doing the update instead of ``optimizer.step()`` (e.g. a compensated update).

        ``fused_kwargs`` is ``None`` when ``apply`` is not the optimizer's own step: the fused path is then not taken.
        """
        step = self._pass(optimizer)
        if step.stage is Stage.STEPPED:
            raise RuntimeError(
                f"`{type(self).__name__}.step()` was already called for this optimizer: call `update()` first."
            )
        if step.stage is Stage.READY:
            params = _params_with_grads(optimizer)
            if fused_kwargs is not None and self._takes_fused_path(optimizer, params):
                self._raise_stop()
                step.params = params
                return self._step_fused(optimizer, step, fused_kwargs)
            self._check(optimizer, step, params)
        self._raise_stop()  # a limit that a read of the pending flags found before this step
        step.stage = Stage.STEPPED
        self._results[id(optimizer)] = StepResult(step.record, self._sync)
        if self._skips.count(step.record, self._backs_off()):
            # The iteration ends here: an update() after the caught error does not advance the scale for it.
            del self._passes[id(optimizer)]
            raise FloatingPointError(self._skips.diagnosis(step.record, self._stall(step.record)))
        return None if step.record.overflow else apply()

    def discard(self, optimizer: Optimizer) -> None:
        """Forget what :meth:`unscale_` recorded for ``optimizer`` this iteration, without stepping.

        For a step that does not happen after all (a Lightning ``training_step`` that returned ``None``): the next
        :meth:`unscale_` checks the gradients afresh and ``update()`` does not count the discarded check. A step already
        taken is not forgotten.
        """
        step = self._passes.get(id(optimizer))
        if step is not None and step.stage is not Stage.STEPPED:
            del self._passes[id(optimizer)]

    # ----------------------------------------------------------------------------------------- the two paths
    def _check(self, optimizer: Optimizer, step: _Pass, params: list[Tensor]) -> None:
        """The unscale path's pass: unscale, check and measure ``params``' gradients; one host read."""
        self._sync()  # the host's scale must be current (only matters when the two paths alternate)
        step.params = params
        grads = [p.grad for p in params if p.grad is not None]
        scale = self._host_scale()
        with torch.no_grad():
            if scale is not None:
                # 1 / scale rounded once to float32, as GradScaler computes it.
                unscale_(grads if self.sharding is None else local_views(grads), f32(1.0 / scale))
            total = self._global_norm(grads, grads[0].device if grads else torch.device("cpu"))
            # The step's one host read: the skip decision (the norm is also the clipping and the monitored one).
            norm = f32(float(total.item()))
        record = step.record
        record.scale, record.grad_norm, record.overflow = scale, norm, not math.isfinite(norm)
        if record.overflow:
            record._names = self._nonfinite_names(optimizer, params, grads)
        step.stage = Stage.UNSCALED
        self._last_checked = record

    def _step_fused(self, optimizer: Optimizer, step: _Pass, kwargs: dict[str, Any]) -> Any:
        """The fused path: a read-only measure, the flag and the scale to the optimizer's kernel, no host read."""
        owners = [p for p in step.params if p.grad is not None]
        grads = [p.grad for p in owners if p.grad is not None]
        device = grads[0].device
        zero, one = self._flag_constants(device)
        with torch.no_grad():
            norms = measure(grads if self.sharding is None else local_views(grads), device)
            if self.sharding is not None:
                total = self.sharding.all_reduce_((norms.square() * self.sharding.weights(grads, device)).sum()).sqrt()
            else:
                total = torch.linalg.vector_norm(norms)
                if self.process_group is not None:
                    total = max_across_ranks(total, self.process_group)
            # Exactly 1.0 or 0.0: the CPU kernels skip only on found_inf == 1.0.
            flag = torch.where(torch.isfinite(total), zero, one)
        step.stage = Stage.STEPPED
        record = step.record
        # The names are read later (on request), after zero_grad: the owners of the measured gradients are kept now.
        record.namer = lambda: self._named_nonfinite(optimizer, owners, norms)
        self._pending.add_step(record, flag, total)
        self._results[id(optimizer)] = StepResult(record, self._sync, ready=lambda: self._pending.ready(record))
        # As GradScaler: a grad_scale the user set is multiplied in; both attributes are removed after the step. They
        # go on the optimizer that runs the kernel: a wrapper (Lightning's LightningOptimizer) would keep them itself.
        inner = _innermost(optimizer)
        user_scale = getattr(inner, "grad_scale", None)
        scale = self._device_scale(device)
        if scale is not None and user_scale is not None:
            scale = scale * user_scale
        inner.grad_scale = user_scale if scale is None else scale  # type: ignore[attr-defined]
        inner.found_inf = flag  # type: ignore[attr-defined]
        try:
            return optimizer.step(**kwargs)
        finally:
            del inner.grad_scale  # type: ignore[attr-defined]
            del inner.found_inf  # type: ignore[attr-defined]

    def _takes_fused_path(self, optimizer: Optimizer, params: list[Tensor]) -> bool:
        """Whether ``optimizer`` can unscale and skip inside its own kernel, safely, this step."""
        inner = _innermost(optimizer)
        if not getattr(inner, "_step_supports_amp_scaling", False) or _takes_grad_scaler(inner):
            return False
        if not params or any(p.grad is None or p.grad.is_sparse for p in params):
            return False
        if params[0].device.type not in _FUSED_DEVICE_TYPES:
            return False
        # torch's fused SGD with momentum creates its buffers uninitialised on its first step and keeps them even when
        # found_inf skips it: that first step takes the unscale path (skipped on the host, no buffers made).
        return not _sgd_buffers_missing(inner)

    # ------------------------------------------------------------------------------------- iterations and reads
    def _close_iteration(self) -> list[StepRecord]:
        """End the iteration: the records it checked or stepped; raise a stop the fused path found since."""
        records = [step.record for step in self._passes.values() if step.stage is not Stage.READY]
        self._passes = {}
        self._raise_stop()
        return records

    def _read_if_due(self) -> bool:
        """Read the pending flags if the skip limit could be reached by them, or too many wait; raise a stop.

        Returns:
            Whether they were read.
        """
        unread = self._pending.unread
        if unread < PENDING_MAX and not self._skips.due_within(unread):
            return False
        self._sync()
        self._raise_stop()
        return True

    def _sync(self) -> None:
        """Read every pending flag (one host read) and replay the counters (and the scale) on the host, in order."""
        if not self._pending:
            return
        for event in self._pending.read():
            if isinstance(event, UpdateMark):
                if self._stop is None:
                    self._replay_update(event)
                continue
            event.scale = self._host_scale()
            scaled = event.scaled_norm if event.scaled_norm is not None else math.nan
            event.grad_norm = scaled if event.scale is None else f32(scaled * f32(1.0 / event.scale))
            if self._stop is None:  # after the limit is reached nothing more is counted, as on the unscale path
                self._last_checked = event
                if self._skips.count(event, self._backs_off()):
                    self._stop = event
        self._after_sync()

    def _after_sync(self) -> None:
        """What a subclass keeps on the device follows the host (the scaler's scale)."""

    def _raise_stop(self) -> None:
        if self._stop is not None:
            record, self._stop = self._stop, None
            raise FloatingPointError(self._skips.diagnosis(record, self._stall(record)))

    # -------------------------------------------------------------------------------------------------- helpers
    def _pass(self, optimizer: Optimizer) -> _Pass:
        return self._passes.setdefault(id(optimizer), _Pass())

    def _global_norm(self, grads: list[Tensor], device: torch.device) -> Tensor:
        """The norm of all gradients, across ranks when they are spread or must agree."""
        if self.sharding is not None:
            return sharded_norm(grads, self.sharding, device)
        total = global_norm(grads, device)
        return total if self.process_group is None else max_across_ranks(total, self.process_group)

    def _flag_constants(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._flags:
            self._flags[device] = (
                torch.zeros((), dtype=torch.float32, device=device),
                torch.ones((), dtype=torch.float32, device=device),
            )
        return self._flags[device]

    def _nonfinite_names(self, optimizer: Optimizer, params: list[Tensor], grads: list[Tensor]) -> list[str]:
        with torch.no_grad():
            norms = measure(grads if self.sharding is None else local_views(grads), grads[0].device)
        return self._named_nonfinite(optimizer, [p for p in params if p.grad is not None], norms)

    def _named_nonfinite(self, optimizer: Optimizer, owners: list[Tensor], norms: Tensor) -> list[str]:
        """The names of ``owners`` (one per entry of ``norms``) whose gradient norm is non-finite (a host read)."""
        bad = set(torch.nonzero(~torch.isfinite(norms)).flatten().tolist())
        groups = optimizer.param_groups
        places = {id(p): f"param_groups[{g}][{i}]" for g, grp in enumerate(groups) for i, p in enumerate(grp["params"])}
        return [self._names.get(id(p), places.get(id(p), "?")) for i, p in enumerate(owners) if i in bad]

    def __getstate__(self) -> dict[str, Any]:
        """Pickle between iterations only (as GradScaler): device tensors and references to parameters are dropped."""
        self._sync()
        if self._passes:
            raise RuntimeError(
                f"A {type(self).__name__} can be pickled only between iterations: before `scale()` or after `update()`."
            )
        state = self.__dict__.copy()
        last = self._skips.last_overflow
        skips = SkipCounter(self._skips.limit)
        skips.restore(self._skips.counters())
        skips.last_skipped = self._skips.last_skipped
        if last is not None:
            skips.last_overflow = StepRecord(overflow=True, scale=last.scale, _names=list(last.names()))
        state["_skips"] = skips
        # Parameter ids, results (which hold parameters) and device tensors do not mean anything in another process.
        state.update(_names={}, _results={}, _flags={}, _pending=PendingReads())
        return state


class NonfiniteGuard(GradientGuard):
    """The guard that only checks (bf16): no loss scaling, steps with inf/NaN gradients skipped, counted and named.

    Args:
        max_consecutive_skips: skipped steps in a row after which :meth:`step` (or :meth:`update` on the fused path)
            raises ``FloatingPointError`` with a diagnosis; ``None`` never.

    Examples:
        >>> w = nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1)
        >>> guard = NonfiniteGuard()
        >>> (w * float("nan")).sum().backward(); _ = guard.step(opt); guard.update()
        >>> guard.skipped_steps, w.tolist()
        (1, [1.0, 1.0])
    """

    def scale(self, outputs: Any) -> Any:
        """The loss as it is: bf16 needs no scaling."""
        return outputs

    def update(self) -> None:
        """End the iteration (no scale to move); read the pending flags when the skip limit could be reached."""
        self._close_iteration()
        self._read_if_due()

    def state_dict(self) -> dict[str, Any]:
        """The skip counters (plain ints)."""
        self._sync()
        return self._skips.counters()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the skip counters (also from a ``DynamicLossScaler`` state, which holds them under the same keys)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"`NonfiniteGuard.load_state_dict` expects a dict, got {type(state_dict).__name__}.")
        self._passes, self._pending, self._stop = {}, PendingReads(), None
        self._skips.restore({key: read_count(state_dict, key, 0) for key in self._skips.counters()})


# ------------------------------------------------------------------------------------------------------- helpers
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


def _innermost(optimizer: Optimizer) -> Optimizer:
    """The optimizer inside wrappers that expose it as ``.optimizer`` (Lightning's ``LightningOptimizer``, Fabric's)."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def _takes_grad_scaler(optimizer: Optimizer) -> bool:
    """Optimizers of GradScaler's old protocol (``step(grad_scaler=...)``) expect GradScaler itself: not fused here."""
    kind = type(optimizer)
    if kind not in _TAKES_GRAD_SCALER:
        _TAKES_GRAD_SCALER[kind] = "grad_scaler" in inspect.signature(optimizer.step).parameters
    return _TAKES_GRAD_SCALER[kind]


def _sgd_buffers_missing(optimizer: Optimizer) -> bool:
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    state = optimizer.state
    return any(
        group["momentum"] != 0 and param.grad is not None and state.get(param, {}).get("momentum_buffer") is None
        for group in optimizer.param_groups
        for param in group["params"]
    )
