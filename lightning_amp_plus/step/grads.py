"""Passes over gradient lists: measure (the global norm, each gradient's norm), clip.

No Lightning here, and no unscale: the step's check (GradScaler's own check-and-unscale kernel) is the step engine's
(:mod:`~lightning_amp_plus.step.engine`); these are the passes made when something reads the norm.

* :func:`global_norm` is the L2 norm of all gradients taken exactly as ``torch.nn.utils.clip_grad_norm_`` takes it
  (each gradient's norm, then the norm of those, grouped by device and dtype as torch groups them), so a clip that
  reuses it gives the parameters of ``clip_grad_norm_`` bit for bit, and the same on every rank
  (:class:`~lightning_amp_plus.step.sharding.Ranks`).
* :func:`multiply_` multiplies the gradients in place, one multi-tensor call per device and dtype (a clip's
  coefficient).
* :func:`measure` gives each gradient's own norm: for naming the non-finite ones (only on an overflow, or a fused
  step a reader measured) and for the sharded sum across ranks.
* :func:`clip_coefficient` and :func:`clip_by_norm_`: the second half of ``clip_grad_norm_``, which multiplies only
  when the norm is over the limit (``clip_grad_norm_`` always multiplies, by exactly 1.0 when under it: the same
  numbers, one pass less).

Gradients may be dense or sparse (COO, as ``nn.Embedding(sparse=True)`` gives), of any floating dtype. The global norm
is torch's, in torch's dtype (a bf16 model's norm is bf16, as torch's clip takes it); each gradient's own norm
(:func:`measure`) is accumulated in float32 (float64 for float64 values), where a half dtype's would overflow.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_amp_plus.step.sharding import Ranks, Sharding, local_view, local_views, max_across_ranks

__all__ = [
    "clip_by_norm_",
    "clip_coefficient",
    "global_norm",
    "measure",
    "multiply_",
    "nonfinite_names",
    "sharded_norm",
]

_NORM_DTYPE = torch.float32


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
def global_norm(grads: Sequence[Tensor], out_device: torch.device | None = None, ranks: Ranks | None = None) -> Tensor:
    """The L2 norm of all ``grads`` together, as a 0-d tensor (non-finite if any value is), the same on every rank.

    Dense gradients are measured as ``torch.nn.utils.clip_grad_norm_`` measures them (``get_total_norm``, its first
    half): the same number in the same dtype (the gradients' own, when they share one), so that a clip with it gives
    torch's parameters bit for bit, whatever the dtype. Sparse gradients, which torch's norm does not take, are
    measured with float32 accumulation and joined in (the result is then float32). Across ``ranks``: sharded, the
    weighted sum of the shards' squares (:func:`sharded_norm`, one SUM all-reduce); replicated, the MAX over the group
    (NaN read as inf), so that every rank decides alike.

    Args:
        grads: the gradients (any devices, dtypes, layouts; DTensors when sharded).
        out_device: where the result lives (default: the first gradient's device).
        ranks: where the gradients live across ranks (``None``: one process).

    Examples:
        >>> global_norm([torch.tensor([3.0, 4.0]), torch.tensor([12.0])])
        tensor(13.)
        >>> bool(torch.isfinite(global_norm([torch.ones(2), torch.tensor([float("nan")])])))
        False
    """
    device = out_device if out_device is not None else (grads[0].device if grads else torch.device("cpu"))
    if ranks is not None and ranks.sharding is not None:
        return sharded_norm(grads, ranks.sharding, device)
    if ranks is not None and ranks.group is not None:
        replicated = global_norm(grads, device)
        # Exact both ways: a value of that dtype, widened and narrowed back.
        return max_across_ranks(replicated.float(), ranks.group).to(replicated.dtype)
    dense = [grad for grad in grads if not grad.is_sparse]
    sparse = [grad for grad in grads if grad.is_sparse]
    total: Tensor | None = None
    if dense and len({(grad.device, grad.dtype) for grad in dense}) == 1 and all(type(g) is Tensor for g in dense):
        # One device and dtype (the usual case): get_total_norm's own two ops without its grouping and checks, which
        # cost more than the ops for a small model's gradients. The same number, bit for bit.
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(dense, 2.0))).to(device)
    elif dense:
        total = torch.nn.utils.get_total_norm(dense).to(device)
    if not sparse:
        return total if total is not None else torch.zeros((), dtype=_NORM_DTYPE, device=device)
    parts = measure(sparse, device)
    if total is not None:
        parts = torch.cat([total.to(_NORM_DTYPE).reshape(1), parts])
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
        pieces.append((indices, _to(norms, out_device)))
    for index, grad in enumerate(grads):
        if grad.is_sparse:
            values = _norm_source(grad)
            norm = torch.linalg.vector_norm(values, dtype=_accumulation_dtype(values.dtype)).to(_NORM_DTYPE)
            pieces.append(([index], _to(norm.reshape(1), out_device)))
    # One group (the usual case: one device, one dtype, dense) is already in order.
    return pieces[0][1] if len(pieces) == 1 else _in_order(pieces, len(grads), out_device)


def _to(tensor: Tensor, device: torch.device) -> Tensor:
    # Asynchronous only towards an accelerator: a copy to host memory made without waiting could be read unfinished.
    return tensor if tensor.device == device else tensor.to(device, non_blocking=device.type != "cpu")


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


def clip_coefficient(total_norm: Tensor, max_norm: float) -> Tensor:
    """What ``torch.nn.utils.clip_grad_norm_`` multiplies the gradients by: ``max_norm / (norm + 1e-6)``, at most 1.

    The same expression on the same tensor (on its device, in its dtype): the same number, bit for bit.

    Examples:
        >>> clip_coefficient(torch.tensor(5.0), 1.0)
        tensor(0.2000)
    """
    return (max_norm / (total_norm + 1e-6)).clamp(max=1.0)


def clip_by_norm_(grads: Sequence[Tensor], coefficient: float) -> None:
    """Multiply ``grads`` by a clip's ``coefficient`` (:func:`clip_coefficient`, read on the host), if it is below 1.

    ``clip_grad_norm_`` always multiplies, by exactly 1.0 when the norm is under the limit: the same numbers, one pass
    less on the step where nothing is clipped.

    Examples:
        >>> g = [torch.tensor([3.0, 4.0])]
        >>> clip_by_norm_(g, float(clip_coefficient(torch.tensor(5.0), 1.0))); g[0]
        tensor([0.6000, 0.8000])
    """
    if grads and coefficient < 1.0:
        multiply_(grads, coefficient)


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
