"""Passes over gradient lists: unscale, measure (non-finite check and L2 norm in one), clip.

No Lightning here, and none of torch's private ``torch._amp_*`` kernels. The design goal is to touch gradient memory
as few times as possible:

* ``unscale_and_measure_`` multiplies each gradient by the inverse scale and takes its squared L2 norm right after,
  tensor by tensor on CPU for large tensors, so the norm reads memory the multiply just left in cache (small tensors go
  through one multi-tensor call, where the cost per call matters more than memory). The norm is of the *unscaled*
  values, so the overflow check holds after unscaling (an fp16 gradient that overflows when multiplied by an inverse
  scale above 1 is caught), and a non-finite value anywhere makes the norm non-finite. On CUDA the same two steps run as
  two multi-tensor (``_foreach``) kernels per dtype, which is what the hardware prefers.
* The global norm from that pass serves the skip decision, gradient clipping and monitoring alike; clipping multiplies
  only when the norm is over the limit (``torch.nn.utils.clip_grad_norm_`` always multiplies).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_amp_plus._float32 import f32

__all__ = ["clip_by_norm_", "nonfinite_names", "unscale_and_measure_"]

# Squared norms are accumulated in float32 whatever the gradient dtype, so fp16 gradients do not overflow the sum.
_NORM_DTYPE = torch.float32
_FLOAT32_MAX = torch.finfo(torch.float32).max
# Below this many elements a tensor is cheaper to treat in one foreach call with its peers than on its own.
_INTERLEAVE_MIN_NUMEL = 1 << 16


def _squared_norm(grad: Tensor) -> Tensor:
    flat = grad.reshape(-1)
    if flat.dtype != _NORM_DTYPE:
        # A float32 copy then a dot product is faster on CPU than vector_norm(dtype=float32) over half types.
        flat = flat.to(_NORM_DTYPE)
    # A dot product is the fastest full read of float32 memory on CPU (BLAS), faster than vector_norm.
    return torch.dot(flat, flat)


def _foreach_squared_norms(group: list[Tensor], inv_scale: float | None) -> list[Tensor]:
    if inv_scale is not None:
        torch._foreach_mul_(group, inv_scale)
    return [norm.square() for norm in torch._foreach_norm(group, 2, dtype=_NORM_DTYPE)]


def _cpu_squared_norms(group: list[Tensor], inv_scale: float | None) -> list[Tensor]:
    # Large tensors: multiply, then measure at once, while the tensor is still in cache. Small ones: two foreach calls
    # for all of them, because there the cost per call, not memory, is what counts.
    large = [i for i, grad in enumerate(group) if grad.numel() >= _INTERLEAVE_MIN_NUMEL]
    small = [i for i, grad in enumerate(group) if grad.numel() < _INTERLEAVE_MIN_NUMEL]
    squared: list[Tensor] = [torch.empty(0)] * len(group)
    for i in large:
        if inv_scale is not None:
            group[i].mul_(inv_scale)
        squared[i] = _squared_norm(group[i])
    if small:
        for i, value in zip(small, _foreach_squared_norms([group[i] for i in small], inv_scale), strict=True):
            squared[i] = value
    return squared


def _check_dense(grads: Sequence[Tensor]) -> None:
    for index, grad in enumerate(grads):
        if grad.is_sparse:
            raise TypeError(
                f"Gradient #{index} (shape {tuple(grad.shape)}) is sparse: lightning-amp-plus unscales dense gradients "
                "only. Use a dense layer (e.g. `nn.Embedding(..., sparse=False)`)."
            )


def unscale_and_measure_(grads: Sequence[Tensor], inv_scale: float | None, out_device: torch.device) -> Tensor:
    """Multiply ``grads`` in place by ``inv_scale`` and return each one's squared L2 norm, measured after the multiply.

    Args:
        grads: the gradients, dense, of any floating dtype, on any devices.
        inv_scale: ``1 / scale`` as a float32 value, or ``None`` to measure only (scale 1). The multiply runs in the
            gradient's compute type (float32 for half types), as torch's own unscale does.
        out_device: where the returned tensor lives (the scaler's device).

    Returns:
        A 1-D float32 tensor with one squared norm per gradient, in the order given. An entry is ``inf`` or ``nan``
        when that gradient holds a non-finite value (or its norm exceeds the float32 range, about 1.8e19).

    Example:
        >>> g = [torch.tensor([3.0, 4.0]), torch.tensor([float("inf")])]
        >>> unscale_and_measure_(g, 0.5, torch.device("cpu"))
        tensor([6.2500,    inf])
        >>> g[0]
        tensor([1.5000, 2.0000])
    """
    if not grads:
        return torch.zeros(0, dtype=_NORM_DTYPE, device=out_device)
    _check_dense(grads)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for index, grad in enumerate(grads):
        groups[(grad.device, grad.dtype)].append(index)
    pieces: list[tuple[list[int], Tensor]] = []
    for (device, _dtype), indices in groups.items():
        group = [grads[i] for i in indices]
        measure = _cpu_squared_norms if device.type == "cpu" else _foreach_squared_norms
        squared = torch.stack(measure(group, inv_scale))
        pieces.append((indices, squared.to(out_device, non_blocking=True)))
    if len(pieces) == 1:
        return pieces[0][1]
    result = torch.empty(len(grads), dtype=_NORM_DTYPE, device=out_device)
    for indices, squared in pieces:
        result[torch.tensor(indices, device=out_device)] = squared
    return result


def clip_by_norm_(grads: Sequence[Tensor], total_norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """Scale ``grads`` so their global norm is at most ``max_norm``, given the norm already measured.

    Uses the coefficient of ``torch.nn.utils.clip_grad_norm_`` (``max_norm / (total_norm + eps)``) but multiplies only
    when it is below 1, which saves a read and a write of every gradient on the common step where nothing is clipped.

    Args:
        grads: the (unscaled) gradients.
        total_norm: their global L2 norm, finite.
        max_norm: the limit.
        eps: added to the norm as torch does, for the same numbers.

    Returns:
        The coefficient applied (1.0 when nothing was clipped).

    Example:
        >>> g = [torch.tensor([3.0, 4.0])]
        >>> round(clip_by_norm_(g, 5.0, 1.0), 4), g[0]
        (0.2, tensor([0.6000, 0.8000]))
    """
    if not grads or max_norm >= _FLOAT32_MAX:
        return 1.0
    # torch computes `max_norm / (norm + eps)` on a float32 tensor, i.e. reciprocal(norm + eps) * max_norm, each
    # rounded to float32. Done here in Python floats with the same roundings (exact: float64 holds every float32
    # sum, product and quotient before rounding), the coefficient is bit-identical without touching a tensor.
    coef = f32(f32(1.0 / f32(f32(total_norm) + f32(eps))) * f32(max_norm))
    if coef >= 1.0:
        return 1.0
    by_device: dict[torch.device, list[Tensor]] = defaultdict(list)
    for grad in grads:
        by_device[grad.device].append(grad)
    for group in by_device.values():
        torch._foreach_mul_(group, coef)
    return coef


def nonfinite_names(named: Sequence[tuple[str, Tensor]]) -> list[str]:
    """Names of the tensors that hold inf or NaN, found with one pass and one host read.

    One multi-tensor norm per device (float32 accumulation, so large half-precision tensors do not overflow it): a
    non-finite value makes its tensor's norm non-finite. Names are looked up only when something is wrong.

    Example:
        >>> nonfinite_names([("a", torch.ones(2)), ("b", torch.tensor([1.0, float("nan")]))])
        ['b']
    """
    if not named:
        return []
    tensors = [tensor for _, tensor in named]
    _check_dense(tensors)
    first = tensors[0].device
    with torch.no_grad():
        if all(tensor.device == first for tensor in tensors):  # the usual case: one multi-tensor call
            order: list[int] = list(range(len(tensors)))
            norms = list(torch._foreach_norm(tensors, 2, dtype=_NORM_DTYPE))
        else:
            by_device: dict[torch.device, list[int]] = defaultdict(list)
            for index, tensor in enumerate(tensors):
                by_device[tensor.device].append(index)
            order, norms = [], []
            for indices in by_device.values():
                group_norms = torch._foreach_norm([tensors[i] for i in indices], 2, dtype=_NORM_DTYPE)
                norms.extend(norm.to(first, non_blocking=True) for norm in group_norms)
                order.extend(indices)
    finite = torch.isfinite(torch.stack(norms))
    if bool(finite.all().item()):  # the one host read
        return []
    bad = {order[i] for i in torch.nonzero(~finite).flatten().tolist()}
    return [name for index, (name, _) in enumerate(named) if index in bad]
