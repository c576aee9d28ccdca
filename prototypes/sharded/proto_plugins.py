"""Prototype precision plugins for sharded strategies: the gradient pass and the hooks the package's code needs.

Not package code: the smallest plugins that run end to end under ``ModelParallelStrategy`` (FSDP2, DTensor gradients)
and ``FSDPStrategy`` (FSDP1, flat-parameter shards), so that the prototype runs (``lightning_sharded.py``) can measure
what the design note claims. The loss-scale policy is the package's ``ScalePolicy``; the unscale-and-measure pass is the
package's ``unscale_and_measure_``, applied unchanged to the local shards. What is new is small:

* :func:`holders`: how many ranks hold each element of a gradient (1 for a shard, the group size for a replica);
* :func:`reduce_squared_norm`: ONE all-reduce (SUM, over the world) of the holders-weighted local squared norms. It is
  the squared global norm; an inf or NaN on any rank reaches every rank, so every rank takes the same skip decision in
  the host read the step already makes.
* the hooks: ``forward_context`` (autocast on the strategy's device type, where ``FSDPPrecision`` hard-codes "cuda"),
  ``pre_backward`` (scale), ``optimizer_step`` (closure, unscale + measure + reduce, hooks and clipping, step or skip,
  policy update), ``clip_grad_by_norm`` (with the reduced norm: no second pass, no collective), ``state_dict``, and
  for FSDP1 ``mixed_precision_config`` (``master_weights=True`` -> ``MixedPrecision(param_dtype=half,
  reduce_dtype=float32)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from torch import Tensor
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecisionConfig
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_amp_plus.numerics.grads import clip_by_norm_, unscale_and_measure_
from lightning_amp_plus.numerics.policy import ScalePolicy

Half = Literal["16-mixed", "bf16-mixed"]
HALF = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


# ------------------------------------------------------------------------------------------- the new numerics
def holders(grad: Tensor, replicas: int = 1) -> int:
    """How many ranks of the world hold each element of ``grad``'s local value.

    Args:
        grad: a gradient: a DTensor (FSDP2, tensor parallel) or a plain tensor (an FSDP1 flat-parameter shard, or a
            replicated gradient).
        replicas: for a plain tensor, how many ranks hold the same values (1 for an FSDP1 FULL_SHARD shard, the
            replicate-group size for HYBRID_SHARD, the world size for NO_SHARD or DDP).
    """
    if not isinstance(grad, DTensor):
        return replicas
    mesh = grad.device_mesh
    # Ranks outside this mesh hold a replica of the same layout (a sub-mesh of a data x tensor parallel mesh).
    copies = dist.get_world_size() // mesh.size()
    for dim, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError(f"A gradient with placement {placement} is not reduced yet: cannot measure its norm.")
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


def local_view(grad: Tensor) -> Tensor:
    """The local values of ``grad``, as a plain tensor sharing its storage (in-place ops on it change ``grad``)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def reduce_squared_norm(squared: Tensor, weights: Tensor) -> Tensor:
    """SUM over the world of ``sum(squared / weights)``: the squared global norm; non-finite everywhere if anywhere."""
    total = (squared / weights).sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


# -------------------------------------------------------------------------------------------- the plugin core
class _ShardedCore:
    """The state and the optimizer step shared by both prototype plugins."""

    precision: str
    scaler: Any

    def _init_core(self, precision: Half, device: str, init_scale: float, growth_interval: int) -> None:
        self.half = HALF[precision]
        self.device_type = device
        self.policy = (
            ScalePolicy(init_scale, 2.0, 0.5, growth_interval, hysteresis=1, min_scale=1.0, max_scale=2.0**24)
            if precision == "16-mixed"
            else None
        )
        self.skipped_steps = 0
        self.last_step_skipped = False
        self.last_grad_norm: float | None = None
        self._grads: list[Tensor] = []

    def _replicas(self, model: Any) -> int:
        return 1  # FSDP1 overrides: depends on the sharding strategy

    @property
    def scale(self) -> float:
        return 1.0 if self.policy is None else self.policy.scale

    def _unscale_and_measure(self, optimizer: Optimizer, model: Any) -> float:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        replicas = self._replicas(model)
        self._grads = [local_view(g) for g in grads]
        inv = None if self.policy is None else 1.0 / self.policy.scale  # a power of two: exact
        squared = unscale_and_measure_(self._grads, inv, torch.device("cpu"))
        weights = torch.tensor([float(holders(g, replicas)) for g in grads])
        norm = float(reduce_squared_norm(squared, weights).sqrt())  # the step's one host read
        self.last_grad_norm = norm
        return norm

    def _sharded_step(
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        closure_result = closure()
        norm = self._unscale_and_measure(optimizer, model)
        self._after_closure(model, optimizer)  # type: ignore[attr-defined]  # hooks, then clipping with `norm`
        self.last_step_skipped = not math.isfinite(norm)
        if self.last_step_skipped:
            self.skipped_steps += 1
        else:
            optimizer.step(**kwargs)
        if self.policy is not None:
            self.policy.update(self.last_step_skipped)
        # Hold no gradient past the step: Lightning frees them (zero_grad(set_to_none=True)) before the next backward,
        # and a reference kept here would keep a second set alive while the next one is computed.
        self._grads = []
        return closure_result

    def _clip_by_norm(self, clip_val: float) -> None:
        if self.last_grad_norm is not None and math.isfinite(self.last_grad_norm):
            clip_by_norm_(self._grads, self.last_grad_norm, float(clip_val))

    def _state(self) -> dict[str, Any]:
        tracker = 0 if self.policy is None else self.policy.growth_tracker
        return {"scale": self.scale, "growth_tracker": tracker, "skipped_steps": self.skipped_steps}

    def _load_state(self, state: dict[str, Any]) -> None:
        if self.policy is not None:
            self.policy.scale = float(state["scale"])
            self.policy.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state["skipped_steps"])

    @contextmanager
    def _autocast(self) -> Iterator[None]:
        # cache_enabled=False, as the package and Lightning do. Under FSDP the cast cache would also keep each
        # unsharded weight's half copy alive until the forward ends (cost.py: +0.5 to +1.5 MB peak per rank on its
        # 2.1M-parameter model).
        with torch.autocast(self.device_type, dtype=self.half, cache_enabled=False):
            yield


class ProtoModelParallelPrecision(_ShardedCore, Precision):
    """For ``ModelParallelStrategy`` (no plugin-type check there): ``plugins=[ProtoModelParallelPrecision(...)]``.

    Master weights under FSDP2 belong to ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))``,
    which the user's ``configure_model`` applies: the plugin then only scales and measures.
    """

    def __init__(
        self, precision: Half, device: str = "cpu", init_scale: float = 2.0**10, growth_interval: int = 2
    ) -> None:
        self.precision = precision
        self._init_core(precision, device, init_scale, growth_interval)

    def forward_context(self) -> Any:
        return self._autocast()

    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        return tensor * self.scale if self.policy is not None else tensor

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        return self._sharded_step(optimizer, model, closure, **kwargs)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._clip_by_norm(clip_val)

    def state_dict(self) -> dict[str, Any]:
        return self._state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_state(state_dict)


class ProtoFSDPPrecision(_ShardedCore, FSDPPrecision):
    """For ``FSDPStrategy``, which accepts only ``FSDPPrecision`` subclasses.

    What it overrides of ``FSDPPrecision`` and why:

    * ``__init__``: ``FSDPPrecision("16-mixed")`` builds a ``ShardedGradScaler`` (CUDA by default: on CPU it disables
      itself); ``self.scaler`` must be ours (``trainer.scaler`` reads it), so it is replaced.
    * ``mixed_precision_config``: Lightning maps "bf16-mixed" to ``MixedPrecision(bf16, bf16, bf16)`` (parameters,
      gradient reduction and buffers all bf16). Here: without master weights ``None`` (FP32 flat parameters under
      autocast, as ``MixedPrecisionPlugin`` does); with them ``MixedPrecision(param_dtype=half,
      reduce_dtype=float32)``: the sharded FP32 flat parameters are the masters, compute in half.
    * ``forward_context``: autocast on the strategy's device type (``FSDPPrecision`` hard-codes "cuda": on CPU its
      "mixed" precisions do no autocast at all).
    * ``pre_backward``, ``optimizer_step``, ``clip_grad_by_norm`` (``FSDPPrecision`` raises), ``state_dict`` and
      ``load_state_dict``: ours.
    * ``convert_module``, ``convert_input``, ``tensor_init_context``, ``module_init_context``: FSDPPrecision's are
      right for the "mixed" precisions (nothing converted, FP32 defaults).
    """

    def __init__(
        self,
        precision: Half,
        device: str = "cpu",
        master_weights: bool = False,
        init_scale: float = 2.0**10,
        growth_interval: int = 2,
    ) -> None:
        super().__init__(precision)
        self.scaler = None  # FSDPPrecision's ShardedGradScaler: not used
        self.master_weights = master_weights
        self._init_core(precision, device, init_scale, growth_interval)

    @property
    def mixed_precision_config(self) -> FSDPMixedPrecisionConfig | None:  # type: ignore[override]
        if not self.master_weights:
            return None
        return FSDPMixedPrecisionConfig(param_dtype=self.half, reduce_dtype=torch.float32)

    def _replicas(self, model: Any) -> int:
        # A gradient shard of FULL_SHARD / SHARD_GRAD_OP lives on one rank; NO_SHARD replicates it on every rank;
        # HYBRID_SHARD on every node (the replicate group).
        root = model.trainer.strategy.model  # the FSDP wrapper around the LightningModule
        assert isinstance(root, FullyShardedDataParallel)
        strategy = root.sharding_strategy
        if strategy == ShardingStrategy.NO_SHARD:
            return dist.get_world_size()
        # FULL_SHARD / SHARD_GRAD_OP: the shard group is the world (1 replica); HYBRID_SHARD: the shard group is a
        # node, replicated world / its size times (checked on 4 CPU ranks in fsdp2_numerics.py).
        return dist.get_world_size() // root.process_group.size()

    def forward_context(self) -> Any:
        return self._autocast()

    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        return tensor * self.scale if self.policy is not None else tensor

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        return self._sharded_step(optimizer, model, closure, **kwargs)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:  # type: ignore[override]
        self._clip_by_norm(clip_val)

    def state_dict(self) -> dict[str, Any]:
        return self._state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._load_state(state_dict)
