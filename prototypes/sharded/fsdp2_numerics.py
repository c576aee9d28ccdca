"""FSDP2 (``fully_shard``, what ``ModelParallelStrategy`` runs) on CPU and gloo: the gradient pass on DTensors.

Answers, with numbers, what the scaler's unscale / measure / clip pass must do when gradients are DTensors:

* ``grads``: gradients are DTensors (``Shard(0)``; a dim of size 1 leaves one rank an empty shard); the global norm is
  ``sqrt(SUM over ranks of the local squared norms)``, equal to the norm of the full (gathered) gradient and of a
  single-process run on the union of the ranks' batches; ``torch._foreach_norm(..., dtype=float32)`` fails on them.
* ``overflow``: one all-reduce (SUM) of the local squared norm gives both the norm and the overflow flag: an inf or
  NaN on one rank's shard reaches every rank. A MAX reduction (right for replicated DDP gradients) is not the norm.
* ``unscale``: the package's ``unscale_and_measure_`` works unchanged on ``grad.to_local()`` views: in place, the
  DTensor sees it.
* ``clip_norm`` / ``clip_value``: clipping the local shards with the global coefficient equals clipping the full
  gradient (and ``torch.nn.utils.clip_grad_norm_``, which handles DTensors with its own collectives).
* ``policy_fp16`` / ``policy_bf16``: ``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32)``: FP32 sharded
  parameters (the masters), half compute, FP32 sharded gradients; a scaled fp16 backward that overflows arrives as
  inf in the FP32 shards and is caught by the same SUM.
* ``autocast_fp16``: fp16 autocast over FP32 parameters under FSDP2 (what ``MixedPrecisionPlugin`` does today).
* ``fused_adam``: the fused path: ``Adam(fused=True)`` over DTensor parameters accepts plain ``grad_scale`` and
  ``found_inf`` tensors: bit-identical to unscale-then-step, untouched when ``found_inf`` is 1.
* ``replicated_and_sharded``: a model with a sharded part and a replicated (plain tensor, all-reduced) part: the
  replicated part's squared norm must be counted once, not once per rank.
* ``fsdp1_hybrid`` (4 ranks): the same for FSDP1 ``HYBRID_SHARD``: flat-parameter shards are replicated
  ``world / process_group.size()`` times; divide by that.
* ``hsdp`` (4 ranks): a 2-D mesh (replicate x shard, HSDP): summing over the shard group gives the norm but leaves an
  inf on one replica unseen by the other; summing over the world counts every element twice; the weighted world SUM
  (each rank's local squared norm divided by the number of ranks holding that element) gives the norm and a flag
  every rank shares, in one collective.

Run (about 30 s on 2 busy cores): ``python prototypes/sharded/fsdp2_numerics.py``. Every check is asserted; the
printed table holds the measured differences behind the tolerances of the design note.
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import _pool  # noqa: F401  (puts tests/ on the path)
import torch
import torch.distributed as dist
import torch.nn.functional as F
from launch import run_pool, scenario
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, ShardingStrategy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_amp_plus.numerics.grads import unscale_and_measure_

SCALE = 2.0**10


# ------------------------------------------------------------------------------------------ model and data
def make_net() -> nn.Sequential:
    torch.manual_seed(0)
    # The last layer's weight is (1, 16) and its bias (1,): sharded on dim 0 over 2 ranks, rank 1 holds empty shards.
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))


def batch(rank: int, n: int = 8) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 8, generator=generator), torch.randn(n, 1, generator=generator)


def loss_of(net: nn.Module, rank: int) -> Tensor:
    x, y = batch(rank)
    return F.mse_loss(net(x).float(), y)


def shard(net: nn.Sequential, mesh: DeviceMesh, policy: MixedPrecisionPolicy | None = None) -> nn.Sequential:
    kwargs: dict[str, Any] = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(net, **kwargs)
    return net


def reference_grads(world: int, scale: float = 1.0) -> list[Tensor]:
    """One process, the same initial weights, the mean of every rank's loss: what FSDP's averaged gradient equals."""
    net = make_net()
    loss = sum(loss_of(net, rank) for rank in range(world)) / world
    (loss * scale).backward()
    return [p.grad.detach().clone() for p in net.parameters()]


def sharded_backward(mesh: DeviceMesh, scale: float = 1.0, policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    net = shard(make_net(), mesh, policy)
    (loss_of(net, dist.get_rank()) * scale).backward()
    return net


def grads_of(net: nn.Module) -> list[DTensor]:
    return [p.grad for p in net.parameters()]


def local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def f64_norm(tensors: Iterable[Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.cat([t.detach().double().reshape(-1) for t in tensors])))


# -------------------------------------------------------------------------------- the prototype's pieces
def holders(t: Tensor) -> int:
    """How many ranks of the world hold each element of ``t`` (its local value), for a weighted world SUM.

    A DTensor holds a distinct piece on each coordinate of its sharded mesh dims and the same piece on each coordinate
    of its replicated ones; ranks outside its mesh are taken as holding a replica of the same layout (true for a
    sub-mesh of a data-parallel x tensor-parallel mesh, not for pipeline stages). A plain tensor is taken as replicated
    on every rank (DDP-like, or all-reduced by hand).
    """
    world = dist.get_world_size()
    if not isinstance(t, DTensor):
        return world
    mesh = t.device_mesh
    copies = world // mesh.size()
    for dim, placement in enumerate(t.placements):
        if placement.is_partial():
            raise ValueError(f"a gradient with placement {placement} has not been reduced yet")
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


def local_squared_sum(grads: Iterable[Tensor], weighted: bool = True) -> Tensor:
    """Sum over this rank's local shards of ``|g|^2``, each divided by how many ranks hold it (``weighted``)."""
    total = torch.zeros((), dtype=torch.float32)
    for grad in grads:
        values = local(grad).detach().float().reshape(-1)
        squared = torch.dot(values, values)
        total = total + (squared / holders(grad) if weighted else squared)
    return total


def global_norm(grads: Iterable[Tensor], group: dist.ProcessGroup | None = None, weighted: bool = True) -> float:
    """The one collective: SUM of the (weighted) local squared norms; inf/NaN anywhere reaches every rank."""
    total = local_squared_sum(grads, weighted)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return float(total.sqrt())


def max_of_local_norms(grads: Iterable[Tensor]) -> float:
    """The reduction that is right for replicated (DDP) gradients, applied to shards: not the global norm."""
    total = local_squared_sum(grads, weighted=False)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return float(total.sqrt())


def full(grads: Iterable[Tensor]) -> list[Tensor]:
    return [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]


# -------------------------------------------------------------------------------------------- scenarios
def mesh_1d() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))


def grads_scenario(out: Path) -> dict[str, Any]:
    net = sharded_backward(mesh_1d())
    grads = grads_of(net)
    reference = reference_grads(dist.get_world_size())
    try:
        torch._foreach_norm(grads, 2, dtype=torch.float32)
        foreach_error = ""
    except RuntimeError as error:
        foreach_error = str(error).splitlines()[0]
    ours = global_norm(grads)
    full_grads = full(grads)
    torch_total = float(torch.nn.utils.get_total_norm(grads).full_tensor())
    return {
        "types": sorted({type(g).__name__ for g in grads}),
        "placements": [str(g.placements) for g in grads],
        "local_shapes": [tuple(local(g).shape) for g in grads],
        "full_shapes": [tuple(g.shape) for g in grads],
        "ours": ours,
        "full_f64": f64_norm(full_grads),
        "reference_f64": f64_norm(reference),
        "torch_get_total_norm": torch_total,
        "max_of_local": max_of_local_norms(grads),
        "grads_vs_reference": max(float((a - b).abs().max()) for a, b in zip(full_grads, reference, strict=True)),
        "foreach_error": foreach_error,
    }


def overflow_scenario(out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, value in (("inf", math.inf), ("nan", math.nan)):
        net = sharded_backward(mesh_1d())
        grads = grads_of(net)
        if dist.get_rank() == 1:
            local(grads[2])[0, 0] = value  # rank 1's shard of net[2].weight only
        results[name] = {"own_local": float(local_squared_sum(grads).sqrt()), "reduced": global_norm(grads)}
    return results


def unscale_scenario(out: Path) -> dict[str, Any]:
    net = sharded_backward(mesh_1d(), scale=SCALE)
    grads = grads_of(net)
    locals_ = [g.to_local() for g in grads]
    shares_storage = all(
        lt.untyped_storage().data_ptr() == g._local_tensor.untyped_storage().data_ptr()
        for lt, g in zip(locals_, grads, strict=True)
    )
    # The package's pass, as it is today, over the local views: unscaled in place, squared norms per tensor.
    squared = unscale_and_measure_(locals_, 1.0 / SCALE, torch.device("cpu"))
    weights = torch.tensor([1.0 / holders(g) for g in grads])
    total = (squared * weights).sum()
    dist.all_reduce(total)
    reference = reference_grads(dist.get_world_size())
    full_grads = full(grads)
    return {
        "shares_storage": shares_storage,
        "norm": float(total.sqrt()),
        "reference_f64": f64_norm(reference),
        "grads_vs_reference": max(float((a - b).abs().max()) for a, b in zip(full_grads, reference, strict=True)),
    }


def clip_norm_scenario(out: Path) -> dict[str, Any]:
    world = dist.get_world_size()
    reference = reference_grads(world)
    max_norm = 0.5 * f64_norm(reference)
    # Ours: the global norm from the one collective, the coefficient, an in-place multiply of the local shards.
    net = sharded_backward(mesh_1d())
    grads = grads_of(net)
    norm = global_norm(grads)
    coef = max_norm / (norm + 1e-6)
    torch._foreach_mul_([g.to_local() for g in grads], min(coef, 1.0))
    # Torch on the same sharded gradients (DTensor-aware, its own collectives).
    twin = sharded_backward(mesh_1d())
    torch_norm = float(torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm).full_tensor())
    # The single-process reference, clipped by torch.
    ref_net = make_net()
    (sum(loss_of(ref_net, r) for r in range(world)) / world).backward()
    torch.nn.utils.clip_grad_norm_(ref_net.parameters(), max_norm)
    clipped_reference = [p.grad for p in ref_net.parameters()]
    ours_full = full(grads)
    return {
        "max_norm": max_norm,
        "norm": norm,
        "torch_norm": torch_norm,
        "clipped_norm": f64_norm(ours_full),
        "vs_torch_dtensor": max(
            float((a - b).abs().max()) for a, b in zip(ours_full, full(grads_of(twin)), strict=True)
        ),
        "vs_reference": max(float((a - b).abs().max()) for a, b in zip(ours_full, clipped_reference, strict=True)),
    }


def clip_value_scenario(out: Path) -> dict[str, Any]:
    reference = reference_grads(dist.get_world_size())
    value = 0.25 * max(float(g.abs().max()) for g in reference)
    net = sharded_backward(mesh_1d())
    grads = grads_of(net)
    for g in grads:
        g.to_local().clamp_(-value, value)
    ours_full = full(grads)
    errors = [float((a - b.clamp(-value, value)).abs().max()) for a, b in zip(ours_full, reference, strict=True)]
    return {"vs_reference": max(errors)}


def policy_scenario(half: torch.dtype) -> dict[str, Any]:
    policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    net = shard(make_net(), mesh_1d(), policy)
    seen: dict[str, str] = {}

    def note_dtype(module: nn.Module, args: Any) -> None:
        seen["unsharded_param"] = str(module.weight.dtype)  # inside forward: the all-gathered parameter

    net[0].register_forward_pre_hook(note_dtype)
    (loss_of(net, dist.get_rank()) * SCALE).backward()
    grads = grads_of(net)
    sharded = {str(p.dtype) for p in net.parameters()}
    locals_ = [g.to_local() for g in grads]
    squared = unscale_and_measure_(locals_, 1.0 / SCALE, torch.device("cpu"))
    total = (squared * torch.tensor([1.0 / holders(g) for g in grads])).sum()
    dist.all_reduce(total)
    reference = reference_grads(dist.get_world_size())
    full_grads = full(grads)
    # An overflowing scale: the half backward produces inf, cast to FP32 for the reduce-scatter, caught by the SUM.
    too_big = 2.0**24 if half == torch.float16 else 2.0**140
    over = shard(make_net(), mesh_1d(), policy)
    (loss_of(over, dist.get_rank()) * too_big).backward()
    overflow_norm = global_norm(grads_of(over))
    return {
        "sharded_param_dtypes": sorted(sharded),
        "unsharded_param_dtype": seen["unsharded_param"],
        "grad_dtypes": sorted({str(g.dtype) for g in grads}),
        "norm": float(total.sqrt()),
        "reference_f64": f64_norm(reference),
        "max_rel_grad_error": max(
            float((a - b).abs().max() / b.abs().max()) for a, b in zip(full_grads, reference, strict=True)
        ),
        "overflow_norm": overflow_norm,
    }


def policy_fp16_scenario(out: Path) -> dict[str, Any]:
    return policy_scenario(torch.float16)


def policy_bf16_scenario(out: Path) -> dict[str, Any]:
    return policy_scenario(torch.bfloat16)


def autocast_fp16_scenario(out: Path) -> dict[str, Any]:
    net = shard(make_net(), mesh_1d())
    with torch.autocast("cpu", dtype=torch.float16):
        x, y = batch(dist.get_rank())
        output = net(x)
        loss = F.mse_loss(output.float(), y)
    out_dtype = str(output.dtype)
    (loss * SCALE).backward()
    grads = grads_of(net)
    squared = unscale_and_measure_([g.to_local() for g in grads], 1.0 / SCALE, torch.device("cpu"))
    total = (squared * torch.tensor([1.0 / holders(g) for g in grads])).sum()
    dist.all_reduce(total)
    return {
        "output_dtype": out_dtype,
        "grad_dtypes": sorted({str(g.dtype) for g in grads}),
        "norm": float(total.sqrt()),
        "reference_f64": f64_norm(reference_grads(dist.get_world_size())),
    }


def fused_adam_scenario(out: Path) -> dict[str, Any]:
    """The fused path: ``Adam(fused=True)`` over DTensor parameters, handed ``grad_scale`` / ``found_inf`` tensors."""
    results: dict[str, Any] = {}
    for found_inf in (0.0, 1.0):
        net = sharded_backward(mesh_1d(), scale=SCALE)
        optimizer = torch.optim.Adam(net.parameters(), lr=0.01, fused=True)
        before = [local(p).detach().clone() for p in net.parameters()]
        # What a scaler sets for a fused optimizer: plain (not DTensor) tensors; found_inf would come from the
        # all-reduced squared norm, on the device, with no host read.
        optimizer.grad_scale = torch.tensor(SCALE)  # type: ignore[attr-defined]
        optimizer.found_inf = torch.tensor(found_inf)  # type: ignore[attr-defined]
        optimizer.step()
        after = [local(p).detach().clone() for p in net.parameters()]
        # The reference: unscale the local shards by hand, then a plain fused step (or none when skipping).
        twin = sharded_backward(mesh_1d(), scale=SCALE)
        torch._foreach_mul_([g.to_local() for g in grads_of(twin)], 1.0 / SCALE)
        twin_optimizer = torch.optim.Adam(twin.parameters(), lr=0.01, fused=True)
        if not found_inf:
            twin_optimizer.step()
        reference = [local(p).detach().clone() for p in twin.parameters()]
        results["skip" if found_inf else "step"] = {
            "moved": any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)),
            "vs_unscale_then_step": max(
                float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(after, reference, strict=True)
            ),
        }
    return results


def replicated_and_sharded_scenario(out: Path) -> dict[str, Any]:
    """net[0] stays a plain (replicated) layer, its gradient all-reduced by hand as DDP would; the rest is sharded."""
    world = dist.get_world_size()
    net = make_net()
    mesh = mesh_1d()
    fully_shard(net[2], mesh=mesh)
    fully_shard(net[4], mesh=mesh)
    fully_shard(net, mesh=mesh, ignored_params=set(net[0].parameters()))
    loss_of(net, dist.get_rank()).backward()
    for p in net[0].parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world
    grads = grads_of(net)
    reference = reference_grads(world)
    return {
        "types": [type(g).__name__ for g in grads],
        "weighted": global_norm(grads),
        "unweighted": global_norm(grads, weighted=False),
        "reference_f64": f64_norm(reference),
    }


def hsdp_scenario(out: Path) -> dict[str, Any]:
    """4 ranks, mesh (replicate=2, shard=2): HSDP. Rank 3 alone gets an inf in the second pass."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    shard_group = mesh["shard"].get_group()
    results: dict[str, Any] = {}
    for fault in (False, True):
        net = sharded_backward(mesh)
        grads = grads_of(net)
        if fault and dist.get_rank() == 3:
            local(grads[0])[0, 0] = math.inf
        results["fault" if fault else "clean"] = {
            "placements": str(grads[0].placements),
            "shard_group_sum": global_norm(grads, group=shard_group, weighted=False),
            "world_sum": global_norm(grads, weighted=False),
            "weighted_world_sum": global_norm(grads),
        }
    results["reference_f64"] = f64_norm(reference_grads(dist.get_world_size()))
    return results


def fsdp1_hybrid_scenario(out: Path) -> dict[str, Any]:
    """4 ranks, FSDP1 HYBRID_SHARD over a (replicate=2, shard=2) mesh: flat-parameter shards replicated twice."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    net = FullyShardedDataParallel(
        make_net(),
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_mesh=mesh,
        use_orig_params=True,
    )
    loss_of(net, dist.get_rank()).backward()
    shards = [p.grad for p in net.parameters() if p.grad is not None]
    shard_group_size = net.process_group.size()  # the group a flat parameter is sharded over
    replicas = dist.get_world_size() // shard_group_size
    squared = torch.stack([torch.dot(g.reshape(-1), g.reshape(-1)) for g in shards]).sum()
    weighted = squared / replicas
    dist.all_reduce(weighted)
    unweighted = squared.clone()
    dist.all_reduce(unweighted)
    return {
        "shard_group_size": shard_group_size,
        "replicas": replicas,
        "weighted_world_sum": float(weighted.sqrt()),
        "world_sum": float(unweighted.sqrt()),
        "reference_f64": f64_norm(reference_grads(dist.get_world_size())),
    }


TWO_RANKS = {
    "grads": grads_scenario,
    "overflow": overflow_scenario,
    "unscale": unscale_scenario,
    "clip_norm": clip_norm_scenario,
    "clip_value": clip_value_scenario,
    "policy_fp16": policy_fp16_scenario,
    "policy_bf16": policy_bf16_scenario,
    "autocast_fp16": autocast_fp16_scenario,
    "fused_adam": fused_adam_scenario,
    "replicated_and_sharded": replicated_and_sharded_scenario,
}
FOUR_RANKS = {"hsdp": hsdp_scenario, "fsdp1_hybrid": fsdp1_hybrid_scenario}


# --------------------------------------------------------------------------------------------- checks
def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def check_two(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    g0, g1 = scenario(ranks, "grads")
    assert g0["types"] == ["DTensor"] and g0["placements"][0] == "(Shard(dim=0),)"
    assert g1["local_shapes"][4] == (0, 16), g1["local_shapes"]  # the (1, 16) weight: rank 1's shard is empty
    assert "Sharding propagation failed" in g0["foreach_error"] or "dtype" in g0["foreach_error"], g0["foreach_error"]
    assert g0["ours"] == g1["ours"]  # one all-reduce: the same float on every rank
    table["norm: ours vs full gradient (rel)"] = rel(g0["ours"], g0["full_f64"])
    table["norm: ours vs single process (rel)"] = rel(g0["ours"], g0["reference_f64"])
    table["norm: torch get_total_norm vs single process (rel)"] = rel(g0["torch_get_total_norm"], g0["reference_f64"])
    table["grads: sharded vs single process (max abs)"] = g0["grads_vs_reference"]
    table["MAX of local norms / global norm"] = g0["max_of_local"] / g0["ours"]
    assert table["norm: ours vs single process (rel)"] < 1e-6
    assert g0["max_of_local"] < g0["ours"] * 0.999  # MAX is not the norm of sharded gradients

    for fault in ("inf", "nan"):
        o0, o1 = (r[fault] for r in scenario(ranks, "overflow"))
        assert math.isfinite(o0["own_local"]) and not math.isfinite(o1["own_local"])
        assert not math.isfinite(o0["reduced"]) and not math.isfinite(o1["reduced"])  # every rank sees it
        assert math.isnan(o0["reduced"]) == (fault == "nan")
    table["overflow: inf on rank 1 only -> reduced on rank 0"] = scenario(ranks, "overflow")[0]["inf"]["reduced"]
    table["overflow: nan on rank 1 only -> reduced on rank 0"] = scenario(ranks, "overflow")[0]["nan"]["reduced"]

    u0, _ = scenario(ranks, "unscale")
    assert u0["shares_storage"]
    table["unscale_and_measure_ on to_local(): norm vs single process (rel)"] = rel(u0["norm"], u0["reference_f64"])
    table["unscale_and_measure_ on to_local(): grads vs single process (max abs)"] = u0["grads_vs_reference"]

    c0, _ = scenario(ranks, "clip_norm")
    table["clip norm: ours vs torch clip_grad_norm_ on DTensors (max abs)"] = c0["vs_torch_dtensor"]
    table["clip norm: ours vs single process clipped (max abs)"] = c0["vs_reference"]
    table["clip norm: clipped norm / max_norm"] = c0["clipped_norm"] / c0["max_norm"]
    assert rel(c0["norm"], c0["torch_norm"]) < 1e-6 and abs(c0["clipped_norm"] / c0["max_norm"] - 1) < 1e-5
    v0, _ = scenario(ranks, "clip_value")
    table["clip value: ours vs single process (max abs)"] = v0["vs_reference"]

    for half in ("fp16", "bf16"):
        p0, p1 = scenario(ranks, f"policy_{half}")
        assert p0["sharded_param_dtypes"] == ["torch.float32"] and p0["grad_dtypes"] == ["torch.float32"]
        assert p0["unsharded_param_dtype"] == {"fp16": "torch.float16", "bf16": "torch.bfloat16"}[half]
        assert not math.isfinite(p0["overflow_norm"]) and not math.isfinite(p1["overflow_norm"])
        table[f"policy {half}: norm vs fp32 single process (rel)"] = rel(p0["norm"], p0["reference_f64"])
        table[f"policy {half}: grads vs fp32 single process (max rel to max |g|)"] = p0["max_rel_grad_error"]
    a0, _ = scenario(ranks, "autocast_fp16")
    assert a0["output_dtype"] == "torch.float16" and a0["grad_dtypes"] == ["torch.float32"]
    table["autocast fp16 over fp32 DTensor params: norm vs fp32 (rel)"] = rel(a0["norm"], a0["reference_f64"])

    f0, _ = scenario(ranks, "fused_adam")
    assert f0["step"]["moved"] and not f0["skip"]["moved"]
    assert f0["step"]["vs_unscale_then_step"] == 0 and f0["skip"]["vs_unscale_then_step"] == 0
    table["fused Adam on DTensors with grad_scale: vs unscale-then-step (max abs)"] = f0["step"]["vs_unscale_then_step"]
    table["fused Adam on DTensors with found_inf=1: parameters moved"] = f0["skip"]["moved"]

    m0, _ = scenario(ranks, "replicated_and_sharded")
    assert m0["types"][:2] == ["Tensor", "Tensor"] and set(m0["types"][2:]) == {"DTensor"}
    table["replicated+sharded: weighted vs single process (rel)"] = rel(m0["weighted"], m0["reference_f64"])
    table["replicated+sharded: unweighted vs single process (rel)"] = rel(m0["unweighted"], m0["reference_f64"])
    assert rel(m0["weighted"], m0["reference_f64"]) < 1e-6 and rel(m0["unweighted"], m0["reference_f64"]) > 1e-3
    return table


def check_four(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    records = scenario(ranks, "hsdp")
    reference = records[0]["reference_f64"]
    clean = records[0]["clean"]
    assert clean["placements"] == "(Replicate(), Shard(dim=0))", clean["placements"]
    table["hsdp: shard-group SUM vs single process (rel)"] = rel(clean["shard_group_sum"], reference)
    table["hsdp: world SUM / norm (counts replicas)"] = clean["world_sum"] / reference
    table["hsdp: weighted world SUM vs single process (rel)"] = rel(clean["weighted_world_sum"], reference)
    assert rel(clean["weighted_world_sum"], reference) < 1e-6 and abs(clean["world_sum"] / reference - 2**0.5) < 1e-5
    faults = [r["fault"] for r in records]
    # Rank 3's inf: the shard-group SUM flags ranks 2 and 3 only; the weighted world SUM flags all four.
    table["hsdp: inf on rank 3, shard-group SUM finite on ranks"] = [
        r for r, f in enumerate(faults) if math.isfinite(f["shard_group_sum"])
    ]
    table["hsdp: inf on rank 3, weighted world SUM finite on ranks"] = [
        r for r, f in enumerate(faults) if math.isfinite(f["weighted_world_sum"])
    ]
    assert table["hsdp: inf on rank 3, shard-group SUM finite on ranks"] == [0, 1]
    assert table["hsdp: inf on rank 3, weighted world SUM finite on ranks"] == []
    hybrid = scenario(ranks, "fsdp1_hybrid")[0]
    assert hybrid["shard_group_size"] == 2 and hybrid["replicas"] == 2
    table["fsdp1 HYBRID_SHARD: weighted world SUM vs single process (rel)"] = rel(
        hybrid["weighted_world_sum"], hybrid["reference_f64"]
    )
    table["fsdp1 HYBRID_SHARD: world SUM / norm"] = hybrid["world_sum"] / hybrid["reference_f64"]
    assert rel(hybrid["weighted_world_sum"], hybrid["reference_f64"]) < 1e-6
    return table


def main() -> int:
    out = Path(tempfile.mkdtemp(prefix="fsdp2_numerics_"))
    (out / "two").mkdir()
    (out / "four").mkdir()
    table = check_two(run_pool(TWO_RANKS, out / "two", world=2))
    table |= check_four(run_pool(FOUR_RANKS, out / "four", world=4))
    width = max(len(k) for k in table)
    for key, value in table.items():
        print(f"{key:<{width}}  {value:.3g}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
