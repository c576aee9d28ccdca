"""Counting skipped optimizer steps, and stopping a run that cannot make progress, with a diagnosis.

A skip that backing off the loss scale could not help (the scale at its floor, a backoff factor of 1, an overflow the
hysteresis tolerates, or no scale at all: a bf16 check) is *stuck*. ``limit`` stuck skips in a row stop the run: the
guard raises ``FloatingPointError`` with :meth:`SkipCounter.diagnosis`, which names the non-finite gradients, says why
nothing helps and what to try. Kept apart from the code that touches gradients, as the scale policy is.

Examples:
    >>> from lightning_amp_plus.step.outcome import StepRecord
    >>> counter = SkipCounter(limit=2)
    >>> counter.count(StepRecord(overflow=True), backs_off=False), counter.count(StepRecord(overflow=True), False)
    (False, True)
    >>> counter.skipped, counter.consecutive, counter.stuck
    (2, 2, 2)
"""

from __future__ import annotations

from typing import NamedTuple

from lightning_amp_plus.step.outcome import StepRecord

__all__ = ["SkipCounter", "Stall"]

_NAMES_SHOWN = 10


class Stall(NamedTuple):
    """Why a run of stuck skips happened, in the guard's words: what stood still, why, and what to try."""

    what: str
    why: str
    fix: str


class SkipCounter:
    """Skipped steps in all, in a row, and stuck in a row; whether the limit is reached.

    State: ``skipped``, ``consecutive``, ``stuck`` (counters, restored from checkpoints), ``last_skipped`` and
    ``last_overflow`` (the record of the last skipped step). ``limit`` is configuration (``None``: never stop).
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.skipped = 0
        self.consecutive = 0
        self.stuck = 0
        self.last_skipped = False
        self.last_overflow: StepRecord | None = None

    def count(self, record: StepRecord, backs_off: bool) -> bool:
        """Count one step whose outcome is known; return whether it makes the stuck skips reach the limit.

        Args:
            record: the step's record (``overflow`` known).
            backs_off: whether this overflow lowers the loss scale (then the skip is not stuck).
        """
        self.last_skipped = bool(record.overflow)
        if not record.overflow:
            self.consecutive = self.stuck = 0
            return False
        self.skipped += 1
        self.consecutive += 1
        self.last_overflow = record
        if not backs_off:
            self.stuck += 1
        return self.limit is not None and self.stuck >= self.limit

    def due_within(self, unread: int) -> bool:
        """Whether ``unread`` steps not counted yet could already have reached the limit (so they must be read)."""
        return self.limit is not None and unread >= self.limit - self.stuck

    def diagnosis(self, record: StepRecord, stall: Stall) -> str:
        """The message that stops the run: the gradients at fault, what stood still and why, and what to try."""
        names = record.names()
        if names:
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
