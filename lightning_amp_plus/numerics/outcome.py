"""What one optimizer step under ``DynamicLossScaler`` did: the scaler's record of it, and the public, lazy view.

On the unscale path (``unscale_`` before ``step``, or an optimizer without the fused protocol) the scaler reads the
step's overflow flag on the host before stepping, and every field of the record is known when ``step()`` returns. On
the fused-optimizer path the flag stays on the device, the optimizer skips on the device, and the record is completed
later, when the host reads the flags of every step not read yet (``DynamicLossScaler`` does that together, once, on the
first access that needs one of them). :class:`StepOutcome` is the view a caller keeps: its fields resolve on first
access.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["StepOutcome", "StepRecord"]


@dataclass(eq=False)
class StepRecord:
    """The scaler's record of one optimizer's gradients between two ``update()`` calls."""

    params: list[Tensor] = field(default_factory=list)
    checked: bool = False
    """Unscaled, checked and measured on the host path."""
    stepped: bool = False
    overflow: bool | None = None
    """Whether the gradients held inf/NaN (the step was skipped); ``None`` while the flag is on the device, unread."""
    scale: float | None = None
    """The scale the gradients carried."""
    grad_norm: float | None = None
    """The global L2 norm of the unscaled gradients."""
    nonfinite: list[str] | None = None
    """Names of the parameters whose gradients were non-finite; ``None`` until looked up."""
    # The fused path's device results, until the host has read them.
    flag: Tensor | None = None
    """1.0 if the gradients held inf/NaN, else 0.0 (float32, on the scaler's device): ``optimizer.found_inf``."""
    total: Tensor | None = None
    """The global L2 norm of the still-scaled gradients."""
    scaled_norm: float | None = None
    """``total`` once read on the host, before the host knows the scale to divide it by."""
    norms: Tensor | None = None
    """Each gradient's norm, to name the non-finite ones."""
    slot: int | None = None
    """Where ``flag`` and ``total`` were copied in the scaler's pinned host buffer (CUDA), if anywhere."""
    event: torch.cuda.Event | None = None
    """Recorded after that copy."""
    namer: Callable[[StepRecord], list[str]] | None = None
    """Looks up the names of the non-finite gradients from ``norms`` (a host read, made only on overflow)."""

    def names(self) -> list[str]:
        """The names of the non-finite gradients, looked up once."""
        if self.nonfinite is None:
            self.nonfinite = [] if not self.overflow or self.namer is None else self.namer(self)
            self.norms = None
        return self.nonfinite


class StepOutcome:
    """What became of one optimizer step: applied or skipped, at what scale, with what gradient norm.

    Returned by ``DynamicLossScaler.outcome(optimizer)`` after ``step(optimizer)``. On the fused-optimizer path the
    skip is decided on the device without a host read; the fields then resolve on first access, which reads the
    flags of every step not read yet in one go (on CUDA from a pinned buffer they were copied to asynchronously, so it
    waits only until the device has checked this step's gradients, not for the optimizer's kernels). :attr:`resolved`
    says whether that read has happened, :attr:`ready` whether it would wait at all.

    Example:
        >>> from lightning_amp_plus.numerics.scaler import DynamicLossScaler
        >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.1, fused=True)
        >>> scaler = DynamicLossScaler(init_scale=8.0)
        >>> scaler.scale(w.sum() * float("inf")).backward(); _ = scaler.step(opt); scaler.update()
        >>> outcome = scaler.outcome(opt)
        >>> outcome.resolved, outcome.skipped, outcome.resolved, outcome.scale, w.tolist()
        (False, True, True, 8.0, [1.0, 1.0])
    """

    def __init__(self, record: StepRecord, resolve: Callable[[], None]) -> None:
        self._record = record
        self._resolve = resolve

    def _known(self) -> StepRecord:
        if self._record.overflow is None:
            self._resolve()
        return self._record

    @property
    def resolved(self) -> bool:
        """Whether the outcome is known on the host: reading the fields needs no device read."""
        return self._record.overflow is not None

    @property
    def ready(self) -> bool:
        """Whether reading the fields now would not wait for the device (true once resolved, and always on CPU)."""
        event = self._record.event
        return self.resolved or event is None or bool(event.query())  # type: ignore[no-untyped-call]

    @property
    def skipped(self) -> bool:
        """Whether the step was skipped (its gradients held inf/NaN): parameters and optimizer state are untouched."""
        return bool(self._known().overflow)

    @property
    def scale(self) -> float:
        """The loss scale the step's gradients carried."""
        scale = self._known().scale
        assert scale is not None  # known once resolved
        return scale

    @property
    def grad_norm(self) -> float | None:
        """The global L2 norm of the step's unscaled gradients (inf or NaN when skipped)."""
        return self._known().grad_norm

    @property
    def overflow_params(self) -> list[str]:
        """Names of the parameters whose gradients were non-finite (empty when the step was applied)."""
        return self._known().names()

    def __repr__(self) -> str:
        if not self.resolved:
            return "StepOutcome(unresolved)"
        return f"StepOutcome(skipped={self.skipped}, scale={self.scale:g}, grad_norm={self.grad_norm!r})"
