"""The shipped LightningModules: CifarCNN and ImdbLSTM, in fp32, under autocast, held in half, and under the plugin."""

from __future__ import annotations

import io
import math
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import FP16_ON_CPU_WARNING, make_trainer
from torch import Tensor, nn

from lightning_amp_plus import MixedPrecisionPlugin
from lightning_amp_plus.data._collate import pad_collate
from lightning_amp_plus.data.synthetic import SyntheticCIFAR10DataModule, SyntheticIMDBDataModule
from lightning_amp_plus.models import CifarCNN, ImdbLSTM, _optim

pytestmark = pytest.mark.filterwarnings(FP16_ON_CPU_WARNING)

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (autocast dtype or None for none, the dtype the logits come out in)
AUTOCAST_CASES = [(None, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]
PLUGIN_MODES = [
    pytest.param({"precision": "16-mixed"}, id="16-mixed"),
    pytest.param({"precision": "bf16-mixed"}, id="bf16-mixed"),
    *(
        pytest.param({"precision": precision, "master_weights": True}, id=f"{precision}-master")
        for precision in ("16-mixed", "bf16-mixed")
    ),
]


def tiny_cnn(**kwargs: Any) -> CifarCNN:
    return CifarCNN(**{"width": 4, "scheduler": "none", **kwargs})


def tiny_lstm(**kwargs: Any) -> ImdbLSTM:
    return ImdbLSTM(**{"vocab_size": 50, "embed_dim": 8, "hidden_dim": 8, **kwargs})


def images(batch: int = 4, size: int = 8) -> tuple[Tensor, Tensor]:
    return torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))


def token_batch() -> tuple[Tensor, Tensor, Tensor]:
    samples = [(torch.randint(2, 50, (length,)), length % 2) for length in (7, 3, 5, 1)]
    return pad_collate(samples)


def autocast(dtype: torch.dtype | None) -> Any:
    return torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None)


def assert_every_parameter_has_a_finite_gradient(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert param.grad.dtype == param.dtype, f"{name}: grad {param.grad.dtype}, param {param.dtype}"
        assert torch.isfinite(param.grad).all(), f"{name} has a non-finite gradient"


# ------------------------------------------------------------------------------------------ forward and backward
@pytest.mark.parametrize(("dtype", "logits_dtype"), AUTOCAST_CASES)
@pytest.mark.parametrize("size", [32, 5])
def test_cnn_forward_and_backward_give_logits_per_class_under_each_autocast(dtype, logits_dtype, size):
    model = tiny_cnn()
    x, y = images(size=size)
    with autocast(dtype):
        logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
    loss.backward()
    assert logits.shape == (4, 10)
    assert logits.dtype == logits_dtype
    assert_every_parameter_has_a_finite_gradient(model)


@pytest.mark.parametrize(("dtype", "logits_dtype"), AUTOCAST_CASES)
@pytest.mark.parametrize(("bidirectional", "num_layers"), [(True, 1), (False, 2)])
def test_lstm_forward_and_backward_give_one_logit_per_sequence_under_each_autocast(
    dtype, logits_dtype, bidirectional, num_layers
):
    model = tiny_lstm(bidirectional=bidirectional, num_layers=num_layers)
    tokens, lengths, labels = token_batch()
    with autocast(dtype):
        logits = model(tokens, lengths)
        loss = F.binary_cross_entropy_with_logits(logits.float(), labels)
    loss.backward()
    assert logits.shape == (4,)
    # The classifier is a Linear: autocast runs it in the autocast dtype.
    assert logits.dtype == logits_dtype
    # The padding row's embedding gets no gradient (padding_idx); every parameter still gets one.
    assert_every_parameter_has_a_finite_gradient(model)
    torch.testing.assert_close(model.embedding.weight.grad[0], torch.zeros(8), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_lstm_held_in_half_runs_outside_autocast(dtype):
    # What master-weights training does to the model (CPU supports fp16/bf16 LSTM kernels in torch >= 2.x).
    model = tiny_lstm().to(dtype)
    tokens, lengths, labels = token_batch()
    logits = model(tokens, lengths)
    F.binary_cross_entropy_with_logits(logits.float(), labels).backward()
    assert logits.dtype == dtype
    assert_every_parameter_has_a_finite_gradient(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("under_autocast", [False, True], ids=["plain", "autocast"])
def test_lstm_with_only_its_embedding_in_half_feeds_the_lstm_its_own_dtype(dtype, under_autocast):
    # A partly converted model (embedding half, LSTM fp32): without the cast the LSTM refuses the half input.
    model = tiny_lstm()
    model.embedding.to(dtype)
    tokens, lengths, _ = token_batch()
    with autocast(dtype if under_autocast else None):
        logits = model(tokens, lengths)
    assert torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("under_autocast", [False, True], ids=["plain", "autocast"])
def test_cnn_with_half_convolutions_and_fp32_batch_norm_runs(dtype, under_autocast):
    # The master-weights layout: conv and linear weights half, BatchNorm kept in fp32; fp32 images come in.
    model = tiny_cnn()
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            module.to(dtype)
    x, y = images()
    with autocast(dtype if under_autocast else None):
        logits = model(x)
    F.cross_entropy(logits.float(), y).backward()
    assert logits.dtype == dtype
    assert_every_parameter_has_a_finite_gradient(model)


def test_lstm_reads_each_sequence_to_its_length_only():
    model = tiny_lstm().eval()
    tokens, lengths, _ = token_batch()
    extra_padding = torch.cat([tokens, torch.zeros(4, 6, dtype=torch.long)], dim=1)
    garbage_after_the_end = extra_padding.clone()
    garbage_after_the_end[:, -6:] = 7
    reference = model(tokens, lengths)
    # Packing must make what lies past each length invisible: same ops on the same values, so exactly equal.
    torch.testing.assert_close(model(extra_padding, lengths), reference, rtol=0, atol=0)
    torch.testing.assert_close(model(garbage_after_the_end, lengths), reference, rtol=0, atol=0)


def test_lstm_reads_an_empty_sequence_as_one_padding_token():
    model = tiny_lstm().eval()
    tokens, lengths, _ = pad_collate([(torch.tensor([], dtype=torch.long), 0), (torch.tensor([4, 5]), 1)])
    assert lengths.tolist() == [0, 2]
    logits = model(tokens, lengths)
    one_pad = model(torch.tensor([[0]]), torch.tensor([1]))
    torch.testing.assert_close(logits[:1], one_pad, rtol=0, atol=0)  # the same computation: exactly equal


def test_lstm_accepts_float_and_long_labels_alike():
    model = tiny_lstm()
    tokens, lengths, labels = token_batch()
    with_float = model._loss((tokens, lengths, labels))[0]
    with_long = model._loss((tokens, lengths, labels.long()))[0]
    torch.testing.assert_close(with_float, with_long, rtol=0, atol=0)  # the same values once cast: exactly equal


def test_lstm_loss_never_calls_the_binary_cross_entropy_that_cuda_autocast_bans(monkeypatch):
    def banned(*args: Any, **kwargs: Any) -> Tensor:
        raise AssertionError("F.binary_cross_entropy is refused under CUDA autocast")

    monkeypatch.setattr(F, "binary_cross_entropy", banned)
    monkeypatch.setattr(nn.BCELoss, "forward", banned)
    model = tiny_lstm()
    with autocast(torch.bfloat16):
        loss = model._loss(token_batch())[0]
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_both_models_train_a_step_under_cuda_autocast(dtype):
    cnn, lstm = tiny_cnn().cuda(), tiny_lstm().cuda()
    x, y = (t.cuda() for t in images())
    tokens, lengths, labels = (t.cuda() for t in token_batch())
    with torch.autocast("cuda", dtype=dtype):
        losses = [cnn._loss((x, y))[0], lstm._loss((tokens, lengths, labels))[0]]
    for loss in losses:
        loss.backward()
        assert torch.isfinite(loss)


# ---------------------------------------------------------------------------------------- under the Trainer
def tiny_cifar(**kwargs: Any) -> SyntheticCIFAR10DataModule:
    return SyntheticCIFAR10DataModule(**{"num_train": 16, "num_val": 8, "image_size": 8, "batch_size": 8, **kwargs})


def tiny_imdb(**kwargs: Any) -> SyntheticIMDBDataModule:
    settings = {"num_train": 16, "num_val": 8, "vocab_size": 50, "min_len": 3, "max_len": 9, "batch_size": 8}
    return SyntheticIMDBDataModule(**{**settings, **kwargs})


@pytest.mark.parametrize("plugin_kwargs", PLUGIN_MODES)
@pytest.mark.parametrize("which", ["cnn", "lstm"])
def test_fast_dev_run_trains_validates_and_logs_under_each_plugin_mode(which, plugin_kwargs):
    model, data = (tiny_cnn(), tiny_cifar()) if which == "cnn" else (tiny_lstm(), tiny_imdb())
    trainer = make_trainer(MixedPrecisionPlugin(**plugin_kwargs), fast_dev_run=True)
    trainer.fit(model, data)
    metrics = dict(trainer.callback_metrics)  # test() starts the callback metrics afresh
    trainer.test(model, data, verbose=False)
    metrics.update(trainer.callback_metrics)
    for name in ("train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc"):
        assert name in metrics, f"{name} not logged; logged: {sorted(metrics)}"
        assert math.isfinite(float(metrics[name])), f"{name} = {metrics[name]}"
    assert trainer.global_step == 1


def test_train_metrics_are_logged_per_step_and_per_epoch_and_validation_per_epoch():
    trainer = make_trainer(max_steps=2, log_every_n_steps=1)
    trainer.fit(tiny_cnn(), tiny_cifar())
    logged = set(trainer.callback_metrics)
    assert {"train/loss_step", "train/loss_epoch", "train/acc_step", "train/acc_epoch"} <= logged
    assert {"val/loss", "val/acc"} <= logged
    assert not {"val/loss_step", "val/acc_step"} & logged


@pytest.mark.parametrize("which", ["cnn", "lstm"])
def test_every_tensor_logged_per_epoch_is_synced_across_processes(which, monkeypatch):
    # Lightning warns under DDP for each epoch-level tensor metric logged without sync_dist=True, and its epoch value
    # is then rank zero's alone. (torchmetrics metrics gather their state themselves.)
    calls = []
    original = pl.LightningModule.log

    def log(self, name, value, *args, **kwargs):
        calls.append((name, isinstance(value, torch.Tensor), kwargs.get("on_epoch"), kwargs.get("sync_dist", False)))
        return original(self, name, value, *args, **kwargs)

    monkeypatch.setattr(pl.LightningModule, "log", log)
    model, data = (tiny_cnn(), tiny_cifar()) if which == "cnn" else (tiny_lstm(), tiny_imdb())
    trainer = make_trainer(max_steps=1)
    trainer.fit(model, data)
    trainer.test(model, data, verbose=False)
    tensors = {(name, on_epoch, sync) for name, is_tensor, on_epoch, sync in calls if is_tensor}
    assert {name for name, _, _ in tensors} == {"train/loss", "val/loss", "test/loss"}
    assert all(sync for _, on_epoch, sync in tensors if on_epoch is not False), sorted(tensors)


# One epoch of fresh samples, validated once at its end. Chance is 0.1 (CNN, 10 classes) and 0.5 (LSTM). Measured with
# these settings (CPU, seed 0, fp32 / bf16): the CNN reaches 0.95 / 0.94 in 96 steps, the LSTM 0.84 / 0.83 in 64 (a
# token-counting oracle scores 0.91 on these short reviews). The thresholds leave room for kernel differences between
# CPUs and torch versions while staying far above chance.
CNN_THRESHOLD, LSTM_THRESHOLD = 0.8, 0.75


def short_training(which: str, precision: str) -> float:
    pl.seed_everything(0, verbose=False)
    if which == "cnn":
        steps = 96
        data: pl.LightningDataModule = SyntheticCIFAR10DataModule(
            num_train=steps * 32, num_val=256, image_size=12, batch_size=32
        )
        model: pl.LightningModule = CifarCNN(width=8, lr=0.05, scheduler="none")
    else:
        steps = 64
        data = SyntheticIMDBDataModule(
            num_train=steps * 32, num_val=256, vocab_size=200, min_len=10, max_len=30, batch_size=32
        )
        model = ImdbLSTM(200, embed_dim=16, hidden_dim=8, lr=0.02)
    plugin = None if precision == "32-true" else MixedPrecisionPlugin(precision)
    trainer = make_trainer(plugin, max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, data)
    assert trainer.global_step == steps
    return float(trainer.callback_metrics["val/acc"])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize(("which", "threshold"), [("cnn", CNN_THRESHOLD), ("lstm", LSTM_THRESHOLD)])
def test_a_short_training_on_synthetic_data_reaches_the_accuracy_threshold(which, threshold, precision):
    accuracy = short_training(which, precision)
    assert accuracy >= threshold, f"{which} under {precision}: validation accuracy {accuracy:.3f} < {threshold}"


# ----------------------------------------------------------------------------------- optimizers and schedules
@pytest.mark.parametrize(
    ("name", "optimizer_type"),
    [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)],
)
def test_each_optimizer_choice_builds_its_optimizer_with_decay_on_weights_only(name, optimizer_type):
    model = tiny_cnn(optimizer=name, lr=0.01, weight_decay=0.1, momentum=0.8)
    optimizer = model.configure_optimizers()
    assert type(optimizer) is optimizer_type
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert all(group["lr"] == 0.01 for group in optimizer.param_groups)
    if name == "sgd":
        assert optimizer.defaults["momentum"] == 0.8


def test_without_weight_decay_all_parameters_share_one_group():
    optimizer = tiny_lstm(weight_decay=0.0).configure_optimizers()
    assert len(optimizer.param_groups) == 1


class LearningRates(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def lrs_over_a_run(scheduler: str, steps: int = 8, lr: float = 0.1) -> tuple[pl.Trainer, list[float]]:
    recorder = LearningRates()
    trainer = make_trainer(max_steps=steps, max_epochs=-1, limit_val_batches=0, callbacks=[recorder])
    trainer.fit(tiny_cnn(scheduler=scheduler, lr=lr), tiny_cifar(num_train=64, batch_size=4))
    return trainer, recorder.lrs


def test_cosine_anneals_per_step_over_the_estimated_stepping_batches():
    trainer, lrs = lrs_over_a_run("cosine")
    config = trainer.lr_scheduler_configs[0]
    assert type(config.scheduler) is torch.optim.lr_scheduler.CosineAnnealingLR
    assert config.interval == "step" and config.scheduler.T_max == 8
    expected = [0.05 * (1 + math.cos(math.pi * step / 8)) for step in range(8)]
    torch.testing.assert_close(lrs, expected, rtol=1e-6, atol=0)  # closed form vs PyTorch's recursion: float rounding


def test_onecycle_warms_up_to_the_lr_then_anneals():
    trainer, lrs = lrs_over_a_run("onecycle", steps=20)
    config = trainer.lr_scheduler_configs[0]
    assert type(config.scheduler) is torch.optim.lr_scheduler.OneCycleLR and config.interval == "step"
    peak = max(range(20), key=lrs.__getitem__)
    assert lrs[0] < 0.1 / 10 and 4 <= peak <= 6 and lrs[-1] < lrs[0]
    torch.testing.assert_close(lrs[peak], 0.1, rtol=0.05, atol=0)  # the peak step falls near, not at, 30% of 20


def test_step_schedule_divides_the_lr_by_ten_at_half_and_three_quarters():
    trainer, lrs = lrs_over_a_run("step")
    assert type(trainer.lr_scheduler_configs[0].scheduler) is torch.optim.lr_scheduler.MultiStepLR
    torch.testing.assert_close(lrs, [0.1] * 4 + [0.01] * 2 + [0.001] * 2, rtol=1e-9, atol=0)  # 0.1*0.1: rounding


def test_no_schedule_returns_the_optimizer_alone():
    assert isinstance(tiny_cnn(scheduler="none").configure_optimizers(), torch.optim.SGD)


def test_onecycle_with_sgd_without_momentum_does_not_cycle_momentum():
    optimizer = _optim.build_optimizer("sgd", _optim.parameter_groups(nn.Linear(2, 1), 0.0), lr=0.1, momentum=0.0)
    config = _optim.build_scheduler("onecycle", optimizer, total_steps=10)
    assert config is not None and config["scheduler"].cycle_momentum is False


def test_a_schedule_over_an_endless_run_is_refused():
    model = tiny_cnn(scheduler="cosine")
    model.trainer = make_trainer(max_epochs=-1, max_steps=-1)
    with pytest.raises(ValueError, match=r"scheduler='cosine'.*no end.*max_steps"):
        model.configure_optimizers()


def test_hyperparameters_are_saved_and_rebuild_the_same_model():
    model = tiny_lstm(hidden_dim=12, dropout=0.1, optimizer="sgd")
    assert model.hparams["hidden_dim"] == 12 and model.hparams["optimizer"] == "sgd"
    twin = ImdbLSTM(**model.hparams)
    assert [p.shape for p in twin.parameters()] == [p.shape for p in model.parameters()]


# ------------------------------------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_classes": 1}, r"CifarCNN\(num_classes=1\)` must be an int >= 2"),
        ({"width": 0}, r"CifarCNN\(width=0\)` must be an int >= 1"),
        ({"in_channels": 2.0}, r"CifarCNN\(in_channels=2.0\)` must be an int"),
        ({"dropout": 1.0}, r"CifarCNN\(dropout=1.0\)` must be a probability in \[0, 1\)"),
        ({"optimizer": "lamb"}, r"CifarCNN\(optimizer='lamb'\)` is not supported: use one of 'sgd', 'adam', 'adamw'"),
        ({"scheduler": "linear"}, r"CifarCNN\(scheduler='linear'\)` is not supported: use one of 'none', 'cosine'"),
        ({"lr": 0.0}, r"CifarCNN\(lr=0.0\)` must be a positive finite number"),
        ({"lr": float("nan")}, r"CifarCNN\(lr=nan\)` must be a positive finite number"),
        ({"weight_decay": -1e-4}, r"CifarCNN\(weight_decay=-0.0001\)` must be a finite number >= 0"),
        ({"momentum": 1.0}, r"CifarCNN\(momentum=1.0\)` must be in \[0, 1\)"),
    ],
)
def test_cnn_refuses_bad_arguments_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CifarCNN(**kwargs)


def test_cnn_refuses_a_non_bool_batch_norm():
    with pytest.raises(TypeError, match=r"CifarCNN\(batch_norm='yes'\)` must be True or False"):
        CifarCNN(batch_norm="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 1}, r"ImdbLSTM\(vocab_size=1\)` must be an int >= 2"),
        ({"vocab_size": 10, "pad_index": 10}, r"ImdbLSTM\(pad_index=10\)` must be a token id in \[0, vocab_size=10\)"),
        ({"vocab_size": 10, "pad_index": -1}, r"ImdbLSTM\(pad_index=-1\)` must be a token id"),
        ({"vocab_size": 10, "hidden_dim": 0}, r"ImdbLSTM\(hidden_dim=0\)` must be an int >= 1"),
        ({"vocab_size": 10, "num_layers": 0}, r"ImdbLSTM\(num_layers=0\)` must be an int >= 1"),
        ({"vocab_size": 10, "dropout": -0.1}, r"ImdbLSTM\(dropout=-0.1\)` must be a probability"),
        ({"vocab_size": 10, "optimizer": "rmsprop"}, r"ImdbLSTM\(optimizer='rmsprop'\)` is not supported"),
    ],
)
def test_lstm_refuses_bad_arguments_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ImdbLSTM(**kwargs)


# ------------------------------------------------------------------------------------------------ NumPy numbers
# Values a float32 holds exactly, so that the NumPy twin and the Python one are equal.
MODEL_NUMBERS = {
    "cnn": (tiny_cnn, {"num_classes": 10, "width": 4, "dropout": 0.25, "lr": 0.5, "momentum": 0.5, "weight_decay": 0}),
    "lstm": (tiny_lstm, {"vocab_size": 50, "hidden_dim": 8, "pad_index": 3, "lr": 0.5, "weight_decay": 0.25}),
}


def as_numpy(value: float) -> Any:
    return np.int64(value) if isinstance(value, int) else np.float32(value)


@pytest.mark.parametrize("which", sorted(MODEL_NUMBERS))
def test_numpy_numbers_build_the_same_model_with_python_numbers_in_its_hyperparameters(which):
    build, numbers = MODEL_NUMBERS[which]
    plain, numpy = build(**numbers), build(**{key: as_numpy(value) for key, value in numbers.items()})
    assert dict(numpy.hparams) == dict(plain.hparams)
    assert all(type(numpy.hparams[key]) is type(plain.hparams[key]) for key in plain.hparams)
    # NumPy scalars in the hyperparameters would make checkpoints that torch.load(weights_only=True) refuses.
    buffer = io.BytesIO()
    torch.save(dict(numpy.hparams), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == dict(plain.hparams)
    assert [p.shape for p in numpy.parameters()] == [p.shape for p in plain.parameters()]
    numpy_groups, plain_groups = numpy.configure_optimizers().param_groups, plain.configure_optimizers().param_groups
    assert [{k: v for k, v in g.items() if k != "params"} for g in numpy_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in plain_groups
    ]


@pytest.mark.parametrize(
    ("build", "kwargs", "message"),
    [
        (CifarCNN, {"width": True}, r"CifarCNN\(width=True\)` must be an int >= 1"),
        (CifarCNN, {"lr": "0.1"}, r"CifarCNN\(lr='0.1'\)` must be a positive finite number"),
        (CifarCNN, {"weight_decay": True}, r"CifarCNN\(weight_decay=True\)` must be a finite number >= 0"),
        (CifarCNN, {"momentum": "0.9"}, r"CifarCNN\(momentum='0.9'\)` must be in \[0, 1\)"),
        (CifarCNN, {"dropout": True}, r"CifarCNN\(dropout=True\)` must be a probability"),
        (ImdbLSTM, {"vocab_size": 10, "pad_index": True}, r"ImdbLSTM\(pad_index=True\)` must be a token id"),
        (ImdbLSTM, {"vocab_size": 10, "pad_index": "0"}, r"ImdbLSTM\(pad_index='0'\)` must be a token id"),
        (ImdbLSTM, {"vocab_size": "10"}, r"ImdbLSTM\(vocab_size='10'\)` must be an int >= 2"),
    ],
)
def test_a_bool_or_a_string_for_a_number_is_refused_naming_the_argument(build, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(**kwargs)


def test_models_refuse_inputs_of_the_wrong_shape_with_the_fix():
    with pytest.raises(ValueError, match=r"expects images of shape \[B, 3, H, W\], got \(4, 1, 8, 8\)"):
        tiny_cnn()(torch.randn(4, 1, 8, 8))
    with pytest.raises(ValueError, match=r"expects tokens as an integer tensor \[B, T\].*pad_collate"):
        tiny_lstm()(torch.randn(4, 5), torch.tensor([5, 5, 5, 5]))
    with pytest.raises(ValueError, match=r"lengths has shape \(3,\), expected \[4\]"):
        tiny_lstm()(torch.ones(4, 5, dtype=torch.long), torch.tensor([5, 5, 5]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_imdb_lstm_runs_a_batch_of_equal_lengths_under_cpu_autocast(dtype: torch.dtype) -> None:
    # torch 2.14's oneDNN LSTM under CPU autocast raises "could not create a primitive descriptor" for such a batch
    # (real IMDB batches truncated to max_len can all have equal lengths); the model runs its LSTM outside autocast.
    model = ImdbLSTM(vocab_size=20, embed_dim=4, hidden_dim=4)
    tokens, lengths = torch.randint(2, 20, (3, 5)), torch.full((3,), 5)
    with torch.autocast("cpu", dtype=dtype):
        assert model(tokens, lengths).shape == (3,)
