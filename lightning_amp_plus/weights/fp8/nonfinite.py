"""Which FP8 layers met a non-finite value in a step, named from device flags, the origin first.

One NaN or inf in a layer's input makes its float8 amax non-finite: a tensorwise scale becomes NaN (or 0 for inf),
every output of the layer is non-finite, the loss is NaN, and every gradient after it too, so the parameters the
overflow check names are all of them. Where it started is the first converted layer, in forward order, whose input
(or weight) held a non-finite value; if the forward was clean, the first in backward order whose backward casts did.

Each layer keeps two flags on the device (0 while clean, NaN once anything non-finite was seen; see
:class:`~lightning_amp_plus.weights.fp8.training.LayerGuard`): the forward one reads the first column of the layer's
output (a NaN or inf anywhere in an input row makes that row's scale, or the tensor's, non-finite, and so the whole row
of the output), the backward one the first column of the gradient the layer hands back to its input (the same, for
the output gradient its backward GEMM casts). Here: :func:`snapshot` stacks them (one device op, no sync) into a
function that names the layers (one sync), to be called once the step is known to be skipped.

Examples:
    >>> nan, zero = torch.tensor(float("nan")), torch.tensor(0.0)
    >>> snapshot([("fc1", zero), ("fc2", nan)], [("fc2", nan), ("fc1", nan)])()
    ['fc2', 'fc1']
    >>> snapshot([("fc1", zero)], [("fc1", zero)])()
    []
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["snapshot"]


def snapshot(
    forward: Sequence[tuple[str, Tensor]],
    backward: Sequence[tuple[str, Tensor]],
    reduce: Callable[[Tensor], Tensor] | None = None,
) -> Callable[[], list[str]]:
    """The flags as they are now, kept on the device (no host sync): a function that names the layers (one sync).

    Args:
        forward: ``(layer, flag)`` of what the forward casts met, in forward order.
        backward: ``(layer, flag)`` of what the backward casts met, in backward order.
        reduce: applied on the device to the flags (1.0 where a layer met a non-finite value), e.g. a SUM
            all-reduce across data-parallel ranks: the layers any rank's casts met are named on every rank. Every
            rank must then take a snapshot at the same points, with the same layers.

    Returns:
        A function naming the layers that met a non-finite value: those in forward first, then those in backward.
    """
    markers = [flag for _, flag in (*forward, *backward)]
    if not markers:
        return list
    device = markers[0].device
    met = (~torch.isfinite(torch.stack([marker.to(device) for marker in markers]))).to(torch.float32)
    if reduce is not None:
        met = reduce(met)

    def names() -> list[str]:
        bad = [count > 0 for count in met.tolist()]
        forward_bad = [name for (name, _), hit in zip(forward, bad, strict=False) if hit]
        backward_bad = [name for (name, _), hit in zip(backward, bad[len(forward) :], strict=True) if hit]
        return forward_bad + [name for name in backward_bad if name not in forward_bad]

    return names
