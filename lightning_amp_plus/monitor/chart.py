"""The run's PNG chart (matplotlib, imported lazily), and the checks made before any work that it can be drawn.

Charts are drawn on a bare matplotlib ``Figure``, never through pyplot: no backend is chosen or switched, and the
user's figures are left alone.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_amp_plus._paths import check_output_file, write_new
from lightning_amp_plus._wording import plural, shown
from lightning_amp_plus.monitor.history import AmpHistory, Batch, batches, scale_text

__all__ = ["check_chart_path", "new_figure", "require_matplotlib", "save_png", "write_chart"]

_PNG = (".png",)


# ------------------------------------------------------------------------------------------------- matplotlib
def _matplotlib_installed() -> bool:
    if "matplotlib" in sys.modules:  # imported already, or blocked (None) on purpose
        return sys.modules["matplotlib"] is not None
    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib(argument: str = "report_path") -> None:
    """Raise a clear ``ImportError`` now if a chart could not be drawn later; ``argument`` is what asked for one.

    Examples:
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

    The path must end in ``.png`` (the chart is always a PNG), must not be a folder, and must lie where a file can be
    created (missing folders are created when the chart is written; if a file has that name by then, the chart goes
    to the next free numbered name, ``amp-1.png``..., and the file is left as it was). ``argument``
    names the path in messages: ``"report_path"`` (Python) or a flag such as ``"--report"``.

    Raises:
        TypeError: ``path`` is not a string or path.
        ValueError: the path cannot take the chart; the message names ``argument``, the value and the fix.
        ImportError: matplotlib is not installed.

    Examples:
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


def new_figure(**options: Any) -> Any:
    """A bare matplotlib ``Figure`` with a constrained layout (matplotlib must be installed)."""
    require_matplotlib()
    # `import matplotlib.figure` also binds (and so needs) the package itself.
    import matplotlib.figure

    return matplotlib.figure.Figure(layout="constrained", **options)


def save_png(figure: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``figure`` as a PNG at ``path``, or at the next free numbered name if a file is there; return where.

    No file is overwritten (:func:`~lightning_amp_plus._paths.write_new`: ``amp.png``, then ``amp-1.png``...); missing
    folders are created. No suffix is added, whatever ``path`` ends in.
    """
    return write_new(path, lambda handle: figure.savefig(handle, format="png", dpi=100))


# --------------------------------------------------------------------------------------------------- run chart
def write_chart(history: AmpHistory, path: str | os.PathLike[str]) -> Path:
    """Draw the run into a PNG at ``path``, or at the next free numbered name; return where it went.

    Where a file has the name ``path`` already, the chart goes to ``amp-1.png`` (or the next free number): no file is
    overwritten. Missing folders are created.

    One panel per series that was measured: the loss scale (only with a loss scaler; ticks on powers of two from its
    highest to its lowest value), the skipped steps so far (only when a step was skipped), the gradient norm, and
    memory (on a zero-based axis, so that a flat line looks flat). Above each panel: its last value and, when the
    series does not have a drawn value on every step, why (recorded on some steps only: memory on the steps
    Lightning logs; not finite on skipped steps). Skipped steps are marked in red in every panel; a step the monitor
    made an autopsy of is labelled A1, A2... on the top panel, and what each found is written under the panels. What
    was not measured is said in the subtitle instead of being drawn on an empty axis. The x axis is whole steps. With
    several optimizers per batch, a batch is one point: its first scale, the global gradient norm over the
    optimizers, the largest memory.

    Under ``"fp8-mixed"``, a panel of the FP8 readings: at each check step the largest share of a cast's values
    flushed to zero (the worst layer's, named at the highest point), the monitor's ``fp8_flush_warn_pct`` as a dashed
    line, and the layers that fell back to bf16 marked where they did.

    With headroom readings, the last one is drawn below: per layer, how many bits its activations stay below
    float16's largest value (red under 2 bits, where an overflow is near), and the percent of its gradient values
    that the half dtype flushes to zero or makes subnormal at the loss scale of the reading.
    """
    return save_png(_whole_figure(history), path)


def _whole_figure(history: AmpHistory) -> Any:
    reading = history.headroom[-1] if history.headroom and history.headroom[-1][1] else None
    autopsies = history.autopsies
    if reading is None and not autopsies:
        return _run_figure(history)
    panels = _run_panels(history)
    layers = 0 if reading is None else min(len(reading[1]), _HEADROOM_LAYERS)
    heights = [2.4 * max(1, len(panels)) + 0.9]
    if reading is not None:
        heights.append(0.28 * layers + 1.6)
    if autopsies:
        heights.append(0.6 + 0.18 * sum(len(_wrapped(a.message)) + 0.5 for a in autopsies[:_AUTOPSIES_SHOWN]))
    figure = new_figure(figsize=(9, sum(heights)))
    parts = figure.subfigures(len(heights), 1, height_ratios=heights, squeeze=False)[:, 0]
    axes = _run_figure(history, parts[0])
    if autopsies and axes:
        _mark_autopsies(axes[0], autopsies)
    if reading is not None:
        _headroom_panels(parts[1], *reading)
    if autopsies:
        _autopsy_notes(parts[-1], autopsies)
    return figure


def _run_panels(history: AmpHistory) -> list[tuple[str, list[float | None], str]]:
    return _panels_and_notes(history)[0]


def _panels_and_notes(history: AmpHistory) -> tuple[list[tuple[str, list[float | None], str]], list[str]]:
    """The series worth a panel (label, one value per batch, kind) and, for the others, why not."""
    merged = batches(history.steps)
    skipped_steps = [b.step for b in merged if b.skipped]
    norm_label = "gradient norm" + (" (all optimizers)" if any(b.optimizers > 1 for b in merged) else "")
    candidates: list[tuple[str, list[float | None], str]] = [
        ("loss scale", [b.scale for b in merged], "log2"),
        ("skipped steps (total)", [float(n) for n in _cumulative([b.skipped for b in merged])], "count"),
        (norm_label, [b.grad_norm for b in merged], "log10"),
        (f"{history.memory_kind} (MB)", [b.memory_mb for b in merged], "zero"),
    ]
    if history.fp8 is not None and history.fp8.checks:
        worst = {point.step: point.flushed_pct for point in history.fp8.checks}
        candidates.append(("FP8: most flushed cast (%)", [worst.get(b.step) for b in merged], "fp8"))
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
    return panels, notes


def _run_figure(history: AmpHistory, target: Any = None) -> Any:
    """The time-series panels, drawn on ``target`` (a subfigure) or on a figure of their own (returned)."""
    merged = batches(history.steps)
    skipped_steps = [b.step for b in merged if b.skipped]
    xs = [b.step for b in merged]
    panels, notes = _panels_and_notes(history)
    figure = new_figure(figsize=(9, 2.4 * max(1, len(panels)) + 0.9)) if target is None else target
    if not merged:
        figure.suptitle("lightning-amp-plus: no optimizer step was taken", fontsize=11)
        return figure if target is None else []
    title = f"lightning-amp-plus: {plural(len(history.steps), 'optimizer step')}"
    if len(merged) != len(history.steps):
        title += f" in {plural(len(merged), 'batch', 'batches')}"
    title += f", {len(skipped_steps)} skipped"
    spikes = [b for b in merged if b.spike_verdict is not None and b.spike_verdict.spike]
    if spikes:
        title += f", {plural(len(spikes), 'spike')}"  # the legend names the spike guard's marks
    figure.suptitle(title + ("\n" + "; ".join(notes) if notes else ""), fontsize=11)
    if not panels:
        axis = figure.subplots()
        axis.set_axis_off()
        axis.text(0.5, 0.5, "nothing was measured", ha="center", va="center", transform=axis.transAxes)
        return figure if target is None else []
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for axis, (label, values, kind) in zip(axes, panels, strict=True):
        _draw_series(axis, xs, values, kind, skipped_steps)
        if kind == "log10":
            _draw_spike_guard(axis, merged)
        if kind == "fp8":
            _draw_fp8(axis, history.fp8)
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
    labelled: dict[str, Any] = {}  # each label once, from whichever panel drew it
    for axis in axes:
        labelled.update(zip(*reversed(axis.get_legend_handles_labels()), strict=True))
    if labelled:  # outside the panels: with many skips, no spot inside is free of lines
        # Below the panels, in one row: above them it would cover the title's second line.
        figure.legend(
            list(labelled.values()), list(labelled), loc="outside lower center", ncols=len(labelled), fontsize=8
        )
    axes[-1].set_xlabel("optimizer step (global step)")
    _step_axis(axes[-1], xs)
    return figure if target is None else list(axes)


# ---------------------------------------------------------------------------------------- autopsies, headroom
_HEADROOM_LAYERS = 24  # the layers drawn: the tightest ones, in model order
_AUTOPSIES_SHOWN = 3
_NEAR_BITS = 2.0  # activations within this many bits of a format's largest value are drawn red


def _wrapped(text: str, width: int = 118) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=width) or [""]


def _mark_autopsies(axis: Any, autopsies: Sequence[Any]) -> None:
    """A1, A2... at the autopsied steps of the top panel (the list of what each found is under the panels)."""
    for number, found in enumerate(autopsies[:_AUTOPSIES_SHOWN], start=1):
        axis.axvline(found.step, color="black", linestyle=":", linewidth=1)
        axis.annotate(
            f"A{number}",
            (found.step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, -10),
            textcoords="offset points",
            fontsize=8,
            fontweight="bold",
        )


def _autopsy_notes(figure: Any, autopsies: Sequence[Any]) -> None:
    lines = []
    for number, found in enumerate(autopsies[:_AUTOPSIES_SHOWN], start=1):
        wrapped = _wrapped(found.message)
        lines.append(f"A{number} {wrapped[0]}")
        lines.extend("     " + line for line in wrapped[1:])
    if len(autopsies) > _AUTOPSIES_SHOWN:
        lines.append(f"... and {len(autopsies) - _AUTOPSIES_SHOWN} more (monitor.autopsies)")
    figure.suptitle("overflow autopsies: where a skipped step's inf/NaN started, and what to do", fontsize=10)
    axis = figure.subplots()
    axis.set_axis_off()
    axis.text(0.0, 1.0, "\n".join(lines), va="top", ha="left", fontsize=8, family="monospace")


def _headroom_panels(figure: Any, step: int, reading: dict[str, Any]) -> None:
    """The last headroom reading: bits of activation range left per layer, and gradients lost at the scale."""
    names = list(reading)
    if len(names) > _HEADROOM_LAYERS:  # the tightest ones, kept in model order
        tightest = set(sorted(names, key=lambda n: reading[n].headroom_bits["float16"])[:_HEADROOM_LAYERS])
        names = [name for name in names if name in tightest]
    layers = [reading[name] for name in names]
    labels = [name or "model" for name in names]
    dtype = str(layers[0].dtype).removeprefix("torch.")
    scale = layers[0].scale
    figure.suptitle(
        f"headroom at step {step} (an FP32 replay of the batch), {dtype} at loss scale {scale_text(scale)}",
        fontsize=10,
    )
    bits_axis, lost_axis = figure.subplots(1, 2, sharey=True, width_ratios=[3, 2])
    rows = list(range(len(names)))
    # float16's range only: every FP8 recipe scales each tensor to float8's top, so an unscaled float8 bar would
    # mislead (under fp8-mixed, the FP8 panel shows what the casts lose).
    bits = [layer.headroom_bits["float16"] for layer in layers]
    colors = ["tab:red" if b < _NEAR_BITS else "tab:blue" for b in bits]
    bits_axis.barh(rows, bits, height=0.6, color=colors, label="to float16's max")
    bits_axis.axvline(0, color="black", linewidth=0.8)
    bits_axis.axvline(_NEAR_BITS, color="tab:red", linewidth=0.8, linestyle="--")
    bits_axis.set_xlabel("activations: bits below float16's largest value (red: under 2)")
    bits_axis.set_yticks(rows, labels, fontsize=7)
    bits_axis.invert_yaxis()
    _legend_below(bits_axis)
    flushed = [_percent(layer.grad_flushed_pct) for layer in layers]
    subnormal = [_percent(layer.grad_subnormal_pct) for layer in layers]
    lost_axis.barh(rows, flushed, color="tab:red", label="flushed to zero")
    lost_axis.barh(rows, subnormal, left=flushed, color="tab:orange", label="subnormal")
    lost_axis.set_xlabel(f"gradients lost in {dtype} (%)")
    lost_axis.set_xlim(0, max(1.0, max(f + n for f, n in zip(flushed, subnormal, strict=True)) * 1.15))
    if not any(flushed) and not any(subnormal):  # no bar at all: say it, or the empty panel reads as not measured
        lost_axis.text(
            0.5,
            0.5,
            f"0% in every layer:\nno gradient value flushed\nto zero or subnormal in {dtype}",
            transform=lost_axis.transAxes,
            ha="center",
            va="center",
            fontsize=8,
            color="dimgray",
        )
    _legend_below(lost_axis)
    for axis in (bits_axis, lost_axis):
        axis.grid(True, axis="x", alpha=0.3)


def _legend_below(axis: Any) -> None:
    # Under the axis label, outside the bars: inside, a legend hides the last layers' bars whatever its corner.
    axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, frameon=False)


def _percent(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def _step_axis(axis: Any, xs: list[int]) -> None:
    """Whole steps only, from the first step to the last, with a margin that keeps their marks in view."""
    from matplotlib.ticker import FixedLocator

    span = xs[-1] - xs[0]
    margin = max(0.03 * span, 0.15) if span else 0.5
    axis.set_xlim(xs[0] - margin, xs[-1] + margin)
    if span < 5:  # a short run: a tick on each step, not on 0.25, 0.5...
        axis.xaxis.set_major_locator(FixedLocator(list(range(xs[0], xs[-1] + 1))))
    else:
        axis.xaxis.set_major_locator(_integer_locator())


def _not_measured(label: str, kind: str) -> str:
    if kind == "log2":
        return "no loss scaler (bf16 or fp32): no loss-scale panel"
    return f"{label.split(' (')[0]} not recorded"


def _draw_series(axis: Any, xs: list[int], values: list[float | None], kind: str, skipped: list[int]) -> None:
    usable = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]  # None: not recorded on that step
    # A value that cannot be drawn (inf/NaN, or <= 0 on a log axis) breaks the line there instead of bridging it.
    drawn = [(x, v if math.isfinite(v) and (v > 0 or not kind.startswith("log")) else math.nan) for x, v in usable]
    points = [(x, v) for x, v in drawn if not math.isnan(v)]
    px, py = [x for x, _ in points], [v for _, v in points]
    lx, ly = [x for x, _ in drawn], [v for _, v in drawn]
    if kind == "log2":
        lonely = _has_isolated_points(drawn, xs)  # a step line through a lone point has no length: mark it
        axis.plot(lx, ly, drawstyle="steps-post", color="tab:blue", marker="o" if lonely else None, markersize=3)
        _power_of_two_axis(axis, min(py), max(py))
    elif kind == "count":
        axis.plot(px, py, drawstyle="steps-post", color="tab:red")
        axis.set_ylim(0, max(py) * 1.15)
        axis.yaxis.set_major_locator(_integer_locator())
    else:
        # Points as dots where a line would hide them: few of them, or one between two gaps.
        dots = len(points) <= 20 or _has_isolated_points(drawn, xs)
        axis.plot(lx, ly, marker="o" if dots else None, markersize=3, color="tab:blue")
        if kind == "log10" and max(py) > 10 * min(py):  # a log axis only where the norm spans a decade or more
            axis.set_yscale("log")
        elif kind in ("zero", "fp8"):
            # From zero: a 0.1 MB wiggle on 900 MB is flat, and a real leak still climbs visibly.
            axis.set_ylim(0, max(max(py), 1e-9) * 1.15)
    # Above the panel, not on it: a note in the plot area hides the points under it.
    why = {"zero": "the steps Lightning logs", "fp8": "the FP8 check steps"}.get(kind, "")
    note = _coverage_note(xs, usable, px, skipped, why)
    axis.set_title(note, loc="left", fontsize=8)
    last = f"last {_last_text(py[-1], kind)}" + (f" (step {px[-1]})" if px[-1] != xs[-1] else "")
    axis.set_title(last, loc="right", fontsize=8)
    skipped_points = [(x, v) for x, v in points if x in set(skipped)]
    for number, step in enumerate(skipped):
        axis.axvline(step, color="tab:red", alpha=0.35, linewidth=1, label="skipped step" if number == 0 else None)
    if skipped_points and kind != "count":
        axis.plot([x for x, _ in skipped_points], [v for _, v in skipped_points], "x", color="tab:red", markersize=5)


def _draw_spike_guard(axis: Any, merged: list[Batch]) -> None:
    """On the gradient-norm panel: the spike guard's limit (once it decides) and each spike at the norm it judged."""
    judged = [(b.step, b.spike_verdict) for b in merged if b.spike_verdict is not None]
    limits = [(x, v.threshold_norm) for x, v in judged if math.isfinite(v.threshold_norm)]  # inf: still warming up
    if limits:
        axis.plot(*zip(*limits, strict=True), "--", color="tab:orange", linewidth=1, label="spike guard's limit")
    for action, marker, label in (("skip", "v", "spike, skipped"), ("clip", "^", "spike, clipped to the limit")):
        spikes = [(x, v.norm) for x, v in judged if v.action == action]
        if spikes:
            axis.plot(*zip(*spikes, strict=True), marker, color="tab:orange", markersize=7, label=label)
    norms = [v.norm for _, v in judged if v.norm > 0]
    if norms and axis.get_yscale() == "linear" and max(norms) > 10 * min(norms):
        axis.set_yscale("log")  # spikes a decade above the rest: on a linear axis the ordinary steps would be flat


def _draw_fp8(axis: Any, record: Any) -> None:
    """On the FP8 panel: the warning threshold, the worst point's layer and cast, and the layers that fell back.

    The labels stay inside the panel, clear of the x axis's tick labels and of each other: the worst point's label
    sits above the point (written below it, a low point's label ran into the tick labels), the fallbacks' along the
    panel's top, in a band the y limit keeps free; each runs toward the middle of the panel, so none leaves it.
    """
    axis.axhline(record.warn_pct, color="tab:red", linestyle="--", linewidth=0.8, label="fp8_flush_warn_pct")
    top = max(record.checks, key=lambda point: point.flushed_pct)
    steps = [point.step for point in record.checks] + [step for step, _ in record.fell_back]
    middle = (min(steps) + max(steps)) / 2

    def inward(step: int) -> dict[str, Any]:  # the text runs away from the nearer edge of the panel
        return {"ha": "left", "dx": 3} if step <= middle else {"ha": "right", "dx": -3}

    if top.flushed_pct > 0:
        side = inward(top.step)
        axis.annotate(
            f"`{top.layer}` {top.cast}",
            (top.step, top.flushed_pct),
            xytext=(side["dx"], 5),
            textcoords="offset points",
            ha=side["ha"],
            va="bottom",
            fontsize=7,
        )
    for number, (step, layer) in enumerate(record.fell_back):
        axis.axvline(
            step, color="tab:purple", linestyle=":", label="FP8 layer fell back to bf16" if not number else None
        )
        side = inward(step)
        axis.annotate(
            layer,
            (step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(side["dx"], -3),
            textcoords="offset points",
            ha=side["ha"],
            va="top",
            fontsize=7,
            color="tab:purple",
        )
    # Room above the highest point for its label, and above that for the fallbacks' labels.
    axis.set_ylim(0, max(axis.get_ylim()[1], record.warn_pct * 1.3, top.flushed_pct * 1.5))


def _has_isolated_points(drawn: list[tuple[int, float]], xs: list[int]) -> bool:
    """Whether a drawable value has no drawable neighbour: a line through it would have no length."""
    value = dict(drawn)
    shown = [not math.isnan(value.get(x, math.nan)) for x in xs]
    return any(
        here and not (index > 0 and shown[index - 1]) and not (index + 1 < len(shown) and shown[index + 1])
        for index, here in enumerate(shown)
    )


def _coverage_note(
    xs: list[int], usable: list[tuple[int, float]], drawn_xs: list[int], skipped: list[int], why: str
) -> str:
    """What the panel's points are, when they are not every step: where the series was recorded, what is not drawn.

    Examples:
        >>> _coverage_note(list(range(40)), [(9, 1.0), (19, 1.0), (29, 1.0), (39, 1.0)], [9, 19, 29, 39], [], "")
        'recorded on 4 of 40 steps: every 10th, from step 9'
        >>> _coverage_note([0, 1, 2, 3], [(0, 0.5), (2, 0.5)], [0, 2], [], "the FP8 check steps")
        'recorded on 2 of 4 steps (the FP8 check steps): every 2nd, from step 0'
        >>> _coverage_note([0, 1, 2, 3], [(0, 1.0), (1, math.inf), (2, math.inf), (3, 1.0)], [0, 3], [1, 2], "")
        'not finite on the 2 skipped steps (not drawn)'
    """
    notes = []
    recorded = [x for x, _ in usable]
    if len(recorded) < len(xs):
        gaps = {b - a for a, b in itertools.pairwise(recorded)}
        where = f": every {_ordinal(gaps.pop())}, from step {recorded[0]}" if len(gaps) == 1 else ""
        notes.append(f"recorded on {len(recorded)} of {len(xs)} steps{' (' + why + ')' if why else ''}{where}")
    hidden = sorted(set(recorded) - set(drawn_xs))
    if hidden:
        which = f"the {len(hidden)} skipped steps" if set(hidden) <= set(skipped) else plural(len(hidden), "step")
        if len(hidden) == 1:
            which = "the skipped step" if set(hidden) <= set(skipped) else f"step {hidden[0]}"
        notes.append(f"not finite on {which} (not drawn)")
    return "; ".join(notes)


def _ordinal(number: int) -> str:
    """``2nd``, ``3rd``, ``10th``, ``21st``: "every 2nd step"."""
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def _last_text(value: float, kind: str) -> str:
    if kind == "log2":
        return scale_text(value)
    if kind == "count":
        return f"{value:.0f}"
    return f"{value:,.1f}" if kind == "zero" else f"{value:.3g}"


def _integer_locator() -> Any:
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _power_of_two_axis(axis: Any, low: float, high: float) -> None:
    """A log2 axis whose ticks are powers of two covering ``[low, high]``: both ends labelled, at most 9 ticks."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    axis.set_yscale("log", base=2)
    exponents = _tick_exponents(math.floor(math.log2(low)), math.ceil(math.log2(high)))
    axis.yaxis.set_major_locator(FixedLocator([2.0**e for e in exponents]))
    axis.yaxis.set_minor_locator(NullLocator())
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: scale_text(value) if value > 0 else ""))
    bottom, top = exponents[0], exponents[-1]
    margin = 0.15 * max(top - bottom, 2)  # in powers of two: the end ticks (and a flat line) stay clear of the frame
    axis.set_ylim(2.0 ** (bottom - margin), 2.0 ** (top + margin))


def _tick_exponents(bottom: int, top: int, most: int = 9) -> list[int]:
    """Exponents from ``top`` down to ``bottom`` in equal strides, ``top`` and ``bottom`` always among them.

    The line's own ends are labelled: the scale it started from and the floor it reached, which a locator choosing
    round numbers on its own may leave out (2**15..2**1 on a line from 2**16 to 2**0).

    Examples:
        >>> _tick_exponents(0, 16)
        [0, 2, 4, 6, 8, 10, 12, 14, 16]
        >>> _tick_exponents(0, 24)
        [0, 3, 6, 9, 12, 15, 18, 21, 24]
        >>> _tick_exponents(18, 24), _tick_exponents(16, 16)
        ([18, 19, 20, 21, 22, 23, 24], [16])
        >>> _tick_exponents(0, 17)  # the stride counted from the top; the bottom tick kept
        [0, 2, 5, 8, 11, 14, 17]
    """
    stride = max(1, math.ceil((top - bottom) / (most - 1)))
    exponents = list(range(top, bottom, -stride))
    if exponents and exponents[-1] - bottom < stride / 2 and exponents[-1] != top:
        exponents.pop()  # too close to the bottom tick to be read apart from it
    return sorted({*exponents, bottom})


def _cumulative(flags: list[bool]) -> list[int]:
    total, out = 0, []
    for flag in flags:
        total += int(flag)
        out.append(total)
    return out
