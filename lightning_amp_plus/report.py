"""The record of a mixed-precision run, its end-of-fit summary, and the PNG charts (matplotlib, imported lazily).

No Lightning here: ``MixedPrecisionMonitor`` fills an :class:`AmpHistory` and asks this module to describe it;
``amp-plus compare`` draws its bar chart here too. Charts are drawn on a bare matplotlib ``Figure``, never through
pyplot: no backend is chosen or switched, and the user's figures are left alone.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lightning_amp_plus._paths import check_output_file
from lightning_amp_plus._wording import plural, shown, spans

__all__ = [
    "AmpHistory",
    "ComparisonRow",
    "StepRecord",
    "check_chart_path",
    "require_matplotlib",
    "summary",
    "write_chart",
    "write_comparison_chart",
]

_ROUTINE = "overflowed gradients"  # the monitor's event kind for a step the loss scaler (or the plugin) skipped
_PNG = (".png",)


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step looked like.

    With several optimizers stepping in one batch there is one record per optimizer step, all with the batch's
    ``step``.

    Attributes:
        step: the global step (the batch) it belongs to.
        scale: the loss scale its gradients carried (``None`` without a loss scaler).
        skipped: the optimizer step was skipped (non-finite gradients).
        grad_norm: the global norm of its unscaled gradients (``None`` when not measured).
        memory_mb: memory in MB, on the steps it was sampled (``None`` otherwise).
    """

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
    """``(step, kind, names)`` for each non-finite finding: ``"parameters"`` or ``"gradients"`` found by the monitor's
    own check, ``"overflowed gradients"`` on a step the scaler (or the plugin) skipped."""
    memory_kind: str = "memory"
    autopsies: list[Any] = field(default_factory=list)
    """The monitor's autopsies (``numerics.autopsy.Autopsy``), oldest first."""
    headroom: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """``(step, {layer: numerics.headroom.LayerHeadroom})`` for each headroom reading."""

    @property
    def skipped(self) -> list[int]:
        """Steps that were skipped (a step appears once per skipped optimizer step in it)."""
        return [record.step for record in self.steps if record.skipped]


# ------------------------------------------------------------------------------------------------------ summary
def _scale_text(value: float) -> str:
    exponent = math.log2(value) if value > 0 else math.nan
    return f"2**{exponent:.0f}" if exponent.is_integer() else f"{value:g}"


def summary(history: AmpHistory) -> str:
    """One paragraph that says how the run went.

    Skips under a loss scaler are fp16 overflows, routine while the scale finds its level, and are said to be;
    non-finite values the monitor found itself (in parameters, or in gradients nothing guarded) are counted apart.

    Example:
        >>> h = AmpHistory([StepRecord(0, 65536.0, True, None, None), StepRecord(1, 32768.0, False, 1.5, None)])
        >>> h.nonfinite_events.append((0, "overflowed gradients", ["w"]))
        >>> print(summary(h))
        MixedPrecisionMonitor: 2 optimizer steps, 1 skipped (50.0%) at step 0; loss scale 2**15 to 2**16, last 2**15; the skipped step was an fp16 overflow caught by the loss scaler, routine in dynamic loss scaling; no non-finite parameters found.
        >>> print(summary(AmpHistory([StepRecord(0, 1024.0, False, 1.0, 900.0)], memory_kind="process memory")))
        MixedPrecisionMonitor: 1 optimizer step, 0 skipped (0.0%); loss scale 2**10 throughout; peak process memory 900 MB; no non-finite parameters or gradients found.
    """  # noqa: E501
    records = history.steps
    if not records:
        return "MixedPrecisionMonitor: no optimizer step was taken."
    skipped = history.skipped
    batches = len({record.step for record in records})
    head = plural(len(records), "optimizer step")
    if batches != len(records):
        head += f" in {plural(batches, 'batch', 'batches')}"
    head += f", {len(skipped)} skipped ({100 * len(skipped) / len(records):.1f}%)"
    if skipped:
        distinct = sorted(set(skipped))
        head += f" at {'step' if len(distinct) == 1 else 'steps'} {spans(distinct)}"
    parts = [head]
    scales = [r.scale for r in records if r.scale is not None]
    if scales:
        low, high = min(scales), max(scales)
        if low == high:
            parts.append(f"loss scale {_scale_text(low)} throughout")
        else:
            parts.append(f"loss scale {_scale_text(low)} to {_scale_text(high)}, last {_scale_text(scales[-1])}")
    routine = [event for event in history.nonfinite_events if event[1] == _ROUTINE]
    streak = _final_streak(records)
    if skipped and scales and not streak:
        what = "the skipped step was an fp16 overflow" if len(skipped) == 1 else "the skipped steps were fp16 overflows"
        parts.append(f"{what} caught by the loss scaler, routine in dynamic loss scaling")
    elif skipped and scales:
        ending = "a skipped step (an fp16 overflow)" if streak == 1 else f"{streak} skipped steps in a row"
        parts.append(f"the run ended on {ending}: overflows that lowering the loss scale did not cure")
    elif skipped:
        first = f", the first at step {routine[0][0]} in {_names(routine[0][2])}" if routine else ""
        parts.append(f"skipped for non-finite gradients{first}")
    memory = [r.memory_mb for r in records if r.memory_mb is not None]
    if memory:
        parts.append(f"peak {history.memory_kind} {max(memory):,.0f} MB")
    parts.extend(_autopsy_and_headroom(history))
    found = [event for event in history.nonfinite_events if event[1] != _ROUTINE]
    if found:
        step, kind, names = found[0]
        parts.append(f"{plural(len(found), 'non-finite event')}, the first at step {step} in {kind} {_names(names)}")
    else:
        parts.append("no non-finite parameters found" if skipped else "no non-finite parameters or gradients found")
    return "MixedPrecisionMonitor: " + "; ".join(parts) + "."


def _autopsy_and_headroom(history: AmpHistory) -> list[str]:
    """What the monitor's autopsies found and what its last headroom reading says, in the summary's words."""
    parts = []
    if history.autopsies:
        first = history.autopsies[0]
        more = len(history.autopsies) - 1
        parts.append(
            f"overflow autopsy: {first.message.rstrip('.')}"
            + (f" ({more} more cause{'s' if more > 1 else ''} in monitor.autopsies)" if more else "")
        )
    if history.headroom:
        step, reading = history.headroom[-1]
        if reading:
            parts.append(_headroom_sentence(step, reading))
    return parts


def _headroom_sentence(step: int, reading: dict[str, Any]) -> str:
    dtype = str(next(iter(reading.values())).dtype).removeprefix("torch.")
    tightest, layer = min(reading.items(), key=lambda item: item[1].headroom_bits[dtype])
    text = (
        f"headroom at step {step}: the tightest layer is `{tightest or 'model'}` (activations up to "
        f"{layer.act_absmax:.3g}, {layer.headroom_bits[dtype]:.1f} bits below {dtype}'s largest value)"
    )
    flushed = [(name, entry) for name, entry in reading.items() if entry.grad_flushed_pct == entry.grad_flushed_pct]
    if flushed:
        name, entry = max(flushed, key=lambda item: item[1].grad_flushed_pct)
        if entry.grad_flushed_pct > 0:
            text += f"; {entry.grad_flushed_pct:.1f}% of `{name or 'model'}`'s gradients flush to zero at its scale"
    return text


def _final_streak(records: list[StepRecord]) -> int:
    """How many batches at the end were all skipped (0 when the run ended on an applied step)."""
    count = 0
    for batch in reversed(_batches(records)):
        if not batch.skipped:
            break
        count += 1
    return count


def _names(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


# ------------------------------------------------------------------------------------------------- matplotlib
def _matplotlib_installed() -> bool:
    if "matplotlib" in sys.modules:  # imported already, or blocked (None) on purpose
        return sys.modules["matplotlib"] is not None
    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib(argument: str = "report_path") -> None:
    """Raise a clear ``ImportError`` now if a chart could not be drawn later; ``argument`` is what asked for one.

    Example:
        >>> require_matplotlib("--png")  # installed here: nothing happens
    """
    if not _matplotlib_installed():
        what = "MixedPrecisionMonitor(report_path=...)" if argument == "report_path" else argument
        raise ImportError(
            f"{what} draws a chart with matplotlib, which is not installed. Install it with "
            f"`pip install 'lightning-amp-plus[report]'` (or `pip install matplotlib`), or drop {argument}."
        )


def check_chart_path(path: str | os.PathLike[str], argument: str = "report_path") -> Path:
    """Check, before any work starts, that a PNG chart can be written at ``path``; return it as a ``Path``.

    The path must end in ``.png`` (the chart is always a PNG, written exactly there), must not be a folder, and
    must lie where a file can be created (missing folders are created when the chart is written). ``argument``
    names the path in messages: ``"report_path"`` (Python) or a flag such as ``"--report"``.

    Raises:
        TypeError: ``path`` is not a string or path.
        ValueError: the path cannot take the chart; the message names ``argument``, the value and the fix.
        ImportError: matplotlib is not installed.

    Example:
        >>> check_chart_path("runs/amp.png")
        PosixPath('runs/amp.png')
        >>> check_chart_path("amp", "--report")
        Traceback (most recent call last):
        ...
        ValueError: --report amp: the chart is written as .png, so the path must end in .png, e.g. amp.png.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{shown(argument, path)} must be a str or a path, not {type(path).__name__}.")
    checked = check_output_file(path, argument, _PNG, kind="the chart")
    require_matplotlib(argument)
    return checked


def _figure(**options: Any) -> Any:
    require_matplotlib()
    # `import matplotlib.figure` also binds (and so needs) the package itself.
    import matplotlib.figure

    return matplotlib.figure.Figure(layout="constrained", **options)


def _save(figure: Any, path: str | os.PathLike[str]) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, format="png", dpi=100)  # exactly `path`: no suffix added, whatever it ends in
    return target


# --------------------------------------------------------------------------------------------------- run chart
@dataclass(frozen=True)
class _Batch:
    """The records of one global step merged: several optimizers stepping in one batch make one point."""

    step: int
    scale: float | None
    skipped: bool
    grad_norm: float | None
    memory_mb: float | None
    optimizers: int


def _batches(records: Sequence[StepRecord]) -> list[_Batch]:
    grouped: dict[int, list[StepRecord]] = {}
    for record in records:
        grouped.setdefault(record.step, []).append(record)
    out = []
    for step, group in grouped.items():
        norms = [r.grad_norm for r in group if r.grad_norm is not None]
        memory = [r.memory_mb for r in group if r.memory_mb is not None]
        out.append(
            _Batch(
                step,
                group[0].scale,  # the scale the batch started with: one scaler, updated once per batch
                any(r.skipped for r in group),
                # The global norm over every optimizer's gradients: sqrt of the sum of the squared norms.
                math.sqrt(sum(n * n for n in norms)) if norms else None,
                max(memory) if memory else None,
                len(group),
            )
        )
    return sorted(out, key=lambda batch: batch.step)


def write_chart(history: AmpHistory, path: str | os.PathLike[str]) -> Path:
    """Draw the run into a PNG at ``path`` (exactly there; missing folders are created) and return the path.

    One panel per series that was measured: the loss scale (only with a loss scaler), the skipped steps so far
    (only when a step was skipped), the gradient norm, and memory (on a zero-based axis, so that a flat line looks
    flat; the points are the steps it was sampled on). Skipped steps are marked in red in every panel. What was
    not measured is said in the subtitle instead of being drawn on an empty axis. With several optimizers per batch,
    a batch is one point: its first scale, the global gradient norm over the optimizers, the largest memory.
    """
    return _save(_run_figure(history), path)


def _run_figure(history: AmpHistory) -> Any:
    batches = _batches(history.steps)
    skipped_steps = [b.step for b in batches if b.skipped]
    xs = [b.step for b in batches]
    norm_label = "gradient norm" + (" (all optimizers)" if any(b.optimizers > 1 for b in batches) else "")
    candidates: list[tuple[str, list[float | None], str]] = [
        ("loss scale", [b.scale for b in batches], "log2"),
        ("skipped steps (total)", [float(n) for n in _cumulative([b.skipped for b in batches])], "count"),
        (norm_label, [b.grad_norm for b in batches], "log10"),
        (f"{history.memory_kind} (MB)", [b.memory_mb for b in batches], "zero"),
    ]
    notes = []
    panels = []
    for label, values, kind in candidates:
        usable = [v for v in values if v is not None and math.isfinite(v) and (v > 0 or kind in ("count", "zero"))]
        if kind == "count" and not skipped_steps:
            notes.append("no step skipped")
        elif not usable:
            notes.append(_not_measured(label, kind))
        else:
            panels.append((label, values, kind))
    figure = _figure(figsize=(9, 2.4 * max(1, len(panels)) + 0.9))
    if not batches:
        figure.suptitle("lightning-amp-plus: no optimizer step was taken", fontsize=11)
        return figure
    title = f"lightning-amp-plus: {plural(len(history.steps), 'optimizer step')}"
    if len(batches) != len(history.steps):
        title += f" in {plural(len(batches), 'batch', 'batches')}"
    title += f", {len(skipped_steps)} skipped"
    figure.suptitle(title + ("\n" + "; ".join(notes) if notes else ""), fontsize=11)
    if not panels:
        axis = figure.subplots()
        axis.set_axis_off()
        axis.text(0.5, 0.5, "nothing was measured", ha="center", va="center", transform=axis.transAxes)
        return figure
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for axis, (label, values, kind) in zip(axes, panels, strict=True):
        _draw_series(axis, xs, values, kind, skipped_steps)
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
    if skipped_steps:
        axes[0].legend(loc="best", fontsize=8)
    axes[-1].set_xlabel("optimizer step (global step)")
    axes[-1].set_xlim(xs[0] - 0.5, xs[-1] + 0.5)  # the first and last steps' marks stay in view
    return figure


def _not_measured(label: str, kind: str) -> str:
    if kind == "log2":
        return "no loss scaler (bf16 or fp32): no loss-scale panel"
    return f"{label.split(' (')[0]} not recorded"


def _draw_series(axis: Any, xs: list[int], values: list[float | None], kind: str, skipped: list[int]) -> None:
    usable = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]  # None: not sampled on that step
    # A value that cannot be drawn (inf/NaN, or <= 0 on a log axis) breaks the line there instead of bridging it.
    drawn = [(x, v if math.isfinite(v) and (v > 0 or not kind.startswith("log")) else math.nan) for x, v in usable]
    points = [(x, v) for x, v in drawn if not math.isnan(v)]
    px, py = [x for x, _ in points], [v for _, v in points]
    lx, ly = [x for x, _ in drawn], [v for _, v in drawn]
    sampled = len(points) < len(xs) / 2  # memory is sampled on logged steps only: show the samples as points
    if kind == "log2":
        axis.plot(lx, ly, drawstyle="steps-post", color="tab:blue")
        axis.set_yscale("log", base=2)
        axis.yaxis.set_major_formatter(_power_of_two_formatter())
    elif kind == "count":
        axis.plot(px, py, drawstyle="steps-post", color="tab:red")
        axis.set_ylim(0, max(py) * 1.3)
        axis.yaxis.set_major_locator(_integer_locator())
    else:
        axis.plot(lx, ly, marker="o" if sampled else None, markersize=3, color="tab:blue")
        if kind == "log10" and max(py) > 10 * min(py):  # a log axis only where the norm spans a decade or more
            axis.set_yscale("log")
        elif kind == "zero":
            # From zero: a 0.1 MB wiggle on 900 MB is flat, and a real leak still climbs visibly.
            axis.set_ylim(0, max(py) * 1.3)  # headroom for the "last" label above the line
        if sampled:
            gaps = sorted({b - a for a, b in itertools.pairwise(px)})
            every = f" (every {gaps[0]} steps)" if len(gaps) == 1 else ""
            axis.text(0.01, 0.04, f"sampled on logged steps{every}", transform=axis.transAxes, fontsize=8)
    axis.text(0.99, 0.9, f"last {_last_text(py[-1], kind)}", ha="right", transform=axis.transAxes, fontsize=8,
              bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})  # fmt: skip
    skipped_points = [(x, v) for x, v in points if x in set(skipped)]
    for number, step in enumerate(skipped):
        axis.axvline(step, color="tab:red", alpha=0.35, linewidth=1, label="skipped step" if number == 0 else None)
    if skipped_points and kind != "count":
        axis.plot([x for x, _ in skipped_points], [v for _, v in skipped_points], "x", color="tab:red", markersize=5)


def _last_text(value: float, kind: str) -> str:
    if kind == "log2":
        return _scale_text(value)
    if kind == "count":
        return f"{value:.0f}"
    return f"{value:,.1f}" if kind == "zero" else f"{value:.3g}"


def _integer_locator() -> Any:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _power_of_two_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    def text(value: float, _: object) -> str:
        return _scale_text(value) if value > 0 else ""

    return FuncFormatter(text)


def _cumulative(flags: list[bool]) -> list[int]:
    total, out = 0, []
    for flag in flags:
        total += int(flag)
        out.append(total)
    return out


# ----------------------------------------------------------------------------------------------- compare chart
class ComparisonRow(Protocol):
    """What the comparison chart reads of one configuration (``amp-plus compare``'s ``ConfigResult``)."""

    @property
    def config(self) -> str: ...  # noqa: D102
    @property
    def step_ms(self) -> float: ...  # noqa: D102
    @property
    def ratio(self) -> float | None: ...  # noqa: D102
    @property
    def peak_memory_mb(self) -> float | None: ...  # noqa: D102
    @property
    def final_train_loss(self) -> float | None: ...  # noqa: D102
    @property
    def val_acc(self) -> float | None: ...  # noqa: D102


def write_comparison_chart(rows: Sequence[ComparisonRow], path: str | os.PathLike[str], title: str) -> Path:
    """Four labelled bar panels, one bar per configuration: step time, peak memory, final train loss, val accuracy.

    Step time is relative to 32-true when every row has a ratio, in ms otherwise. A value not measured is drawn as
    no bar, labelled ``-``.
    """
    return _save(_comparison_figure(rows, title), path)


def _comparison_figure(rows: Sequence[ComparisonRow], title: str) -> Any:
    names = [row.config for row in rows]
    relative = all(row.ratio is not None for row in rows)
    panels: list[tuple[str, list[float | None], str]] = [
        (
            "step time vs 32-true (lower is faster)" if relative else "step time, ms (median)",
            [row.ratio if relative else row.step_ms for row in rows],
            "{:.2f}x" if relative else "{:,.1f}",
        ),
        ("peak memory, MB", [row.peak_memory_mb for row in rows], "{:,.1f}"),
        ("final train loss", [row.final_train_loss for row in rows], "{:.3f}"),
        ("validation accuracy", [row.val_acc for row in rows], "{:.3f}"),
    ]
    figure = _figure(figsize=(11, 1.2 + 0.45 * len(rows) * 2))
    axes = figure.subplots(2, 2, sharey=True)
    colors = [_family_color(name) for name in names]
    positions = list(range(len(rows)))
    for axis, (label, values, template) in zip(axes.flat, panels, strict=True):
        heights = [v if v is not None and math.isfinite(v) else 0.0 for v in values]
        bars = axis.barh(positions, heights, color=colors)
        texts = ["-" if v is None or not math.isfinite(v) else template.format(v) for v in values]
        axis.bar_label(bars, labels=texts, padding=3, fontsize=8)
        axis.set_title(label, fontsize=10)
        # Accuracy on its whole 0-1 range; the others from zero to a little past the longest bar and its label.
        axis.set_xlim(0, 1.12 if label == "validation accuracy" else max([*heights, 1e-12]) * 1.25)
        axis.grid(True, axis="x", alpha=0.3)
        if relative and template.endswith("x"):
            axis.axvline(1.0, color="black", linewidth=0.8)
    axes[0, 0].set_yticks(positions, names)
    axes[0, 0].invert_yaxis()  # the table's order, top to bottom
    figure.suptitle(title, fontsize=11)
    return figure


def _family_color(name: str) -> str:
    if name.startswith("lightning"):
        return "tab:blue"
    if name.startswith("ours"):
        return "tab:red" if name.endswith("master") else "tab:orange"
    return "tab:gray"
