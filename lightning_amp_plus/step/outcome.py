"""What optimizer steps did: their :class:`StepResult`, the fused path's values still on the device, the skip count.

* :class:`StepResult` is the one record of a step that everybody reads: the engine's ``recent_steps``, the scaler's
  ``result(optimizer)``, the monitor's history. On the unscale path it is complete when ``step()`` returns (the skip
  was decided on the host). On the fused-optimizer path the optimizer skips on the device and the result's values
  are still there: the first read of a field reads every such step's values in one go (:class:`PendingReads`) and
  keeps them. Reading never changes what any later call does.
* :class:`PendingReads` owns those device values, in order, until they are read (on CUDA each step's values are
  copied at once, asynchronously, into a pinned ring buffer, so the read waits only for the check, not for the
  optimizer kernels behind it).
* :class:`SkipCounter` counts skipped steps and stops a run that cannot make progress: a skip that backing off the
  loss scale could not help (the scale at its floor, a backoff factor of 1, an overflow the hysteresis tolerates, or
  no scale at all: a bf16 check) is *stuck*, and ``limit`` stuck skips in a row stop the run with a diagnosis.

Examples:
    >>> counter = SkipCounter(limit=2)
    >>> first, second = StepResult.known(skipped=True), StepResult.known(skipped=True)
    >>> counter.count(first), counter.count(second)
    (False, True)
    >>> counter.skipped, counter.consecutive, counter.stuck
    (2, 2, 2)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from lightning_amp_plus.step.float32 import f32

if TYPE_CHECKING:
    from lightning_amp_plus.step.spikes import SpikeVerdict

__all__ = ["BF16_STALL", "PENDING_MAX", "SPIKE_STALL", "PendingReads", "SkipCounter", "Stall", "StepResult"]

# Fused-path steps whose values may wait unread on the device, when no skip limit asks for them sooner.
PENDING_MAX = 256
_NAMES_SHOWN = 10


class StepResult:
    """What became of one optimizer step: applied or skipped, at what scale, with what gradient norm.

    Attributes:
        index: the engine's count of optimizer steps before this one (``None`` for a result made by hand).
        optimizer: the optimizer's position among the engine's optimizers (``None`` for a result made by hand).

    Examples:
        >>> from lightning_amp_plus.step.scaler import DynamicLossScaler
        >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1, fused=True)
        >>> scaler = DynamicLossScaler(init_scale=8.0)
        >>> scaler.scale(w.sum() * float("inf")).backward(); _ = scaler.step(opt); scaler.update()
        >>> result = scaler.result(opt)
        >>> result.resolved, result.skipped, result.resolved, result.scale, w.tolist()
        (False, True, True, 8.0, [1.0, 1.0])
        >>> StepResult.known(skipped=False, scale=None, grad_norm=2.0)
        StepResult(skipped=False, scale=None, grad_norm=2.0)
    """

    __slots__ = ("_backs_off", "_grad_norm", "_namer", "_names", "_pending", "_scale", "_skipped", "_verdict", "index",
                 "optimizer")  # fmt: skip

    def __init__(self, *, index: int | None = None, optimizer: int | None = None) -> None:
        self.index = index
        self.optimizer = optimizer
        self._skipped: bool | None = None
        self._scale: float | None = None
        self._grad_norm: float | None = None
        self._backs_off = False
        self._names: list[str] | None = None
        self._namer: Callable[[], list[str]] | None = None
        self._pending: PendingReads | None = None
        self._verdict: SpikeVerdict | None = None

    @classmethod
    def known(
        cls,
        *,
        skipped: bool,
        scale: float | None = None,
        grad_norm: float | None = None,
        overflow_params: list[str] | None = None,
        index: int | None = None,
        optimizer: int | None = None,
    ) -> StepResult:
        """A result known on the host (a step nothing checked, or one read off another tool's scale)."""
        result = cls(index=index, optimizer=optimizer)
        result.settle(skipped=skipped, scale=scale, grad_norm=grad_norm)
        result._names = list(overflow_params or [])
        return result

    def settle(
        self,
        *,
        skipped: bool,
        scale: float | None,
        grad_norm: float | None,
        backs_off: bool = False,
        verdict: SpikeVerdict | None = None,
    ) -> None:
        """Fill in what the step did (the engine does, on the host or from the device's values)."""
        self._skipped, self._scale, self._grad_norm, self._backs_off = skipped, scale, grad_norm, backs_off
        self._pending, self._verdict = None, verdict
        if not skipped:
            self._namer = None  # an applied step names nothing: drop what the lookup needed

    def _read(self) -> None:
        """Read the device's values (every pending step's, in one go) if this result's are still there."""
        if self._pending is not None:
            self._pending.read()

    @property
    def resolved(self) -> bool:
        """Whether the result is known on the host: reading the fields needs no device read."""
        return self._skipped is not None

    @property
    def ready(self) -> bool:
        """Whether reading the fields now would not wait for the device (true once resolved, and always on CPU)."""
        return self.resolved or self._pending is None or self._pending.ready(self)

    @property
    def skipped(self) -> bool:
        """Whether the step was skipped: parameters and optimizer state untouched (inf/NaN, or a spike skipped)."""
        if self._skipped is None:
            self._read()
        return bool(self._skipped)

    @property
    def overflowed(self) -> bool:
        """Whether the step was skipped because its gradients held inf/NaN (what a loss scaler backs off for)."""
        return self.skipped and self._verdict is None

    @property
    def spike_verdict(self) -> SpikeVerdict | None:
        """The spike guard's verdict on the step's gradient norm (``None`` without a guard, or for an overflow).

        ``spike_verdict.spike`` says whether the step was a spike (skipped, or clipped to ``threshold_norm``).
        """
        return self._verdict

    @property
    def scale(self) -> float | None:
        """The loss scale the step's gradients carried (``None`` where no scaler was involved)."""
        if self._skipped is None:
            self._read()
        return self._scale

    @property
    def grad_norm(self) -> float | None:
        """The global L2 norm of the step's unscaled gradients (inf or NaN for an overflow; ``None`` if not measured).

        After a spike guard's clip, the norm of the clipped gradients (``spike_verdict.norm`` is the one judged).
        """
        if self._skipped is None:
            self._read()
        return self._grad_norm

    @property
    def overflow_params(self) -> list[str]:
        """Names of the parameters whose gradients were non-finite (empty when the step was applied), looked up once."""
        if self._skipped is None:
            self._read()
        if self._names is None:
            namer, self._namer = self._namer, None  # drops what the lookup needed (the per-gradient norms)
            self._names = namer() if self._skipped and namer is not None else []
        return list(self._names or [])

    def __repr__(self) -> str:
        if not self.resolved:
            return "StepResult(unresolved)"
        return f"StepResult(skipped={self.skipped}, scale={self.scale!r}, grad_norm={self.grad_norm!r})"


class _Values(NamedTuple):
    """One fused step's values on the device: ``[flag, scaled norm]`` or ``[flag, scaled norm, scale, hysteresis]``."""

    result: StepResult
    values: Tensor
    backs_off: Callable[[float, float], bool] | None
    slot: int | None
    event: torch.cuda.Event | None


class PendingReads:
    """The fused path's steps whose values were on the device, in order, until the engine has counted them.

    A step's values are its overflow flag (1.0 or 0.0), the norm of its still-scaled gradients and, under a loss
    scale, the scale it carried and the hysteresis tracker before the update (whether an overflow lowered the scale).
    :meth:`read` fills every unread step's result in one host read; :meth:`take` hands the results over, in order, to
    be counted.

    State: ``entries``, the steps not counted yet (their results and device values); the pinned ring buffer (CUDA);
    the constant 0.0 and 1.0 flags per device.
    """

    def __init__(self) -> None:
        self.entries: list[_Values] = []
        self._ring: Tensor | None = None
        self._flags: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def flags(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The constant flags ``(0.0, 1.0)`` on ``device`` (exactly those: the CPU kernels skip only on 1.0)."""
        if device not in self._flags:
            one = torch.ones((), dtype=torch.float32, device=device)  # float32 whatever the default dtype (bf16-true)
            self._flags[device] = (torch.zeros_like(one), one)
        return self._flags[device]

    def add(self, result: StepResult, values: Tensor, backs_off: Callable[[float, float], bool] | None) -> None:
        """Keep a fused step's device ``values`` (see the class); ``backs_off(scale, hysteresis)`` judges overflows."""
        slot, event = self._copy_to_host(values) if values.device.type == "cuda" else (None, None)
        result._pending = self
        self.entries.append(_Values(result, values, backs_off, slot, event))

    def flags_of(self, results: list[StepResult]) -> list[Tensor]:
        """One iteration's overflow flags on the device (for the scale's update there, no host read).

        The flags of ``results`` not read yet, and a 1.0 flag if any of them is known on the host to have overflowed.
        """
        wanted = {id(result) for result in results}
        flags = [e.values[0] for e in self.entries if id(e.result) in wanted and e.result._skipped is None]
        device = flags[0].device if flags else next(iter(self._flags))
        if any(result._skipped and result._verdict is None for result in results):  # a spike skip is no overflow
            flags.append(self.flags(device)[1])
        return flags or [self.flags(device)[0]]

    def results(self) -> list[StepResult]:
        """The results not counted yet, oldest first (read first: their fields are known)."""
        self.read()
        return [entry.result for entry in self.entries]

    def take(self) -> list[StepResult]:
        """The results not counted yet, read, oldest first; forgotten here (the caller counts them)."""
        results = self.results()
        self.entries = []
        return results

    def ready(self, result: StepResult) -> bool:
        """Whether reading ``result``'s values would not wait for the device."""
        for entry in self.entries:
            if entry.result is result and entry.event is not None:
                return bool(entry.event.query())  # type: ignore[no-untyped-call]
        return True

    def read(self) -> None:
        """Read every unread step's values (one host read) into its result."""
        unread = [entry for entry in self.entries if not entry.result.resolved]
        if not unread:
            return
        rows: dict[int, list[float]] = {}
        ringed = [entry for entry in unread if entry.event is not None]
        if ringed and self._ring is not None:
            ringed[-1].event.synchronize()  # type: ignore[union-attr]  # the last check has run, not the kernels after
            table = self._ring[: max(entry.slot or 0 for entry in ringed) + 1].tolist()
            rows = {id(entry): table[entry.slot or 0][: entry.values.numel()] for entry in ringed}
        rest = [entry for entry in unread if entry.event is None]
        if rest:
            flat = torch.cat([entry.values.to(rest[0].values.device) for entry in rest]).tolist()
            start = 0
            for entry in rest:
                rows[id(entry)] = flat[start : start + entry.values.numel()]
                start += entry.values.numel()
        for entry in unread:
            _settle_from(entry, rows[id(entry)])

    def _copy_to_host(self, values: Tensor) -> tuple[int | None, torch.cuda.Event | None]:
        """On CUDA: start copying the step's values to pinned memory, so a later read waits for nothing else."""
        if self._ring is None:
            self._ring = torch.empty(PENDING_MAX + 16, 4, dtype=torch.float32, pin_memory=True)
        slot = len(self.entries)
        if slot >= len(self._ring):
            return None, None  # read the slow way
        self._ring[slot, : values.numel()].copy_(values, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return slot, event


def _settle_from(entry: _Values, row: list[float]) -> None:
    """Fill a result from its device values: the flag, the scaled norm and, under a loss scale, scale and tracker."""
    flag, scaled_norm = row[0] != 0.0, row[1]
    if entry.backs_off is None:
        entry.result.settle(skipped=flag, scale=None, grad_norm=scaled_norm)
        return
    scale, hysteresis = row[2], row[3]
    norm = f32(scaled_norm * f32(1.0 / scale))  # 1 / scale rounded once to float32, as the unscale path divides
    entry.result.settle(
        skipped=flag, scale=scale, grad_norm=norm, backs_off=flag and entry.backs_off(scale, hysteresis)
    )


class Stall(NamedTuple):
    """Why a run of stuck skips happened, in the guard's words: what stood still, why, and what to try."""

    what: str
    why: str
    fix: str


BF16_STALL = Stall(
    "for non-finite gradients",
    "The model produces inf/NaN gradients.",
    "check the inputs and the loss for inf/NaN, lower the learning rate, or clip gradients",
)
"""Why a check without a loss scale (bf16) stalls: nothing but the model can make the gradients finite."""

SPIKE_STALL = Stall(
    "as gradient-norm spikes (SpikeGuard, action='skip')",
    "The gradient norm rose and stayed above the guard's limit: a skipped spike never enters the running statistics, "
    "so after a lasting rise (a new phase of the data, a learning-rate restart) every step is judged a spike.",
    "SpikeGuard(action='clip'), whose clipped steps enter the statistics and so follow a lasting rise, or a higher "
    "`threshold`",
)
"""Why a run of spike skips stalls: the guard's statistics cannot follow a lasting rise it keeps skipping."""


class SkipCounter:
    """Skipped steps in all, in a row, and stuck in a row; whether the limit is reached.

    State: ``skipped``, ``consecutive`` and ``stuck`` (counters, restored from checkpoints), and ``last_skip`` (the
    result of the last skipped step, for the diagnosis). ``limit`` is configuration (``None``: never stop).
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.skipped = 0
        self.consecutive = 0
        self.stuck = 0
        self.last_skip: StepResult | None = None

    def count(self, result: StepResult) -> bool:
        """Count one step (its result is read); return whether it makes the stuck skips reach the limit."""
        if not result.skipped:
            self.consecutive = self.stuck = 0
            return False
        self.skipped += 1
        self.consecutive += 1
        self.last_skip = result
        if not result._backs_off:
            self.stuck += 1
        return self.limit is not None and self.stuck >= self.limit

    def due_within(self, uncounted: int) -> bool:
        """Whether ``uncounted`` steps could already have reached the limit (so they must be read now)."""
        return self.limit is not None and uncounted >= self.limit - self.stuck

    def diagnosis(self, result: StepResult, stall: Stall) -> str:
        """The message that stops the run: the gradients at fault, what stood still and why, and what to try."""
        names, verdict = result.overflow_params, result.spike_verdict
        if verdict is not None:
            where = (
                f"the last gradient norm, {verdict.norm:.4g}, was above the guard's limit {verdict.threshold_norm:.4g} "
                f"(mean {verdict.mean:.4g} + threshold x std {verdict.std:.4g} of the steps taken)"
            )
        elif names:
            more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
            where = f"non-finite gradients in {len(names)} parameter(s): {', '.join(names[:_NAMES_SHOWN])}{more}"
        else:
            where = "no single gradient is non-finite, but their global L2 norm overflows float32"
        return (
            f"Training cannot make progress: {self.stuck} optimizer steps in a row were skipped {stall.what} "
            f"({self.skipped} skipped in all); {where}. {stall.why} Try: {stall.fix}. To keep going anyway, raise "
            f"`max_consecutive_skips` (now {self.limit}) or set it to None."
        )

    def counters(self) -> dict[str, int]:
        """The counters under their checkpoint keys (the GradScaler-style names of ``DynamicLossScaler``)."""
        # "_floor_skips": skips in a row that backing off could not help (named when only skips at the floor did).
        return {"skipped_steps": self.skipped, "consecutive_skips": self.consecutive, "_floor_skips": self.stuck}

    def restore(self, counters: dict[str, int]) -> None:
        """Set the counters from :meth:`counters`' keys (already checked by the caller)."""
        self.skipped = counters["skipped_steps"]
        self.consecutive = counters["consecutive_skips"]
        self.stuck = counters["_floor_skips"]

    def with_counted(self, results: list[StepResult]) -> SkipCounter:
        """A copy that has also counted ``results`` (for a read that must not change this counter)."""
        ahead = copy.copy(self)
        for result in results:
            ahead.count(result)
        return ahead
