"""Fault injection and resume, single process on CPU: inf/NaN in the loss, a gradient or an activation; a loss that
overflows at every step; a run killed and resumed; corrupt plugin state in a checkpoint.

Every run here takes its batch from the optimizer step (``FaultyRegressor.data_index``), never from the DataLoader,
which only paces the loop: Lightning does not restore a sampler's position mid-epoch, and a fault-free reference run
must see the same batches as a faulty one.
"""

from __future__ import annotations

import math
import random
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import FP16_ON_CPU_WARNING, INF, loader, make_net, make_trainer, parameters_of
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.testing import assert_close

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionMonitor, MixedPrecisionPlugin

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings(FP16_ON_CPU_WARNING),
    # Resumed runs restart the (non-resumable) DataLoader; the batches come from the step number (see above).
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended"),
    pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable.*"),
]

NAN = float("nan")


@dataclass(frozen=True)
class Mode:
    """A plugin configuration under test."""

    precision: str
    master_weights: bool


MODES = [
    pytest.param(Mode("16-mixed", False), id="fp16"),
    pytest.param(Mode("bf16-mixed", False), id="bf16"),
    pytest.param(Mode("16-mixed", True), id="fp16-master"),
    pytest.param(Mode("bf16-mixed", True), id="bf16-master"),
]


def make_plugin(mode: Mode, max_consecutive_skips: int | None = 50, **scaler_kwargs: Any) -> MixedPrecisionPlugin:
    """The plugin for ``mode``; for fp16 a scaler starting at 2**10 that does not grow unless told to.

    At the default 2**16 this model's scaled fp16 backward overflows by itself in the first steps, and the tests below
    want to see only the skips they inject.
    """
    if mode.precision == "16-mixed":
        settings = {"init_scale": 2.0**10, "growth_interval": 10_000, **scaler_kwargs}
        scaler = DynamicLossScaler(**settings, max_consecutive_skips=max_consecutive_skips)
        return MixedPrecisionPlugin("16-mixed", device="cpu", scaler=scaler, master_weights=mode.master_weights)
    return MixedPrecisionPlugin(
        "bf16-mixed", device="cpu", master_weights=mode.master_weights, max_consecutive_skips=max_consecutive_skips
    )


# ------------------------------------------------------------------------------------------------- the faulty model
@dataclass(frozen=True)
class Fault:
    """An inf or NaN put into the loss, into ``net.2.weight``'s gradient, or into the hidden activations."""

    site: str  # "loss", "grad" or "activation"
    value: float


SITES = ("loss", "grad", "activation")
TRUE_WEIGHTS = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))


def learnable_batch(index: int, batch_size: int = 8) -> tuple[Tensor, Tensor]:
    """Batch number ``index`` of a noisy linear map: a loss that training visibly lowers in a few steps."""
    generator = torch.Generator().manual_seed(2000 + index)
    x = torch.randn(batch_size, 8, generator=generator)
    return x, x @ TRUE_WEIGHTS + 0.1 * torch.randn(batch_size, 1, generator=generator)


HELD_OUT = learnable_batch(-1000, batch_size=256)


class FaultyRegressor(pl.LightningModule):
    """Linear(8,16)-ReLU-Linear(16,1) on ``learnable_batch`` data, with faults injected at chosen optimizer steps.

    Step ``t`` trains on batch ``t - (number of faults before t)``: a faulty step's batch is taken again by the next
    step, so a run with ``k`` faults and ``n + k`` steps applies exactly the ``n`` batches of a fault-free ``n``-step
    run, in the same order. The batch depends on ``trainer.global_step`` only (never on the sampler's position).

    Args:
        faults: optimizer step -> the fault injected at that step.
        optimizer: ``"adam"`` or ``"sgd"`` (with momentum 0.9, which OneCycleLR cycles).
        scheduler: ``"step"`` (StepLR(step_size=2, gamma=0.7)) or ``"onecycle"`` (OneCycleLR over
            ``scheduler_steps``), stepped after every optimizer step.
    """

    def __init__(
        self,
        faults: Mapping[int, Fault] | None = None,
        optimizer: str = "adam",
        scheduler: str = "step",
        scheduler_steps: int = 0,
        lr: float = 0.05,
    ) -> None:
        super().__init__()
        self.net = make_net()
        self.faults = dict(faults or {})
        self.optimizer_name = optimizer
        self.scheduler_name = scheduler
        self.scheduler_steps = scheduler_steps
        self.lr = lr

    def data_index(self, step: int) -> int:
        return step - sum(1 for fault_step in self.faults if fault_step < step)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        step = self.trainer.global_step
        fault = self.faults.get(step)
        x, y = learnable_batch(self.data_index(step))
        hidden = self.net[1](self.net[0](x))
        if fault is not None and fault.site == "activation":
            # After the ReLU, which would turn a -inf into 0.
            first = torch.zeros_like(hidden, dtype=torch.bool)
            first[0, 0] = True
            hidden = torch.where(first, torch.full_like(hidden, fault.value), hidden)
        loss = F.mse_loss(self.net[2](hidden).float(), y)
        if fault is not None and fault.site == "loss":
            loss = loss * fault.value
        return loss

    def on_after_backward(self) -> None:
        fault = self.faults.get(self.trainer.global_step)
        if fault is not None and fault.site == "grad":
            grad = self.net[2].weight.grad
            assert grad is not None
            grad[0, 0] = fault.value

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adam":
            optimizer: torch.optim.Optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler: torch.optim.lr_scheduler.LRScheduler
        if self.scheduler_name == "step":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        else:
            # OneCycleLR raises once stepped past total_steps: a schedule advanced on skipped steps would fail loudly.
            scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=self.scheduler_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def held_out_loss(model: FaultyRegressor) -> float:
    """The MSE on a held-out batch, in FP32, of the model's FP32 weights (the masters, with master weights)."""
    net = make_net()
    net.load_state_dict({key.removeprefix("net."): value for key, value in model.state_dict().items()})
    with torch.no_grad():
        return float(F.mse_loss(net(HELD_OUT[0]), HELD_OUT[1]))


def nonfinite_training_state(trainer: pl.Trainer) -> list[str]:
    """Names of the parameters (the masters, with master weights), optimizer-state tensors and LRs holding inf/NaN."""
    optimizer = trainer.optimizers[0]
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecisionPlugin)
    named: list[tuple[str, Tensor]] = list(trainer.lightning_module.named_parameters())
    for index, state in enumerate(optimizer.state.values()):
        named += [
            (f"optimizer state #{index} {key}", value) for key, value in state.items() if isinstance(value, Tensor)
        ]
    named += [(f"lr of group {g}", torch.tensor(group["lr"])) for g, group in enumerate(optimizer.param_groups)]
    return [name for name, tensor in named if tensor.is_floating_point() and not torch.isfinite(tensor).all()]


class StepWatch(pl.Callback):
    """Per optimizer step: the LR and loss scale it used, whether it was skipped, and any non-finite state after it."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.scales: list[float | None] = []
        self.skipped: list[bool] = []
        self.skipped_total: list[int] = []
        self.overflow_params: list[list[str]] = []
        self.nonfinite: list[list[str]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])
        self.scales.append(None if trainer.scaler is None else trainer.scaler.get_scale())

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        plugin = trainer.precision_plugin
        assert isinstance(plugin, MixedPrecisionPlugin)
        self.skipped.append(plugin.recent_steps[-1].skipped)
        self.skipped_total.append(plugin.skipped_steps)
        self.overflow_params.append(plugin.recent_steps[-1].overflow_params)
        self.nonfinite.append(nonfinite_training_state(trainer))


@dataclass
class Run:
    """A finished (or killed) fit and what was recorded of it."""

    model: FaultyRegressor
    plugin: MixedPrecisionPlugin
    trainer: pl.Trainer
    watch: StepWatch


def fit_faulty(
    mode: Mode, faults: Mapping[int, Fault], steps: int, optimizer: str = "adam", scheduler: str = "step"
) -> Run:
    """``steps`` optimizer steps with ``faults``; the scheduler spans the fault-free steps (``steps - len(faults)``)."""
    torch.manual_seed(0)
    model = FaultyRegressor(faults, optimizer=optimizer, scheduler=scheduler, scheduler_steps=steps - len(faults))
    plugin = make_plugin(mode)
    watch = StepWatch()
    trainer = make_trainer(plugin, max_steps=steps, max_epochs=-1, callbacks=[watch])
    trainer.fit(model, loader(n=64, batch_size=8))
    # After fit the model holds its FP32 weights in every mode (with master weights they are the masters).
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    return Run(model, plugin, trainer, watch)


@cache
def fault_free(mode: Mode, steps: int, optimizer: str, scheduler: str) -> Run:
    """The reference run without faults (deterministic, so shared between the tests that compare with it)."""
    return fit_faulty(mode, {}, steps, optimizer, scheduler)


def check_faults_leave_no_trace(
    mode: Mode, faults: Mapping[int, Fault], clean_steps: int, optimizer: str = "adam", scheduler: str = "step"
) -> Run:
    """Run ``clean_steps + len(faults)`` steps with ``faults``; compare with the fault-free ``clean_steps`` run."""
    run = fit_faulty(mode, faults, clean_steps + len(faults), optimizer, scheduler)
    clean = fault_free(mode, clean_steps, optimizer, scheduler)
    watch, steps = run.watch, clean_steps + len(faults)
    # Every injected step is skipped, and only those.
    assert watch.skipped == [step in faults for step in range(steps)]
    assert watch.skipped_total == [sum(1 for f in faults if f <= step) for step in range(steps)]
    assert clean.watch.skipped == [False] * clean_steps
    # Nothing ever turns non-finite: parameters, masters, optimizer state, LR; checked after every step.
    assert watch.nonfinite == [[]] * steps
    # The schedule stands still on skipped steps: step t uses the LR the fault-free run used at its step
    # t - (faults before t) (past its end, on skipped last steps: the LR it ended with). Same arithmetic: exact.
    clean_lrs = [*clean.watch.lrs, clean.trainer.optimizers[0].param_groups[0]["lr"]]
    assert watch.lrs == [clean_lrs[run.model.data_index(step)] for step in range(steps)]
    lr_scheduler = run.trainer.lr_scheduler_configs[0].scheduler
    assert lr_scheduler.last_epoch == clean_steps
    assert run.plugin.engine.log.held_schedulers.held_steps == len(faults)
    # Recovery: the faulty run ends where the fault-free one ends, having applied the same batches in the same order.
    # bf16 has no loss scale: a skipped step changes nothing, the arithmetic is the same, bit for bit. In fp16 each
    # fault halves the scale; power-of-two scaling commutes with fp16 rounding except where scaled gradients fall into
    # fp16's subnormal range (< 6.1e-5), which a lower scale reaches sooner: a last-bit change there, carried through
    # the following steps. Measured: identical here too; the bound leaves room for such last-bit changes, while a
    # gradient left scaled (or unscaled twice) would be off by a factor of 2 or more.
    exact = mode.precision == "bf16-mixed"
    rtol, atol = (0.0, 0.0) if exact else (1e-4, 1e-5)
    assert_close(parameters_of(run.model), parameters_of(clean.model), rtol=rtol, atol=atol)
    # And so its loss: within 0.1% of the fault-free run's and well below the untrained model's (at least 30% less).
    loss, clean_loss = held_out_loss(run.model), held_out_loss(clean.model)
    assert loss == pytest.approx(clean_loss, rel=1e-3)
    torch.manual_seed(0)
    assert loss < 0.7 * held_out_loss(FaultyRegressor())
    return run


# ---------------------------------------------------------------------------------------------- injected faults
CHOSEN = (0, 4, 5)  # the very first step (no LR step yet), and two in a row
CLEAN_STEPS = 8


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("mode", MODES)
def test_faults_at_chosen_steps_are_skipped_and_leave_no_trace(mode: Mode, site: str) -> None:
    faults = {step: Fault(site, value) for step, value in zip(CHOSEN, (INF, NAN, -INF), strict=True)}
    run = check_faults_leave_no_trace(mode, faults, CLEAN_STEPS)
    overflowed = [names for names in run.watch.overflow_params if names]
    if site == "grad":
        # The diagnosis names the one parameter whose gradient was poisoned (never a master's index).
        assert overflowed == [["net.2.weight"]] * len(CHOSEN)
    else:
        assert len(overflowed) == len(CHOSEN)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", MODES)
def test_faults_at_random_steps_are_skipped_and_leave_no_trace_under_one_cycle(mode: Mode, seed: int) -> None:
    rng = random.Random(seed)
    clean_steps, count = 12, 4
    steps = rng.sample(range(clean_steps + count), count)
    faults = {step: Fault(rng.choice(SITES), rng.choice((INF, -INF, NAN))) for step in steps}
    check_faults_leave_no_trace(mode, faults, clean_steps, optimizer="sgd", scheduler="onecycle")


# ------------------------------------------------------------------------------------------- persistent overflow
def nonfinite_paths(value: Any, path: str = "checkpoint") -> Iterator[str]:
    """Where a nested checkpoint structure (dicts, lists, tuples, tensors, numbers) holds inf or NaN."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from nonfinite_paths(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from nonfinite_paths(item, f"{path}[{index}]")
    elif isinstance(value, Tensor):
        if value.is_floating_point() and not torch.isfinite(value).all():
            yield path
    elif isinstance(value, float) and not math.isfinite(value):
        yield path


# ModelCheckpoint's "no k-th best score yet" sentinel is tensor(inf) by design, not a value of the training state.
KTH_VALUE_SENTINEL = "['kth_value']"


class SaveOnException(pl.Callback):
    """Saves a checkpoint when fit fails: what a user's emergency-save callback does."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        trainer.save_checkpoint(self.path)


GOOD_STEPS = 3  # steps before the overflow starts, so that the optimizer state and the masters are not the initial ones


@pytest.mark.parametrize("mode", MODES)
def test_overflow_at_every_step_stops_within_max_consecutive_skips_and_checkpoints_stay_finite(
    mode: Mode, tmp_path: Path
) -> None:
    max_skips = 3
    # fp16: from 8 the scale backs off to the floor 0.5 in 4 skips (8, 4, 2, 1), then 3 skips at the floor stop it.
    # bf16 has no scale (the scaler arguments are not used): its first 3 skips stop it.
    plugin = make_plugin(mode, max_consecutive_skips=max_skips, init_scale=8.0, min_scale=0.5)
    steps_to_floor = 4 if mode.precision == "16-mixed" else 0
    watch = StepWatch()
    every_step = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(
        plugin,
        max_steps=100,
        max_epochs=-1,
        enable_checkpointing=True,
        callbacks=[watch, every_step, SaveOnException(tmp_path / "on_exception.ckpt")],
    )
    model = FaultyRegressor({step: Fault("loss", INF) for step in range(GOOD_STEPS, 100)})
    with pytest.raises(FloatingPointError, match=rf"{max_skips} optimizer steps in a row were skipped"):
        trainer.fit(model, loader())
    # The step that raised started (its LR was read) but did not finish.
    assert len(watch.lrs) == GOOD_STEPS + steps_to_floor + max_skips
    assert watch.skipped == [False] * GOOD_STEPS + [True] * (steps_to_floor + max_skips - 1)
    assert plugin.skipped_steps == steps_to_floor + max_skips
    if mode.precision == "16-mixed":
        assert watch.scales == [8.0] * GOOD_STEPS + [8.0, 4.0, 2.0, 1.0] + [0.5] * max_skips
        assert plugin.scaler is not None and plugin.scaler.get_scale() == plugin.scaler.state_dict()["min_scale"] == 0.5
    else:
        assert watch.scales == [None] * len(watch.lrs)
    # Every checkpoint written, during the run and at the failure, holds no inf/NaN anywhere.
    saved = sorted(tmp_path.glob("*.ckpt"))
    assert len(saved) == len(watch.skipped) + 1
    for path in saved:
        checkpoint = torch.load(path, weights_only=True)
        bad = [p for p in nonfinite_paths(checkpoint) if not p.endswith(KTH_VALUE_SENTINEL)]
        assert bad == [], path.name
    # The failure checkpoint holds the last applied weights (the masters under master_weights) and the skips.
    checkpoint = torch.load(tmp_path / "on_exception.ckpt", weights_only=True)
    last_good = torch.load(tmp_path / f"step={GOOD_STEPS}.ckpt", weights_only=True)
    assert_close(checkpoint["state_dict"], last_good["state_dict"], rtol=0, atol=0)
    assert checkpoint["MixedPrecisionPlugin"]["scaler"]["skipped_steps"] == steps_to_floor + max_skips
    # bf16's check keeps no scale, only the counters.
    assert checkpoint["MixedPrecisionPlugin"]["scaler"].get("scale") == (0.5 if mode.precision == "16-mixed" else None)
    assert len(checkpoint["optimizer_states"][0]["state"]) == 4  # Adam's state of every parameter was walked
    assert all(value.dtype == torch.float32 for value in checkpoint["state_dict"].values())


# ---------------------------------------------------------------------------------------------- kill and resume
RESUME_STEPS = 10
RESUME_FAULTS = {2: Fault("loss", INF), 5: Fault("grad", NAN)}


class Killed(Exception):
    """Stands for the process being killed: raised after a checkpoint was saved."""


class KillAt(pl.Callback):
    """Saves a checkpoint at the end of optimizer step ``step - 1`` (global_step == ``step``), then kills the run."""

    def __init__(self, step: int, path: Path) -> None:
        self.step = step
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            raise Killed(f"killed after step {self.step - 1}")


def fit_resumable(mode: Mode, steps: int, callbacks: list[pl.Callback], ckpt_path: Path | None = None) -> Run:
    torch.manual_seed(0)
    # The faults are part of the model: a resumed run injects them at the same global steps.
    model = FaultyRegressor(RESUME_FAULTS)
    # growth_interval=3 makes the fp16 scale and its trackers move, so that restoring them is tested.
    plugin = make_plugin(mode, growth_interval=3)
    watch = StepWatch()
    monitor = MixedPrecisionMonitor(log_memory=False, prog_bar=False)
    trainer = make_trainer(
        plugin, max_steps=steps, max_epochs=-1, log_every_n_steps=1, callbacks=[watch, monitor, *callbacks]
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return Run(model, plugin, trainer, watch)


@cache
def uninterrupted(mode: Mode) -> Run:
    return fit_resumable(mode, RESUME_STEPS, [])


def monitor_of(run: Run) -> MixedPrecisionMonitor:
    return next(c for c in run.trainer.callbacks if isinstance(c, MixedPrecisionMonitor))  # type: ignore[attr-defined]


def records(monitor: MixedPrecisionMonitor) -> list[tuple[int, float | None, bool, str]]:
    """The monitor's step records, the grad norm as text so that NaN equals NaN (skipped steps have a NaN norm)."""
    return [(r.step, r.scale, r.skipped, repr(r.grad_norm)) for r in monitor.history.steps]


def kill_steps() -> list[Any]:
    # Right after each skipped step (the checkpoint holds a held scheduler and a backed-off scale), and random steps.
    after_skips = [pytest.param(step + 1, id=f"after-skipped-step-{step}") for step in sorted(RESUME_FAULTS)]
    rng = random.Random(1234)
    randoms = [pytest.param(step, id=f"random-{step}") for step in rng.sample(range(1, RESUME_STEPS), 2)]
    return after_skips + randoms


@pytest.mark.parametrize("kill_step", kill_steps())
@pytest.mark.parametrize("mode", MODES)
def test_a_run_killed_and_resumed_equals_the_uninterrupted_run_bit_for_bit(
    mode: Mode, kill_step: int, tmp_path: Path
) -> None:
    path = tmp_path / "killed.ckpt"
    with pytest.raises(Killed):
        fit_resumable(mode, RESUME_STEPS, [KillAt(kill_step, path)])
    resumed = fit_resumable(mode, RESUME_STEPS, [], ckpt_path=path)
    whole = uninterrupted(mode)
    assert whole.watch.skipped == [step in RESUME_FAULTS for step in range(RESUME_STEPS)]
    assert resumed.trainer.global_step == RESUME_STEPS
    # The same arithmetic from the same restored state: bit for bit on CPU.
    assert_close(parameters_of(resumed.model), parameters_of(whole.model), rtol=0, atol=0)
    assert_close(resumed.trainer.optimizers[0].state_dict(), whole.trainer.optimizers[0].state_dict(), rtol=0, atol=0)
    resumed_scheduler = resumed.trainer.lr_scheduler_configs[0].scheduler
    whole_scheduler = whole.trainer.lr_scheduler_configs[0].scheduler
    assert resumed_scheduler.state_dict() == whole_scheduler.state_dict()
    # Scale, growth and hysteresis trackers, skipped and consecutive-skip counts.
    assert resumed.plugin.state_dict() == whole.plugin.state_dict()
    assert resumed.plugin.skipped_steps == len(RESUME_FAULTS)
    # The resumed steps used the same LRs and scales and skipped the same steps as the uninterrupted run's last ones.
    assert resumed.watch.lrs == whole.watch.lrs[kill_step:]
    assert resumed.watch.scales == whole.watch.scales[kill_step:]
    assert resumed.watch.skipped_total == whole.watch.skipped_total[kill_step:]
    # The monitor: its records of the resumed steps (step, scale, skipped, grad norm) equal the uninterrupted run's,
    # and its running skip count continues from the restored total.
    resumed_history, whole_history = records(monitor_of(resumed)), records(monitor_of(whole))
    assert resumed_history == whole_history[kill_step:]
    logged = "amp/skipped_steps"
    assert resumed.trainer.callback_metrics[logged] == whole.trainer.callback_metrics[logged] == len(RESUME_FAULTS)


# ------------------------------------------------------------------------------------------- corrupt plugin state
KEY = "MixedPrecisionPlugin"
FOREIGN_KEY = "MixedPrecision"  # where Lightning's own plugin saves its torch.amp.GradScaler state
LEGACY_KEY = "native_amp_scaling_state"  # where Lightning 1.x's native AMP saved it
# What torch.amp.GradScaler("cpu").state_dict() holds, as Lightning's MixedPrecision plugin saves it.
GRAD_SCALER_STATE: dict[str, Any] = {
    "scale": 256.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "_growth_tracker": 7,
}


@pytest.fixture(scope="module")
def saved_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """A 2-step checkpoint of each precision (one step skipped), loaded as dicts."""
    checkpoints = {}
    for precision in ("16-mixed", "bf16-mixed"):
        torch.manual_seed(0)
        trainer = make_trainer(make_plugin(Mode(precision, False)), max_steps=2)
        trainer.fit(FaultyRegressor({1: Fault("loss", INF)}), loader())
        path = tmp_path_factory.mktemp(precision) / "two.ckpt"
        trainer.save_checkpoint(path)
        checkpoints[precision] = torch.load(path, weights_only=True)
    return checkpoints


def resume_from(checkpoint: dict[str, Any], precision: str, tmp_path: Path) -> MixedPrecisionPlugin:
    """Restore a fresh run of ``precision`` from ``checkpoint`` (no further step: max_steps is reached); its plugin."""
    path = tmp_path / "edited.ckpt"
    torch.save(checkpoint, path)
    plugin = make_plugin(Mode(precision, master_weights=False))
    trainer = make_trainer(plugin, max_steps=checkpoint["global_step"], max_epochs=-1)
    trainer.fit(FaultyRegressor(), loader(), ckpt_path=path)
    assert trainer.global_step == checkpoint["global_step"]  # restored
    return plugin


Edit = Callable[[dict[str, Any]], None]


def set_plugin_state(value: Any) -> Edit:
    def edit(checkpoint: dict[str, Any]) -> None:
        checkpoint[KEY] = value

    return edit


def drop(key: str) -> Edit:
    def edit(checkpoint: dict[str, Any]) -> None:
        del checkpoint[KEY][key]

    return edit


def set_field(key: str, value: Any) -> Edit:
    def edit(checkpoint: dict[str, Any]) -> None:
        checkpoint[KEY][key] = value

    return edit


def set_scaler_field(key: str, value: Any) -> Edit:
    def edit(checkpoint: dict[str, Any]) -> None:
        checkpoint[KEY]["scaler"][key] = value

    return edit


def drop_scaler_field(key: str) -> Edit:
    def edit(checkpoint: dict[str, Any]) -> None:
        del checkpoint[KEY]["scaler"][key]

    return edit


def as_lightnings(value: Any) -> Edit:
    """The checkpoint as Lightning's MixedPrecision plugin would have written it: its state under its own key."""

    def edit(checkpoint: dict[str, Any]) -> None:
        del checkpoint[KEY]
        checkpoint[FOREIGN_KEY] = value

    return edit


def no_edit(checkpoint: dict[str, Any]) -> None:
    pass


def edited(saved: dict[str, Any], edit: Edit) -> dict[str, Any]:
    checkpoint = {**saved, KEY: {**saved[KEY], "scaler": dict(saved[KEY]["scaler"])}}
    edit(checkpoint)
    return checkpoint


def error_case(
    name: str, edit: Edit, error: type[Exception], message: str, saved_as: str = "16-mixed", resumed_as: str = ""
) -> Any:
    """A checkpoint of ``saved_as`` precision, edited, resumed as ``resumed_as`` (the same by default)."""
    return pytest.param(saved_as, resumed_as or saved_as, edit, error, message, id=name)


ERRORS = [
    error_case("state-is-a-list", set_plugin_state([1.0, 2.0]), TypeError, r"state is a list, not a dict"),
    error_case("state-is-a-string", set_plugin_state("garbage"), TypeError, r"state is a str, not a dict"),
    error_case("state-is-none", set_plugin_state(None), TypeError, r"state is a NoneType, not a dict", "bf16-mixed"),
    error_case("state-is-empty", set_plugin_state({}), ValueError, r"has keys \[\] and no 'format': expected a"),
    error_case("garbage-dict", set_plugin_state({"a": 1}), ValueError, r"has keys \['a'\] and no 'format'"),
    error_case("no-scaler", drop("scaler"), ValueError, r"lacks 'scaler': expected .* and 'scaler'"),
    error_case("no-format", drop("format"), ValueError, r"expected a 'lightning_amp_plus/1' state", "bf16-mixed"),
    error_case("scaler-is-a-list", set_field("scaler", [1.0]), TypeError, r"expects a dict, got list"),
    error_case("no-scale", drop_scaler_field("scale"), ValueError, r"scaler state has no 'scale' key"),
    error_case(
        "scale-is-a-string", set_scaler_field("scale", "1024"), TypeError, r"scale='1024' \(str\); expected a number"
    ),
    error_case(
        "scale-is-a-vector",
        set_scaler_field("scale", torch.ones(2)),
        TypeError,
        r"holds scale=tensor\(\[1\., 1\.\]\) \(Tensor\); expected a number",
    ),
    error_case("scale-is-nan", set_scaler_field("scale", NAN), ValueError, r"scale=nan; .* finite and > 0"),
    error_case("scale-is-inf", set_scaler_field("scale", INF), ValueError, r"scale=inf; .* finite and > 0"),
    error_case("scale-is-zero", set_scaler_field("scale", 0.0), ValueError, r"scale=0.0; .* finite and > 0"),
    error_case(
        "tracker-is-a-float",
        set_scaler_field("_growth_tracker", 1.5),
        TypeError,
        r"_growth_tracker=1.5 \(float\); expected an int",
    ),
    error_case(
        "count-is-a-string",
        set_scaler_field("skipped_steps", "1"),
        TypeError,
        r"skipped_steps='1' \(str\); expected an int",
        "bf16-mixed",
    ),
    error_case(
        "fp16-resumed-as-bf16",
        no_edit,
        ValueError,
        r"trained with MixedPrecisionPlugin\('16-mixed'\), this run uses 'bf16-mixed'",
        "16-mixed",
        "bf16-mixed",
    ),
    error_case(
        "bf16-resumed-as-fp16",
        no_edit,
        ValueError,
        r"trained with MixedPrecisionPlugin\('bf16-mixed'\), this run uses '16-mixed'",
        "bf16-mixed",
        "16-mixed",
    ),
    error_case(
        "grad-scaler-state-with-a-bad-scale",
        as_lightnings({**GRAD_SCALER_STATE, "scale": "x"}),
        TypeError,
        r"scale='x' \(str\); expected a number",
    ),
    error_case("grad-scaler-state-without-scale", as_lightnings({"_growth_tracker": 1}), ValueError, r"no 'scale' key"),
]


@pytest.mark.parametrize(("saved_as", "resumed_as", "edit", "error", "message"), ERRORS)
def test_corrupt_plugin_state_raises_an_error_naming_what_is_wrong(
    saved_checkpoints: dict[str, dict[str, Any]],
    tmp_path: Path,
    saved_as: str,
    resumed_as: str,
    edit: Edit,
    error: type[Exception],
    message: str,
) -> None:
    with pytest.raises(error, match=message):
        resume_from(edited(saved_checkpoints[saved_as], edit), resumed_as, tmp_path)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_a_lightning_1_checkpoint_loads_its_grad_scaler_state_once_with_each_warning_said_once(
    saved_checkpoints: dict[str, dict[str, Any]], tmp_path: Path, precision: str
) -> None:
    # Lightning hands "native_amp_scaling_state" to the load_state_dict of any MixedPrecision, which the plugin is
    # (tests/plugins/test_throughput.py): loaded by the plugin's own on_load_checkpoint as well, it was loaded twice.
    checkpoint = edited(saved_checkpoints[precision], as_lightnings(GRAD_SCALER_STATE))
    checkpoint[LEGACY_KEY] = checkpoint.pop(FOREIGN_KEY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin = resume_from(checkpoint, precision, tmp_path)
    said = [str(warning.message) for warning in caught if re.search("GradScaler|saved", str(warning.message))]
    if precision == "bf16-mixed":
        assert said == [
            "The checkpoint holds an fp16 GradScaler state for MixedPrecisionPlugin; bf16 uses no scaler: ignored."
        ]
    else:
        # The scale and its tracker are Lightning 1.x's; the hyperparameters this plugin's own (said once).
        assert (plugin.state_dict()["scaler"]["scale"], plugin.state_dict()["scaler"]["_growth_tracker"]) == (256.0, 7)
        assert len(said) == 1 and "growth_interval" in said[0]


@pytest.mark.parametrize("key", [KEY, FOREIGN_KEY])
def test_a_grad_scaler_state_resumed_under_bf16_is_ignored_with_a_warning_naming_its_key(
    saved_checkpoints: dict[str, dict[str, Any]], tmp_path: Path, key: str
) -> None:
    checkpoint = edited(saved_checkpoints["bf16-mixed"], as_lightnings(GRAD_SCALER_STATE))
    checkpoint[key] = checkpoint.pop(FOREIGN_KEY)
    where = f"under '{key}'" if key == FOREIGN_KEY else f"for {key}"  # the Trainer hands the plugin its own key
    with pytest.warns(UserWarning, match=rf"fp16 GradScaler state {where}; bf16 uses no scaler: ignored"):
        plugin = resume_from(checkpoint, "bf16-mixed", tmp_path)
    assert plugin.skipped_steps == 0  # nothing of it was taken


@pytest.mark.parametrize(
    ("edit", "message", "check"),
    [
        pytest.param(
            set_scaler_field("scale", 2.0**30),
            r"saved loss scale 1.07374e\+09 is outside \[min_scale, max_scale\] = \[1, 1.67772e\+07\]; it is clamped",
            lambda plugin: plugin.state_dict()["scaler"]["scale"] == 2.0**24,
            id="scale-above-max-scale",
        ),
        pytest.param(
            set_scaler_field("max_consecutive_skips", 7),
            r"saved scaler was built with \{'max_consecutive_skips': 7\}; this one keeps its own "
            r"\{'max_consecutive_skips': 50\}",
            lambda plugin: plugin.scaler.engine.max_consecutive_skips == 50,
            id="other-hyperparameters",
        ),
    ],
)
def test_a_scaler_state_that_can_be_used_with_an_adjustment_warns_and_resumes(
    saved_checkpoints: dict[str, dict[str, Any]],
    tmp_path: Path,
    edit: Edit,
    message: str,
    check: Callable[[MixedPrecisionPlugin], bool],
) -> None:
    with pytest.warns(UserWarning, match=message):
        plugin = resume_from(edited(saved_checkpoints["16-mixed"], edit), "16-mixed", tmp_path)
    assert check(plugin)
    assert plugin.skipped_steps == 1  # the rest of the state was restored


# Found by these tests and fixed: each case failed (wrong message, raw TypeError, silent acceptance) before the fix.
EDGE_CASES = [
    pytest.param(
        drop("precision"),
        ValueError,
        r"'precision'",
        id="no-precision-key",
    ),
    pytest.param(
        set_field("format", "lightning_amp_plus/2"),
        ValueError,
        r"format.*'lightning_amp_plus/2'",
        id="unknown-format",
    ),
    pytest.param(
        set_plugin_state({1: "a", "b": 2}),
        ValueError,
        r"has keys",
        id="mixed-type-keys",
    ),
    *[
        pytest.param(
            set_scaler_field(field_name, -100),
            ValueError,
            rf"{field_name}=-100",
            id=f"negative-{field_name}",
        )
        for field_name in ("skipped_steps", "consecutive_skips", "_floor_skips", "_growth_tracker")
    ],
]


@pytest.mark.parametrize(("edit", "error", "message"), EDGE_CASES)
def test_corrupt_plugin_state_edge_cases_name_the_problem(
    saved_checkpoints: dict[str, dict[str, Any]], tmp_path: Path, edit: Edit, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        resume_from(edited(saved_checkpoints["16-mixed"], edit), "16-mixed", tmp_path)
