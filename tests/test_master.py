"""FP32 master weights: ``MixedPrecisionPlugin(master_weights=True)`` and the buffers under it (``_master``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import FP16_ON_CPU_WARNING, INF, PRECISIONS, TinyRegressor, loader, make_trainer, parameters_of
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionPlugin
from lightning_amp_plus._master import MasterWeights, convert_to_half_, default_fp32_modules

pytestmark = [
    pytest.mark.filterwarnings(FP16_ON_CPU_WARNING),
    # The resume tests take their batches from the step number, not the loader (see TinyRegressor.data_from_step).
    pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable.*"),
]
HALF = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


def ours(precision: str, **kwargs: Any) -> MixedPrecisionPlugin:
    # A start scale of 2**10 keeps these small models clear of fp16 overflow, so runs compare step for step.
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=10_000) if precision == "16-mixed" else None
    return MixedPrecisionPlugin(precision, device="cpu", scaler=scaler, master_weights=True, **kwargs)


def lightnings(precision: str) -> MixedPrecision:
    plugin = MixedPrecision(precision, device="cpu")  # type: ignore[arg-type]
    if plugin.scaler is not None:
        plugin.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10_000)
    return plugin


def fit(model: pl.LightningModule, plugin: Any = None, steps: int = 24, **kwargs: Any) -> pl.Trainer:
    trainer = make_trainer(plugin, max_steps=steps, max_epochs=-1, **kwargs)
    trainer.fit(model, loader(n=64, batch_size=8))
    return trainer


# ------------------------------------------------------------------------------------------------ lost updates
class OneWeight(pl.LightningModule):
    """A single weight w = 1.0 and the loss -w: SGD(lr=1e-4) adds 1e-4 to w at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return -(self.w.float().sum())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def thousand_steps(plugin: Any = None, precision: str | None = None) -> OneWeight:
    model = OneWeight()
    data = DataLoader(TensorDataset(torch.zeros(1000, 1)), batch_size=1)
    kwargs: dict[str, Any] = {} if precision is None else {"precision": precision}
    # barebones: no logging or progress machinery, a third of the per-step cost of a default Trainer.
    make_trainer(plugin, max_steps=1000, barebones=True, **kwargs).fit(model, data)
    return model


def fp32_reference_of_thousand_steps() -> Tensor:
    """The same 1000 SGD steps on an FP32 weight: what the master must equal exactly."""
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=1e-4)
    for _ in range(1000):
        w.grad = -torch.ones(1)
        opt.step()
    return w.detach()


@pytest.mark.parametrize(
    ("precision", "true_precision", "half_spacing"), [("16-mixed", "16-true", 1e-3), ("bf16-mixed", "bf16-true", 4e-3)]
)
def test_updates_below_the_half_spacing_are_kept_by_the_masters_and_lost_by_lightnings_true_modes(
    precision: str, true_precision: str, half_spacing: float
) -> None:
    plugin = ours(precision)
    model = thousand_steps(plugin)
    master = plugin.master_params(plugin_optimizer(model))[0]
    # The gradient (-1, scaled by a power of two) is exact in every dtype, so the master takes exactly the steps an
    # FP32 weight takes; those are 1.1 up to 1000 float32 roundings of half an ulp (6e-8) each: 6e-5.
    torch.testing.assert_close(master, fp32_reference_of_thousand_steps(), rtol=0, atol=0)
    torch.testing.assert_close(master, torch.tensor([1.1]), rtol=0, atol=6e-5)
    # The model's copy is the master rounded to the half dtype: within its spacing at 1.1.
    assert model.w.dtype == HALF[precision]
    torch.testing.assert_close(model.w.float(), torch.tensor([1.1]), rtol=0, atol=half_spacing)
    # Lightning's *-true modes update the half weight directly: 1e-4 is under half its spacing at 1.0, lost every time.
    lightning_model = thousand_steps(precision=true_precision)
    assert lightning_model.w.item() == 1.0


def plugin_optimizer(model: pl.LightningModule) -> torch.optim.Optimizer:
    return model.trainer.optimizers[0]


# ------------------------------------------------------------------------------------------------- conversion
class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.register_buffer("offset", torch.ones(4))


def test_conversion_is_in_place_keeps_normalisation_fp32_and_returns_the_exact_fp32_values() -> None:
    net = Normed()
    weight = net.lin.weight
    before = weight.detach().clone()
    originals = convert_to_half_(net, torch.bfloat16, default_fp32_modules())
    assert net.lin.weight is weight and weight.dtype == torch.bfloat16  # the same Parameter object: DDP-safe
    assert net.block[0].weight.dtype == torch.bfloat16 and net.offset.dtype == torch.bfloat16
    assert net.bn.weight.dtype == net.bn.running_mean.dtype == net.block[1].weight.dtype == torch.float32
    assert torch.equal(originals[weight], before)  # not the bf16 value converted back
    assert set(originals) == {net.lin.weight, net.lin.bias, net.block[0].weight, net.block[0].bias}


def test_keep_fp32_is_configurable_and_empty_converts_everything() -> None:
    net = Normed()
    convert_to_half_(net, torch.float16, ())
    assert {p.dtype for p in net.parameters()} == {torch.float16}
    net = Normed()
    convert_to_half_(net, torch.float16, (nn.Linear,))
    assert net.lin.weight.dtype == torch.float32 and net.bn.weight.dtype == torch.float16


def test_conversion_rejects_a_full_precision_dtype() -> None:
    with pytest.raises(ValueError, match=r"dtype=torch.float32.*float16 or torch.bfloat16"):
        convert_to_half_(nn.Linear(1, 1), torch.float32)


def test_masters_replace_half_params_in_place_keeping_groups_options_and_state() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    convert_to_half_(model, torch.float16, default_fp32_modules())
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters(), "lr": 0.1, "weight_decay": 0.5}, {"params": model[1].parameters()}],
        lr=0.01,
    )
    masters = MasterWeights(opt)
    assert len(masters) == 2
    assert [group["lr"] for group in opt.param_groups] == [0.1, 0.01] and opt.param_groups[0]["weight_decay"] == 0.5
    assert all(p.dtype == torch.float32 for group in opt.param_groups for p in group["params"])
    assert opt.param_groups[1]["params"][0] is model[1].weight  # FP32 already: its own master
    assert torch.equal(masters.masters[0], model[0].weight.float())


# --------------------------------------------------------------------------------------- numerics vs references
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_masters_follow_lightnings_mixed_run_bit_for_bit(precision: str, optimizer: str) -> None:
    """Autocast casts FP32 weights to the half dtype in every forward: exactly our rounded copy. The half gradient is
    then widened (Lightning: by the cast's backward; ours: by the unscale pass) and stepped in FP32, so a run with
    master weights must equal Lightning's *-mixed run exactly, overflow skips and LR schedule included."""
    torch.manual_seed(0)
    # Lightning's bf16 plugin does not skip a non-finite step (its weights would turn NaN): inject into fp16 only.
    overflow_steps = {5} if precision == "16-mixed" else set()
    reference = TinyRegressor(overflow_steps=overflow_steps, optimizer=optimizer, scheduler="step", weight_decay=0.01)
    model = copy.deepcopy(reference)
    fit(reference, lightnings(precision))
    plugin = ours(precision, hold_schedulers_on_skip=False)  # Lightning's plugin decays the LR on skipped steps too
    fit(model, plugin)
    masters = plugin.master_params(plugin_optimizer(model))
    torch.testing.assert_close(masters, parameters_of(reference), rtol=0, atol=0)
    assert plugin.skipped_steps == len(overflow_steps)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fp32_gradient_accumulation_equals_lightnings_mixed_accumulation(precision: str) -> None:
    """Lightning accumulates the widened half gradients in FP32 parameter gradients: so does fp32_grad_accumulation."""
    torch.manual_seed(0)
    # SGD: Adam would turn the half sums' rounding of near-zero gradients into full-size steps of either sign.
    reference = TinyRegressor(optimizer="sgd")
    model, half_accumulating = copy.deepcopy(reference), copy.deepcopy(reference)
    fit(reference, lightnings(precision), accumulate_grad_batches=4)
    plugin = ours(precision, fp32_grad_accumulation=True)
    fit(model, plugin, accumulate_grad_batches=4)
    torch.testing.assert_close(plugin.master_params(plugin_optimizer(model)), parameters_of(reference), rtol=0, atol=0)
    # The default sums in the half dtype: each partial sum is rounded to 11 (fp16) or 8 (bf16) bits, so the steps
    # differ by up to 2**-8 relative; 6 steps of lr 0.05 keep the weights within 1e-3 + 1%.
    other = ours(precision)
    fit(half_accumulating, other, accumulate_grad_batches=4)
    torch.testing.assert_close(
        other.master_params(plugin_optimizer(half_accumulating)), parameters_of(reference), rtol=0.01, atol=1e-3
    )


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_tracks_an_fp32_run_and_converges_as_well(precision: str) -> None:
    torch.manual_seed(0)
    fp32 = TinyRegressor(lr=0.05)
    model = copy.deepcopy(fp32)
    fp32_trainer = fit(fp32, steps=200)
    trainer = fit(model, ours(precision), steps=200)
    losses = [float(t.callback_metrics.get("train_loss", torch.nan)) for t in (fp32_trainer, trainer)]
    del losses  # TinyRegressor does not log; measure the loss on the data directly
    x, y = loader(n=64, batch_size=64).dataset[:]
    with torch.no_grad():
        fp32_loss = F.mse_loss(fp32.net(x), y)
        ours_loss = F.mse_loss(model.net(x.to(HALF[precision])).float(), y)
        start_loss = F.mse_loss(TinyRegressor().net(x), y)
    # Converges at least as well, up to the half dtype's rounding of the forward pass (2**-8 relative for bf16).
    assert ours_loss <= fp32_loss * 1.02 and ours_loss < start_loss
    # And the weights stay near the fp32 run's: every forward computes in the half dtype (relative error 2**-11 for
    # fp16, 2**-8 for bf16 per op), and 200 steps of SGD carry those differences along, hence the loose tolerance.
    tolerance = 0.02 if precision == "16-mixed" else 0.1
    torch.testing.assert_close(
        [p.float() for p in model.parameters()], parameters_of(fp32), rtol=tolerance, atol=tolerance
    )


def test_a_pure_fp16_model_trains_with_dynamic_loss_scaling_where_grad_scaler_refuses() -> None:
    torch.manual_seed(0)
    model = TinyRegressor(overflow_steps={3})
    model.net.append(nn.LayerNorm(1))
    plugin = MixedPrecisionPlugin("16-mixed", device="cpu", master_weights=True, keep_fp32=())
    fit(model, plugin, steps=40)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert plugin.skipped_steps >= 1 and all(torch.isfinite(p).all() for p in model.parameters())
    # torch's GradScaler cannot unscale fp16 gradients at all.
    param = nn.Parameter(torch.ones(2, dtype=torch.float16))
    param.grad = torch.ones(2, dtype=torch.float16)
    grad_scaler = torch.amp.GradScaler("cpu")
    grad_scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="FP16 gradients"):
        grad_scaler.unscale_(torch.optim.SGD([param], lr=0.1))


# -------------------------------------------------------------------------------------------- skipped steps
class Snapshots(pl.Callback):
    """Model weights, masters and Adam state around each optimizer step, and gradient memory after it."""

    def __init__(self) -> None:
        self.before: list[list[Tensor]] = []
        self.after: list[list[Tensor]] = []
        self.grads_left: list[int] = []

    def _state(self, trainer: pl.Trainer, module: pl.LightningModule) -> list[Tensor]:
        opt = trainer.optimizers[0]
        state = [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, Tensor)]
        masters = trainer.precision_plugin.master_params(opt)  # type: ignore[attr-defined]
        return parameters_of(module) + [m.detach().clone() for m in masters] + state

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.before.append(self._state(trainer, module))

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.after.append(self._state(trainer, module))
        masters = trainer.precision_plugin.master_params(trainer.optimizers[0])  # type: ignore[attr-defined]
        self.grads_left.append(sum(t.grad is not None for t in [*module.parameters(), *masters]))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_skipped_step_leaves_weights_masters_and_optimizer_state_untouched(precision: str) -> None:
    model = TinyRegressor(overflow_steps={4}, optimizer="adam", scheduler="step")
    snapshots = Snapshots()
    plugin = ours(precision)
    trainer = fit(model, plugin, steps=8, callbacks=[snapshots])
    assert plugin.skipped_steps == 1 and plugin.held_scheduler_steps == 1
    torch.testing.assert_close(snapshots.after[4], snapshots.before[4], rtol=0, atol=0)
    assert not torch.equal(snapshots.after[5][0], snapshots.before[5][0])  # the next step applies again
    # 7 applied steps of StepLR(gamma=0.5): the held step did not decay the LR.
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**7)
    # No gradient memory survives a step, half or FP32 (Lightning's zero_grad would free only the masters').
    assert snapshots.grads_left == [0] * 8


def test_overflow_diagnostics_name_the_model_parameters_not_masters() -> None:
    class OneBadLayer(TinyRegressor):
        def on_after_backward(self) -> None:
            if self.trainer.global_step == 2:
                self.net[2].weight.grad[0, 0] = INF

    plugin = ours("16-mixed")
    fit(OneBadLayer(), plugin, steps=4)
    assert plugin.skipped_steps == 1 and plugin.last_overflow_params == ["net.2.weight"]


def test_bf16_with_nothing_checked_still_steps_the_masters() -> None:
    model = TinyRegressor()
    before = parameters_of(model)
    plugin = MixedPrecisionPlugin("bf16-mixed", device="cpu", master_weights=True, skip_nonfinite=False)
    trainer = fit(model, plugin, steps=5, gradient_clip_val=0.5)
    masters = plugin.master_params(trainer.optimizers[0])
    assert not torch.equal(masters[0], before[0]) and torch.equal(masters[0].bfloat16(), model.net[0].weight)


class ManualTwoSteps(TinyRegressor):
    """Manual optimization: two backward passes accumulate, then clip and step; zero_grad at the start."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.automatic_optimization = False
        self.stale_grads: list[int] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        self.stale_grads.append(sum(p.grad is not None for p in self.parameters()))
        if batch_idx % 3 == 2:
            self.manual_backward(super().training_step(batch, batch_idx))  # left over: zero_grad must clear it
            return
        for _ in range(2):
            self.manual_backward(super().training_step(batch, batch_idx))
        self.clip_gradients(opt, gradient_clip_val=0.1, gradient_clip_algorithm="norm")  # type: ignore[arg-type]
        opt.step()  # type: ignore[union-attr]


def test_manual_optimization_zero_grad_clears_half_gradients_and_clipping_acts_on_masters() -> None:
    model = ManualTwoSteps()
    plugin = ours("bf16-mixed")
    trainer = fit(model, plugin, steps=6)
    assert model.stale_grads == [0] * len(model.stale_grads)
    assert plugin.last_grad_norm is not None and plugin.last_grad_norm > 0
    masters = plugin.master_params(trainer.optimizers[0])
    assert torch.equal(masters[0].bfloat16(), model.net[0].weight)


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpoint_resume_equals_the_uninterrupted_run(tmp_path: Path, precision: str) -> None:
    torch.manual_seed(0)
    straight = TinyRegressor(overflow_steps={3, 9}, optimizer="adam", scheduler="step", data_from_step=True)
    first, second = copy.deepcopy(straight), copy.deepcopy(straight)
    full = ours(precision)
    fit(straight, full, steps=12)
    half_way = fit(first, ours(precision), steps=6)
    path = tmp_path / "six.ckpt"
    half_way.save_checkpoint(path)
    resumed = ours(precision)
    trainer = make_trainer(resumed, max_steps=12, max_epochs=-1)
    trainer.fit(second, loader(n=64, batch_size=8), ckpt_path=path)
    torch.testing.assert_close(
        resumed.master_params(trainer.optimizers[0]), full.master_params(plugin_optimizer(straight)), rtol=0, atol=0
    )
    torch.testing.assert_close(parameters_of(second), parameters_of(straight), rtol=0, atol=0)
    assert resumed.skipped_steps == full.skipped_steps == 2
    saved, now = plugin_optimizer(straight).state_dict()["state"], trainer.optimizers[0].state_dict()["state"]
    torch.testing.assert_close(now, saved, rtol=0, atol=0)


def test_checkpoints_and_state_dict_hold_the_fp32_masters_and_load_alone(tmp_path: Path) -> None:
    model = TinyRegressor()
    plugin = ours("16-mixed")
    trainer = fit(model, plugin, steps=10)
    masters = plugin.master_params(trainer.optimizers[0])
    state = model.state_dict()
    assert model.net[0].weight.dtype == torch.float16 and state["net.0.weight"].dtype == torch.float32
    torch.testing.assert_close(
        [state[k] for k in ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias")], masters
    )
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["MixedPrecisionPlugin"]["master_weights"] is True
    alone = TinyRegressor.load_from_checkpoint(path)  # the LightningModule by itself: an FP32 model, exact masters
    torch.testing.assert_close(parameters_of(alone), masters, rtol=0, atol=0)


def test_a_second_fit_continues_from_the_masters_not_the_rounded_weights() -> None:
    model = OneWeight()
    plugin = ours("bf16-mixed")
    data = DataLoader(TensorDataset(torch.zeros(10, 1)), batch_size=1)
    trainer = make_trainer(plugin, max_epochs=1)
    trainer.fit(model, data)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, data)
    master = plugin.master_params(trainer.optimizers[0])[0]
    torch.testing.assert_close(master, torch.tensor([1.002]), rtol=0, atol=1e-6)  # bf16 alone would stay at 1.0


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"keep_fp32": (nn.LayerNorm,)}, ValueError, r"keep_fp32=.*master weights only: add master_weights=True"),
        ({"fp32_grad_accumulation": True}, ValueError, r"fp32_grad_accumulation=True.*add master_weights=True"),
        ({"master_weights": True, "keep_fp32": ("LayerNorm",)}, TypeError, r"keep_fp32=\('LayerNorm',\).*subclasses"),
    ],
)
def test_bad_master_weight_options_raise_naming_the_argument(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        MixedPrecisionPlugin("bf16-mixed", **kwargs)


def test_lbfgs_is_refused_with_master_weights() -> None:
    with pytest.raises(TypeError, match=r"master_weights=True\) cannot drive torch.optim.LBFGS"):
        fit(
            TinyRegressor(optimizer="lbfgs"),
            MixedPrecisionPlugin("bf16-mixed", master_weights=True, skip_nonfinite=False),
        )


class WeightsAtStep(pl.Callback):
    """What the model's half weights look like while the optimizer steps (an optimizer step pre-hook)."""

    def __init__(self) -> None:
        self.sizes: list[list[int]] = []
        self.pointers: list[list[int]] = []

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        def record(*_: Any) -> None:
            self.sizes.append([p.numel() for p in module.parameters()])
            self.pointers.append([p.data_ptr() for p in module.parameters()])

        trainer.optimizers[0].register_step_pre_hook(record)


def test_half_weights_are_released_while_the_optimizer_steps_and_rounded_back_after() -> None:
    model = TinyRegressor(overflow_steps={2})
    probe = WeightsAtStep()
    plugin = ours("bf16-mixed")
    trainer = fit(model, plugin, steps=4, callbacks=[probe])
    # The step's peak holds masters, their gradients and the optimizer state, not the 2-byte half copies.
    assert probe.sizes == [[0, 0, 0, 0]] * 3  # three applied steps; the skipped one never reached optimizer.step
    masters = plugin.master_params(trainer.optimizers[0])
    assert [p.shape for p in model.parameters()] == [m.shape for m in masters]
    assert all(torch.equal(m.bfloat16(), p) for m, p in zip(masters, model.parameters(), strict=True))


class TinyLSTM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 4, batch_first=True)
        self.head = nn.Linear(4, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        out, _ = self.lstm(x.unsqueeze(1).to(self.lstm.weight_ih_l0.dtype))
        return F.mse_loss(self.head(out[:, -1]).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_rnn_weights_keep_their_memory_so_cudnn_keeps_its_flat_chunk() -> None:
    model = TinyLSTM()
    probe = WeightsAtStep()
    plugin = ours("bf16-mixed")
    fit(model, plugin, steps=3, callbacks=[probe])
    lstm_weights = len(list(model.lstm.parameters()))
    assert all(all(size > 0 for size in sizes[:lstm_weights]) for sizes in probe.sizes)
    assert all(sizes[lstm_weights:] == [0, 0] for sizes in probe.sizes)  # the Linear head is released
    assert len({tuple(p[:lstm_weights]) for p in probe.pointers}) == 1  # the same storage at every step
    assert model.lstm.weight_ih_l0.dtype == torch.bfloat16
