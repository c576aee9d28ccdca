"""The plugins under activation checkpointing, as users turn it on, against Lightning's and Fabric's own plugins.

Checkpointing keeps less for backward and recomputes a block's forward there: the step must not change. The same
checkpointing on both sides, 4 AdamW steps (under fp16 the loss made inf at step 2: a skipped step, the scale halved),
bit for bit, under the Trainer and under Fabric:

* transformers' ``LlamaForCausalLM`` (a tiny config) with ``gradient_checkpointing_enable()``, reentrant by default,
  and with ``use_reentrant=False``;
* litgpt's GPT with each ``Block`` wrapped by torch's ``apply_activation_checkpointing`` (non-reentrant: what
  Lightning's FSDP ``activation_checkpointing_policy`` and torchtitan apply).

``16-mixed`` with FP32 master weights (against Lightning's ``MixedPrecision``, which keeps the model in FP32) and
``bf16-mixed``; ``fp8-mixed`` against torchao's recipe under the built-in ``bf16-mixed``. The monitor's replays under
checkpointing are ``tests/monitor/test_monitor_checkpointing.py``'s.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from fabric_loops import fabrics, ours
from fp8_models import CONFIG, CPU_EMULATED, tokens, torchao_reference
from helpers import FP16_ON_CPU_WARNING, START_SCALE, lightning_plugin, make_trainer, our_plugin
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.utils.data import DataLoader, Dataset

import lightning_amp_plus.fabric as amp_fabric
from lightning_amp_plus import MixedPrecisionPlugin

litgpt = pytest.importorskip("litgpt", reason="litgpt's GPT")
transformers = pytest.importorskip("transformers", reason="transformers' Llama")

pytestmark = [pytest.mark.filterwarnings(FP16_ON_CPU_WARNING), pytest.mark.filterwarnings(CPU_EMULATED)]

STEPS = 4
OVERFLOW = 2  # under fp16, the step whose loss is made inf
VOCAB = CONFIG["vocab_size"]


def build(how: str) -> tuple[nn.Module, nn.Module]:
    """The model checkpointed ``how``, and one of its blocks (whose forward calls are counted)."""
    torch.manual_seed(0)
    if how == "litgpt-wrapper":
        gpt = litgpt.GPT(litgpt.Config(**CONFIG))
        block = gpt.transformer.h[0]
        apply_activation_checkpointing(gpt, check_fn=lambda module: isinstance(module, litgpt.model.Block))
        return gpt, block
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        use_cache=False,
    )
    llama = transformers.LlamaForCausalLM(config)
    llama.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False} if how == "hf-non-reentrant" else None
    )
    return llama, llama.model.layers[0]


def lm_loss(model: nn.Module, batch: Tensor) -> Tensor:
    output = model(batch[:, :-1])
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


class Counted:
    """How often a block's forward ran (twice a step when it is recomputed in backward)."""

    def __init__(self, block: nn.Module) -> None:
        self.calls = 0
        block.register_forward_pre_hook(self.count)

    def count(self, *_: Any) -> None:
        self.calls += 1


class Steps(Dataset[tuple[Tensor, int]]):
    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, step: int) -> tuple[Tensor, int]:
        return tokens(step), step


class LanguageModel(pl.LightningModule):
    def __init__(self, model: nn.Module, overflow: bool) -> None:
        super().__init__()
        self.model, self.overflow = model, overflow

    def training_step(self, batch: tuple[Tensor, int], _index: int) -> Tensor:
        loss = lm_loss(self.model, batch[0])
        return loss * math.inf if self.overflow and batch[1] == OVERFLOW else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


def trainer_run(plugin: Any, model: nn.Module, overflow: bool) -> None:
    given = {"precision": "bf16-mixed"} if plugin is None else {}
    trainer = make_trainer(plugin, max_steps=STEPS, **given)
    trainer.fit(LanguageModel(model, overflow), DataLoader(Steps(), batch_size=None))


def fabric_run(plugin: Any, model: nn.Module, overflow: bool) -> None:
    fabric = L.Fabric(
        accelerator="cpu", devices=1, **({"precision": "bf16-mixed"} if plugin is None else {"plugins": [plugin]})
    )
    wrapped, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    for step in range(STEPS):
        loss = lm_loss(wrapped, tokens(step))
        fabric.backward(loss * math.inf if overflow and step == OVERFLOW else loss)
        optimizer.step()
        optimizer.zero_grad()


FRONTS: dict[str, Callable[[Any, nn.Module, bool], None]] = {"trainer": trainer_run, "fabric": fabric_run}
HOW = ["hf-reentrant", "hf-non-reentrant", "litgpt-wrapper"]


def plugins(front: str, precision: str) -> tuple[Any, Any]:
    """Ours and the built-in one at ``precision`` (``16-mixed``: ours with FP32 master weights), scalers alike."""
    options = {"master_weights": True} if precision == "16-mixed" else {}
    if front == "trainer":
        return our_plugin(precision, **options), lightning_plugin(precision)
    return ours(precision, **options), fabrics(precision)


def run(front: str, how: str, plugin: Any, overflow: bool, convert: bool = False) -> tuple[nn.Module, int]:
    """One run: the model checkpointed ``how`` (converted by torchao first if ``convert``), and its block's calls."""
    model, block = build(how)
    if convert:
        torchao_reference("tensorwise", model)
    counted = Counted(block)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*bfloat16 Automatic Mixed Precision.*")
        FRONTS[front](plugin, model, overflow)
    return model, counted.calls


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("front", sorted(FRONTS))
def test_a_checkpointed_model_steps_as_under_the_built_in_plugin_bit_for_bit(
    front: str, how: str, precision: str
) -> None:
    mine, theirs = plugins(front, precision)
    overflow = precision == "16-mixed"
    reference, _ = run(front, how, theirs, overflow)
    ours, calls = run(front, how, mine, overflow)
    assert calls == 2 * STEPS  # premise: each step's forward ran again in its backward
    assert_same_parameters(ours, reference)
    assert mine.skipped_steps == int(overflow)
    if overflow:
        assert mine.scaler.get_scale() == theirs.scaler.get_scale() == START_SCALE / 2


# 10-30 s a case on 2 shared cores (FP8 emulated on CPU, each block run twice): the integration tier, two cases.
@pytest.mark.integration
@pytest.mark.parametrize(("front", "how"), [("fabric", "hf-reentrant"), ("trainer", "litgpt-wrapper")])
def test_fp8_mixed_on_a_checkpointed_model_equals_torchaos_recipe_bit_for_bit(front: str, how: str) -> None:
    pytest.importorskip("torchao.float8", reason="fp8-mixed needs torchao (the fp8 extra)")
    plugin_class = amp_fabric.MixedPrecisionPlugin if front == "fabric" else MixedPrecisionPlugin
    plugin = plugin_class("fp8-mixed", fp8_check_interval=2)
    reference, _ = run(front, how, None, overflow=False, convert=True)
    ours, calls = run(front, how, plugin, overflow=False)
    assert calls == 2 * STEPS and len(plugin.fp8.layers) == (9 if how == "litgpt-wrapper" else 15)
    assert [check.step for check in plugin.fp8.checks] == [0, 2] and plugin.skipped_steps == 0
    assert_same_parameters(ours, reference)


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for mine, theirs in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
