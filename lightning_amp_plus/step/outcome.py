"""What one optimizer step did: the guard's record of it, and :class:`StepResult`, the one view everybody reads.

A step's record is complete when ``step()`` returns on the unscale path (the overflow flag was read on the host to
decide the skip). On the fused-optimizer path the flag stays on the device and the optimizer skips there; the record is
completed later, when the host reads the flags of every step not read yet, in one go (on first access to a field that
needs them). :class:`StepResult` is the view a caller keeps: the scaler's ``outcome(optimizer)``, the plugins'
``recent_steps`` and the monitor's history all hold this one type.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Stage", "StepRecord", "StepResult"]


class Stage(enum.Enum):
    """Where one optimizer's gradients are between two ``update()`` calls (as ``torch.amp.GradScaler``'s ``OptState``).

    * ``READY``: nothing done yet this iteration; the gradients are as backward left them (scaled).
    * ``UNSCALED``: unscaled, checked and measured once (``unscale_``); clipping may still change them.
    * ``STEPPED``: stepped or skipped; nothing more until ``update()``.
    """

    READY = "ready"
    UNSCALED = "unscaled"
    STEPPED = "stepped"


@dataclass(eq=False)
class StepRecord:
    """What the guard learned about one optimizer's gradients in one iteration (mutable until complete)."""

    overflow: bool | None = None
    """Whether the gradients held inf/NaN (the step is skipped); ``None`` while the flag is unread on the device."""
    scale: float | None = None
    """The loss scale the gradients carried (1.0 for a guard that only checks)."""
    grad_norm: float | None = None
    """The global L2 norm of the unscaled gradients (inf or NaN on an overflow)."""
    scaled_norm: float | None = None
    """Fused path: the norm of the still-scaled gradients, read before the host knows the scale to divide it by."""
    namer: Callable[[], list[str]] | None = None
    """Looks up the names of the non-finite gradients (a host read, made only for a skipped step, once)."""
    _names: list[str] | None = None

    def names(self) -> list[str]:
        """The names of the parameters whose gradients were non-finite (empty for an applied step), looked up once."""
        if self._names is None:
            self._names = self.namer() if self.overflow and self.namer is not None else []
            self.namer = None  # drops what the lookup needed (the per-gradient norms)
        return self._names


class StepResult:
    """What became of one optimizer step: applied or skipped, at what scale, with what gradient norm.

    On the fused-optimizer path the skip is decided on the device; the fields then resolve on first access, which reads
    the flags of every step not read yet in one go (on CUDA from a pinned buffer they were copied to asynchronously, so
    it waits only until the device has checked this step's gradients). Reading never changes what any later call does.

    Attributes:
        index: the front end's count of optimizer steps before this one (``None`` from a bare scaler).
        optimizer: the optimizer's position among the front end's optimizers (``None`` from a bare scaler).

    Examples:
        >>> from lightning_amp_plus.step.scaler import DynamicLossScaler
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1, fused=True)
        >>> scaler = DynamicLossScaler(init_scale=8.0)
        >>> scaler.scale(w.sum() * float("inf")).backward(); _ = scaler.step(opt); scaler.update()
        >>> result = scaler.outcome(opt)
        >>> result.resolved, result.skipped, result.resolved, result.scale, w.tolist()
        (False, True, True, 8.0, [1.0, 1.0])
        >>> StepResult.known(skipped=False, scale=None, grad_norm=2.0)
        StepResult(skipped=False, scale=None, grad_norm=2.0)
    """

    def __init__(
        self,
        record: StepRecord,
        resolve: Callable[[], None] | None = None,
        *,
        index: int | None = None,
        optimizer: int | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self._record = record
        self._resolve = resolve
        self._ready = ready
        self.index = index
        self.optimizer = optimizer

    @classmethod
    def known(
        cls,
        *,
        skipped: bool,
        scale: float | None,
        grad_norm: float | None,
        overflow_params: list[str] | None = None,
        index: int | None = None,
        optimizer: int | None = None,
    ) -> StepResult:
        """A result known on the host (a step nothing checked, or one read off another tool's scale)."""
        record = StepRecord(overflow=skipped, scale=scale, grad_norm=grad_norm, _names=list(overflow_params or []))
        return cls(record, index=index, optimizer=optimizer)

    def renumbered(self, index: int, optimizer: int) -> StepResult:
        """The same step's result, numbered as a front end counts its steps."""
        return StepResult(self._record, self._resolve, index=index, optimizer=optimizer, ready=self._ready)

    def _known(self) -> StepRecord:
        if self._record.overflow is None and self._resolve is not None:
            self._resolve()
        return self._record

    @property
    def resolved(self) -> bool:
        """Whether the result is known on the host: reading the fields needs no device read."""
        return self._record.overflow is not None

    @property
    def ready(self) -> bool:
        """Whether reading the fields now would not wait for the device (true once resolved, and always on CPU)."""
        return self.resolved or self._ready is None or self._ready()

    @property
    def skipped(self) -> bool:
        """Whether the step was skipped (its gradients held inf/NaN): parameters and optimizer state are untouched."""
        return bool(self._known().overflow)

    @property
    def scale(self) -> float | None:
        """The loss scale the step's gradients carried (``None`` where no scaler was involved)."""
        return self._known().scale

    @property
    def grad_norm(self) -> float | None:
        """The global L2 norm of the step's unscaled gradients (inf or NaN when skipped; ``None`` if not measured)."""
        return self._known().grad_norm

    @property
    def overflow_params(self) -> list[str]:
        """Names of the parameters whose gradients were non-finite (empty when the step was applied)."""
        return self._known().names()

    def __repr__(self) -> str:
        if not self.resolved:
            return "StepResult(unresolved)"
        return f"StepResult(skipped={self.skipped}, scale={self.scale!r}, grad_norm={self.grad_norm!r})"
