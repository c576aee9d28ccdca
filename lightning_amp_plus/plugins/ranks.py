"""Where the gradients live across ranks, as a plugin learns it at set-up: replicated (DDP) or sharded (FSDP, FSDP2).

Every rank must take the same skip decision: :func:`set_up_ranks` gives the engine its
:class:`~lightning_amp_plus.step.sharding.Ranks`: a MAX over the world under DDP, or the sharding whose weighted SUM
gives the global norm under FSDP and FSDP2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_amp_plus.step.engine import StepEngine
from lightning_amp_plus.step.sharding import Ranks, Sharding, is_dtensor

__all__ = ["fsdp2_policy", "refuse_sharded_master_weights", "set_up_ranks", "sharding_of", "world_size"]


def set_up_ranks(engine: StepEngine, params: Sequence[Tensor], wrapper: nn.Module | None = None) -> None:
    """One skip decision for all ranks: a sharded sum under FSDP/FSDP2, a MAX over the world under DDP."""
    sharding = sharding_of(params, wrapper)
    if sharding is not None:
        # Each rank holds a shard: one weighted SUM over the world gives the norm and the skip decision.
        engine.ranks = Ranks(sharding=sharding)
    elif world_size() > 1 and engine.ranks is None:
        # An overflow seen on one rank only (a rank-local fault, unused parameters) must skip the step everywhere,
        # or the replicas drift apart.
        engine.ranks = Ranks(group=torch.distributed.group.WORLD)


def world_size() -> int:
    """The number of processes (1 without torch.distributed)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _is_dtensor(param: Tensor) -> bool:
    return is_dtensor(param) or is_dtensor(param.data)


def sharding_of(params: Sequence[Tensor], wrapper: nn.Module | None = None) -> Sharding | None:
    """How the gradients are spread over the ranks: ``None`` unless sharded (FSDP's flat shards, FSDP2's DTensors).

    Args:
        params: the parameters (the model's, or an optimizer's).
        wrapper: the model as the strategy wrapped it, if known (the Trainer's plugins see it; Fabric's do not).
    """
    world = world_size()
    if any(_is_dtensor(param) for param in params):
        # FSDP2: DTensor gradients say where they live; a parameter left as a plain tensor is on every rank.
        return Sharding(replicas=world)
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    if isinstance(wrapper, FullyShardedDataParallel):
        # FSDP1: a FULL_SHARD / SHARD_GRAD_OP shard lives on one rank, a NO_SHARD one on all, a HYBRID_SHARD one on
        # every replica of the shard group.
        if wrapper.sharding_strategy == ShardingStrategy.NO_SHARD:
            return Sharding(replicas=world)
        group = wrapper.process_group
        return Sharding(replicas=world if group is None else world // group.size())
    if any(getattr(param, "_fsdp_flattened", False) or getattr(param, "_is_flat_param", False) for param in params):
        # FSDP1 seen from its parameters only (Fabric): taken as fully sharded over the world, its default.
        return Sharding(replicas=1)
    return None


def fsdp2_policy(half_dtype: torch.dtype) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for half compute over FP32 shards, gradients reduce-scattered in FP32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=half_dtype, reduce_dtype=torch.float32)


def refuse_sharded_master_weights(name: str, module: nn.Module) -> None:
    """Under FSDP2 the FP32 shards are the masters already: half compute is FSDP2's own policy."""
    sharded = [param_name for param_name, p in module.named_parameters() if _is_dtensor(p)]
    if sharded:
        raise ValueError(
            f"{name}(master_weights=True) does not apply to sharded (DTensor) parameters ({', '.join(sharded[:3])}, "
            "...): under ModelParallelStrategy the FP32 shards are the master weights. Compute in half through "
            "FSDP2's own policy instead: `fully_shard(module, mp_policy=plugin.mp_policy)` in configure_model, with "
            "master_weights=False."
        )
