"""FP8 numerics you can see: per layer and cast, the share of nonzero values flushed to zero and left subnormal.

Shares of the cast's target float8 format, under the scale the recipe computes. Dynamic scaling puts each tensor's
(or row's) amax at the top of the float8 range, so nothing saturates; what is lost is at the bottom. One outlier sets
the scale for everything it shares a scale with: a token 10,000 times larger than the rest pushes the other values of
a tensorwise cast below e4m3's smallest subnormal (2**-9), where they become zero, or into its subnormals (below
2**-6), where they keep 1-3 significant bits. :func:`count_rows` measures exactly that, with torchao's scale
functions (:func:`~lightning_amp_plus.weights.fp8.casts.cast_counts`), on check steps only: the layer's forward
(:class:`~lightning_amp_plus.weights.fp8.training.LayerGuard`) count its input and weight casts in forward and its
output-gradient casts in backward, on the device; :func:`readings_of` reads every count at once (one host sync).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_amp_plus.weights.fp8.casts import Cast, cast_counts, operand_2d

__all__ = ["COLUMNS", "CastReading", "count_rows", "readings_of", "worst_flush"]

COLUMNS = 4
"""A cast's counts: nonzero, flushed, subnormal, and how many times it was read (0: not read this check)."""


@dataclass(frozen=True)
class CastReading:
    """What one cast of one layer did on a check step (summed over its micro-batches).

    Attributes:
        layer: the layer's name.
        cast: the cast (``"input"``, ``"weight"``, ``"grad_output"``, ``"input_for_grad_weight"``...).
        flushed_pct: percent of the nonzero values that became zero in float8.
        subnormal_pct: percent of the nonzero values left subnormal in float8 (1-3 significant bits in e4m3).
        nonzero: how many nonzero values the cast read.
    """

    layer: str
    cast: str
    flushed_pct: float
    subnormal_pct: float
    nonzero: int


def worst_flush(readings: Iterable[CastReading]) -> dict[str, CastReading]:
    """Each layer's reading with the largest flushed share, in the readings' order.

    Examples:
        >>> worst = worst_flush([CastReading("fc", "input", 4.4, 58.0, 100), CastReading("fc", "weight", 0.0, 0.1, 9)])
        >>> worst["fc"].cast, worst["fc"].flushed_pct
        ('input', 4.4)
    """
    worst: dict[str, CastReading] = {}
    for reading in readings:
        if reading.layer not in worst or reading.flushed_pct > worst[reading.layer].flushed_pct:
            worst[reading.layer] = reading
    return worst


def count_rows(casts: Sequence[Cast], operands: Mapping[str, Tensor], device: torch.device) -> Tensor:
    """One row of :data:`COLUMNS` float64 counts per cast (on ``device``); zeros for a cast whose operand is absent.

    float64 holds every count exactly (up to 2**53 values); the counts of a check step's micro-batches add up.
    """
    rows = [torch.zeros(0, COLUMNS, dtype=torch.float64, device=device)]  # no cast: no row
    for cast in casts:
        operand = operands.get(cast.operand)
        if operand is None or not operand.numel():
            rows.append(torch.zeros(1, COLUMNS, dtype=torch.float64, device=device))
            continue
        counts = cast_counts(operand_2d(cast.operand, operand.detach()), cast).to(torch.float64)
        rows.append(torch.cat([counts, counts.new_ones(1)])[None])
    return torch.cat(rows)


def readings_of(
    keys: Sequence[tuple[str, str]], counts: Tensor, reduce: Callable[[Tensor], Tensor] | None = None
) -> list[CastReading]:
    """The readings of ``counts`` (one :func:`count_rows` row per ``(layer, cast)`` of ``keys``), read at once.

    Args:
        keys: the layer and cast of each row.
        counts: the rows, on the device.
        reduce: applied to ``counts`` before the read, e.g. a SUM all-reduce so that every data-parallel rank reads the
            same numbers.

    Returns:
        One reading per row that was read at least once, in the rows' order.

    Examples:
        >>> rows = torch.tensor([[100.0, 4.0, 50.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
        >>> readings_of([("fc", "input"), ("fc", "weight")], rows)
        [CastReading(layer='fc', cast='input', flushed_pct=4.0, subnormal_pct=50.0, nonzero=100)]
    """
    if reduce is not None:
        counts = reduce(counts)
    rows: list[list[float]] = counts.tolist()
    return [
        CastReading(layer, cast, _percent(flushed, nonzero), _percent(subnormal, nonzero), int(nonzero))
        for (layer, cast), (nonzero, flushed, subnormal, reads) in zip(keys, rows, strict=True)
        if reads > 0
    ]


def _percent(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole else 0.0
