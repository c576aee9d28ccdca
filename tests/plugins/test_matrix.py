"""The plugin's training matrix, declared once and run by one runner against Lightning's ``MixedPrecision``.

Each :class:`Case` is one combination of precision, master weights, optimizer, gradient accumulation and gradient
clipping. :func:`run` trains the same model from the same seed under our plugin and under Lightning's at the same
precision (fp16 with a GradScaler that starts and stays where ours does), with an overflow injected in fp16, and the
test compares the weights: bit for bit, except where the case states why not (:attr:`Case.tolerance`).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers import (
    FP16_ON_CPU_WARNING,
    TinyRegressor,
    lightning_plugin,
    loader,
    make_trainer,
    our_plugin,
    parameters_of,
)
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_amp_plus import MixedPrecisionPlugin

pytestmark = pytest.mark.filterwarnings(FP16_ON_CPU_WARNING)

STEPS = 6
OVERFLOW_STEP = 3  # fp16 only: Lightning's bf16 plugin does not skip a non-finite step (its weights would turn NaN)


@dataclass(frozen=True)
class Case:
    precision: str
    master_weights: bool
    optimizer: str  # TinyRegressor's names: "sgd", "adam" (foreach), "fused_adam"
    accumulate: int
    clip: str | None  # None, "norm" or "value"

    def __str__(self) -> str:
        parts = [self.precision, "master" if self.master_weights else "", self.optimizer, f"acc{self.accumulate}"]
        return "-".join(p for p in [*parts, f"clip-{self.clip}" if self.clip else ""] if p)


CASES = [
    Case(precision, master, optimizer, accumulate, clip)
    for precision, master, optimizer, accumulate, clip in itertools.product(
        ("16-mixed", "bf16-mixed"), (False, True), ("sgd", "adam"), (1, 3), (None, "norm", "value")
    )
]


def ours(case: Case) -> MixedPrecisionPlugin:
    # hold_schedulers_on_skip=False: as Lightning's, which steps schedulers on skipped steps.
    return our_plugin(case.precision, master_weights=case.master_weights, hold_schedulers_on_skip=False)


def lightnings(case: Case) -> MixedPrecision:
    return lightning_plugin(case.precision)


def run(case: Case, plugin: Any, model: TinyRegressor) -> list[torch.Tensor]:
    clipping: dict[str, Any] = {}
    if case.clip is not None:
        clipping = {"gradient_clip_val": 0.05 if case.clip == "norm" else 0.01, "gradient_clip_algorithm": case.clip}
    trainer = make_trainer(plugin, max_steps=STEPS, max_epochs=-1, accumulate_grad_batches=case.accumulate, **clipping)
    trainer.fit(model, loader(n=8 * STEPS * case.accumulate, batch_size=8))
    return parameters_of(model)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_combination_trains_as_under_lightnings_plugin(case: Case) -> None:
    overflow = {OVERFLOW_STEP} if case.precision == "16-mixed" else set()
    torch.manual_seed(0)
    reference = TinyRegressor(overflow_steps=overflow, optimizer=case.optimizer, scheduler="step", weight_decay=0.01)
    model = copy.deepcopy(reference)
    expected = run(case, lightnings(case), reference)
    plugin = ours(case)
    actual = run(case, plugin, model)
    # Bit for bit, clipping by norm included: the norm of the check is measured as clip_grad_norm_ measures it.
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert plugin.skipped_steps == len(overflow)
