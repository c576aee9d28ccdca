"""The prototype plugins (``proto_plugins.py``) under Lightning's sharded strategies, 2 CPU ranks over gloo.

Each check compares with somebody else's behaviour: the package's ``MixedPrecisionPlugin`` under ``strategy="ddp"``
(same data, same options), the norm of the full (gathered) gradient, an uninterrupted run. Scenarios:

* ``driven``: which ``FSDPPrecision`` hooks Lightning calls, in which order, under ``FSDPStrategy``; what its
  ``ShardedGradScaler`` does on CPU; that its ``clip_grad_by_norm`` raises.
* ``vs_ddp``: for FSDP1 (``ProtoFSDPPrecision``) and FSDP2 (``ProtoModelParallelPrecision``), in 16-mixed and
  bf16-mixed, with an inf injected on rank 1 only at step 1: skip decisions, scales, norms and final parameters
  against DDP with ``MixedPrecisionPlugin``; the reported norm against the full-gradient norm.
* ``master_weights``: FSDP1 ``MixedPrecision(param_dtype=half, reduce_dtype=float32)`` and FSDP2
  ``MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32)`` against DDP with ``master_weights=True``.
* ``clipping``: by norm (the clipped gradients the optimizer sees have the global norm ``gradient_clip_val``) and by
  value, FSDP1 and FSDP2; Lightning's own ``FSDPPrecision`` refusing by norm.
* ``flat_params``: FSDP1 with ``use_orig_params=False`` (the optimizer holds flat parameters).
* ``checkpoints``: FSDP1 ``state_dict_type`` "full" and "sharded", FSDP2 ``save_distributed_checkpoint`` True and
  False: where the plugin's state lands, and a resumed run against the uninterrupted one.

Run (about 1-2 minutes on 2 busy cores): ``python prototypes/sharded/lightning_sharded.py``. Every check is asserted;
the measured differences are printed.
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _pool  # noqa: F401  (puts tests/ on the path)
import lightning.pytorch as pl
import torch
from cpu_fsdp import CPUFSDPStrategy
from launch import WORLD, run_pool, scenario
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from proto_plugins import ProtoFSDPPrecision, ProtoModelParallelPrecision, local_view
from test_sharded import ShardedStepData, StepData, fit, full_parameters
from torch import Tensor
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionPlugin

FAULT_STEP = 1
STEPS = 4
HALF = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


# ------------------------------------------------------------------------------------------------ recording
def full_grad_norm(trainer: pl.Trainer, module: pl.LightningModule) -> float:
    """The norm of the whole gradient, gathered (a collective: every rank calls it), in float64."""
    wrapped = trainer.strategy.model
    if isinstance(wrapped, FullyShardedDataParallel) and not wrapped._use_orig_params:
        # Flat parameters: summon_full_params cannot bring their gradients; the shards are equal-sized (padded with
        # zeros), so gather them whole.
        shards = [p.grad.reshape(-1) for group in trainer.optimizers[0].param_groups for p in group["params"]]
        local = torch.cat(shards)
        gathered = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(gathered, local)
        return float(torch.linalg.vector_norm(torch.cat(gathered).double()))
    if isinstance(wrapped, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(wrapped, writeback=False, with_grads=True):
            grads = [p.grad for p in module.parameters() if p.grad is not None]
            return float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads])))
    # DDP: every rank holds the whole gradient, in the optimizer's parameters (the FP32 masters with master weights).
    params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads])))


def plugin_scale(plugin: Any) -> float | None:
    if isinstance(plugin, MixedPrecisionPlugin):
        return None if plugin.scaler is None else plugin.scaler.get_scale()
    return plugin.scale if getattr(plugin, "policy", None) is not None else None


class StepRecorder(pl.Callback):
    """Per optimizer step: the skip decision, the scale, the plugin's norm and the full-gradient norm."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._reference: float | None = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._reference = full_grad_norm(trainer, pl_module)  # after unscaling, before clipping

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        plugin = trainer.precision_plugin
        self.steps.append(
            {
                "skipped": plugin.last_step_skipped,  # type: ignore[attr-defined]
                "scale": plugin_scale(plugin),
                "grad_norm": plugin.last_grad_norm,  # type: ignore[attr-defined]
                "full_norm": self._reference,
            }
        )


class SeenGrads(pl.Callback):
    """The local gradient shards at ``optimizer.step`` (after clipping): what the optimizer is handed."""

    def __init__(self) -> None:
        self.seen: list[list[Tensor]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0]
        step = optimizer.step

        def recording_step(*args: Any, **kwargs: Any) -> Any:
            self.seen.append(
                [
                    local_view(p.grad).detach().clone()
                    for g in optimizer.param_groups
                    for p in g["params"]
                    if p.grad is not None
                ]
            )
            return step(*args, **kwargs)

        optimizer.step = recording_step  # type: ignore[method-assign]


def make_model(name: str, seed: int = 0, policy: MixedPrecisionPolicy | None = None, **kwargs: Any) -> StepData:
    torch.manual_seed(seed)
    if name == "model_parallel":
        return ShardedStepData(mp_policy=policy, **kwargs)
    return StepData(**kwargs)


def ours(precision: str, **kwargs: Any) -> MixedPrecisionPlugin:
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2) if precision == "16-mixed" else None
    return MixedPrecisionPlugin(precision, device="cpu", scaler=scaler, **kwargs)  # type: ignore[arg-type]


def proto(name: str, precision: str, **kwargs: Any) -> Any:
    if name == "fsdp":
        return ProtoFSDPPrecision(precision, **kwargs)  # type: ignore[arg-type]
    return ProtoModelParallelPrecision(precision, **kwargs)  # type: ignore[arg-type]


def recorded(name: str, plugin: Any, model: StepData, **kwargs: Any) -> dict[str, Any]:
    recorder = StepRecorder()
    trainer, model = fit(name, plugin=plugin, model=model, callbacks=[recorder, *kwargs.pop("callbacks", [])], **kwargs)
    return {
        "steps": recorder.steps,
        "params": full_parameters(trainer, model),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "global_step": trainer.global_step,
        "scaler": type(trainer.scaler).__name__,
    }


# ---------------------------------------------------------------------------------------------- scenarios
class TracingFSDPPrecision(FSDPPrecision):
    """Lightning's FSDPPrecision, noting each hook Lightning calls on it."""

    HOOKS = (
        "convert_module",
        "tensor_init_context",
        "module_init_context",
        "forward_context",
        "convert_input",
        "convert_output",
        "connect",
        "pre_backward",
        "backward",
        "post_backward",
        "optimizer_step",
        "clip_gradients",
        "clip_grad_by_value",
        "clip_grad_by_norm",
        "state_dict",
        "load_state_dict",
        "teardown",
    )

    def __init__(self, precision: Any) -> None:
        super().__init__(precision)
        self.calls: list[str] = []
        for hook in self.HOOKS:
            method = getattr(self, hook)
            setattr(self, hook, self._noting(hook, method))

    def _noting(self, hook: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def noted(*args: Any, **kwargs: Any) -> Any:
            if not self.calls or self.calls[-1] != hook:
                self.calls.append(hook)
            return method(*args, **kwargs)

        return noted

    @property
    def mixed_precision_config(self) -> Any:  # type: ignore[override]
        self.calls.append("mixed_precision_config")
        return super().mixed_precision_config


def driven(out: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    plugin = TracingFSDPPrecision("bf16-mixed")
    fit("fsdp", plugin=plugin, steps=2, gradient_clip_val=0.5, gradient_clip_algorithm="value")
    results["calls"] = plugin.calls
    context = FSDPPrecision("bf16-mixed").forward_context()
    results["forward_context"] = f"{type(context).__name__}(device={context.device!r}, dtype={context.fast_dtype})"
    fp16 = FSDPPrecision("16-mixed")
    results["sharded_grad_scaler"] = {
        "type": type(fp16.scaler).__name__,
        "device": fp16.scaler._device,  # type: ignore[union-attr]
        "enabled": fp16.scaler.is_enabled(),  # type: ignore[union-attr]
    }
    try:
        fit("fsdp", precision="bf16-mixed", steps=1, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        results["clip_by_norm"] = None
    except MisconfigurationException as error:
        results["clip_by_norm"] = str(error)
    return results


def vs_ddp(out: Path) -> dict[str, Any]:
    results = {}
    for precision in ("16-mixed", "bf16-mixed"):
        model = make_model("ddp", fault_steps=(FAULT_STEP,))
        results[f"ddp/{precision}"] = recorded("ddp", ours(precision), model)
        for name in ("fsdp", "model_parallel"):
            model = make_model(name, fault_steps=(FAULT_STEP,))
            results[f"{name}/{precision}"] = recorded(name, proto(name, precision), model)
    return results


def master_weights(out: Path) -> dict[str, Any]:
    results = {}
    for precision in ("16-mixed", "bf16-mixed"):
        half = HALF[precision]
        model = make_model("ddp", fault_steps=(FAULT_STEP,))
        results[f"ddp/{precision}"] = recorded("ddp", ours(precision, master_weights=True), model)
        model = make_model("fsdp", fault_steps=(FAULT_STEP,))
        results[f"fsdp/{precision}"] = recorded("fsdp", proto("fsdp", precision, master_weights=True), model)
        policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
        model = make_model("model_parallel", policy=policy, fault_steps=(FAULT_STEP,))
        results[f"model_parallel/{precision}"] = recorded("model_parallel", proto("model_parallel", precision), model)
    return results


def clipping(out: Path) -> dict[str, Any]:
    results = {}
    for name in ("fsdp", "model_parallel"):
        for algorithm, value in (("norm", 0.05), ("value", 0.02)):
            seen = SeenGrads()
            record = recorded(
                name,
                proto(name, "bf16-mixed"),
                make_model(name),
                callbacks=[seen],
                gradient_clip_val=value,
                gradient_clip_algorithm=algorithm,
            )
            record["seen"] = seen.seen
            results[f"{name}/{algorithm}"] = record
    return results


def flat_params(out: Path) -> dict[str, Any]:
    class FlatParamModel(StepData):
        def configure_optimizers(self) -> Any:
            # use_orig_params=False: the optimizer must hold the FSDP wrapper's flat parameters.
            return torch.optim.SGD(self.trainer.model.parameters(), lr=self.lr)

    torch.manual_seed(0)
    model = FlatParamModel(fault_steps=(FAULT_STEP,))
    seen = SeenGrads()
    record = recorded(
        "fsdp", proto("fsdp", "16-mixed"), model, strategy=CPUFSDPStrategy(use_orig_params=False), callbacks=[seen]
    )
    record["seen_shapes"] = [tuple(g.shape) for g in seen.seen[0]]
    return record


def checkpoints(out: Path) -> dict[str, Any]:
    """Adam, fp16, faults at steps 1 and 5: 8 steps straight; 4 steps, a checkpoint, a resume (other seed) to 8."""
    faults = (FAULT_STEP, 5)
    layouts: dict[str, tuple[str, Callable[[], Any]]] = {
        "fsdp/full": ("fsdp", lambda: CPUFSDPStrategy(state_dict_type="full")),
        "fsdp/sharded": ("fsdp", lambda: CPUFSDPStrategy(state_dict_type="sharded")),
        "model_parallel/full": (
            "model_parallel",
            lambda: ModelParallelStrategy(WORLD, 1, save_distributed_checkpoint=False),
        ),
        "model_parallel/sharded": (
            "model_parallel",
            lambda: ModelParallelStrategy(WORLD, 1, save_distributed_checkpoint=True),
        ),
    }
    results = {}
    for tag, (name, strategy) in layouts.items():
        straight = recorded(
            name,
            proto(name, "16-mixed"),
            make_model(name, optimizer="adam", fault_steps=faults),
            steps=8,
            strategy=strategy(),
        )
        path = out / tag.replace("/", "_")
        first, _ = fit(
            name,
            plugin=proto(name, "16-mixed"),
            model=make_model(name, optimizer="adam", fault_steps=faults),
            steps=4,
            strategy=strategy(),
        )
        first.save_checkpoint(path)
        resumed = recorded(
            name,
            proto(name, "16-mixed"),
            make_model(name, seed=1, optimizer="adam", fault_steps=faults),
            steps=8,
            strategy=strategy(),
            ckpt_path=path,
        )
        saved = torch.load(path / "meta.pt" if path.is_dir() else path, weights_only=True, map_location="cpu")
        results[tag] = {
            "straight": straight,
            "resumed": resumed,
            "is_dir": path.is_dir(),
            "files": sorted(p.name for p in path.iterdir()) if path.is_dir() else [path.name],
            "plugin_state": saved.get(type(first.precision_plugin).__qualname__),
            "top_keys": sorted(saved),
        }
    return results


SCENARIOS = {
    "driven": driven,
    "vs_ddp": vs_ddp,
    "master_weights": master_weights,
    "clipping": clipping,
    "flat_params": flat_params,
    "checkpoints": checkpoints,
}


# ---------------------------------------------------------------------------------------------- checks
def max_abs(a: list[Tensor], b: list[Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def check(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    d0, _ = scenario(ranks, "driven")
    table["FSDPPrecision hooks called (fit, clip by value)"] = " > ".join(d0["calls"])
    table["FSDPPrecision('bf16-mixed').forward_context()"] = d0["forward_context"]
    table["FSDPPrecision('16-mixed').scaler on CPU"] = d0["sharded_grad_scaler"]
    table["FSDPPrecision clip by norm"] = d0["clip_by_norm"]
    assert d0["clip_by_norm"] and "not supported" in d0["clip_by_norm"]
    assert "mixed_precision_config" in d0["calls"] and "optimizer_step" in d0["calls"]

    records = scenario(ranks, "vs_ddp")
    for precision in ("16-mixed", "bf16-mixed"):
        for name in ("fsdp", "model_parallel"):
            for rank, record in enumerate(records):
                ddp, sharded = record[f"ddp/{precision}"], record[f"{name}/{precision}"]
                skipped = [s["skipped"] for s in sharded["steps"]]
                assert skipped == [s == FAULT_STEP for s in range(STEPS)], (name, precision, rank, skipped)
                assert skipped == [s["skipped"] for s in ddp["steps"]]
                assert [s["scale"] for s in sharded["steps"]] == [s["scale"] for s in ddp["steps"]]
                assert all(bool(torch.isfinite(p).all()) for p in sharded["params"])
                clean = [i for i in range(STEPS) if i != FAULT_STEP]
                norm_vs_full = max(
                    rel(sharded["steps"][i]["grad_norm"], sharded["steps"][i]["full_norm"]) for i in clean
                )
                norm_vs_ddp = max(rel(sharded["steps"][i]["grad_norm"], ddp["steps"][i]["grad_norm"]) for i in clean)
                assert norm_vs_full < 1e-6 and math.isinf(sharded["steps"][FAULT_STEP]["grad_norm"])
                if rank == 0:
                    table[f"{name} {precision}: norm vs full gradient (max rel)"] = norm_vs_full
                    table[f"{name} {precision}: norm vs DDP+ours (max rel)"] = norm_vs_ddp
                    table[f"{name} {precision}: params vs DDP+ours (max abs)"] = max_abs(
                        sharded["params"], ddp["params"]
                    )
            assert records[0][f"{name}/{precision}"]["steps"] == records[1][f"{name}/{precision}"]["steps"]

    records = scenario(ranks, "master_weights")
    for precision in ("16-mixed", "bf16-mixed"):
        for name in ("fsdp", "model_parallel"):
            record = records[0]
            ddp, sharded = record[f"ddp/{precision}"], record[f"{name}/{precision}"]
            assert sharded["param_dtypes"] == ["torch.float32"]  # the sharded parameters are FP32: the masters
            assert [s["skipped"] for s in sharded["steps"]] == [s == FAULT_STEP for s in range(STEPS)]
            table[f"{name} {precision} + half params: params vs DDP+ours master weights (max abs)"] = max_abs(
                sharded["params"], ddp["params"]
            )

    records = scenario(ranks, "clipping")
    for name in ("fsdp", "model_parallel"):
        by_norm = [r[f"{name}/norm"]["seen"] for r in records]
        for step in range(STEPS):
            squared = sum(float(g.double().square().sum()) for rank_seen in by_norm for g in rank_seen[step])
            table.setdefault(f"{name}: clip by norm 0.05, global norm seen by the optimizer", []).append(
                round(math.sqrt(squared), 6)
            )
        assert all(abs(v - 0.05) < 1e-6 for v in table[f"{name}: clip by norm 0.05, global norm seen by the optimizer"])
        by_value = [r[f"{name}/value"]["seen"] for r in records]
        largest = max(float(g.abs().max()) for rank_seen in by_value for step in rank_seen for g in step if g.numel())
        table[f"{name}: clip by value 0.02, largest |g| seen"] = largest
        assert largest <= 0.02

    flat = scenario(ranks, "flat_params")
    table["fsdp use_orig_params=False: optimizer grads (shapes per rank)"] = [r["seen_shapes"] for r in flat]
    assert [s["skipped"] for s in flat[0]["steps"]] == [s == FAULT_STEP for s in range(STEPS)]
    clean = [i for i in range(STEPS) if i != FAULT_STEP]
    table["fsdp use_orig_params=False: norm vs full gradient (max rel)"] = max(
        rel(flat[0]["steps"][i]["grad_norm"], flat[0]["steps"][i]["full_norm"]) for i in clean
    )

    records = scenario(ranks, "checkpoints")
    for tag in records[0]:
        for record in records:
            straight, resumed = record[tag]["straight"], record[tag]["resumed"]
            assert resumed["global_step"] == straight["global_step"] == 8
            torch.testing.assert_close(resumed["params"], straight["params"], rtol=0, atol=0)
            assert resumed["steps"] == straight["steps"][4:], tag
        r0 = records[0][tag]
        table[f"checkpoint {tag}: layout"] = r0["files"]
        table[f"checkpoint {tag}: plugin state saved"] = r0["plugin_state"]
        assert r0["plugin_state"] is not None and r0["plugin_state"]["skipped_steps"] == 1
    return table


def main() -> int:
    out = Path(tempfile.mkdtemp(prefix="lightning_sharded_"))
    table = check(run_pool(SCENARIOS, out))
    width = max(len(k) for k in table)
    for key, value in table.items():
        print(f"{key:<{width}}  {value:.3g}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
