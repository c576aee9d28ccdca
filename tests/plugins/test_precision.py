"""MixedPrecisionPlugin driven by a real Lightning Trainer, on CPU.

fp16 autocast runs on CPU with the plugin object (slowly, which is why the models are tiny), so the loss-scaling path is
exercised here without a GPU. Overflows are injected deterministically: ``TinyRegressor(overflow_steps=...)`` multiplies
the loss by inf at chosen optimizer steps, which makes every gradient of that step non-finite.

Unless a test says otherwise, fp16 plugins start at ``init_scale=2**10``: at the default 2**16 this model's scaled
backward overflows fp16 on its own at the first steps, and tests that count skipped steps want only the injected ones.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import (
    FP16_ON_CPU_WARNING,
    INF,
    PRECISIONS,
    RecordingSGD,
    ScaleRecorder,
    TinyRegressor,
    TrainingStateAfterBatches,
    global_norm,
    lightning_plugin,
    loader,
    make_net,
    make_trainer,
    mse,
    our_plugin,
    parameters_of,
    unscaled_reference_grads,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from torch.testing import assert_close

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionMonitor, MixedPrecisionPlugin

pytestmark = pytest.mark.filterwarnings(FP16_ON_CPU_WARNING)

# Resuming from a checkpoint written mid-epoch, Lightning warns that the DataLoader restarts; where it matters, the
# tests make the data independent of the sampler position.
MID_EPOCH_RESUME_WARNING = "ignore:You're resuming from a checkpoint that ended before the epoch ended"
SCHEDULER_ORDER_WARNING = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
# Power-of-two loss scaling commutes with fp16/fp32 rounding, so the unscaled gradients equal a backward run without
# scaling, except where the unscaled run's fp16 intermediates fall below the fp16 normal range (6.1e-5) and are rounded
# to a multiple of 2**-24 (6e-8): a few such roundings summed give absolute differences of ~1e-7 (measured up to 1.2e-7)
# on gradients of ~1e-2. A missing (or doubled) unscale is off by a factor of 2**10 or more.
UNSCALED_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def plugin_for(precision: str, **scaler_kwargs: Any) -> MixedPrecisionPlugin:
    if precision == "16-mixed":
        scaler = DynamicLossScaler(**{"init_scale": 2.0**10, **scaler_kwargs})
        return MixedPrecisionPlugin("16-mixed", device="cpu", scaler=scaler)
    return MixedPrecisionPlugin("bf16-mixed", device="cpu")


class HookGradients(pl.Callback):
    """In ``on_before_optimizer_step`` (before clipping): the gradients the hook sees, and the same batch's gradients
    computed without loss scaling."""

    def __init__(self) -> None:
        self.seen: list[list[Tensor]] = []
        self.reference: list[list[Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.seen.append([p.grad.detach().clone() for p in pl_module.parameters()])
        self.reference.append(unscaled_reference_grads(pl_module, pl_module.last_batch))


class ScalerStateAtStart(pl.Callback):
    """The plugin's scaler state when training starts, i.e. right after a checkpoint was restored."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = trainer.scaler.state_dict()


# ------------------------------------------------------------------------------------------------ what Trainer reports
@pytest.mark.parametrize(
    ("precision", "scaler_type"), [("16-mixed", DynamicLossScaler), ("bf16-mixed", type(None))], ids=PRECISIONS
)
def test_trainer_reports_the_plugin_precision_and_its_scaler(precision, scaler_type):
    plugin = MixedPrecisionPlugin(precision, device="cpu")
    trainer = make_trainer(plugin)
    assert trainer.precision == precision
    assert type(trainer.scaler) is scaler_type
    assert trainer.scaler is plugin.scaler


@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_training_step_runs_under_autocast_to_the_precision_dtype(precision, dtype):
    model = TinyRegressor()
    make_trainer(plugin_for(precision), max_steps=3).fit(model, loader())
    assert model.forward_dtypes == [dtype] * 3


def test_plugin_without_arguments_takes_its_device_from_the_model_and_trains_in_fp16():
    plugin = MixedPrecisionPlugin()
    assert plugin.device is None
    torch.manual_seed(0)
    model = TinyRegressor()
    before = parameters_of(model)
    trainer = make_trainer(plugin, max_steps=6)
    trainer.fit(model, loader())
    assert plugin.device == "cpu"
    assert trainer.precision == "16-mixed"
    assert model.forward_dtypes == [torch.float16] * 6
    after = parameters_of(model)
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


# ---------------------------------------------------------------------------------- parity with Lightning's own plugin
PARITY_OVERFLOWS = (0, 3, 50, 51, 120, 199)


def _fit_for_parity(plugin: Any, **trainer_kwargs: Any) -> tuple[TinyRegressor, ScaleRecorder]:
    torch.manual_seed(0)
    model = TinyRegressor(overflow_steps=PARITY_OVERFLOWS)
    recorder = ScaleRecorder()
    trainer = make_trainer(plugin, max_steps=200, max_epochs=-1, callbacks=[recorder], **trainer_kwargs)
    trainer.fit(model, loader())
    return model, recorder


@pytest.mark.parametrize(
    ("gradient_clip_val", "tolerance"),
    [
        # Identical arithmetic: the same inverse scale (float32 of the float64 reciprocal), one float32 multiply per
        # gradient element, the same SGD update. Bit for bit.
        (None, {"rtol": 0, "atol": 0}),
        # Clipping: the norm is torch's get_total_norm of the unscaled gradients and the coefficient torch's own
        # arithmetic, so the clipped gradients are clip_grad_norm_'s. Bit for bit too.
        (0.8, {"rtol": 0, "atol": 0}),
    ],
    ids=["no-clipping", "clip-norm"],
)
def test_fp16_training_matches_lightning_mixed_precision_step_for_step(gradient_clip_val, tolerance):
    growth_interval = 5
    ours, our_record = _fit_for_parity(
        MixedPrecisionPlugin("16-mixed", device="cpu", scaler=DynamicLossScaler(growth_interval=growth_interval)),
        gradient_clip_val=gradient_clip_val,
    )
    theirs, their_record = _fit_for_parity(
        MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", growth_interval=growth_interval)),
        gradient_clip_val=gradient_clip_val,
    )
    our_scales = our_record.scales
    assert len(our_scales) == 200
    if gradient_clip_val is not None:  # the limit is met: some steps clip, others do not
        norms = [norm for norm in our_record.grad_norms if norm is not None and math.isfinite(norm)]
        assert min(norms) < gradient_clip_val < max(norms)
    # Our ceiling (max_scale=2**24) never engaged, GradScaler has none: the comparison is like for like.
    assert max(our_scales) < 2.0**24
    # Every injected overflow backed the scale off (natural fp16 overflows do too, in both runs alike).
    scales = [2.0**16, *our_scales]
    assert all(scales[step + 1] == scales[step] / 2 for step in PARITY_OVERFLOWS)
    assert our_scales == their_record.scales
    assert_close(parameters_of(ours), parameters_of(theirs), **tolerance)


# -------------------------------------------------------------------------------------------- gradient accumulation
@pytest.mark.parametrize("accumulate", [2, 3, 4])
def test_gradient_accumulation_updates_the_scale_once_per_optimizer_step(accumulate):
    recorder = ScaleRecorder()
    plugin = plugin_for("16-mixed", init_scale=2.0, growth_interval=1)
    trainer = make_trainer(plugin, accumulate_grad_batches=accumulate, callbacks=[recorder])
    trainer.fit(TinyRegressor(), loader(n=96, batch_size=8))  # 12 micro-batches: a multiple of 2, 3 and 4
    # growth_interval=1: the scale doubles at every optimizer step, i.e. after every `accumulate` micro-batches.
    assert recorder.scales == [2.0 * 2.0 ** ((batch + 1) // accumulate) for batch in range(12)]
    assert trainer.global_step == 12 // accumulate


@pytest.mark.parametrize("accumulate", [2, 3, 4])
def test_gradient_accumulation_matches_lightning_mixed_precision(accumulate):
    def fit(plugin: Any) -> tuple[TinyRegressor, list[float]]:
        torch.manual_seed(0)
        model = TinyRegressor(overflow_steps=(1, 5))
        recorder = ScaleRecorder()
        trainer = make_trainer(plugin, max_epochs=4, accumulate_grad_batches=accumulate, callbacks=[recorder])
        trainer.fit(model, loader(n=96, batch_size=8))
        return model, recorder.scales

    ours, our_scales = fit(MixedPrecisionPlugin("16-mixed", device="cpu", scaler=DynamicLossScaler(growth_interval=3)))
    theirs, their_scales = fit(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", growth_interval=3)))
    assert our_scales == their_scales
    # Gradients accumulate scaled in float32 in both and are unscaled once with the same inverse scale: bit for bit.
    assert_close(parameters_of(ours), parameters_of(theirs), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------------ clipping
@pytest.mark.parametrize("precision", PRECISIONS)
def test_on_before_optimizer_step_hooks_see_unscaled_gradients(precision):
    hook = HookGradients()
    make_trainer(plugin_for(precision), max_steps=6, callbacks=[hook]).fit(TinyRegressor(), loader())
    assert len(hook.seen) == 6
    for step, (seen, reference) in enumerate(zip(hook.seen, hook.reference, strict=True)):
        assert_close(seen, reference, **UNSCALED_TOLERANCE, msg=lambda m, step=step: f"step {step}: {m}")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("clip_val", [1e-3, 1e3], ids=["clips", "does-not-clip"])
def test_norm_clipping_caps_the_unscaled_gradient_norm_the_optimizer_sees(precision, clip_val):
    hook = HookGradients()
    model = TinyRegressor(optimizer="recording_sgd")
    trainer = make_trainer(plugin_for(precision), max_steps=6, gradient_clip_val=clip_val, callbacks=[hook])
    trainer.fit(model, loader())
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, RecordingSGD)
    stepped = torch.stack([global_norm(grads) for grads in optimizer.seen])
    true_norms = torch.stack([global_norm(grads) for grads in hook.reference])
    assert len(stepped) == 6
    assert (stepped <= clip_val * (1 + 1e-6)).all()
    # min(c, norm): the reference is within ~1e-7 of the unscaled gradients (see UNSCALED_TOLERANCE), and clipping
    # multiplies by c / (norm + 1e-6), which lands 1e-6 / norm (a few 1e-6 here) below c.
    assert_close(stepped, true_norms.clamp(max=clip_val), rtol=1e-5, atol=0)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_value_clipping_clamps_the_unscaled_gradients(precision):
    clip_val = 0.05
    hook = HookGradients()
    model = TinyRegressor(optimizer="recording_sgd")
    trainer = make_trainer(
        plugin_for(precision),
        max_steps=4,
        gradient_clip_val=clip_val,
        gradient_clip_algorithm="value",
        callbacks=[hook],
    )
    trainer.fit(model, loader())
    stepped = trainer.optimizers[0].seen
    reference = torch.cat([g.reshape(-1) for grads in hook.reference for g in grads]).abs()
    assert (reference > clip_val).any() and (reference < clip_val).any()  # c cuts some gradients and spares others
    for seen, true in zip(stepped, hook.reference, strict=True):
        assert all(g.abs().max() <= clip_val for g in seen)
        assert_close(seen, [g.clamp(-clip_val, clip_val) for g in true], **UNSCALED_TOLERANCE)


# ---------------------------------------------------------------------------------- manual optimization, two optimizers
class TwoOptimizers(pl.LightningModule):
    """Manual optimization: two networks, two RecordingSGD optimizers, both stepped in every batch.

    Args:
        overflow_b_at: batch indices at which the second loss is multiplied by inf.
        clip_a: "norm" or "value": clip the first optimizer's gradients with ``self.clip_gradients`` to half their
            unscaled norm, or to half their largest unscaled magnitude.
    """

    def __init__(self, overflow_b_at: tuple[int, ...] = (), clip_a: str | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net_a = make_net()
        self.net_b = make_net()
        self.overflow_b_at = overflow_b_at
        self.clip_a = clip_a
        self.reference: dict[str, list[list[Tensor]]] = {"a": [], "b": []}
        self.after_clip: list[list[Tensor]] = []
        self.clip_vals: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        loss_a = mse(self.net_a, batch)
        self.reference["a"].append(list(torch.autograd.grad(loss_a, list(self.net_a.parameters()), retain_graph=True)))
        self.manual_backward(loss_a)
        if self.clip_a is not None:
            reference = self.reference["a"][-1]
            measure = global_norm(reference) if self.clip_a == "norm" else max(g.abs().max() for g in reference)
            clip_val = float(measure) / 2
            self.clip_vals.append(clip_val)
            self.clip_gradients(opt_a, gradient_clip_val=clip_val, gradient_clip_algorithm=self.clip_a)
            self.after_clip.append([p.grad.detach().clone() for p in self.net_a.parameters()])
        opt_a.step()
        opt_a.zero_grad()

        loss_b = mse(self.net_b, batch)
        if batch_idx in self.overflow_b_at:
            loss_b = loss_b * INF
        self.reference["b"].append(list(torch.autograd.grad(loss_b, list(self.net_b.parameters()), retain_graph=True)))
        self.manual_backward(loss_b)
        opt_b.step()
        opt_b.zero_grad()

    def configure_optimizers(self) -> Any:
        return RecordingSGD(self.net_a.parameters(), lr=0.05), RecordingSGD(self.net_b.parameters(), lr=0.05)


def test_manual_optimization_with_two_optimizers_updates_the_scale_once_per_batch():
    recorder = ScaleRecorder()
    plugin = plugin_for("16-mixed", init_scale=2.0, growth_interval=1)
    make_trainer(plugin, max_epochs=1, callbacks=[recorder]).fit(TwoOptimizers(), loader())
    # Doubling once per batch (8 batches), not once per optimizer step (which would give 2 * 4**n).
    assert recorder.scales == [2.0 * 2.0 ** (batch + 1) for batch in range(8)]


def test_manual_optimization_overflow_in_one_of_two_optimizers_backs_the_scale_off_once():
    recorder = ScaleRecorder()
    plugin = plugin_for("16-mixed", init_scale=8.0, growth_interval=1)
    model = TwoOptimizers(overflow_b_at=(3,))
    make_trainer(plugin, max_epochs=1, callbacks=[recorder]).fit(model, loader())
    assert recorder.scales == [16.0, 32.0, 64.0, 32.0, 64.0, 128.0, 256.0, 512.0]
    assert plugin.skipped_steps == 1
    assert len(model.trainer.optimizers[0].seen) == 8  # the first optimizer stepped in the overflowing batch
    assert len(model.trainer.optimizers[1].seen) == 7  # the second one did not


def test_manual_optimization_unscales_the_second_optimizer_with_the_scale_its_loss_was_scaled_by():
    # growth_interval=1: a scale updated between the two steps (as Lightning's built-in plugin does) would double
    # before the second optimizer unscales, and hand it half its gradients.
    model = TwoOptimizers()
    make_trainer(plugin_for("16-mixed", growth_interval=1), max_steps=8).fit(model, loader())
    stepped = model.trainer.optimizers[1].seen
    assert len(stepped) == 4
    for seen, reference in zip(stepped, model.reference["b"], strict=True):
        assert_close(seen, reference, **UNSCALED_TOLERANCE)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_manual_clip_gradients_before_step_sees_unscaled_gradients_and_they_are_not_unscaled_again(algorithm):
    model = TwoOptimizers(clip_a=algorithm)
    make_trainer(plugin_for("16-mixed"), max_epochs=1).fit(model, loader())
    assert len(model.after_clip) == 8
    for clipped, reference, clip_val in zip(model.after_clip, model.reference["a"], model.clip_vals, strict=True):
        if algorithm == "norm":
            # clip_val is half the unscaled norm, so clipping multiplies by clip_val / (norm + 1e-6) ~ 1/2.
            expected = [g * (clip_val / (2 * clip_val + 1e-6)) for g in reference]
        else:
            expected = [g.clamp(-clip_val, clip_val) for g in reference]
        assert_close(clipped, expected, **UNSCALED_TOLERANCE)
    # The optimizer gets exactly the clipped gradients: the step must not unscale them a second time.
    assert_close(model.trainer.optimizers[0].seen, model.after_clip, rtol=0, atol=0)


# ------------------------------------------------------------------------------------- skipped steps and LR schedulers
@pytest.mark.parametrize("precision", PRECISIONS)
def test_skipped_step_leaves_parameters_optimizer_state_and_learning_rate_untouched(precision):
    snapshots = TrainingStateAfterBatches()
    plugin = plugin_for(precision)
    model = TinyRegressor(optimizer="adam", scheduler="step", overflow_steps=(3,))
    make_trainer(plugin, max_steps=6, callbacks=[snapshots]).fit(model, loader())
    before, skipped, after = snapshots.taken[2], snapshots.taken[3], snapshots.taken[4]
    assert plugin.skipped_steps == 1
    # Nothing is computed on a skipped step: the values are the very same, bit for bit.
    assert_close(skipped["params"], before["params"], rtol=0, atol=0)
    assert_close(skipped["state"], before["state"], rtol=0, atol=0)
    assert (skipped["lr"], skipped["last_epoch"]) == (before["lr"], before["last_epoch"])
    # ...whereas the next, normal step moves all three.
    assert not torch.equal(after["params"][0], skipped["params"][0])
    assert not torch.equal(after["state"][0]["exp_avg"], skipped["state"][0]["exp_avg"])
    assert after["lr"] == skipped["lr"] / 2


def test_skipped_steps_are_counted_by_the_plugin_and_by_trainer_scaler():
    plugin = plugin_for("16-mixed")
    trainer = make_trainer(plugin, max_steps=8)
    trainer.fit(TinyRegressor(overflow_steps=(1, 4, 5)), loader())
    assert plugin.skipped_steps == 3
    assert trainer.scaler.skipped_steps == 3


def test_a_skipped_first_step_holds_the_scheduler_without_pytorch_order_warning():
    snapshots = TrainingStateAfterBatches()
    model = TinyRegressor(optimizer="adam", scheduler="step", overflow_steps=(0,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugin_for("16-mixed"), max_steps=3, callbacks=[snapshots]).fit(model, loader())
    assert not [w for w in caught if SCHEDULER_ORDER_WARNING in str(w.message)]
    assert [s["lr"] for s in snapshots.taken] == [0.05, 0.025, 0.0125]


def test_without_holding_schedulers_a_skipped_step_advances_the_scheduler_as_in_lightning():
    def fit(plugin: Any) -> list[float]:
        snapshots = TrainingStateAfterBatches()
        model = TinyRegressor(optimizer="adam", scheduler="step", overflow_steps=(0,))
        with pytest.warns(UserWarning, match=re.escape(SCHEDULER_ORDER_WARNING)):
            make_trainer(plugin, max_steps=3, callbacks=[snapshots]).fit(model, loader())
        return [s["lr"] for s in snapshots.taken]

    scaler = DynamicLossScaler(init_scale=2.0**10)
    ours = fit(MixedPrecisionPlugin("16-mixed", device="cpu", scaler=scaler, hold_schedulers_on_skip=False))
    theirs = fit(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10)))
    assert ours == theirs == [0.025, 0.0125, 0.00625]


class PlateauRegressor(TinyRegressor):
    """Validated every epoch; the LR under ``ReduceLROnPlateau`` on the validation loss (patience 0: halved at once)."""

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        plateau = ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


class PlateauAfterEachEpoch(pl.Callback):
    """The plateau scheduler's LR, best loss and bad epochs after each epoch's scheduler step."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float, int]] = []

    def _record(self, trainer: pl.Trainer) -> None:
        plateau = trainer.lr_scheduler_configs[0].scheduler
        self.seen.append((plateau.optimizer.param_groups[0]["lr"], plateau.best, plateau.num_bad_epochs))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch > 0:  # the epoch before has stepped the scheduler
            self._record(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer)  # the fit's last scheduler step, after its last epoch


def test_reduce_lr_on_plateau_steps_as_under_lightnings_plugin_and_is_held_over_an_epoch_of_skips():
    def fit(plugin: Any, overflow_steps: range) -> list[tuple[float, float, int]]:
        torch.manual_seed(0)
        plateau = PlateauAfterEachEpoch()
        trainer = make_trainer(plugin, max_epochs=4, limit_val_batches=2, callbacks=[plateau])
        trainer.fit(PlateauRegressor(overflow_steps=overflow_steps), loader(), loader())
        return plateau.seen

    def lightnings() -> MixedPrecision:
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))

    clean = fit(plugin_for("16-mixed"), range(0))
    assert clean == fit(lightnings(), range(0))  # the scheduler sees the same validation losses, bit for bit
    assert len(clean) == 4 and clean[0][1] > clean[1][1] > clean[2][1]  # improving: the LR stays at 0.1
    # Epoch 1 (steps 8 to 15) skipped whole: its validation loss is epoch 0's, no improvement. Lightning's plugin steps
    # the plateau scheduler on it (one more bad epoch: the LR is halved); ours holds it (every step of its optimizer
    # since its last step was skipped), so epoch 1 leaves it as epoch 0 left it.
    ours, theirs = fit(plugin_for("16-mixed"), range(8, 16)), fit(lightnings(), range(8, 16))
    assert ours[1] == ours[0] == clean[0]
    assert ours[2:] == clean[1:3]  # then the run goes on as the run without that epoch
    assert theirs[0] == clean[0] and theirs[1][0] == theirs[0][0] / 2


def test_held_scheduler_keeps_its_class_and_state_dict_keys_and_gets_its_class_back_after_fit():
    seen: list[tuple[bool, set[str]]] = []

    class Inspect(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            scheduler = trainer.lr_scheduler_configs[0].scheduler
            seen.append((isinstance(scheduler, StepLR), set(scheduler.state_dict())))

    plugin = plugin_for("16-mixed")
    trainer = make_trainer(plugin, max_steps=4, callbacks=[Inspect()])
    trainer.fit(TinyRegressor(optimizer="adam", scheduler="step", overflow_steps=(1,)), loader())
    assert plugin.engine.log.held_schedulers.held_steps == 1  # the hold was in force during fit
    fresh_keys = set(StepLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), step_size=1).state_dict())
    assert seen == [(True, fresh_keys)] * 4
    assert type(trainer.lr_scheduler_configs[0].scheduler) is StepLR


# ------------------------------------------------------------------------------------------------------------- bf16
def test_bf16_skips_a_step_with_non_finite_gradients_by_default():
    snapshots = TrainingStateAfterBatches()
    plugin = MixedPrecisionPlugin("bf16-mixed", device="cpu")
    trainer = make_trainer(plugin, max_steps=5, callbacks=[snapshots])
    trainer.fit(TinyRegressor(overflow_steps=(2,)), loader())
    assert trainer.scaler is None
    assert plugin.skipped_steps == 1
    assert_close(snapshots.taken[2]["params"], snapshots.taken[1]["params"], rtol=0, atol=0)
    assert all(torch.isfinite(p).all() for p in snapshots.taken[-1]["params"])


def test_bf16_with_skip_nonfinite_off_lets_non_finite_gradients_into_the_parameters_as_lightning_does():
    def fit(plugin: Any) -> list[Tensor]:
        torch.manual_seed(0)
        model = TinyRegressor(overflow_steps=(2,))
        make_trainer(plugin, max_steps=5).fit(model, loader())
        return parameters_of(model)

    plugin = MixedPrecisionPlugin("bf16-mixed", device="cpu", skip_nonfinite=False)
    ours = fit(plugin)
    assert plugin.skipped_steps == 0
    assert not all(torch.isfinite(p).all() for p in ours)
    # Same arithmetic as Lightning's plugin, NaNs included.
    assert_close(ours, fit(MixedPrecision("bf16-mixed", "cpu")), rtol=0, atol=0, equal_nan=True)


# ------------------------------------------------------------------------------------------------------ fused Adam
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("gradient_clip_val", [None, 0.05], ids=["no-clipping", "clip-norm"])
def test_fused_adam_trains_and_matches_foreach_adam(precision, gradient_clip_val):
    # Lightning 2.6.6's built-in plugin raises for bf16-mixed + fused optimizer + clipping (#21435).
    def fit(optimizer: str) -> list[Tensor]:
        torch.manual_seed(0)
        # weight_decay makes the update depend on the gradients' magnitude, so a gradient left scaled would show.
        model = TinyRegressor(optimizer=optimizer, lr=1e-2, weight_decay=0.1, overflow_steps=(2,))
        trainer = make_trainer(plugin_for(precision), max_epochs=2, gradient_clip_val=gradient_clip_val)
        trainer.fit(model, loader())
        assert trainer.precision_plugin.skipped_steps == 1
        return parameters_of(model)

    torch.manual_seed(0)
    initial = parameters_of(TinyRegressor())
    fused = fit("fused_adam")
    assert all(torch.isfinite(p).all() for p in fused)
    assert all(not torch.equal(a, b) for a, b in zip(initial, fused, strict=True))
    # The fused CPU kernel computes the same Adam update in another order: last-bit differences per step, measured at
    # ~3e-7 relative after 15 steps.
    assert_close(fused, fit("foreach_adam"), rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------------------- refused set-ups
@pytest.mark.parametrize("precision", PRECISIONS)
def test_lbfgs_is_refused_with_a_type_error_that_names_it(precision):
    model = TinyRegressor(optimizer="lbfgs")
    with pytest.raises(TypeError, match="LBFGS"):
        make_trainer(plugin_for(precision), max_steps=1).fit(model, loader())
    assert model.forward_dtypes == []  # refused at set-up, before any training step


def test_a_scaler_with_bf16_is_refused_with_a_value_error():
    with pytest.raises(ValueError, match=r"bf16-mixed.*scaler"):
        MixedPrecisionPlugin("bf16-mixed", scaler=DynamicLossScaler())


@pytest.mark.parametrize("precision", ["32-true", "16", "bf16", "fp16"])
def test_an_unsupported_precision_is_refused_with_its_value_in_the_message(precision):
    with pytest.raises(ValueError, match=re.escape(f"precision={precision!r}")):
        MixedPrecisionPlugin(precision)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["tpu", "xla:0", "gpu", 0])
def test_an_unsupported_device_is_refused_with_its_value_in_the_message(device):
    with pytest.raises(ValueError, match=re.escape(f"device={device!r}")):
        MixedPrecisionPlugin("16-mixed", device=device)  # type: ignore[arg-type]


def test_a_torch_grad_scaler_is_refused_with_a_type_error_that_names_it():
    with pytest.raises(TypeError, match=r"scaler=<torch\.amp\.grad_scaler\.GradScaler"):
        MixedPrecisionPlugin("16-mixed", scaler=torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------------- checkpoints
def _fit_with_checkpoints(
    precision: str, dirpath: Path, ckpt_path: str | None = None
) -> tuple[TinyRegressor, MixedPrecisionPlugin, pl.Trainer]:
    torch.manual_seed(0)
    # data_from_step: each batch is drawn from the global step alone, so a resumed run sees the same data as the
    # uninterrupted one wherever Lightning restarts the (non-resumable) DataLoader.
    model = TinyRegressor(optimizer="adam", scheduler="step", overflow_steps=(4,), data_from_step=True)
    plugin = plugin_for(precision, growth_interval=2)
    every_step = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer(plugin, max_steps=10, max_epochs=-1, enable_checkpointing=True, callbacks=[every_step])
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    return model, plugin, trainer


@pytest.mark.filterwarnings(MID_EPOCH_RESUME_WARNING)
@pytest.mark.filterwarnings("ignore:The dirpath has changed from")  # the resumed run writes its checkpoints elsewhere
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("resume_step", [3, 5], ids=["mid-run", "right-after-a-skipped-step"])
def test_resuming_from_a_mid_run_checkpoint_matches_an_uninterrupted_run(tmp_path, precision, resume_step):
    # Step 4 overflows: the checkpoint "step=5" is the one written right after that skipped step.
    whole, whole_plugin, whole_trainer = _fit_with_checkpoints(precision, tmp_path / "whole")
    checkpoint = str(tmp_path / "whole" / f"step={resume_step}.ckpt")
    resumed, resumed_plugin, resumed_trainer = _fit_with_checkpoints(precision, tmp_path / "resumed", checkpoint)
    assert resumed_trainer.global_step == whole_trainer.global_step == 10
    # The same arithmetic from the same restored state: bit for bit.
    assert_close(parameters_of(resumed), parameters_of(whole), rtol=0, atol=0)
    assert_close(resumed_trainer.optimizers[0].state_dict(), whole_trainer.optimizers[0].state_dict(), rtol=0, atol=0)
    # Scale, trackers and skip counters (the one skipped step, also when it happened before the checkpoint).
    assert resumed_plugin.state_dict()["scaler"] == whole_plugin.state_dict()["scaler"]
    assert resumed_plugin.skipped_steps == whole_plugin.skipped_steps == 1


@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpoint_loads_with_weights_only_and_holds_the_plugin_state(tmp_path, precision):
    plugin = plugin_for(precision)
    trainer = make_trainer(plugin, max_steps=3)
    trainer.fit(TinyRegressor(overflow_steps=(1,)), loader())
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert checkpoint["MixedPrecisionPlugin"] == plugin.state_dict()
    assert checkpoint["MixedPrecisionPlugin"]["scaler"]["skipped_steps"] == 1


@pytest.mark.filterwarnings(MID_EPOCH_RESUME_WARNING)
def test_checkpoint_of_lightning_mixed_precision_resumes_with_its_grad_scaler_state(tmp_path):
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    theirs = make_trainer(MixedPrecision("16-mixed", "cpu", scaler=grad_scaler), max_steps=4)
    theirs.fit(TinyRegressor(overflow_steps=(1,)), loader())
    theirs.save_checkpoint(tmp_path / "lightning.ckpt")
    saved = torch.load(tmp_path / "lightning.ckpt", weights_only=True)["MixedPrecision"]
    assert (saved["scale"], saved["_growth_tracker"]) == (2.0**9, 2)  # backed off at step 1, then two clean steps

    at_start = ScalerStateAtStart()
    plugin = MixedPrecisionPlugin("16-mixed", device="cpu", scaler=DynamicLossScaler(growth_interval=3))
    ours = make_trainer(plugin, max_steps=6, max_epochs=-1, callbacks=[at_start])
    ours.fit(TinyRegressor(), loader(), ckpt_path=tmp_path / "lightning.ckpt")
    assert (at_start.state["scale"], at_start.state["_growth_tracker"]) == (2.0**9, 2)


@pytest.mark.filterwarnings(MID_EPOCH_RESUME_WARNING)
def test_a_grad_scaler_state_under_the_plugin_key_of_lightning_2_0_loads(tmp_path):
    trainer = make_trainer(plugin_for("16-mixed"), max_steps=2)
    trainer.fit(TinyRegressor(), loader())
    trainer.save_checkpoint(tmp_path / "ours.ckpt")
    checkpoint = torch.load(tmp_path / "ours.ckpt", weights_only=True)
    # Lightning 2.0-2.1 stored GradScaler.state_dict() under the key "MixedPrecisionPlugin", the name of our class.
    old_state = {
        "scale": 256.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
        "_growth_tracker": 7,
    }
    assert set(old_state) == set(torch.amp.GradScaler("cpu").state_dict())
    checkpoint["MixedPrecisionPlugin"] = old_state
    torch.save(checkpoint, tmp_path / "old.ckpt")

    at_start = ScalerStateAtStart()
    plugin = MixedPrecisionPlugin("16-mixed", device="cpu")
    resumed = make_trainer(plugin, max_steps=3, max_epochs=-1, callbacks=[at_start])
    resumed.fit(TinyRegressor(), loader(), ckpt_path=tmp_path / "old.ckpt")
    assert (at_start.state["scale"], at_start.state["_growth_tracker"]) == (256.0, 7)


def test_a_bf16_checkpoint_resumed_under_fp16_raises_a_value_error_naming_both_precisions(tmp_path):
    bf16 = make_trainer(plugin_for("bf16-mixed"), max_steps=2)
    bf16.fit(TinyRegressor(), loader())
    bf16.save_checkpoint(tmp_path / "bf16.ckpt")
    fp16 = make_trainer(plugin_for("16-mixed"), max_steps=3, max_epochs=-1)
    with pytest.raises(ValueError, match=r"'bf16-mixed'.*'16-mixed'"):
        fp16.fit(TinyRegressor(), loader(), ckpt_path=tmp_path / "bf16.ckpt")


# ------------------------------------------------------------------------------------------------------ the skip limit
@pytest.fixture
def single_process_ddp(one_process_group: None) -> dict[str, Any]:
    """Trainer arguments for DDP with one CPU process, so the model is really wrapped (names gain "module.")."""
    return {"strategy": "ddp", "devices": 1}


def test_an_overflow_at_every_step_stops_training_with_a_diagnosis_naming_the_parameters(single_process_ddp):
    seen_names: list[str] = []

    class Names(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
            seen_names[:] = [name for name, _ in trainer.strategy.model.named_parameters()]

    plugin = MixedPrecisionPlugin(
        "16-mixed", device="cpu", scaler=DynamicLossScaler(init_scale=4.0, max_consecutive_skips=3)
    )
    trainer = make_trainer(plugin, max_steps=20, callbacks=[Names()], **single_process_ddp)
    with pytest.raises(FloatingPointError) as raised:
        trainer.fit(TinyRegressor(overflow_steps=range(20)), loader())
    assert seen_names[0] == "module.net.0.weight"  # DDP wrapped the model...
    message = str(raised.value)
    # ...and the diagnosis names the parameters as the user wrote them.
    assert "net.0.weight, net.0.bias, net.2.weight, net.2.bias" in message
    assert "module." not in message
    # 4 -> 2 -> 1 (the floor), then 3 skips at the floor: 5 skipped in all.
    assert "scale=1," in message
    assert "5 skipped in all" in message


def test_the_diagnosis_keeps_the_name_of_a_submodule_the_user_called_module():
    class Wrapper(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.module = make_net()
            self.gain = torch.nn.Parameter(torch.ones(()))

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            return mse(self.module, batch) * self.gain * INF

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    scaler = DynamicLossScaler(init_scale=1.0, max_consecutive_skips=1)
    trainer = make_trainer(MixedPrecisionPlugin("16-mixed", device="cpu", scaler=scaler), max_steps=2)
    # The LightningModule's own parameter comes first, then those of its submodule called `module`.
    names = "gain, module.0.weight, module.0.bias, module.2.weight, module.2.bias."
    with pytest.raises(FloatingPointError, match=re.escape(names)):
        trainer.fit(Wrapper(), loader())


# ----------------------------------------------------------------------------------------------- backward-side hooks
@pytest.mark.parametrize("precision", PRECISIONS)
def test_on_before_backward_hooks_see_the_unscaled_loss(precision):
    class LossHooks(TinyRegressor):
        def __init__(self) -> None:
            super().__init__()
            self.returned: list[Tensor] = []
            self.module_hook: list[Tensor] = []

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            self.returned.append(loss.detach().clone())
            return loss

        def on_before_backward(self, loss: Tensor) -> None:
            self.module_hook.append(loss.detach().clone())

    callback_hook: list[Tensor] = []

    class LossCallback(pl.Callback):
        def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
            callback_hook.append(loss.detach().clone())

    model = LossHooks()
    make_trainer(plugin_for(precision), max_steps=3, callbacks=[LossCallback()]).fit(model, loader())
    assert len(model.returned) == 3
    # The very tensor training_step returned, before any multiply by the scale (2**10 for fp16): exact.
    assert_close(model.module_hook, model.returned, rtol=0, atol=0)
    assert_close(callback_hook, model.returned, rtol=0, atol=0)


def test_a_held_scheduler_pickles_and_copies_as_its_original_class() -> None:
    import copy as _copy
    import pickle

    from lightning_amp_plus.step import schedulers as _schedulers

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    _schedulers.hold(scheduler, _schedulers.StepLedger())
    clone = pickle.loads(pickle.dumps(scheduler))
    assert type(clone) is torch.optim.lr_scheduler.StepLR and clone.state_dict() == scheduler.state_dict()
    assert type(_copy.deepcopy(scheduler)) is torch.optim.lr_scheduler.StepLR
    assert type(scheduler) is not torch.optim.lr_scheduler.StepLR  # the original stays held


def test_garbage_under_lightnings_scaler_key_names_the_key() -> None:
    plugin = MixedPrecisionPlugin("16-mixed", device="cpu")
    with pytest.raises(TypeError, match=r"entry under 'MixedPrecision' is a str, not a GradScaler state dict"):
        plugin.on_load_checkpoint({"MixedPrecision": "garbage"})


# ---------------------------------------------------------------------------------------------- option checks
@pytest.mark.parametrize("option", ["skip_nonfinite", "hold_schedulers_on_skip", "master_weights"])
@pytest.mark.parametrize("value", ["false", "no", 0, 1, None])
def test_flags_must_be_bools_and_the_error_names_the_option_and_the_value(option: str, value: Any) -> None:
    with pytest.raises(
        TypeError, match=rf"`MixedPrecisionPlugin\({option}={re.escape(repr(value))}\)` must be True or False"
    ):
        MixedPrecisionPlugin("bf16-mixed", **{option: value})


@pytest.mark.parametrize("value", ["abc", -5, 0, 2.5, True])
def test_max_consecutive_skips_must_be_a_positive_int_or_none(value: Any) -> None:
    with pytest.raises(ValueError, match=rf"max_consecutive_skips={re.escape(repr(value))}\)` must be an int >= 1"):
        MixedPrecisionPlugin("16-mixed", max_consecutive_skips=value)


def test_max_consecutive_skips_given_to_the_plugin_configures_the_default_fp16_scaler() -> None:
    plugin = MixedPrecisionPlugin("16-mixed", max_consecutive_skips=5)
    assert plugin.scaler is not None and plugin.scaler.engine.max_consecutive_skips == 5
    assert MixedPrecisionPlugin("16-mixed", max_consecutive_skips=None).scaler.engine.max_consecutive_skips is None  # type: ignore[union-attr]


def test_a_scaler_keeps_its_own_limit_and_a_different_explicit_plugin_limit_is_refused() -> None:
    own = DynamicLossScaler(max_consecutive_skips=10)
    assert MixedPrecisionPlugin("16-mixed", scaler=own).scaler is own and own.engine.max_consecutive_skips == 10
    assert MixedPrecisionPlugin("16-mixed", scaler=own, max_consecutive_skips=10).scaler is own
    with pytest.raises(
        ValueError, match=r"max_consecutive_skips=10 differs from .*max_consecutive_skips=5\).*one place"
    ):
        MixedPrecisionPlugin("16-mixed", scaler=own, max_consecutive_skips=5)


def test_an_overflow_at_every_step_stops_at_the_plugins_limit_in_fp16() -> None:
    plugin = MixedPrecisionPlugin("16-mixed", device="cpu", max_consecutive_skips=3)
    plugin.scaler.load_state_dict({"scale": 1.0})  # type: ignore[union-attr]  # at the floor from the start
    with pytest.raises(FloatingPointError, match=r"3 optimizer steps in a row were skipped"):
        make_trainer(plugin, max_steps=20, max_epochs=-1).fit(TinyRegressor(overflow_steps=range(20)), loader(n=160))


# ------------------------------------------------------------------------------------ checkpointed plugin state
def bf16_plugin(**options: Any) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("bf16-mixed", device="cpu", **options)


def saved_plugin_state(tmp_path: Path, **plugin_options: Any) -> Path:
    trainer = make_trainer(bf16_plugin(**plugin_options), max_steps=2)
    trainer.fit(TinyRegressor(), loader())
    trainer.save_checkpoint(tmp_path / "saved.ckpt")
    return tmp_path / "saved.ckpt"


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (-7, ValueError, r"held_scheduler_steps=-7; expected an int in \[0, 2\*\*62\]"),
        (2**70, ValueError, r"held_scheduler_steps=\d+; expected an int in \[0, 2\*\*62\]"),
        ("lots", TypeError, r"held_scheduler_steps='lots' \(str\); expected an int >= 0"),
        (1.5, TypeError, r"held_scheduler_steps=1.5 \(float\)"),
    ],
)
def test_a_corrupt_held_scheduler_count_is_refused_naming_the_key(
    tmp_path: Path, value: Any, error: type[Exception], message: str
) -> None:
    path = saved_plugin_state(tmp_path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["MixedPrecisionPlugin"]["held_scheduler_steps"] = value
    torch.save(checkpoint, path)
    with pytest.raises(error, match=message):
        make_trainer(bf16_plugin(), max_steps=3, max_epochs=-1).fit(TinyRegressor(), loader(), ckpt_path=path)


@pytest.mark.parametrize("saved", [True, False])
def test_resuming_with_another_master_weights_setting_is_refused_with_the_way_out(tmp_path: Path, saved: bool) -> None:
    path = saved_plugin_state(tmp_path, master_weights=saved)
    resumed = make_trainer(bf16_plugin(master_weights=not saved), max_steps=3, max_epochs=-1)
    with pytest.raises(
        ValueError, match=rf"master_weights={saved}\), this run uses master_weights={not saved}.*Resume"
    ):
        resumed.fit(TinyRegressor(), loader(), ckpt_path=path)


def test_the_slow_fp16_on_cpu_warning_is_given_once_per_plugin_across_its_runs() -> None:
    # Python's once-per-place rule is reset by any warnings.catch_warnings() block (a replay of the monitor's runs
    # one): the plugin itself must remember that it warned, or each run it is connected to (a fit, then the validate
    # amp-plus train runs after it) warns again.
    plugin = MixedPrecisionPlugin("16-mixed", device="cpu")
    model = TinyRegressor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        make_trainer(plugin, max_steps=1, max_epochs=-1).fit(model, loader())
        with warnings.catch_warnings():
            pass
        make_trainer(plugin, max_steps=1, max_epochs=-1).fit(model, loader())
    slow = [w for w in caught if "fp16 autocast is correct there but slow" in str(w.message)]
    assert len(slow) == 1


# ------------------------------------------------------------------------------------------- the norm, on request
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_the_norm_is_measured_for_a_reader_only_and_reading_it_changes_no_parameter(precision):
    # Nothing reads the norm: the check is GradScaler's one pass, which measures none. A monitor asks for it from its
    # first step on. Either way the overflow at step 2 is skipped and every parameter is the same, bit for bit; under
    # fp16 they are Lightning's with GradScaler (which skips it too).
    def fit(plugin: Any, callbacks: list[pl.Callback]) -> list[Tensor]:
        torch.manual_seed(0)
        model = TinyRegressor(overflow_steps=(2,))
        make_trainer(plugin, max_steps=5, callbacks=callbacks).fit(model, loader())
        return parameters_of(model)

    alone, watched = our_plugin(precision), our_plugin(precision)
    unwatched = fit(alone, [])
    assert_close(fit(watched, [MixedPrecisionMonitor(log_memory=False)]), unwatched, rtol=0, atol=0)
    if precision == "16-mixed":
        assert_close(unwatched, fit(lightning_plugin(precision), []), rtol=0, atol=0)
    assert [r.skipped for r in alone.recent_steps] == [r.skipped for r in watched.recent_steps] == [0, 0, 1, 0, 0]
    assert [r.grad_norm for r in alone.recent_steps] == [None] * 5
    norms = [r.grad_norm for r in watched.recent_steps]
    assert [n is not None and math.isfinite(n) for n in norms] == [True, True, False, True, True]
    assert norms[2] is not None  # the overflow's norm: inf or NaN
