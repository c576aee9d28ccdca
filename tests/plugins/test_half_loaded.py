"""A model built or loaded in half (bf16, fp16) and trained with ``master_weights=True``, with real third-party models
and Lightning's own callbacks, against Lightning's and Fabric's built-in ``*-mixed`` on the same model widened to FP32
by hand (``copy.deepcopy(model).float()``): bit for bit.

Three ways such a model went wrong, each reproduced here with the model and callback it was found with:

* BatchNorm's running statistics stayed in half while its weight became FP32: torchvision's ``mobilenet_v3_small``
  crashed at its first forward ("mixed dtype (CPU)"). Floating buffers are widened with the parameters now.
* The Trainer runs the callbacks' ``setup`` before any precision plugin hook: ``StochasticWeightAveraging`` and
  ``EMAWeightAveraging`` copied the half model there and averaged half values back into the FP32 masters (silently,
  5.6e-3 off on a transformers LM); ``ModelPruning``'s lottery-ticket copy wrote half tensors back into the masters'
  ``.data`` and crashed inside AdamW. Such a copy is refused now, before training, with the fix (widen before ``fit``),
  and the fixed run equals the built-in's.
* A half tensor written into a master's ``.data`` later, by any code: refused before the optimizer runs, naming the
  parameter, where it used to crash inside torch.

The loaded dtype is the precision's half dtype (bf16 for ``bf16-mixed``, fp16 for ``16-mixed``): what a fine-tuner
loads and trains. Tiny shapes, a few steps, CPU.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fabric_loops import fabrics
from fabric_loops import ours as fabric_ours
from helpers import FP16_ON_CPU_WARNING, HALF, PRECISIONS, lightning_plugin, make_trainer, our_plugin
from lightning.pytorch import callbacks
from lightning.pytorch.callbacks import BackboneFinetuning, ModelPruning, StochasticWeightAveraging
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from versions import needs

from lightning_amp_plus.weights.master import widen_model_

pytestmark = [
    pytest.mark.filterwarnings(FP16_ON_CPU_WARNING),
    pytest.mark.filterwarnings(r"ignore:.*MixedPrecisionPlugin\('16-mixed'\) on CPU:UserWarning"),
    # SWA's own notes on the schedulers it swaps in and on the epochs it adds; nothing of ours.
    pytest.mark.filterwarnings("ignore:.*SWA.*"),
]


# --------------------------------------------------------------------------------------------------- models
class ConvNet(pl.LightningModule):
    """torchvision's ``mobilenet_v3_small`` (BatchNorm, squeeze-excitation, hardswish), a quarter wide, as a backbone
    and a head (the shape ``BackboneFinetuning`` asks for); AdamW over the parameters that train at set-up."""

    def __init__(self) -> None:
        super().__init__()
        torchvision = pytest.importorskip("torchvision")
        net = torchvision.models.mobilenet_v3_small(weights=None, num_classes=4, width_mult=0.25)
        self.backbone = net.features
        self.head = nn.Sequential(net.avgpool, nn.Flatten(1), net.classifier)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


class CausalLM(pl.LightningModule):
    """transformers' ``LlamaForCausalLM`` from a tiny config (RMSNorm, rotary embeddings with their ``inv_freq``
    buffer), trained with AdamW on random tokens."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss.float()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def images() -> DataLoader[tuple[Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(12, 3, 32, 32, generator=generator), torch.randint(0, 4, (12,), generator=generator)
    )
    return DataLoader(data, batch_size=4)


def tokens() -> DataLoader[tuple[Tensor, ...]]:
    return DataLoader(TensorDataset(torch.randint(0, 64, (12, 10), generator=torch.Generator().manual_seed(0))), 4)


def loaded_in_half(build: Callable[[], pl.LightningModule], precision: str) -> pl.LightningModule:
    """``build()`` cast to the precision's half dtype: what ``from_pretrained(torch_dtype=...)`` hands a fine-tuner."""
    torch.manual_seed(0)
    return build().to(HALF[precision])


def state_of(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and persistent buffer (BatchNorm's statistics and counters included), copied."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_same_state(actual: nn.Module, expected: nn.Module) -> None:
    a, e = state_of(actual), state_of(expected)
    assert a.keys() == e.keys()
    for name in e:
        torch.testing.assert_close(a[name], e[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def fit(
    model: pl.LightningModule, plugin: Any, data: DataLoader[Any], callbacks: list[pl.Callback], **kwargs: Any
) -> None:
    torch.manual_seed(1)  # dropout draws the same masks in both runs
    make_trainer(plugin, callbacks=callbacks, **kwargs).fit(model, data)


# ------------------------------------------------------------------------------- Trainer: buffers, finetuning
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_batchnorm_convnet_loaded_in_half_trains_as_the_builtin_on_its_fp32_widening(precision: str) -> None:
    half = loaded_in_half(ConvNet, precision)
    expected = copy.deepcopy(half).float()
    fit(expected, lightning_plugin(precision), images(), [], max_epochs=2)
    fit(half, our_plugin(precision, master_weights=True), images(), [], max_epochs=2)
    # Parameters and running statistics FP32, widened at set-up; the batch counters stay int64, and count.
    bn = half.backbone[0][1]
    assert {bn.weight.dtype, bn.running_mean.dtype, bn.running_var.dtype} == {torch.float32}
    assert bn.num_batches_tracked.dtype == torch.int64 and int(bn.num_batches_tracked) == 6
    assert_same_state(half, expected)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_backbone_finetuning_of_a_convnet_loaded_in_half_equals_the_builtin(precision: str) -> None:
    """BackboneFinetuning freezes the backbone in `setup` (no copy) and adds it to AdamW at epoch 1: the parameters it
    adds are the widened FP32 masters."""
    half = loaded_in_half(ConvNet, precision)
    expected = copy.deepcopy(half).float()
    fit(
        expected,
        lightning_plugin(precision),
        images(),
        [BackboneFinetuning(unfreeze_backbone_at_epoch=1, train_bn=False)],
        max_epochs=2,
    )
    fit(
        half,
        our_plugin(precision, master_weights=True),
        images(),
        [BackboneFinetuning(unfreeze_backbone_at_epoch=1, train_bn=False)],
        max_epochs=2,
    )
    assert_same_state(half, expected)
    assert all(p.requires_grad for p in half.backbone.parameters())  # it did unfreeze (premise)


# ------------------------------------------------------------------------- Trainer: callbacks that copy in setup
def swa() -> pl.Callback:
    return StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1, annealing_epochs=1)


def ema() -> pl.Callback:
    return callbacks.EMAWeightAveraging(decay=0.5)


def pruning() -> pl.Callback:
    return ModelPruning("l1_unstructured", amount=0.25, use_lottery_ticket_hypothesis=True)


COPYING = {"StochasticWeightAveraging": swa, "EMAWeightAveraging": ema, "ModelPruning": pruning}
WHERE = {
    "StochasticWeightAveraging": "`_average_model`",
    "EMAWeightAveraging": "`_average_model`",
    "ModelPruning": "`_original_layers[",
}
CALLBACKS = [
    "StochasticWeightAveraging",
    pytest.param("EMAWeightAveraging", marks=needs("lightning", "2.6", "EMAWeightAveraging")),
    "ModelPruning",
]


@pytest.mark.parametrize("callback", CALLBACKS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_half_copy_made_in_a_callbacks_setup_is_refused_before_training_with_the_fix(
    precision: str, callback: str
) -> None:
    """Before: SWA and EMA averaged the half copy back into the masters (the LM ended 5.6e-3 from the built-in);
    ModelPruning wrote its half lottery ticket into the masters' `.data` and AdamW crashed ("expected dtype float for
    end but got dtype c10::BFloat16")."""
    half = loaded_in_half(CausalLM, precision)
    before = state_of(half)
    dtype = HALF[precision]
    message = (
        f"MixedPrecisionPlugin(master_weights=True): {callback} holds a {dtype} copy of the model ({WHERE[callback]}"
    )
    with pytest.raises(ValueError, match=re.escape(message)) as refusal:
        fit(half, our_plugin(precision, master_weights=True), tokens(), [COPYING[callback]()], max_epochs=3)
    assert "widen_model_(model)` before `trainer.fit(model)`" in str(refusal.value)
    assert all(torch.equal(state_of(half)[name], before[name]) for name in before)  # refused before any step


@pytest.mark.parametrize("callback", CALLBACKS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_model_widened_before_fit_trains_with_a_copying_callback_as_the_builtin(
    precision: str, callback: str
) -> None:
    half = loaded_in_half(CausalLM, precision)
    expected, without = copy.deepcopy(half).float(), copy.deepcopy(half).float()
    fit(expected, lightning_plugin(precision), tokens(), [COPYING[callback]()], max_epochs=3)
    assert widen_model_(half)  # the fix the refusal names
    fit(half, our_plugin(precision, master_weights=True), tokens(), [COPYING[callback]()], max_epochs=3)
    assert_same_state(half, expected)
    fit(without, lightning_plugin(precision), tokens(), [], max_epochs=3)
    assert not torch.equal(without.model.lm_head.weight, expected.model.lm_head.weight)  # the callback acted (premise)


# --------------------------------------------------------------------- a half tensor written into a master later
class HalfSnapshot(pl.Callback):
    """Keeps the weights in half at the start (to save memory) and puts them back by replacing each parameter's
    ``.data`` at the end of the first epoch (``ModelPruning``'s lottery-ticket reset writes the same way)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.snapshot = {n: p.detach().to(torch.bfloat16) for n, p in pl_module.named_parameters()}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 0:
            for name, param in pl_module.named_parameters():
                param.data = self.snapshot[name]


class WritesHalfDuringTheStep(CausalLM):
    """Replaces a weight's data by a half copy in ``on_after_backward`` of its third step (during the step)."""

    def on_after_backward(self) -> None:
        if self.trainer.global_step == 2:
            weight = self.model.lm_head.weight
            weight.data = weight.data.to(torch.bfloat16)


@pytest.mark.parametrize("skip_nonfinite", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("when", ["between steps", "during the step"])
def test_a_half_tensor_written_into_a_master_is_refused_before_the_optimizer_runs(
    when: str, skip_nonfinite: bool
) -> None:
    """Before: AdamW raised inside torch ("expected dtype float for end but got dtype c10::BFloat16"). Checked and
    unchecked: with ``skip_nonfinite=False`` bf16 runs Lightning's own step, whose closure runs inside the optimizer."""
    plugin = our_plugin("bf16-mixed", master_weights=True, skip_nonfinite=skip_nonfinite)
    if when == "between steps":
        model, callbacks, name = CausalLM(), [HalfSnapshot()], "model.model.embed_tokens.weight"
    else:
        model, callbacks, name = WritesHalfDuringTheStep(), [], "model.lm_head.weight"
    seen: list[dict[str, Tensor]] = []

    class Recorder(pl.Callback):
        def on_before_optimizer_step(self, *args: Any) -> None:
            seen.append(state_of(model))

    with pytest.raises(RuntimeError) as refusal:
        fit(model, plugin, tokens(), [*callbacks, Recorder()], max_epochs=2)
    message = str(refusal.value)
    assert message.startswith(
        f"MixedPrecisionPlugin(master_weights=True): the parameter `{name}` is torch.bfloat16 at this optimizer step"
    )
    assert "a callback that restores weights" in message and "widen_model_(model)" in message
    assert "param.data.copy_(source)" in message
    assert len(seen) == (3 if when == "between steps" else 2)  # the refused step reached no hook and no optimizer


# ------------------------------------------------------------------------------------------------------ Fabric
def fabric_run(
    plugin: Any, model: nn.Module, data: DataLoader[Any], loss: Callable[[nn.Module, Any], Tensor], steps: int = 4
) -> tuple[nn.Module, nn.Module]:
    """A Fabric loop of ``steps`` AdamW steps with an EMA (torch's ``AveragedModel``, made after ``fabric.setup``, as
    Fabric users make it): the trained module and its average."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(1)
    wrapped, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    average = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5), use_buffers=True
    )
    for _, batch in zip(range(steps), data, strict=False):
        fabric.backward(loss(wrapped, batch))
        optimizer.step()
        optimizer.zero_grad()
        average.update_parameters(model)
    return model, average


def image_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def token_loss(model: nn.Module, batch: tuple[Tensor]) -> Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def torchvision_net() -> nn.Module:
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.mobilenet_v3_small(weights=None, num_classes=4, width_mult=0.25)


def transformers_lm() -> nn.Module:
    return CausalLM().model


FABRIC_CASES = {
    "mobilenet_v3_small": (torchvision_net, images, image_loss),
    "LlamaForCausalLM": (transformers_lm, tokens, token_loss),
}


@pytest.mark.parametrize("case", list(FABRIC_CASES))
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fabric_a_model_loaded_in_half_trains_as_fabrics_builtin_on_its_fp32_widening(
    precision: str, case: str
) -> None:
    build, data, loss = FABRIC_CASES[case]
    torch.manual_seed(0)
    half = build().to(HALF[precision])
    expected, expected_average = fabric_run(fabrics(precision), copy.deepcopy(half).float(), data(), loss)
    actual, actual_average = fabric_run(fabric_ours(precision, master_weights=True), half, data(), loss)
    assert {t.dtype for t in actual.state_dict().values() if t.is_floating_point()} == {torch.float32}
    assert_same_state(actual, expected)
    assert_same_state(actual_average, expected_average)


@pytest.mark.parametrize("clip", [False, True], ids=["step", "clip_gradients"])
def test_fabric_a_half_tensor_written_into_a_master_is_refused_before_the_optimizer_runs(clip: bool) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[fabric_ours("bf16-mixed", master_weights=True)])
    model = transformers_lm().to(torch.bfloat16)
    wrapped, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = next(iter(tokens()))
    fabric.backward(token_loss(wrapped, ids))
    optimizer.step()
    head = model.lm_head.weight
    head.data = head.data.to(torch.bfloat16)  # user code restoring a half snapshot
    after_first = state_of(model)
    fabric.backward(token_loss(wrapped, ids))
    message = "MixedPrecisionPlugin(master_weights=True): the parameter `lm_head.weight` is torch.bfloat16"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        if clip:
            fabric.clip_gradients(wrapped, optimizer, max_norm=1.0)
        optimizer.step()
    assert all(torch.equal(state_of(model)[name], after_first[name]) for name in after_first)  # nothing stepped
