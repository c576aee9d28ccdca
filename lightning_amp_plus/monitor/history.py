"""The record of a mixed-precision run: one entry per optimizer step, and what the monitor found.

No Lightning here: ``MixedPrecisionMonitor`` fills an :class:`AmpHistory`; :mod:`~.summary` words it and
:mod:`~.chart` draws it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_amp_plus.monitor.fp8 import FP8Record
    from lightning_amp_plus.step.spikes import SpikeVerdict

__all__ = ["ROUTINE", "AmpHistory", "Batch", "StepEntry", "batches", "scale_text"]

ROUTINE = "overflowed gradients"  # the monitor's event kind for a step the loss scaler (or the plugin) skipped


@dataclass(frozen=True)
class StepEntry:
    """What one optimizer step looked like.

    With several optimizers stepping in one batch there is one record per optimizer step, all with the batch's
    ``step``.

    Attributes:
        step: the global step (the batch) it belongs to.
        scale: the loss scale its gradients carried (``None`` without a loss scaler).
        skipped: the optimizer step was skipped (non-finite gradients, or a spike the spike guard skipped).
        grad_norm: the global norm of its unscaled gradients (``None`` when not measured).
        memory_mb: memory in MB, on the steps it was sampled (``None`` otherwise).
        spike_verdict: the spike guard's verdict on its gradient norm (``None`` without a guard, or for an overflow).
    """

    step: int
    scale: float | None
    skipped: bool
    grad_norm: float | None
    memory_mb: float | None
    spike_verdict: SpikeVerdict | None = None

    @property
    def overflowed(self) -> bool:
        """Whether it was skipped for non-finite gradients (not for a spike)."""
        return self.skipped and self.spike_verdict is None


@dataclass
class AmpHistory:
    """Every step's record, plus the non-finite events seen."""

    steps: list[StepEntry] = field(default_factory=list)
    nonfinite_events: list[tuple[int, str, list[str]]] = field(default_factory=list)
    """``(step, kind, names)`` for each non-finite finding: ``"parameters"`` or ``"gradients"`` found by the monitor's
    own check, ``"overflowed gradients"`` on a step the scaler (or the plugin) skipped."""
    memory_kind: str = "memory"
    autopsies: list[Any] = field(default_factory=list)
    """The monitor's autopsies (``numerics.autopsy.Autopsy``), oldest first."""
    headroom: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """``(step, {layer: numerics.headroom.LayerHeadroom})`` for each headroom reading."""
    notes: list[str] = field(default_factory=list)
    """Sentences the summary adds as they are (e.g. how compensated bf16 weights were kept)."""
    fp8: FP8Record | None = None
    """Under ``"fp8-mixed"``: what the FP8 readings found (``None`` under the other precisions)."""
    unexamined: str | None = None
    """Why the autopsy did not examine this run's skipped steps (what the summary says of a skip whose cause it does
    not know: the autopsy off, another precision plugin, manual optimization, a sharded model, a loop that gives no
    replay, the autopsy limit reached), or ``None`` where nothing kept it from them."""
    replays_stopped: tuple[int, str] | None = None
    """``(step, why)`` when the monitor stopped replaying batches (no autopsy or headroom reading from that step on):
    a model whose gradients a replay cannot take, as through a reentrant activation checkpoint; ``None`` otherwise."""
    replayed: dict[int, str | None] = field(default_factory=dict)
    """Skipped steps the autopsy replayed, and the kind of cause it found (``"forward"``, ``"scale"``,
    ``"backward"``), or ``None`` when the replay at the same scale found every gradient finite. A cause found again
    is reported once (:attr:`autopsies`) but recorded here at every step."""

    @property
    def skipped(self) -> list[int]:
        """Steps that were skipped (a step appears once per skipped optimizer step in it)."""
        return [record.step for record in self.steps if record.skipped]

    @property
    def overflowed(self) -> list[int]:
        """Steps that were skipped for non-finite gradients (a step appears once per such optimizer step in it)."""
        return [record.step for record in self.steps if record.overflowed]

    @property
    def spikes(self) -> list[tuple[int, SpikeVerdict]]:
        """The steps the spike guard judged spikes (skipped or clipped), with its verdicts."""
        return [(r.step, r.spike_verdict) for r in self.steps if r.spike_verdict is not None and r.spike_verdict.spike]


@dataclass(frozen=True)
class Batch:
    """The records of one global step merged: several optimizers stepping in one batch make one point."""

    step: int
    scale: float | None
    skipped: bool
    grad_norm: float | None
    memory_mb: float | None
    optimizers: int
    overflowed: bool = False
    """A step of the batch was skipped for non-finite gradients (not for a spike)."""
    spike_verdict: SpikeVerdict | None = None
    """A spike's verdict if the guard judged one in the batch; else the one optimizer's verdict (``None`` without a
    guard, or with several optimizers)."""


def batches(records: Sequence[StepEntry]) -> list[Batch]:
    """The records merged per global step (one point per batch), in step order."""
    grouped: dict[int, list[StepEntry]] = {}
    for record in records:
        grouped.setdefault(record.step, []).append(record)
    out = []
    for step, group in grouped.items():
        norms = [r.grad_norm for r in group if r.grad_norm is not None]
        memory = [r.memory_mb for r in group if r.memory_mb is not None]
        out.append(
            Batch(
                step,
                group[0].scale,  # the scale the batch started with: one scaler, updated once per batch
                any(r.skipped for r in group),
                # The global norm over every optimizer's gradients: sqrt of the sum of the squared norms.
                math.sqrt(sum(n * n for n in norms)) if norms else None,
                max(memory) if memory else None,
                len(group),
                any(r.overflowed for r in group),
                _verdict_of(group),
            )
        )
    return sorted(out, key=lambda batch: batch.step)


def _verdict_of(group: list[StepEntry]) -> SpikeVerdict | None:
    spike = next((r.spike_verdict for r in group if r.spike_verdict is not None and r.spike_verdict.spike), None)
    return spike if spike is not None or len(group) > 1 else group[0].spike_verdict


def scale_text(value: float) -> str:
    """A loss scale as people read it: ``2**16`` for a power of two, else the number."""
    exponent = math.log2(value) if value > 0 else math.nan
    return f"2**{exponent:.0f}" if exponent.is_integer() else f"{value:g}"
