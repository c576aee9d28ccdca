"""The monitor under the plugin's spike guard: ``amp/spikes`` in what a real logger wrote, the spikes in the summary and
the chart, and a spike never taken for an overflow (no autopsy, no skip-rate warning, no "fp16 overflow" wording)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
from helpers import FP16_ON_CPU_WARNING, PNG_SIGNATURE, SpikyRegressor, make_trainer, our_plugin, step_batch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_amp_plus import MixedPrecisionMonitor, SpikeGuard
from lightning_amp_plus.monitor.history import AmpHistory, StepEntry
from lightning_amp_plus.monitor.summary import summary
from lightning_amp_plus.step.spikes import SpikeVerdict

pytestmark = pytest.mark.filterwarnings(FP16_ON_CPU_WARNING)

STEPS = 12
SPIKE = 7
WARMUP = 4


def spiky_loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    # A loss 10x on one batch: a norm about 12x the running mean, a finite spike (tests/plugins/test_spike_guard.py).
    batches = [(*step_batch(step), torch.tensor(10.0 if step == SPIKE else 1.0)) for step in range(STEPS)]
    return DataLoader(batches, batch_size=None)


def read_csv(log_dir: str) -> dict[str, list[float]]:
    with (Path(log_dir) / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    return {key: [float(row[key]) if row[key] != "" else math.nan for row in rows] for key in rows[0]}


@pytest.mark.parametrize(
    ("precision", "action"), [("bf16-mixed", "skip"), ("16-mixed", "skip"), ("bf16-mixed", "clip")]
)
def test_a_spike_is_logged_summarised_and_drawn_and_never_taken_for_an_overflow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], precision: str, action: str
) -> None:
    plugin = our_plugin(precision, spike_guard=SpikeGuard(warmup=WARMUP, action=action))  # type: ignore[arg-type]
    # A window of 4 steps and a 10% rate: one skipped spike in it would warn if it counted as an overflow (warnings
    # are errors in this suite).
    monitor = MixedPrecisionMonitor(report_path=tmp_path / "amp.png", skip_window=4, skip_warn_rate=0.1)
    trainer = make_trainer(
        plugin, max_steps=STEPS, callbacks=[monitor], logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1
    )
    trainer.fit(SpikyRegressor(), spiky_loader())

    columns = read_csv(trainer.logger.log_dir)  # type: ignore[union-attr]
    assert columns["amp/spikes"] == [0.0] * SPIKE + [1.0] * (STEPS - SPIKE)
    assert columns["amp/skipped_steps"][-1] == (1.0 if action == "skip" else 0.0)
    assert [step for step, _ in monitor.history.spikes] == [SPIKE]
    assert monitor.history.overflowed == [] and monitor.autopsies == [] and monitor.history.replayed == {}

    printed = capsys.readouterr().out
    verdict = plugin.recent_steps[SPIKE].spike_verdict
    assert verdict is not None
    what = "skipped" if action == "skip" else "clipped to the limit"
    assert (
        f"the spike guard judged 1 gradient-norm spike: step {SPIKE} {what} (norm {verdict.norm:.3g}, "
        f"{verdict.norm / verdict.mean:.3g}x the running mean {verdict.mean:.3g}; limit {verdict.threshold_norm:.3g})"
    ) in printed
    assert "overflow" not in printed.split("MixedPrecisionMonitor: ")[-2]  # the summary's paragraph
    assert (tmp_path / "amp.png").read_bytes().startswith(PNG_SIGNATURE)


def test_without_a_guard_no_spike_metric_is_logged(tmp_path: Path) -> None:
    trainer = make_trainer(
        our_plugin("bf16-mixed"),
        max_steps=4,
        callbacks=[MixedPrecisionMonitor()],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
    )
    trainer.fit(SpikyRegressor(), spiky_loader())  # Lightning logs the last of the 4 steps: its metrics are the columns
    assert "amp/spikes" not in read_csv(trainer.logger.log_dir)  # type: ignore[union-attr]


def verdict(action: str, norm: float) -> SpikeVerdict:
    return SpikeVerdict(action, norm, 1.0, 2.0, 0.5, 14.5, 100)  # type: ignore[arg-type]


def test_the_summary_counts_spikes_apart_from_the_fp16_overflows() -> None:
    history = AmpHistory(
        [
            StepEntry(0, 1024.0, True, math.inf, None),  # an overflow: the scale descends
            StepEntry(1, 512.0, False, 1.5, None, verdict("take", 1.5)),
            StepEntry(2, 512.0, True, 40.0, None, verdict("skip", 40.0)),
            StepEntry(3, 512.0, False, 14.5, None, verdict("clip", 60.0)),
            StepEntry(4, 512.0, True, 30.0, None, verdict("skip", 30.0)),  # the run ends on a spike, not an overflow
        ]
    )
    history.nonfinite_events.append((0, "overflowed gradients", ["w"]))
    assert summary(history) == (
        "MixedPrecisionMonitor: 5 optimizer steps, 3 skipped (60.0%) at steps 0, 2 and 4; loss scale 2**9 to 2**10, "
        "last 2**9; the spike guard judged 3 gradient-norm spikes: step 2 skipped (norm 40, 20x the running mean 2; "
        "limit 14.5), step 3 clipped to the limit (norm 60, 30x the running mean 2; limit 14.5), step 4 skipped "
        "(norm 30, 15x the running mean 2; limit 14.5); the skipped step was an fp16 overflow caught by the loss "
        "scaler, routine in dynamic loss scaling; no non-finite parameters found."
    )
