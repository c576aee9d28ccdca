"""Conformance: ``MixedPrecisionPlugin`` inside the Lightning features users combine with a precision plugin.

Every scenario runs under our plugin in every mode (fp16 and bf16, with and without master weights) and under
Lightning's built-in ``MixedPrecision`` at the same precision, which is the reference: the runs must agree bit for bit
wherever the arithmetic is the same, and within a stated tolerance (with its reason) where it is not. The cases are
declared once (:data:`MODES`, the models below) and compared by one runner (:func:`check_against_lightning`).

The models have the shapes users bring, tiny enough for CI: a small ResNet-style CNN (BatchNorm, a residual block,
``channels_last``), a transformer encoder with embeddings and LayerNorm, a GAN trained with ``toggle_optimizer``, and an
LSTM language model whose decoder is tied to its embedding.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    FP16_ON_CPU_WARNING,
    START_SCALE,
    TinyRegressor,
    lightning_plugin,
    loader,
    make_trainer,
    our_plugin,
    parameters_of,
)
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.utilities import grad_norm
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from versions import at_least

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionMonitor, MixedPrecisionPlugin

pytestmark = [
    pytest.mark.filterwarnings(FP16_ON_CPU_WARNING),
    pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable.*"),
    pytest.mark.filterwarnings("ignore:.*Swapping scheduler.*"),
    pytest.mark.filterwarnings("ignore:.*has `shuffle=True`.*"),
    pytest.mark.filterwarnings("ignore:.*`training_step` returned `None`.*"),
    pytest.mark.filterwarnings("ignore:.*The number of training batches.*"),
]


@dataclass(frozen=True)
class Mode:
    precision: str
    master_weights: bool

    def __str__(self) -> str:
        return f"{self.precision}{'-master' if self.master_weights else ''}"


MODES = [Mode(p, m) for p in ("16-mixed", "bf16-mixed") for m in (False, True)]


def ours(mode: Mode, growth_interval: int = 10_000, **kwargs: Any) -> MixedPrecisionPlugin:
    # Lightning's plugin steps schedulers on skipped steps too; no scenario here skips, but keep the two alike.
    return our_plugin(
        mode.precision, growth_interval, master_weights=mode.master_weights, hold_schedulers_on_skip=False, **kwargs
    )


def lightnings(mode: Mode, growth_interval: int = 10_000) -> MixedPrecision:
    return lightning_plugin(mode.precision, growth_interval)


Run = Callable[[Precision], dict[str, Any]]


def check_against_lightning(mode: Mode, run: Run, plugin: Precision | None = None, **tolerance: float) -> None:
    """Run ``run`` under our plugin in ``mode`` and under Lightning's at the same precision; compare what it returns.

    Bit for bit by default; ``rtol``/``atol`` where the caller states why the arithmetic differs.
    """
    torch.manual_seed(0)
    expected = run(lightnings(mode))
    torch.manual_seed(0)
    actual = run(ours(mode) if plugin is None else plugin)
    torch.testing.assert_close(actual, expected, rtol=tolerance.get("rtol", 0.0), atol=tolerance.get("atol", 0.0))


def trainer_for(plugin: Precision, **kwargs: Any) -> pl.Trainer:
    return make_trainer(plugin, **kwargs)


def state_of(module: nn.Module) -> dict[str, Tensor]:
    """A copy of ``module.state_dict()`` (its values are the live tensors otherwise)."""
    return {key: value.detach().clone() for key, value in module.state_dict().items()}


def hooks_left(model: nn.Module) -> int:
    """State-dict hooks attached to the model (a plugin must leave none behind after fit)."""
    return sum(len(m._state_dict_hooks) + len(m._load_state_dict_pre_hooks) for m in model.modules())


# ---------------------------------------------------------------------------------------------------- models
class ResNetish(pl.LightningModule):
    """Conv-BN-ReLU stem, one residual block, global pooling, a linear head; SGD with momentum."""

    def __init__(self, channels_last: bool = False, compiled: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)
        )
        self.head = nn.Linear(8, 4)
        self.channels_last = channels_last
        if channels_last:
            self.to(memory_format=torch.channels_last)
        self.body: Callable[[Tensor], Tensor] = (
            torch.compile(self.features, backend="eager") if compiled else self.features
        )

    def features(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        return F.relu(h + self.block(h)).mean(dim=(2, 3))

    def forward(self, x: Tensor) -> Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.head(self.body(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).float(), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).float(), y))

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def images(n: int = 32, batch_size: int = 8) -> DataLoader[tuple[Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 3, 8, 8, generator=generator), torch.randint(0, 4, (n,), generator=generator))
    return DataLoader(data, batch_size=batch_size)


class Encoder(pl.LightningModule):
    """Token embedding + learned positions, one TransformerEncoderLayer, LayerNorm, a classifier; AdamW."""

    def __init__(self, vocab: int = 50, dim: int = 16, length: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.randn(length, dim) * 0.02)
        self.layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 2)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, labels = batch
        h = self.layer(self.embed(tokens) + self.positions)
        return F.cross_entropy(self.head(self.norm(h).mean(dim=1)).float(), labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def sentences(n: int = 32, vocab: int = 50, length: int = 6) -> DataLoader[tuple[Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, length), generator=generator)
    return DataLoader(TensorDataset(tokens, (tokens[:, 0] % 2).long()), batch_size=8)


class Generator(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))


class Discriminator(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


class GAN(pl.LightningModule):
    """A generator and a discriminator, manual optimization with ``toggle_optimizer``, as Lightning documents it.

    The discriminator's step applies it twice (to real and to generated samples), as most GAN code does.
    """

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = Generator()
        self.discriminator = Discriminator()
        self.optimizer_grads: list[tuple[int, float]] = []

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        noise = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx))
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)

        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(noise)).float(), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        fake = self.generator(noise).detach()
        d_loss = (
            F.binary_cross_entropy_with_logits(self.discriminator(real).float(), ones)
            + F.binary_cross_entropy_with_logits(self.discriminator(fake).float(), zeros)
        ) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
        )


def real_samples(n: int = 48) -> DataLoader[tuple[Tensor, ...]]:
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=torch.Generator().manual_seed(0)) + 2.0), batch_size=8)


class TiedLM(pl.LightningModule):
    """Embedding -> LSTM -> decoder whose weight IS the embedding's (GPT-2, nanoGPT, PyTorch's word LM do this).

    On CPU, torch 2.14's oneDNN LSTM fails under fp16 autocast, so the LSTM runs outside autocast in FP32 (as the
    shipped ImdbLSTM does on CPU); the plugins below keep it FP32 with master weights too, so both sides run the same
    LSTM and the comparison isolates what this model is about: the tied weight.
    """

    def __init__(self, vocab: int = 40, dim: int = 16, data_from_step: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, batch_first=True)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.embed.weight
        self.data_from_step = data_from_step

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        (tokens,) = batch
        if self.data_from_step:  # a resumed run sees the batches an uninterrupted one sees, wherever the loader is
            tokens = torch.randint(
                0, 8, tokens.shape, generator=torch.Generator().manual_seed(self.trainer.global_step)
            )
        with torch.autocast("cpu", enabled=False):
            hidden, _ = self.lstm(self.embed(tokens[:, :-1]).float())
        logits = self.decoder(hidden)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def token_streams(n: int = 48, vocab: int = 40, length: int = 9) -> DataLoader[tuple[Tensor, ...]]:
    # Frequent tokens repeat within a batch: the embedding's gradient sums rows, the decoder adds its own part.
    tokens = torch.randint(0, 8, (n, length), generator=torch.Generator().manual_seed(0)) % vocab
    return DataLoader(TensorDataset(tokens), batch_size=8)


def lm_plugin(mode: Mode) -> MixedPrecisionPlugin:
    return ours(mode)


# ------------------------------------------------------------------------------- 1. training_step returns None
class SkipsABatch(TinyRegressor):
    """Returns None (Lightning's documented way to skip a batch) for batch 2; an inf loss at ``overflow_batches``."""

    def __init__(self, overflow_batches: tuple[int, ...] = ()) -> None:
        super().__init__(optimizer="recording_sgd")
        self.overflow_batches = overflow_batches

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 2:
            return None
        return loss * float("inf") if batch_idx in self.overflow_batches else loss


def without_batch_two(n: int = 64) -> DataLoader[tuple[Tensor, ...]]:
    data = loader(n=n).dataset
    indices = [i for i in range(n) if i // 8 != 2]
    return DataLoader(torch.utils.data.Subset(data, indices), batch_size=8)


# Clipping (by value, at a limit no gradient reaches) makes the plugin unscale in the skipped batch's clipping call.
CLIPPING = {"gradient_clip_val": 1e6, "gradient_clip_algorithm": "value"}


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_a_training_step_returning_none_leaves_the_next_step_unscaled_and_checked_once(mode: Mode) -> None:
    # The reference: Lightning's plugin on the same batches without batch 2 (its value clipping itself fails on a
    # batch without gradients: torch's clip_grad_value_ of an empty gradient list raises).
    torch.manual_seed(0)
    reference = TinyRegressor(optimizer="recording_sgd")
    make_trainer(lightnings(mode), max_steps=5, max_epochs=-1, **CLIPPING).fit(reference, without_batch_two())
    torch.manual_seed(0)
    model = SkipsABatch()
    make_trainer(ours(mode), max_steps=6, max_epochs=-1, **CLIPPING).fit(model, loader())
    # Every step after the skipped batch made the update Lightning's made...
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=0, atol=0)
    if mode.precision == "16-mixed":
        # ...from the unscaled gradients it saw. (Lightning's bf16 plugin hands the closure to `optimizer.step`, so
        # its recording optimizer notes the gradients before the closure computed them: compared in fp16 only.)
        seen, expected = model.trainer.optimizers[0].seen, reference.trainer.optimizers[0].seen  # type: ignore[attr-defined]
        torch.testing.assert_close(seen, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_an_overflow_right_after_a_batch_without_backward_is_caught_and_skipped(mode: Mode) -> None:
    model = SkipsABatch(overflow_batches=(3,))
    plugin = ours(mode)
    make_trainer(plugin, max_steps=6, max_epochs=-1, **CLIPPING).fit(model, loader())
    assert plugin.skipped_steps == 1 and all(torch.isfinite(p).all() for p in model.parameters())


# ------------------------------------------------------------------------------------ 2. assigning a scaler
@pytest.mark.parametrize("mode", [m for m in MODES if m.precision == "16-mixed"], ids=str)
def test_a_scaler_assigned_after_construction_scales_unscales_checks_and_updates(mode: Mode) -> None:
    def run(plugin: Precision) -> dict[str, Any]:
        model = TinyRegressor(overflow_steps={4}, optimizer="adam")
        scales: list[float] = []
        probe = pl.Callback()
        probe.on_train_batch_end = lambda trainer, *_: scales.append(trainer.scaler.get_scale())  # type: ignore[method-assign]
        make_trainer(plugin, max_steps=10, max_epochs=-1, callbacks=[probe]).fit(model, loader(n=80))
        return {"params": parameters_of(model), "scales": scales}

    plugin = MixedPrecisionPlugin("16-mixed", device="cpu", master_weights=mode.master_weights)
    plugin.scaler = DynamicLossScaler(init_scale=START_SCALE, growth_interval=3)  # as users do with Lightning's plugin
    torch.manual_seed(0)
    expected = run(lightnings(mode, growth_interval=3))
    torch.manual_seed(0)
    actual = run(plugin)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert plugin.scaler is not None and plugin.scaler.skipped_steps == 1
    assert max(actual["scales"]) == START_SCALE * 2  # grew every 3 clean steps: the assigned scaler's policy


def test_assigning_a_scaler_to_a_bf16_plugin_or_a_non_scaler_is_refused_with_the_way_out() -> None:
    with pytest.raises(ValueError, match=r"bf16 has fp32's range.*Drop `scaler`"):
        MixedPrecisionPlugin("bf16-mixed").scaler = DynamicLossScaler()
    with pytest.raises(TypeError, match=r"\.scaler = <torch\.amp\.grad_scaler\.GradScaler.*load its state"):
        MixedPrecisionPlugin("16-mixed").scaler = torch.amp.GradScaler("cpu")  # type: ignore[assignment]


# ------------------------------------------------------------------------------ 3. the monitor, two optimizers
class NormProbe(pl.Callback):
    """Each optimizer step's gradient norm as the optimizer sees it (float64, an independent reference)."""

    def __init__(self) -> None:
        self.norms: list[tuple[int, float]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad.double().reshape(-1) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        index = [id(o) for o in trainer.optimizers].index(id(optimizer))
        self.norms.append((index, float(torch.linalg.vector_norm(torch.cat(grads)))))


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_the_monitor_counts_every_optimizer_step_and_reports_each_optimizers_norm(mode: Mode, tmp_path: Path) -> None:
    monitor, probe = MixedPrecisionMonitor(log_memory=False), NormProbe()
    trainer = make_trainer(
        ours(mode), max_epochs=1, callbacks=[monitor, probe], logger=CSVLogger(tmp_path), log_every_n_steps=1
    )
    trainer.fit(GAN(), real_samples())
    assert len(monitor.history.steps) == 2 * 6 == trainer.global_step  # six batches, two optimizer steps each
    assert [record.step for record in monitor.history.steps] == list(range(12))
    # Each step's norm is the one the optimizer saw (float64 reference: the scaler sums float32 squares, hence 1e-6).
    measured = [record.grad_norm for record in monitor.history.steps]
    torch.testing.assert_close(measured, [norm for _, norm in probe.norms], rtol=1e-6, atol=0)
    rows = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert {"amp/grad_norm", "amp/grad_norm_opt0", "amp/grad_norm_opt1"} <= set(header)
    last = rows[-1].split(",")
    per_optimizer = [float(last[header.index(f"amp/grad_norm_opt{i}")]) for i in (0, 1)]
    torch.testing.assert_close(per_optimizer, [norm for _, norm in probe.norms[-2:]], rtol=1e-6, atol=0)
    total = float(last[header.index("amp/grad_norm")])
    assert total == pytest.approx(sum(n * n for n in per_optimizer) ** 0.5, rel=1e-6)


# -------------------------------------------------------------------------------- 4. validate/test/predict
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_validate_test_and_predict_before_and_after_fit_keep_the_full_precision_weights(
    mode: Mode, tmp_path: Path
) -> None:
    def run(plugin: Precision) -> dict[str, Any]:
        model = ResNetish()
        trainer = trainer_for(plugin, max_epochs=2, limit_val_batches=2)
        trainer.validate(model, images())  # before fit: the fit must still start from the exact initial weights
        trainer.fit(model, images(), images())
        after_fit = {k: v.clone() for k, v in model.state_dict().items()}
        trainer.test(model, images())
        predictions = trainer.predict(model, images())
        trainer.validate(model, images())
        trainer.save_checkpoint(tmp_path / f"{type(plugin).__name__}.ckpt")
        saved = torch.load(tmp_path / f"{type(plugin).__name__}.ckpt", weights_only=True)["state_dict"]
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        torch.testing.assert_close(model.state_dict(), after_fit, rtol=0, atol=0)  # evaluation changed nothing
        torch.testing.assert_close(saved, after_fit, rtol=0, atol=0)
        return {"state": after_fit, "predictions": predictions}

    check_against_lightning(mode, run)


# ------------------------------------------------------------------------------------------------ 5. lr_find
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_fit_after_lr_find_starts_from_the_restored_weights(mode: Mode) -> None:
    def run(plugin: Precision) -> dict[str, Any]:
        model = TinyRegressor(optimizer="adam")
        trainer = trainer_for(plugin, max_steps=8, max_epochs=-1)
        Tuner(trainer).lr_find(model, loader(n=160), num_training=10, update_attr=False, early_stop_threshold=None)
        restored = parameters_of(model)
        trainer.fit(model, loader())
        return {"restored": restored, "params": parameters_of(model)}

    torch.manual_seed(0)
    untouched = parameters_of(TinyRegressor(optimizer="adam"))
    check_against_lightning(mode, run)
    torch.manual_seed(0)
    result = run(ours(mode))
    torch.testing.assert_close(result["restored"], untouched, rtol=0, atol=0)


class BatchSized(TinyRegressor):
    """Its training data in batches of ``self.batch_size``, the attribute Lightning's batch-size finder scales."""

    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.batch_size = 4

    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return loader(n=256, batch_size=self.batch_size)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_fit_after_scale_batch_size_starts_from_the_restored_weights_at_the_size_found(mode: Mode) -> None:
    def run(plugin: Precision) -> dict[str, Any]:
        model = BatchSized()
        trainer = trainer_for(plugin, max_steps=6, max_epochs=-1)
        # Trials of 2 steps, the batch doubled after each, each from the checkpoint the finder took before the first.
        found = Tuner(trainer).scale_batch_size(model, mode="power", max_trials=4, steps_per_trial=2)
        restored = parameters_of(model)
        trainer.fit(model)
        return {"found": found, "restored": restored, "params": parameters_of(model)}

    torch.manual_seed(0)
    untouched = parameters_of(BatchSized())
    check_against_lightning(mode, run)
    torch.manual_seed(0)
    result = run(ours(mode))
    assert result["found"] > 4  # premise: it scaled (the size found is Lightning's, compared above)
    torch.testing.assert_close(result["restored"], untouched, rtol=0, atol=0)


# ------------------------------------------------------------------------------------- 6. a second Trainer
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_a_second_trainer_on_the_same_model_continues_from_the_first_ones_weights(mode: Mode) -> None:
    def run(plugin_factory: Callable[[], Precision]) -> dict[str, Any]:
        model = Encoder()
        trainer_for(plugin_factory(), max_epochs=1).fit(model, sentences())
        stage_one = state_of(model)
        assert {p.dtype for p in model.parameters()} == {torch.float32} and hooks_left(model) == 0
        trainer_for(plugin_factory(), max_epochs=1).fit(model, sentences())  # fine-tuning, stage two
        return {"stage_one": stage_one, "final": state_of(model)}

    torch.manual_seed(0)
    expected = run(lambda: lightnings(mode))
    torch.manual_seed(0)
    actual = run(lambda: ours(mode))
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------------------- 7. toggle_optimizer GAN
def gan_run(plugin: Precision) -> dict[str, Any]:
    model = GAN()
    trainer_for(plugin, max_epochs=2).fit(model, real_samples())
    return {"generator": parameters_of(model.generator), "discriminator": parameters_of(model.discriminator)}


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_a_gan_with_toggle_optimizer_trains_as_under_lightnings_plugin(mode: Mode) -> None:
    """Its discriminator is applied twice per D loss (real and fake samples): each use is cast by autocast, and the
    two gradients are summed in FP32, as under Lightning's plugin, with master weights too (bit for bit)."""
    check_against_lightning(mode, gan_run)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_lightnings_plugin_before_2_5_5_sums_the_discriminators_two_gradients_in_half_precision(precision: str) -> None:
    """Why the reference is Lightning's plugin with 2.5.5's autocast on older releases (``helpers.lightning_plugin``).

    With torch's cast cache on, autocast casts each FP32 weight to half once per training step, and both uses of the
    discriminator (real and fake samples) take that one half copy: their weight gradients meet at the copy and are
    summed in half precision before the cast back to FP32. Without the cache each use has its own cast and the two
    gradients are summed in FP32. Lightning's built-in plugin is the first before 2.5.5 (on 2.4.0 it ends up to 1.4e-6
    from the second in fp16, 2.5e-5 in bf16) and the second from 2.5.5 on; this package's plugin is the second.
    """
    torch.manual_seed(0)
    cached = gan_run(lightning_plugin(precision, cast_cache=True))
    torch.manual_seed(0)
    uncached = gan_run(lightning_plugin(precision, cast_cache=False))
    builtin = MixedPrecision(precision, device="cpu")  # type: ignore[arg-type]
    if builtin.scaler is not None:
        builtin.scaler = torch.amp.GradScaler("cpu", init_scale=START_SCALE, growth_interval=10_000)
    torch.manual_seed(0)
    released = gan_run(builtin)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(cached, uncached, rtol=0, atol=0)  # the cache alone changes the training
    torch.testing.assert_close(released, uncached if at_least("lightning", "2.5.5") else cached, rtol=0, atol=0)


# ------------------------------------------------------------------------ 8. SWA, load_state_dict between fits
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_stochastic_weight_averaging_saves_and_leaves_the_averaged_weights(mode: Mode, tmp_path: Path) -> None:
    def run(plugin: Precision) -> dict[str, Any]:
        model = ResNetish()
        swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1, annealing_epochs=1)
        trainer = trainer_for(plugin, max_epochs=3, callbacks=[swa])
        trainer.fit(model, images())
        path = tmp_path / f"swa-{type(plugin).__name__}.ckpt"
        trainer.save_checkpoint(path)
        # Before torch 2.10 SWALR's state_dict holds its annealing function (a bound method), which Lightning saves in
        # the checkpoint and weights_only=True refuses (`builtins.getattr`), under either plugin.
        saved = torch.load(path, weights_only=at_least("torch", "2.10"))
        return {"model": state_of(model), "saved": saved["state_dict"]}

    check_against_lightning(mode, run)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_weights_loaded_between_fits_are_the_ones_the_next_fit_starts_from(mode: Mode) -> None:
    def run(plugin_factory: Callable[[], Precision]) -> dict[str, Any]:
        model = TinyRegressor(optimizer="adam")
        trainer_for(plugin_factory(), max_steps=5, max_epochs=-1).fit(model, loader())
        other = TinyRegressor()  # e.g. the best checkpoint's weights
        model.load_state_dict(other.state_dict())
        loaded = state_of(model)
        trainer_for(plugin_factory(), max_steps=5, max_epochs=-1).fit(model, loader())
        return {"loaded": loaded, "other": state_of(other), "final": state_of(model)}

    torch.manual_seed(0)
    expected = run(lambda: lightnings(mode))
    torch.manual_seed(0)
    actual = run(lambda: ours(mode))
    torch.testing.assert_close(actual["loaded"], actual["other"], rtol=0, atol=0)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- 9. tied weights
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_a_tied_lm_trains_as_under_lightnings_plugin(mode: Mode) -> None:
    def run(plugin: Precision) -> dict[str, Any]:
        model = TiedLM()
        trainer_for(plugin, max_epochs=2).fit(model, token_streams())
        assert model.decoder.weight is model.embed.weight
        return state_of(model)

    check_against_lightning(mode, run, plugin=lm_plugin(mode))


class Killed(Exception):
    """The run dies (Lightning tears the strategy and the plugin down, then re-raises)."""


class StopAt(pl.Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            raise Killed


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_a_tied_lm_resumes_exactly_and_loads_alone_in_full_precision(mode: Mode, tmp_path: Path) -> None:
    torch.manual_seed(0)
    whole = TiedLM(data_from_step=True)
    killed, resumed = copy.deepcopy(whole), copy.deepcopy(whole)
    trainer_for(lm_plugin(mode), max_steps=10, max_epochs=-1).fit(whole, token_streams(n=80))
    path = tmp_path / "at5.ckpt"
    with pytest.raises(Killed):
        trainer_for(lm_plugin(mode), max_steps=10, max_epochs=-1, callbacks=[StopAt(5, path)]).fit(
            killed, token_streams(n=80)
        )
    trainer_for(lm_plugin(mode), max_steps=10, max_epochs=-1).fit(resumed, token_streams(n=80), ckpt_path=path)
    torch.testing.assert_close(resumed.state_dict(), whole.state_dict(), rtol=0, atol=0)
    alone = TiedLM.load_from_checkpoint(path)
    assert {p.dtype for p in alone.parameters()} == {torch.float32}
    assert alone.decoder.weight is alone.embed.weight
    saved = torch.load(path, weights_only=True)["state_dict"]
    torch.testing.assert_close(saved["decoder.weight"], saved["embed.weight"], rtol=0, atol=0)


# --------------------------------------------------------------------------- 10. BackboneFinetuning, add_param_group
class WithBackbone(pl.LightningModule):
    """Lightning's fine-tuning recipe: a frozen `backbone`, unfrozen (and added to the optimizer) at epoch 1."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)
        self.step_dtypes: set[tuple[str, str]] = set()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.backbone(x)).float(), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.step_dtypes.add((str(p.dtype), str(p.grad.dtype)))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_backbone_finetuning_unfreezes_into_full_precision_training(mode: Mode) -> None:
    def run(plugin: Precision) -> dict[str, Any]:
        model = WithBackbone()
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=1e-3)
        trainer_for(plugin, max_epochs=3, callbacks=[finetuning]).fit(model, loader())
        assert model.step_dtypes == {("torch.float32", "torch.float32")}  # the added group steps FP32 too
        return state_of(model)

    check_against_lightning(mode, run)


# ------------------------------------------------------------------------- 11. channels_last, torch.compile
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_channels_last_weights_keep_their_memory_format_and_a_compiled_model_compiles_once(mode: Mode) -> None:
    compiles: list[int] = []

    def run(plugin: Precision) -> dict[str, Any]:
        torch._dynamo.reset()
        model = ResNetish(channels_last=True, compiled=True)
        counter = torch._dynamo.utils.counters
        counter.clear()
        formats = FormatProbe()
        trainer_for(plugin, max_epochs=3, callbacks=[formats]).fit(model, images())
        compiles.append(int(counter["stats"]["unique_graphs"]))
        assert formats.channels_last == [True] * 12
        return state_of(model)

    check_against_lightning(mode, run)
    # Lightning's plugin compiles the training graph once; ours too: neither dtype nor strides change between steps.
    assert compiles[1] == compiles[0], compiles


class FormatProbe(pl.Callback):
    def __init__(self) -> None:
        self.channels_last: list[bool] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        convs = [m.weight for m in pl_module.modules() if isinstance(m, nn.Conv2d)]
        self.channels_last.append(all(w.is_contiguous(memory_format=torch.channels_last) for w in convs))


# ------------------------------------------------------------------------------------- 12. grad_norm(self)
class LogsGradNorms(TinyRegressor):
    def __init__(self) -> None:
        super().__init__(optimizer="adam")
        self.norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.norms.append({k: float(v) for k, v in grad_norm(self, norm_type=2).items()})  # Lightning's idiom


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_lightnings_grad_norm_in_on_before_optimizer_step_sees_the_unscaled_gradients(mode: Mode) -> None:
    def run(plugin: Precision) -> dict[str, Any]:
        model = LogsGradNorms()
        trainer_for(plugin, max_steps=5, max_epochs=-1).fit(model, loader())
        assert all(len(norms) == 5 for norms in model.norms)  # four parameters and the total
        return {"norms": model.norms, "params": parameters_of(model)}

    check_against_lightning(mode, run)


# -------------------------------------------------------------- 13. gradients summed inside one tensor's backward
class SharedLayer(pl.LightningModule):
    """One Linear applied twice (not tied by name: one module used twice, as weight-shared networks do)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.head(torch.tanh(self.shared(torch.tanh(self.shared(x))))).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


@pytest.mark.parametrize("mode", [m for m in MODES if m.master_weights], ids=str)
def test_a_layer_used_twice_sums_its_two_gradients_in_the_half_dtype_within_its_rounding(mode: Mode) -> None:
    """Lightning's autocast casts the FP32 weight at each use and sums the two widened gradients in FP32; the half
    copy is one tensor, so autograd sums the two contributions in the half dtype: one more rounding per step, of at
    most half an ulp of the sum (2**-11 relative in fp16, 2**-8 in bf16). Over 20 SGD steps of lr 0.05 the weights
    stay within that relative bound plus a small absolute slack (1e-3: the drift those roundings carry along)."""

    def run(plugin: Precision) -> dict[str, Any]:
        model = SharedLayer()
        trainer_for(plugin, max_steps=20, max_epochs=-1).fit(model, loader(n=160))
        return state_of(model)

    relative = 2.0**-11 if mode.precision == "16-mixed" else 2.0**-8
    check_against_lightning(mode, run, rtol=relative, atol=1e-3)


# -------------------------------------------------------- 14. accumulation + clipping + a per-step OneCycleLR
class OneCycle(TinyRegressor):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=12)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_gradient_accumulation_with_clipping_and_a_per_step_one_cycle_schedule(mode: Mode, tmp_path: Path) -> None:
    def run(plugin: Precision) -> dict[str, Any]:
        model = OneCycle()
        lrs = LearningRateMonitor(logging_interval="step")
        trainer = trainer_for(
            plugin,
            max_steps=12,
            max_epochs=-1,
            accumulate_grad_batches=3,
            gradient_clip_val=0.5,
            callbacks=[lrs],
            logger=CSVLogger(tmp_path / type(plugin).__name__),
        )
        trainer.fit(model, loader(n=320))
        return {"params": parameters_of(model), "lr": trainer.optimizers[0].param_groups[0]["lr"]}

    # Bit for bit, clipping by norm included (the check's norm is clip_grad_norm_'s).
    check_against_lightning(mode, run)


# ------------------------------------------------- 15. ModelCheckpoint + EarlyStopping + LearningRateMonitor
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_checkpointing_early_stopping_and_lr_monitoring_work_as_under_lightnings_plugin(
    mode: Mode, tmp_path: Path
) -> None:
    def run(plugin: Precision) -> dict[str, Any]:
        folder = tmp_path / type(plugin).__name__
        model = ResNetish()
        best = ModelCheckpoint(dirpath=folder, monitor="val_loss", save_top_k=1, save_last=True)
        stop = EarlyStopping(monitor="val_loss", patience=1, min_delta=1.0)  # stops after two epochs
        trainer = make_trainer(
            plugin,
            max_epochs=6,
            callbacks=[best, stop, LearningRateMonitor()],
            enable_checkpointing=True,
            logger=CSVLogger(folder),
        )
        trainer.fit(model, images(), images())
        saved = torch.load(best.best_model_path, weights_only=True)["state_dict"]
        last = torch.load(best.last_model_path, weights_only=True)["state_dict"]
        assert {v.dtype for v in [*saved.values(), *last.values()] if v.is_floating_point()} == {torch.float32}
        torch.testing.assert_close(last, model.state_dict(), rtol=0, atol=0)
        return {"epochs": trainer.current_epoch, "best": saved, "last": last}

    check_against_lightning(mode, run)


# -------------------------------------------------------------------------- 16. the transformer encoder
@pytest.mark.parametrize("mode", MODES, ids=str)
def test_a_transformer_encoder_with_embeddings_and_layer_norm_trains_as_under_lightnings_plugin(mode: Mode) -> None:
    def run(plugin: Precision) -> dict[str, Any]:
        model = Encoder()
        trainer_for(plugin, max_epochs=3).fit(model, sentences())
        return state_of(model)

    check_against_lightning(mode, run)


# ---------------------------------------------------------------------------------------- 17. LightningCLI
class CliModel(TinyRegressor):
    def train_dataloader(self) -> DataLoader[tuple[Tensor, ...]]:
        return loader()


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_lightning_cli_takes_the_plugin_from_trainer_plugins(mode: Mode, tmp_path: Path) -> None:
    args = {
        "fit": {
            "trainer": {
                "plugins": [
                    {
                        "class_path": "lightning_amp_plus.MixedPrecisionPlugin",
                        "init_args": {
                            "precision": mode.precision,
                            "device": "cpu",
                            "master_weights": mode.master_weights,
                        },
                    }
                ],
                "accelerator": "cpu",
                "max_steps": 3,
                "logger": False,
                "enable_checkpointing": False,
                "enable_progress_bar": False,
                "enable_model_summary": False,
                "default_root_dir": str(tmp_path),
            }
        }
    }
    cli = LightningCLI(CliModel, args=args, save_config_kwargs={"overwrite": True})
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, MixedPrecisionPlugin)
    assert (plugin.precision, plugin.settings.master_weights) == (mode.precision, mode.master_weights)
    assert cli.trainer.global_step == 3 and {p.dtype for p in cli.model.parameters()} == {torch.float32}


class SwapsTheScaler(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            trainer.precision_plugin.scaler = DynamicLossScaler(init_scale=START_SCALE)  # type: ignore[union-attr]


def test_a_scaler_assigned_during_fit_names_the_parameters_the_old_one_named() -> None:
    class OneBadLayer(TinyRegressor):
        def on_after_backward(self) -> None:
            if self.trainer.global_step == 4:
                self.net[2].weight.grad[0, 0] = float("inf")

    plugin = ours(Mode("16-mixed", False))
    make_trainer(plugin, max_steps=6, max_epochs=-1, callbacks=[SwapsTheScaler()]).fit(OneBadLayer(), loader())
    assert plugin.scaler is not None and plugin.scaler.skipped_steps == 1
    skipped = [result for result in plugin.recent_steps if result.skipped]
    assert [result.overflow_params for result in skipped] == [["net.2.weight"]]
