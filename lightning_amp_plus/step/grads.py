"""Passes over gradient lists: unscale, measure (the global norm, each gradient's norm), clip.

No Lightning here. One private torch kernel, GradScaler's own check-and-unscale
(``torch._amp_foreach_non_finite_check_and_unscale_``), for the check that measures no norm (:func:`unscale_checked_`).

* :func:`multiply_` multiplies the gradients in place, one multi-tensor call per device and dtype: by the inverse
  scale (the values equal ``torch.amp.GradScaler``'s unscale) or by a clip's coefficient.
* :func:`global_norm` is the L2 norm of all gradients taken exactly as ``torch.nn.utils.clip_grad_norm_`` takes it
  (each gradient's norm, then the norm of those, grouped by device and dtype as torch groups them), so a clip that
  reuses it gives the parameters of ``clip_grad_norm_`` bit for bit. A non-finite value anywhere makes it non-finite:
  the same number is the overflow check, the clipping norm and the monitored norm.
* :func:`unscale_checked_` unscales and checks for inf/NaN in one pass, without a norm: what a step that nothing
  clips and nobody reads the norm of needs (GradScaler's kernel, the same numbers).
* :func:`measure` gives each gradient's own norm: for naming the non-finite ones (only on an overflow) and for the
  sharded sum across ranks.
* :func:`clip_by_norm_` multiplies only when the norm is over the limit (``clip_grad_norm_`` always multiplies, by
  exactly 1.0 when under it: the same numbers, one pass less).

Gradients may be dense or sparse (COO, as ``nn.Embedding(sparse=True)`` gives), of any floating dtype. Half-precision
gradients (a model held in fp16/bf16) are measured with float32 accumulation, where torch's norm would overflow at
65504; float64 ones in float64. Norms are returned as float32.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_amp_plus.step.float32 import f32
from lightning_amp_plus.step.sharding import Sharding, local_view, local_views, max_across_ranks

__all__ = [
    "PIECE",
    "checked_norm",
    "clip_by_norm_",
    "global_norm",
    "measure",
    "nonfinite_names",
    "sharded_norm",
    "multiply_",
    "unscale_and_measure_",
    "unscale_checked_",
]

_NORM_DTYPE = torch.float32
_FLOAT32_MAX = torch.finfo(torch.float32).max
_HALF = (torch.float16, torch.bfloat16)
PIECE = 1 << 18
"""Elements of gradient measured while still in the cache after their unscale (1 MiB of float32)."""


def _values(grad: Tensor) -> Tensor:
    """The tensor holding ``grad``'s numbers: itself, or a sparse gradient's values (duplicates included)."""
    return grad._values() if grad.is_sparse else grad


def _norm_source(grad: Tensor) -> Tensor:
    """What ``grad``'s L2 norm is the norm of: for a sparse gradient with duplicate indices, its coalesced values."""
    if not grad.is_sparse:
        return grad
    return grad._values() if grad.is_coalesced() else grad.coalesce()._values()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else _NORM_DTYPE


def _by_device_and_dtype(tensors: Sequence[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for index, tensor in enumerate(tensors):
        groups[(tensor.device, tensor.dtype)].append(index)
    return groups


@torch.no_grad()
def multiply_(grads: Sequence[Tensor], factor: float) -> None:
    """Multiply ``grads`` in place by ``factor``: the unscale, and the clip.

    The unscale multiplies by ``1 / scale`` as a float32 value, as GradScaler's unscale does; the clip by
    :func:`clip_by_norm_`'s coefficient, as ``clip_grad_norm_``'s multiply.

    Dense gradients in one multi-tensor call per device and dtype; a sparse gradient's stored values in place
    (duplicates included: it stays the same sparse tensor). The multiply runs in the gradient's compute type (float32
    for half types).

    Examples:
        >>> g = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])]
        >>> multiply_(g, 0.5); g
        [tensor([1.5000, 2.0000]), tensor([0.5000])]
    """
    dense = [grad for grad in grads if not grad.is_sparse]
    for indices in _by_device_and_dtype(dense).values():
        torch._foreach_mul_([dense[i] for i in indices], factor)
    for grad in grads:
        if grad.is_sparse:
            grad._values().mul_(factor)


@torch.no_grad()
def unscale_and_measure_(grads: Sequence[Tensor], inv_scale: float, out_device: torch.device) -> Tensor:
    """:func:`multiply_` and the global norm in one pass over memory: each piece is measured right after it is written.

    On the CPU the gradients are cut into pieces of at most :data:`PIECE` elements (small tensors batched together up
    to that size); each batch is multiplied and then measured while it is still in the cache, so memory is read and
    written once, as torch's fused check-and-unscale does. The norm is the same number as :func:`global_norm`'s summed
    in another order: within float32 rounding, not bit for bit (clipping needs torch's exact number: it takes
    :func:`multiply_` then :func:`global_norm`). On other devices, and for sparse gradients, it is those two.

    Examples:
        >>> g = [torch.tensor([6.0, 8.0]), torch.tensor([24.0])]
        >>> unscale_and_measure_(g, 0.5, torch.device("cpu")), g
        (tensor(13.), [tensor([3., 4.]), tensor([12.])])
    """
    dense = [g for g in grads if not g.is_sparse and g.device.type == "cpu" and g.is_contiguous()]
    if len(dense) != len(grads):
        multiply_(grads, inv_scale)
        return global_norm(grads, out_device)
    norms: list[Tensor] = []
    for indices in _by_device_and_dtype(dense).values():
        accumulate = torch.float64 if dense[indices[0]].dtype == torch.float64 else _NORM_DTYPE
        batch: list[Tensor] = []
        size = 0
        for index in indices:
            for piece in torch.split(dense[index].view(-1), PIECE):
                batch.append(piece)
                size += piece.numel()
                if size >= PIECE:
                    torch._foreach_mul_(batch, inv_scale)
                    norms.extend(torch._foreach_norm(batch, 2, dtype=accumulate))
                    batch, size = [], 0
        if batch:
            torch._foreach_mul_(batch, inv_scale)
            norms.extend(torch._foreach_norm(batch, 2, dtype=accumulate))
    if not norms:
        return torch.zeros((), dtype=_NORM_DTYPE, device=out_device)
    total: Tensor = torch.linalg.vector_norm(torch.stack(norms).to(_NORM_DTYPE))
    return total if total.device == out_device else total.to(out_device)


@torch.no_grad()
def global_norm(grads: Sequence[Tensor], out_device: torch.device | None = None) -> Tensor:
    """The L2 norm of all ``grads`` together, as a 0-d float32 tensor (non-finite if any value is).

    Dense float32 and float64 gradients are measured by ``torch.nn.utils.get_total_norm``, the first half of
    ``torch.nn.utils.clip_grad_norm_``: the same number bit for bit, so clipping with it gives torch's parameters.
    Half-precision and sparse gradients, which torch's norm does not take well (fp16 accumulation overflows at 65504),
    are measured with float32 accumulation and joined in.

    Args:
        grads: the gradients (any devices, dtypes, layouts).
        out_device: where the result lives (default: the first gradient's device).

    Examples:
        >>> global_norm([torch.tensor([3.0, 4.0]), torch.tensor([12.0])])
        tensor(13.)
        >>> bool(torch.isfinite(global_norm([torch.ones(2), torch.tensor([float("nan")])])))
        False
    """
    device = out_device if out_device is not None else (grads[0].device if grads else torch.device("cpu"))
    exact = [grad for grad in grads if not grad.is_sparse and grad.dtype not in _HALF]
    rest = [grad for grad in grads if grad.is_sparse or grad.dtype in _HALF]
    total: Tensor | None = None
    if exact and len(_by_device_and_dtype(exact)) == 1 and all(type(grad) is Tensor for grad in exact):
        # One device and dtype (the usual case): get_total_norm's own two ops without its grouping and checks, which
        # cost more than the ops for a small model's gradients. The same number, bit for bit.
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(exact, 2.0))).to(device, _NORM_DTYPE)
    elif exact:
        total = torch.nn.utils.get_total_norm(exact).to(device=device, dtype=_NORM_DTYPE)
    if not rest:
        return total if total is not None else torch.zeros((), dtype=_NORM_DTYPE, device=device)
    parts = measure(rest, device)
    if total is not None:
        parts = torch.cat([total.reshape(1), parts])
    joined: Tensor = torch.linalg.vector_norm(parts)
    return joined


@torch.no_grad()
def sharded_norm(grads: Sequence[Tensor], sharding: Sharding, device: torch.device) -> Tensor:
    """The norm of gradients spread over ranks: this rank's local norms, weighted by ``1 / holders``, summed over ranks.

    One SUM all-reduce (see :mod:`~lightning_amp_plus.step.sharding`): an inf or NaN on any rank makes every rank's
    result non-finite.

    Examples:
        >>> sharded_norm([torch.tensor([3.0, 4.0])], Sharding(replicas=1), torch.device("cpu"))
        tensor(5.)
    """
    squared = measure(local_views(grads), device).square()
    return sharding.all_reduce_((squared * sharding.weights(grads, device)).sum()).sqrt()


@torch.no_grad()
def measure(grads: Sequence[Tensor], out_device: torch.device) -> Tensor:
    """Each gradient's L2 norm, read-only, as a 1-D float32 tensor in the order given.

    Half-precision values are accumulated in float32, float64 ones in float64; a sparse gradient's norm is that of its
    coalesced values. An entry is ``inf`` or ``nan`` for a gradient that holds a non-finite value (or whose norm
    exceeds the float32 range).

    Examples:
        >>> measure([torch.tensor([3.0, 4.0]), torch.tensor([1.0, float("nan")])], torch.device("cpu"))
        tensor([5., nan])
    """
    if not grads:
        return torch.zeros(0, dtype=_NORM_DTYPE, device=out_device)
    pieces: list[tuple[list[int], Tensor]] = []
    dense_at = [index for index, grad in enumerate(grads) if not grad.is_sparse]
    for (_, dtype), positions in _by_device_and_dtype([grads[i] for i in dense_at]).items():
        indices = [dense_at[p] for p in positions]
        accumulate = torch.float64 if dtype == torch.float64 else _NORM_DTYPE
        norms = torch.stack(torch._foreach_norm([grads[i] for i in indices], 2, dtype=accumulate)).to(_NORM_DTYPE)
        pieces.append((indices, norms if norms.device == out_device else norms.to(out_device, non_blocking=True)))
    for index, grad in enumerate(grads):
        if grad.is_sparse:
            values = _norm_source(grad)
            norm = torch.linalg.vector_norm(values, dtype=_accumulation_dtype(values.dtype)).to(_NORM_DTYPE)
            pieces.append(([index], _to(norm.reshape(1), out_device)))
    # One group (the usual case: one device, one dtype, dense) is already in order.
    return pieces[0][1] if len(pieces) == 1 else _in_order(pieces, len(grads), out_device)


def _to(tensor: Tensor, device: torch.device) -> Tensor:
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def _in_order(pieces: list[tuple[list[int], Tensor]], count: int, device: torch.device) -> Tensor:
    """Put per-group results back in the order of the gradients they came from."""
    if len(pieces) == 1:
        return pieces[0][1]
    result = torch.empty(count, dtype=_NORM_DTYPE, device=device)
    for indices, values in pieces:
        if indices == list(range(indices[0], indices[0] + len(indices))):  # a contiguous run: no index tensor
            result[indices[0] : indices[0] + len(indices)] = values
        else:
            result[_index_tensor(tuple(indices), device)] = values
    return result


@functools.lru_cache(maxsize=64)
def _index_tensor(indices: tuple[int, ...], device: torch.device) -> Tensor:
    # Cached: the same optimizer gives the same groups every step, and building the tensor on an accelerator copies
    # it from host memory, which would synchronise every step.
    return torch.tensor(indices, device=device)


def clip_by_norm_(grads: Sequence[Tensor], total_norm: float, max_norm: float, eps: float = 1e-6) -> float:
    """Scale ``grads`` so their global norm is at most ``max_norm``, given the norm already measured.

    Uses the coefficient of ``torch.nn.utils.clip_grad_norm_`` (``max_norm / (total_norm + eps)``) but multiplies only
    when it is below 1, which saves a read and a write of every gradient on the common step where nothing is clipped.

    Args:
        grads: the (unscaled) gradients, dense or sparse.
        total_norm: their global L2 norm, finite.
        max_norm: the limit.
        eps: added to the norm as torch does, for the same numbers.

    Returns:
        The coefficient applied (1.0 when nothing was clipped).

    Examples:
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
    multiply_(grads, coef)
    return coef


def checked_norm(
    grads: list[Tensor], inv_scale: float | None, exact: bool, sharding: Sharding | None, process_group: Any
) -> float:
    """Unscale ``grads`` by ``inv_scale`` (if given), then their global norm, the same on every rank, read on the host.

    The unscale path's one host read: the overflow check, the clipping norm and the monitored norm in one number.

    Args:
        grads: the gradients (DTensors when ``sharding`` is set).
        inv_scale: 1 / the loss scale, rounded once to float32 (as GradScaler's), or ``None`` to leave them.
        exact: the norm as ``clip_grad_norm_`` takes it, bit for bit (a second read after the unscale); otherwise one
            cache-hot pass measures as it unscales (:func:`unscale_and_measure_`).
        sharding: how the gradients are spread over ranks (one SUM all-reduce), or ``None``.
        process_group: replicated gradients' group, whose ranks take the MAX (the same decision everywhere), or
            ``None``.

    Examples:
        >>> g = [torch.tensor([6.0, 8.0])]
        >>> checked_norm(g, 0.5, False, None, None), g[0]
        (5.0, tensor([3., 4.]))
    """
    device = grads[0].device if grads else torch.device("cpu")
    with torch.no_grad():
        if sharding is not None:
            if inv_scale is not None:
                multiply_(local_views(grads), inv_scale)
            total = sharded_norm(grads, sharding, device)
        elif inv_scale is not None and not exact:
            total = unscale_and_measure_(grads, inv_scale, device)
        else:
            if inv_scale is not None:
                multiply_(grads, inv_scale)
            total = global_norm(grads, device)
        if process_group is not None:
            total = max_across_ranks(total, process_group)
        return float(total.item())


@torch.no_grad()
def unscale_checked_(grads: list[Tensor], inv_scale: float, sharding: Sharding | None, process_group: Any) -> bool:
    """Unscale ``grads`` by ``inv_scale`` and tell whether any held inf/NaN (on any rank): one pass, one host read.

    No norm is measured: each value is multiplied and tested as it is written, by the kernel ``torch.amp.GradScaler``
    unscales with, so the gradients are GradScaler's bit for bit (and :func:`multiply_`'s). A sparse gradient's stored
    values are unscaled in place, as GradScaler does.

    Args:
        grads: the gradients (DTensors when ``sharding`` is set: each rank checks its shard).
        inv_scale: 1 / the loss scale, rounded once to float32.
        sharding: set for sharded gradients: the ranks' flags are summed (one all-reduce), so all decide alike.
        process_group: replicated gradients' group (the flags' MAX), or ``None``.

    Examples:
        >>> g = [torch.tensor([6.0, 8.0]), torch.tensor([24.0])]
        >>> unscale_checked_(g, 0.5, None, None), g
        (False, [tensor([3., 4.]), tensor([12.])])
        >>> unscale_checked_([torch.tensor([1.0, float("inf")])], 0.5, None, None)
        True
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for grad in grads if sharding is None else local_views(grads):  # one loop: it runs cache-cold after backward
        value = _values(grad)
        groups.setdefault((value.device, value.dtype), []).append(value)
    device = next(iter(groups))[0] if groups else torch.device("cpu")
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for (where, _), values in groups.items():
        here = found if where == device else torch.zeros(1, dtype=torch.float32, device=where)
        torch._amp_foreach_non_finite_check_and_unscale_(values, here, _filled(inv_scale, where))
        if here is not found:
            found += here.to(device)
    if sharding is not None:
        found = sharding.all_reduce_(found)
    if process_group is not None:
        found = max_across_ranks(found, process_group)
    return bool(found.item())


@functools.lru_cache(maxsize=64)
def _filled(value: float, device: torch.device) -> Tensor:
    # Cached: the kernel only reads it, and the same inverse scale (1.0 under bf16) comes back every step.
    return torch.full((1,), value, dtype=torch.float32, device=device)


def nonfinite_names(named: Sequence[tuple[str, Tensor]]) -> list[str]:
    """Names of the tensors that hold inf or NaN, found with one pass and one host read.

    One multi-tensor norm per device and dtype (float32 accumulation, so large half-precision tensors do not overflow
    it): a non-finite value makes its tensor's norm non-finite. Names are looked up only when something is wrong.
    Sparse tensors are judged by their stored values, sharded ones (DTensors) by this rank's shard: each rank names
    what it holds.

    Examples:
        >>> nonfinite_names([("a", torch.ones(2)), ("b", torch.tensor([1.0, float("nan")]))])
        ['b']
    """
    if not named:
        return []
    tensors = [_values(local_view(tensor)) for _, tensor in named]
    first = tensors[0].device
    with torch.no_grad():
        norms = measure(tensors, first)
    finite = torch.isfinite(norms)
    if bool(finite.all().item()):  # the one host read
        return []
    bad = set(torch.nonzero(~finite).flatten().tolist())
    return [name for index, (name, _) in enumerate(named) if index in bad]
