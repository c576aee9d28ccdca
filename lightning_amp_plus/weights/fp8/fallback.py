"""When an FP8 layer goes back to bf16: a small rule over the readings, with a state of plain values.

A layer is due when its worst cast flushed more than the limit (``threshold_pct``) at ``in_a_row`` readings in a row
(two by default): one reading can catch a single odd batch, two in a row mean the layer's inputs or gradients keep an
outlier that FP8's scale cannot hold. A reading at or below the limit resets the layer's count; a layer without a
reading keeps it. With ``threshold_pct=None`` the rule never sends a layer back: it watches at the default limit
(:data:`DEFAULT_THRESHOLD_PCT`) and names each layer once, for a warning.

Examples:
    >>> from lightning_amp_plus.weights.fp8.readings import CastReading
    >>> rule = FallbackRule(threshold_pct=1.0)
    >>> rule.update([CastReading("mlp.fc", "input", 4.4, 58.0, 4096), CastReading("head", "input", 0.0, 0.1, 512)])
    []
    >>> rule.update([CastReading("mlp.fc", "input", 3.9, 55.0, 4096)])
    ['mlp.fc']
    >>> rule.state_dict()
    {'streaks': {'mlp.fc': 2, 'head': 0}, 'said': []}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning_amp_plus._checks import check_int
from lightning_amp_plus.weights.fp8.readings import CastReading, worst_flush

__all__ = ["DEFAULT_THRESHOLD_PCT", "FallbackRule"]

DEFAULT_THRESHOLD_PCT = 1.0
"""Percent flushed above which a layer counts: the default fallback, and what ``threshold_pct=None`` watches."""


class FallbackRule:
    """Counts, per layer, the readings in a row above the limit; says which layers reach ``in_a_row``.

    Args:
        threshold_pct: percent of a cast's nonzero values flushed to zero above which a reading counts and a layer
            falls back, or ``None`` to never fall back (the rule then watches at :data:`DEFAULT_THRESHOLD_PCT` and
            names each layer that reaches it once: :attr:`said`).
        in_a_row: how many readings in a row it takes.

    Attributes:
        streaks: each layer's readings in a row above the limit.
        said: with ``threshold_pct=None``, the layers already named (each is named once).
    """

    def __init__(self, threshold_pct: float | None, in_a_row: int = 2) -> None:
        self.threshold_pct = threshold_pct
        self.in_a_row = check_int("FallbackRule", "in_a_row", in_a_row, minimum=1)
        self.streaks: dict[str, int] = {}
        self.said: list[str] = []

    @property
    def limit_pct(self) -> float:
        """The percent a reading must pass to count: ``threshold_pct``, or the default when it is ``None``."""
        return DEFAULT_THRESHOLD_PCT if self.threshold_pct is None else self.threshold_pct

    def update(self, readings: Iterable[CastReading]) -> list[str]:
        """Count one check step's readings; return the layers that reach the rule at this one.

        With ``threshold_pct=None``, a layer is returned the first time only.
        """
        due = []
        for layer, worst in worst_flush(readings).items():
            above = worst.flushed_pct > self.limit_pct
            self.streaks[layer] = self.streaks.get(layer, 0) + 1 if above else 0
            if above and self.streaks[layer] == self.in_a_row and layer not in self.said:
                due.append(layer)
                if self.threshold_pct is None:
                    self.said.append(layer)
        return due

    def state_dict(self) -> dict[str, Any]:
        """The counts and the layers named, as plain values."""
        return {"streaks": dict(self.streaks), "said": list(self.said)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s counts (a state without ``said``, written before it was kept, names none).

        Raises:
            ValueError: a count is not an int >= 0 under a string name, or ``said`` is not a list of names.
        """
        streaks = state.get("streaks", {})
        if not isinstance(streaks, Mapping) or not all(
            isinstance(name, str) and isinstance(count, int) and not isinstance(count, bool) and count >= 0
            for name, count in streaks.items()
        ):
            raise ValueError(f"The FP8 fallback state holds streaks={streaks!r}: expected layer names -> ints >= 0.")
        said = state.get("said", [])
        if not isinstance(said, list) or not all(isinstance(name, str) for name in said):
            raise ValueError(f"The FP8 fallback state holds said={said!r}: expected a list of layer names.")
        self.streaks = dict(streaks)
        self.said = list(said)
