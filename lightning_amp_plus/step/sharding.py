"""Gradients spread over ranks (FSDP's flat shards, FSDP2's DTensors): their local values, and who else holds them.

Under DDP every rank holds the whole (averaged) gradient, so any rank's norm is the global norm. Under sharding each
rank holds a piece: the global squared norm is the SUM over ranks of the local squared norms, each divided by how
many ranks hold the same piece (one for a shard; every rank of a replicate dimension for a replicated one, as in
HSDP's 2-D mesh or a plain parameter of an FSDP2 model). One SUM all-reduce over the world of the ranks' overflow
flags gives every rank the same skip decision (an inf or NaN on any rank skips the step everywhere), and, when the
norm is read, one SUM all-reduce of the weighted local squared norms gives the global norm.

The world, not the shard group: with a replicate dimension, a rank-local fault seen only by one shard group would
otherwise let the other replicas step while this one skips. The weights make the world sum exact. Ranks outside a
DTensor's mesh are taken to hold replicas of it (true of a data x tensor parallel mesh, where the mesh of a gradient
is a sub-mesh; pipeline stages, which hold different parameters, are not supported).

Examples:
    >>> grad = torch.ones(3)
    >>> holders(grad, replicas=2), local_view(grad) is grad
    (2, True)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Ranks", "Sharding", "holders", "is_dtensor", "local_view", "local_views", "max_across_ranks"]


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (without importing it where it cannot exist)."""
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def local_view(tensor: Tensor) -> Tensor:
    """The local values of ``tensor`` on this rank, as a plain tensor sharing its storage (in-place ops change it)."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def local_views(tensors: Sequence[Tensor]) -> list[Tensor]:
    """:func:`local_view` of each tensor."""
    return [local_view(tensor) for tensor in tensors]


def holders(grad: Tensor, replicas: int = 1) -> int:
    """How many ranks of the world hold each element of ``grad``'s local value.

    Args:
        grad: a DTensor (its placements say), or a plain tensor (an FSDP flat shard, a replicated gradient).
        replicas: for a plain tensor, how many ranks hold the same values.

    Raises:
        ValueError: ``grad`` is a DTensor whose reduction across ranks is still pending (a ``Partial`` placement).
    """
    if not is_dtensor(grad):
        return replicas
    import torch.distributed as dist

    mesh = grad.device_mesh  # type: ignore[attr-defined]
    copies = dist.get_world_size() // mesh.size()
    for dim, placement in enumerate(grad.placements):  # type: ignore[attr-defined]
        if placement.is_partial():
            raise ValueError(
                f"A gradient with placement {placement} is not reduced across its ranks yet, so its norm cannot be "
                "measured: the loss scaler runs after the strategy has reduced the gradients."
            )
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return int(copies)


@dataclass(frozen=True)
class Sharding:
    """How a scaler's gradients are spread over the ranks: ``scaler.engine.ranks = Ranks(sharding=Sharding())``.

    Attributes:
        replicas: how many ranks hold each plain (non-DTensor) gradient: 1 for FSDP's FULL_SHARD flat shards, the
            replicate-group size for HYBRID_SHARD, the world size for a parameter FSDP2 left unsharded.
        group: the process group of the SUM (``None``: the default group, the world).

    Examples:
        >>> Sharding(replicas=2).weights([torch.ones(2), torch.ones(3)])
        tensor([0.5000, 0.5000])
    """

    replicas: int = 1
    group: Any = None

    def weights(self, grads: Sequence[Tensor], device: torch.device | None = None) -> Tensor:
        """``1 / holders`` of each gradient (float32): the weight of its local squared norm in the world sum.

        The same gradients give the same weights at every step: the tensor is made once per set of weights and device
        (a host list copied to an accelerator is a blocking copy; a cached tensor is none).
        """
        return _weights_tensor(
            tuple(1.0 / holders(grad, self.replicas) for grad in grads), torch.device(device or "cpu")
        )

    def all_reduce_(self, squared_total: Tensor) -> Tensor:
        """SUM ``squared_total`` over the group, in place (a no-op in a single process); returns it."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(squared_total, op=dist.ReduceOp.SUM, group=self.group)
        return squared_total


@functools.lru_cache(maxsize=64)
def _weights_tensor(values: tuple[float, ...], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


@dataclass(frozen=True)
class Ranks:
    """Where a step's gradients live across ranks, so that every rank takes the same skip decision.

    Exactly one is set: ``group`` for replicated gradients (DDP: every rank holds the whole averaged gradient; the flag
    and the norm are the MAX over the group, so a fault seen on one rank skips the step everywhere), ``sharding`` for
    gradients spread over ranks (FSDP, FSDP2: one SUM all-reduce of the weighted local squares gives the norm and the
    flag everywhere).

    Examples:
        >>> ranks = Ranks(sharding=Sharding(replicas=1))
        >>> ranks.reduce_flag(torch.tensor([1.0])), ranks.local([torch.ones(2)])
        (tensor([1.]), [tensor([1., 1.])])
    """

    group: Any = None
    sharding: Sharding | None = None

    def local(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """The values this rank holds of each gradient (a DTensor's local shard; a plain tensor itself)."""
        return local_views(grads) if self.sharding is not None else list(grads)

    def reduce_flag(self, found: Tensor) -> Tensor:
        """Every rank's overflow flag (1.0 or 0.0) from this rank's: SUM over the shards, MAX over the replicas."""
        if self.sharding is not None:
            return self.sharding.all_reduce_(found)
        return max_across_ranks(found, self.group) if self.group is not None else found


def max_across_ranks(norm: Tensor, group: Any) -> Tensor:
    """The largest of the ranks' norms, NaN first turned into inf (MAX with NaN differs between backends).

    For replicated gradients (DDP): every rank then takes the same skip decision, also when a fault shows on one rank
    only; equal norms stay themselves.
    """
    flag = torch.where(torch.isfinite(norm), norm, torch.full_like(norm, math.inf))
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return flag
