"""``MixedPrecisionPlugin`` with fused optimizers: the scaler's fused path, inside Lightning.

With ``Adam/AdamW/SGD(fused=True)`` and nothing that needs unscaled gradients before the step (no clipping, no
``on_before_optimizer_step`` hook), the plugin leaves the unscaling and the skip to the optimizer's kernel, as
Lightning's own plugin does with ``torch.amp.GradScaler``: the reference here, bit for bit.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import (
    FP16_ON_CPU_WARNING,
    PRECISIONS,
    TinyRegressor,
    lightning_plugin,
    loader,
    make_trainer,
    our_plugin,
)
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor

from lightning_amp_plus import MixedPrecisionMonitor, MixedPrecisionPlugin
from lightning_amp_plus.step.engine import PendingStep

pytestmark = pytest.mark.filterwarnings(FP16_ON_CPU_WARNING)


def ours(precision: str, master_weights: bool = False, **kwargs: Any) -> MixedPrecisionPlugin:
    return our_plugin(precision, growth_interval=3, master_weights=master_weights, **kwargs)


def lightnings(precision: str) -> MixedPrecision:
    return lightning_plugin(precision, growth_interval=3)


class ScaleWatch(pl.Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.scaler is not None:
            self.scales.append(float(trainer.scaler.get_scale()))


def fit(plugin: Any, model: TinyRegressor, steps: int = 10) -> tuple[pl.Trainer, ScaleWatch]:
    watch = ScaleWatch()
    trainer = make_trainer(plugin, max_steps=steps, max_epochs=-1, callbacks=[watch])
    trainer.fit(model, loader(n=8 * steps))
    return trainer, watch


def test_the_plugins_step_reads_nothing_from_the_device_on_the_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TinyRegressor(overflow_steps={3}, optimizer="fused_adam")
    plugin = ours("16-mixed")
    reads: list[str] = []
    step = MixedPrecisionPlugin.optimizer_step

    def counting_step(self: MixedPrecisionPlugin, *args: Any, **kwargs: Any) -> Any:
        # Every host read of a tensor goes through Tensor.item/tolist/__bool__/...; patched for the plugin's step
        # only, after the closure (forward and backward) has run inside it.
        with pytest.MonkeyPatch.context() as patch:
            for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
                original = getattr(Tensor, name)

                def record(tensor: Tensor, *a: Any, _name: str = name, _original: Any = original, **k: Any) -> Any:
                    reads.append(_name)
                    return _original(tensor, *a, **k)

                patch.setattr(Tensor, name, record)
            return step(self, *args, **kwargs)

    monkeypatch.setattr(MixedPrecisionPlugin, "optimizer_step", counting_step)
    # The data comes from the loader, and the loss only from tensors: no host read in the closure either.
    fit(plugin, model, steps=6)
    assert reads == []
    assert plugin.skipped_steps == 1  # read afterwards: the outcome was there all along


class HookReadsGradients(TinyRegressor):
    def __init__(self) -> None:
        super().__init__(optimizer="fused_adam")
        self.seen: list[list[Tensor]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen.append([p.grad.clone() for p in self.parameters() if p.grad is not None])


def test_a_hook_that_may_read_the_gradients_gets_them_unscaled() -> None:
    model = HookReadsGradients()
    plugin = ours("16-mixed")
    fit(plugin, model, steps=3)
    assert not any(isinstance(step, PendingStep) for step in plugin.recent_steps)  # the unscale path, every step
    # Unscaled: the same order of magnitude as the gradients of the unscaled loss, not 1024 times larger.
    torch.manual_seed(0)
    twin = HookReadsGradients()
    fit(MixedPrecisionPlugin("bf16-mixed", device="cpu"), twin, steps=1)
    assert 0.1 < float(model.seen[0][0].norm() / twin.seen[0][0].norm()) < 10


@pytest.mark.parametrize("precision", PRECISIONS)
def test_clipping_switches_a_fused_optimizer_to_the_unscale_path_and_clips_the_unscaled_norm(precision: str) -> None:
    model = TinyRegressor(optimizer="fused_adam")
    plugin = ours(precision)
    monitor = MixedPrecisionMonitor(log_memory=False)  # does not read gradients: the clipping switches the path
    trainer = make_trainer(plugin, max_steps=4, max_epochs=-1, gradient_clip_val=1e-3, callbacks=[monitor])
    trainer.fit(model, loader(n=32))
    # The norm was measured on the unscale path and clipping brought it down to the limit.
    assert all(record.grad_norm is not None and record.grad_norm > 1e-3 for record in monitor.history.steps)


def test_a_held_scheduler_reads_a_fused_steps_outcome_when_it_steps() -> None:
    model = TinyRegressor(overflow_steps={2}, optimizer="fused_adam", scheduler="step")
    plugin = ours("16-mixed")
    trainer, _ = fit(plugin, model, steps=6)
    assert plugin.skipped_steps == 1 and plugin.engine.log.held_schedulers.held_steps == 1
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**5)  # 5 applied steps
