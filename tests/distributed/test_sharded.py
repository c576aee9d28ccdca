"""Sharded strategies on CPU, 2 processes over gloo, with Lightning's own precision plugins.

``FSDPStrategy`` (FSDP1, flat parameters; through the test-only :class:`cpu_fsdp.CPUFSDPStrategy`) and
``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``configure_model``, DTensor parameters) train the same model on
the same batches as ``strategy="ddp"``, in ``32-true`` and ``bf16-mixed``, inside one pool of worker processes
(:mod:`launch`): the parameters they end with are compared with DDP's. One more scenario runs
``MixedPrecisionPlugin`` under ``ModelParallelStrategy``, where its gradient pass meets DTensor gradients.

The pool tests are marked ``slow`` (about 15 s on an idle machine, a minute on 2 busy cores): ``--run-slow``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from cpu_fsdp import CPUFSDPStrategy
from helpers import TinyRegressor, loader, make_net, mse, step_batch
from launch import WORLD, run_pool, scenario
from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_amp_plus import MixedPrecisionPlugin

pytestmark = pytest.mark.integration  # starts processes or runs whole commands

STEPS = 4
FAULT_RANK = 1
N_PARAMS = sum(p.numel() for p in make_net().parameters())
LIGHTNING_PRECISIONS = ("32-true", "bf16-mixed")
STRATEGIES = ("fsdp", "model_parallel")


# ------------------------------------------------------------------------------------------------ the models
class StepData(TinyRegressor):
    """TinyRegressor whose batches depend only on the step and the rank, as in ``test_ddp.RankData``.

    The input is cast to the first layer's weight dtype: under ``FSDPPrecision("bf16-mixed")`` FSDP computes with
    bf16 parameters and casts only the *root* forward's inputs (a batch made inside ``training_step`` is not one), and
    its ``torch.autocast("cuda")`` does nothing on CPU. Elsewhere the weight is FP32 and the cast does nothing.

    Args:
        optimizer: as for TinyRegressor ("sgd" by default: its update is linear in the gradient, so runs compare
            tightly).
        fault_steps: at these global steps rank ``FAULT_RANK`` sets one element of its first non-empty local gradient
            shard to inf after the backward (and its reduction): only a reduction of the overflow flag across ranks
            makes the other rank skip too.
    """

    def __init__(self, optimizer: str = "sgd", fault_steps: Iterable[int] = (), scheduler: str | None = None) -> None:
        super().__init__(optimizer=optimizer, lr=0.05 if optimizer == "sgd" else 0.01, scheduler=scheduler)
        self.fault_steps = set(fault_steps)
        self.compute_dtypes: list[torch.dtype] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = step_batch(self.trainer.global_step * WORLD + self.global_rank)
        x = x.to(self.net[0].weight.dtype)
        self.compute_dtypes.append(self.net[0](x).dtype)
        return mse(self.net, (x, y))

    def on_after_backward(self) -> None:
        if self.global_rank == FAULT_RANK and self.trainer.global_step in self.fault_steps:
            for p in self.parameters():
                grad = None if p.grad is None else local_view(p.grad)
                if grad is not None and grad.numel() > 0:
                    grad.view(-1)[0] = math.inf
                    return


class ShardedStepData(StepData):
    """The same model, each ``Linear`` and then the root sharded with FSDP2 over the data-parallel mesh.

    Args:
        mp_policy: FSDP2's mixed-precision policy for every ``fully_shard`` call, or None (FP32 throughout).
    """

    def __init__(
        self,
        optimizer: str = "sgd",
        fault_steps: Iterable[int] = (),
        mp_policy: MixedPrecisionPolicy | None = None,
        scheduler: str | None = None,
    ) -> None:
        super().__init__(optimizer, fault_steps, scheduler)
        self.mp_policy = mp_policy

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        policy = {} if self.mp_policy is None else {"mp_policy": self.mp_policy}
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, **policy)
        fully_shard(self, mesh=mesh, **policy)


def strategy_for(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    if name == "fsdp":
        return CPUFSDPStrategy()
    # All ranks in the data-parallel dimension: FSDP2 shards over it (Lightning's default puts them in tensor-parallel).
    return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)


def fit(
    name: str,
    precision: str | None = None,
    plugin: Precision | None = None,
    model: StepData | None = None,
    steps: int = STEPS,
    ckpt_path: Path | None = None,
    strategy: Any = None,
    seed: int = 0,
    **kwargs: Any,
) -> tuple[pl.Trainer, StepData]:
    """A fresh 2-rank fit of ``model`` (seeded, so every strategy starts from the same weights) for ``steps`` steps.

    Args:
        name: "ddp", "fsdp" or "model_parallel" (the model must then shard itself in ``configure_model``).
        strategy: a strategy object instead of the default one for ``name``.
        seed: the seed of the initial weights (a resumed run starts from other weights than the checkpoint's).
        kwargs: more ``Trainer`` arguments (callbacks, gradient clipping).
    """
    torch.manual_seed(seed)
    if model is None:
        model = ShardedStepData() if name == "model_parallel" else StepData()
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": WORLD,
        "strategy": strategy_for(name) if strategy is None else strategy,
        "precision": precision,
        "plugins": None if plugin is None else [plugin],
        "max_steps": steps,
        "max_epochs": -1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    trainer = pl.Trainer(**{**settings, **kwargs})
    # The batches come from StepData.training_step; the loader only sets the pace.
    trainer.fit(model, loader(n=WORLD * 16 * 8, batch_size=8), ckpt_path=ckpt_path)
    return trainer, model


def full_parameters(trainer: pl.Trainer, model: pl.LightningModule) -> list[Tensor]:
    """Every parameter whole, on every rank (collectives: every rank calls this)."""
    wrapped = trainer.strategy.model
    if isinstance(wrapped, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False):
            return [p.detach().clone() for p in model.parameters()]
    return [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]


def local_view(t: Tensor) -> Tensor:
    """A DTensor's local shard (sharing its storage), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_numels(model: pl.LightningModule) -> list[int]:
    return [local_view(p).numel() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------- scenarios
def lightning_fits(out: Path) -> dict[str, Any]:
    """DDP, FSDP and FSDP2, each in 32-true and bf16-mixed, Lightning's precision plugins."""
    results = {}
    for name in ("ddp", *STRATEGIES):
        for precision in LIGHTNING_PRECISIONS:
            trainer, model = fit(name, precision)
            results[f"{name}/{precision}"] = {
                "global_step": trainer.global_step,
                "plugin": type(trainer.precision_plugin).__name__,
                "compute_dtypes": sorted({str(dtype) for dtype in model.compute_dtypes}),
                "param_types": sorted({type(p).__name__ for p in model.parameters()}),
                "local_numels": local_numels(model),
                "params": full_parameters(trainer, model),
            }
    return results


def our_plugin_under_model_parallel(out: Path) -> dict[str, Any]:
    try:
        fit("model_parallel", plugin=MixedPrecisionPlugin("bf16-mixed", device="cpu"))
    except RuntimeError as error:
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None, "message": ""}


SCENARIOS = {"lightning": lightning_fits, "ours_model_parallel": our_plugin_under_model_parallel}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_pool(SCENARIOS, tmp_path_factory.mktemp("sharded"))


# -------------------------------------------------------------------------------------------------- tests
def test_the_cpu_fsdp_strategy_is_accepted_on_cpu_and_gets_lightnings_fsdp_precision() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=CPUFSDPStrategy(), precision="bf16-mixed")
    assert isinstance(trainer.precision_plugin, FSDPPrecision) and trainer.precision == "bf16-mixed"
    with pytest.raises(TypeError, match=r"FSDP strategy can only work with the `FSDPPrecision` plugin"):
        CPUFSDPStrategy(precision_plugin=MixedPrecisionPlugin("bf16-mixed"))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_fits_at_32_true_end_where_ddp_ends(ranks: list[dict[str, Any]], strategy: str) -> None:
    for record in scenario(ranks, "lightning"):
        ddp, sharded = record["ddp/32-true"], record[f"{strategy}/32-true"]
        assert sharded["global_step"] == ddp["global_step"] == STEPS
        assert sharded["compute_dtypes"] == ["torch.float32"]
        # Same model, same batches, same SGD: only the order of the gradient sums can differ (over 2 ranks it does
        # not: both average two values, exactly). One float32 rounding per step is the tolerance.
        torch.testing.assert_close(sharded["params"], ddp["params"], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sharded_fits_hold_shards_not_replicas(ranks: list[dict[str, Any]], strategy: str) -> None:
    records = [r[f"{strategy}/32-true"] for r in scenario(ranks, "lightning")]
    # Each element lives on one rank only: the ranks' local pieces add up to the model, once.
    assert sum(sum(r["local_numels"]) for r in records) == N_PARAMS
    assert all(sum(r["local_numels"]) < N_PARAMS for r in records)
    expected_type = "Parameter" if strategy == "fsdp" else "DTensor"
    assert records[0]["param_types"] == [expected_type]
    torch.testing.assert_close(records[0]["params"], records[1]["params"], rtol=0, atol=0)


@pytest.mark.slow
def test_model_parallel_bf16_mixed_is_lightnings_autocast_and_ends_where_ddp_ends(
    ranks: list[dict[str, Any]],
) -> None:
    for record in scenario(ranks, "lightning"):
        ddp, fsdp2 = record["ddp/bf16-mixed"], record["model_parallel/bf16-mixed"]
        assert fsdp2["plugin"] == ddp["plugin"] == MixedPrecision.__name__
        assert fsdp2["compute_dtypes"] == ddp["compute_dtypes"] == ["torch.bfloat16"]
        # Autocast over the all-gathered FP32 parameters: the same arithmetic as DDP's, the sums ordered as above.
        torch.testing.assert_close(fsdp2["params"], ddp["params"], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_fsdp_bf16_mixed_computes_with_bf16_parameters_and_stays_near_ddp(ranks: list[dict[str, Any]]) -> None:
    for record in scenario(ranks, "lightning"):
        ddp, fsdp = record["ddp/bf16-mixed"], record["fsdp/bf16-mixed"]
        assert fsdp["plugin"] == FSDPPrecision.__name__
        assert fsdp["compute_dtypes"] == ["torch.bfloat16"]
        # FSDP's MixedPrecision(param_dtype=bf16, reduce_dtype=bf16): the weights are rounded to bf16 before the
        # forward and the gradients reduced in bf16, where DDP's autocast keeps FP32 weights and gradients. Each
        # step's update (lr 0.05 x gradient) then differs by a few bf16 roundings (2**-8 relative); over 4 steps that
        # stays well under 1e-2 for these weights (|w| < 1).
        torch.testing.assert_close(fsdp["params"], ddp["params"], rtol=0, atol=1e-2)
        # ... and it is not the same arithmetic:
        assert any(not torch.equal(a, b) for a, b in zip(fsdp["params"], ddp["params"], strict=True))


@pytest.mark.slow
def test_our_plugin_under_model_parallel_measures_dtensor_gradients_on_their_shards(
    ranks: list[dict[str, Any]],
) -> None:
    """It failed in its one-pass norm on DTensor gradients (`Sharding propagation failed for aten._foreach_norm`);
    it now measures each rank's local shards (tests/distributed/test_sharded_plugin.py checks the numbers)."""
    for record in scenario(ranks, "ours_model_parallel"):
        assert record == {"error": None, "message": ""}
