"""``MixedPrecisionPlugin`` under DDP on CPU: 2 processes over gloo.

Starting processes costs seconds, so most checks share ONE pair of worker processes. The module-scoped fixture
``ranks`` launches them as ``torchrun`` would (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``MASTER_*`` in the
environment, so Lightning's ``strategy="ddp"`` runs inside them instead of launching its own), and each worker runs
every scenario of :data:`SCENARIOS` in turn, each a fresh ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``
fit, then saves what it recorded to a file per rank. The tests compare the two ranks' records. One more test runs
``strategy="ddp_spawn"`` end to end, because that path pickles the plugin into fresh processes.

What a rank records (:class:`Recorder`): per optimizer step the skip decision, the loss scale, the gradient norm, the
overflowing parameters it saw itself, and the weights before and after the step; and every gradient bucket DDP
all-reduced (dtype and bytes), seen by a communication hook (with master weights, whose half-precision communication
hook the plugin registers, by the all-reduces that hook makes).
"""

from __future__ import annotations

import atexit
import contextlib
import io
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from helpers import (
    FP16_ON_CPU_WARNING,
    HALF,
    INF,
    PRECISIONS,
    TinyRegressor,
    loader,
    make_net,
    make_trainer,
    mse,
    step_batch,
)
from launch import WORLD, destroy_process_group, free_port, run_pool, scenario
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import FSDPStrategy
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionMonitor, MixedPrecisionPlugin, SpikeGuard
from lightning_amp_plus.step import sharding as step_sharding
from lightning_amp_plus.step.engine import StepResult

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings(FP16_ON_CPU_WARNING),
    # The resumed runs take their batches from the step number, not the loader (see RankData).
    pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable.*"),
]

FAULT_RANK = 1
FAULT_STEP = 3
STEPS = 8
MODES = [(precision, master_weights) for precision in PRECISIONS for master_weights in (False, True)]
N_PARAMS = sum(p.numel() for p in make_net().parameters())


# ------------------------------------------------------------------------------------------------ the model
class RankData(TinyRegressor):
    """TinyRegressor (Adam) whose batches depend only on the step, the micro-batch and the rank.

    The ranks see different data, so their local gradients differ and DDP's all-reduce matters; a resumed run sees
    the same batches as an uninterrupted one whatever the loader's position. At ``fault_steps`` one layer's gradient
    on rank ``FAULT_RANK`` only is set to inf *after* DDP has all-reduced it (``on_after_backward``): the other rank's
    gradients stay finite, so only the plugin's reduction of the overflow flag can make it skip too.
    """

    def __init__(self, fault_steps: Iterable[int] = (FAULT_STEP,)) -> None:
        super().__init__(optimizer="adam", lr=0.01)
        self.fault_steps = set(fault_steps)
        self._micro_batches: Counter[int] = Counter()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        step = self.trainer.global_step
        micro = self._micro_batches[step]  # 0, 1, ... under gradient accumulation
        self._micro_batches[step] += 1
        return mse(self.net, step_batch((step * WORLD + self.global_rank) * 2 + micro))

    def on_after_backward(self) -> None:
        if self.global_rank == FAULT_RANK and self.trainer.global_step in self.fault_steps:
            self.net[2].weight.grad[0, 0] = INF


def our_plugin(precision: str, master_weights: bool, **kwargs: Any) -> MixedPrecisionPlugin:
    # A start scale of 2**10 keeps the tiny model clear of natural fp16 overflows (the only skips are the injected
    # ones), and growth every 2 clean steps keeps the scale moving, so equal scales on both ranks mean something.
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2) if precision == "16-mixed" else None
    return MixedPrecisionPlugin(precision, device="cpu", scaler=scaler, master_weights=master_weights, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- recording
def recording_allreduce(buckets: list[tuple[str, int]], bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """A DDP communication hook: note the bucket's dtype and bytes, then all-reduce it as DDP does by default."""
    buffer = bucket.buffer()
    buckets.append((str(buffer.dtype), buffer.numel() * buffer.element_size()))
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default process group


# DDP compares a hook's annotations with the real objects; `from __future__ import annotations` made them strings.
recording_allreduce.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]})


def weights(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, list[Tensor]]:
    """The module's parameters, and what the optimizer steps (with master weights too: the same FP32 tensors)."""
    return {
        "params": [p.detach().clone() for p in module.parameters()],
        "masters": [p.detach().clone() for g in trainer.optimizers[0].param_groups for p in g["params"]],
    }


class HalfAllReduces:
    """Records the half-precision all-reduces of the plugin's DDP communication hook (dtype and bytes)."""

    def __init__(self, buckets: list[tuple[str, int]]) -> None:
        self.buckets = buckets
        self.original = dist.all_reduce

    def __call__(self, tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.dtype in (torch.float16, torch.bfloat16):  # not the scaler's float32 overflow flag
            self.buckets.append((str(tensor.dtype), tensor.numel() * tensor.element_size()))
        return self.original(tensor, *args, **kwargs)


class Recorder(pl.Callback):
    """What this rank saw: per batch the skip decision, scale, norm and weights; the all-reduced buckets.

    Args:
        save_to: under ``ddp_spawn``, a folder to write this rank's record to at the end of fit (``rank{r}.pt``): the
            callback object in the launching process is a stale copy.
    """

    def __init__(self, save_to: Path | None = None) -> None:
        self.save_to = save_to
        self.batches: list[dict[str, Any]] = []
        self.buckets: list[tuple[str, int]] = []
        self.start: dict[str, Any] = {}
        self._before: dict[str, list[Tensor]] = {}
        self._recording: HalfAllReduces | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        assert isinstance(plugin, MixedPrecisionPlugin)
        self.start = {
            **weights(trainer, pl_module),
            "state_dict": {k: v.clone() for k, v in pl_module.state_dict().items()},
            "global_step": trainer.global_step,
            "skipped_steps": plugin.skipped_steps,
            "scale": None if plugin.scaler is None else plugin.scaler.get_scale(),
        }
        # This callback reads each step's norm, so it asks for it as a monitor does, in half the modes: the other half
        # checks in GradScaler's one pass, no norm. Both flags are reduced across ranks.
        if plugin.settings.master_weights:
            plugin.engine.read_norms()
        if plugin.settings.master_weights:
            # The plugin has registered its half-precision hook (DDP takes one): watch the all-reduces it makes.
            self._recording = HalfAllReduces(self.buckets)
            dist.all_reduce = self._recording  # type: ignore[assignment]
        elif isinstance(trainer.strategy.model, DistributedDataParallel):
            # Lightning registers `DDPStrategy(ddp_comm_hook=...)` on CUDA only, so register it here (before the first
            # backward, as DDP requires).
            trainer.strategy.model.register_comm_hook(self.buckets, recording_allreduce)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._recording is not None:
            dist.all_reduce = self._recording.original
            self._recording = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._before = weights(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        plugin = trainer.precision_plugin
        assert isinstance(plugin, MixedPrecisionPlugin)
        last = plugin.recent_steps[-1] if plugin.recent_steps else StepResult(skipped=False)  # none: accumulating
        self.batches.append(
            {
                "global_step": trainer.global_step,  # after the batch: a skipped step counts too
                "skipped": last.skipped,
                "scale": None if plugin.scaler is None else plugin.scaler.get_scale(),
                "grad_norm": last.grad_norm,
                "overflow_params": last.overflow_params,
                "before": self._before,
                "after": weights(trainer, pl_module),
            }
        )

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_to is not None:
            torch.save(self.result(trainer, pl_module), self.save_to / f"rank{trainer.global_rank}.pt")

    def result(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        plugin = trainer.precision_plugin
        assert isinstance(plugin, MixedPrecisionPlugin)
        return {
            "batches": self.batches,
            "buckets": self.buckets,
            "start": self.start,
            "final": weights(trainer, pl_module),
            "dtypes": [str(p.dtype) for p in pl_module.parameters()],
            "skipped_steps": plugin.skipped_steps,
            "global_step": trainer.global_step,
            "measured": plugin.engine.norms_read,
        }


class DestroyProcessGroupAtExit(pl.Callback):
    """In each ``ddp_spawn`` worker, destroy the process group when the worker's interpreter exits.

    Lightning registers that at exit for NCCL only; with gloo a worker that exits right after its last collective
    sometimes dies with SIGABRT while the interpreter finalizes (see :func:`launch.destroy_process_group`): 3 plain
    ``ddp_spawn`` fits in about 100 on this 2-core machine. ``setup`` runs in the workers only, after the group exists.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        atexit.register(destroy_process_group)


# ----------------------------------------------------------------------------------------- the scenarios
def ddp_fit(
    model: pl.LightningModule,
    plugin: MixedPrecisionPlugin,
    steps: int,
    callbacks: Iterable[pl.Callback] = (),
    ckpt_path: Path | None = None,
    **kwargs: Any,
) -> pl.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": WORLD,
        "strategy": "ddp",
        "plugins": [plugin],
        "max_steps": steps,
        "max_epochs": -1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": list(callbacks),
    }
    settings.update(kwargs)
    trainer = pl.Trainer(**settings)
    # The batches come from RankData.training_step; the loader only sets the pace (16 batches per rank and epoch).
    trainer.fit(model, loader(n=WORLD * 16 * 8, batch_size=8), ckpt_path=ckpt_path)
    return trainer


def recorded_fit(model: pl.LightningModule, plugin: MixedPrecisionPlugin, steps: int, **kwargs: Any) -> dict[str, Any]:
    recorder = Recorder()
    trainer = ddp_fit(model, plugin, steps, callbacks=[recorder], **kwargs)
    return recorder.result(trainer, model)


def each_mode(out: Path) -> dict[str, Any]:
    """Every (precision, master_weights) mode, with an overflow on rank 1 only at FAULT_STEP."""
    results = {}
    for precision, master_weights in MODES:
        torch.manual_seed(0)
        results[f"{precision}/{master_weights}"] = recorded_fit(
            RankData(), our_plugin(precision, master_weights), STEPS
        )
    return results


def without_the_reduction(out: Path) -> dict[str, Any]:
    """The same fault with the overflow flag NOT reduced across ranks: what the feature prevents."""
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_sharding, "max_across_ranks", lambda norm, group: norm)
        return recorded_fit(RankData(), our_plugin("bf16-mixed", False), FAULT_STEP + 2)


def accumulation(out: Path) -> dict[str, Any]:
    """Master weights with accumulate_grad_batches=2 (DDP skips the all-reduce of the first micro-batch: no_sync)."""
    results = {}
    for precision in PRECISIONS:
        torch.manual_seed(0)
        results[precision] = recorded_fit(
            RankData(fault_steps=()), our_plugin(precision, True), 4, accumulate_grad_batches=2
        )
    return results


def checkpoints(out: Path) -> dict[str, Any]:
    """fp16 + master weights: 12 steps straight; 6 steps, a checkpoint by rank 0, and a 2-rank resume to 12."""
    faults = (FAULT_STEP, 9)  # one skip before the checkpoint, one after it
    torch.manual_seed(0)
    straight = recorded_fit(RankData(faults), our_plugin("16-mixed", True), 12)
    torch.manual_seed(0)
    path = out / "two_ranks.ckpt"
    first = ddp_fit(RankData(faults), our_plugin("16-mixed", True), 6)
    first.save_checkpoint(path)  # every rank calls it; rank 0 writes
    torch.manual_seed(1)  # a different initialisation: the checkpoint must overwrite it
    resumed = recorded_fit(RankData(faults), our_plugin("16-mixed", True), 12, ckpt_path=path)
    return {"straight": straight, "resumed": resumed, "path": str(path)}


def monitor(out: Path) -> dict[str, Any]:
    """MixedPrecisionMonitor with a CSVLogger, the overflow on rank 1 only."""
    torch.manual_seed(0)
    callback = MixedPrecisionMonitor()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ddp_fit(
            RankData(),
            our_plugin("16-mixed", False),
            6,
            callbacks=[callback],
            logger=CSVLogger(out, name="monitor", version=0),
            log_every_n_steps=1,
        )
    return {
        "printed": printed.getvalue(),
        "skipped": [record.skipped for record in callback.history.steps],
        "log_dir": str(out / "monitor"),
    }


class SpikeOnOneRank(RankData):
    """RankData whose loss on rank ``FAULT_RANK`` only is 10x at ``SPIKE_STEP``: DDP averages it into every rank's
    gradients (a finite spike, no overflow)."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        spike = self.global_rank == FAULT_RANK and self.trainer.global_step == SPIKE_STEP
        return loss * 10.0 if spike else loss


SPIKE_STEP = 6


def spikes(out: Path) -> dict[str, Any]:
    """The spike guard ("skip" and "clip") with a spike in one rank's batch, in fp16 and bf16."""
    results = {}
    for precision in PRECISIONS:
        for action in ("skip", "clip"):
            torch.manual_seed(0)
            guard = SpikeGuard(warmup=4, action=action)  # type: ignore[arg-type]
            # The scale held at 2**10: grown, the spike's scaled fp16 gradients would overflow (not a spike then).
            scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=10_000) if precision == "16-mixed" else None
            plugin = MixedPrecisionPlugin(precision, device="cpu", scaler=scaler, spike_guard=guard)  # type: ignore[arg-type]
            record = recorded_fit(SpikeOnOneRank(fault_steps=()), plugin, STEPS + 2)
            record["verdicts"] = [r.spike_verdict for r in plugin.recent_steps]
            record["guard"] = guard.state_dict()
            results[f"{precision}/{action}"] = record
    return results


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "spikes": spikes,
    "modes": each_mode,
    "unreduced": without_the_reduction,
    "accumulation": accumulation,
    "checkpoints": checkpoints,
    "monitor": monitor,
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_pool(SCENARIOS, tmp_path_factory.mktemp("ddp"))


# ----------------------------------------------------------------------------------------------- assertions
def assert_same_on_every_rank(records: tuple[dict[str, Any], ...]) -> None:
    """One skip decision, one scale, one measured norm on every rank at every step; bit-identical replicas."""
    first, *others = records
    for other in others:
        for key in ("skipped", "scale", "grad_norm", "global_step"):
            assert [b[key] for b in other["batches"]] == [b[key] for b in first["batches"]], key
        # Bit for bit: the replicas must not drift by even one rounding.
        torch.testing.assert_close(other["final"], first["final"], rtol=0, atol=0)
        assert other["skipped_steps"] == first["skipped_steps"]


def assert_fault_skipped_everywhere(records: tuple[dict[str, Any], ...], steps: int) -> None:
    """The overflow seen by FAULT_RANK alone skipped the step on every rank, and only that step."""
    for rank, record in enumerate(records):
        assert [b["skipped"] for b in record["batches"]] == [step == FAULT_STEP for step in range(steps)], rank
        fault = record["batches"][FAULT_STEP]
        # Each rank names only what it saw itself: rank 0's own gradients were finite, and it skipped anyway.
        assert fault["overflow_params"] == (["net.2.weight"] if rank == FAULT_RANK else []), rank
        assert fault["grad_norm"] == (INF if record["measured"] else None), rank  # the MAX of the ranks' norms
        # Untouched on the skipped step (weights and masters), updated on the others.
        torch.testing.assert_close(fault["after"], fault["before"], rtol=0, atol=0)
        assert not torch.equal(record["batches"][FAULT_STEP + 1]["after"]["params"][0], fault["after"]["params"][0])


# -------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize(("precision", "master_weights"), MODES)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank_and_the_replicas_stay_bit_identical(
    ranks: list[dict[str, Any]], precision: str, master_weights: bool
) -> None:
    (modes, *others) = scenario(ranks, "modes")
    records = tuple(m[f"{precision}/{master_weights}"] for m in (modes, *others))
    assert_same_on_every_rank(records)
    assert_fault_skipped_everywhere(records, STEPS)
    record = records[0]
    assert record["global_step"] == STEPS and record["skipped_steps"] == 1
    if precision == "16-mixed":
        # The scale grows every 2 clean steps and backs off at the fault, the same on both ranks (checked above): a
        # rank that stepped instead would have grown its scale and diverged.
        scales = [b["scale"] for b in record["batches"]]
        assert scales == [1024.0, 2048.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0, 4096.0]
    # In every mode the model holds FP32 weights, and they are what the optimizer steps.
    assert set(record["dtypes"]) == {"torch.float32"}
    torch.testing.assert_close(record["final"]["params"], record["final"]["masters"], rtol=0, atol=0)


def test_without_the_reduction_of_the_overflow_flag_only_the_faulty_rank_skips_and_the_replicas_diverge(
    ranks: list[dict[str, Any]],
) -> None:
    """The negative control of the test above: the MAX across ranks patched to the identity in the workers."""
    rank0, rank1 = scenario(ranks, "unreduced")
    assert [b["skipped"] for b in rank0["batches"]] == [False] * (FAULT_STEP + 2)
    assert [b["skipped"] for b in rank1["batches"]] == [step == FAULT_STEP for step in range(FAULT_STEP + 2)]
    assert not all(torch.equal(a, b) for a, b in zip(rank0["final"]["params"], rank1["final"]["params"], strict=True))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_master_weights_halve_the_bytes_ddp_all_reduces_gradients_in_the_half_dtype(
    ranks: list[dict[str, Any]], precision: str
) -> None:
    modes = scenario(ranks, "modes")
    for rank_modes in modes:
        fp32_buckets = rank_modes[f"{precision}/False"]["buckets"]
        half_buckets = rank_modes[f"{precision}/True"]["buckets"]
        # Without master weights the model is FP32 under autocast: its gradients, and the buckets, are FP32.
        assert {dtype for dtype, _ in fp32_buckets} == {"torch.float32"}
        assert {dtype for dtype, _ in half_buckets} == {str(HALF[precision])}
        # Every parameter's gradient once per step (the skipped step's too: the all-reduce runs in backward).
        assert sum(n for _, n in fp32_buckets) == STEPS * N_PARAMS * 4
        assert sum(n for _, n in half_buckets) == STEPS * N_PARAMS * 2


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gradient_accumulation_with_master_weights_all_reduces_once_per_step_and_keeps_ranks_identical(
    ranks: list[dict[str, Any]], precision: str
) -> None:
    records = tuple(r[precision] for r in scenario(ranks, "accumulation"))
    assert_same_on_every_rank(records)
    for record in records:
        assert record["global_step"] == 4 and len(record["batches"]) == 8 and record["skipped_steps"] == 0
        # One half-dtype all-reduce per optimizer step: the accumulating micro-batch ran under DDP's no_sync.
        assert {dtype for dtype, _ in record["buckets"]} == {str(HALF[precision])}
        assert sum(n for _, n in record["buckets"]) == 4 * N_PARAMS * 2
        # Every optimizer step moved the masters (the accumulating micro-batches leave them alone).
        for index, batch in enumerate(record["batches"]):
            moved = not torch.equal(batch["after"]["masters"][0], batch["before"]["masters"][0])
            assert moved == (index % 2 == 1), index
        assert set(record["dtypes"]) == {"torch.float32"}


def test_a_checkpoint_written_by_rank_zero_resumes_on_two_ranks_exactly_as_the_uninterrupted_run(
    ranks: list[dict[str, Any]],
) -> None:
    records = scenario(ranks, "checkpoints")
    checkpoint = torch.load(records[0]["path"], weights_only=True)
    saved = checkpoint["state_dict"]
    assert all(value.dtype == torch.float32 for value in saved.values())  # the FP32 masters, not the fp16 model
    for record in records:
        straight, resumed = record["straight"], record["resumed"]
        # Loaded exactly: the masters (and the module's state_dict, which returns them) are the checkpoint's.
        start = resumed["start"]
        assert start["global_step"] == 6 and start["skipped_steps"] == 1
        torch.testing.assert_close(start["masters"], list(saved.values()), rtol=0, atol=0)
        torch.testing.assert_close(start["state_dict"], saved, rtol=0, atol=0)
        assert start["scale"] == checkpoint["MixedPrecisionPlugin"]["scaler"]["scale"]
        # Same arithmetic on the same batches: the resumed run ends bit for bit where the uninterrupted one does.
        torch.testing.assert_close(resumed["final"], straight["final"], rtol=0, atol=0)
        assert resumed["skipped_steps"] == straight["skipped_steps"] == 2
        assert [b["scale"] for b in resumed["batches"]] == [b["scale"] for b in straight["batches"]][6:]
    assert_same_on_every_rank(tuple(record["resumed"] for record in records))


def test_a_checkpoint_written_by_two_ranks_resumes_in_one_process(ranks: list[dict[str, Any]]) -> None:
    path = Path(scenario(ranks, "checkpoints")[0]["path"])
    checkpoint = torch.load(path, weights_only=True)
    saved = checkpoint["state_dict"]
    recorder = Recorder()
    model = RankData(fault_steps=())
    trainer = make_trainer(our_plugin("16-mixed", True), max_steps=12, max_epochs=-1, callbacks=[recorder])
    trainer.fit(model, loader(n=16 * 8, batch_size=8), ckpt_path=path)
    start = recorder.start
    # The arithmetic differs from 2 ranks (one process averages nothing), so compare the loaded state, exactly.
    torch.testing.assert_close(start["masters"], list(saved.values()), rtol=0, atol=0)
    torch.testing.assert_close(start["state_dict"], saved, rtol=0, atol=0)
    torch.testing.assert_close(start["params"], list(saved.values()), rtol=0, atol=0)  # FP32 between steps
    assert start["skipped_steps"] == 1 and start["scale"] == checkpoint["MixedPrecisionPlugin"]["scaler"]["scale"]
    # And it trains on: 6 more steps, each applied, every weight finite.
    assert trainer.global_step == 12 and [b["skipped"] for b in recorder.batches] == [False] * 6
    assert all(not torch.equal(b["after"]["masters"][0], b["before"]["masters"][0]) for b in recorder.batches)
    assert all(torch.isfinite(m).all() for m in recorder.result(trainer, model)["final"]["masters"])


def test_the_monitor_logs_and_prints_on_rank_zero_only(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = scenario(ranks, "monitor")
    # Both ranks' monitors saw the one skip (the plugin's decision is shared)...
    expected = [step == FAULT_STEP for step in range(6)]
    assert rank0["skipped"] == rank1["skipped"] == expected
    # ...but only rank 0 prints the summary and writes metrics.
    assert "MixedPrecisionMonitor: 6 optimizer steps, 1 skipped" in rank0["printed"] and rank1["printed"] == ""
    files = list(Path(rank0["log_dir"]).rglob("metrics.csv"))
    assert len(files) == 1
    rows = files[0].read_text().splitlines()
    header = rows[0].split(",")
    skipped_column = [line.split(",")[header.index("amp/step_skipped")] for line in rows[1:]]
    assert [float(value) for value in skipped_column if value] == [float(s) for s in expected]


def test_ddp_spawn_pickles_the_plugin_and_every_rank_skips_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same checks through `strategy="ddp_spawn"`: plugin, model and callbacks pickled into fresh processes."""
    # Lightning's launcher writes the rendezvous address into this process's environment: keep it to this test.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch.manual_seed(0)
    steps = FAULT_STEP + 2
    trainer = make_trainer(
        our_plugin("16-mixed", True),
        devices=WORLD,
        strategy="ddp_spawn",
        max_steps=steps,
        max_epochs=-1,
        callbacks=[Recorder(save_to=tmp_path), DestroyProcessGroupAtExit()],
    )
    model = RankData()
    trainer.fit(model, loader(n=WORLD * 16 * 8, batch_size=8))
    records = tuple(torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD))
    assert_same_on_every_rank(records)
    assert_fault_skipped_everywhere(records, steps)
    assert {dtype for r in records for dtype, _ in r["buckets"]} == {"torch.float16"}
    # The trained weights come back to this process through rank 0's `state_dict()`: the FP32 masters, exactly (the
    # model here was never converted, so it stays FP32).
    torch.testing.assert_close(list(model.parameters()), records[0]["final"]["masters"], rtol=0, atol=0)


# ----------------------------------------------------------------------------------- strategies that refuse it
def test_fsdp_accepts_only_its_own_precision_plugin() -> None:
    # On CPU Lightning refuses FSDP before it looks at the plugin...
    with pytest.raises(ValueError, match=r"strategy `fsdp` requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=2, strategy="fsdp", plugins=[MixedPrecisionPlugin("bf16-mixed")])
    # ...so check the refusal the Trainer reaches on GPU, where it hands the plugin to the strategy.
    with pytest.raises(TypeError, match=r"FSDP strategy can only work with the `FSDPPrecision` plugin"):
        FSDPStrategy(precision_plugin=MixedPrecisionPlugin("bf16-mixed"))


@pytest.mark.cuda
def test_fsdp_trainer_on_cuda_refuses_the_plugin() -> None:
    with pytest.raises(TypeError, match=r"FSDP strategy can only work with the `FSDPPrecision` plugin"):
        pl.Trainer(accelerator="cuda", devices=1, strategy="fsdp", plugins=[MixedPrecisionPlugin("bf16-mixed")])


def test_deepspeed_engines_are_refused_with_the_way_out() -> None:
    # Lightning's DeepSpeedStrategy does not check its precision plugin's type (FSDP and XLA do): the plugin refuses
    # a DeepSpeed engine itself when the strategy connects it. DeepSpeed is not installed here: a stand-in class from
    # a `deepspeed.*` module plays the engine.
    engine_class = type("DeepSpeedEngine", (torch.nn.Module,), {"__module__": "deepspeed.runtime.engine"})
    with pytest.raises(TypeError, match=r"cannot run under DeepSpeed.*strategy='deepspeed', precision="):
        MixedPrecisionPlugin("bf16-mixed").connect(engine_class(), [], [])


@pytest.mark.parametrize("action", ["skip", "clip"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_spike_in_one_ranks_batch_is_judged_alike_on_every_rank(
    ranks: list[dict[str, Any]], precision: str, action: str
) -> None:
    records = tuple(record[f"{precision}/{action}"] for record in scenario(ranks, "spikes"))
    assert_same_on_every_rank(records)
    first, second = records
    assert first["verdicts"] == second["verdicts"] and first["guard"] == second["guard"]
    flagged = [i for i, verdict in enumerate(first["verdicts"]) if verdict is not None and verdict.spike]
    assert flagged == [SPIKE_STEP]
    skipped = [i for i, batch in enumerate(first["batches"]) if batch["skipped"]]
    assert skipped == ([SPIKE_STEP] if action == "skip" else [])
