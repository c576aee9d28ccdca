"""The monitor's overflow autopsy and headroom readings, through the Trainer and through Fabric.

The numerics (``run_autopsy``, ``measure_headroom``) are tested in ``test_autopsy.py`` and ``test_headroom.py`` on
bare models; here the faults live in LightningModules trained by a Trainer (and a Fabric loop), and what is asserted
is what the user gets: ``monitor.autopsies``, ``monitor.headroom``, the logged metrics, and a run that ends exactly as
it would without the monitor's replays.
"""

from __future__ import annotations

import copy
import csv
from pathlib import Path
from typing import Any

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from autopsy_models import MLP, BrokenBackward, batch
from helpers import FP16_ON_CPU_WARNING, make_trainer, parameters_of
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionMonitor, MixedPrecisionPlugin
from lightning_amp_plus import fabric as amp_fabric

pytestmark = [
    pytest.mark.filterwarnings(FP16_ON_CPU_WARNING),
    pytest.mark.filterwarnings("ignore:.*MixedPrecisionMonitor.*:RuntimeWarning"),
]


class SwitchedBackward(BrokenBackward):
    """BrokenBackward only while ``active``; the identity otherwise."""

    active = False

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) if self.active else x


class Faulty(pl.LightningModule):
    """The autopsy's MLP in a LightningModule, with a fault switched on for chosen batches.

    Args:
        fault: ``"forward"`` (the batch's inputs scaled by 1e5: ``blocks.0.fc``'s fp16 output overflows),
            ``"backward"`` (``blocks.1.extra``'s backward returns inf), or ``None``.
        fault_batches: the batch indices that carry the fault (the batch, not the step: a replay of the batch,
            after its step, must meet the fault again).
    """

    def __init__(self, fault: str | None = None, fault_batches: tuple[int, ...] = (), dropout: float = 0.0) -> None:
        super().__init__()
        self.model = MLP(extra=SwitchedBackward() if fault == "backward" else None, dropout=dropout, norm=True)
        self.fault, self.fault_batches = fault, set(fault_batches)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        active = batch_idx in self.fault_batches
        extra = self.model.blocks[1].extra
        if isinstance(extra, SwitchedBackward):
            extra.active = active
        if active and self.fault == "forward":
            x = x * 1e5  # the first layer's fp16 output overflows (the data, not the model, is at fault here)
        loss = F.mse_loss(self.model(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def data(n: int = 64) -> DataLoader[tuple[Tensor, ...]]:
    x, y = batch(seed=3, n=n)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def fp16(init_scale: float = 2.0**10) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("16-mixed", "cpu", DynamicLossScaler(init_scale=init_scale, growth_interval=1000))


def fit(model: pl.LightningModule, plugin: Any, monitor: MixedPrecisionMonitor, steps: int = 8, **kw: Any) -> None:
    callbacks = [monitor, *kw.pop("callbacks", [])]
    make_trainer(plugin, max_steps=steps, max_epochs=-1, callbacks=callbacks, **kw).fit(model, data())


class RaiseScale(pl.Callback):
    """Sets the loss scale to 2**24 after global step ``at``, as a user's too-high scale would come back."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            trainer.scaler.update(new_scale=2.0**24)


# ---------------------------------------------------------------------------------------------- the kinds
def test_a_forward_overflow_is_blamed_on_its_layer_with_the_fix() -> None:
    monitor = MixedPrecisionMonitor()
    fit(Faulty("forward", fault_batches=(4,)), fp16(), monitor)
    assert [(a.kind, a.module, a.step) for a in monitor.autopsies] == [("forward", "model.blocks.0.fc", 4)]
    message = monitor.autopsies[0].message
    assert "exceeds float16's 65504" in message and "keep_fp32=(Linear,)" in message
    summary = monitor.summary()
    assert "model.blocks.0.fc" in summary
    # A cause no loss scale cures: the summary must not call the skip a routine overflow.
    assert "routine" not in summary and "a cause loss scaling cannot cure (the autopsy of step 4)" in summary


def test_a_broken_backward_is_blamed_on_its_module() -> None:
    monitor = MixedPrecisionMonitor()
    fit(Faulty("backward", fault_batches=(3,)), fp16(), monitor)
    assert [(a.kind, a.module) for a in monitor.autopsies] == [("backward", "model.blocks.1.extra")]
    assert "routine" not in monitor.summary()


def test_bf16_nan_in_forward_is_found_too() -> None:
    monitor = MixedPrecisionMonitor()

    class NaNInput(Faulty):
        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            if self.trainer.global_step == 2:
                self.model.blocks[0].fc.weight.data[0, 0] = float("nan")  # stays: every later step skips too
            return super().training_step(batch, batch_idx)

    with (
        pytest.warns(RuntimeWarning, match="layer `model.blocks.0.fc`"),
        pytest.warns(UserWarning, match=r"non-finite parameters at step \d: model\.blocks\.0\.fc\.weight"),
    ):
        fit(NaNInput(), MixedPrecisionPlugin("bf16-mixed", "cpu"), monitor, steps=4)
    assert [(a.kind, a.module) for a in monitor.autopsies] == [("forward", "model.blocks.0.fc")]


def test_the_scales_first_descent_is_routine_and_a_later_scale_overflow_is_reported() -> None:
    """At 2**24 this model's scaled loss gradient overflows fp16: the scale comes down from init_scale without an
    autopsy. After applied steps, a scale set high again overflows once more: that one is diagnosed "scale"."""

    monitor = MixedPrecisionMonitor()
    plugin = fp16(init_scale=2.0**24)
    fit(Faulty(), plugin, monitor, steps=34, callbacks=[RaiseScale(at=30)])
    first_applied = next(record.step for record in monitor.history.steps if not record.skipped)
    assert first_applied >= 2  # the premise: a first descent of several skips
    assert all(a.kind == "scale" and a.step > first_applied for a in monitor.autopsies)
    found = next(a for a in monitor.autopsies if a.step == 30)
    assert found.safe_scale is not None and found.safe_scale < 2.0**24


class OnceNaN(Faulty):
    """A NaN loss the first time batch 4 is trained, and never again: the switch lives outside the model, so a replay
    of the batch (which restores the model's own state) is finite, as a fault that happens once would be."""

    def __init__(self, fired: list[int]) -> None:
        super().__init__()
        self.fired = fired

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 4 and not self.fired:
            self.fired.append(batch_idx)
            loss = loss * float("nan")
        return loss


@pytest.mark.parametrize("autopsy", [True, False])
def test_a_nan_that_happens_once_is_not_called_a_routine_overflow(autopsy: bool) -> None:
    monitor = MixedPrecisionMonitor(autopsy=autopsy)
    fit(OnceNaN(fired=[]), fp16(), monitor)
    assert monitor.history.skipped == [4] and monitor.autopsies == []
    summary = monitor.summary()
    assert "routine" not in summary
    if autopsy:  # replayed: finite at the same scale
        assert monitor.history.replayed == {4: None}
        assert (
            "step 4 had non-finite gradients that a replay of the batch at the same loss scale did not reproduce"
            in (summary)
        )
    else:
        assert "step 4 had non-finite gradients at a loss scale earlier steps had passed at" in summary
        assert (
            "its cause was not examined (the monitor's autopsy, which replays such a step and says where its first "
            "inf/NaN starts, is off: MixedPrecisionMonitor(autopsy=True) turns it on)"
        ) in summary


def test_at_most_autopsy_limit_autopsies_are_made() -> None:
    monitor = MixedPrecisionMonitor(autopsy_limit=1)
    fit(Faulty("forward", fault_batches=(2, 5)), fp16(), monitor)
    assert len(monitor.autopsies) == 1 and monitor.autopsies[0].step == 2


def test_autopsy_false_makes_none() -> None:
    monitor = MixedPrecisionMonitor(autopsy=False)
    fit(Faulty("forward", fault_batches=(2,)), fp16(), monitor)
    assert monitor.autopsies == []


# ------------------------------------------------------------------------------ why a skip was not examined
class NaNAt(Faulty):
    """A NaN loss at the chosen global steps, once each (a replay after the step, at the next global step, is finite).

    Under manual optimization (``manual=True``) it steps its optimizer itself.
    """

    def __init__(self, steps: tuple[int, ...], manual: bool = False) -> None:
        super().__init__()
        self.nan_steps = set(steps)
        self.automatic_optimization = not manual

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step in self.nan_steps:
            loss = loss * float("nan")
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        return loss


def not_examined_because(summary: str) -> str:
    """What the summary says kept the autopsy from a skip's cause (the parenthesis after "not examined")."""
    said = summary.split("not examined (", 1)[1]
    return said[: said.index(");")]


def test_a_skip_under_another_precision_plugin_says_the_autopsy_runs_under_this_packages_plugins() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    monitor = MixedPrecisionMonitor()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    fit(NaNAt(steps=(4,)), MixedPrecision("16-mixed", "cpu", scaler=scaler), monitor)
    assert monitor.history.skipped == [4]
    assert not_examined_because(monitor.summary()) == (
        "the monitor's autopsy, which replays such a step and says where its first inf/NaN starts, runs under this "
        "package's plugins, not under MixedPrecision"
    )


def test_a_skip_under_manual_optimization_says_the_autopsy_replays_automatic_optimization_only() -> None:
    monitor = MixedPrecisionMonitor()
    fit(NaNAt(steps=(4,), manual=True), fp16(), monitor)
    assert monitor.history.skipped == [4] and monitor.history.replayed == {}
    assert not_examined_because(monitor.summary()) == (
        "the monitor's autopsy replays steps of automatic optimization only, and this LightningModule steps its "
        "optimizers itself"
    )


def test_a_skip_after_the_autopsy_limit_says_the_limit_was_reached() -> None:
    monitor = MixedPrecisionMonitor(autopsy_limit=1)
    # Steps 10-18 overflow as the scale comes down again; the autopsy of step 10 says "scale".
    fit(NaNAt(steps=(21,)), fp16(), monitor, steps=24, callbacks=[RaiseScale(at=10)])
    assert [(a.kind, a.step) for a in monitor.autopsies] == [("scale", 10)]
    assert monitor.history.skipped == [*range(10, 19), 21] and 21 not in monitor.history.replayed
    assert not_examined_because(monitor.summary()) == "the monitor had made the autopsy_limit=1 autopsies of the run"


def fabric_run(monitor: MixedPrecisionMonitor, *, replay: bool, batch_start: bool) -> None:
    """Four steps of a Fabric loop, the loss NaN at step 2 (after applied steps at the same scale)."""
    plugin = amp_fabric.MixedPrecisionPlugin("16-mixed", "cpu", DynamicLossScaler(init_scale=2.0**10))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = MLP(norm=True)
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    x, y = batch(seed=3)
    for step in range(4):
        if batch_start:
            monitor.batch_start()
        loss = F.mse_loss(model(x).float(), y)
        fabric.backward(loss * float("nan") if step == 2 else loss)
        optimizer.step()
        optimizer.zero_grad()
        if replay:
            monitor.observe(plugin, model=model, replay=lambda: F.mse_loss(model(x).float(), y))
        else:
            monitor.observe(plugin, model=model)
    assert monitor.history.skipped == [2] and monitor.history.replayed == {}


def test_a_fabric_loop_without_a_replay_says_what_observe_needs_for_the_autopsy() -> None:
    monitor = MixedPrecisionMonitor()
    fabric_run(monitor, replay=False, batch_start=True)
    assert not_examined_because(monitor.summary()) == (
        "in a Fabric or plain loop the monitor's autopsy replays such a step, and says where its first inf/NaN "
        "starts, when observe() is given model=... and replay=..."
    )


def test_a_fabric_loop_that_does_not_call_batch_start_is_told_to() -> None:
    monitor = MixedPrecisionMonitor()
    fabric_run(monitor, replay=True, batch_start=False)
    assert not_examined_because(monitor.summary()) == (
        "the monitor's autopsy replays a step of a loop that calls monitor.batch_start() before the batch's forward, "
        "for its random state"
    )


# ------------------------------------------------------------------------------------- nothing left behind
class Counting(Faulty):
    """Faulty with the side effects training_steps have: a torchmetrics metric, a list, a counter, a dict."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen_metric = torchmetrics.SumMetric()
        self.losses: list[float] = []
        self.seen = 0
        self.last: dict[str, float] = {}

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.seen_metric.update(torch.tensor(float(len(batch[0]))))
        self.losses.append(float(loss.detach()))
        self.seen += len(batch[0])
        self.last["loss"] = float(loss.detach())
        return loss


def run_with(autopsy: bool, tmp_path: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Counting("forward", fault_batches=(3, 6), dropout=0.2)  # dropout: the replay draws random numbers too
    monitor = MixedPrecisionMonitor(autopsy=autopsy, headroom_interval=4 if autopsy else 0, log_memory=False)
    logger = CSVLogger(tmp_path / str(autopsy), name="run", version=0)
    trainer = make_trainer(fp16(), max_steps=8, max_epochs=-1, callbacks=[monitor], logger=logger, log_every_n_steps=1)
    trainer.fit(model, data())
    with open(tmp_path / str(autopsy) / "run" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    return {
        "params": parameters_of(model),
        "buffers": [b.clone() for b in model.buffers()],
        "state": copy.deepcopy(trainer.optimizers[0].state_dict()["state"]),
        "train_loss": [row["train_loss"] for row in rows if row.get("train_loss")],
        "rng": torch.rand(4),
        "autopsies": len(monitor.autopsies),
        # What the training_step itself keeps: a replay (autopsy, headroom) must not count its batch again.
        "kept": (
            float(model.seen_metric.compute()),
            model.seen_metric.update_count,
            model.losses,
            model.seen,
            model.last,
        ),
    }


def test_a_run_with_autopsies_and_headroom_ends_as_one_without(tmp_path: Path) -> None:
    with_them, without = run_with(True, tmp_path), run_with(False, tmp_path)
    assert with_them.pop("autopsies") == 1 and without.pop("autopsies") == 0  # the same cause at steps 3 and 6
    assert with_them.pop("train_loss") == without.pop("train_loss")  # the logged metrics, as written
    kept = without["kept"]
    assert kept[0] == 64.0 and kept[1] == 8 and len(kept[2]) == 8 and kept[3] == 64  # premise: 8 steps of 8 samples
    # NaN included: the overflowing batches left NaN in BatchNorm's running statistics, in both runs alike.
    torch.testing.assert_close(with_them, without, rtol=0, atol=0, equal_nan=True)


# --------------------------------------------------------------------------------------------------- headroom
def test_headroom_is_read_every_n_steps_logged_and_summarised(tmp_path: Path) -> None:
    monitor = MixedPrecisionMonitor(headroom_interval=3, log_memory=False)
    logger = CSVLogger(tmp_path, name="h", version=0)
    fit(Faulty(), fp16(), monitor, steps=7, logger=logger, log_every_n_steps=1)
    assert [step for step, _ in monitor.history.headroom] == [2, 5]
    assert set(monitor.headroom) >= {"model.blocks.0.fc", "model.head"}
    layer = monitor.headroom["model.blocks.0.fc"]
    assert 0 < layer.act_absmax < 65504 and layer.headroom_bits["float16"] > 0
    with open(tmp_path / "h" / "version_0" / "metrics.csv") as file:
        columns = next(csv.reader(file))
    assert "amp/headroom/model.blocks.0.fc/grad_flushed_pct" in columns
    assert "headroom" in monitor.summary()


# ---------------------------------------------------------------------------------------------------- Fabric
def test_fabric_observe_with_a_replay_makes_the_autopsy_and_the_headroom_readings() -> None:
    plugin = amp_fabric.MixedPrecisionPlugin("16-mixed", "cpu", DynamicLossScaler(init_scale=2.0**10))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = MLP(norm=True)
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    monitor = MixedPrecisionMonitor(headroom_interval=2, log_memory=False)
    x, y = batch(seed=3)
    weight = net.blocks[1].fc.weight
    for step in range(4):
        monitor.batch_start()
        if step == 1:
            with torch.no_grad():
                weight.mul_(1e5)  # this step's forward overflows fp16 (and the replay sees the same weights)
        fabric.backward(F.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
        metrics = monitor.observe(plugin, model=model, replay=lambda: F.mse_loss(model(x).float(), y))
        if step == 1:
            with torch.no_grad():
                weight.div_(1e5)
        assert metrics["amp/step_skipped"] == float(step == 1)
    assert [(a.kind, a.module) for a in monitor.autopsies] == [("forward", "blocks.1.fc")]
    assert [step for step, _ in monitor.history.headroom] == [1, 3]
    assert not isinstance(model.forward, nn.Module) and plugin._suspended is False  # the wrapper's autocast is back


# ------------------------------------------------------------------------------------------------------- chart
def texts_of(figure: Any) -> list[str]:
    found = [text.get_text() for text in figure.findobj(lambda a: hasattr(a, "get_text"))]
    return [text for text in found if text]


def test_the_chart_marks_the_autopsy_says_what_it_found_and_draws_the_headroom_of_each_layer(tmp_path: Path) -> None:
    from lightning_amp_plus.monitor import chart

    monitor = MixedPrecisionMonitor(headroom_interval=4, report_path=tmp_path / "run.png")
    fit(Faulty("forward", fault_batches=(3,)), fp16(), monitor, steps=8)
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    texts = texts_of(chart._whole_figure(monitor.history))
    assert "A1" in texts  # the marker on the top panel
    assert any(text.startswith("A1 step 3: layer `model.blocks.0.fc` (Linear)") for text in texts)
    assert {"model.blocks.0.fc", "model.head"} <= set(texts)  # one bar row per layer
    assert any(text.startswith("headroom at step 7") for text in texts)


def test_a_chart_without_autopsy_or_headroom_is_the_run_chart_alone() -> None:
    from lightning_amp_plus.monitor import chart

    monitor = MixedPrecisionMonitor()
    fit(Faulty(), fp16(), monitor, steps=3)
    texts = texts_of(chart._whole_figure(monitor.history))
    assert not any("headroom" in text or "autops" in text for text in texts)
