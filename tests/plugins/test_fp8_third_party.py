"""``"fp8-mixed"`` inside the third-party models users train: what converts, and the numbers against torchao's path.

* litgpt's GPT in litgpt's own pretraining loop under Fabric (gradient accumulation, ``fabric.clip_gradients``, its LR
  schedule: ``test_fabric_litgpt.pretrain``) and in a LightningModule under the Trainer with Lightning's gradient
  accumulation and clipping: all 9 Linear layers convert, and the parameters equal those of torchao's
  ``convert_to_float8_training`` (same config, same filter) under Fabric's / Lightning's built-in ``bf16-mixed``, bit
  for bit.
* transformers' GPT-2 (``GPT2LMHeadModel`` from a tiny ``GPT2Config``): its attention and MLP compute in ``Conv1D``,
  which is not an ``nn.Linear``: only ``lm_head`` (tied to the token embedding) converts, a warning names the 8
  ``Conv1D`` layers that stay in bf16, and a filter that leaves out ``lm_head`` leaves no FP8 layer, which a warning
  says. The run equals torchao's own path bit for bit.
* litgpt's LoRA GPT (``litgpt.lora``, adapters on every projection and the head, the base frozen): the frozen base
  ``nn.Linear`` inside each ``LoRALinear`` and ``LoRAQKVLinear`` converts (9 layers), the adapters (``lora_A``,
  ``lora_B``: Parameters in a plain matmul) stay in bf16 autocast; bit for bit torchao's path, the base weights
  unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from fabric_loops import fabrics
from fp8_models import CONFIG, CPU_EMULATED, LINEARS, LR, GPTModule, assert_same_parameters, loader, tokens
from helpers import make_trainer
from lightning.fabric.plugins.precision import Precision
from torch import nn

pytest.importorskip("torchao.float8", reason="fp8-mixed needs torchao (the fp8 extra)")
litgpt = pytest.importorskip("litgpt", reason="litgpt's GPT and LoRA")
transformers = pytest.importorskip("transformers", reason="transformers' GPT-2")

from test_fabric_litgpt import MAX_NORM, assert_same, pretrain  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

import lightning_amp_plus.fabric as amp_fabric  # noqa: E402
from lightning_amp_plus import MixedPrecisionPlugin  # noqa: E402
from lightning_amp_plus.weights.fp8 import eligible  # noqa: E402

pytestmark = pytest.mark.filterwarnings(CPU_EMULATED)

STEPS = 3
GPT2_CONV1D = 8  # per block attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj


def torchao_convert(model: nn.Module) -> None:
    """torchao's own conversion, with the plugin's default config (tensorwise) and its filter."""
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    convert_to_float8_training(model, config=config, module_filter_fn=eligible)


def fabric_loop(
    plugin: Precision, build: Callable[[], nn.Module], loss: Callable[[nn.Module, int], torch.Tensor]
) -> nn.Module:
    """``STEPS`` AdamW steps over the trainable parameters, under ``fabric.setup``."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(build())
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(trainable, lr=LR, weight_decay=0.1))
    for step in range(STEPS):
        fabric.backward(loss(model, step))
        optimizer.step()
        optimizer.zero_grad()
    return model


def reference(build: Callable[[], nn.Module], loss: Callable[[nn.Module, int], torch.Tensor]) -> nn.Module:
    def converted() -> nn.Module:
        model = build()
        torchao_convert(model)
        return model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*bfloat16 Automatic Mixed Precision.*")
        return fabric_loop(fabrics("bf16-mixed"), converted, loss)


# ---------------------------------------------------------------------------------------------------------- litgpt
def test_litgpts_pretraining_loop_in_fp8_mixed_equals_torchao_under_fabrics_bf16_mixed_bit_for_bit() -> None:
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=2)
    norms, mine = pretrain(plugin)
    their_norms, theirs = pretrain(fabrics("bf16-mixed"), prepare=torchao_convert)
    assert_same(mine, theirs, "fp8-mixed in litgpt's loop")
    assert norms == their_norms and all(norm > MAX_NORM for norm in norms)  # every step clipped, by the same norm
    assert len(plugin.fp8.layers) == LINEARS and plugin.skipped_steps == 0
    assert [check.step for check in plugin.fp8.checks] == [0, 2]  # a check step's micro-batches read together


def test_litgpts_gpt_under_the_trainer_with_accumulation_and_clipping_equals_torchao_bit_for_bit() -> None:
    features = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5, "max_steps": STEPS}
    theirs = GPTModule("tensorwise")
    make_trainer(precision="bf16-mixed", **features).fit(theirs, loader(range(2 * STEPS)))
    plugin = MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=2)
    mine = GPTModule()
    make_trainer(plugins=[plugin], **features).fit(mine, loader(range(2 * STEPS)))
    assert len(plugin.fp8.layers) == LINEARS and len(plugin.recent_steps) == STEPS
    assert [check.step for check in plugin.fp8.checks] == [0, 2]
    assert_same_parameters(mine, theirs, "under accumulation and clipping")


# ---------------------------------------------------------------------------------------------------------- GPT-2
def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, n_positions=CONFIG["block_size"], vocab_size=CONFIG["vocab_size"]
    )
    return transformers.GPT2LMHeadModel(config)


def gpt2_loss(model: nn.Module, step: int) -> torch.Tensor:
    batch = tokens(step)[:, :-1]  # GPT-2 shifts the labels itself
    return model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]


CONV1D_STAY = (
    r"1 layer\(s\) of the model train in FP8 \(lm_head\); 8 layers with a weight matrix are not exactly nn\.Linear "
    r"and compute in bf16: 8 Conv1D \(transformer\.h\.0\.attn\.c_attn, transformer\.h\.0\.attn\.c_proj, "
    r"transformer\.h\.0\.mlp\.c_fc, \.\.\.\) \(torchao converts nn\.Linear layers only\)"
)


def test_gpt2_converts_only_its_lm_head_names_the_conv1d_layers_and_equals_torchao_bit_for_bit() -> None:
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1)
    with pytest.warns(UserWarning, match=CONV1D_STAY):
        mine = fabric_loop(plugin, gpt2, gpt2_loss)
    assert list(plugin.fp8.layers) == ["lm_head"] and type(mine.lm_head) is Float8Linear
    conv1d = [m for m in mine.modules() if type(m).__name__ == "Conv1D"]
    assert len(conv1d) == GPT2_CONV1D and not any(isinstance(m, Float8Linear) for m in conv1d)
    assert mine.lm_head.weight is mine.transformer.wte.weight  # still tied: the same Parameter
    assert {reading.layer for check in plugin.fp8.checks for reading in check.readings} == {"lm_head"}
    theirs = reference(gpt2, gpt2_loss)
    assert_same_parameters(mine, theirs, f"GPT-2 after {STEPS} steps")


def test_gpt2_without_its_lm_head_has_no_fp8_layer_and_a_warning_says_so() -> None:
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_modules=lambda module, name: name != "lm_head")
    message = (
        r"No layer of the model trains in FP8: the fp8_modules filter accepted none of the 1 eligible Linear layers\. "
        r"Its 8 layers with a weight matrix that are not exactly nn\.Linear never convert: 8 Conv1D"
    )
    with pytest.warns(UserWarning, match=message):
        L.Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(gpt2())
    assert plugin.fp8.layers == {}


# ----------------------------------------------------------------------------------------------------------- LoRA
def lora_gpt() -> nn.Module:
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    torch.manual_seed(0)
    adapters = {f"lora_{where}": True for where in ("query", "key", "value", "projection", "mlp", "head")}
    model = GPT(Config(**CONFIG, lora_r=4, lora_alpha=8, **adapters))
    mark_only_lora_as_trainable(model)
    with torch.no_grad():  # lora_B starts at zero: make the adapters contribute from the first step
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.normal_(std=0.02)
    return model


def lm_loss(model: nn.Module, step: int) -> torch.Tensor:
    batch = tokens(step)
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, CONFIG["vocab_size"]), batch[:, 1:].reshape(-1))


def test_lora_converts_the_frozen_base_linears_keeps_the_adapters_in_bf16_and_equals_torchao_bit_for_bit() -> None:
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1)
    before = {name: p.detach().clone() for name, p in lora_gpt().named_parameters()}
    mine = fabric_loop(plugin, lora_gpt, lm_loss)
    assert sorted(plugin.fp8.layers) == sorted(
        f"{name}.linear"
        for name, m in mine.module.named_modules()
        if hasattr(m, "lora_A")  # LoRA(QKV)Linear
    )
    assert len(plugin.fp8.layers) == LINEARS
    assert all(not layer.weight.requires_grad for layer in plugin.fp8.layers.values())  # the frozen base
    after = dict(mine.module.named_parameters())
    for name, value in before.items():
        changed = not torch.equal(after[name], value)
        assert changed == ("lora_" in name), f"{name}: {'changed' if changed else 'unchanged'}"
    theirs = reference(lora_gpt, lm_loss)
    assert_same_parameters(mine, theirs, f"LoRA after {STEPS} steps")


def test_hooks_registered_on_a_linear_before_set_up_still_run_under_both_front_ends() -> None:
    calls: dict[str, list[str]] = {"trainer": [], "fabric": []}

    def hooked(front_end: str) -> Callable[[nn.Module], Any]:
        def register(model: nn.Module) -> Any:
            layer = model.get_submodule("transformer.h.1.mlp.fc")
            layer.register_forward_hook(lambda module, _args, _out: calls[front_end].append(type(module).__name__))
            return model

        return register

    module = GPTModule()
    hooked("trainer")(module.gpt)
    make_trainer(plugins=[MixedPrecisionPlugin("fp8-mixed")], max_steps=2).fit(module, loader(range(2)))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[amp_fabric.MixedPrecisionPlugin("fp8-mixed")])
    model = fabric.setup_module(hooked("fabric")(litgpt.GPT(litgpt.Config(**CONFIG))))
    model(tokens(0)[:, :-1])
    assert calls == {"trainer": ["Float8Linear"] * 2, "fabric": ["Float8Linear"]}  # the converted layer's forwards
