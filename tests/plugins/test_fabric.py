"""``lightning_amp_plus.fabric.MixedPrecisionPlugin`` in plain Lightning Fabric loops, against Fabric's own plugin.

The reference is Fabric's built-in ``MixedPrecision`` at the same precision (fp16 with a ``torch.amp.GradScaler`` set
like our scaler), run through the same loop (:mod:`fabric_loops`): the parameters after every optimizer step are
compared bit for bit, over steps with injected overflows, with clipping by norm and by value, with accumulation.

``fabric.clip_gradients`` keeps Fabric's contract with either plugin: torch's ``clip_grad_norm_`` over the unscaled
gradients, which with Fabric's default ``error_if_nonfinite=True`` raises on an overflow step. The loops here pass
``error_if_nonfinite=False`` (:class:`fabric_loops.Loop`'s default), which changes nothing on a finite step and on an
overflow step lets the plugin skip the step it found non-finite, ours and GradScaler alike.
"""

from __future__ import annotations

import copy
import csv
import math
import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from fabric_loops import (
    GROWTH_INTERVAL,
    START_SCALE,
    FabricRun,
    Loop,
    UnscalesBeforeFusedSteps,
    assert_same_runs,
    batch,
    fabrics,
    make_model,
    max_difference,
    ours,
    train,
)
from helpers import PNG_SIGNATURE
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from lightning.fabric.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

import lightning_amp_plus
from lightning_amp_plus import DynamicLossScaler, MixedPrecisionMonitor
from lightning_amp_plus.fabric import FSDPMixedPrecisionPlugin, MixedPrecisionPlugin
from lightning_amp_plus.plugins.wrappers import user_names

pytestmark = pytest.mark.filterwarnings(r"ignore:.*MixedPrecisionPlugin\('16-mixed'\) on CPU:UserWarning")

OVERFLOWS = (1, 4)  # with growth every 3 clean steps: a back-off, a growth at step 3, a back-off, a growth again
STEPS = 8


def saved_scale(plugin: MixedPrecisionPlugin) -> float:
    """The scale as a checkpoint holds it: with the move the last step left for the next backward made."""
    return float(plugin.state_dict()["scaler"]["scale"])


# ------------------------------------------------------------------------------------------ fp16, bit for bit
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("accumulate", [1, 3])
@pytest.mark.parametrize("clip", [None, "norm", "value"])
def test_fp16_equals_fabrics_builtin_with_gradscaler_bit_for_bit_over_overflows(
    clip: Any, accumulate: int, optimizer: Any
) -> None:
    loop = Loop(steps=STEPS, accumulate=accumulate, clip=clip, overflow_at=OVERFLOWS, optimizer=optimizer)
    mine = train(ours(), loop)
    theirs = train(fabrics(), loop)
    assert_same_runs(mine, theirs, what=f"clip={clip}, accumulate={accumulate}, {optimizer}")
    assert mine.plugin.skipped_steps == len(OVERFLOWS)
    # The scale's last move is made at the next backward, or when the state is saved (as here); GradScaler's at once.
    assert saved_scale(mine.plugin) == theirs.plugin.scaler.get_scale()
    assert saved_scale(mine.plugin) != START_SCALE  # it moved: backed off twice, grew twice (premise)
    if clip == "norm":
        # What fabric.clip_gradients returns: torch's norm before clipping, on every step the same as with Fabric's own
        # plugin (inf on the skipped ones, where the step result says inf too once something measures the norm).
        assert [repr(n) for n in mine.clip_norms] == [repr(n) for n in theirs.clip_norms]  # NaN equals nothing: repr
        finite = [math.isfinite(mine.clip_norms[s]) for s in range(STEPS)]  # type: ignore[arg-type]
        assert finite == [s not in OVERFLOWS for s in range(STEPS)]
        assert all(theirs.clip_norms[s] > loop.max_norm for s in range(STEPS) if s not in OVERFLOWS)  # type: ignore[operator]  # it clipped


@pytest.mark.parametrize("plugin", [fabrics, ours])
def test_with_fabrics_default_error_if_nonfinite_clip_gradients_raises_on_an_overflow_step_with_either_plugin(
    plugin: Any,
) -> None:
    # Fabric's contract (torch's clip_grad_norm_ with error_if_nonfinite=True) is kept: the step cannot be clipped.
    run = FabricRun(plugin(), Loop(steps=2, clip="norm", overflow_at=(1,), error_if_nonfinite=True))
    run.step()
    with pytest.raises(RuntimeError, match="non-finite"):
        run.step()
    if plugin is ours:  # and the plugin still skips it, should the loop go on to step
        run.optimizer.step()
        assert run.plugin.recent_steps[-1].skipped and run.plugin.skipped_steps == 1


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_an_overflow_step_clipped_without_error_if_nonfinite_is_skipped_and_says_its_norm(clip: Any) -> None:
    run = FabricRun(ours(), Loop(steps=3, clip=clip, overflow_at=(1,), optimizer="adamw"))
    run.step()
    state_before = copy.deepcopy(run.optimizer.optimizer.state_dict())
    run.step()  # fabric.clip_gradients(..., max_norm=0.25, error_if_nonfinite=False) or (..., clip_val=0.02)
    plugin = run.plugin
    assert plugin.recent_steps[-1].skipped and plugin.skipped_steps == 1
    assert plugin.recent_steps[-1].overflow_params  # named at the check, before a clip by value made them finite
    if clip == "norm":
        assert not math.isfinite(run.clip_norms[1])  # type: ignore[arg-type]  # torch's norm of the gradients: the truth
    for before, after in zip(run.params[0], run.params[1], strict=True):
        assert torch.equal(before, after)  # parameters untouched
    state_after = run.optimizer.optimizer.state_dict()
    for param, state in state_before["state"].items():
        for key, value in state.items():
            assert torch.equal(value, state_after["state"][param][key]), key  # AdamW's moments and step untouched
    assert plugin.scaler.get_scale() == START_SCALE  # the scale the skipped step's gradients carried
    run.step()  # its backward first backs the scale off
    assert not plugin.recent_steps[-1].skipped and plugin.skipped_steps == 1
    assert plugin.scaler.get_scale() == START_SCALE / 2


def test_fabric_clips_the_real_parameters_on_every_step_as_with_its_own_plugin() -> None:
    # main_params is Fabric's own: the optimizer's parameters, also on a step found non-finite (no stand-in).
    run = FabricRun(ours(), Loop(steps=1, clip="value", overflow_at=(0,)))
    x, y = batch(0, 0)
    run.fabric.backward(torch.nn.functional.mse_loss(run.model(x), y) * math.inf)
    run.plugin.unscale_gradients(run.optimizer.optimizer)
    handed = list(run.plugin.main_params(run.optimizer.optimizer))
    assert [id(p) for p in handed] == [id(p) for p in run.module.parameters()]


# -------------------------------------------------------------------------------------------------- fused
def test_fused_adamw_without_clipping_equals_gradscaler_with_fused_adamw_bit_for_bit() -> None:
    loop = Loop(steps=STEPS, accumulate=2, overflow_at=OVERFLOWS, optimizer="adamw-fused")
    mine, theirs = train(ours(), loop), train(fabrics(), loop)
    assert_same_runs(mine, theirs, what="fused AdamW")
    assert mine.plugin.skipped_steps == len(OVERFLOWS)
    assert saved_scale(mine.plugin) == theirs.plugin.scaler.get_scale()


def test_fabrics_builtin_refuses_clipping_with_a_fused_optimizer() -> None:
    run = FabricRun(fabrics(), Loop(steps=1, clip="norm", optimizer="adamw-fused"))
    with pytest.raises(NotImplementedError, match="optimizers handling the unscaling"):
        run.step()


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_fused_adamw_with_clipping_equals_gradscaler_unscaling_before_the_fused_step(clip: Any) -> None:
    loop = Loop(steps=STEPS, clip=clip, overflow_at=OVERFLOWS, optimizer="adamw-fused")
    reference = fabrics()
    mine = train(ours(), loop)
    theirs = train(UnscalesBeforeFusedSteps("16-mixed", "cpu", scaler=reference.scaler), loop)
    assert_same_runs(mine, theirs, what=f"fused AdamW, clip by {clip}")
    assert mine.plugin.skipped_steps == len(OVERFLOWS)


def test_fused_adamw_with_clipping_is_within_fused_arithmetic_of_foreach_adamw() -> None:
    # Fused and foreach AdamW round differently (the fused kernel computes each element's update in one expression;
    # foreach in separate passes, each rounded to float32). The tolerance is what the two do to each other on the same
    # loop in plain float32 (Fabric's 32-true, no loss scaling), times 4 for the drift of a different run: measured
    # 3.0e-8 there and 1.5e-8 under our fp16 plugin, about one float32 ulp of these parameters.
    def run(plugin: Any, kind: Any, **options: Any) -> FabricRun:
        return train(plugin, Loop(steps=STEPS, clip="norm", optimizer=kind, **options))

    plain = max_difference(run(Precision(), "adamw-fused"), run(Precision(), "adamw-foreach"))
    assert 0.0 < plain < 1e-6  # premise: fused and foreach differ, by float32 rounding
    fused = run(ours(), "adamw-fused", overflow_at=OVERFLOWS)
    foreach = run(ours(), "adamw-foreach", overflow_at=OVERFLOWS)
    assert_same_runs(fused, foreach, rtol=0.0, atol=4 * plain, what="fused vs foreach AdamW, clip by norm")
    assert fused.plugin.skipped_steps == foreach.plugin.skipped_steps == len(OVERFLOWS)


# --------------------------------------------------------------------------------------------------- bf16
def test_fabrics_builtin_bf16_lets_one_nan_step_poison_every_weight() -> None:
    # The premise: Fabric's bf16-mixed checks nothing, so a single NaN loss makes every parameter NaN for good.
    run = train(fabrics("bf16-mixed"), Loop(steps=4, nan_at=(1,)))
    assert all(torch.isfinite(p).all() for p in run.params[0])
    assert all(torch.isnan(p).any() for p in run.params[1])  # the NaN step: NaN in every tensor (ReLU kept a few)
    for step in (2, 3):
        assert all(torch.isnan(p).all() for p in run.params[step]), step  # then every element, for good


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("clip", [None, "norm", "value"])
def test_bf16_skips_non_finite_steps_and_equals_fabrics_builtin_never_taking_them(clip: Any, accumulate: int) -> None:
    # The reference skips by hand: Fabric's built-in run where optimizer.step() is not called at those steps.
    faults = {"nan_at": (1,), "overflow_at": (4,)}
    mine = train(ours("bf16-mixed"), Loop(steps=STEPS, clip=clip, accumulate=accumulate, **faults))  # type: ignore[arg-type]
    theirs = train(fabrics("bf16-mixed"), Loop(steps=STEPS, clip=clip, accumulate=accumulate, step_skipped_at=(1, 4)))
    assert_same_runs(mine, theirs, what=f"bf16, clip={clip}, accumulate={accumulate}")
    assert mine.plugin.skipped_steps == 2 and mine.plugin.scaler is None


def test_bf16_with_fused_adamw_skips_a_nan_step_on_the_fused_path() -> None:
    mine = train(ours("bf16-mixed"), Loop(steps=4, nan_at=(1,), optimizer="adamw-fused"))
    theirs = train(fabrics("bf16-mixed"), Loop(steps=4, step_skipped_at=(1,), optimizer="adamw-fused"))
    assert_same_runs(mine, theirs, what="bf16, fused AdamW")
    assert mine.plugin.skipped_steps == 1


def test_bf16_with_skip_nonfinite_off_behaves_as_fabrics_builtin() -> None:
    mine = train(ours("bf16-mixed", skip_nonfinite=False), Loop(steps=3, clip="value", nan_at=(1,)))
    theirs = train(fabrics("bf16-mixed"), Loop(steps=3, clip="value", nan_at=(1,)))
    assert all(torch.isnan(p).all() for p in mine.params[2])
    for a, b in zip(mine.params[0], theirs.params[0], strict=True):
        assert torch.equal(a, b)
    assert mine.plugin.skipped_steps == 0 and not mine.plugin.settings.skip_nonfinite


# ----------------------------------------------------------------------------------------------- readings
def norms_the_optimizer_is_handed(run: FabricRun) -> list[float]:
    """The float64 norm of the gradients at each ``optimizer.step`` (a pre-hook): computed apart from the plugin."""
    seen: list[float] = []

    def record(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        grads = [p.grad.double().reshape(-1) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.cat(grads))))

    run.optimizer.optimizer.register_step_pre_hook(record)
    return seen


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_the_norm_is_measured_once_a_monitor_reads_it_the_global_norm_of_the_unscaled_gradients(precision: str) -> None:
    # Without clipping, the optimizer is handed the unscaled gradients the plugin measured. The plugin sums squares in
    # float32: against float64, a relative error of at most n * 2**-24 for n = 808 terms, ~5e-5; it is far smaller.
    # Before a reader, nothing asks for the norm: the check is GradScaler's one pass, which measures none.
    run = FabricRun(ours(precision), Loop(steps=4, accumulate=2))
    seen = norms_the_optimizer_is_handed(run)
    run.step()
    assert run.plugin.recent_steps[-1].grad_norm is None and not run.plugin.recent_steps[-1].skipped
    MixedPrecisionMonitor().observe(run.plugin)
    for step in range(1, 4):
        run.step()
        assert run.plugin.recent_steps[-1].grad_norm == pytest.approx(seen[step], rel=5e-5, abs=0.0), step
    assert len(seen) == 4


def test_the_norm_a_monitor_reads_is_the_norm_fabric_clip_gradients_returns() -> None:
    run = FabricRun(ours(), Loop(steps=4, clip="norm", overflow_at=(2,)))
    MixedPrecisionMonitor().observe(run.plugin)  # a reader before the loop: every step's norm is measured
    for step in range(4):
        run.step()
        norm = run.plugin.recent_steps[-1].grad_norm
        assert norm is not None
        if step == 2:
            assert run.plugin.recent_steps[-1].skipped and not math.isfinite(norm)
            assert not math.isfinite(run.clip_norms[step])  # type: ignore[arg-type]
        else:
            assert norm == run.clip_norms[step] and not run.plugin.recent_steps[-1].skipped  # the same float32, exactly


@pytest.mark.parametrize(
    ("precision", "optimizer"),
    [
        ("16-mixed", "adamw"),
        ("16-mixed", "sgd"),
        ("bf16-mixed", "sgd"),
        ("16-mixed", "adamw-fused"),
        ("bf16-mixed", "adamw-fused"),
    ],
)
def test_last_overflow_params_names_the_parameters_as_named_parameters_gives_them(
    precision: str, optimizer: Any
) -> None:
    run = FabricRun(ours(precision), Loop(steps=3, optimizer=optimizer))
    if optimizer == "adamw-fused":
        # The fused path measures each gradient only for a reader (a pass GradScaler does not make): the monitor.
        MixedPrecisionMonitor().observe(run.plugin)
    run.step()
    handle = run.module[2].bias.register_hook(lambda grad: torch.full_like(grad, math.inf))
    run.step()
    handle.remove()
    assert run.plugin.recent_steps[-1].skipped
    assert run.plugin.recent_steps[-1].overflow_params == ["2.bias"]
    assert "2.bias" in dict(run.module.named_parameters())
    run.step()
    assert not run.plugin.recent_steps[-1].skipped and run.plugin.skipped_steps == 1


def test_the_scaler_is_ours_for_fp16_none_for_bf16_and_can_be_replaced() -> None:
    plugin = MixedPrecisionPlugin("16-mixed", "cpu")
    assert isinstance(plugin.scaler, DynamicLossScaler) and plugin.scaler.get_scale() == 2.0**16
    assert MixedPrecisionPlugin("bf16-mixed", "cpu").scaler is None
    replacement = DynamicLossScaler(init_scale=START_SCALE, growth_interval=GROWTH_INTERVAL)
    plugin.scaler = replacement
    run = train(plugin, Loop(steps=STEPS, overflow_at=OVERFLOWS))
    assert plugin.scaler is replacement
    assert_same_runs(run, train(fabrics(), Loop(steps=STEPS, overflow_at=OVERFLOWS)), what="replaced scaler")


# -------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_a_run_resumed_with_fabric_load_equals_the_uninterrupted_run_bit_for_bit(
    tmp_path: Path, precision: str
) -> None:
    faults: dict[str, Any] = {"overflow_at": (1, 5)} if precision == "16-mixed" else {"nan_at": (1, 5)}
    loop = Loop(steps=STEPS, accumulate=2, clip="norm", schedule=True, **faults)
    whole = train(ours(precision), loop)
    first = FabricRun(ours(precision), loop).run(4)
    first.save(tmp_path / "step4.ckpt")
    resumed = FabricRun(ours(precision), loop, seed=1)  # other initial weights, a fresh scaler: all from the file
    resumed.load(tmp_path / "step4.ckpt")
    assert resumed.next_step == 4
    resumed.run()
    for step, (mine, theirs) in enumerate(zip(resumed.params, whole.params[4:], strict=True), start=4):
        for p, q in zip(mine, theirs, strict=True):
            assert torch.equal(p, q), f"step {step}"
    assert resumed.plugin.skipped_steps == whole.plugin.skipped_steps == 2
    assert resumed.plugin.state_dict() == whole.plugin.state_dict()
    if precision == "16-mixed":
        assert resumed.plugin.scaler.get_scale() == whole.plugin.scaler.get_scale()
    assert resumed.scheduler.get_last_lr() == whole.scheduler.get_last_lr()  # type: ignore[union-attr]


def test_fabric_save_and_load_round_trip_the_plugin_state(tmp_path: Path) -> None:
    run = train(ours(), Loop(steps=5, overflow_at=(2, 3)))  # backed off twice, then one clean step: no growth yet
    saved = run.plugin.state_dict()
    assert saved["scaler"]["scale"] == run.plugin.scaler.get_scale() == START_SCALE / 4
    assert saved["scaler"]["skipped_steps"] == 2
    run.fabric.save(tmp_path / "ckpt", {"amp": run.plugin})
    fresh = ours()
    L.Fabric(accelerator="cpu", devices=1, plugins=[fresh]).load(tmp_path / "ckpt", {"amp": fresh})
    assert fresh.state_dict() == saved and fresh.skipped_steps == 2
    assert fresh.scaler.get_scale() == START_SCALE / 4


def test_a_checkpoint_of_fabrics_builtin_fp16_plugin_resumes_under_ours(tmp_path: Path) -> None:
    # Migrating: the GradScaler state that Fabric's own plugin saves is read as such.
    theirs = train(fabrics(), Loop(steps=4, overflow_at=(1,)))
    theirs.fabric.save(tmp_path / "ckpt", {"amp": theirs.plugin})
    mine = ours()
    L.Fabric(accelerator="cpu", devices=1, plugins=[mine]).load(tmp_path / "ckpt", {"amp": mine})
    assert mine.scaler.get_scale() == theirs.plugin.scaler.get_scale() == START_SCALE / 2


def test_loading_a_bf16_plugin_state_into_an_fp16_plugin_says_how_to_resume(tmp_path: Path) -> None:
    run = train(ours("bf16-mixed"), Loop(steps=1))
    run.fabric.save(tmp_path / "ckpt", {"amp": run.plugin})
    mine = ours()
    with pytest.raises(
        ValueError, match=re.escape("trained with MixedPrecisionPlugin('bf16-mixed'), this run uses '16-mixed'")
    ):
        L.Fabric(accelerator="cpu", devices=1, plugins=[mine]).load(tmp_path / "ckpt", {"amp": mine})


# ----------------------------------------------------------------------------------------------- monitor
def test_the_monitor_observes_each_step_for_fabric_log_dict(tmp_path: Path) -> None:
    plugin, monitor = ours(), MixedPrecisionMonitor()
    run = FabricRun(plugin, Loop(steps=6, clip="norm", overflow_at=(1, 4)), loggers=CSVLogger(tmp_path, name="amp"))
    assert monitor.observe(plugin) == {}  # before the loop (docs/fabric.md): the first step's norm is measured too
    for step in range(6):
        run.step()
        scale = plugin.scaler.get_scale()  # after a step, the scale it used (it moves at the next backward)
        metrics = monitor.observe(plugin, model=run.model)
        run.fabric.log_dict(metrics, step=step)
        assert metrics["amp/loss_scale"] == scale  # the scale this step's gradients carried
        assert metrics["amp/step_skipped"] == float(step in (1, 4))
        assert metrics["amp/skipped_steps"] == float(sum(skip <= step for skip in (1, 4)))
        if step not in (1, 4):
            assert metrics["amp/grad_norm"] == plugin.recent_steps[-1].grad_norm == run.clip_norms[step]
        assert metrics["amp/cpu_rss_mb"] > 0
    assert monitor.observe(plugin) == {}  # no step since: nothing to log
    run.fabric.logger.finalize("success")
    with open(Path(run.fabric.logger.log_dir) / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert [float(row["amp/step_skipped"]) for row in rows] == [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    summary = monitor.summary()
    head = "MixedPrecisionMonitor: 6 optimizer steps, 2 skipped (33.3%) at steps 1 and 4"
    assert summary.startswith(f"{head}; loss scale 2**8 to 2**10, last 2**8")
    chart = monitor.write_chart(tmp_path / "amp.png")
    assert chart.read_bytes()[:8] == PNG_SIGNATURE


def test_the_first_observe_after_the_first_step_reports_that_step() -> None:
    plugin, monitor = ours(), MixedPrecisionMonitor()
    run = FabricRun(plugin, Loop(steps=2))
    run.step()
    assert monitor.observe(plugin, model=run.model)["amp/loss_scale"] == START_SCALE


def test_the_monitor_names_a_non_finite_parameter_of_a_fabric_model_as_the_users_model_does() -> None:
    plugin, monitor = ours("bf16-mixed", skip_nonfinite=False), MixedPrecisionMonitor()
    run = FabricRun(plugin, Loop(steps=1, nan_at=(0,), optimizer="sgd")).run()
    with pytest.warns(UserWarning, match="non-finite parameters"):
        monitor.observe(plugin, model=run.model)
    assert monitor.history.nonfinite_events[-1][2] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_names_look_through_fabrics_and_compiles_wrappers_but_not_a_users_module_attribute() -> None:
    class Holder(nn.Module):  # a user's model whose submodule is called `module`: its names keep the prefix
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[ours()])
    wrapped = fabric.setup_module(torch.compile(Holder()))
    assert [name for name, _ in user_names(wrapped)] == ["module.weight", "module.bias"]
    assert [name for name, _ in user_names(Holder())] == ["module.weight", "module.bias"]


# ----------------------------------------------------------------------------------------------- refusals
class CountsForwards(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.forwards = 0

    def forward(self, x: Tensor) -> Tensor:
        self.forwards += 1
        return self.layer(x)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_the_trainer_plugin_given_to_fabric_is_refused_at_setup_before_any_forward(precision: str) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[lightning_amp_plus.MixedPrecisionPlugin(precision, "cpu")])  # type: ignore[arg-type]
    model = CountsForwards()
    with pytest.raises(
        TypeError, match=re.escape(f"use lightning_amp_plus.fabric.MixedPrecisionPlugin({precision!r})")
    ):
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.forwards == 0


def test_the_fabric_plugin_given_to_a_trainer_is_refused_naming_the_trainer_plugin() -> None:
    with pytest.raises(
        MisconfigurationException, match=re.escape("for the Trainer, use lightning_amp_plus.MixedPrecisionPlugin")
    ):
        L.Trainer(accelerator="cpu", plugins=[MixedPrecisionPlugin("bf16-mixed")], logger=False)


def test_lbfgs_is_refused_at_its_first_step_before_the_parameters_change() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[ours()])
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.LBFGS(model.parameters()))
    before = [p.detach().clone() for p in model.parameters()]

    def closure() -> Tensor:
        optimizer.zero_grad()
        x, y = batch(0, 0)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        return loss

    with pytest.raises(TypeError, match=re.escape("cannot drive torch.optim.LBFGS") + ".*Use another optimizer"):
        optimizer.step(closure)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


BAD_ARGUMENTS = [
    (
        {"precision": "16-true"},
        ValueError,
        "`{name}(precision='16-true')` is not supported: use '16-mixed'",
    ),
    ({"precision": 16}, ValueError, "`{name}(precision=16)` is not supported: use '16-mixed'"),
    ({"device": "tpu"}, ValueError, "`{name}(device='tpu')` is not supported: use 'cuda', 'cpu', 'mps' or None"),
    ({"scaler": torch.amp.GradScaler("cpu")}, TypeError, "`{name}(precision='16-mixed', scaler=<torch.amp.grad_scaler"),
    (
        {"precision": "bf16-mixed", "scaler": DynamicLossScaler()},
        ValueError,
        "`{name}(precision='bf16-mixed', scaler=DynamicLossScaler(",
    ),
    ({"skip_nonfinite": 1}, TypeError, "`{name}(skip_nonfinite=1)` must be True or False"),
    ({"max_consecutive_skips": 0}, ValueError, "`{name}(max_consecutive_skips=0)` must be an int >= 1"),
    ({"master_weights": "yes"}, TypeError, "`{name}(master_weights='yes')` must be True or False"),
    (
        {"scaler": DynamicLossScaler(max_consecutive_skips=5), "max_consecutive_skips": 7},
        ValueError,
        "the scaler's max_consecutive_skips=5 differs from",
    ),
]


@pytest.mark.parametrize("plugin", [MixedPrecisionPlugin, FSDPMixedPrecisionPlugin])
@pytest.mark.parametrize(("arguments", "error", "message"), BAD_ARGUMENTS)
def test_a_bad_argument_is_refused_naming_the_plugin_the_argument_its_value_and_the_fix(
    plugin: type, arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    name = "MixedPrecisionPlugin" if plugin is MixedPrecisionPlugin else "FSDPMixedPrecisionPlugin"  # as imported
    with pytest.raises(error, match=re.escape(message.format(name=name))):
        plugin(**arguments)


def test_a_deepspeed_engine_is_refused_at_the_first_backward_before_any_gradient() -> None:
    # Fabric's DeepSpeedStrategy does not check its precision plugin's type, and hands the engine to the plugin's
    # backward (the engine runs its own loss scaling). DeepSpeed is not installed here: a stand-in class from a
    # `deepspeed.*` module plays the engine.
    engine = type("DeepSpeedEngine", (nn.Linear,), {"__module__": "deepspeed.runtime.engine"})(2, 1)
    loss = engine(torch.ones(1, 2)).sum()
    with pytest.raises(TypeError, match=re.escape("Use Fabric(strategy='deepspeed', precision='16-mixed' or")):
        ours().backward(loss, engine)
    assert engine.weight.grad is None


def test_the_fsdp_plugin_refuses_bf16_true_naming_fabrics_own() -> None:
    # FSDP1 keeps flat bf16 shards of its own: the compensated update is not defined there (the Trainer's FSDP plugin
    # refuses it too); Fabric's FSDPStrategy with precision='bf16-true' is plain bf16-true.
    with pytest.raises(ValueError, match=re.escape("use Fabric(strategy='fsdp', precision='bf16-true') without")):
        FSDPMixedPrecisionPlugin("bf16-true")  # type: ignore[arg-type]


def test_the_fix_each_scaler_refusal_names() -> None:
    with pytest.raises(TypeError, match=re.escape("`DynamicLossScaler().load_state_dict(grad_scaler.state_dict())`")):
        MixedPrecisionPlugin(scaler=torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("Drop `scaler`, or use precision='16-mixed'")):
        MixedPrecisionPlugin("bf16-mixed", scaler=DynamicLossScaler())
    with pytest.raises(
        ValueError, match=re.escape("set the limit in one place, e.g. DynamicLossScaler(..., max_consecutive_skips=7)")
    ):
        MixedPrecisionPlugin(scaler=DynamicLossScaler(max_consecutive_skips=5), max_consecutive_skips=7)


def test_the_fsdp_plugin_names_itself_when_it_refuses_lbfgs() -> None:
    plugin = FSDPMixedPrecisionPlugin("16-mixed", "cpu")
    weight = nn.Parameter(torch.ones(2))
    with pytest.raises(
        TypeError, match=re.escape("FSDPMixedPrecisionPlugin('16-mixed') cannot drive torch.optim.LBFGS")
    ):
        plugin.optimizer_step(torch.optim.LBFGS([weight]))


def test_keep_fp32_must_be_module_types() -> None:
    with pytest.raises(
        TypeError, match=re.escape("`MixedPrecisionPlugin(keep_fp32=[<class 'int'>])` must be a sequence of nn.Module")
    ):
        MixedPrecisionPlugin(keep_fp32=[int])  # type: ignore[list-item]


# ------------------------------------------------------------------------------------------ the autocast device
class OnCuda(nn.Parameter):
    """A CPU parameter that says it is on CUDA: what a module moved to a GPU looks like to the plugin, on a CPU box."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


class MovesToCuda(SingleDeviceStrategy):
    """Fabric's single-device strategy whose move to the device is a move to a (pretended) GPU."""

    def module_to_device(self, module: nn.Module) -> None:
        for submodule in module.modules():
            for name, param in list(submodule.named_parameters(recurse=False)):
                setattr(submodule, name, OnCuda(param.data, param.requires_grad))


def test_without_a_device_the_plugin_autocasts_where_fabric_moved_the_model_not_where_it_was_built() -> None:
    # Fabric calls convert_module *before* moving the module to its device: a model built on the CPU and trained on
    # a GPU was read as a CPU model, and its forward ran under CPU autocast, i.e. in FP32 on the GPU.
    plugin = MixedPrecisionPlugin("16-mixed")  # device=None, as litgpt-style code writes it
    fabric = L.Fabric(accelerator="cpu", strategy=MovesToCuda(device=torch.device("cpu")), plugins=[plugin])
    model = fabric.setup_module(make_model())  # built on the CPU
    assert next(model.parameters()).device.type == "cuda"  # premise: where Fabric put it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available": the context is only built, never entered
        context = plugin.forward_context()
    assert isinstance(context, torch.autocast) and context.device == "cuda"
    assert plugin.device == "cuda"


def test_a_given_device_is_kept_and_keep_fp32_modules_run_in_fp32_under_it() -> None:
    seen: list[torch.dtype] = []
    plugin = MixedPrecisionPlugin("bf16-mixed", "cpu", keep_fp32=[nn.ReLU])
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(make_model())
    model.module[1].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    out = model(torch.randn(2, 16))
    assert seen == [torch.float32] and out.dtype == torch.float32 and plugin.device == "cpu"


def test_keep_fp32_modules_run_in_fp32_when_the_device_is_learnt_at_the_first_forward() -> None:
    seen: list[torch.dtype] = []
    plugin = MixedPrecisionPlugin("bf16-mixed", keep_fp32=[nn.ReLU])
    model = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(make_model())
    model.module[1].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    model.module[2].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    model(torch.randn(2, 16))
    assert seen == [torch.float32, torch.bfloat16] and plugin.device == "cpu"


# ------------------------------------------------- Fabric's own precision tests' scenarios, for this plugin
# Upstream (tests/tests_fabric/plugins/precision/test_amp.py, test_amp_integration.py, test_all.py and
# test_fabric.py::test_backward, test_grad_clipping) checks these of Fabric's MixedPrecision; ours must hold them too.
@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_forward_context_is_a_torch_autocast_in_the_half_dtype(precision: str, dtype: torch.dtype) -> None:
    plugin = MixedPrecisionPlugin(precision, "cpu")  # type: ignore[arg-type]
    context = plugin.forward_context()
    assert isinstance(context, torch.autocast) and context.fast_dtype == dtype
    with plugin.forward_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_in_a_fabric_step_inputs_and_compute_are_half_while_weights_outputs_and_gradients_stay_fp32(
    precision: str, dtype: torch.dtype
) -> None:
    seen: dict[str, Any] = {}

    class Checks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(32, 2)

        def forward(self, x: Tensor) -> Tensor:
            seen.update(input=x.dtype, autocast=torch.is_autocast_enabled("cpu"))
            out = self.layer(x)
            seen["output"] = out.dtype
            return out

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[ours(precision)])
    model = fabric.setup_module(Checks())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.1))
    out = model(torch.rand(2, 32))
    assert seen == {"input": dtype, "autocast": True, "output": dtype}
    assert out.dtype == torch.float32 and model.layer.weight.dtype == torch.float32
    fabric.backward(torch.nn.functional.mse_loss(out, torch.ones_like(out)))
    assert model.layer.weight.grad is not None and model.layer.weight.grad.dtype == torch.float32
    optimizer.step()
    optimizer.zero_grad()
    assert not fabric.strategy.precision.recent_steps[-1].skipped  # type: ignore[attr-defined]


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_fabric_backward_passes_its_arguments_to_the_tensors_backward_with_the_loss_scaled(precision: str) -> None:
    plugin = ours(precision)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(nn.Linear(3, 2))
    out = model(torch.ones(4, 3))  # not a scalar: backward needs its `gradient`, passed positionally
    fabric.backward(out, torch.ones_like(out), retain_graph=True)  # retain_graph: a second backward works
    first = model.weight.grad.clone()  # type: ignore[union-attr]
    fabric.backward(out, torch.ones_like(out))
    assert torch.equal(model.weight.grad, 2 * first)  # type: ignore[arg-type]
    scale = START_SCALE if precision == "16-mixed" else 1.0
    torch.testing.assert_close(first, torch.full((2, 3), 4.0 * scale))  # d(sum of outputs)/dW = 4 per entry, scaled


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_optimizer_step_hands_its_arguments_to_the_optimizer_and_moves_the_scale_once(precision: str) -> None:
    calls: list[dict[str, Any]] = []

    class TakesArguments(torch.optim.SGD):
        def step(self, closure: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
            calls.append(kwargs)
            return super().step(closure)

    plugin = MixedPrecisionPlugin(
        precision, "cpu", DynamicLossScaler(init_scale=4.0, growth_interval=1) if precision == "16-mixed" else None
    )  # type: ignore[arg-type]
    weight = nn.Parameter(torch.ones(2))
    optimizer = TakesArguments([weight], lr=0.1)
    plugin.backward((weight * 2).sum(), None)
    plugin.optimizer_step(optimizer, keyword="arg")
    assert calls == [{"keyword": "arg"}]
    if plugin.scaler is not None:
        # One clean step with growth_interval=1: grown once, not twice, when the next backward starts.
        assert plugin.scaler.get_scale() == 4.0
        plugin.backward((weight * 0).sum(), None)
        assert plugin.scaler.get_scale() == 8.0
    torch.testing.assert_close(weight.detach(), torch.full((2,), 1.0 - 0.1 * 2.0))  # the unscaled gradient, 2


def test_fabrics_precision_aliases_are_refused_naming_the_precisions_this_plugin_takes() -> None:
    for given in ("16", 16, "bf16", "32-true"):
        with pytest.raises(ValueError, match=re.escape("use '16-mixed', 'bf16-mixed', 'bf16-true' or 'fp8-mixed'")):
            MixedPrecisionPlugin(given)  # type: ignore[arg-type]


@pytest.mark.parametrize("context", ["forward_context", "module_init_context", "tensor_init_context"])
def test_the_default_dtype_is_restored_when_a_context_exits_with_an_error(context: str) -> None:
    plugin = MixedPrecisionPlugin("bf16-mixed", "cpu")
    with pytest.raises(RuntimeError, match="inside"), getattr(plugin, context)():
        raise RuntimeError("inside")
    assert torch.get_default_dtype() is torch.float32 and not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_fabric_clip_gradients_clips_the_unscaled_gradients_as_torch_does(clip: str) -> None:
    # Fabric's clip_gradients -> the plugin's unscale_gradients -> torch's clipping of main_params: the gradients the
    # optimizer gets equal torch's clipping of the unscaled gradients (divided by the scale here, exact: a power of 2).
    run = FabricRun(ours(), Loop(steps=1))
    x, y = batch(0, 0)
    run.fabric.backward(torch.nn.functional.mse_loss(run.model(x), y))
    expected = [p.grad.detach().clone() / START_SCALE for p in run.module.parameters()]  # type: ignore[union-attr]
    if clip == "norm":
        total = run.fabric.clip_gradients(run.model, run.optimizer, max_norm=0.1)
        assert total is not None
        _clip_norm(expected, 0.1)
    else:
        assert run.fabric.clip_gradients(run.model, run.optimizer, clip_val=0.01) is None
        expected = [g.clamp(-0.01, 0.01) for g in expected]
    for param, grad in zip(run.module.parameters(), expected, strict=True):
        assert torch.equal(param.grad, grad)  # type: ignore[arg-type]
    run.optimizer.step()
    # torch measured the norm for its clip; the check made GradScaler's one pass and measured none (nobody reads it).
    assert run.plugin.recent_steps[-1].grad_norm is None


def _clip_norm(grads: list[Tensor], max_norm: float) -> None:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    torch.nn.utils.clip_grad_norm_(params, max_norm)


def test_the_plugin_pickles_after_set_up_without_its_modules() -> None:
    # Fabric pickles its plugin to start ddp_spawn's workers; the modules it learnt from belong to this process.
    import pickle

    run = train(ours(keep_fp32=[nn.ReLU]), Loop(steps=2, overflow_at=(0,)))
    copy_ = pickle.loads(pickle.dumps(run.plugin))
    assert copy_.skipped_steps == 1 and copy_.scaler.get_scale() == run.plugin.scaler.get_scale()
    assert copy_.device == "cpu" and copy_._modules == [] and copy_._fp32_hooks == []


# ------------------------------------------------------------------------------ several optimizers, one backward
def two_optimizer_run(plugin: Precision, *, split: bool, steps: int = 4) -> list[list[Tensor]]:
    """One backward, then either two SGD optimizers (one per layer, stepped in turn) or one over both layers."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    module = make_model()
    groups = [list(module[0].parameters()), list(module[2].parameters())]
    optimizers = (
        [torch.optim.SGD(g, lr=0.05) for g in groups] if split else [torch.optim.SGD(groups[0] + groups[1], lr=0.05)]
    )
    model = fabric.setup_module(module)
    optimizers = [fabric.setup_optimizers(o) for o in optimizers]
    after = []
    for step in range(steps):
        x, y = batch(step, 0)
        fabric.backward(torch.nn.functional.mse_loss(model(x), y) * (math.inf if step == 1 else 1.0))
        for optimizer in optimizers:
            fabric.clip_gradients(model, optimizer, max_norm=10.0, error_if_nonfinite=False)
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()
        after.append([p.detach().clone() for p in model.parameters()])
    return after


def test_two_optimizers_stepped_after_one_backward_unscale_by_the_scale_their_gradients_carry() -> None:
    # The loss scale moves once per iteration, at the next backward: the second optimizer's gradients are unscaled by
    # the scale they were scaled with. Moving it after each optimizer step (as Fabric's built-in does, reproduced
    # below) halves the second optimizer's gradients when the scale grows, and doubles them when it backs off.
    def scaler() -> DynamicLossScaler:
        return DynamicLossScaler(init_scale=START_SCALE, growth_interval=1)  # grows at every clean step

    split = two_optimizer_run(MixedPrecisionPlugin("16-mixed", "cpu", scaler()), split=True)
    joint = two_optimizer_run(MixedPrecisionPlugin("16-mixed", "cpu", scaler()), split=False)
    for step, (a, b) in enumerate(zip(split, joint, strict=True)):
        for p, q in zip(a, b, strict=True):
            assert torch.equal(p, q), f"step {step}"
    gradscaler = torch.amp.GradScaler("cpu", init_scale=START_SCALE, growth_interval=1)
    builtin = two_optimizer_run(MixedPrecision("16-mixed", "cpu", scaler=gradscaler), split=True)
    assert not torch.equal(builtin[0][2], joint[0][2])  # premise: Fabric's built-in gets the second layer wrong


def test_the_scale_move_a_step_leaves_pending_is_in_the_saved_state() -> None:
    run = train(ours(), Loop(steps=1, overflow_at=(0,)))
    assert run.plugin.state_dict()["scaler"]["scale"] == START_SCALE / 2


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-fused"])
def test_skips_at_the_floor_stop_training_with_a_diagnosis_on_either_path(optimizer: Any) -> None:
    # At min_scale a skip cannot be helped by backing off: after max_consecutive_skips of them training stops, in that
    # optimizer.step() on both paths (on the fused path the steps' values are read at the first step by which the
    # limit could have been reached, while the gradients are there to name).
    scaler = DynamicLossScaler(init_scale=1.0, min_scale=1.0, max_consecutive_skips=2)
    run = FabricRun(
        MixedPrecisionPlugin("16-mixed", "cpu", scaler), Loop(steps=5, overflow_at=tuple(range(5)), optimizer=optimizer)
    )
    with pytest.raises(FloatingPointError, match="skipped") as caught:
        run.run()
    assert "2 optimizer steps in a row were skipped with the loss scale at its floor" in str(caught.value)
    assert "non-finite gradients in 4 parameter(s): 0.weight, 0.bias, 2.weight, 2.bias" in str(caught.value)
    assert run.next_step <= 3
    torch.manual_seed(0)  # FabricRun's initial weights: no step was applied
    assert all(torch.equal(p, q) for p, q in zip(run.module.parameters(), make_model().parameters(), strict=True))
