"""``StepEngine``: the numerics of one optimizer step, held by every front end and by ``DynamicLossScaler``.

A front end adapts its framework's hooks; the engine does the step, in the order of the recipe:

1. :meth:`StepEngine.scale_loss`: multiply the loss by the loss scale (fp16) before backward;
2. :meth:`StepEngine.unscale`: unscale and check the gradients, once per optimizer step: GradScaler's own one-pass
   kernel, which multiplies by the inverse scale (1.0 without a loss scale) and flags inf/NaN as it goes, then the
   global norm when something reads it (a clip, a spike guard, a reader such as the monitor); one host read;
3. :meth:`StepEngine.clip_by_norm`: clip with that norm (``clip_grad_norm_``'s result, bit for bit);
4. :meth:`StepEngine.step`: step, or skip when the gradients hold inf/NaN; record one :class:`StepResult`; stop a
   run that cannot make progress;
5. :meth:`StepEngine.update`: move the loss scale once for every optimizer stepped since the last call, on the
   scale's device, from the steps' flags there (:meth:`~.policy.LossScale.advance`: no host read).

Each optimizer is known by a slot (:class:`Stage` is where it is this iteration). Its **route** is decided once, at
its first step: an optimizer that unscales and skips in its own kernel (``Adam``/``AdamW``/``SGD``/``Adagrad`` with
``fused=True``) takes the **fused path** whenever it reaches ``step()`` unchecked, unless the front end said at
:meth:`StepEngine.track` that something reads its gradients before the step, or a spike guard needs the norm on the
host. On the fused path the check is the same kernel, by 1.0 (values untouched), the scale and the flag go to the
optimizer as ``grad_scale`` / ``found_inf``, and the step's values wait on the device (:class:`PendingStep`): no host
read in the step. Otherwise (the **unscale path**) the host reads the check and skips.

Examples:
    >>> from torch import nn
    >>> from lightning_amp_plus.step.policy import LossScale, ScalePolicy
    >>> model = nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> engine = StepEngine(LossScale(ScalePolicy(2.0, 0.5, 2000, 1, 1.0, 2.0**24), 256.0))
    >>> engine.scale_loss(model(torch.ones(1, 2)).sum()).backward()
    >>> norm = engine.clip_by_norm(opt, 1.0); _ = engine.step(opt); engine.update()
    >>> engine.log.recent[-1].skipped, engine.log.recent[-1].scale, engine.skipped_steps
    (False, 256.0, 0)
"""

from __future__ import annotations

import enum
import functools
import inspect
import math
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_amp_plus._checks import is_int, read_count, require
from lightning_amp_plus.step import grads as _grads
from lightning_amp_plus.step.float32 import f32
from lightning_amp_plus.step.pending import PENDING_MAX, PendingReads
from lightning_amp_plus.step.policy import LossScale, ScalePolicy
from lightning_amp_plus.step.schedulers import SchedulerHold
from lightning_amp_plus.step.sharding import Ranks
from lightning_amp_plus.step.skips import BF16_STALL, SPIKE_STALL, diagnosis
from lightning_amp_plus.step.spikes import SpikeGuard, SpikeGuards, SpikeVerdict

__all__ = ["PendingStep", "Stage", "StepEngine", "StepResult"]

_RECENT_STEPS = 1024
# The loss scale's constants in a scaler state: a saved state with others than this engine's gets a warning.
_CONSTANTS = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "max_scale")
# A step engine's own attributes; any other name set on one must be one of the class's (see StepEngine.__setattr__).
_OWN_ATTRIBUTES = ("check", "gradients", "log", "slots", "_norms_read")
# Devices whose kernels take GradScaler's fused protocol.
_FUSED_DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class StepResult:
    """What became of one optimizer step: applied or skipped, at what scale, with what gradient norm.

    Built once, when the step's facts are known, and never changed. A fused optimizer's step is a
    :class:`PendingStep` until its values are read; it reads the same way.

    Attributes:
        skipped: whether the step was skipped: parameters and optimizer state untouched (inf/NaN, or a spike skipped).
        scale: the loss scale the step's gradients carried (``None`` where no loss scale was involved).
        grad_norm: the global L2 norm of the unscaled gradients (inf or NaN for an overflow; ``None`` when nothing
            asked for it). After a spike guard's clip, the norm of the clipped gradients.
        overflow_params: the names of the parameters whose gradients were non-finite in this process (empty when the
            step was applied, or when the inf/NaN was on another rank; ``None`` where they were not looked up: a fused
            optimizer's skip that no reader measured).
        spike_verdict: the spike guard's verdict on the norm (``None`` without a guard, or for an overflow).
        backed_off: whether the step's overflow lowered the loss scale (a skip that did not is *stuck*).
        index: the engine's count of optimizer steps before this one (``None`` for a result made by hand).
        optimizer: the optimizer's position among the engine's optimizers (``None`` for a result made by hand).
        resolved: always ``True``: a result's values are on the host (a :class:`PendingStep` says whether its are).

    Examples:
        >>> StepResult(skipped=False, grad_norm=2.0)
        StepResult(skipped=False, scale=None, grad_norm=2.0)
        >>> StepResult(skipped=True, overflow_params=["fc.weight"]).overflowed
        True
    """

    skipped: bool
    scale: float | None = None
    grad_norm: float | None = None
    overflow_params: list[str] | None = field(default_factory=list)
    spike_verdict: SpikeVerdict | None = None
    backed_off: bool = False
    index: int | None = None
    optimizer: int | None = None
    resolved: ClassVar[bool] = True

    @property
    def overflowed(self) -> bool:
        """Whether the step was skipped because its gradients held inf/NaN (what a loss scaler backs off for)."""
        return self.skipped and self.spike_verdict is None

    def __repr__(self) -> str:
        return f"StepResult(skipped={self.skipped}, scale={self.scale!r}, grad_norm={self.grad_norm!r})"


class PendingStep:
    """A fused step whose values are on the device until read; reading any field reads every pending step at once.

    It reads as a :class:`StepResult` does (``skipped``, ``scale``, ``grad_norm``, ``overflow_params``...), and
    :attr:`result` is that result, built once its values are known (:class:`~.pending.PendingReads`).

    Attributes:
        index: the engine's count of optimizer steps before this one.
        optimizer: the optimizer's position among the engine's optimizers.
    """

    __slots__ = ("_namer", "_policy", "_reads", "_result", "index", "optimizer")

    def __init__(
        self,
        reads: PendingReads,
        index: int,
        optimizer: int,
        policy: ScalePolicy | None,
        namer: Callable[[], list[str]] | None,
    ) -> None:
        self.index = index
        self.optimizer = optimizer
        self._reads = reads
        self._policy = policy
        self._namer = namer  # a reader measured the step's norms: they name its non-finite gradients
        self._result: StepResult | None = None

    @property
    def resolved(self) -> bool:
        """Whether the values have been read (reading a field then waits for nothing)."""
        return self._result is not None

    @property
    def result(self) -> StepResult:
        """The step's result (every pending step's values read first, if this one's are not yet)."""
        if self._result is None:
            self._reads.read()
        assert self._result is not None
        return self._result

    skipped = property(lambda self: self.result.skipped, doc="Whether the step was skipped.")
    overflowed = property(lambda self: self.result.overflowed, doc="Whether the step was skipped for inf/NaN.")
    scale = property(lambda self: self.result.scale, doc="The loss scale the step's gradients carried.")
    grad_norm = property(lambda self: self.result.grad_norm, doc="The unscaled gradients' norm, if a reader asked.")
    overflow_params = property(lambda self: self.result.overflow_params, doc="The non-finite gradients' names.")
    backed_off = property(lambda self: self.result.backed_off, doc="Whether the overflow lowered the loss scale.")
    spike_verdict = property(lambda self: None, doc="Always ``None``: a guarded step takes the unscale path.")

    def _resolve(self, row: list[float]) -> None:
        """Build the result from the step's values ``[flag, scaled norm, scale, hysteresis tracker]``."""
        skipped = row[0] != 0.0
        measured, namer = self._namer is not None, self._namer
        self._namer = None  # drops the norms and the parameters the lookup needed
        norm = None
        if measured:  # 1 / scale rounded once to float32, as the unscale path's kernel multiplies
            norm = row[1] if self._policy is None else f32(row[1] * f32(1.0 / row[2]))
        self._result = StepResult(
            skipped=skipped,
            scale=None if self._policy is None else row[2],
            grad_norm=norm,
            overflow_params=(namer() if namer is not None else None) if skipped else [],
            backed_off=skipped and self._policy is not None and self._policy.backs_off(row[2], row[3]),
            index=self.index,
            optimizer=self.optimizer,
        )

    def __repr__(self) -> str:
        return repr(self._result) if self._result is not None else f"PendingStep(index={self.index}, unread)"


class Stage(enum.Enum):
    """Where one optimizer's gradients are between two ``update()`` calls (GradScaler's ``OptState``).

    * ``READY``: nothing done yet this iteration; the gradients are as backward left them (scaled).
    * ``UNSCALED``: unscaled and checked once (:meth:`StepEngine.unscale`); clipping may still change them.
    * ``STEPPED``: stepped or skipped; nothing more until ``update()``.
    """

    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclass(eq=False)
class _Pass:
    """One optimizer's gradients this iteration: the check's flag (and norm), then what the host read of it.

    Made by the check, dropped by ``update()`` (an optimizer without one is ``READY``).
    """

    params: list[Tensor]
    grads: list[Tensor]  # their gradients (DTensors when sharded)
    found: Tensor  # the overflow flag on the device, the same on every rank: what the scale's update reads
    stage: Stage = Stage.UNSCALED
    norm: Tensor | None = None  # the unscaled gradients' norm on the device, when something reads it
    read: bool = False  # whether what follows is known (read on the host)
    overflow: bool = False
    skipped: bool = False  # an overflow, or a spike the guard skips
    scale: float | None = None
    grad_norm: float | None = None
    names: list[str] | None = field(default_factory=list)
    verdict: SpikeVerdict | None = None
    backs_off: bool = False
    coefficient: float | None = None  # a clip by norm's, read with the rest


@dataclass(eq=False)
class _Slot:
    """One optimizer as the engine knows it.

    Its position, its route (decided at its first step) and this iteration's pass (``None``: ready).
    """

    position: int
    fused_allowed: bool
    optimizer: Optimizer
    fused: bool | None = None
    now: _Pass | None = None

    def takes_fused_path(self, guarded: bool) -> bool:
        """Whether this step goes through the optimizer's own kernel: the route, decided at the first step."""
        if self.fused is None:
            self.fused = self.fused_allowed and not guarded and _fused_capable(self.optimizer)
        # torch's fused SGD with momentum creates its buffers uninitialised on its first step and keeps them even when
        # found_inf skips it: until they exist, steps take the unscale path (skipped on the host, no buffers made).
        inner = _innermost(self.optimizer)
        return self.fused and not (isinstance(inner, torch.optim.SGD) and _sgd_buffers_missing(inner))


class Slots:
    """The optimizers an engine knows, each in its :class:`_Slot`, found however it is wrapped.

    Lightning hands the hooks its ``LightningOptimizer`` here and the optimizer there.

    State: the slots, by the innermost optimizer's ``id``.

    Examples:
        >>> slots, opt = Slots(), torch.optim.SGD([torch.zeros(1)])
        >>> slots.track(opt, fused=True), slots.of(opt).position, slots.busy()
        (0, 0, False)
    """

    def __init__(self) -> None:
        self.slots: dict[int, _Slot] = {}

    def track(self, optimizer: Optimizer, *, fused: bool) -> int:
        """Know ``optimizer`` (numbered after those known, if new) and return its position."""
        key = _key(optimizer)
        if key not in self.slots:
            self.slots[key] = _Slot(len(self.slots), fused, optimizer)
        return self.slots[key].position

    def get(self, optimizer: Optimizer) -> _Slot | None:
        """``optimizer``'s slot, if known."""
        return self.slots.get(_key(optimizer))

    def of(self, optimizer: Optimizer) -> _Slot:
        """``optimizer``'s slot, made at first sight (a raw optimizer is found at once, a wrapper looked through)."""
        slot = self.slots.get(id(optimizer)) or self.slots.get(_key(optimizer))
        if slot is None:
            slot = self.slots[_key(optimizer)] = _Slot(len(self.slots), True, optimizer)
        return slot

    def at(self, position: int | None) -> _Slot | None:
        """The slot at ``position``, if any."""
        return next((slot for slot in self.slots.values() if slot.position == position), None)

    def busy(self) -> bool:
        """Whether some optimizer is between its check and ``update()``."""
        return any(slot.now is not None for slot in self.slots.values())

    def end_iteration(self) -> list[Tensor]:
        """Drop every pass; return the overflow flags of the steps that move the scale (not those a guard skipped)."""
        flags = [
            slot.now.found
            for slot in self.slots.values()
            if slot.now is not None and not (slot.now.verdict is not None and slot.now.verdict.action == "skip")
        ]
        for slot in self.slots.values():
            slot.now = None
        return flags

    def copy(self) -> Slots:
        """The same optimizers at the same positions, routes undecided and no pass (for an engine taking over)."""
        copied = Slots()
        copied.slots = {key: _Slot(s.position, s.fused_allowed, s.optimizer) for key, s in self.slots.items()}
        return copied


@dataclass
class SkipCount:
    """Skipped steps in all, in a row, and stuck in a row (restored from checkpoints); ``limit`` stops a run.

    Examples:
        >>> count = SkipCount(limit=2)
        >>> [count.count(StepResult(skipped=True)) for _ in range(2)], count.skipped, count.stuck
        ([False, True], 2, 2)
    """

    limit: int | None
    skipped: int = 0
    consecutive: int = 0
    stuck: int = 0

    def count(self, result: StepResult) -> bool:
        """Count one step; return whether it makes the stuck skips reach the limit."""
        if not result.skipped:
            self.consecutive = self.stuck = 0
            return False
        self.skipped, self.consecutive = self.skipped + 1, self.consecutive + 1
        self.stuck += not result.backed_off
        return self.limit is not None and self.stuck >= self.limit

    def counters(self) -> dict[str, int]:
        """The counters under their checkpoint keys (``"_floor_skips"``: the stuck skips in a row)."""
        return {"skipped_steps": self.skipped, "consecutive_skips": self.consecutive, "_floor_skips": self.stuck}


class StepLog:
    """What became of the optimizer steps: their results, the skip counts, and the LR schedulers held on skips.

    The engine decides a step; the log keeps it. A fused step's values wait on the device (:class:`PendingStep`)
    until something reads them: :meth:`count_pending` counts them, in order, before anything newer is counted.

    Attributes:
        recent: the last optimizer steps' results, newest last (1024 kept).
        skips: the skip counts and the limit.
        pending: the fused steps not counted yet (:class:`~.pending.PendingReads`).
        held_schedulers: the LR schedulers held still while their optimizer's steps are skipped.
        recorded: the count of optimizer steps recorded.

    Examples:
        >>> log = StepLog(limit=None)
        >>> log.add(torch.optim.SGD([torch.zeros(1)]), StepResult(skipped=True)); log.skips.count(log.recent[-1])
        False
        >>> log.recorded, log.counted().skipped
        (1, 1)
    """

    def __init__(self, limit: int | None) -> None:
        self.recent: deque[StepResult | PendingStep] = deque(maxlen=_RECENT_STEPS)
        self.skips = SkipCount(limit)
        self.pending = PendingReads()
        self.held_schedulers = SchedulerHold(self.read_ready)
        self.recorded = 0

    def read_ready(self) -> None:
        """Read the fused steps whose values have arrived, waiting for nothing (what a held scheduler asks)."""
        self.pending.read_ready()

    def add(self, optimizer: Optimizer, result: StepResult | PendingStep) -> None:
        """Record one step's result (a fused step's, pending, in :attr:`pending` too: see :meth:`add_pending`)."""
        self.recorded += 1
        self.recent.append(result)
        if self.held_schedulers.schedulers:  # a held scheduler asks its optimizer's steps (only then are they noted)
            self.held_schedulers.record(optimizer, result)

    def add_pending(self, optimizer: Optimizer, step: PendingStep, values: Tensor) -> None:
        """Record a fused step whose ``values`` are on the device (:meth:`~.pending.PendingReads.add`)."""
        self.pending.add(step, values)
        self.add(optimizer, step)

    def count_pending(self) -> StepResult | None:
        """Count the fused steps not counted yet, in order (their values read); return the one at the limit."""
        for step in self.pending.take():
            result = step.result  # type: ignore[attr-defined]
            if self.skips.count(result):
                return result  # type: ignore[no-any-return]
        return None

    def counted(self) -> SkipCount:
        """The skip counts with the fused steps not counted yet included (read; the counts here stay as they are)."""
        if not self.pending.entries:
            return self.skips
        ahead = replace(self.skips)
        self.pending.read()
        for step in self.pending.entries:
            ahead.count(step.result)  # type: ignore[attr-defined]
        return ahead

    def restore(self, counters: Mapping[str, int]) -> None:
        """Set the skip counters from a checkpoint's (:meth:`SkipCount.counters`'s keys); pending steps are dropped."""
        self.pending = PendingReads()
        self.skips.skipped = counters["skipped_steps"]
        self.skips.consecutive = counters["consecutive_skips"]
        self.skips.stuck = counters["_floor_skips"]

    def continue_from(self, previous: StepLog) -> None:
        """Keep ``previous``'s results and held schedulers (a scaler replaced); the counts stay this log's own."""
        self.recent, self.recorded = previous.recent, previous.recorded
        self.held_schedulers = previous.held_schedulers
        self.held_schedulers.read_ready = self.read_ready

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with every step read and counted (device values belong to this process)."""
        state = self.__dict__.copy()
        recent = [step.result if isinstance(step, PendingStep) else step for step in self.recent]
        state.update(recent=deque(recent, maxlen=_RECENT_STEPS), skips=self.counted(), pending=PendingReads())
        return state


class GradientCheck:
    """The check of each optimizer's gradients, once per step.

    GradScaler's unscale-and-flag pass on the device, their global norm when something reads it, and the one host read
    of what the pass found (a :class:`_Pass`).

    Attributes:
    loss_scale: the loss scale the gradients carry (``None``: they are unscaled by 1.0, checked only).
    ranks: where the gradients live across ranks (:class:`~.sharding.Ranks`; ``None`` in one process).
    spike_guards: each optimizer's :class:`~.spikes.SpikeGuard` (``None`` without a guard).
    names: what to call each parameter in diagnostics, by ``id``.

    Examples:
        >>> check = GradientCheck(None, None)
        >>> param = torch.nn.Parameter(torch.ones(2)); param.grad = torch.tensor([1.0, float("inf")])
        >>> optimizer = torch.optim.SGD([param])
        >>> now = check.unscale(optimizer, by_one=False); check.read(now, 0, optimizer)
        >>> now.overflow, now.names
        (True, ['param_groups[0][0]'])
    """

    def __init__(self, loss_scale: LossScale | None, spike_guards: SpikeGuards | None) -> None:
        self.loss_scale = loss_scale
        self.spike_guards = spike_guards
        self.ranks: Ranks | None = None
        self.names: dict[int, str] = {}

    def unscale(self, optimizer: Optimizer, *, by_one: bool) -> _Pass:
        """The check's pass, on the device, in place: unscale ``optimizer``'s gradients and flag inf/NaN.

        The gradients are multiplied by 1 / scale (by 1.0 without a loss scale, or ``by_one`` for a fused optimizer,
        whose kernel unscales).

        GradScaler's own kernel, once per device and dtype: the values equal GradScaler's unscale bit for bit. The
        flag (float32, shape ``(1,)``, exactly 1.0 or 0.0: the CPU's fused kernels skip only on 1.0) is the same on
        every rank. No host read.
        """
        params, grads = [], []
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse and grad.dtype == torch.float16:
                    # As GradScaler: duplicates of scaled fp16 values may overflow when summed, so check them summed.
                    param.grad = grad = grad.coalesce()
                params.append(param)
                grads.append(grad)
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for grad in grads if self.ranks is None else self.ranks.local(grads):  # one loop: it runs cache-cold
            values = grad._values() if grad.is_sparse else grad
            groups.setdefault((values.device, values.dtype), []).append(values)
        device = next(iter(groups))[0] if groups else torch.device("cpu")
        found = torch.zeros(1, dtype=torch.float32, device=device)
        for (where, _), values in groups.items():
            here = found if where == device else torch.zeros(1, dtype=torch.float32, device=where)
            if by_one or self.loss_scale is None:
                inverse = _filled(1.0, where)
            else:  # as GradScaler: 1 / scale in float64 (float32 on MPS), rounded once to float32
                scale = self.loss_scale.tensor(where)  # places the state first, which sets its wide dtype
                inverse = scale.to(self.loss_scale.wide).reciprocal().float().reshape(1)
            torch._amp_foreach_non_finite_check_and_unscale_(values, here, inverse)
            if here is not found:
                found += here.to(device)
        if self.ranks is not None:
            found = self.ranks.reduce_flag(found)
        if len(groups) > 1 or (self.ranks is not None and self.ranks.sharding is not None):  # a sum of flags
            found = (found > 0).float()
        return _Pass(params, grads, found)

    def read(self, now: _Pass, position: int, optimizer: Optimizer, clip: float | None = None) -> None:
        """Read the check on the host, once, and decide the step.

        One read: the flag, the norm (if measured), a clip's coefficient (for ``clip``, a max norm), the scale and the
        hysteresis tracker. Then the spike guard's verdict and, on an overflow, the non-finite gradients' names.
        """
        if now.read:
            return
        read = [now.found]
        if now.norm is not None:
            read.append(now.norm.reshape(1))
            if clip is not None:
                read.append(_grads.clip_coefficient(now.norm, clip).reshape(1))
        # The step's one host read, every value read exactly: in the loss scale's float64 (float32 on MPS, which has
        # no float64); without a loss scale, in the widest of the flag's float32 and the norm's dtype.
        device, wide = now.found.device, torch.float32
        if self.loss_scale is not None:  # placed on the flag's device if no unscale placed it (a check by 1.0)
            read += [self.loss_scale.tensor(device).reshape(1), self.loss_scale.hysteresis.reshape(1)]
            wide = self.loss_scale.wide
        elif now.norm is not None:
            wide = torch.promote_types(wide, now.norm.dtype)
        values = torch.cat([value.to(device, wide) for value in read]).tolist()
        now.read, now.overflow = True, values[0] != 0.0
        if now.norm is not None:
            now.grad_norm = values[1]
            now.coefficient = values[2] if clip is not None else None
        if self.spike_guards is not None and now.grad_norm is not None and not now.overflow:
            if not math.isfinite(now.grad_norm):  # finite values whose norm passes float32: the guard has no number
                now.overflow, now.found = True, _filled(1.0, now.found.device)
            else:
                now.verdict = self.spike_guards.of(position).judge(now.grad_norm)
                if now.verdict.action == "clip":  # before any clip of the user's, which measures the clipped values
                    self._clip_spike(now, now.verdict.threshold_norm, clip)
        now.skipped = now.overflow or (now.verdict is not None and now.verdict.action == "skip")
        if now.overflow:
            # Named now, while the gradients are there (a skip is rare: the lookup costs a pass). A clip by value
            # since the check may have made them finite: then they cannot be named.
            now.names = self.nonfinite_names(optimizer, now.params)
        if self.loss_scale is not None:
            now.scale = values[-2]
            now.backs_off = now.overflow and self.loss_scale.policy.backs_off(values[-2], values[-1])

    def local(self, params: Sequence[Tensor]) -> list[Tensor]:
        """The gradients of ``params`` as this rank holds them."""
        grads = [p.grad for p in params if p.grad is not None]
        return grads if self.ranks is None else self.ranks.local(grads)

    def nonfinite_names(self, optimizer: Optimizer, owners: list[Tensor], norms: Tensor | None = None) -> list[str]:
        """The names of ``owners`` whose gradient norm (``norms``, or measured now) is non-finite.

        A host read, made only for a skipped step. A parameter without a name is called by its place in ``optimizer``.
        """
        with torch.no_grad():
            if norms is None:
                local = self.local(owners)
                norms = _grads.measure(local, local[0].device)
        bad = set(torch.nonzero(~torch.isfinite(norms)).flatten().tolist())
        groups = optimizer.param_groups
        places = {id(p): f"param_groups[{g}][{i}]" for g, grp in enumerate(groups) for i, p in enumerate(grp["params"])}
        return [self.names.get(id(p), places.get(id(p), "?")) for i, p in enumerate(owners) if i in bad]

    def fused_values(
        self, now: _Pass, optimizer: Optimizer, measure: bool
    ) -> tuple[Tensor, Callable[[], list[str]] | None]:
        """A fused step's values on the device, and, when ``measure`` (a reader), how to name its non-finite gradients.

        The values are ``[flag, scaled norm, scale, hysteresis tracker]`` (NaN where there is none); the names are
        looked up once the step is known skipped.

        Measured, the norms are of the scaled gradients, read-only: each one's kept to name the non-finite ones.
        """
        device, loss_scale = now.found.device, self.loss_scale
        nan = _filled(math.nan, device)  # cached: only read
        norm, namer = nan, None
        if measure:
            norms = _grads.measure(self.local(now.params), device)
            norm = _grads.global_norm(now.grads, device, self.ranks).reshape(1).to(device)
            namer = functools.partial(self.nonfinite_names, optimizer, now.params, norms)
        state = [nan, nan] if loss_scale is None else [loss_scale.scale.reshape(1), loss_scale.hysteresis.reshape(1)]
        return torch.cat([now.found, norm.float(), *(value.to(device) for value in state)]), namer

    def diagnosis(self, result: StepResult, slot: _Slot | None, skips: SkipCount) -> str:
        """Why the run cannot make progress, at ``result``, the step at which the skip limit is reached.

        The non-finite gradients are the step's own names or, for a fused step nobody measured, those of its
        optimizer's gradients if this iteration's are still there (``slot``'s: still scaled, and scaling keeps a
        value finite or not).
        """
        names = result.overflow_params
        if names is None and slot is not None and slot.now is not None:
            owners = [p for p in slot.now.params if p.grad is not None]
            names = self.nonfinite_names(slot.optimizer, owners) if owners else None
        if result.spike_verdict is not None:
            stall = SPIKE_STALL
        elif self.loss_scale is None or result.scale is None:
            stall = BF16_STALL
        else:
            stall = self.loss_scale.stall(result.scale)
        limit, stuck, skipped, verdict = skips.limit, skips.stuck, skips.skipped, result.spike_verdict
        return diagnosis(stuck=stuck, skipped=skipped, limit=limit, names=names, verdict=verdict, stall=stall)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the names: they are keyed by the parameters' ``id`` in this process."""
        return {**self.__dict__, "names": {}}

    def _clip_spike(self, now: _Pass, limit: float, clip: float | None) -> None:
        """Clip a spike as ``clip_grad_norm_(max_norm=limit)`` does, bit for bit; measure the clipped gradients.

        The new norm serves the user's clip by ``clip`` too. A spike is rare: the reads and the pass cost nothing.
        """
        assert now.norm is not None
        _grads.clip_by_norm_(self.local(now.params), float(_grads.clip_coefficient(now.norm, limit).item()))
        now.norm = _grads.global_norm(now.grads, now.norm.device, self.ranks)
        now.grad_norm = float(now.norm.item())
        if clip is not None:
            now.coefficient = float(_grads.clip_coefficient(now.norm, clip).item())


class StepEngine:
    """Scale, check once, clip, step or skip, update once, record (see the module docstring).

    Args:
        loss_scale: the fp16 loss scale, or ``None`` (bf16: nothing to scale).
        check: check each step's gradients and skip on inf/NaN (always, with a loss scale); ``False`` steps blindly.
        max_consecutive_skips: stuck skips in a row after which ``step()`` raises ``FloatingPointError`` with a
            diagnosis (on the fused path, at the first step by which the limit could have been reached, when the
            steps' values are read); ``None`` never.
        spike_guard: judge each finite gradient norm (:mod:`~.spikes`): skip a spike (counted, the scale left alone)
            or clip it before any clip of the user's; one guard per optimizer. Needs the check; no fused path.

    Attributes:
        check: whether steps are checked.
        gradients: the check of each optimizer's gradients, with the loss scale, the ranks and the spike guards
            (:class:`GradientCheck`).
        slots: the optimizers known, each with its route and this iteration's pass (:class:`Slots`).
        log: the steps' results, the skip counts and the LR schedulers held on skips (:class:`StepLog`).

    State (besides those): whether a reader asked for every step's norm.
    """

    def __init__(
        self,
        loss_scale: LossScale | None = None,
        *,
        check: bool = True,
        max_consecutive_skips: int | None = 50,
        spike_guard: SpikeGuard | None = None,
    ) -> None:
        self.check = check or loss_scale is not None
        require(
            spike_guard is None or self.check,
            "spike_guard",
            spike_guard,
            "needs the gradients checked: drop check=False, or the guard",
            "StepEngine",
        )
        self.gradients = GradientCheck(loss_scale, None if spike_guard is None else SpikeGuards(spike_guard))
        self.log = StepLog(_skip_limit(max_consecutive_skips))
        self.slots = Slots()
        self._norms_read = spike_guard is not None  # every step's norm is measured: a guard judges it, or a reader asks

    def __setattr__(self, name: str, value: Any) -> None:
        # A name the engine does not have is refused, not set and ignored (`engine.process_group = group` is how ranks
        # were once set); its own names and its methods can be set (mock.patch.object), as the scaler's can.
        if name not in _OWN_ATTRIBUTES and not hasattr(type(self), name):
            ranks = name in ("process_group", "sharding")
            fix = " Set `engine.ranks` to a `lightning_amp_plus.step.sharding.Ranks`." if ranks else ""
            raise AttributeError(f"`StepEngine` has no attribute {name!r}: setting it would do nothing.{fix}")
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------------------------------------------ set-up
    @property
    def loss_scale(self) -> LossScale | None:
        """The loss scale (``None`` without one)."""
        return self.gradients.loss_scale

    @property
    def spike_guards(self) -> SpikeGuards | None:
        """Each optimizer's :class:`~.spikes.SpikeGuard` (``None`` without a guard)."""
        return self.gradients.spike_guards

    @property
    def ranks(self) -> Ranks | None:
        """Where the gradients live across ranks (:class:`~.sharding.Ranks`; ``None`` in one process).

        Every rank then takes the same skip decision (the front ends set it under DDP and FSDP).
        """
        return self.gradients.ranks

    @ranks.setter
    def ranks(self, ranks: Ranks | None) -> None:
        self.gradients.ranks = ranks

    @property
    def max_consecutive_skips(self) -> int | None:
        """Stuck skips in a row that stop the run (``None``: never)."""
        return self.log.skips.limit

    @max_consecutive_skips.setter
    def max_consecutive_skips(self, value: int | None) -> None:
        self.log.skips.limit = _skip_limit(value)

    def track(self, optimizer: Optimizer, *, fused: bool = True) -> int:
        """Know ``optimizer`` (numbered after those known, if new) and return its position.

        Args:
            optimizer: the optimizer (a wrapper exposing ``.optimizer`` is looked through).
            fused: whether its steps may take the fused path; ``False`` when something reads its unscaled gradients
                before every step or steps it in place of ``optimizer.step()`` (the front end knows).
        """
        return self.slots.track(optimizer, fused=fused)

    def knows(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` has been tracked (however it is wrapped)."""
        return self.slots.get(optimizer) is not None

    def name_parameters(self, named: nn.Module | Iterable[tuple[str, Tensor]]) -> None:
        """What to call each parameter in diagnostics (a module, or ``named_parameters()`` pairs).

        Without names, parameters are called by their place in the optimizer, e.g. ``param_groups[0][3]``.
        """
        pairs = named.named_parameters() if isinstance(named, nn.Module) else named
        self.gradients.names = {id(param): name for name, param in pairs}

    def guard_spikes(self, guard: SpikeGuard) -> None:
        """Judge every step's norm with ``guard`` (one copy per optimizer), as ``StepEngine(spike_guard=...)`` does.

        For an engine made without one (a scaler's, when a plugin with a guard drives it), before its first step.
        """
        self.gradients.spike_guards = SpikeGuards(guard)
        self._norms_read = True

    def read_norms(self) -> None:
        """Measure every step's norm from now on (``StepResult.grad_norm``): a reader (the monitor) asks for them."""
        self._norms_read = True

    @property
    def norms_read(self) -> bool:
        """Whether every step's norm is measured (a reader asked, :meth:`read_norms`, or a spike guard judges it)."""
        return self._norms_read

    def take_over(self, previous: StepEngine) -> None:
        """Continue where ``previous`` left off (a plugin's scaler replaced).

        Its optimizers, names, ranks, held schedulers, spike guards, norm readers and recent results carry over; the
        skip counts and the scale stay this engine's own.
        """
        self.ranks, self.gradients.names = previous.ranks, dict(previous.gradients.names)
        self._norms_read = previous._norms_read
        self.slots = previous.slots.copy()
        self.gradients.spike_guards = previous.spike_guards
        self.log.continue_from(previous.log)

    # -------------------------------------------------------------------------------------------- the recipe
    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call ``backward()`` on: multiplied by the loss scale under fp16, as it is otherwise."""
        loss_scale = self.gradients.loss_scale
        return loss if loss_scale is None else loss * loss_scale.tensor(loss.device)

    def unscale(self, optimizer: Optimizer, *, norm: bool = False, read: bool = False) -> None:
        """Unscale and check ``optimizer``'s gradients (once per step), on the device; measure their norm if asked.

        As GradScaler's ``unscale_``, nothing is read on the host here unless ``read``: the check is read once, when
        the host first needs it (a clip by norm, the step), together with the norm. A second call does nothing but
        measure the norm if it is asked for now and was not measured.

        Args:
            optimizer: the optimizer whose gradients to unscale.
            norm: measure the global norm too (a clip by norm follows); it is measured anyway when a reader asked.
            read: read the check on the host now (the step's one host read), before something changes the gradients
                (a clip by value) under the names of the non-finite ones.

        Raises:
            RuntimeError: ``optimizer`` already stepped this iteration (call ``update()`` first).
        """
        if not self.check:
            return
        slot = self.slots.of(optimizer)
        now = slot.now
        if now is None:
            now = slot.now = self.gradients.unscale(optimizer, by_one=False)
        elif now.stage is Stage.STEPPED:
            raise RuntimeError("`unscale_()` was called after `step()` for this optimizer: call `update()` first.")
        if (norm or self._norms_read) and now.norm is None:
            now.norm = _grads.global_norm(now.grads, now.found.device, self.gradients.ranks)
            if now.read:  # read already: the norm is read now
                now.grad_norm = float(now.norm.item())
        if read:
            self.gradients.read(now, slot.position, slot.optimizer)

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
        self.unscale(optimizer, norm=True)
        slot = self.slots.of(optimizer)
        now = slot.now
        assert now is not None and now.norm is not None  # measured by the unscale
        if not now.read:  # the coefficient read with the check: the step's one host read
            self.gradients.read(now, slot.position, slot.optimizer, clip=max_norm)
        else:
            now.coefficient = float(_grads.clip_coefficient(now.norm, max_norm).item())
        assert now.grad_norm is not None and now.coefficient is not None
        if not now.skipped:
            ranks = self.gradients.ranks
            _grads.clip_by_norm_(now.grads if ranks is None else ranks.local(now.grads), now.coefficient)
        return now.grad_norm

    def step(
        self,
        optimizer: Optimizer,
        apply: Callable[[], Any] | None = None,
        *,
        unscale: Callable[[Optimizer], None] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Step ``optimizer`` (or run ``apply`` in its place) unless its gradients hold inf/NaN; record the result.

        Gradients not unscaled yet are unscaled and checked here (by ``unscale``, if given: a scaler's ``unscale_``,
        which GradScaler's step calls so), unless the optimizer takes the fused path and unscales in its own kernel.

        Returns:
            What the step returned, or ``None`` when it was skipped on the host.

        Raises:
            FloatingPointError: the skip limit was reached.
        """
        slot = self.slots.of(optimizer)
        run = functools.partial(optimizer.step, **kwargs) if apply is None else apply
        if not self.check:  # nothing checked: no stage to keep (a disabled scaler steps as often as it is told)
            self.log.add(optimizer, StepResult(skipped=False, index=self.log.recorded, optimizer=slot.position))
            return run()
        if "closure" in kwargs:
            raise ValueError(
                "`step(optimizer, closure=...)`: closures are not supported, because the gradients must be checked "
                "before the step. Run the closure yourself, then call `step(optimizer)`."
            )
        now = slot.now
        if now is None:
            guarded = self.gradients.spike_guards is not None
            if apply is None and slot.fused is not False and slot.takes_fused_path(guarded):
                return self._step_fused(slot, optimizer, kwargs)
            if unscale is not None:
                unscale(optimizer)  # the caller's (a scaler's unscale_, which calls self.unscale) makes the pass
                now = slot.now
                assert now is not None
            else:
                now = slot.now = self.gradients.unscale(optimizer, by_one=False)
                if self._norms_read:
                    now.norm = _grads.global_norm(now.grads, now.found.device, self.gradients.ranks)
        elif now.stage is Stage.STEPPED:
            raise RuntimeError("`step()` was already called for this optimizer: call `update()` first.")
        if self.log.pending.entries:
            self._count_pending()  # the fused steps before this one come first
        self.gradients.read(now, slot.position, slot.optimizer)
        now.stage = Stage.STEPPED
        result = StepResult(
            skipped=now.skipped,
            scale=now.scale,
            grad_norm=now.grad_norm,
            overflow_params=now.names,
            spike_verdict=now.verdict,
            backed_off=now.backs_off,
            index=self.log.recorded,
            optimizer=slot.position,
        )
        self.log.add(optimizer, result)
        if self.log.skips.count(result):
            self._stop(result)
        if result.skipped:
            return None
        stepped = run()
        if now.verdict is not None:
            assert self.gradients.spike_guards is not None
            self.gradients.spike_guards.of(slot.position).observe(now.verdict)
        return stepped

    def update(self, new_scale: float | None = None) -> None:
        """End the iteration: move the loss scale once for every optimizer stepped since the last call.

        The flags stay on the device and the scale moves there (no host read). A step the spike guard skipped leaves
        the scale as if its batch had not been seen.

        Args:
            new_scale: set the scale to this value instead of moving it by the policy (clamped by the caller).
        """
        flags, loss_scale = self.slots.end_iteration(), self.gradients.loss_scale
        if loss_scale is None:
            return
        if new_scale is not None:
            loss_scale.set(new_scale)
        elif flags:
            loss_scale.advance(flags[0] if len(flags) == 1 else torch.cat(flags).amax())

    def discard(self, optimizer: Optimizer) -> None:
        """Forget a check made for a step that does not happen after all (the next one checks afresh)."""
        slot = self.slots.get(optimizer)
        if slot is not None and slot.now is not None and slot.now.stage is Stage.UNSCALED:
            slot.now = None

    # --------------------------------------------------------------------------------------------- readings
    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped since the start (restored from checkpoints; reads fused steps' values)."""
        return self.log.counted().skipped

    def result(self, optimizer: Optimizer) -> StepResult | PendingStep | None:
        """The result of ``optimizer``'s latest step (``None`` before its first)."""
        slot = self.slots.get(optimizer)
        position = None if slot is None else slot.position
        return next((result for result in reversed(self.log.recent) if result.optimizer == position), None)

    def found_inf(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s gradients were found non-finite this iteration (``False`` before a check)."""
        slot = self.slots.get(optimizer)
        if slot is None or slot.now is None or slot.now.stage is not Stage.UNSCALED:
            return False
        self.gradients.read(slot.now, slot.position, slot.optimizer)
        return slot.now.overflow

    # ------------------------------------------------------------------------------------------- checkpoints
    def scaler_state_dict(self) -> dict[str, Any]:
        """The loss scale's state and the skip counters, in plain Python numbers (a ``DynamicLossScaler``'s state).

        Without a loss scale, the counters alone (under the same keys).
        """
        counters = self.log.counted().counters()
        if self.loss_scale is None:
            return counters
        return {**self.loss_scale.state_dict(), "max_consecutive_skips": self.max_consecutive_skips, **counters}

    def load_scaler_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`scaler_state_dict` (or a ``torch.amp.GradScaler`` state): scale, trackers, skip counters.

        The constants this engine was built with stay in force; if the saved ones differ, a warning says which.

        Raises:
            TypeError: the state is not a mapping, or a value has the wrong type.
            ValueError: a key is missing or a value is out of range.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"A scaler state's `load_state_dict` expects a dict, got {type(state).__name__}.")
        counters = {key: read_count(state, key, 0) for key in self.log.skips.counters()}
        if self.loss_scale is not None:
            self.loss_scale.load_state_dict(state)
            _warn_if_built_otherwise(state, self.scaler_state_dict())
        self.slots.end_iteration()
        self.log.restore(counters)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, the scheduler steps held and, with a guard, each optimizer's guard state."""
        state = {"held_scheduler_steps": self.log.held_schedulers.held_steps, "scaler": self.scaler_state_dict()}
        if self.spike_guards is not None:
            state["spike_guard"] = self.spike_guards.state_dict()
        return state

    def load_state_dict(self, scaler: Mapping[str, Any], held_scheduler_steps: int, spike_guard: Any = None) -> None:
        """Restore :meth:`state_dict`'s parts (a guard not made yet gets its state when it is).

        A spike guard state is loaded only into an engine with a guard (without one, nothing judges norms).
        """
        self.load_scaler_state_dict(scaler)
        self.log.held_schedulers.held_steps = held_scheduler_steps
        if spike_guard is not None and self.spike_guards is not None:
            self.spike_guards.load_state_dict(spike_guard)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle between iterations only (as GradScaler): device values are read, parameter references dropped."""
        if self.slots.busy():
            raise RuntimeError(
                "A step engine can be pickled only between iterations: before `scale()` or after `update()`."
            )
        return self.__dict__

    # ------------------------------------------------------------------------------------------ the fused path
    def _step_fused(self, slot: _Slot, optimizer: Optimizer, kwargs: dict[str, Any]) -> Any:
        """The fused path: GradScaler's check by 1.0, the flag and the scale to the kernel, no host read."""
        now = slot.now = self.gradients.unscale(optimizer, by_one=True)  # by 1.0: the optimizer's kernel unscales
        now.stage, loss_scale, log = Stage.STEPPED, self.gradients.loss_scale, self.log
        values, namer = self.gradients.fused_values(now, optimizer, measure=self._norms_read)
        log.add_pending(
            optimizer, PendingStep(log.pending, log.recorded, slot.position, _policy(loss_scale), namer), values
        )
        scale = None if loss_scale is None else loss_scale.tensor(now.found.device)
        output = _step_with_flags(optimizer, _innermost(optimizer), scale, now.found.reshape(()), kwargs)
        waiting, skips = len(log.pending.entries), log.skips
        if waiting >= PENDING_MAX or (skips.limit is not None and waiting >= skips.limit - skips.stuck):
            # The skip limit could be reached by now: counted here, while a diagnosis can still name the gradients.
            self._count_pending()
        return output

    # -------------------------------------------------------------------------------------- counts, records
    def _count_pending(self) -> None:
        """Count the fused steps not counted yet, in order; at the limit, stop."""
        at_limit = self.log.count_pending()
        if at_limit is not None:
            self._stop(at_limit)

    def _stop(self, result: StepResult) -> None:
        """The skip limit is reached at ``result``: raise the diagnosis (an ``update()`` after it moves nothing)."""
        slot = self.slots.at(result.optimizer)
        message = self.gradients.diagnosis(result, slot, self.log.skips)
        if slot is not None:
            slot.now = None
        raise FloatingPointError(message)


# ------------------------------------------------------------------------------------------------------- helpers
def _policy(loss_scale: LossScale | None) -> ScalePolicy | None:
    return None if loss_scale is None else loss_scale.policy


@functools.lru_cache(maxsize=64)
def _filled(value: float, device: torch.device) -> Tensor:
    # Cached: the kernel only reads it, and the same value (1.0) comes back every step.
    return torch.full((1,), value, dtype=torch.float32, device=device)


def _step_with_flags(
    optimizer: Optimizer, inner: Optimizer, scale: Tensor | None, found_inf: Tensor, kwargs: dict[str, Any]
) -> Any:
    """``optimizer.step(**kwargs)`` with ``grad_scale`` and ``found_inf`` set on ``inner``, both removed after.

    ``inner`` is the optimizer whose kernel runs: a wrapper such as Lightning's ``LightningOptimizer`` would keep the
    attributes itself.

    As GradScaler: a ``grad_scale`` the user set is multiplied in.
    """
    user_scale = getattr(inner, "grad_scale", None)
    if scale is not None and user_scale is not None:
        scale = scale * user_scale
    inner.grad_scale = user_scale if scale is None else scale  # type: ignore[attr-defined]
    inner.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(**kwargs)
    finally:
        del inner.grad_scale  # type: ignore[attr-defined]
        del inner.found_inf  # type: ignore[attr-defined]


def _skip_limit(value: int | None) -> int | None:
    require(
        value is None or (is_int(value) and value >= 1),
        "max_consecutive_skips",
        value,
        "must be an int >= 1, or None to never stop",
    )
    return None if value is None else int(value)


def _warn_if_built_otherwise(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    """Say which constants a loaded scaler state was built with that differ from this engine's (which stay)."""
    keys = (*_CONSTANTS, "max_consecutive_skips")
    differing = {key: saved[key] for key in keys if key in saved and saved[key] != mine[key]}
    if differing:
        warnings.warn(
            f"The saved scaler was built with {differing}; this one keeps its own "
            f"{ {key: mine[key] for key in differing} }.",
            stacklevel=4,
        )


def _params(optimizer: Optimizer) -> Iterable[Tensor]:
    return (param for group in optimizer.param_groups for param in group["params"])


def _takes_grad_scaler_kwarg(kind: type[Optimizer]) -> bool:
    """GradScaler's old protocol, ``step(grad_scaler=...)``: for GradScaler itself only."""
    return "grad_scaler" in inspect.signature(kind.step).parameters


def _fused_capable(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` can unscale and skip inside its own kernel, safely, for the gradients it has now."""
    inner = _innermost(optimizer)
    if not getattr(inner, "_step_supports_amp_scaling", False) or _takes_grad_scaler_kwarg(type(inner)):
        return False
    grads = [param.grad for param in _params(optimizer) if param.grad is not None]
    if not grads or any(grad.is_sparse for grad in grads):
        return False
    return grads[0].device.type in _FUSED_DEVICE_TYPES


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
