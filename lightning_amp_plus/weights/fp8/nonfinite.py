"""Which FP8 layers met a non-finite value this step, kept on the device and read only when the step is skipped.

One NaN or inf in a layer's input makes its float8 amax non-finite: a tensorwise scale becomes NaN (or 0 for inf),
every output of the layer is non-finite, the loss is NaN, and every gradient after it too, so the parameters the
overflow check names are all of them. Where it started is the first converted layer, in forward order, whose input
(or weight) held a non-finite value; if the forward was clean, the first in backward order whose output gradient did.

The forward needs only one column of the layer's output: a NaN or inf anywhere in an input row makes that row's scale
(rowwise) or the tensor's (tensorwise) NaN or 0, and so every output of the row NaN; the first column is non-finite
exactly when the input casts met a non-finite value (the weight, never non-finite while steps with non-finite
gradients are skipped, is checked when the flags are read). The backward reads the whole output gradient. Each is one
``aminmax`` and two in-place adds into a 0-d FP32 flag (NaN once anything non-finite was seen), per layer and pass: no
host sync, a bounded amount of memory. :meth:`NonfiniteLog.read` reads every flag at once (one sync);
:meth:`NonfiniteLog.snapshot` keeps them on the device to be read later (after the step's skip is known);
:meth:`NonfiniteLog.reset` zeroes them in one call. Gradient accumulation ORs the micro-batches of a step together.

Examples:
    >>> log = NonfiniteLog()
    >>> log.saw_output("fc1", torch.ones(4, 16)); log.saw_output("fc2", torch.tensor([[1.0], [float("nan")]]))
    >>> log.saw_grad("fc2", torch.full((2, 1), float("inf"))); log.saw_grad("fc1", torch.full((4, 16), float("nan")))
    >>> log.read()
    ['fc2', 'fc1']
    >>> log.reset(); log.read()
    []
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from lightning_amp_plus.step.sharding import local_view

__all__ = ["NonfiniteLog"]


class NonfiniteLog:
    """Per-layer device flags of a non-finite value met by the FP8 casts since the last :meth:`reset`."""

    def __init__(self) -> None:
        self._forward: dict[str, Tensor] = {}
        self._backward: dict[str, Tensor] = {}
        self._order: list[str] = []
        """Layer names in the order their first training forward ran (forward order)."""

    def saw_output(self, name: str, output: Tensor) -> None:
        """Note layer ``name``'s output of a training forward (its first column: see the module's docstring)."""
        value = output[..., :1]
        flag = self._forward.get(name)
        if flag is None or flag.device != value.device:
            # Both flags are made here, in the forward: the gradient hook then only adds in place (torch.compile cannot
            # trace a hook that changes a dict: a graph break per layer).
            if name not in self._forward:
                self._order.append(name)
            flag = self._forward[name] = torch.zeros((), dtype=torch.float32, device=value.device)
            self._backward[name] = torch.zeros((), dtype=torch.float32, device=value.device)
        _mark(flag, value)

    def saw_grad(self, name: str, grad: Tensor) -> None:
        """Note what layer ``name``'s output-gradient casts read in backward (a tensor hook: returns nothing)."""
        flag = self._backward.get(name)
        if flag is not None and flag.device == grad.device:
            _mark(flag, grad)

    def reset(self) -> None:
        """Clear every flag (one call, no sync): at the end of each optimizer step."""
        flags = [*self._forward.values(), *self._backward.values()]
        if flags:
            torch._foreach_zero_(flags)

    def read(self, weights: Mapping[str, Tensor] | None = None) -> list[str]:
        """The layers whose casts met a non-finite value since the last reset, the origin first (one host sync).

        Those with a non-finite input (or, if given, weight) in forward order, then those with a non-finite output
        gradient in backward order.
        """
        return self.snapshot(weights)()

    def snapshot(
        self, weights: Mapping[str, Tensor] | None = None, reduce: Callable[[Tensor], Tensor] | None = None
    ) -> Callable[[], list[str]]:
        """The flags as they are now, kept on the device (no host sync): a function that names the layers (one sync).

        Args:
            weights: the layers' weights, checked too (a non-finite weight names its layer in forward order).
            reduce: applied on the device to the flags (1.0 where a layer met a non-finite value), e.g. a SUM
                all-reduce across data-parallel ranks: the layers any rank's casts met are named on every rank. Every
                rank must then take a snapshot at the same points, with the same layers run.
        """
        weights = weights or {}
        forward = [*self._order, *(name for name in weights if name not in self._forward)]
        markers: list[Tensor] = []
        for name in forward:
            flag = self._forward.get(name)
            if name in weights:
                weight_flag = _marker(weights[name])
                flag = weight_flag if flag is None else flag.to(weight_flag.device) + weight_flag
            assert flag is not None  # a name of `forward` ran forward or has a weight
            markers.append(flag)
        backward = [name for name in reversed(self._order) if name in self._backward]
        backward += [name for name in self._backward if name not in self._forward]
        markers += [self._backward[name] for name in backward]
        if not markers:
            return list
        device = markers[0].device
        met = (~torch.isfinite(torch.stack([marker.to(device) for marker in markers]))).to(torch.float32)
        if reduce is not None:
            met = reduce(met)

        def names() -> list[str]:
            bad = [count > 0 for count in met.tolist()]
            forward_bad = [name for name, hit in zip(forward, bad, strict=False) if hit]
            backward_bad = [name for name, hit in zip(backward, bad[len(forward) :], strict=True) if hit]
            return forward_bad + [name for name in backward_bad if name not in forward_bad]

        return names


def _marker(value: Tensor) -> Tensor:
    """A 0-d FP32 tensor: 0 if ``value`` is all finite, NaN otherwise (computed on the device)."""
    local = local_view(value)  # a DTensor (FSDP2): this rank's shard
    flag = torch.zeros((), dtype=torch.float32, device=local.device)
    _mark(flag, local)
    return flag


def _mark(flag: Tensor, value: Tensor) -> None:
    """Make ``flag`` NaN if ``value`` holds a NaN or inf (in place, on the device, no sync)."""
    if value.numel():
        low, high = torch.aminmax(value.detach())
        # x * 0 is 0 for a finite x and NaN for NaN or +-inf: the add keeps the flag NaN from then on.
        flag.add_(low, alpha=0).add_(high, alpha=0)
