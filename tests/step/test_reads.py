"""Reading is pure: a run that reads every public value between (and inside) its steps trains exactly as one that reads
nothing, on both paths, through overflows and the skip limit's stop.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import TinyRegressor, loader, make_trainer
from torch import nn

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionPlugin
from lightning_amp_plus.step.engine import PendingStep, StepResult

OVERFLOWS = {3, 4, 9, 17, 18, 19}


def read_everything(scaler: DynamicLossScaler, opt: torch.optim.Optimizer) -> list[Any]:
    """Every public reading of the scaler, its engine and the step results it keeps."""
    results = [scaler.result(opt), *scaler.engine.log.recent]
    seen: list[Any] = [
        scaler.get_scale(),
        scaler.skipped_steps,
        scaler.state_dict(),
        scaler.is_enabled(),
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
        scaler.engine.skipped_steps,
        scaler.engine.log.held_schedulers.held_steps,
        repr(scaler),
    ]
    for result in results:
        if isinstance(result, StepResult | PendingStep):
            seen += [result.skipped, result.scale, result.grad_norm, result.overflow_params]
    return seen


def train(*, fused: bool, clip: bool, reads: bool, limit: int | None = None) -> tuple[list[torch.Tensor], list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2, max_consecutive_skips=limit)
    scaler.engine.name_parameters(model)
    outcome: list[Any] = []
    for step in range(24):
        x = torch.randn(5, 6)
        opt.zero_grad()
        loss = model(x).pow(2).mean() * (math.inf if step in OVERFLOWS else 1.0)
        scaler.scale(loss).backward()
        if reads:
            read_everything(scaler, opt)
        if clip:
            scaler.unscale_(opt)
            scaler.clip_grad_norm_(opt, 0.5)
        try:
            scaler.step(opt)
            if reads:
                read_everything(scaler, opt)
            scaler.update()
        except FloatingPointError as error:
            outcome.append(("stopped", step, str(error)))
            break
        if reads:
            read_everything(scaler, opt)
    # What the run left: parameters, optimizer state, and the scaler's own record, read once at the end.
    state = [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    # Norms as text: a skipped step's norm is NaN, which equals nothing, itself included.
    outcome += [scaler.state_dict(), [(r.skipped, r.scale, repr(r.grad_norm)) for r in scaler.engine.log.recent]]
    return [p.detach().clone() for p in model.parameters()] + state, outcome


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("limit", [None, 2], ids=["no-limit", "limit-2"])
def test_reading_every_public_value_between_steps_changes_nothing(fused: bool, clip: bool, limit: int | None) -> None:
    quiet, quiet_outcome = train(fused=fused, clip=clip, reads=False, limit=limit)
    read, read_outcome = train(fused=fused, clip=clip, reads=True, limit=limit)
    assert read_outcome == quiet_outcome
    for a, b in zip(read, quiet, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class ReadsThePlugin(pl.Callback):
    """Reads every public reading of the plugin and its scaler after every hook a user may read them in."""

    def _read(self, trainer: pl.Trainer) -> None:
        plugin = trainer.precision_plugin
        assert isinstance(plugin, MixedPrecisionPlugin)
        values: list[Any] = [plugin.skipped_steps, plugin.settings, plugin.device, plugin.mp_policy]
        values += [(r.skipped, r.scale, r.grad_norm, r.overflow_params) for r in plugin.recent_steps]
        if plugin.scaler is not None:
            values += [plugin.scaler.get_scale(), plugin.scaler.state_dict(), plugin.scaler.skipped_steps]
        values.append(plugin.state_dict())

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._read(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._read(trainer)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_a_trainer_run_that_reads_the_plugin_at_every_hook_trains_as_one_that_does_not(precision: str) -> None:
    def fit(callbacks: list[pl.Callback]) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = TinyRegressor(overflow_steps=(2, 5, 6))
        plugin = MixedPrecisionPlugin(precision, device="cpu")
        make_trainer(plugin, max_steps=12, max_epochs=-1, callbacks=callbacks).fit(model, loader())
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(fit([ReadsThePlugin()]), fit([]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
