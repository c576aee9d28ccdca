"""``skipped_steps``: one accessor for the steps a run's precision plugin skipped, whichever plugin ran it."""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
import pytest
import torch
from helpers import FP16_ON_CPU_WARNING, ScaleRecorder, TinyRegressor, loader, make_trainer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionPlugin
from lightning_amp_plus.plugins.precision import skipped_steps

pytestmark = pytest.mark.filterwarnings(FP16_ON_CPU_WARNING)

OVERFLOW_STEPS = (1, 3)  # loss * inf: every gradient overflows, the scaler skips the step
STEPS = 6


def fit(plugin: Precision | None, callbacks: Sequence[pl.Callback] = ()) -> pl.Trainer:
    trainer = make_trainer(plugin, max_steps=STEPS, max_epochs=-1, callbacks=list(callbacks))
    torch.manual_seed(0)
    trainer.fit(TinyRegressor(overflow_steps=OVERFLOW_STEPS), loader())
    return trainer


def test_our_plugin_counts_the_steps_that_lightnings_grad_scaler_skips_silently() -> None:
    # The reference: the same faults under Lightning's MixedPrecision, where a skipped step is a scale backoff.
    recorder = ScaleRecorder()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    lightning = fit(MixedPrecision("16-mixed", "cpu", scaler=scaler), [recorder])
    backoffs = sum(after < before for before, after in zip([2.0**10, *recorder.scales], recorder.scales, strict=False))
    ours = fit(MixedPrecisionPlugin("16-mixed", device="cpu", scaler=DynamicLossScaler(init_scale=2.0**10)))
    assert skipped_steps(lightning) is None  # GradScaler counts nothing: no number that could be wrong
    assert skipped_steps(ours) == skipped_steps(ours.precision_plugin) == backoffs == len(OVERFLOW_STEPS)


@pytest.mark.parametrize(
    ("make_plugin", "expected"),
    [
        (lambda: None, 0),  # 32-true: nothing skips a step
        (lambda: MixedPrecision("bf16-mixed", "cpu"), 0),  # no scaler, overflowed steps are applied
        (lambda: MixedPrecisionPlugin("bf16-mixed", device="cpu"), len(OVERFLOW_STEPS)),  # checked by default
        (lambda: MixedPrecisionPlugin("bf16-mixed", device="cpu", skip_nonfinite=False), 0),
    ],
    ids=["32-true", "lightning-bf16", "ours-bf16", "ours-bf16-unchecked"],
)
def test_a_plugin_without_a_counting_scaler_reports_what_it_skipped(make_plugin, expected) -> None:
    trainer = fit(make_plugin())
    assert skipped_steps(trainer) == skipped_steps(trainer.precision_plugin) == expected


def test_a_plugin_is_read_before_any_fit_too() -> None:
    assert skipped_steps(MixedPrecisionPlugin("16-mixed", device="cpu")) == 0
    assert skipped_steps(MixedPrecision("16-mixed", "cpu")) is None
    assert skipped_steps(Precision()) == 0
