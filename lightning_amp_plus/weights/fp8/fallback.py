"""When an FP8 layer goes back to bf16: a small rule over the readings, with a state of plain values.

A layer falls back when its worst cast flushed more than ``threshold_pct`` percent of its nonzero values at
``in_a_row`` readings in a row (two by default): one reading can catch a single odd batch, two in a row mean the
layer's inputs or gradients keep an outlier that FP8's scale cannot hold. A reading at or below the threshold resets
the layer's count; a layer without a reading keeps it. ``threshold_pct=None`` never falls back (readings only).

Examples:
    >>> from lightning_amp_plus.weights.fp8.readings import CastReading
    >>> rule = FallbackRule(threshold_pct=1.0)
    >>> rule.update([CastReading("mlp.fc", "input", 4.4, 58.0, 4096), CastReading("head", "input", 0.0, 0.1, 512)])
    []
    >>> rule.update([CastReading("mlp.fc", "input", 3.9, 55.0, 4096)])
    ['mlp.fc']
    >>> rule.state_dict()
    {'streaks': {'mlp.fc': 2, 'head': 0}}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning_amp_plus._checks import check_int
from lightning_amp_plus.weights.fp8.readings import CastReading, worst_flush

__all__ = ["FallbackRule"]


class FallbackRule:
    """Counts, per layer, the readings in a row above ``threshold_pct``; says which layers reach ``in_a_row``.

    Args:
        threshold_pct: percent of a cast's nonzero values flushed to zero above which a reading counts, or ``None``
            to never fall back.
        in_a_row: how many readings in a row it takes.
    """

    def __init__(self, threshold_pct: float | None, in_a_row: int = 2) -> None:
        self.threshold_pct = threshold_pct
        self.in_a_row = check_int("FallbackRule", "in_a_row", in_a_row, minimum=1)
        self.streaks: dict[str, int] = {}

    def update(self, readings: Iterable[CastReading]) -> list[str]:
        """Count one check step's readings; return the layers that reach the rule at this one."""
        due = []
        for layer, worst in worst_flush(readings).items():
            above = self.threshold_pct is not None and worst.flushed_pct > self.threshold_pct
            self.streaks[layer] = self.streaks.get(layer, 0) + 1 if above else 0
            if above and self.streaks[layer] == self.in_a_row:
                due.append(layer)
        return due

    def state_dict(self) -> dict[str, Any]:
        """The counts, as plain values."""
        return {"streaks": dict(self.streaks)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s counts.

        Raises:
            ValueError: a count is not an int >= 0 under a string name.
        """
        streaks = state.get("streaks", {})
        if not isinstance(streaks, Mapping) or not all(
            isinstance(name, str) and isinstance(count, int) and not isinstance(count, bool) and count >= 0
            for name, count in streaks.items()
        ):
            raise ValueError(f"The FP8 fallback state holds streaks={streaks!r}: expected layer names -> ints >= 0.")
        self.streaks = dict(streaks)
