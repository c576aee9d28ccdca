"""``MixedPrecisionMonitor`` in real Lightning runs on CPU: what it logs, what it finds, what it does about it.

Faults are injected at chosen optimizer steps (``trainer.global_step`` inside the step is the index of the step
being taken): ``Faulty(overflow_steps=...)`` multiplies the loss by inf, so every gradient is non-finite;
``grad_inf_steps=...`` puts one inf into ``net.2.weight``'s gradient only; ``nan_weight_at=k`` sets
``net.0.weight[0, 0]`` to NaN once ``k`` optimizer steps are done (in the module's ``on_train_batch_end``, which runs
after the callbacks').

The metrics are read back from what a real logger wrote (``CSVLogger``'s ``metrics.csv``, TensorBoard's event file),
with ``log_every_n_steps=1`` so that every optimizer step is written. fp16 runs start at ``init_scale=2**10``: at the
default 2**16 this model overflows fp16 on its own at the first steps, and these tests want only the injected skips.
"""

from __future__ import annotations

import csv
import math
import re
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import FP16_ON_CPU_WARNING, INF, PNG_SIGNATURE, TinyRegressor, loader, make_trainer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionMonitor, MixedPrecisionPlugin

pytestmark = pytest.mark.filterwarnings(FP16_ON_CPU_WARNING)

NAN = float("nan")
ALL_PARAMETERS = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


# ------------------------------------------------------------------------------------------------------ set-up
class Faulty(TinyRegressor):
    """``TinyRegressor`` with two more faults: an inf in one gradient, and a weight turned NaN.

    Args:
        overflow_steps: optimizer steps whose loss is multiplied by inf (every gradient non-finite).
        grad_inf_steps: optimizer steps at which ``net.2.weight.grad[0, 0]`` is set to inf after the backward (under a
            loss scaler the gradient is still scaled there; inf stays inf after unscaling).
        nan_weight_at: once this many optimizer steps are done, ``net.0.weight[0, 0]`` is set to NaN.
    """

    def __init__(
        self, overflow_steps: Iterable[int] = (), grad_inf_steps: Iterable[int] = (), nan_weight_at: int | None = None
    ) -> None:
        super().__init__(overflow_steps=overflow_steps)
        self.grad_inf_steps = set(grad_inf_steps)
        self.nan_weight_at = nan_weight_at

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.grad_inf_steps:
            self.net[2].weight.grad[0, 0] = INF

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == self.nan_weight_at:
            with torch.no_grad():
                self.net[0].weight[0, 0] = NAN


class StepRecorder(pl.Callback):
    """An independent record of every optimizer step, read from the trainer rather than from the monitor.

    ``scale_at_start``: ``trainer.scaler.get_scale()`` at batch start (the scale the step's loss is multiplied by);
    ``scale_used``/``skipped``: our plugin's last step's scale and skip at batch end;
    ``norms``: in ``on_before_optimizer_step`` (gradients already unscaled), the global L2 norm of the gradients the
    way ``torch.nn.utils.clip_grad_norm_`` takes it: the float32 norm of the float32 per-tensor norms.
    """

    def __init__(self) -> None:
        self.scale_at_start: list[float] = []
        self.scale_used: list[float | None] = []
        self.skipped: list[bool] = []
        self.norms: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.scaler is not None:
            self.scale_at_start.append(float(trainer.scaler.get_scale()))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad.detach() for p in pl_module.parameters() if p.grad is not None]
        per_tensor = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
        self.norms.append(float(torch.linalg.vector_norm(per_tensor)))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        plugin = trainer.precision_plugin
        if isinstance(plugin, MixedPrecisionPlugin):
            self.scale_used.append(plugin.recent_steps[-1].scale)
            self.skipped.append(plugin.recent_steps[-1].skipped)


def fp16_plugin(**scaler_kwargs: Any) -> MixedPrecisionPlugin:
    scaler = DynamicLossScaler(**{"init_scale": 2.0**10, **scaler_kwargs})
    return MixedPrecisionPlugin("16-mixed", device="cpu", scaler=scaler)


def bf16_plugin(**kwargs: Any) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("bf16-mixed", device="cpu", **kwargs)


def lightning_fp16_plugin(growth_interval: int) -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval)
    return MixedPrecision("16-mixed", "cpu", scaler=scaler)


def fit(
    model: pl.LightningModule,
    plugin: Any = None,
    *,
    monitor: MixedPrecisionMonitor | None = None,
    steps: int = 6,
    log_dir: Path | None = None,
    callbacks: Iterable[pl.Callback] = (),
    **trainer_kwargs: Any,
) -> SimpleNamespace:
    """Fit ``model`` for ``steps`` optimizer steps with the monitor first among the callbacks.

    With ``log_dir``, a ``CSVLogger`` there receives every step's metrics. Returns the trainer, the monitor and the
    model.
    """
    monitor = monitor if monitor is not None else MixedPrecisionMonitor()
    if log_dir is not None:
        trainer_kwargs.setdefault("logger", CSVLogger(log_dir, name="csv"))
        trainer_kwargs.setdefault("log_every_n_steps", 1)
    trainer = make_trainer(plugin, max_steps=steps, max_epochs=-1, callbacks=[monitor, *callbacks], **trainer_kwargs)
    trainer.fit(model, loader())
    return SimpleNamespace(trainer=trainer, monitor=monitor, model=model)


def read_csv(log_dir: str | Path) -> dict[str, list[float]]:
    """``metrics.csv`` in ``log_dir`` as columns of floats (an empty cell is NaN)."""
    with (Path(log_dir) / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    return {key: [float(row[key]) if row[key] != "" else NAN for row in rows] for key in rows[0]}


def read_csv_metrics(trainer: pl.Trainer) -> dict[str, list[float]]:
    """What the trainer's CSVLogger wrote, as columns, checked to hold one row per optimizer step of the run."""
    columns = read_csv(trainer.logger.log_dir)
    assert columns["step"] == list(range(trainer.global_step)), "expected exactly one row per optimizer step"
    return columns


def scales_by_the_rules(init_scale: float, growth_interval: int, skipped: set[int], steps: int) -> list[float]:
    """The scale each step runs with under GradScaler's policy (hysteresis 1, factors 2 and 1/2, no bounds hit)."""
    scale, clean, scales = init_scale, 0, []
    for step in range(steps):
        scales.append(scale)
        if step in skipped:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == growth_interval:
                scale, clean = scale * 2, 0
    return scales


def running_total(flags: Iterable[float]) -> list[float]:
    total, out = 0.0, []
    for flag in flags:
        total += flag
        out.append(total)
    return out


def fit_catching_warnings(*args: Any, **kwargs: Any) -> tuple[SimpleNamespace, list[warnings.WarningMessage]]:
    """``fit``, recording every warning it raises (repeats included) instead of showing them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = fit(*args, **kwargs)
    return run, caught


def messages(caught: list[warnings.WarningMessage], containing: str) -> list[str]:
    return [str(w.message) for w in caught if containing in str(w.message)]


# ----------------------------------------------------------------------- one fp16 run under our plugin, read back
FP16_STEPS = 20
FP16_GROWTH_INTERVAL = 3
FP16_OVERFLOW_STEPS = {2, 7, 8, 15}  # loss * inf: every gradient overflows
FP16_GRAD_INF_STEPS = {11}  # one inf in net.2.weight's gradient only
FP16_SKIPPED = FP16_OVERFLOW_STEPS | FP16_GRAD_INF_STEPS


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    torch.manual_seed(0)
    recorder = StepRecorder()
    # The injected non-finite loss is found by the autopsy and said (a warning the tests of the autopsy check).
    with pytest.warns(RuntimeWarning, match="the loss is non-finite though every module's output is finite"):
        run = fit(
            Faulty(overflow_steps=FP16_OVERFLOW_STEPS, grad_inf_steps=FP16_GRAD_INF_STEPS),
            fp16_plugin(growth_interval=FP16_GROWTH_INTERVAL),
            steps=FP16_STEPS,
            log_dir=tmp_path_factory.mktemp("fp16"),
            callbacks=[recorder],
        )
    run.recorder = recorder
    run.metrics = read_csv_metrics(run.trainer)
    # The run is what the tests below assume: the injected skips, and no others.
    assert {step for step, skipped in enumerate(recorder.skipped) if skipped} == FP16_SKIPPED
    return run


def test_logged_loss_scale_is_the_scale_each_step_was_taken_with(fp16_run):
    logged = fp16_run.metrics["amp/loss_scale"]
    assert logged == fp16_run.recorder.scale_used
    assert logged == fp16_run.recorder.scale_at_start
    assert logged == scales_by_the_rules(2.0**10, FP16_GROWTH_INTERVAL, FP16_SKIPPED, FP16_STEPS)


def test_step_skipped_is_one_exactly_at_the_skipped_steps(fp16_run):
    assert fp16_run.metrics["amp/step_skipped"] == [float(skipped) for skipped in fp16_run.recorder.skipped]
    assert fp16_run.monitor.history.skipped == sorted(FP16_SKIPPED)


def test_skipped_steps_is_the_running_total_of_skips(fp16_run):
    logged = fp16_run.metrics["amp/skipped_steps"]
    assert logged == running_total(fp16_run.metrics["amp/step_skipped"])
    assert logged[-1] == len(FP16_SKIPPED) == fp16_run.trainer.precision_plugin.skipped_steps


def test_overflow_events_name_exactly_the_parameters_that_overflowed(fp16_run):
    overflows = [(step, names) for step, kind, names in fp16_run.monitor.history.nonfinite_events]
    expected = {step: ALL_PARAMETERS for step in FP16_OVERFLOW_STEPS} | {11: ["net.2.weight"]}
    assert overflows == sorted(expected.items())
    assert {kind for _, kind, _ in fp16_run.monitor.history.nonfinite_events} == {"overflowed gradients"}


def test_logged_grad_norm_is_the_norm_of_the_unscaled_gradients(fp16_run):
    logged = fp16_run.metrics["amp/grad_norm"]
    reference = fp16_run.recorder.norms
    assert len(logged) == len(reference) == FP16_STEPS
    for step, (ours, theirs) in enumerate(zip(logged, reference, strict=True)):
        if step in FP16_SKIPPED:
            assert not math.isfinite(ours) and not math.isfinite(theirs)
        else:
            # Same float32 gradients (unscaled by a power of two: exact), two float32 reductions in different orders
            # (ours: sum of squared per-tensor norms then sqrt; torch: norm of the per-tensor norms), a few ulps
            # (~1e-7) apart; `self.log` then rounds the value to float32 (<= 6e-8). A scaled norm would be 2**8 to
            # 2**10 off, a norm missing a tensor or taken after clipping off by far more than 1e-6.
            assert ours == pytest.approx(theirs, rel=1e-6, abs=0), f"step {step}"


def test_monitor_history_matches_what_was_logged(fp16_run):
    history = fp16_run.monitor.history.steps
    assert [r.step for r in history] == list(range(FP16_STEPS))
    assert [r.scale for r in history] == fp16_run.metrics["amp/loss_scale"]
    assert history[-1].grad_norm == fp16_run.trainer.precision_plugin.recent_steps[-1].grad_norm
    # The logger gets `self.log`'s float32 copy of the plugin's own norm, bit for bit.
    for record, logged in zip(history, fp16_run.metrics["amp/grad_norm"], strict=True):
        if math.isfinite(logged):
            assert torch.tensor(record.grad_norm, dtype=torch.float32).item() == logged


# ------------------------------------------------------------------------------- Lightning's own plugin, 32-true
LIGHTNING_STEPS = 12
LIGHTNING_GROWTH_INTERVAL = 3
LIGHTNING_OVERFLOW_STEPS = {2, 7, 8}


@pytest.fixture(scope="module")
def lightning_fp16_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    torch.manual_seed(0)
    recorder = StepRecorder()
    run = fit(
        Faulty(overflow_steps=LIGHTNING_OVERFLOW_STEPS),
        lightning_fp16_plugin(LIGHTNING_GROWTH_INTERVAL),
        steps=LIGHTNING_STEPS,
        log_dir=tmp_path_factory.mktemp("lightning_fp16"),
        callbacks=[recorder],
    )
    run.recorder = recorder
    run.metrics = read_csv_metrics(run.trainer)
    return run


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    torch.manual_seed(0)
    run = fit(Faulty(), steps=6, log_dir=tmp_path_factory.mktemp("fp32"))
    run.metrics = read_csv_metrics(run.trainer)
    return run


def test_under_lightnings_mixed_precision_the_logged_scale_is_the_grad_scalers(lightning_fp16_run):
    logged = lightning_fp16_run.metrics["amp/loss_scale"]
    assert logged == lightning_fp16_run.recorder.scale_at_start
    skipped = LIGHTNING_OVERFLOW_STEPS
    assert logged == scales_by_the_rules(2.0**10, LIGHTNING_GROWTH_INTERVAL, skipped, LIGHTNING_STEPS)


def test_under_lightnings_mixed_precision_skips_are_detected_from_the_scale_backoff(lightning_fp16_run):
    flags = lightning_fp16_run.metrics["amp/step_skipped"]
    assert flags == [float(step in LIGHTNING_OVERFLOW_STEPS) for step in range(LIGHTNING_STEPS)]
    assert lightning_fp16_run.metrics["amp/skipped_steps"] == running_total(flags)
    assert lightning_fp16_run.monitor.history.skipped == sorted(LIGHTNING_OVERFLOW_STEPS)


@pytest.mark.parametrize("run_name", ["lightning_fp16_run", "fp32_run"])
def test_grad_norm_is_not_logged_without_our_plugin(run_name, request):
    run = request.getfixturevalue(run_name)
    assert "amp/grad_norm" not in run.metrics
    assert all(record.grad_norm is None for record in run.monitor.history.steps)


def test_under_32_true_there_is_no_loss_scale_and_no_skip(fp32_run):
    assert "amp/loss_scale" not in fp32_run.metrics
    assert fp32_run.metrics["amp/skipped_steps"] == [0.0] * 6
    assert fp32_run.metrics["amp/step_skipped"] == [0.0] * 6


def test_process_memory_is_logged_on_cpu(fp32_run):
    rss = fp32_run.metrics["amp/cpu_rss_mb"]
    assert len(rss) == 6
    assert all(value > 0 for value in rss)
    assert not any(key.startswith("amp/cuda") for key in fp32_run.metrics)


def test_log_memory_false_logs_no_memory(tmp_path):
    run = fit(Faulty(), steps=3, log_dir=tmp_path, monitor=MixedPrecisionMonitor(log_memory=False))
    assert not any(key.endswith("_mb") for key in read_csv_metrics(run.trainer))


# ---------------------------------------------------------------------------------- a parameter that turns NaN
# Under the bf16 plugin (which skips steps with non-finite gradients) the NaN weight makes every later step skip, so
# net.0.weight stays the only non-finite parameter. It turns NaN once 3 steps are done (after the monitor's check of
# that batch); the monitor checks the parameters after each step and finds it after the next one, step index 3 (events
# carry the index of the optimizer step after which they were found, as overflow events and history do).
NAN_AT = 3


def test_warn_policy_warns_naming_the_nan_parameter():
    monitor = MixedPrecisionMonitor(on_nonfinite="warn")
    run, caught = fit_catching_warnings(Faulty(nan_weight_at=NAN_AT), bf16_plugin(), monitor=monitor)
    said = messages(caught, "non-finite parameters")
    assert said[0] == "MixedPrecisionMonitor: non-finite parameters at step 3: net.0.weight."
    assert all(w.category is UserWarning for w in caught if "non-finite parameters" in str(w.message))
    # The skipped step's autopsy found the NaN weight's layer too (and said it is not a precision problem).
    assert [(a.kind, a.module) for a in monitor.autopsies] == [("forward", "net.0")]
    assert run.trainer.global_step == 6  # warning does not stop training
    found_at = [step for step, kind, _ in run.monitor.history.nonfinite_events if kind == "parameters"]
    assert found_at == [3, 4, 5]


def test_raise_policy_raises_floating_point_error_naming_the_nan_parameter():
    model = Faulty(nan_weight_at=NAN_AT)
    with (
        pytest.raises(FloatingPointError, match=re.escape("non-finite parameters at step 3: net.0.weight.")),
        pytest.warns(RuntimeWarning, match="forward output is NaN from finite inputs"),  # the autopsy's finding
    ):
        fit(model, bf16_plugin(), monitor=MixedPrecisionMonitor(on_nonfinite="raise"))
    assert model.trainer.global_step == 4


def test_stop_policy_ends_fit_after_the_step_and_saves_a_debug_file(tmp_path):
    monitor = MixedPrecisionMonitor(on_nonfinite="stop")
    run, caught = fit_catching_warnings(
        Faulty(nan_weight_at=NAN_AT), bf16_plugin(), monitor=monitor, steps=10, default_root_dir=tmp_path
    )
    assert len(said := messages(caught, "Training stops")) == 1
    assert str(monitor.debug_path) in said[0]
    trainer = run.trainer
    assert trainer.global_step == NAN_AT + 1
    assert trainer.should_stop
    assert trainer.state.finished and not trainer.interrupted
    assert monitor.debug_path is not None
    assert monitor.debug_path.parent == tmp_path
    debug = torch.load(monitor.debug_path, weights_only=True)
    assert debug["names"] == ["net.0.weight"]
    assert debug["kind"] == "parameters"
    assert debug["global_step"] == NAN_AT + 1
    state = debug["state_dict"]
    assert set(state) == set(ALL_PARAMETERS)
    assert math.isnan(state["net.0.weight"][0, 0])
    assert all(torch.isfinite(value).all() for name, value in state.items() if name != "net.0.weight")


# ------------------------------------------------------------------------------------------------- check_interval
def test_check_interval_reports_a_nan_parameter_at_the_next_multiple_and_not_before():
    monitor = MixedPrecisionMonitor(check_interval=5)
    fit_catching_warnings(Faulty(nan_weight_at=7), bf16_plugin(), monitor=monitor, steps=16)
    found_at = [step for step, kind, _ in monitor.history.nonfinite_events if kind == "parameters"]
    # Checked after every 5th step (indices 4, 9, 14): the NaN set after step index 6 is first seen after index 9.
    assert found_at == [9, 14]


def test_check_interval_zero_is_refused_because_its_summary_would_claim_a_check_never_made():
    # It used to be accepted, checked nothing, and the summary said "no non-finite parameters or gradients found".
    with pytest.raises(ValueError, match=r"check_interval=0\)` .*>= 1, e\.g\. 1 \(every step\)"):
        MixedPrecisionMonitor(check_interval=0)


@pytest.mark.parametrize("flag", ["prog_bar", "log_memory"])
def test_flags_must_be_bools_as_the_plugins_flags_are(flag):
    with pytest.raises(TypeError, match=rf"MixedPrecisionMonitor\({flag}='no'\)` must be True or False"):
        MixedPrecisionMonitor(**{flag: "no"})


BAD_ARGUMENTS = [
    ({"check_interval": -1}, "check_interval=-1"),
    ({"check_interval": 2.5}, "check_interval=2.5"),
    ({"check_interval": True}, "check_interval=True"),
    ({"on_nonfinite": "ignore"}, "on_nonfinite='ignore'"),
    ({"skip_window": 0}, "skip_window=0"),
    ({"skip_warn_rate": 1.5}, "skip_warn_rate=1.5"),
    ({"skip_warn_rate": -0.1}, "skip_warn_rate=-0.1"),
    ({"skip_warn_rate": NAN}, "skip_warn_rate=nan"),
]


@pytest.mark.parametrize(("kwargs", "named"), BAD_ARGUMENTS, ids=[named for _, named in BAD_ARGUMENTS])
def test_bad_constructor_arguments_raise_value_error_naming_argument_and_value(kwargs, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        MixedPrecisionMonitor(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"skip_window": True}, "skip_window=True"),
        ({"skip_window": "100"}, "skip_window='100'"),
        ({"check_interval": "1"}, "check_interval='1'"),
        ({"skip_warn_rate": True}, "skip_warn_rate=True"),
        ({"skip_warn_rate": "0.05"}, "skip_warn_rate='0.05'"),
    ],
)
def test_a_bool_or_a_string_for_a_number_is_refused_naming_the_argument(kwargs, named):
    with pytest.raises(ValueError, match=re.escape(f"MixedPrecisionMonitor({named})` must be")):
        MixedPrecisionMonitor(**kwargs)


def test_numpy_numbers_are_accepted_and_the_run_records_what_python_numbers_give():
    numbers = {"check_interval": 2, "skip_window": 4, "skip_warn_rate": 0.5}
    numpy_monitor = MixedPrecisionMonitor(
        check_interval=np.int64(2), skip_window=np.int32(4), skip_warn_rate=np.float32(0.5)
    )
    assert {name: getattr(numpy_monitor, name) for name in numbers} == numbers
    assert all(type(getattr(numpy_monitor, name)) is type(value) for name, value in numbers.items())
    torch.manual_seed(0)
    plain = fit(Faulty(overflow_steps={1}), fp16_plugin(), monitor=MixedPrecisionMonitor(**numbers))
    torch.manual_seed(0)
    numpy = fit(Faulty(overflow_steps={1}), fp16_plugin(), monitor=numpy_monitor)

    def seen(run: SimpleNamespace) -> list[tuple[Any, ...]]:  # memory differs from run to run; nan != nan
        return [(r.step, r.scale, r.skipped, repr(r.grad_norm)) for r in run.monitor.history.steps]

    assert seen(numpy) == seen(plain) and len(seen(plain)) == 6
    assert numpy.monitor.history.skipped == plain.monitor.history.skipped == [1]


# ------------------------------------------------------------------------------------------ unguarded gradients
# An inf in net.2.weight's gradient at step 3. Nothing else checks gradients under 32-true, nor under the bf16 plugin
# with skip_nonfinite=False: the monitor does, and names the parameter.
UNGUARDED = {"32-true": lambda: None, "bf16-unchecked": lambda: bf16_plugin(skip_nonfinite=False)}


@pytest.mark.parametrize("precision", list(UNGUARDED))
def test_unguarded_nonfinite_gradient_is_reported_by_name(precision):
    monitor = MixedPrecisionMonitor(on_nonfinite="warn")
    _, caught = fit_catching_warnings(Faulty(grad_inf_steps={3}), UNGUARDED[precision](), monitor=monitor)
    assert messages(caught, "non-finite")[0] == "MixedPrecisionMonitor: non-finite gradients at step 3: net.2.weight."
    assert monitor.history.nonfinite_events[0] == (3, "gradients", ["net.2.weight"])
    assert monitor.history.skipped == []


@pytest.mark.parametrize("precision", list(UNGUARDED))
def test_unguarded_nonfinite_gradient_with_raise_policy_raises_naming_it(precision):
    model = Faulty(grad_inf_steps={3})
    with pytest.raises(FloatingPointError, match=re.escape("non-finite gradients at step 3: net.2.weight.")):
        fit(model, UNGUARDED[precision](), monitor=MixedPrecisionMonitor(on_nonfinite="raise"))
    # Raised before the optimizer step: the inf never reached the weights.
    assert torch.isfinite(model.net[2].weight).all()


def test_nonfinite_gradient_under_the_fp16_plugin_is_an_overflow_not_an_error():
    monitor = MixedPrecisionMonitor(on_nonfinite="raise")
    run = fit(Faulty(grad_inf_steps={3}), fp16_plugin(), monitor=monitor)
    assert run.trainer.global_step == 6
    assert monitor.history.skipped == [3]
    assert monitor.history.nonfinite_events == [(3, "overflowed gradients", ["net.2.weight"])]
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


# ------------------------------------------------------------------------------------------------------- warnings
def _skip_warnings(overflow_steps: set[int], steps: int = 10) -> list[str]:
    monitor = MixedPrecisionMonitor(skip_window=10, skip_warn_rate=0.2)
    _, caught = fit_catching_warnings(
        Faulty(overflow_steps=overflow_steps), fp16_plugin(), monitor=monitor, steps=steps
    )
    return [m for w in caught if w.category is RuntimeWarning for m in messages([w], "optimizer steps were skipped")]


def test_skip_rate_above_the_threshold_warns():
    said = _skip_warnings({1, 3, 5})  # 3 of 10: 30% > 20%
    assert len(said) == 1
    assert "3 of the last 10 optimizer steps were skipped" in said[0]
    assert "more than 20%" in said[0]


def test_skip_rate_at_the_threshold_does_not_warn():
    assert _skip_warnings({1, 3}) == []  # 2 of 10: 20%, not more


def test_scale_reaching_its_floor_warns_once():
    # Every step overflows: the scale runs 4, 2, 1, 1, 1, 1 and the step at 1 still overflows.
    model = Faulty(overflow_steps=range(100))
    plugin = fp16_plugin(init_scale=4.0, min_scale=1.0, max_consecutive_skips=None)
    _, caught = fit_catching_warnings(model, plugin)
    floor = [w for w in caught if "reached its floor" in str(w.message)]
    assert len(floor) == 1
    assert floor[0].category is RuntimeWarning
    assert "min_scale=1" in str(floor[0].message)
    assert "at step 2" in str(floor[0].message)


def test_scale_that_starts_at_its_floor_without_overflows_does_not_warn():
    # A scale of 1 is a legitimate choice; the floor warning says gradients overflow even unscaled, which is false here.
    plugin = fp16_plugin(init_scale=1.0, min_scale=1.0)
    run, caught = fit_catching_warnings(Faulty(), plugin)
    assert run.monitor.history.skipped == []
    assert not messages(caught, "reached its floor")


# -------------------------------------------------------------------------------------------------------- loggers
@pytest.mark.parametrize("logger_kind", ["csv", "tensorboard"])
def test_metrics_reach_a_real_logger(logger_kind, tmp_path):
    steps = 6
    if logger_kind == "csv":
        logger: Any = CSVLogger(tmp_path)
    else:
        logger = TensorBoardLogger(tmp_path)
    run = fit(Faulty(overflow_steps={2}), fp16_plugin(), steps=steps, logger=logger, log_every_n_steps=1)
    expected = [record.scale for record in run.monitor.history.steps]
    assert expected == [2.0**10] * 3 + [2.0**9] * 3
    if logger_kind == "csv":
        assert read_csv_metrics(run.trainer)["amp/loss_scale"] == expected
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    assert "amp/loss_scale" in events.Tags()["scalars"]
    points = events.Scalars("amp/loss_scale")
    assert [p.step for p in points] == list(range(steps))
    assert [p.value for p in points] == expected
    assert "amp/skipped_steps" in events.Tags()["scalars"]


# -------------------------------------------------------------------------------------------- summary and chart
def test_summary_is_printed_once_at_fit_end(capsys):
    run = fit(Faulty(overflow_steps={2}), fp16_plugin())
    out = capsys.readouterr().out
    assert out.count("optimizer steps") == 1
    assert "6 optimizer steps, 1 skipped (16.7%)" in out
    assert "loss scale 2**9 to 2**10, last 2**9" in out
    assert run.trainer.global_step == 6


def test_report_path_writes_a_png_that_matplotlib_reads_back(tmp_path):
    import matplotlib.image

    path = tmp_path / "charts" / "amp.png"
    fit(Faulty(overflow_steps={2}), fp16_plugin(), monitor=MixedPrecisionMonitor(report_path=path))
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_a_chart_whose_name_is_taken_goes_to_the_next_free_name_and_the_output_says_so(tmp_path, capsys):
    path = tmp_path / "amp.png"
    path.write_bytes(b"the first run's chart")
    monitor = MixedPrecisionMonitor(report_path=path)
    fit(Faulty(), fp16_plugin(), monitor=monitor, steps=2)
    assert path.read_bytes() == b"the first run's chart"  # left as it was
    assert (tmp_path / "amp-1.png").read_bytes().startswith(PNG_SIGNATURE)
    said = f"chart written to {tmp_path / 'amp-1.png'} ({path} exists: it was left as it was)"
    assert said in capsys.readouterr().out
    assert monitor.write_chart() == tmp_path / "amp-2.png"  # and again, by hand


class StopAt(pl.Callback):
    """Raises ``error`` at the start of optimizer step ``step`` (inside fit, as Ctrl-C or a failure would)."""

    def __init__(self, step: int, error: BaseException) -> None:
        self.step, self.error = step, error

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise self.error


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("a bug")], ids=["ctrl-c", "error"])
def test_a_fit_that_stops_early_still_prints_the_summary_and_writes_the_chart(tmp_path, capsys, error):
    # Ctrl-C takes Lightning's graceful shutdown (it exits with sys.exit(1)); an error propagates: on_fit_end never
    # runs in either case.
    path = tmp_path / "amp.png"
    with pytest.raises(SystemExit if isinstance(error, KeyboardInterrupt) else RuntimeError):
        fit(Faulty(overflow_steps={1}), fp16_plugin(), monitor=MixedPrecisionMonitor(report_path=path), steps=6,
            callbacks=[StopAt(3, error)])  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("MixedPrecisionMonitor: 3 optimizer steps, 1 skipped (33.3%) at step 1") == 1
    assert f"chart written to {path}" in out and path.read_bytes().startswith(PNG_SIGNATURE)


def test_an_error_before_training_prints_no_summary(tmp_path, capsys):
    class BrokenSetup(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            raise RuntimeError("no data here")

    with pytest.raises(RuntimeError, match="no data here"):
        fit(Faulty(), fp16_plugin(), monitor=MixedPrecisionMonitor(report_path=tmp_path / "amp.png"),
            callbacks=[BrokenSetup()])  # fmt: skip
    assert "MixedPrecisionMonitor" not in capsys.readouterr().out and not (tmp_path / "amp.png").exists()


def test_writing_the_chart_leaves_matplotlibs_backend_alone(tmp_path):
    import matplotlib

    before = matplotlib.get_backend()
    matplotlib.use("pdf")  # the user's choice, non-interactive so the test needs no display
    try:
        monitor = MixedPrecisionMonitor(report_path=tmp_path / "amp.png")
        assert matplotlib.get_backend() == "pdf"
        fit(Faulty(), fp16_plugin(), monitor=monitor, steps=2)
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use(before)
    assert (tmp_path / "amp.png").read_bytes().startswith(PNG_SIGNATURE)


def test_report_path_without_matplotlib_raises_import_error_saying_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    with pytest.raises(ImportError, match=re.escape("pip install 'lightning-amp-plus[report]'")):
        MixedPrecisionMonitor(report_path=tmp_path / "amp.png")


def test_monitor_without_report_path_needs_no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    run = fit(Faulty(), steps=2)
    assert len(run.monitor.history.steps) == 2


# ----------------------------------------------------------------------------------------------- progress bar
@pytest.mark.parametrize("prog_bar", [True, False])
def test_loss_scale_is_on_the_progress_bar_only_when_asked(prog_bar):
    run = fit(Faulty(), fp16_plugin(), monitor=MixedPrecisionMonitor(prog_bar=prog_bar), steps=3)
    metrics = run.trainer.progress_bar_metrics
    assert ("amp/loss_scale" in metrics) is prog_bar
    if prog_bar:
        assert metrics["amp/loss_scale"] == 2.0**10
    assert not any(key.startswith("amp/") and key != "amp/loss_scale" for key in metrics)


# ---------------------------------------------------------------------------------------- accumulation, resuming
def test_with_gradient_accumulation_there_is_one_record_per_optimizer_step():
    # 8 batches, 2 per optimizer step: 4 steps; step 1's two micro-batches both overflow.
    run = fit(Faulty(overflow_steps={1}), fp16_plugin(), steps=4, accumulate_grad_batches=2)
    assert [record.step for record in run.monitor.history.steps] == [0, 1, 2, 3]
    assert run.monitor.history.skipped == [1]
    assert [record.scale for record in run.monitor.history.steps] == [2.0**10, 2.0**10, 2.0**9, 2.0**9]


# ----------------------------------------------------------------------------------------------------- resuming
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_resumed_run_does_not_count_restored_skips_as_a_new_skip(tmp_path):
    first = fit(Faulty(overflow_steps={1}), fp16_plugin(), steps=8)  # 8 steps: one epoch of the loader
    assert first.monitor.history.skipped == [1]
    checkpoint = tmp_path / "after8.ckpt"
    first.trainer.save_checkpoint(checkpoint)

    resumed = make_trainer(
        fp16_plugin(),
        max_steps=11,
        max_epochs=-1,
        callbacks=[monitor := MixedPrecisionMonitor()],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
    )
    resumed.fit(Faulty(), loader(), ckpt_path=checkpoint)
    assert resumed.precision_plugin.skipped_steps == 1  # the total, restored from the checkpoint
    assert [r.step for r in monitor.history.steps] == [8, 9, 10]
    assert monitor.history.skipped == []
    logged = read_csv(resumed.logger.log_dir)
    assert logged["step"] == [8.0, 9.0, 10.0]
    assert logged["amp/step_skipped"] == [0.0, 0.0, 0.0]
    assert logged["amp/skipped_steps"] == [1.0, 1.0, 1.0]


# --------------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_cuda_memory_is_logged_with_peak_at_least_allocated(tmp_path):
    plugin = MixedPrecisionPlugin("16-mixed", device="cuda", scaler=DynamicLossScaler(init_scale=2.0**10))
    run = fit(Faulty(), plugin, steps=4, log_dir=tmp_path, accelerator="cuda")
    metrics = read_csv_metrics(run.trainer)
    allocated, reserved, peak = (metrics[f"amp/cuda_{key}_mb"] for key in ("allocated", "reserved", "peak"))
    assert len(allocated) == 4
    for a, r, p in zip(allocated, reserved, peak, strict=True):
        assert p >= a > 0
        assert r >= a
    assert "amp/cpu_rss_mb" not in metrics
    assert run.monitor.history.memory_kind == "CUDA memory"


# ------------------------------------------------------------------------------------- cost: when it logs, stopping
def test_metrics_are_logged_only_on_the_steps_lightning_writes_yet_every_step_is_in_the_history(tmp_path):
    run = fit(Faulty(overflow_steps={6}), fp16_plugin(growth_interval=100), steps=12, log_dir=tmp_path,
              log_every_n_steps=5)  # fmt: skip
    columns = read_csv(run.trainer.logger.log_dir)
    logged = [step for step, scale in zip(columns["step"], columns["amp/loss_scale"], strict=True) if scale == scale]
    assert logged == [4.0, 9.0]  # Lightning writes after steps 5 and 10 (indices 4 and 9)
    assert [record.step for record in run.monitor.history.steps] == list(range(12))
    # The scale backed off after step 6, between two written steps: the progress bar still shows the new scale.
    assert run.trainer.progress_bar_metrics["amp/loss_scale"] == 2.0**9


def test_stop_on_unguarded_non_finite_gradients_drops_them_so_the_parameters_stay_finite(tmp_path):
    model = Faulty(grad_inf_steps={3})
    monitor = MixedPrecisionMonitor(on_nonfinite="stop")
    run, _ = fit_catching_warnings(model, None, monitor=monitor, default_root_dir=tmp_path)
    assert run.trainer.global_step == 4  # the step with the inf gradient was the last
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [kind for _, kind, _ in monitor.history.nonfinite_events] == ["gradients"]
    assert monitor.debug_path is not None and sorted(p.name for p in tmp_path.glob("amp_nonfinite_*.pt")) == [
        monitor.debug_path.name
    ]


def test_skips_while_the_scale_first_descends_from_init_scale_do_not_count_towards_the_skip_rate():
    # Steps 0-3 overflow before any step was applied (the scale finding its level), then 1 of the next 10 (10% < 20%).
    assert _skip_warnings({0, 1, 2, 3, 8}, steps=14) == []
    # The same overflows after an applied step do count: 4 of 10 > 20%.
    assert len(_skip_warnings({1, 2, 3, 4}, steps=11)) == 1


def test_a_run_that_never_applies_a_step_warns_once_its_window_is_full_of_skips():
    # A scale that can never back off (backoff_factor=1.0) overflows at every step: no step is ever applied, so the
    # skips are not the scale's first descent; without a stop limit the run would go on silently.
    plugin = fp16_plugin(init_scale=2.0**10, backoff_factor=1.0, max_consecutive_skips=None)
    monitor = MixedPrecisionMonitor(skip_window=10, skip_warn_rate=0.2)
    _, caught = fit_catching_warnings(Faulty(overflow_steps=range(100)), plugin, monitor=monitor, steps=12)
    said = messages([w for w in caught if w.category is RuntimeWarning], "optimizer steps were skipped")
    assert len(said) == 1 and "10 of the last 10 optimizer steps were skipped" in said[0]


@pytest.mark.parametrize(
    ("path", "message"),
    [("/proc/amp.png", r"report_path='/proc/amp.png'"), ("amp.txt", r"report_path='amp.txt'.*\.png")],
)
def test_a_chart_path_that_cannot_be_written_is_refused_when_the_monitor_is_built(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MixedPrecisionMonitor(report_path=path)


def test_the_step_that_stops_a_run_is_in_the_history_too():
    plugin = fp16_plugin(init_scale=1.0, min_scale=1.0, max_consecutive_skips=3)
    monitor = MixedPrecisionMonitor()
    with (
        pytest.raises(FloatingPointError),
        pytest.warns(RuntimeWarning, match="the loss scale has reached its floor"),
        pytest.warns(RuntimeWarning, match="the loss is non-finite though every module's output is finite"),
    ):
        fit(Faulty(overflow_steps=range(100)), plugin, monitor=monitor)
    assert [record.step for record in monitor.history.steps] == [0, 1, 2]
    assert all(record.skipped for record in monitor.history.steps)


def test_observing_a_plain_loops_scaler_measures_the_norm_from_then_on() -> None:
    # A DynamicLossScaler on its own checks a plain step in GradScaler's one pass and measures no norm; the monitor
    # reads the norm, so observing the scaler asks for it from the next step on (the first observed step has none).
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler, monitor = DynamicLossScaler(init_scale=2.0**8), MixedPrecisionMonitor()
    logged = []
    for _ in range(3):
        scaler.scale(model(torch.randn(8, 4)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        logged.append(monitor.observe(scaler).get("amp/grad_norm"))
    assert logged[0] is None and all(isinstance(norm, float) and norm > 0 for norm in logged[1:])
    assert [entry.grad_norm is not None for entry in monitor.history.steps] == [False, True, True]
