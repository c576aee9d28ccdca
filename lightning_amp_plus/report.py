"""The record of a mixed-precision run, its end-of-fit summary, and a PNG chart (matplotlib, imported lazily).

No Lightning here: ``MixedPrecisionMonitor`` fills an :class:`AmpHistory` and asks this module to describe it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["AmpHistory", "StepRecord", "summary", "write_chart"]


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step looked like."""

    step: int
    scale: float | None
    skipped: bool
    grad_norm: float | None
    memory_mb: float | None


@dataclass
class AmpHistory:
    """Every step's record, plus the non-finite events seen."""

    steps: list[StepRecord] = field(default_factory=list)
    nonfinite_events: list[tuple[int, str, list[str]]] = field(default_factory=list)
    """``(step, "parameters" | "gradients", names)`` for each non-finite finding."""
    memory_kind: str = "memory"

    @property
    def skipped(self) -> list[int]:
        """Steps that were skipped."""
        return [record.step for record in self.steps if record.skipped]


def _scale_text(value: float) -> str:
    exponent = math.log2(value) if value > 0 else math.nan
    return f"2**{exponent:.0f}" if exponent.is_integer() else f"{value:g}"


def summary(history: AmpHistory) -> str:
    """One paragraph that says how the run went.

    Example:
        >>> h = AmpHistory([StepRecord(0, 65536.0, True, None, None), StepRecord(1, 32768.0, False, 1.5, None)])
        >>> print(summary(h))
        MixedPrecisionMonitor: 2 optimizer steps, 1 skipped (50.0%); loss scale 2**15 to 2**16, last 2**15; overflows at steps 0 to 0; no non-finite parameters or gradients found.
    """  # noqa: E501
    records = history.steps
    if not records:
        return "MixedPrecisionMonitor: no optimizer step was taken."
    skipped = history.skipped
    parts = [f"{len(records)} optimizer steps, {len(skipped)} skipped ({100 * len(skipped) / len(records):.1f}%)"]
    scales = [r.scale for r in records if r.scale is not None]
    if scales:
        parts.append(
            f"loss scale {_scale_text(min(scales))} to {_scale_text(max(scales))}, last {_scale_text(scales[-1])}"
        )
    if skipped:
        parts.append(f"overflows at steps {skipped[0]} to {skipped[-1]}")
    memory = [r.memory_mb for r in records if r.memory_mb is not None]
    if memory:
        parts.append(f"peak {history.memory_kind} {max(memory):,.0f} MB")
    events = history.nonfinite_events
    if events:
        step, kind, names = events[0]
        parts.append(f"{len(events)} non-finite events, the first at step {step} in {kind} {', '.join(names[:5])}")
    else:
        parts.append("no non-finite parameters or gradients found")
    return "MixedPrecisionMonitor: " + "; ".join(parts) + "."


def _figure_class() -> Any:
    try:
        # `import matplotlib.figure` also binds (and so needs) the package itself. The chart is drawn on a bare
        # `Figure`, never through pyplot: no backend is chosen or switched, and the user's figures are left alone.
        import matplotlib.figure
    except ImportError as error:
        raise ImportError(
            "MixedPrecisionMonitor(report_path=...) draws its chart with matplotlib, which is not installed. "
            "Install it with `pip install 'lightning-amp-plus[report]'` (or `pip install matplotlib`), or drop "
            "`report_path`."
        ) from error
    return matplotlib.figure.Figure


def require_matplotlib() -> None:
    """Raise the clear ``ImportError`` now if the chart could not be drawn later."""
    _figure_class()


def write_chart(history: AmpHistory, path: str | Path) -> Path:
    """Draw loss scale, skipped steps, gradient norm and memory over steps into a PNG at ``path``."""
    figure_class = _figure_class()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = [r.step for r in history.steps]
    figure = figure_class(figsize=(8, 9), layout="tight")
    axes = figure.subplots(4, 1, sharex=True)
    series: list[tuple[str, list[float | None], bool]] = [
        ("loss scale", [r.scale for r in history.steps], True),
        ("skipped steps (total)", [float(i) for i in _cumulative([r.skipped for r in history.steps])], False),
        ("gradient norm", [r.grad_norm for r in history.steps], True),
        (f"{history.memory_kind} (MB)", [r.memory_mb for r in history.steps], False),
    ]
    for axis, (label, values, log) in zip(axes, series, strict=True):
        # A log axis cannot show 0; a linear one can (a run with no skips draws a flat line at 0).
        points = [
            (s, v)
            for s, v in zip(steps, values, strict=True)
            if v is not None and math.isfinite(v) and (v > 0 or not log)
        ]
        if points:
            axis.plot([s for s, _ in points], [v for _, v in points], drawstyle="steps-post")
            if log:
                axis.set_yscale("log", base=2 if label == "loss scale" else 10)
        else:
            axis.text(0.5, 0.5, "not measured", ha="center", va="center", transform=axis.transAxes)
        for step in history.skipped:
            axis.axvline(step, color="red", alpha=0.15, linewidth=1)
        axis.set_ylabel(label)
    axes[-1].set_xlabel("optimizer step (red: skipped)")
    figure.suptitle("lightning-amp-plus: mixed-precision run")
    figure.savefig(path, dpi=100)
    return path


def _cumulative(flags: list[bool]) -> list[int]:
    total, out = 0, []
    for flag in flags:
        total += int(flag)
        out.append(total)
    return out
