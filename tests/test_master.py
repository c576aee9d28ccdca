"""FP32 master weights: ``MixedPrecisionPlugin(master_weights=True)`` and its half copies (``numerics/master.py``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    FP16_ON_CPU_WARNING,
    HALF,
    INF,
    PRECISIONS,
    StateAroundSteps,
    TinyRegressor,
    lightning_plugin,
    loader,
    make_trainer,
    our_plugin,
    parameters_of,
)
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import MixedPrecisionPlugin
from lightning_amp_plus.numerics.master import HalfCopies, default_half_modules, managed_parameters

pytestmark = [
    pytest.mark.filterwarnings(FP16_ON_CPU_WARNING),
    # The resume tests take their batches from the step number, not the loader (see TinyRegressor.data_from_step).
    pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable.*"),
]


def ours(precision: str, **kwargs: Any) -> MixedPrecisionPlugin:
    return our_plugin(precision, master_weights=True, **kwargs)


def fit(model: pl.LightningModule, plugin: Any = None, steps: int = 24, **kwargs: Any) -> pl.Trainer:
    trainer = make_trainer(plugin, max_steps=steps, max_epochs=-1, **kwargs)
    trainer.fit(model, loader(n=64, batch_size=8))
    return trainer


# ------------------------------------------------------------------------------------------------ lost updates
class OneWeight(pl.LightningModule):
    """A single weight w = 1.0 (a bias-free Linear(1, 1)) and the loss -w: SGD(lr=1e-4) adds 1e-4 to w at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.layer.weight.fill_(1.0)
        self.dtypes_seen: set[torch.dtype] = set()

    @property
    def w(self) -> Tensor:
        return self.layer.weight.view(1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.dtypes_seen.add(self.w.dtype)
        return -self.layer(torch.ones(1, 1)).float().sum()

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


@pytest.mark.parametrize("precision", PRECISIONS)
def test_updates_below_the_half_spacing_are_kept_and_lost_by_lightnings_true_modes(precision: str) -> None:
    model = thousand_steps(ours(precision))
    # Forward and backward saw the half copy; the optimizer stepped the FP32 weight, which the model holds after fit.
    assert model.dtypes_seen == {HALF[precision]} and model.w.dtype == torch.float32
    # The gradient (-1, scaled by a power of two) is exact in every dtype, so the weight takes exactly the steps an
    # FP32 weight takes; those are 1.1 up to 1000 float32 roundings of half an ulp (6e-8) each: 6e-5.
    torch.testing.assert_close(model.w.detach(), fp32_reference_of_thousand_steps(), rtol=0, atol=0)
    torch.testing.assert_close(model.w.detach(), torch.tensor([1.1]), rtol=0, atol=6e-5)
    # Lightning's *-true modes update the half weight directly: 1e-4 is under half its spacing at 1.0, lost every time.
    assert thousand_steps(precision=precision.replace("mixed", "true")).w.item() == 1.0


# ------------------------------------------------------------------------------------------ which parameters
class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.out = nn.Linear(4, 10)
        self.out.weight = self.emb.weight  # tied
        self.positions = nn.Parameter(torch.zeros(4))  # used elementwise, outside autocast's casts
        self.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))
        self.head = nn.Sequential(nn.Linear(4, 2))


def names_of(module: nn.Module, params: list[nn.Parameter]) -> list[str]:
    ids = {id(p) for p in params}
    return [name for name, p in module.named_parameters() if id(p) in ids]


def test_by_default_only_the_layers_autocast_runs_in_half_get_half_copies() -> None:
    model = Mixed()
    # Not the embedding, the LayerNorm, the positions, the float64 scale, nor the decoder weight tied to the embedding.
    assert names_of(model, managed_parameters(model)) == [
        "lin.weight",
        "lin.bias",
        "out.bias",
        "head.0.weight",
        "head.0.bias",
    ]


def test_half_modules_widens_the_choice_and_keep_fp32_excludes_whole_subtrees() -> None:
    model = Mixed()
    assert names_of(model, managed_parameters(model, half_modules=(nn.Module,))) == [
        "positions",
        "emb.weight",  # tied to out.weight: one parameter, once
        "lin.weight",
        "lin.bias",
        "norm.weight",
        "norm.bias",
        "out.bias",
        "head.0.weight",
        "head.0.bias",
    ]  # everything floating but the float64 scale
    assert names_of(model, managed_parameters(model, keep_fp32=(nn.Sequential,))) == [
        "lin.weight",
        "lin.bias",
        "out.bias",
    ]
    assert all(issubclass(kind, default_half_modules()) for kind in (nn.LSTM, nn.Conv2d, nn.MultiheadAttention))


def test_half_dtype_parameters_are_widened_to_fp32_masters() -> None:
    param = nn.Parameter(torch.full((2,), 1.5, dtype=torch.bfloat16))
    HalfCopies([param], torch.bfloat16)
    assert param.dtype == torch.float32 and param.tolist() == [1.5, 1.5]


# ----------------------------------------------------------------------------------------------- the swaps
def test_narrowing_keeps_the_parameter_object_its_values_and_its_memory_format() -> None:
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    weight, fp32 = conv.weight, conv.weight.detach().clone()
    copies = HalfCopies(conv.parameters(), torch.float16)
    copies.narrow_()
    assert conv.weight is weight and weight.dtype == torch.float16 and copies.holds_half(weight)
    assert weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(weight.float(), fp32, rtol=2**-11, atol=0)  # fp16 rounding: half an ulp, relative
    copies.widen_()
    assert weight.dtype == torch.float32 and torch.equal(weight.detach(), fp32)  # the FP32 data itself, unrounded
    assert weight.is_contiguous(memory_format=torch.channels_last)


def test_widening_turns_the_half_gradient_into_the_same_fp32_gradient() -> None:
    lin = nn.Linear(4, 2)
    copies = HalfCopies(lin.parameters(), torch.bfloat16)
    copies.narrow_()
    lin(torch.randn(3, 4, dtype=torch.bfloat16)).sum().backward()
    half = [p.grad.clone() for p in lin.parameters()]  # type: ignore[union-attr]
    copies.widen_()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lin.parameters())
    torch.testing.assert_close([p.grad for p in lin.parameters()], [g.float() for g in half], rtol=0, atol=0)


def test_a_gradient_kept_across_a_narrowing_goes_on_summing_in_fp32() -> None:
    w = nn.Parameter(torch.zeros(1))
    copies = HalfCopies([w], torch.bfloat16)
    copies.narrow_()
    (w * 1.0).sum().backward()
    copies.widen_()  # e.g. a load_state_dict in the middle of an accumulation cycle
    copies.narrow_()
    (w * 2.0**-9).sum().backward()  # bf16 would round 1 + 2**-9 back to 1
    copies.widen_()
    assert w.grad is not None and w.grad.dtype == torch.float32 and w.grad.item() == 1.0 + 2.0**-9


def test_fp32_accumulation_sums_each_micro_batch_in_fp32() -> None:
    w = nn.Parameter(torch.zeros(1))
    copies = HalfCopies([w], torch.bfloat16)
    copies.narrow_()
    # 1 + 100 * 2**-9: in bf16 (8 significant bits) every 2**-9 added to 1 is rounded away; in FP32 it is kept.
    (w * 1.0).sum().backward()
    for _ in range(100):
        copies.widen_grads_()  # before each backward that adds to a sum
        (w * 2.0**-9).sum().backward()
    copies.widen_()
    assert w.grad is not None and w.grad.item() == 1.0 + 100 * 2.0**-9


def test_an_in_place_write_into_the_half_copy_is_kept_at_widening() -> None:
    w = nn.Parameter(torch.full((2,), 3.0))
    copies = HalfCopies([w], torch.float16)
    copies.narrow_()
    with torch.no_grad():
        w.fill_(0.5)  # a callback clamping or loading weights while the step holds its half copies
    copies.widen_()
    assert w.dtype == torch.float32 and w.tolist() == [0.5, 0.5]


def test_state_dict_gives_fp32_values_and_load_state_dict_loads_unrounded_while_half() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    copies = HalfCopies(managed_parameters(net), torch.bfloat16)
    copies.hook_state_dicts(net)
    fp32 = {k: v.clone() for k, v in net.state_dict().items()}
    copies.narrow_()
    state = net.state_dict()
    assert net[0].weight.dtype == torch.bfloat16 and all(v.dtype == torch.float32 for v in state.values())
    torch.testing.assert_close(state, fp32, rtol=0, atol=0)
    torch.testing.assert_close(net[0].state_dict(), {"weight": fp32["0.weight"], "bias": fp32["0.bias"]})
    exact = {k: torch.full_like(v, 1 + 2.0**-20) for k, v in fp32.items()}  # not representable in bf16
    net.load_state_dict(exact)
    assert net[0].weight.dtype == torch.float32
    torch.testing.assert_close(net.state_dict(), exact, rtol=0, atol=0)
    copies.unhook()
    copies.narrow_()
    assert net.state_dict()["0.weight"].dtype == torch.bfloat16  # unhooked: the plain half copy


def test_a_deep_copy_of_a_hooked_model_is_an_ordinary_model() -> None:
    net = nn.Linear(2, 2)
    copies = HalfCopies(net.parameters(), torch.float16)
    copies.hook_state_dicts(net)
    twin = copy.deepcopy(net)  # StochasticWeightAveraging keeps such a copy
    copies.narrow_()
    assert twin.weight.dtype == torch.float32 and twin.state_dict()["weight"].data_ptr() == twin.weight.data_ptr()


def test_a_half_copies_dtype_must_be_a_half_type() -> None:
    with pytest.raises(ValueError, match=r"HalfCopies\(dtype=torch.float32\)` takes torch.float16 or torch.bfloat16"):
        HalfCopies([], torch.float32)


# --------------------------------------------------------------------------------------- numerics vs references
# Bit-for-bit agreement with Lightning's *-mixed runs (optimizers, accumulation, clipping, an overflow, a schedule):
# tests/test_matrix.py.


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fp32_gradient_accumulation_equals_lightnings_mixed_accumulation(precision: str) -> None:
    """Lightning accumulates the widened half gradients in FP32 parameter gradients: so does fp32_grad_accumulation."""
    torch.manual_seed(0)
    # SGD: Adam would turn the half sums' rounding of near-zero gradients into full-size steps of either sign.
    reference = TinyRegressor(optimizer="sgd")
    model, half_accumulating = copy.deepcopy(reference), copy.deepcopy(reference)
    fit(reference, lightning_plugin(precision), accumulate_grad_batches=4)
    fit(model, ours(precision, fp32_grad_accumulation=True), accumulate_grad_batches=4)
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=0, atol=0)
    # Summed in the half dtype instead, each partial sum is rounded to 11 (fp16) or 8 (bf16) bits, so the steps
    # differ by up to 2**-8 relative; 6 steps of lr 0.05 keep the weights within 1e-3 + 1%.
    fit(half_accumulating, ours(precision, fp32_grad_accumulation=False), accumulate_grad_batches=4)
    torch.testing.assert_close(parameters_of(half_accumulating), parameters_of(reference), rtol=0.01, atol=1e-3)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_tracks_an_fp32_run_and_converges_as_well(precision: str) -> None:
    torch.manual_seed(0)
    fp32 = TinyRegressor(lr=0.05)
    model = copy.deepcopy(fp32)
    fit(fp32, steps=200)
    fit(model, ours(precision), steps=200)
    x, y = loader(n=64, batch_size=64).dataset[:]
    with torch.no_grad():
        fp32_loss = F.mse_loss(fp32.net(x), y)
        ours_loss = F.mse_loss(model.net(x), y)  # the model holds its FP32 weights after fit
        start_loss = F.mse_loss(TinyRegressor().net(x), y)
    # Converges at least as well, up to the half dtype's rounding of the forward pass (2**-8 relative for bf16).
    assert ours_loss <= fp32_loss * 1.02 and ours_loss < start_loss
    # And the weights stay near the fp32 run's: every forward computes in the half dtype (relative error 2**-11 for
    # fp16, 2**-8 for bf16 per op), and 200 steps of SGD carry those differences along, hence the loose tolerance.
    tolerance = 0.02 if precision == "16-mixed" else 0.1
    torch.testing.assert_close(parameters_of(model), parameters_of(fp32), rtol=tolerance, atol=tolerance)


class Dtypes(pl.Callback):
    """The parameters' dtypes where users look: in training_step (via the module), after each batch, after fit."""

    def __init__(self) -> None:
        self.after_batch: list[set[torch.dtype]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.after_batch.append({p.dtype for p in module.parameters()})


@pytest.mark.parametrize("precision", PRECISIONS)
def test_forward_sees_half_copies_and_every_other_place_sees_fp32(precision: str) -> None:
    model = TinyRegressor()
    dtypes = Dtypes()
    fit(model, ours(precision), steps=4, callbacks=[dtypes])
    assert model.forward_dtypes == [HALF[precision]] * 4  # the first layer's output: half weights, no autocast copy
    assert dtypes.after_batch == [{torch.float32}] * 4
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_pure_fp16_model_trains_with_dynamic_loss_scaling_where_grad_scaler_refuses() -> None:
    torch.manual_seed(0)
    model = TinyRegressor(overflow_steps={3})
    model.net.append(nn.LayerNorm(1))
    plugin = MixedPrecisionPlugin("16-mixed", device="cpu", master_weights=True, half_modules=(nn.Module,))
    dtypes = DtypesInStep()
    fit(model, plugin, steps=40, callbacks=[dtypes])
    assert dtypes.seen == {torch.float16}  # the LayerNorm too: nothing kept FP32
    assert plugin.skipped_steps >= 1 and all(torch.isfinite(p).all() for p in model.parameters())
    # torch's GradScaler cannot unscale fp16 gradients at all.
    param = nn.Parameter(torch.ones(2, dtype=torch.float16))
    param.grad = torch.ones(2, dtype=torch.float16)
    grad_scaler = torch.amp.GradScaler("cpu")
    grad_scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="FP16 gradients"):
        grad_scaler.unscale_(torch.optim.SGD([param], lr=0.1))


class DtypesInStep(pl.Callback):
    """The parameters' dtypes during backward (``on_after_backward``)."""

    def __init__(self) -> None:
        self.seen: set[torch.dtype] = set()

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.seen |= {p.dtype for p in module.parameters()}


# -------------------------------------------------------------------------------------------- skipped steps
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_skipped_step_leaves_weights_and_optimizer_state_untouched(precision: str) -> None:
    model = TinyRegressor(overflow_steps={4}, optimizer="adam", scheduler="step")
    snapshots = StateAroundSteps()
    plugin = ours(precision)
    trainer = fit(model, plugin, steps=8, callbacks=[snapshots])
    assert plugin.skipped_steps == 1 and plugin.held_scheduler_steps == 1
    torch.testing.assert_close(snapshots.after[4], snapshots.before[4], rtol=0, atol=0)
    assert not torch.equal(snapshots.after[5][0], snapshots.before[5][0])  # the next step applies again
    # 7 applied steps of StepLR(gamma=0.5): the held step did not decay the LR.
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**7)


def test_overflow_diagnostics_name_the_model_parameters() -> None:
    class OneBadLayer(TinyRegressor):
        def on_after_backward(self) -> None:
            if self.trainer.global_step == 2:
                self.net[2].weight.grad[0, 0] = INF

    plugin = ours("16-mixed")
    fit(OneBadLayer(), plugin, steps=4)
    assert plugin.skipped_steps == 1 and plugin.last_overflow_params == ["net.2.weight"]


def test_bf16_with_nothing_checked_still_steps_fp32_weights() -> None:
    model = TinyRegressor()
    before = parameters_of(model)
    plugin = MixedPrecisionPlugin("bf16-mixed", device="cpu", master_weights=True, skip_nonfinite=False)
    dtypes = DtypesInStep()
    fit(model, plugin, steps=5, gradient_clip_val=0.5, callbacks=[dtypes])
    assert dtypes.seen == {torch.bfloat16} and model.net[0].weight.dtype == torch.float32
    assert not torch.equal(model.net[0].weight, before[0])


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


def test_manual_optimization_with_zero_grad_and_clipping_matches_lightnings_mixed() -> None:
    torch.manual_seed(0)
    reference = ManualTwoSteps()
    model = copy.deepcopy(reference)
    fit(reference, lightning_plugin("bf16-mixed"), steps=6)
    plugin = ours("bf16-mixed")
    fit(model, plugin, steps=6)
    assert model.stale_grads == [0] * len(model.stale_grads)
    assert plugin.last_grad_norm is not None and plugin.last_grad_norm > 0
    # Clipping by norm: ours reuses the norm of its check; torch sums the squares in another order (last-bit
    # differences in the coefficient, then carried through 6 SGD steps).
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("precision", PRECISIONS)
def test_checkpoint_resume_equals_the_uninterrupted_run(tmp_path: Path, precision: str) -> None:
    torch.manual_seed(0)
    straight = TinyRegressor(overflow_steps={3, 9}, optimizer="adam", scheduler="step", data_from_step=True)
    first, second = copy.deepcopy(straight), copy.deepcopy(straight)
    full = ours(precision)
    whole = fit(straight, full, steps=12)
    half_way = fit(first, ours(precision), steps=6)
    path = tmp_path / "six.ckpt"
    half_way.save_checkpoint(path)
    resumed = ours(precision)
    trainer = make_trainer(resumed, max_steps=12, max_epochs=-1)
    trainer.fit(second, loader(n=64, batch_size=8), ckpt_path=path)
    torch.testing.assert_close(parameters_of(second), parameters_of(straight), rtol=0, atol=0)
    assert resumed.skipped_steps == full.skipped_steps == 2
    saved, now = whole.optimizers[0].state_dict()["state"], trainer.optimizers[0].state_dict()["state"]
    torch.testing.assert_close(now, saved, rtol=0, atol=0)


def test_checkpoints_hold_fp32_weights_that_load_alone(tmp_path: Path) -> None:
    model = TinyRegressor()
    trainer = fit(model, ours("16-mixed"), steps=10)
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["MixedPrecisionPlugin"]["master_weights"] is True
    assert {value.dtype for value in checkpoint["state_dict"].values()} == {torch.float32}
    alone = TinyRegressor.load_from_checkpoint(path)  # the LightningModule by itself: an FP32 model, exact weights
    torch.testing.assert_close(parameters_of(alone), parameters_of(model), rtol=0, atol=0)


def test_a_second_fit_continues_from_the_fp32_weights_not_rounded_ones() -> None:
    model = OneWeight()
    plugin = ours("bf16-mixed")
    data = DataLoader(TensorDataset(torch.zeros(10, 1)), batch_size=1)
    trainer = make_trainer(plugin, max_epochs=1)
    trainer.fit(model, data)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, data)
    torch.testing.assert_close(model.w.detach(), torch.tensor([1.002]), rtol=0, atol=1e-6)  # bf16 alone: 1.0


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"keep_fp32": (nn.LayerNorm,)}, ValueError, r"keep_fp32=.*master weights only: add master_weights=True"),
        ({"fp32_grad_accumulation": False}, ValueError, r"fp32_grad_accumulation=False.*add master_weights=True"),
        ({"half_modules": (nn.Linear,)}, ValueError, r"half_modules=.*master weights only"),
        ({"master_weights": True, "half_modules": nn.Linear}, TypeError, r"half_modules=<class.*subclasses"),
        ({"master_weights": True, "keep_fp32": ("LayerNorm",)}, TypeError, r"keep_fp32=\('LayerNorm',\).*subclasses"),
        ({"master_weights": True, "keep_fp32": "LayerNorm"}, TypeError, r"keep_fp32='LayerNorm'.*subclasses"),
    ],
)
def test_bad_master_weight_options_raise_naming_the_argument(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        MixedPrecisionPlugin("bf16-mixed", **kwargs)


def test_lbfgs_is_refused_with_master_weights() -> None:
    with pytest.raises(TypeError, match=r"cannot drive torch.optim.LBFGS.*without master_weights"):
        fit(
            TinyRegressor(optimizer="lbfgs"),
            MixedPrecisionPlugin("bf16-mixed", master_weights=True, skip_nonfinite=False),
        )


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


def test_rnn_weights_are_reflattened_after_each_narrowing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[torch.dtype] = []
    flatten = nn.LSTM.flatten_parameters

    def recording(self: nn.LSTM) -> None:
        calls.append(self.weight_ih_l0.dtype)
        flatten(self)

    monkeypatch.setattr(nn.LSTM, "flatten_parameters", recording)
    model = TinyLSTM()
    fit(model, ours("bf16-mixed"), steps=3)
    # cuDNN wants an RNN's weights in one flat chunk: each step's half copies are flattened (a no-op off CUDA).
    assert calls.count(torch.bfloat16) == 3 and model.lstm.weight_ih_l0.dtype == torch.float32


# ------------------------------------------------------------------------------------- the last step's gradients
class GradsInForward(TinyRegressor):
    """Counts the gradients alive while ``training_step`` (the forward) runs."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.alive: list[int] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.alive.append(sum(p.grad is not None for p in self.parameters()))
        return super().training_step(batch, batch_idx)


class ZeroesInPlace(GradsInForward):
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)  # a common override: the gradients stay allocated


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_last_steps_gradients_are_freed_before_the_forward_unless_zero_grad_is_overridden(precision: str) -> None:
    # Lightning zeroes them after the forward (before backward): freeing them first saves 4 bytes per parameter there.
    stock = GradsInForward()
    fit(stock, ours(precision), steps=4)
    assert stock.alive == [0, 0, 0, 0]
    # An overridden optimizer_zero_grad decides itself: the gradients stay, and training equals Lightning's.
    torch.manual_seed(0)
    reference = ZeroesInPlace()
    model = copy.deepcopy(reference)
    fit(reference, lightning_plugin(precision), steps=4)
    fit(model, ours(precision), steps=4)
    assert model.alive == [0, 4, 4, 4]
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=0, atol=0)


class RaisesInStep(TinyRegressor):
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.trainer.global_step == 3:
            raise RuntimeError("user code failed")
        return super().training_step(batch, batch_idx)


def test_a_run_that_fails_during_a_step_leaves_the_model_in_fp32_and_unhooked() -> None:
    model = RaisesInStep()
    with pytest.raises(RuntimeError, match="user code failed"):
        fit(model, ours("bf16-mixed"), steps=6)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert sum(len(m._state_dict_hooks) for m in model.modules()) == 0
