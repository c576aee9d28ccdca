"""The monitor's FP8 readings under ``"fp8-mixed"``: outliers kept and warned about, the metric, the summary, the chart.

The reading is the plugin's own (``plugin.fp8.checks``, tested against hand-computed float8 thresholds in
``tests/weights/test_fp8.py``); here: that the monitor reports exactly what the plugin read, under the Trainer and in a
Fabric loop, on litgpt's tiny GPT with one token x1e4 at one MLP layer's input (the outlier of
``benchmarks/bench_fp8.py``), a NaN in that layer's input, and a clean run.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from fp8_models import CPU_EMULATED, LAYER, LR, Faults, GPTModule, gpt, lm_loss, loader, tokens
from helpers import make_trainer

pytest.importorskip("torchao.float8", reason="fp8-mixed needs torchao (the fp8 extra)")
pytest.importorskip("litgpt", reason="the model is litgpt's GPT")

import lightning_amp_plus.fabric as amp_fabric
from lightning_amp_plus import MixedPrecisionMonitor, MixedPrecisionPlugin

pytestmark = pytest.mark.filterwarnings(CPU_EMULATED)

OUTLIER = 1e4
NAME = f"gpt.{LAYER}"  # under the Trainer, as the LightningModule's named_modules() names it
FLUSH_WARNING = r"FP8 layer `gpt\.transformer\.h\.0\.mlp\.proj` flushed .*% of its input cast's nonzero values"


def fit(plugin: MixedPrecisionPlugin, monitor: MixedPrecisionMonitor, module: GPTModule, steps: int) -> Any:
    run = make_trainer(plugins=[plugin], callbacks=[monitor], max_steps=steps)
    run.fit(module, loader(range(steps)))
    return run


def monitor_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("MixedPrecisionMonitor: FP8")]


def expected_outliers(plugin: Any, threshold: float) -> list[tuple[str, str, float]]:
    """What the plugin read above ``threshold``: the reference the monitor's records must equal."""
    return [
        (reading.layer, reading.cast, reading.flushed_pct)
        for check in plugin.fp8.checks
        for reading in check.readings
        if reading.flushed_pct > threshold
    ]


def test_an_outlier_layer_is_recorded_warned_about_once_and_logged_under_the_trainer() -> None:
    plugin = MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1, fp8_fallback=None)
    monitor = MixedPrecisionMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = fit(plugin, monitor, GPTModule(faulty=range(3), factor=OUTLIER), 3)
    found = [(o.layer, o.cast, o.flushed_pct) for o in monitor.fp8_outliers]
    assert found == expected_outliers(plugin, 1.0)
    assert {(o.step, o.layer, o.cast) for o in monitor.fp8_outliers} >= {(s, NAME, "input") for s in range(3)}
    said = monitor_warnings(caught)
    assert len([m for m in said if re.search(FLUSH_WARNING, m)]) == 1  # once per layer and cast, not per step
    assert len(said) == len({(o.layer, o.cast) for o in monitor.fp8_outliers})
    last = max(reading.flushed_pct for reading in plugin.fp8.checks[-1].readings)
    assert run.callback_metrics["amp/fp8_flushed_max"].item() == pytest.approx(last)
    assert f"`{NAME}` input (worst " in monitor.summary()


def test_a_clean_run_records_nothing_and_warns_nothing() -> None:
    plugin = MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1)
    monitor = MixedPrecisionMonitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(plugin, monitor, GPTModule(), 3)
    assert monitor.fp8_outliers == [] and monitor_warnings(caught) == []
    assert expected_outliers(plugin, 1.0) == []  # the plugin read nothing above 1% either
    assert [point.step for point in monitor.history.fp8.checks] == [0, 1, 2]
    assert "FP8 readings at 3 check steps of 9 FP8 layers: no cast flushed more than 1%" in monitor.summary()


def test_a_nan_in_one_fp8_layer_is_named_in_the_summary_as_where_it_started() -> None:
    plugin = MixedPrecisionPlugin("fp8-mixed")
    monitor = MixedPrecisionMonitor()
    with pytest.warns(RuntimeWarning, match="MixedPrecisionMonitor: step 1"):  # the autopsy's, after the reading
        fit(plugin, monitor, GPTModule(faulty=[1]), 3)
    assert plugin.skipped_steps == 1
    step, layers = monitor.history.fp8.nonfinite[0]
    assert step == 1 and layers[0] == NAME
    assert f"at skipped step 1 the non-finite values met FP8 layer `{NAME}` first (then `" in monitor.summary()


def test_a_fallback_shows_in_the_summary_and_the_chart(tmp_path: Path) -> None:
    plugin = MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1, fp8_fallback=1.0)
    monitor = MixedPrecisionMonitor(report_path=tmp_path / "amp.png")
    with pytest.warns(UserWarning, match=FLUSH_WARNING):
        fit(plugin, monitor, GPTModule(faulty=range(4), factor=OUTLIER), 4)
    assert plugin.fp8.fallen_back == [NAME]
    assert monitor.history.fp8.fell_back == [(1, NAME)]  # two readings in a row: steps 0 and 1
    assert f"FP8 layer sent back to bf16: `{NAME}` at step 1" in monitor.summary()
    assert (tmp_path / "amp.png").stat().st_size > 0


def test_a_fabric_loop_gets_the_readings_from_observe() -> None:
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=2, fp8_fallback=None)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = gpt()
    Faults(model.get_submodule(LAYER), factor=OUTLIER).on = True
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    monitor = MixedPrecisionMonitor()
    logged = []
    with pytest.warns(UserWarning, match=rf"FP8 layer `{re.escape(LAYER)}` flushed .* input cast"):
        for step in range(3):
            fabric.backward(lm_loss(model, tokens(step)))
            optimizer.step()
            optimizer.zero_grad()
            logged.append("amp/fp8_flushed_max" in monitor.observe(plugin, model=model))
    assert logged == [True, False, True]  # the check steps
    assert [(o.layer, o.cast, o.flushed_pct) for o in monitor.fp8_outliers] == expected_outliers(plugin, 1.0)
    assert {o.step for o in monitor.fp8_outliers if (o.layer, o.cast) == (LAYER, "input")} == {0, 2}


# The headroom replays steps 1 and 3 (after 2 and 4 steps): with no fallback the casts are read there too.
@pytest.mark.parametrize(("fallback", "read"), [(None, [0, 1, 3]), (1.0, [0])], ids=["no-fallback", "fallback"])
def test_headroom_interval_reads_the_casts_too_where_that_cannot_change_the_run(
    fallback: float | None, read: list[int]
) -> None:
    plugin = MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=50, fp8_fallback=fallback)
    monitor = MixedPrecisionMonitor(headroom_interval=2, autopsy=False)
    fit(plugin, monitor, GPTModule(), 4)
    assert [step for step, _ in monitor.history.headroom] == [1, 3]
    assert [point.step for point in monitor.history.fp8.checks] == read


def test_other_precisions_have_no_fp8_record_and_the_headroom_sentence_no_float8() -> None:
    plugin = MixedPrecisionPlugin("bf16-mixed")
    monitor = MixedPrecisionMonitor(headroom_interval=2)
    fit(plugin, monitor, GPTModule(), 2)
    assert monitor.history.fp8 is None and monitor.fp8_outliers == []
    assert "headroom at step 1" in monitor.summary() and "float8" not in monitor.summary()


@pytest.mark.parametrize("value", [-1, 100, "1", float("nan")])
def test_a_bad_fp8_flush_warn_pct_is_refused_naming_it(value: object) -> None:
    with pytest.raises((ValueError, TypeError), match=r"fp8_flush_warn_pct=.*percent in \[0, 100\)"):
        MixedPrecisionMonitor(fp8_flush_warn_pct=value)  # type: ignore[arg-type]
