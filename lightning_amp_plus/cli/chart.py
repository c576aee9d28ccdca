"""``amp-plus compare``'s bar chart: one bar per configuration, in four panels."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from lightning_amp_plus.monitor.chart import new_figure, save_png

__all__ = ["ComparisonRow", "write_comparison_chart"]


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
    return save_png(_comparison_figure(rows, title), path)


def _comparison_figure(rows: Sequence[ComparisonRow], title: str) -> Any:
    names = [row.config for row in rows]
    relative = all(row.ratio is not None for row in rows)
    panels: list[tuple[str, list[float | None], str]] = [
        (
            "step time vs 32-true (lower is faster)" if relative else "step time, ms (median)",
            [row.ratio if relative else row.step_ms for row in rows],
            "{:.2f}x" if relative else "{:,.1f}",
        ),
        (
            "peak memory, MB (on CPU: rise of the RSS)",
            [row.peak_memory_mb for row in rows],
            "{:,.1f}",
        ),
        ("final train loss", [row.final_train_loss for row in rows], "{:.3f}"),
        ("validation accuracy", [row.val_acc for row in rows], "{:.3f}"),
    ]
    figure = new_figure(figsize=(11, 1.2 + 0.45 * len(rows) * 2))
    axes = figure.subplots(2, 2, sharey=True)
    colors = [_family_color(name) for name in names]
    positions = list(range(len(rows)))
    for axis, (label, values, template) in zip(axes.flat, panels, strict=True):
        heights = [v if v is not None and math.isfinite(v) else 0.0 for v in values]
        axis.barh(positions, heights, color=colors)
        texts = ["-" if v is None or not math.isfinite(v) else template.format(v) for v in values]
        reference = 1.0 if relative and template.endswith("x") else 0.0  # the 1.0x line: labels start past it
        for position, height, text in zip(positions, heights, texts, strict=True):
            axis.annotate(
                text,
                (max(height, reference), position),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        axis.set_title(label, fontsize=10)
        # Accuracy on its whole 0-1 range; the others from zero to a little past the longest bar and its label.
        axis.set_xlim(0, 1.12 if label == "validation accuracy" else max([*heights, reference, 1e-12]) * 1.25)
        axis.grid(True, axis="x", alpha=0.3)
        if reference:
            axis.axvline(reference, color="black", linewidth=0.8)
    axes[0, 0].set_yticks(positions, names)
    axes[0, 0].invert_yaxis()  # the table's order, top to bottom
    figure.suptitle(title, fontsize=11)
    _family_legend(figure, names)
    return figure


_FAMILIES = {
    "tab:gray": "fp32 (32-true)",
    "tab:blue": "Lightning's built-in precision",
    "tab:orange": "ours (MixedPrecisionPlugin)",
    "tab:red": "ours + FP32 master weights",
}
"""What each bar colour stands for, in the legend's order."""


def _family_color(name: str) -> str:
    if name.startswith("lightning"):
        return "tab:blue"
    if name.startswith("ours"):
        return "tab:red" if name.endswith("master") else "tab:orange"
    return "tab:gray"


def _family_legend(figure: Any, names: Sequence[str]) -> None:
    """A legend of the colours the bars use, below the panels."""
    from matplotlib.patches import Patch

    used = {_family_color(name) for name in names}
    handles = [Patch(color=color, label=label) for color, label in _FAMILIES.items() if color in used]
    figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=9, frameon=False)
