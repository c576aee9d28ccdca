"""The Fabric plugins on 2 CPU processes over gloo: DDP, Fabric's FSDP (``FSDPMixedPrecisionPlugin``) and FSDP2.

One pool of worker processes (:mod:`launch`) runs every scenario; each rank trains the model of :mod:`fabric_loops`
on its own batches, in a plain Fabric loop (``fabric.launch``, ``setup_module``, ``setup_optimizers``,
``no_backward_sync`` while accumulating, ``backward``, ``clip_gradients(max_norm=...)``, ``step``, ``zero_grad``), and
at one step rank 1 alone sets one element of its first non-empty *local* gradient to inf after ``backward``: under
DDP its copy of the averaged gradient, under FSDP its shard. The tests compare what the ranks recorded:

* under Fabric's ``FSDPStrategy`` (the test-only :func:`cpu_fsdp_fabric.cpu_fsdp_strategy`, as Fabric refuses
  FSDP on CPU) with ``FSDPMixedPrecisionPlugin``, the parameters equal those of the same loop under DDP with
  ``MixedPrecisionPlugin`` (within the tolerance of sums taken in another order, see there);
* the inf on one rank skips the step on every rank, the ranks' parameters stay identical and finite, and the
  scale, the skip count and the reported global norm agree across ranks;
* the reported norm is the norm of the whole gradient (gathered in float64, a reference computed apart);
* a run resumed from ``fabric.save``/``fabric.load`` (FSDP's sharded checkpoint) equals the uninterrupted one;
* ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` in its ``parallelize_fn``) with ``MixedPrecisionPlugin`` equals
  DDP too; with ``fully_shard(..., mp_policy=plugin.mp_policy)`` (FP32 shards, half compute) it skips and measures as
  the others;
* DDP, FSDP and FSDP2 under ``lightning_fabric.Fabric`` (Lightning's standalone package) with the plugins of
  ``lightning_amp_plus.lightning_fabric`` equal the same strategies under ``lightning.Fabric`` bit for bit, and a
  sharded checkpoint saved and resumed under it ends where the straight run under ``lightning.Fabric`` does.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from cpu_fsdp_fabric import cpu_fsdp_strategy
from fabric_loops import GROWTH_INTERVAL, START_SCALE, batch, make_model, make_optimizer
from launch import WORLD, run_pool, scenario
from torch import Tensor, nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from lightning_amp_plus import DynamicLossScaler
from lightning_amp_plus.fabric import FSDPMixedPrecisionPlugin, MixedPrecisionPlugin

pytestmark = pytest.mark.integration  # starts processes or runs whole commands

STEPS, FAULT_STEP, FAULT_RANK, MAX_NORM = 6, 2, 1, 0.25
PRECISIONS = ("16-mixed", "bf16-mixed")
STRATEGIES = ("ddp", "fsdp", "model_parallel")
# FSDPMixedPrecisionPlugin(master_weights=True): FSDP's own mixed precision (half parameters all-gathered for compute,
# FP32 shards and reduction); other arithmetic than DDP's, so it is not compared with DDP.
FSDP_MASTER = "fsdp-master"
# ModelParallelStrategy with `fully_shard(..., mp_policy=plugin.mp_policy)`: FP32 shards, half compute, FP32 reduction.
FSDP2_MASTER = "model_parallel-master"


# DDP, FSDP and FSDP2 under Lightning's standalone Fabric package, with the plugins built over it: each, its strategy.
STANDALONE = {
    "ddp-lightning_fabric": "ddp",
    "fsdp-lightning_fabric": "fsdp",
    "model_parallel-lightning_fabric": "model_parallel",
}


def plugin_for(strategy: str, precision: str) -> MixedPrecisionPlugin | FSDPMixedPrecisionPlugin:
    scaler = (
        DynamicLossScaler(init_scale=START_SCALE, growth_interval=GROWTH_INTERVAL) if precision == "16-mixed" else None
    )
    if strategy in STANDALONE:
        from lightning_amp_plus import lightning_fabric as standalone

        if STANDALONE[strategy] == "fsdp":
            return standalone.FSDPMixedPrecisionPlugin(precision, "cpu", scaler)  # type: ignore[no-any-return]
        return standalone.MixedPrecisionPlugin(precision, "cpu", scaler)  # type: ignore[no-any-return]
    if strategy in ("fsdp", FSDP_MASTER):
        return FSDPMixedPrecisionPlugin(precision, "cpu", scaler, master_weights=strategy == FSDP_MASTER)  # type: ignore[arg-type]
    return MixedPrecisionPlugin(precision, "cpu", scaler)  # type: ignore[arg-type]


def shard_with_fsdp2(model: nn.Module, device_mesh: Any, mp_policy: Any = None) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh, policy = device_mesh["data_parallel"], mp_policy or MixedPrecisionPolicy()
    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def strategy_for(strategy: str, plugin: Any, **options: Any) -> Any:
    package = "lightning_fabric" if strategy in STANDALONE else "lightning.fabric"
    kind = STANDALONE.get(strategy, strategy)
    if kind in ("fsdp", FSDP_MASTER):
        return cpu_fsdp_strategy(package)(**options)
    if kind in ("model_parallel", FSDP2_MASTER):
        policy = plugin.mp_policy if kind == FSDP2_MASTER else None
        shard = functools.partial(shard_with_fsdp2, mp_policy=policy)
        model_parallel = importlib.import_module(f"{package}.strategies").ModelParallelStrategy
        return model_parallel(shard, data_parallel_size=WORLD, tensor_parallel_size=1, **options)
    return "ddp"


def full_parameters(model: Any) -> list[Tensor]:
    """Every parameter whole, on every rank (a collective under FSDP)."""
    wrapped = model._forward_module
    if isinstance(wrapped, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
            return [p.detach().clone() for p in model.parameters()]
    return [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]


def local(grad: Tensor) -> Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def full_grad_norm(model: Any) -> float:
    """The global norm of the gradients in float64, from every rank's local pieces (the reference, apart)."""
    squares = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        if param.grad is not None:
            squares += local(param.grad).double().square().sum()
    wrapped = model._forward_module
    sharded = isinstance(wrapped, FullyShardedDataParallel) or any(isinstance(p, DTensor) for p in model.parameters())
    if sharded:
        torch.distributed.all_reduce(squares)  # shards: the whole is the sum over ranks
    return float(squares.sqrt())


def train(
    strategy: str,
    precision: str,
    *,
    steps: int = STEPS,
    accumulate: int = 2,
    seed: int = 0,
    save: tuple[int, Path] | None = None,
    load: Path | None = None,
    **strategy_options: Any,
) -> dict[str, Any]:
    """The loop of the module docstring on this rank; what it records at each step and the parameters at the end."""
    plugin = plugin_for(strategy, precision)
    fabric_type = importlib.import_module("lightning_fabric").Fabric if strategy in STANDALONE else L.Fabric
    chosen = strategy_for(strategy, plugin, **strategy_options)
    fabric = fabric_type(accelerator="cpu", devices=WORLD, strategy=chosen, plugins=[plugin])
    fabric.launch()
    torch.manual_seed(seed)
    plugin.engine.read_norms()  # as a MixedPrecisionMonitor does: each step's norm is measured (for the records)
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(make_optimizer("adamw", model.parameters()))
    start, handed_back = 0, None
    if load is not None:
        state = {"model": model, "optimizer": optimizer, "amp": plugin}
        start = fabric.load(load, state)["step"]
        handed_back = type(state["amp"]).__name__
        if state["amp"] is not plugin:
            # Fabric's FSDP (and ModelParallel) load of a sharded checkpoint puts the saved dict in the state instead of
            # calling the plugin's load_state_dict, as its other strategies do: the user loads it (docs/fabric.md).
            plugin.load_state_dict(state["amp"])
    records = []
    for step in range(start, steps):
        for micro in range(accumulate):
            x, y = batch(step, 10 * fabric.global_rank + micro)  # every rank its own batches
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                fabric.backward(F.mse_loss(model(x), y) / accumulate)
        if step == FAULT_STEP and fabric.global_rank == FAULT_RANK:
            first = next(local(p.grad) for p in model.parameters() if p.grad is not None and local(p.grad).numel())
            first.view(-1)[0] = float("inf")
        reference_norm = full_grad_norm(model)  # scaled under fp16: divided by the scale below
        scale = plugin.scaler.get_scale() if plugin.scaler is not None else 1.0
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM, error_if_nonfinite=False)  # the fault step's skipped
        optimizer.step()
        optimizer.zero_grad()
        records.append(
            {
                "skipped": plugin.recent_steps[-1].skipped,
                "scale": scale,
                "grad_norm": plugin.recent_steps[-1].grad_norm,
                "reference_norm": reference_norm / scale,
            }
        )
        if save is not None and step + 1 == save[0]:
            fabric.save(save[1], {"model": model, "optimizer": optimizer, "amp": plugin, "step": step + 1})
    return {
        "records": records,
        "params": full_parameters(model),
        "skipped_steps": plugin.skipped_steps,
        "state": plugin.state_dict(),
        "plugin": type(plugin).__name__,
        "built_on": (type(fabric).__module__.split(".")[0], type(plugin).__module__),
        "handed_back": handed_back,
    }


# ---------------------------------------------------------------------------------------------- scenarios
def runs(out: Path) -> dict[str, Any]:
    """Every strategy, both precisions: one fault on one rank at ``FAULT_STEP``."""
    every = (*STRATEGIES, FSDP_MASTER, FSDP2_MASTER, *STANDALONE)
    return {f"{strategy}/{precision}": train(strategy, precision) for strategy in every for precision in PRECISIONS}


def resumed(out: Path) -> dict[str, Any]:
    """fp16 under FSDP: straight to the end, and saved after 3 steps (sharded), resumed in fresh objects to the end; the
    same under FSDP and FSDP2 of ``lightning_fabric``."""
    path = out / "fsdp-step3"
    straight = train("fsdp", "16-mixed")
    train("fsdp", "16-mixed", steps=3, save=(3, path))
    again = train("fsdp", "16-mixed", seed=1, load=path)
    standalone = {}
    for strategy in ("fsdp-lightning_fabric", "model_parallel-lightning_fabric"):  # saved and resumed under it
        saved_at = out / f"{strategy}-step3"
        train(strategy, "16-mixed", steps=3, save=(3, saved_at))
        standalone[strategy] = train(strategy, "16-mixed", seed=1, load=saved_at)
    return {
        "straight": straight,
        "resumed": again,
        "files": sorted(p.name for p in path.iterdir()),
        "standalone": standalone,
    }


SCENARIOS = {"runs": runs, "resumed": resumed}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_pool(SCENARIOS, tmp_path_factory.mktemp("fabric_distributed"))


# -------------------------------------------------------------------------------------------------- tests
def test_the_fsdp_plugin_runs_under_fabrics_fsdp_strategy_and_ours_under_the_others(
    ranks: list[dict[str, Any]],
) -> None:
    for record in scenario(ranks, "runs"):
        for key, run in record.items():
            expected = FSDPMixedPrecisionPlugin if key.startswith("fsdp") else MixedPrecisionPlugin
            assert run["plugin"] == expected.__qualname__, key


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", [*STRATEGIES, FSDP_MASTER, FSDP2_MASTER, *STANDALONE])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(
    ranks: list[dict[str, Any]], strategy: str, precision: str
) -> None:
    runs = [record[f"{strategy}/{precision}"] for record in scenario(ranks, "runs")]
    for run in runs:
        assert [r["skipped"] for r in run["records"]] == [step == FAULT_STEP for step in range(STEPS)]
        assert run["skipped_steps"] == 1
        assert all(torch.isfinite(p).all() for p in run["params"])
    assert runs[0]["state"] == runs[1]["state"]  # the same scale and counters on both ranks
    for a, b in zip(runs[0]["params"], runs[1]["params"], strict=True):
        assert torch.equal(a, b)
    assert [r["grad_norm"] for r in runs[0]["records"]] == [r["grad_norm"] for r in runs[1]["records"]]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", [*STRATEGIES, FSDP_MASTER, FSDP2_MASTER])
def test_the_reported_norm_is_the_norm_of_the_whole_unscaled_gradient(
    ranks: list[dict[str, Any]], strategy: str, precision: str
) -> None:
    # The plugin sums float32 squares (over shards, then over ranks); the reference float64 ones: a relative error of
    # at most n * 2**-24 for n = 808 terms, ~5e-5. On the fault step both are non-finite.
    run = scenario(ranks, "runs")[0][f"{strategy}/{precision}"]
    for step, record in enumerate(run["records"]):
        if step == FAULT_STEP:
            assert not torch.isfinite(torch.tensor(record["grad_norm"]))
        else:
            assert record["grad_norm"] == pytest.approx(record["reference_norm"], rel=5e-5), step
            assert record["grad_norm"] > MAX_NORM  # every step clipped


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_sharded_runs_equal_ddp(ranks: list[dict[str, Any]], strategy: str, precision: str) -> None:
    # Tolerance: FSDP reduce-scatters (FSDP2 too) the gradients where DDP all-reduces its buckets, and the norm that
    # clips is a sum over shards: float32 sums in another order. Measured: at most 3.0e-8 apart (one float32 ulp of
    # these weights; AdamW's normalised update carries a one-ulp gradient difference to the weight), FSDP2 in fp16
    # bit for bit. atol 1e-7 with rtol 1e-6 allows a few ulps.
    record = scenario(ranks, "runs")[0]
    for p, q in zip(record[f"{strategy}/{precision}"]["params"], record[f"ddp/{precision}"]["params"], strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert record[f"{strategy}/{precision}"]["state"] == record[f"ddp/{precision}"]["state"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", sorted(STANDALONE))
def test_under_lightning_fabric_the_strategy_equals_the_same_under_lightning_bit_for_bit(
    ranks: list[dict[str, Any]], strategy: str, precision: str
) -> None:
    module = "fsdp" if STANDALONE[strategy] == "fsdp" else "precision"
    for record in scenario(ranks, "runs"):
        mine, lightnings = record[f"{strategy}/{precision}"], record[f"{STANDALONE[strategy]}/{precision}"]
        assert mine["built_on"] == ("lightning_fabric", f"lightning_amp_plus._standalone.plugins.{module}")
        assert lightnings["built_on"] == ("lightning", f"lightning_amp_plus.plugins.{module}")
        for p, q in zip(mine["params"], lightnings["params"], strict=True):
            assert torch.equal(p, q)
        assert mine["state"] == lightnings["state"]
        assert repr(mine["records"]) == repr(lightnings["records"])  # the fault step's norm is NaN, equal to nothing


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fsdp2_under_the_plugins_policy_keeps_fp32_shards(ranks: list[dict[str, Any]], precision: str) -> None:
    run = scenario(ranks, "runs")[0][f"{FSDP2_MASTER}/{precision}"]
    assert run["params"] and all(p.dtype == torch.float32 for p in run["params"])


def test_a_run_resumed_under_fsdp_equals_the_uninterrupted_one(ranks: list[dict[str, Any]]) -> None:
    for record in scenario(ranks, "resumed"):
        straight, again = record["straight"], record["resumed"]
        for p, q in zip(straight["params"], again["params"], strict=True):
            assert torch.equal(p, q)
        assert again["state"] == straight["state"] and again["skipped_steps"] == 1
        assert again["records"] == straight["records"][3:]
        assert "meta.pt" in record["files"]  # Fabric's sharded checkpoint: the plugin's state is in its metadata
        # ... which Fabric's FSDP load hands back as the saved dict, without calling the plugin's load_state_dict:
        # the loop above loads it itself, as docs/fabric.md says (Fabric's single-device and DDP loads call it).
        assert again["handed_back"] == "dict"


@pytest.mark.parametrize("strategy", ["fsdp-lightning_fabric", "model_parallel-lightning_fabric"])
def test_a_sharded_checkpoint_resumed_under_lightning_fabric_ends_where_the_run_under_lightning_does(
    ranks: list[dict[str, Any]], strategy: str
) -> None:
    for resumed_of_rank, runs_of_rank in zip(scenario(ranks, "resumed"), scenario(ranks, "runs"), strict=True):
        again, straight = resumed_of_rank["standalone"][strategy], runs_of_rank[f"{STANDALONE[strategy]}/16-mixed"]
        assert again["built_on"][0] == "lightning_fabric" and straight["built_on"][0] == "lightning"
        for p, q in zip(again["params"], straight["params"], strict=True):
            assert torch.equal(p, q)
        assert again["state"] == straight["state"] and again["skipped_steps"] == 1
        assert repr(again["records"]) == repr(straight["records"][3:])
        assert again["handed_back"] == "dict"  # a sharded load hands the plugin's state back (docs/fabric.md)
