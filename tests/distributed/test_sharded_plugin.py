"""Our plugins under sharding on CPU, 2 processes over gloo: FSDP (``FSDPStrategy``), FSDP2 (``ModelParallelStrategy``).

``FSDPMixedPrecisionPlugin`` under the test-only :class:`cpu_fsdp.CPUFSDPStrategy` (Lightning refuses FSDP on CPU)
and ``MixedPrecisionPlugin`` under ``ModelParallelStrategy`` (``fully_shard`` in ``configure_model``) train the model
of ``test_sharded`` on the same batches as DDP with ``MixedPrecisionPlugin``, in fp16 and bf16, with and without
master weights (under FSDP2: the plugin's ``mp_policy`` passed to ``fully_shard``), with an inf injected into one
rank's gradient shard at one step. One pool of worker processes (:mod:`launch`) runs every scenario; the tests compare
what the ranks recorded:

* the parameters after the run equal DDP's (rtol 1e-6, atol 1e-7: the sums over shards are ordered differently; with
  master weights FSDP reduces FP32 gradients where DDP all-reduces half ones, see the tolerance there);
* the norm the plugin reports is the norm of the whole gradient, gathered; clipping by norm clips to it;
* the inf on one rank skips the step on every rank, the parameters stay finite and identical, the LR is held;
* a run resumed from a checkpoint (full, and sharded/distributed) equals the uninterrupted one;
* the monitor logs on rank zero only.
"""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from cpu_fsdp import CPUFSDPStrategy
from helpers import FP16_ON_CPU_WARNING
from launch import WORLD, run_pool, scenario
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from test_sharded import ShardedStepData, StepData, fit, full_parameters, local_view
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_amp_plus import DynamicLossScaler, FSDPMixedPrecisionPlugin, MixedPrecisionMonitor, MixedPrecisionPlugin

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings(FP16_ON_CPU_WARNING)]

STEPS = 5
FAULT_STEP = 2
PRECISIONS = ("16-mixed", "bf16-mixed")
HALF = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
SHARDED = ("fsdp", "model_parallel")


def scaler(precision: str) -> DynamicLossScaler | None:
    # growth every 2 clean steps keeps the scale moving, so equal scales on both ranks mean something
    return DynamicLossScaler(init_scale=2.0**10, growth_interval=2) if precision == "16-mixed" else None


def plugin_for(strategy: str, precision: str, master_weights: bool) -> MixedPrecisionPlugin | FSDPMixedPrecisionPlugin:
    if strategy == "fsdp":
        return FSDPMixedPrecisionPlugin(precision, "cpu", scaler(precision), master_weights=master_weights)  # type: ignore[arg-type]
    # Under FSDP2 master weights are the model's own policy (fully_shard), not the plugin's option.
    ddp_master = master_weights and strategy == "ddp"
    return MixedPrecisionPlugin(precision, "cpu", scaler(precision), master_weights=ddp_master)  # type: ignore[arg-type]


def model_for(strategy: str, precision: str, master_weights: bool, **kwargs: Any) -> StepData:
    if strategy != "model_parallel":
        return StepData(**kwargs)
    policy = MixedPrecisionPolicy(param_dtype=HALF[precision], reduce_dtype=torch.float32) if master_weights else None
    return ShardedStepData(mp_policy=policy, **kwargs)


# ----------------------------------------------------------------------------------------------- recording
def full_grad_norm(trainer: pl.Trainer, module: pl.LightningModule) -> float:
    """The norm of the whole gradient, gathered on every rank (a collective), in float64: the reference."""
    wrapped = trainer.strategy.model
    if isinstance(wrapped, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False, with_grads=True):
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            return float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads])))
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    full = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
    return float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in full])))


class Steps(pl.Callback):
    """Per optimizer step: skip, scale, LR, the plugin's norm, the gathered norm, and the norm the optimizer got."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._norm: float | None = None
        self._seen: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        trainer.precision_plugin.engine.read_norms()  # type: ignore[attr-defined]  # this callback reads each norm

        def seen(*_: Any) -> None:  # at optimizer.step: after clipping, what the optimizer is handed
            local = [
                local_view(p.grad).double() for g in optimizer.param_groups for p in g["params"] if p.grad is not None
            ]
            squared = (
                torch.stack([t.square().sum() for t in local]).sum() if local else torch.zeros((), dtype=torch.float64)
            )
            torch.distributed.all_reduce(squared)  # shards: the sum over the ranks is the whole
            self._seen = float(squared.sqrt())

        optimizer.register_step_pre_hook(seen)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._norm = full_grad_norm(trainer, pl_module)  # unscaled, before clipping

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        plugin = trainer.precision_plugin
        assert isinstance(plugin, MixedPrecisionPlugin | FSDPMixedPrecisionPlugin)
        self.steps.append(
            {
                "skipped": plugin.recent_steps[-1].skipped,
                "scale": None if plugin.scaler is None else plugin.scaler.get_scale(),
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
                "grad_norm": plugin.recent_steps[-1].grad_norm,
                "full_norm": self._norm,
                "seen_norm": None if plugin.recent_steps[-1].skipped else self._seen,
            }
        )
        self._seen = None


def record_fit(strategy: str, precision: str, master_weights: bool, **kwargs: Any) -> dict[str, Any]:
    steps = Steps()
    torch.manual_seed(0)  # every strategy starts from the same weights
    model = model_for(strategy, precision, master_weights, fault_steps=(FAULT_STEP,), scheduler="step")
    trainer, model = fit(
        strategy,
        plugin=plugin_for(strategy, precision, master_weights),
        model=model,
        steps=STEPS,
        callbacks=[steps],
        **kwargs,
    )
    return {
        "steps": steps.steps,
        "params": full_parameters(trainer, model),
        "skipped_steps": trainer.precision_plugin.skipped_steps,  # type: ignore[attr-defined]
        "held": trainer.precision_plugin.engine.log.held_schedulers.held_steps,  # type: ignore[attr-defined]
    }


# ---------------------------------------------------------------------------------------------- scenarios
def modes(out: Path) -> dict[str, Any]:
    """DDP and both sharded strategies, fp16 and bf16, with and without master weights: one fault on one rank."""
    return {
        f"{strategy}/{precision}/{master}": record_fit(strategy, precision, master)
        for strategy in ("ddp", *SHARDED)
        for precision in PRECISIONS
        for master in (False, True)
    }


def clipped(out: Path) -> dict[str, Any]:
    """Clipping by norm under both sharded strategies (fp16): the optimizer gets gradients of norm 0.05."""
    return {
        strategy: record_fit(strategy, "16-mixed", False, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        for strategy in SHARDED
    }


def resumed(out: Path) -> dict[str, Any]:
    """Adam, fp16, a fault before and after the checkpoint: 8 steps straight, and 4 + a resume to 8, per layout."""
    results = {}
    layouts = {
        "fsdp/full": lambda: CPUFSDPStrategy(state_dict_type="full"),
        "fsdp/sharded": lambda: CPUFSDPStrategy(state_dict_type="sharded"),
        "model_parallel/full": lambda: ModelParallelStrategy(WORLD, 1, save_distributed_checkpoint=False),
        "model_parallel/sharded": lambda: ModelParallelStrategy(WORLD, 1, save_distributed_checkpoint=True),
    }
    for layout, strategy in layouts.items():
        name = layout.split("/")[0]

        def run(seed: int, steps: int, ckpt_path: Path | None = None) -> tuple[pl.Trainer, StepData]:
            torch.manual_seed(seed)  # the straight run and the first half start alike; the resumed one elsewhere
            model = model_for(name, "16-mixed", False, optimizer="adam", fault_steps=(1, 5))  # noqa: B023
            plugin = plugin_for(name, "16-mixed", False)  # noqa: B023
            return fit(name, plugin=plugin, model=model, steps=steps, strategy=strategy(), ckpt_path=ckpt_path)  # noqa: B023

        straight, straight_model = run(0, 8)
        first, _ = run(0, 4)
        path = out / layout.replace("/", "-")
        first.save_checkpoint(path)
        again, again_model = run(1, 8, ckpt_path=path)
        results[layout] = {
            "straight": full_parameters(straight, straight_model),
            "resumed": full_parameters(again, again_model),
            "skips": (straight.precision_plugin.skipped_steps, again.precision_plugin.skipped_steps),  # type: ignore[attr-defined]
            "scales": (straight.scaler.get_scale(), again.scaler.get_scale()),  # type: ignore[union-attr]
            "files": sorted(p.name for p in path.iterdir()) if path.is_dir() else [path.name],
        }
    return results


def monitored(out: Path) -> dict[str, Any]:
    results = {}
    for strategy in SHARDED:
        monitor = MixedPrecisionMonitor(log_memory=False)
        printed = io.StringIO()
        folder = out / f"monitor-{strategy}"
        torch.manual_seed(0)
        model = model_for(strategy, "16-mixed", False, fault_steps=(FAULT_STEP,))
        with contextlib.redirect_stdout(printed):
            fit(
                strategy,
                plugin=plugin_for(strategy, "16-mixed", False),
                model=model,
                steps=STEPS,
                callbacks=[monitor],
                logger=CSVLogger(folder),
                log_every_n_steps=1,
            )
        results[strategy] = {
            "skipped": [record.skipped for record in monitor.history.steps],
            "printed": printed.getvalue(),
            "csv": [str(p) for p in folder.rglob("metrics.csv")],
        }
    return results


def half_built(out: Path) -> dict[str, Any]:
    """FSDP master weights (bf16) for a model built in bf16, and for the same bf16 values built as an FP32 model."""
    results = {}
    for built in ("bf16", "fp32"):
        torch.manual_seed(0)
        model = StepData().to(torch.bfloat16)
        if built == "fp32":
            model = model.to(torch.float32)  # the same (bf16-rounded) values, held in FP32 from the start
        plugin = FSDPMixedPrecisionPlugin("bf16-mixed", "cpu", master_weights=True)
        trainer, _ = fit("fsdp", plugin=plugin, model=model, steps=3)
        results[built] = {
            "shards": sorted({str(p.dtype) for p in trainer.strategy.model.parameters()}),
            "params": full_parameters(trainer, model),
        }
    return results


def refusals(out: Path) -> dict[str, Any]:
    def error_of(run: Any) -> str:
        try:
            run()
        except (TypeError, ValueError) as error:
            return f"{type(error).__name__}: {error}"
        return ""

    return {
        "master_weights_under_fsdp2": error_of(
            lambda: fit(
                "model_parallel", plugin=MixedPrecisionPlugin("bf16-mixed", "cpu", master_weights=True), steps=1
            )
        ),
        "two_fsdp_policies": error_of(
            lambda: fit(
                "fsdp",
                plugin=FSDPMixedPrecisionPlugin("bf16-mixed", "cpu", master_weights=True),
                strategy=CPUFSDPStrategy(
                    mixed_precision=torch.distributed.fsdp.MixedPrecision(param_dtype=torch.bfloat16)
                ),
                steps=1,
            )
        ),
    }


SCENARIOS = {
    "modes": modes,
    "clipped": clipped,
    "resumed": resumed,
    "monitored": monitored,
    "half_built": half_built,
    "refusals": refusals,  # last: it ends fits with an exception
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_pool(SCENARIOS, tmp_path_factory.mktemp("sharded_plugin"))


def both(ranks: list[dict[str, Any]], name: str, key: str) -> tuple[Any, ...]:
    return tuple(record[key] for record in scenario(ranks, name))


# -------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", SHARDED)
def test_sharded_training_ends_where_ddp_with_the_same_plugin_ends(
    ranks: list[dict[str, Any]], strategy: str, precision: str
) -> None:
    for modes_of_rank in scenario(ranks, "modes"):
        sharded, ddp = modes_of_rank[f"{strategy}/{precision}/False"], modes_of_rank[f"ddp/{precision}/False"]
        # Same model, batches and SGD; autocast over FP32 parameters in both. Only the order of the gradient sums over
        # shards differs (over 2 ranks it does not: both average two values exactly): one float32 rounding per step.
        torch.testing.assert_close(sharded["params"], ddp["params"], rtol=1e-6, atol=1e-7)
        assert [s["scale"] for s in sharded["steps"]] == [s["scale"] for s in ddp["steps"]]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", SHARDED)
def test_master_weights_under_sharding_train_as_ddp_with_master_weights_within_their_reductions_rounding(
    ranks: list[dict[str, Any]], strategy: str, precision: str
) -> None:
    """FSDP's half parameters over FP32 shards, gradients reduced in FP32; DDP with our master weights all-reduces half
    gradients. The forward sees the same half weights, the reductions round differently: measured 1.2e-4 (fp16) and
    9.5e-4 (bf16) after these steps, hence 5e-4 / 2e-3."""
    atol = 5e-4 if precision == "16-mixed" else 2e-3
    for modes_of_rank in scenario(ranks, "modes"):
        sharded, ddp = modes_of_rank[f"{strategy}/{precision}/True"], modes_of_rank[f"ddp/{precision}/True"]
        torch.testing.assert_close(sharded["params"], ddp["params"], rtol=0, atol=atol)
        assert [s["skipped"] for s in sharded["steps"]] == [s["skipped"] for s in ddp["steps"]]


def test_fsdp_master_weights_of_a_model_built_in_half_are_fp32_shards_as_for_the_same_values_built_fp32(
    ranks: list[dict[str, Any]],
) -> None:
    # The masters FSDP holds (its flat shards) are FP32 whatever dtype the model was built in: the plugin widens the
    # parameters before FSDP flattens them, so the run equals the one built in FP32 from the same values, bit for bit.
    for built in scenario(ranks, "half_built"):
        assert built["bf16"]["shards"] == built["fp32"]["shards"] == ["torch.float32"]
        torch.testing.assert_close(built["bf16"]["params"], built["fp32"]["params"], rtol=0, atol=0)


@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", SHARDED)
def test_an_inf_on_one_rank_skips_the_step_everywhere_and_holds_the_schedule(
    ranks: list[dict[str, Any]], strategy: str, precision: str, master: bool
) -> None:
    records = [m[f"{strategy}/{precision}/{master}"] for m in scenario(ranks, "modes")]
    for record in records:
        assert [s["skipped"] for s in record["steps"]] == [step == FAULT_STEP for step in range(STEPS)]
        assert record["skipped_steps"] == 1 and record["held"] == 1
        # StepLR(gamma=0.5) stepped every optimizer step, but not after the skipped one.
        assert [s["lr"] for s in record["steps"]] == [
            0.05 * 0.5 ** (step + 1 - (step >= FAULT_STEP)) for step in range(STEPS)
        ]
        assert all(torch.isfinite(p).all() for p in record["params"])
    # One decision, one scale, one model on both ranks.
    torch.testing.assert_close(records[0]["params"], records[1]["params"], rtol=0, atol=0)
    assert [s["scale"] for s in records[0]["steps"]] == [s["scale"] for s in records[1]["steps"]]


@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", SHARDED)
def test_the_reported_norm_is_the_norm_of_the_whole_gradient(
    ranks: list[dict[str, Any]], strategy: str, precision: str, master: bool
) -> None:
    for modes_of_rank in scenario(ranks, "modes"):
        for step in modes_of_rank[f"{strategy}/{precision}/{master}"]["steps"]:
            if step["skipped"]:
                assert step["grad_norm"] == math.inf
                continue
            # float32 sums of the local squared norms, in another order than the float64 gathered reference.
            assert step["grad_norm"] == pytest.approx(step["full_norm"], rel=1e-6)


@pytest.mark.parametrize("strategy", SHARDED)
def test_clipping_by_norm_clips_the_whole_gradient_to_the_limit(ranks: list[dict[str, Any]], strategy: str) -> None:
    for clipped_of_rank in scenario(ranks, "clipped"):
        steps = clipped_of_rank[strategy]["steps"]
        applied = [s for s in steps if not s["skipped"]]
        assert applied and all(s["grad_norm"] > 0.05 for s in applied)  # every applied step was over the limit
        for step in applied:
            # max_norm / (norm + 1e-6) as torch computes it: the clipped norm is the limit to that epsilon.
            assert step["seen_norm"] == pytest.approx(0.05, rel=1e-5)


@pytest.mark.parametrize("layout", ["fsdp/full", "fsdp/sharded", "model_parallel/full", "model_parallel/sharded"])
def test_a_resumed_run_equals_the_uninterrupted_one(ranks: list[dict[str, Any]], layout: str) -> None:
    for resumed_of_rank in scenario(ranks, "resumed"):
        record = resumed_of_rank[layout]
        torch.testing.assert_close(record["resumed"], record["straight"], rtol=0, atol=0)
        assert record["skips"] == (2, 2) and record["scales"][0] == record["scales"][1]
        if layout.endswith("sharded"):
            assert "meta.pt" in record["files"]  # the plugin's state rides with Lightning's metadata


@pytest.mark.parametrize("strategy", SHARDED)
def test_the_monitor_logs_and_prints_on_rank_zero_only(ranks: list[dict[str, Any]], strategy: str) -> None:
    rank0, rank1 = (record[strategy] for record in scenario(ranks, "monitored"))
    expected = [step == FAULT_STEP for step in range(STEPS)]
    assert rank0["skipped"] == rank1["skipped"] == expected
    assert f"MixedPrecisionMonitor: {STEPS} optimizer steps, 1 skipped" in rank0["printed"] and rank1["printed"] == ""
    assert len(rank0["csv"]) == 1 and rank1["csv"] == rank0["csv"]


def test_master_weights_on_fsdp2_parameters_are_refused_with_the_policy_to_use(ranks: list[dict[str, Any]]) -> None:
    for refusals_of_rank in scenario(ranks, "refusals"):
        message = refusals_of_rank["master_weights_under_fsdp2"]
        assert message.startswith("ValueError") and "mp_policy=plugin.mp_policy" in message


def test_a_second_fsdp_mixed_precision_policy_is_refused(ranks: list[dict[str, Any]]) -> None:
    for refusals_of_rank in scenario(ranks, "refusals"):
        message = refusals_of_rank["two_fsdp_policies"]
        assert message.startswith("ValueError") and "pass one of them" in message


# ----------------------------------------------------------------------------------- single-process checks
def test_the_fsdp_plugin_is_an_fsdp_precision_with_our_scaler_and_fsdps_policy_for_master_weights() -> None:
    plugin = FSDPMixedPrecisionPlugin("16-mixed")
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=CPUFSDPStrategy(), plugins=[plugin])
    assert trainer.precision_plugin is plugin and isinstance(trainer.scaler, DynamicLossScaler)
    assert trainer.strategy.mixed_precision_config is None  # FP32 shards under autocast
    masters = FSDPMixedPrecisionPlugin("bf16-mixed", master_weights=True).mixed_precision_config
    assert masters is not None and (masters.param_dtype, masters.reduce_dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "16"])
def test_the_fsdp_plugin_refuses_a_precision_that_is_not_mixed_naming_lightnings_own(precision: str) -> None:
    with pytest.raises(ValueError, match=rf"precision={precision!r}\)` is not supported.*strategy='fsdp'"):
        FSDPMixedPrecisionPlugin(precision)  # type: ignore[arg-type]


def test_the_plugins_fsdp2_policy_computes_in_half_over_fp32_shards() -> None:
    policy = MixedPrecisionPlugin("16-mixed").mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.float16, torch.float32)
