"""FP32 master weights (``MixedPrecisionPlugin(master_weights=True)``, ``weights/master.py``) and ``keep_fp32``.

The masters are the model's own FP32 parameters at all times; autocast computes in half from them per use. So user code
during a step (a ``training_step`` writing a constraint, an EMA in a hook, a callback swapping weights) reads and writes
FP32 values, exactly as under Lightning's ``*-mixed``: every test here runs the same code under Lightning's built-in
``MixedPrecision`` as the reference and asks for the same numbers, bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
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
from lightning.pytorch import callbacks
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from versions import needs

from lightning_amp_plus import MixedPrecisionPlugin
from lightning_amp_plus.weights.fp32_modules import compute_in_fp32
from lightning_amp_plus.weights.master import half_copies, half_parameters, widen_model_, widen_to_fp32_

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


def same_run(
    precision: str, run: Callable[[Precision], Any], master_weights: bool = True, **options: Any
) -> tuple[Any, Any]:
    """``run`` under Lightning's plugin and under ours (each from the same seed): both results."""
    torch.manual_seed(0)
    expected = run(lightning_plugin(precision))
    torch.manual_seed(0)
    actual = run(our_plugin(precision, master_weights=master_weights, **options))
    return expected, actual


# ------------------------------------------------------------------------------------------------ lost updates
class OneWeight(pl.LightningModule):
    """A single weight w = 1.0 (a bias-free Linear(1, 1)) and the loss -w: SGD(lr=1e-4) adds 1e-4 to w at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.layer.weight.fill_(1.0)
        self.dtypes_seen: set[torch.dtype] = set()
        self.output_dtypes: set[torch.dtype] = set()

    @property
    def w(self) -> Tensor:
        return self.layer.weight.view(1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.dtypes_seen.add(self.w.dtype)
        out = self.layer(torch.ones(1, 1))
        self.output_dtypes.add(out.dtype)
        return -out.float().sum()

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
    # training_step saw the FP32 weight; autocast computed the layer in half; the optimizer stepped the FP32 weight.
    assert model.dtypes_seen == {torch.float32} and model.output_dtypes == {HALF[precision]}
    assert model.w.dtype == torch.float32
    # The gradient (-1, scaled by a power of two) is exact in every dtype, so the weight takes exactly the steps an
    # FP32 weight takes; those are 1.1 up to 1000 float32 roundings of half an ulp (6e-8) each: 6e-5.
    torch.testing.assert_close(model.w.detach(), fp32_reference_of_thousand_steps(), rtol=0, atol=0)
    torch.testing.assert_close(model.w.detach(), torch.tensor([1.1]), rtol=0, atol=6e-5)
    # Lightning's *-true modes update the half weight directly: 1e-4 is under half its spacing at 1.0, lost every time.
    assert thousand_steps(precision=precision.replace("mixed", "true")).w.item() == 1.0


# ------------------------------------------------------------------- 1. writes during a step: weight constraints
class Critic(pl.LightningModule):
    """A WGAN critic trained to separate two clouds, its weights clipped in ``training_step`` as the WGAN recipe does.

    Args:
        idiom: how the clip is written: ``"data"`` (``p.data.clamp_``, the reference recipe), ``"no_grad"``
            (``with torch.no_grad(): p.clamp_``), ``"utils"`` (``torch.nn.utils.vector_to_parameters``), or
            ``"none"`` (no clip: the control).
        clip: the clip value.
    """

    def __init__(self, idiom: str, clip: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        self.idiom, self.clip = idiom, clip

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        real, fake = batch
        loss = self.net(fake).float().mean() - self.net(real).float().mean()
        params = list(self.net.parameters())
        if self.idiom == "data":
            for p in params:
                p.data.clamp_(-self.clip, self.clip)
        elif self.idiom == "none":
            pass
        elif self.idiom == "no_grad":
            with torch.no_grad():
                for p in params:
                    p.clamp_(-self.clip, self.clip)
        else:
            vector = torch.nn.utils.parameters_to_vector(params).clamp(-self.clip, self.clip)
            torch.nn.utils.vector_to_parameters(vector, params)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(self.parameters(), lr=5e-3)


def clouds(n: int = 128) -> DataLoader[tuple[Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    real = torch.randn(n, 4, generator=generator) + 2.0
    fake = torch.randn(n, 4, generator=generator) - 1.0
    return DataLoader(TensorDataset(real, fake), batch_size=16)


def run_none(plugin: Precision) -> list[Tensor]:
    critic = Critic("none")
    make_trainer(plugin, max_epochs=2).fit(critic, clouds())
    return parameters_of(critic)


@pytest.mark.parametrize("idiom", ["data", "no_grad", "utils"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_weight_clip_written_in_training_step_lands_on_the_fp32_weights_whatever_the_idiom(
    precision: str, idiom: str
) -> None:
    def run(plugin: Precision) -> list[Tensor]:
        critic = Critic(idiom)
        make_trainer(plugin, max_epochs=2).fit(critic, clouds())
        return parameters_of(critic)

    expected, actual = same_run(precision, run)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    # Premise: the clip binds. Unclipped, the critic's weights grow far past it (as they did when the clip was lost);
    # clipped, they end within one RMSprop step (lr 5e-3, a few times that at most) of it.
    unclipped = max(p.abs().max().item() for p in same_run(precision, lambda plugin: run_none(plugin))[0])
    assert unclipped > 0.3 and max(p.abs().max().item() for p in actual) < 0.13


class ClampsInStep(OneWeight):
    """OneWeight with a no-op constraint (``clamp_(-10, 10)``) in ``training_step``."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        with torch.no_grad():
            self.layer.weight.clamp_(-10.0, 10.0)
        return loss


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_no_op_constraint_keeps_every_small_update(precision: str) -> None:
    """The issue's reproduction: 16 SGD steps of 1e-4 on a weight of 1.0 with a no-op clamp in training_step."""

    def run(plugin: Precision) -> float:
        model = ClampsInStep()
        data = DataLoader(TensorDataset(torch.zeros(16, 1)), batch_size=1)
        make_trainer(plugin, max_steps=16, barebones=True).fit(model, data)
        return model.w.item()

    expected, actual = same_run(precision, run)
    assert actual == expected == pytest.approx(1.0016, abs=1e-6)  # the old half-copy design ended at 1.0001


# ------------------------------------------------------------------------------- 2. EMAs read during a step
class DiffusersStyleEMA:
    """The update of diffusers' ``EMAModel.step(parameters)``: ``s -= (1 - decay) * (s - p)``, from ``parameters()``."""

    def __init__(self, parameters: list[Tensor], decay: float) -> None:
        self.shadow = [p.detach().clone() for p in parameters]
        self.decay = decay

    @torch.no_grad()
    def step(self, parameters: list[Tensor]) -> None:
        for s, p in zip(self.shadow, parameters, strict=True):
            s.sub_((1.0 - self.decay) * (s - p))


class WithEMA(TinyRegressor):
    """A regressor keeping an EMA of its weights, updated in ``hook`` (a LightningModule hook name)."""

    def __init__(self, hook: str) -> None:
        super().__init__(optimizer="adam", lr=0.02)
        self.hook = hook
        self.ema = DiffusersStyleEMA(list(self.parameters()), decay=0.9)

    def on_before_zero_grad(self, optimizer: Any) -> None:  # Lightning calls it inside the optimizer step
        if self.hook == "on_before_zero_grad":
            self.ema.step(list(self.parameters()))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:  # the latent-diffusion pattern
        if self.hook == "on_train_batch_end":
            self.ema.step(list(self.parameters()))


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("hook", ["on_before_zero_grad", "on_train_batch_end"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_an_ema_updated_in_a_hook_averages_the_fp32_weights(precision: str, hook: str, accumulate: int) -> None:
    def run(plugin: Precision) -> list[Tensor]:
        model = WithEMA(hook)
        fit(model, plugin, steps=4, accumulate_grad_batches=accumulate)
        return model.ema.shadow + parameters_of(model)

    expected, actual = same_run(precision, run)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


class Validated(TinyRegressor):
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self.net(batch[0]).float(), batch[1]))


@needs("lightning", "2.6", "EMAWeightAveraging")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_lightnings_ema_weight_averaging_with_a_validation_inside_an_accumulation_cycle(precision: str) -> None:
    """EMAWeightAveraging swaps its averages in for validation (through ``.data``) and back: a validation after
    batch 3 of cycles of 2 falls in the middle of a cycle."""

    def run(plugin: Precision) -> dict[str, Any]:
        model = Validated(optimizer="adam", lr=0.02)
        ema = callbacks.EMAWeightAveraging(decay=0.8)
        trainer = make_trainer(
            plugin, max_steps=6, max_epochs=-1, accumulate_grad_batches=2, val_check_interval=3, callbacks=[ema],
            limit_val_batches=2,
        )  # fmt: skip
        trainer.fit(model, loader(n=64, batch_size=8), loader(n=16, batch_size=8))
        return {"model": parameters_of(model), "average": parameters_of(ema._average_model.module)}

    expected, actual = same_run(precision, run)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# --------------------------------------------------------------------------------- 3. a model built in half
class RMSNorm(nn.Module):
    """A Llama-style RMSNorm: not one of the layers autocast runs in half, its weight used elementwise."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        wide = x.float()
        return self.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = RMSNorm(8)
        self.head = nn.Linear(8, 16)

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (tokens,) = batch
        logits = self.head(self.norm(self.embed(tokens[:, :-1])))
        return F.cross_entropy(logits.float().reshape(-1, 16), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def tokens() -> DataLoader[tuple[Tensor, ...]]:
    return DataLoader(TensorDataset(torch.randint(0, 16, (64, 6), generator=torch.Generator().manual_seed(0))), 8)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_model_built_in_half_trains_its_every_floating_parameter_as_an_fp32_master(precision: str) -> None:
    torch.manual_seed(0)
    built_in_half = TinyLM().to(HALF[precision])  # what from_pretrained(torch_dtype=...) hands a fine-tuner
    fp32_copy = copy.deepcopy(built_in_half).float()
    make_trainer(lightning_plugin(precision), max_epochs=1).fit(fp32_copy, tokens())
    start = built_in_half.norm.weight.detach().clone()
    make_trainer(ours(precision), max_epochs=1).fit(built_in_half, tokens())
    assert {p.dtype for p in built_in_half.parameters()} == {torch.float32}
    # Exactly the FP32 model under Lightning's *-mixed: the masters start from the half values, widened exactly.
    torch.testing.assert_close(parameters_of(built_in_half), parameters_of(fp32_copy), rtol=0, atol=0)
    # The RMSNorm weight moves (by ~1e-4 per step): in half it would not move at all (its spacing at 1.0 is 2**-7).
    assert not torch.equal(built_in_half.norm.weight.detach(), start.float())
    # The premise, under Lightning's *-true (what a model held in half trains with otherwise): the weight stays at 1.
    without = TinyLM().to(HALF[precision])
    make_trainer(precision=precision.replace("mixed", "true"), max_epochs=1).fit(without, tokens())
    assert torch.equal(without.norm.weight.detach(), torch.ones(8, dtype=HALF[precision]))


def test_half_parameters_are_found_and_widened_in_place() -> None:
    lm = TinyLM().to(torch.bfloat16)
    lm.extra = nn.Parameter(torch.ones(2, dtype=torch.float64))  # asked for on purpose: left alone
    objects = [id(p) for p in lm.parameters()]
    found = half_parameters(lm)
    assert len(found) == 4
    widen_to_fp32_(found)
    assert [id(p) for p in lm.parameters()] == objects  # the same Parameter objects (an optimizer keeps them)
    assert {p.dtype for p in lm.parameters()} == {torch.float32, torch.float64}


def test_widen_model_widens_floating_buffers_in_place_and_leaves_counts_masks_and_float64() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(torch.bfloat16)
    net.register_buffer("mask", torch.ones(3, dtype=torch.bool))
    net.register_buffer("scale", torch.full((3,), 0.1, dtype=torch.float64))
    net.register_buffer("positions", torch.arange(3, dtype=torch.bfloat16), persistent=False)  # data, held as floats
    objects = {name: id(t) for name, t in [*net.named_parameters(), *net.named_buffers()]}
    values = {name: t.clone() for name, t in net.named_buffers()}
    assert widen_model_(net) == [
        "0.weight", "0.bias", "1.weight", "1.bias", "positions", "1.running_mean", "1.running_var"
    ]  # fmt: skip
    assert {name: id(t) for name, t in [*net.named_parameters(), *net.named_buffers()]} == objects  # the same objects
    dtypes = {name: t.dtype for name, t in net.named_buffers()}
    assert dtypes["1.num_batches_tracked"] == torch.int64 and dtypes["mask"] == torch.bool
    assert dtypes["scale"] == torch.float64 and dtypes["positions"] == dtypes["1.running_var"] == torch.float32
    for name, before in values.items():  # every half value is an FP32 value: widening changes none
        assert torch.equal(net.get_buffer(name), before)


def test_half_copies_finds_copies_kept_in_attributes_and_containers_not_the_models_own_tensors() -> None:
    model = nn.Sequential(nn.Linear(2, 4), nn.LayerNorm(4)).to(torch.bfloat16)

    class Holder:
        def __init__(self) -> None:
            self.model = model  # the model itself: not a copy
            self.layers = [(model[0], "weight")]  # its own submodules: not copies
            self.weight = model[0].weight  # its own parameter: not a copy
            self.wide = copy.deepcopy(model).float()  # an FP32 copy: nothing half to round
            self.other = torch.zeros(7, dtype=torch.bfloat16)  # a half tensor of no parameter's shape
            self.records = {0: {"data": copy.deepcopy(model[1])}}  # a half copy, two containers deep
            self.snapshot = [model[0].weight.detach().clone()]  # a half tensor copy in a list

    assert half_copies(Holder(), model) == ["records[0]['data']", "snapshot[0]"]
    model.float()
    assert half_copies(Holder(), model) == []  # nothing of the model is half any more: nothing to round


# -------------------------------------------------- 4, 5. clipping by norm, GPT-2's Conv1D, a real transformer
class Conv1D(nn.Module):
    """The shape of transformers' ``pytorch_utils.Conv1D`` (GPT-2's attention and MLP): ``addmm`` with a (in, out)
    weight. Not an ``nn.Linear``: a design that names layer classes would miss it."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight = nn.Parameter(torch.randn(in_features, out_features) * 0.2)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: Tensor) -> Tensor:
        shape = (*x.shape[:-1], self.out_features)
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(shape)


class GPT2Block(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.c_attn, self.c_proj = Conv1D(24, 8), Conv1D(8, 8)
        self.mlp = nn.Sequential(Conv1D(32, 8), nn.GELU(), Conv1D(8, 32))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        h = self.ln(x.repeat(1, 1))
        q, k, v = self.c_attn(h).split(8, dim=-1)
        h = h + self.c_proj(torch.softmax(q @ k.T / 8**0.5, dim=-1) @ v)
        return F.mse_loss(self.mlp(h).float().sum(-1, keepdim=True), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("master_weights", [True, False])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpt2_shaped_conv1d_layers_train_as_under_lightnings_plugin_with_clipping_by_norm(
    precision: str, master_weights: bool
) -> None:
    def run(plugin: Precision) -> list[Tensor]:
        model = GPT2Block()
        fit(model, plugin, steps=8, gradient_clip_val=0.05)
        return parameters_of(model)

    expected, actual = same_run(precision, run, master_weights=master_weights)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


class HFGPT2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64)
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss.float()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("master_weights", [True, False])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_transformers_gpt2_with_clipping_by_norm_ends_bit_identical_to_lightnings_plugin(
    precision: str, master_weights: bool
) -> None:
    """The issue's GPT-2 case: the clipping norm differed from clip_grad_norm_'s in its last bit on 4 of 20 steps, which
    AdamW magnified on near-zero gradients (3.8e-3 on a c_attn bias after 8 steps)."""

    def run(plugin: Precision) -> list[Tensor]:
        model = HFGPT2()
        data = DataLoader(TensorDataset(torch.randint(0, 64, (64, 12), generator=torch.Generator().manual_seed(1))), 8)
        make_trainer(plugin, max_steps=8, max_epochs=-1, gradient_clip_val=1.0).fit(model, data)
        return parameters_of(model)

    expected, actual = same_run(precision, run, master_weights=master_weights)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------- keep_fp32
class Blocks(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        self.second_dtypes: list[torch.dtype] = []

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        out = self.second(h)
        self.second_dtypes.append(out.dtype)
        return out

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return F.mse_loss(self(batch[0][:, :4]).float(), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class ReferenceBlocks(Blocks):
    """The same model with ``second`` run in FP32 by hand: what ``keep_fp32=(nn.Sequential,)`` must give."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        with torch.autocast("cpu", enabled=False):
            return self.second(h.float())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_keep_fp32_runs_those_modules_in_fp32_as_a_hand_written_autocast_exit_does(precision: str) -> None:
    torch.manual_seed(0)
    model = Blocks()
    reference = ReferenceBlocks()
    reference.load_state_dict(model.state_dict())
    fit(reference, lightning_plugin(precision), steps=6)
    fit(model, our_plugin(precision, keep_fp32=(nn.Sequential,)), steps=6)
    assert set(model.second_dtypes) == {torch.float32}
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=0, atol=0)


def test_compute_in_fp32_excludes_the_root_and_undoes_itself_even_when_forward_raises() -> None:
    class Fails(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(2, 2), Fails())
    handles = compute_in_fp32(model, (nn.Sequential, Fails), "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(1, 2))
        assert torch.is_autocast_enabled("cpu")  # the region closed though the forward raised
    for handle in handles:
        handle.remove()


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


# -------------------------------------------------------------------------------------------- skipped steps
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_skipped_step_leaves_weights_and_optimizer_state_untouched(precision: str) -> None:
    model = TinyRegressor(overflow_steps={4}, optimizer="adam", scheduler="step")
    snapshots = StateAroundSteps()
    plugin = ours(precision)
    trainer = fit(model, plugin, steps=8, callbacks=[snapshots])
    assert plugin.skipped_steps == 1 and plugin.engine.log.held_schedulers.held_steps == 1
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
    skipped = [result for result in plugin.recent_steps if result.skipped]
    assert plugin.skipped_steps == 1 and [result.overflow_params for result in skipped] == [["net.2.weight"]]


def test_bf16_with_nothing_checked_still_steps_fp32_weights() -> None:
    model = TinyRegressor()
    before = parameters_of(model)
    plugin = MixedPrecisionPlugin("bf16-mixed", device="cpu", master_weights=True, skip_nonfinite=False)
    fit(model, plugin, steps=5, gradient_clip_val=0.5)
    assert model.net[0].weight.dtype == torch.float32 and model.forward_dtypes[-1] == torch.bfloat16
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
    assert (plugin.recent_steps[-1].grad_norm or 0) > 0
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=0, atol=0)


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
        ({"keep_fp32": nn.Linear}, TypeError, r"keep_fp32=<class.*subclasses"),
        ({"keep_fp32": ("LayerNorm",)}, TypeError, r"keep_fp32=\('LayerNorm',\).*subclasses"),
        ({"keep_fp32": "LayerNorm"}, TypeError, r"keep_fp32='LayerNorm'.*subclasses"),
        ({"master_weights": "yes"}, TypeError, r"master_weights='yes'\)` must be True or False"),
    ],
)
def test_bad_options_raise_naming_the_argument(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        MixedPrecisionPlugin("bf16-mixed", **kwargs)


def test_lbfgs_is_refused_where_the_step_is_checked_and_trains_where_it_is_not() -> None:
    with pytest.raises(TypeError, match=r"cannot drive torch.optim.LBFGS"):
        fit(TinyRegressor(optimizer="lbfgs"), MixedPrecisionPlugin("bf16-mixed", master_weights=True), steps=2)
    model = TinyRegressor(optimizer="lbfgs")
    before = parameters_of(model)
    fit(model, MixedPrecisionPlugin("bf16-mixed", master_weights=True, skip_nonfinite=False), steps=2)
    assert not torch.equal(parameters_of(model)[0], before[0])
