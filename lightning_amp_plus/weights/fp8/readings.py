"""FP8 numerics you can see: per layer and cast, the share of nonzero values flushed to zero and left subnormal.

Shares of the cast's target float8 format, under the scale the recipe computes. Dynamic scaling puts each tensor's
(or row's) amax at the top of the float8 range, so nothing saturates; what is lost is at the bottom. One outlier sets
the scale for everything it shares a scale with: a token 10,000 times larger than the rest pushes the other values of
a tensorwise cast below e4m3's smallest subnormal (2**-9), where they become zero, or into its subnormals (below
2**-6), where they keep 1-3 significant bits. :class:`Readings` measures exactly that, with torchao's scale functions
(:func:`~lightning_amp_plus.weights.fp8.casts.cast_counts`), on check steps only: :meth:`Readings.arm` registers a
forward pre-hook (input and weight casts, in forwards with gradients: an evaluation forward is not read) and a forward
hook that puts a tensor hook on the output (output-gradient casts) on each layer; :meth:`Readings.take` reads every
count at once (one host sync) and removes the hooks. Between check steps there is no hook and no work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["CastReading", "Readings", "worst_flush"]


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


class Readings:
    """The flush and subnormal counts of every cast of the armed layers, kept on the device until :meth:`take`."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], Tensor] = {}
        self._handles: list[RemovableHandle] = []

    @property
    def armed(self) -> bool:
        """Whether the hooks are on (between :meth:`arm` and :meth:`take`)."""
        return bool(self._handles)

    def arm(self, layers: Mapping[str, nn.Module]) -> None:
        """Read the casts of ``layers`` (name -> converted layer) in every forward and backward until :meth:`take`."""
        from lightning_amp_plus.weights.fp8.casts import recipe_casts
        from lightning_amp_plus.weights.fp8.convert import guard_of

        self.disarm()
        for name, layer in layers.items():
            casts = recipe_casts(layer.__dict__["config"])  # torchao's Float8LinearConfig of the layer
            guard = guard_of(layer)
            every_device = guard is not None and guard.cast_every_device
            self._handles.append(layer.register_forward_pre_hook(partial(self._before, name, casts, every_device)))
            self._handles.append(layer.register_forward_hook(partial(self._after, name, casts)))

    def disarm(self) -> None:
        """Remove the hooks (the counts stay until :meth:`take`)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take(self, reduce: Callable[[Tensor], Tensor] | None = None) -> list[CastReading]:
        """Disarm, read every count (one host sync) and forget them: one reading per layer and cast.

        The layers come in the order they first ran.

        Args:
            reduce: applied to the ``(n, 3)`` int64 tensor of counts (nonzero, flushed, subnormal) before the read,
                e.g. a SUM all-reduce so that every data-parallel rank reads the same numbers.
        """
        self.disarm()
        if not self._counts:
            return []
        keys = list(self._counts)
        counts = torch.stack([self._counts[key] for key in keys])
        self._counts = {}
        if reduce is not None:
            counts = reduce(counts)
        rows: list[list[int]] = counts.tolist()
        order = {layer: i for i, layer in enumerate(dict.fromkeys(layer for layer, _ in keys))}
        readings = [
            CastReading(layer, cast, _percent(flushed, nonzero), _percent(subnormal, nonzero), nonzero)
            for (layer, cast), (nonzero, flushed, subnormal) in zip(keys, rows, strict=True)
        ]
        return sorted(readings, key=lambda reading: order[reading.layer])

    def _before(self, name: str, casts: tuple[Any, ...], every_device: bool, layer: nn.Module, args: Any) -> None:
        from lightning_amp_plus.weights.fp8.layer import input_as_cast

        if not args or not isinstance(args[0], Tensor) or not torch.is_grad_enabled():
            return  # an evaluation forward (no_grad, inference mode) between arming and the step is not training's
        operands = {"input": input_as_cast(args[0], every_device)}
        weight = layer.weight
        if isinstance(weight, Tensor) and not _cast_already(weight):
            operands["weight"] = weight
        self._count(name, casts, operands)

    def _after(self, name: str, casts: tuple[Any, ...], _layer: nn.Module, _args: Any, output: Any) -> None:
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(partial(self._grad, name, casts))  # type: ignore[no-untyped-call]

    def _grad(self, name: str, casts: tuple[Any, ...], grad: Tensor) -> None:
        self._count(name, casts, {"grad_output": grad})

    def _count(self, name: str, casts: tuple[Any, ...], operands: dict[str, Tensor]) -> None:
        from lightning_amp_plus.weights.fp8.casts import cast_counts, operand_2d

        with torch.no_grad():
            for cast in casts:
                if cast.operand in operands and operands[cast.operand].numel():
                    counts = cast_counts(operand_2d(cast.operand, operands[cast.operand]), cast)
                    key = (name, cast.name)
                    self._counts[key] = counts if key not in self._counts else self._counts[key] + counts


def _cast_already(weight: Tensor) -> bool:
    """Whether the weight reaches the layer in float8 already: FSDP2's FP8 all-gather cast it, from the shards.

    Its high-precision values never reach the layer then, so its cast is not read (the input and gradient casts are).
    """
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    return isinstance(weight, Float8TrainingTensor)


def _percent(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0
