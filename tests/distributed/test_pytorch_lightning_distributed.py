"""The Trainer's plugins under ``import pytorch_lightning as pl``, on 2 CPU processes over gloo: DDP, FSDP and FSDP2.

``lightning_amp_plus.pytorch_lightning`` builds the plugins and the monitor over Lightning's standalone package, which
has its own copy of every strategy (``tests/plugins/test_pytorch_lightning_name.py`` runs them in one process). Here
they meet those copies' hooks and checkpoint layouts: one model trained by ``pytorch_lightning.Trainer`` with this
package's ``pytorch_lightning`` plugins, and by ``lightning.pytorch.Trainer`` with its ``lightning`` ones, in one pool
of worker processes (:mod:`launch`), with an inf set into rank 1's local gradient at one step, AdamW with a per-step LR
scheduler, clipping by norm and the monitor:

* under each strategy (``"ddp"``; FSDP with ``FSDPMixedPrecisionPlugin``, through the test-only CPU twin of either
  package's ``FSDPStrategy``, :func:`cpu_fsdp.cpu_fsdp_strategy`; ``ModelParallelStrategy`` with ``fully_shard`` in
  ``configure_model``) and precision, the parameters, the plugin's state, the LR and the monitor's records equal
  ``lightning``'s bit for bit;
* the inf skips the step on both ranks and holds the LR;
* a run saved at step 4 in a sharded checkpoint (FSDP's sharded state dict, FSDP2's distributed checkpoint) and resumed
  under ``pytorch_lightning`` ends where the straight run under ``lightning`` ends.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from cpu_fsdp import cpu_fsdp_strategy
from helpers import FP16_ON_CPU_WARNING, loader, make_net, mse, step_batch
from launch import WORLD, run_pool, scenario
from test_sharded import full_parameters, local_view
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

import lightning_amp_plus
from lightning_amp_plus import DynamicLossScaler

pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")
from lightning_amp_plus import pytorch_lightning as standalone

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings(FP16_ON_CPU_WARNING)]

STEPS, FAULT_STEP, FAULT_RANK, MAX_NORM, LR = 5, 2, 1, 0.05, 0.01
RESUME_STEPS, RESUME_AT, RESUME_FAULTS = 8, 4, (1, 5)
PRECISIONS = ("16-mixed", "bf16-mixed")
STRATEGIES = ("ddp", "fsdp", "model_parallel")
NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def amp_for(namespace: str) -> Any:
    """This package's names for the Trainer of ``namespace``."""
    return lightning_amp_plus if namespace == "lightning.pytorch" else standalone


def regressor(namespace: str) -> type:
    """One LightningModule, the same source over either package: its batches depend on the step and the rank only."""
    pl = importlib.import_module(namespace)

    class Regressor(pl.LightningModule):  # type: ignore[misc,name-defined]
        """Linear-ReLU-Linear on an MSE loss; AdamW with a StepLR stepped every step; FSDP2-sharded if ``sharded``.

        Args:
            sharded: shard each Linear, then the root, with ``fully_shard`` over the data-parallel mesh.
            fault_steps: at these global steps rank ``FAULT_RANK`` sets one element of its first non-empty local
                gradient to inf after the backward (and DDP's averaging, or FSDP's reduce-scatter).
        """

        def __init__(self, sharded: bool, fault_steps: tuple[int, ...]) -> None:
            super().__init__()
            self.net = make_net()
            self.sharded = sharded
            self.fault_steps = fault_steps

        def configure_model(self) -> None:
            if self.sharded:
                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    if isinstance(layer, nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self, mesh=mesh)

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            return mse(self.net, step_batch(self.trainer.global_step * WORLD + self.global_rank))

        def on_after_backward(self) -> None:
            if self.global_rank == FAULT_RANK and self.trainer.global_step in self.fault_steps:
                grad = next(local_view(p.grad) for p in self.parameters() if p.grad is not None and p.grad.numel())
                grad.view(-1)[0] = math.inf

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return Regressor


def strategy_for(namespace: str, name: str, **options: Any) -> Any:
    if name == "fsdp":
        return cpu_fsdp_strategy(namespace)(**options)
    if name == "model_parallel":
        strategies = importlib.import_module(f"{namespace}.strategies")
        # Every rank in the data-parallel dimension: FSDP2 shards over it (Lightning's default: tensor-parallel).
        return strategies.ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1, **options)
    return "ddp"


def plugin_for(namespace: str, name: str, precision: str) -> Any:
    # Growth every 2 clean steps keeps the scale moving, so equal scales mean something.
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2) if precision == "16-mixed" else None
    kind = amp_for(namespace).FSDPMixedPrecisionPlugin if name == "fsdp" else amp_for(namespace).MixedPrecisionPlugin
    return kind(precision, "cpu", scaler)


def fit(
    namespace: str,
    name: str,
    precision: str,
    steps: int,
    fault_steps: tuple[int, ...],
    *,
    seed: int = 0,
    strategy: Any = None,
    ckpt_path: Path | None = None,
) -> dict[str, Any]:
    """A 2-rank fit under ``namespace``'s Trainer; what it recorded and the whole parameters at the end."""
    pl = importlib.import_module(namespace)
    torch.manual_seed(seed)
    model = regressor(namespace)(sharded=name == "model_parallel", fault_steps=fault_steps)
    monitor = amp_for(namespace).MixedPrecisionMonitor(log_memory=False, prog_bar=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy_for(namespace, name) if strategy is None else strategy,
        plugins=[plugin_for(namespace, name, precision)],
        callbacks=[monitor],
        max_steps=steps,
        max_epochs=-1,
        gradient_clip_val=MAX_NORM,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # The batches come from training_step; the loader only sets the pace.
    trainer.fit(model, loader(n=WORLD * 16 * 8, batch_size=8), ckpt_path=ckpt_path)
    plugin = trainer.precision_plugin
    return {
        "trainer": trainer,
        "built_on": (type(trainer).__module__.split(".")[0], type(plugin).__module__),
        "params": full_parameters(trainer, model),
        "state": plugin.state_dict(),
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "steps": [(e.step, e.scale, e.skipped, e.grad_norm) for e in monitor.history.steps],
        "summary": monitor.summary(),
    }


# ---------------------------------------------------------------------------------------------- scenarios
def runs(out: Path) -> dict[str, Any]:
    """Every strategy and precision under both packages: one fault on one rank at ``FAULT_STEP``."""
    results = {}
    for namespace in NAMESPACES:
        for name in STRATEGIES:
            for precision in PRECISIONS:
                run = fit(namespace, name, precision, STEPS, (FAULT_STEP,))
                del run["trainer"]
                results[f"{namespace}/{name}/{precision}"] = run
    return results


def resumed(out: Path) -> dict[str, Any]:
    """fp16, faults before and after step 4: straight under lightning; saved at 4, resumed under pytorch_lightning."""
    results = {}
    layouts = {"fsdp": {"state_dict_type": "sharded"}, "model_parallel": {"save_distributed_checkpoint": True}}
    for name, options in layouts.items():
        straight = fit("lightning.pytorch", name, "16-mixed", RESUME_STEPS, RESUME_FAULTS)
        namespace = "pytorch_lightning"
        first = fit(
            namespace, name, "16-mixed", RESUME_AT, RESUME_FAULTS, strategy=strategy_for(namespace, name, **options)
        )
        path = out / f"{name}-step{RESUME_AT}"
        first["trainer"].save_checkpoint(path)
        again = fit(
            namespace,
            name,
            "16-mixed",
            RESUME_STEPS,
            RESUME_FAULTS,
            seed=1,  # other initial weights: the checkpoint's must replace them
            strategy=strategy_for(namespace, name, **options),
            ckpt_path=path,
        )
        del straight["trainer"], again["trainer"]  # records only: a Trainer does not leave the worker
        results[name] = {"straight": straight, "resumed": again, "files": sorted(p.name for p in path.iterdir())}
    return results


SCENARIOS = {"runs": runs, "resumed": resumed}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_pool(SCENARIOS, tmp_path_factory.mktemp("pytorch_lightning_distributed"))


# -------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_under_pytorch_lightning_the_strategy_trains_as_under_lightning_bit_for_bit(
    ranks: list[dict[str, Any]], strategy: str, precision: str
) -> None:
    module = "fsdp" if strategy == "fsdp" else "precision"
    for record in scenario(ranks, "runs"):
        mine, lightnings = (
            record[f"pytorch_lightning/{strategy}/{precision}"],
            record[f"lightning.pytorch/{strategy}/{precision}"],
        )
        assert mine["built_on"] == ("pytorch_lightning", f"lightning_amp_plus._standalone.plugins.{module}")
        assert lightnings["built_on"] == ("lightning", f"lightning_amp_plus.plugins.{module}")
        for p, q in zip(mine["params"], lightnings["params"], strict=True):
            assert torch.equal(p, q)
        assert mine["state"] == lightnings["state"] and mine["lr"] == lightnings["lr"]
        assert repr(mine["steps"]) == repr(lightnings["steps"])  # the fault step's norm is inf or NaN


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_under_pytorch_lightning_an_inf_on_one_rank_skips_the_step_on_every_rank_and_holds_the_lr(
    ranks: list[dict[str, Any]], strategy: str, precision: str
) -> None:
    runs = [record[f"pytorch_lightning/{strategy}/{precision}"] for record in scenario(ranks, "runs")]
    for run in runs:
        assert [(step, skipped) for step, _, skipped, _ in run["steps"]] == [(s, s == FAULT_STEP) for s in range(STEPS)]
        assert run["state"]["scaler"]["skipped_steps"] == 1
        assert run["lr"] == LR * 0.5 ** (STEPS - 1)  # StepLR stepped after every step but the skipped one
        assert all(torch.isfinite(p).all() for p in run["params"])
    for p, q in zip(runs[0]["params"], runs[1]["params"], strict=True):
        assert torch.equal(p, q)
    assert runs[0]["state"] == runs[1]["state"]


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_a_sharded_checkpoint_resumed_under_pytorch_lightning_ends_where_the_straight_run_does(
    ranks: list[dict[str, Any]], strategy: str
) -> None:
    for record in scenario(ranks, "resumed"):
        straight, again = record[strategy]["straight"], record[strategy]["resumed"]
        assert again["built_on"][0] == "pytorch_lightning" and straight["built_on"][0] == "lightning"
        for p, q in zip(again["params"], straight["params"], strict=True):
            assert torch.equal(p, q)
        assert again["state"] == straight["state"] and again["state"]["scaler"]["skipped_steps"] == len(RESUME_FAULTS)
        assert again["lr"] == straight["lr"]
        assert repr(again["steps"]) == repr(straight["steps"][RESUME_AT:])
        assert "meta.pt" in record[strategy]["files"]  # the plugin's state rides with Lightning's metadata


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_the_monitor_says_it_does_not_replay_the_skipped_steps_of_a_sharded_model(
    ranks: list[dict[str, Any]], strategy: str
) -> None:
    # Steps 1 and 5 skip at a scale earlier steps passed at: the summary says why no autopsy examined them.
    for record in scenario(ranks, "resumed"):
        for run in (record[strategy]["straight"], record[strategy]["resumed"]):
            assert (
                "not examined (the monitor's autopsy replays no step of a sharded model (FSDP, FSDP2): its forward "
                "needs every rank)"
            ) in run["summary"]
