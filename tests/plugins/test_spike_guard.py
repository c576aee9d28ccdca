"""``spike_guard=`` on the Trainer's and Fabric's plugins, against Lightning's and Fabric's own plugins.

* ``action="skip"``: a run whose spike batch is skipped equals, bit for bit, the built-in plugin's run without that
  batch (with the LR scheduler held, gradient clipping on, and under fp16 the same loss scale at the end).
* ``action="clip"``: equals the built-in's run where a hook clips the spike's gradients to the guard's limit with
  ``clip_grad_norm_`` before Lightning's own clipping.
* A run resumed from a Trainer checkpoint or from `fabric.save` judges as the uninterrupted run (the guard's statistics
  are in the plugin's state).
* Refusals name the argument, the value and the fix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    FP16_ON_CPU_WARNING,
    START_SCALE,
    SpikyRegressor,
    lightning_plugin,
    make_net,
    make_trainer,
    mse,
    our_plugin,
    step_batch,
)
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
from torch import Tensor
from torch.utils.data import DataLoader

import lightning_amp_plus.fabric as amp_fabric
from lightning_amp_plus import DynamicLossScaler, MixedPrecisionPlugin, SpikeGuard

pytestmark = [
    pytest.mark.filterwarnings(FP16_ON_CPU_WARNING),
    pytest.mark.filterwarnings(r"ignore:lightning_amp_plus.fabric.MixedPrecisionPlugin\('16-mixed'\) on CPU"),
]

STEPS = 10
SPIKE = 6  # after the warm-up
WARMUP = 4
# The spike batch's loss factor: a norm 12x the running mean, 1.4x the guard's limit. At 30x the scaled fp16 gradients
# overflow: an overflow, not a spike (backed off, never judged).
FACTOR = 10.0
CLIP = 0.5
GROWTH = 3  # the fp16 scale grows every 3 clean steps: a spike that moved it would show


def batches(spikes: tuple[int, ...] = (SPIKE,)) -> list[tuple[Tensor, Tensor, float]]:
    return [(*step_batch(step), FACTOR if step in spikes else 1.0) for step in range(STEPS)]


Run = tuple[SpikyRegressor, Any]  # the model and its trainer


def fit(plugin: Any, data: list[tuple[Tensor, Tensor, float]], model: SpikyRegressor | None = None) -> Run:
    model = model or SpikyRegressor()
    loader = DataLoader([(x, y, torch.tensor(f)) for x, y, f in data], batch_size=None)
    trainer = make_trainer(plugin, max_steps=len(data), gradient_clip_val=CLIP)
    trainer.fit(model, loader)
    return model, trainer


def assert_same_run(ours: Run, theirs: Run) -> None:
    torch.testing.assert_close(ours[0].state_dict(), theirs[0].state_dict(), rtol=0, atol=0)
    ours_state, theirs_state = (run[1].optimizers[0].state_dict()["state"] for run in (ours, theirs))
    torch.testing.assert_close(ours_state, theirs_state, rtol=0, atol=0)
    # The scheduler: held on the skipped step, so the learning rates agree too.
    assert ours[1].optimizers[0].param_groups[0]["lr"] == theirs[1].optimizers[0].param_groups[0]["lr"]
    if theirs[1].scaler is not None:
        assert ours[1].scaler.get_scale() == theirs[1].scaler.get_scale()


# ------------------------------------------------------------------------------------------------- the Trainer
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_trainer_a_skipped_spike_equals_lightnings_run_without_the_batch(precision: str) -> None:
    plugin = our_plugin(precision, growth_interval=GROWTH, spike_guard=SpikeGuard(warmup=WARMUP))
    ours = fit(plugin, batches())
    theirs = fit(
        lightning_plugin(precision, growth_interval=GROWTH), batches(spikes=())[:SPIKE] + batches()[SPIKE + 1 :]
    )
    assert_same_run(ours, theirs)
    assert plugin.skipped_steps == 1 and [r.skipped for r in plugin.recent_steps].index(True) == SPIKE
    verdict = plugin.recent_steps[SPIKE].spike_verdict
    assert verdict is not None and verdict.action == "skip" and not plugin.recent_steps[SPIKE].overflowed


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_trainer_a_clipped_spike_equals_lightnings_run_clipped_to_the_limit_in_a_hook(precision: str) -> None:
    plugin = our_plugin(precision, growth_interval=GROWTH, spike_guard=SpikeGuard(warmup=WARMUP, action="clip"))
    ours = fit(plugin, batches())
    verdict = plugin.recent_steps[SPIKE].spike_verdict
    assert verdict is not None and verdict.action == "clip" and plugin.skipped_steps == 0
    theirs = fit(
        lightning_plugin(precision, growth_interval=GROWTH),
        batches(),
        SpikyRegressor(clip_at=(SPIKE, verdict.threshold_norm)),
    )
    assert_same_run(ours, theirs)


def test_trainer_a_clean_run_is_lightnings_with_or_without_the_guard() -> None:
    plugin = our_plugin("bf16-mixed", spike_guard=SpikeGuard(warmup=WARMUP))
    assert_same_run(fit(plugin, batches(spikes=())), fit(lightning_plugin("bf16-mixed"), batches(spikes=())))
    assert not any(r.spike_verdict is None or r.spike_verdict.spike for r in plugin.recent_steps)


class FromStep(SpikyRegressor):
    """Batches from the global step (a resumed run sees the batches the uninterrupted one saw), a spike at SPIKE."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        step = self.trainer.global_step
        return mse(self.net, step_batch(step)) * (FACTOR if step == SPIKE else 1.0)


@pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable.*")
@pytest.mark.parametrize("action", ["skip", "clip"])
def test_trainer_a_resumed_run_judges_as_the_uninterrupted_one(tmp_path: Path, action: Any) -> None:
    def plugin() -> MixedPrecisionPlugin:
        return our_plugin("16-mixed", growth_interval=GROWTH, spike_guard=SpikeGuard(warmup=WARMUP, action=action))

    loader = DataLoader(range(64), batch_size=None)
    whole, whole_plugin = FromStep(), plugin()
    make_trainer(whole_plugin, max_steps=STEPS, max_epochs=-1).fit(whole, loader)

    first = make_trainer(plugin(), max_steps=SPIKE - 1, max_epochs=-1)
    first.fit(FromStep(), loader)
    first.save_checkpoint(tmp_path / "mid.ckpt")
    # A guard that started afresh at the resume would still be warming up at the spike, and take it.
    resumed, resumed_plugin = FromStep(), plugin()
    make_trainer(resumed_plugin, max_steps=STEPS, max_epochs=-1).fit(resumed, loader, ckpt_path=tmp_path / "mid.ckpt")

    torch.testing.assert_close(resumed.state_dict(), whole.state_dict(), rtol=0, atol=0)
    resumed_spike = resumed_plugin.recent_steps[SPIKE - (SPIKE - 1)]  # the resumed run's steps start at SPIKE - 1
    assert resumed_spike.spike_verdict == whole_plugin.recent_steps[SPIKE].spike_verdict
    assert resumed_spike.spike_verdict is not None and resumed_spike.spike_verdict.spike
    assert resumed_plugin.engine.state_dict() == whole_plugin.engine.state_dict()


# --------------------------------------------------------------------------------------------------- Fabric
def fabric_run(plugin: Any, data: list[tuple[Tensor, Tensor, float]]) -> tuple[Any, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01, foreach=True))
    for x, y, factor in data:
        fabric.backward(mse(model, (x, y)) * factor)
        # Fabric's own fp16 plugin leaves an overflow's inf gradients to the clip, which raises by default.
        fabric.clip_gradients(model, optimizer, max_norm=CLIP, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
    return net, optimizer.optimizer


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fabric_a_skipped_spike_equals_fabrics_run_without_the_batch(precision: str) -> None:
    fp16 = precision == "16-mixed"
    ours_plugin = amp_fabric.MixedPrecisionPlugin(
        precision,  # type: ignore[arg-type]
        device="cpu",
        scaler=DynamicLossScaler(init_scale=START_SCALE, growth_interval=GROWTH) if fp16 else None,
        spike_guard=SpikeGuard(warmup=WARMUP),
    )
    ours = fabric_run(ours_plugin, batches())
    scaler = torch.amp.GradScaler("cpu", init_scale=START_SCALE, growth_interval=GROWTH) if fp16 else None
    theirs = fabric_run(FabricMixed(precision, device="cpu", scaler=scaler), batches()[:SPIKE] + batches()[SPIKE + 1 :])  # type: ignore[arg-type]
    torch.testing.assert_close(ours[0].state_dict(), theirs[0].state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(ours[1].state_dict()["state"], theirs[1].state_dict()["state"], rtol=0, atol=0)
    assert ours_plugin.skipped_steps == 1 and ours_plugin.recent_steps[SPIKE].spike_verdict.action == "skip"
    if fp16:  # ours moves the scale at the next backward, or when its state is read
        assert ours_plugin.state_dict()["scaler"]["scale"] == scaler.get_scale()  # type: ignore[union-attr]
    assert ours_plugin.state_dict()["spike_guard"][0]["steps"] == STEPS - 1


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_fabric_a_run_resumed_from_fabric_save_judges_as_the_uninterrupted_one(precision: str, tmp_path: Path) -> None:
    def plugin() -> amp_fabric.MixedPrecisionPlugin:
        fp16 = precision == "16-mixed"
        scaler = DynamicLossScaler(init_scale=START_SCALE, growth_interval=GROWTH) if fp16 else None
        return amp_fabric.MixedPrecisionPlugin(
            precision, device="cpu", scaler=scaler, spike_guard=SpikeGuard(warmup=WARMUP)
        )  # type: ignore[arg-type]

    def run(amp: Any, data: list[tuple[Tensor, Tensor, float]], load: Path | None, save: Path | None) -> Tensor:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[amp])
        torch.manual_seed(0)
        net = make_net()
        model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01, foreach=True))
        state = {"model": model, "optimizer": optimizer, "amp": amp}
        if load is not None:
            fabric.load(load, state)
        for x, y, factor in data:
            fabric.backward(mse(model, (x, y)) * factor)
            fabric.clip_gradients(model, optimizer, max_norm=CLIP, error_if_nonfinite=False)
            optimizer.step()
            optimizer.zero_grad()
        if save is not None:
            fabric.save(save, state)
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    whole_plugin, first_plugin, resumed_plugin = plugin(), plugin(), plugin()
    whole = run(whole_plugin, batches(), None, None)
    run(first_plugin, batches()[: SPIKE - 1], None, tmp_path / "mid.ckpt")
    # A guard that started afresh at the resume would still be warming up at the spike, and take it.
    resumed = run(resumed_plugin, batches()[SPIKE - 1 :], tmp_path / "mid.ckpt", None)
    torch.testing.assert_close(resumed, whole, rtol=0, atol=0)
    assert resumed_plugin.recent_steps[1].spike_verdict == whole_plugin.recent_steps[SPIKE].spike_verdict
    assert whole_plugin.recent_steps[SPIKE].spike_verdict.spike and resumed_plugin.skipped_steps == 1
    assert resumed_plugin.state_dict()["spike_guard"] == whole_plugin.state_dict()["spike_guard"]


# ----------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "make",
    [
        lambda guard: MixedPrecisionPlugin("bf16-mixed", skip_nonfinite=False, spike_guard=guard),
        lambda guard: amp_fabric.MixedPrecisionPlugin("bf16-true", skip_nonfinite=False, spike_guard=guard),
    ],
    ids=["trainer", "fabric"],
)
def test_a_guard_with_the_check_off_is_refused_naming_both_arguments(make: Any) -> None:
    with pytest.raises(ValueError, match=r"skip_nonfinite=False, spike_guard=SpikeGuard\(.*Keep skip_nonfinite=True"):
        make(SpikeGuard())


def test_a_guard_that_is_not_one_is_refused() -> None:
    with pytest.raises(TypeError, match=r"`MixedPrecisionPlugin\(spike_guard='skip'\)` \(str\).*SpikeGuard\(\)"):
        MixedPrecisionPlugin("bf16-mixed", spike_guard="skip")  # type: ignore[arg-type]


def test_fp16_refuses_the_check_off_since_fp16_always_checks() -> None:
    with pytest.raises(ValueError, match=re.escape("fp16 loss scaling checks every step")):
        MixedPrecisionPlugin("16-mixed", skip_nonfinite=False, spike_guard=SpikeGuard())  # type: ignore[call-arg]
    plugin = MixedPrecisionPlugin("16-mixed", spike_guard=SpikeGuard())
    assert plugin.engine.spike_guards is not None and plugin.engine.check
