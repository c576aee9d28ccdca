"""Passes over gradient lists: unscale and measure (non-finite check and L2 norm in one), measure only, clip.

No Lightning here, and none of torch's private ``torch._amp_*`` kernels. The design goal is to touch gradient memory
as few times as possible:

* ``unscale_and_measure_`` multiplies each gradient by the inverse scale and takes its squared L2 norm right after,
  on CPU piece by piece for large tensors (pieces of ``_PIECE`` elements, which stay in a core's L2 cache between the
  multiply and the norm), so the norm reads memory the multiply just left in cache; small tensors go through one
  multi-tensor call, where the cost per call matters more than memory. The norm is of the *unscaled* values, so the
  overflow check holds after unscaling (an fp16 gradient that overflows when multiplied by an inverse scale above 1 is
  caught), and a non-finite value anywhere makes the norm non-finite. On CUDA the same two steps run as two
  multi-tensor (``_foreach``) kernels per dtype, which is what the hardware prefers.
* ``measure`` is the read-only pass of the fused-optimizer path: one multi-tensor norm of the still-scaled gradients,
  no multiply (the fused optimizer divides by the scale inside its own kernel).
* The global norm from these passes serves the skip decision, gradient clipping and monitoring alike; clipping
  multiplies only when the norm is over the limit (``torch.nn.utils.clip_grad_norm_`` always multiplies).

Gradients may be dense or sparse (COO, as ``nn.Embedding(sparse=True)`` gives), of any floating dtype; norms are
accumulated in float64 for float64 gradients and in float32 otherwise, and returned as float32.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_amp_plus.numerics.float32 import f32
from lightning_amp_plus.numerics.sharding import local_view

__all__ = ["clip_by_norm_", "measure", "nonfinite_names", "unscale_and_measure_"]

# Norms are returned in float32 whatever the gradient dtype; half-precision squares are summed in float32 so they do
# not overflow, float64 ones in float64 (torch refuses to narrow them inside a norm).
_NORM_DTYPE = torch.float32
_FLOAT32_MAX = torch.finfo(torch.float32).max
# Below this many elements a tensor is cheaper to treat in one foreach call with its peers than on its own.
_INTERLEAVE_MIN_NUMEL = 1 << 16
# Contiguous CPU tensors above _WHOLE_MAX_NUMEL elements (2 MiB of float32, a core's L2 on current x86 server parts)
# are unscaled and measured in pieces of _PIECE elements (1 MiB): a piece the multiply has just written is still in
# L2 when the norm reads it. Smaller ones are done whole: cutting them only adds calls. Half-precision tensors always
# go piece by piece through a reused float32 buffer. Both sizes are per intra-op thread: each thread works on its share
# of a piece, in its own core's cache. Measured in benchmarks/bench_grads.py.
_PIECE = 1 << 18
_WHOLE_MAX_NUMEL = 1 << 19


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


def _squared_norm(tensor: Tensor) -> Tensor:
    """``sum(tensor ** 2)`` as a 0-d float32 tensor."""
    flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)  # no extra call for the common 1-D case
    if flat.dtype not in (torch.float32, torch.float64):
        # A float32 copy then a dot product is faster on CPU than vector_norm(dtype=float32) over half types.
        flat = flat.to(_NORM_DTYPE)
    if flat.dtype == torch.float64:
        return torch.dot(flat, flat).to(_NORM_DTYPE)
    # A dot product is the fastest full read of float32 memory on CPU (BLAS), faster than vector_norm.
    return torch.dot(flat, flat)


def _foreach_squared_norms(group: list[Tensor], inv_scale: float | None) -> list[Tensor]:
    if inv_scale is not None:
        torch._foreach_mul_(group, inv_scale)
    norms = torch._foreach_norm(group, 2, dtype=_accumulation_dtype(group[0].dtype))
    return [norm.square().to(_NORM_DTYPE) for norm in norms]


def _pieces_squared_norm(grad: Tensor, inv_scale: float | None, buffer: Tensor | None, piece_numel: int) -> Tensor:
    """Unscale a contiguous CPU tensor piece by piece, measuring each piece while it is in cache.

    Half-precision pieces are widened into ``buffer``, a float32 buffer reused for every piece: no allocation (a
    fresh float32 copy of a large tensor costs page faults as well as the copy).
    """
    parts = []
    for piece in torch.split(grad.view(-1), piece_numel):
        if inv_scale is not None:
            piece.mul_(inv_scale)
        if buffer is not None:
            widened = buffer[: piece.numel()]
            widened.copy_(piece)
            parts.append(torch.dot(widened, widened))
        else:
            parts.append(_squared_norm(piece))
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def _cpu_squared_norms(group: list[Tensor], inv_scale: float | None) -> list[Tensor]:
    # Large tensors: multiply, then measure at once, while the memory is still in cache (in pieces when the tensor
    # is larger than a core's L2). Small ones: two foreach calls for all of them, because there the cost per call,
    # not memory, is what counts.
    large = [i for i, grad in enumerate(group) if grad.numel() >= _INTERLEAVE_MIN_NUMEL]
    small = [i for i, grad in enumerate(group) if grad.numel() < _INTERLEAVE_MIN_NUMEL]
    squared: list[Tensor] = [torch.empty(0)] * len(group)
    half = group[0].dtype not in (torch.float32, torch.float64)
    threads = max(1, torch.get_num_threads())
    piece_numel, whole_max = _PIECE * threads, _WHOLE_MAX_NUMEL * threads
    biggest = max((group[i].numel() for i in large), default=0)
    buffer = torch.empty(min(piece_numel, biggest), dtype=_NORM_DTYPE) if half and large else None
    for i in large:
        grad = group[i]
        if grad.is_contiguous() and (half or grad.numel() > whole_max):
            squared[i] = _pieces_squared_norm(grad, inv_scale, buffer, piece_numel)
        else:  # fits in L2 whole (or has no flat view to cut, e.g. channels_last)
            if inv_scale is not None:
                grad.mul_(inv_scale)
            squared[i] = _squared_norm(grad)
    if small:
        for i, value in zip(small, _foreach_squared_norms([group[i] for i in small], inv_scale), strict=True):
            squared[i] = value
    return squared


def _sparse_squared_norm(grad: Tensor, inv_scale: float | None) -> Tensor:
    if inv_scale is not None:
        # In place on the stored values, duplicates included: the gradient stays the same sparse tensor.
        grad._values().mul_(inv_scale)
    return _squared_norm(_norm_source(grad))


def unscale_and_measure_(grads: Sequence[Tensor], inv_scale: float | None, out_device: torch.device) -> Tensor:
    """Multiply ``grads`` in place by ``inv_scale`` and return each one's squared L2 norm, measured after the multiply.

    Args:
        grads: the gradients, dense or sparse, of any floating dtype, on any devices.
        inv_scale: ``1 / scale`` as a float32 value, or ``None`` to measure only (scale 1). The multiply runs in the
            gradient's compute type (float32 for half types), as torch's own unscale does.
        out_device: where the returned tensor lives (the scaler's device).

    Returns:
        A 1-D float32 tensor with one squared norm per gradient, in the order given. An entry is ``inf`` or ``nan``
        when that gradient holds a non-finite value (or its squared norm exceeds the float32 range, a norm of about
        1.8e19). A sparse gradient's norm is that of its coalesced values.

    Example:
        >>> g = [torch.tensor([3.0, 4.0]), torch.tensor([float("inf")])]
        >>> unscale_and_measure_(g, 0.5, torch.device("cpu"))
        tensor([6.2500,    inf])
        >>> g[0]
        tensor([1.5000, 2.0000])
    """
    if not grads:
        return torch.zeros(0, dtype=_NORM_DTYPE, device=out_device)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    pieces: list[tuple[list[int], Tensor]] = []
    for index, grad in enumerate(grads):
        if grad.is_sparse:
            squared = _sparse_squared_norm(grad, inv_scale).reshape(1)
            pieces.append(([index], _to(squared, out_device)))
        else:
            groups[(grad.device, grad.dtype)].append(index)
    for (device, _dtype), indices in groups.items():
        group = [grads[i] for i in indices]
        measured = _cpu_squared_norms if device.type == "cpu" else _foreach_squared_norms
        pieces.append((indices, _to(torch.stack(measured(group, inv_scale)), out_device)))
    return _in_order(pieces, len(grads), out_device)


def measure(grads: Sequence[Tensor], out_device: torch.device) -> Tensor:
    """Each gradient's L2 norm, read-only: no multiply.

    The pass of the fused-optimizer path, where the optimizer divides by the scale itself: the norms are of the
    gradients as they are (still scaled). Dense gradients only (fused optimizers refuse sparse ones). One
    multi-tensor norm per (device, dtype), except large float32/float64 CPU tensors, read with a BLAS dot product each
    (faster there than the norm kernel).

    Returns:
        A 1-D float32 tensor with one norm per gradient, in the order given; ``inf`` or ``nan`` for a gradient that
        holds a non-finite value (or whose norm exceeds the float32 range).

    Example:
        >>> measure([torch.tensor([3.0, 4.0]), torch.tensor([1.0, float("nan")])], torch.device("cpu"))
        tensor([5., nan])
    """
    if not grads:
        return torch.zeros(0, dtype=_NORM_DTYPE, device=out_device)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for index, grad in enumerate(grads):
        groups[(grad.device, grad.dtype)].append(index)
    pieces: list[tuple[list[int], Tensor]] = []
    for (device, dtype), indices in groups.items():
        if device.type == "cpu" and dtype in (torch.float32, torch.float64):
            large = [i for i in indices if grads[i].numel() >= _INTERLEAVE_MIN_NUMEL]
            indices = [i for i in indices if grads[i].numel() < _INTERLEAVE_MIN_NUMEL]
            if large:
                dots = torch.stack([_squared_norm(grads[i]) for i in large]).sqrt_()
                pieces.append((large, _to(dots, out_device)))
            if not indices:
                continue
        norms = torch._foreach_norm([grads[i] for i in indices], 2, dtype=_accumulation_dtype(dtype))
        pieces.append((indices, _to(torch.stack(norms).to(_NORM_DTYPE), out_device)))
    return _in_order(pieces, len(grads), out_device)


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
        by_device[grad.device].append(_values(grad))
    for group in by_device.values():
        torch._foreach_mul_(group, coef)
    return coef


def nonfinite_names(named: Sequence[tuple[str, Tensor]]) -> list[str]:
    """Names of the tensors that hold inf or NaN, found with one pass and one host read.

    One multi-tensor norm per device and dtype (float32 accumulation, so large half-precision tensors do not overflow
    it): a non-finite value makes its tensor's norm non-finite. Names are looked up only when something is wrong.
    Sparse tensors are judged by their stored values, sharded ones (DTensors) by this rank's shard: each rank names
    what it holds.

    Example:
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
