"""What the ``"fp8-mixed"`` tests share: litgpt's tiny GPT, token batches, a LightningModule over it, torchao's path.

The model is litgpt's GPT as its users build it, 2 layers and 64 wide: 9 Linear layers, all eligible for FP8 (both
weight dimensions divisible by 16); :func:`llama` is the same GPT shaped as a Llama (RMSNorm, SwiGLU MLP, grouped
queries, no biases: 11 Linear layers), as torchtitan trains it. The reference is torchao's own
``convert_to_float8_training`` with the same config and filter, trained under Lightning's or Fabric's own
``bf16-mixed``. torchao and litgpt are imported by the tests
that use this module, after their ``importorskip``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

CONFIG = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32, "vocab_size": 64, "padded_vocab_size": 64}
LINEARS = 9  # per block qkv, proj, mlp.fc, mlp.proj; and lm_head
LLAMA = {
    **CONFIG,
    "n_query_groups": 1,
    "bias": False,
    "norm_class_name": "RMSNorm",
    "mlp_class_name": "LLaMAMLP",
    "intermediate_size": 128,
    "parallel_residual": False,
    "rotary_percentage": 1.0,
}
LLAMA_LINEARS = 11  # per block qkv, proj, mlp.fc_1, mlp.fc_2, mlp.proj; and lm_head
FIRST_LAYERS = ("transformer.h.0.attn.qkv", "transformer.h.0.attn.proj", "transformer.h.0.mlp.fc")
LAYER = "transformer.h.0.mlp.proj"  # where a NaN or an outlier is put
# The plugin warns once that FP8 is emulated on CPU; the tests run there on purpose (one test expects the warning).
CPU_EMULATED = r"ignore:.*\('fp8-mixed'\) on CPU. torch emulates:UserWarning"
LR = 3e-3
# torchao 0.18 casts a layer's input only under CUDA autocast: on CPU rowwise_with_gw_hp's bf16 weight-gradient GEMM
# then meets an FP32 input and fails; its reference casts the input as CUDA autocast does (as the plugin does).
RUNS_ON_CPU_UNDER_TORCHAO = ("tensorwise", "rowwise")


def gpt(seed: int = 0) -> nn.Module:
    import litgpt

    torch.manual_seed(seed)
    return litgpt.GPT(litgpt.Config(**CONFIG))


def llama(seed: int = 0) -> nn.Module:
    import litgpt

    torch.manual_seed(seed)
    return litgpt.GPT(litgpt.Config(**LLAMA))


def tokens(step: int, batch: int = 4) -> Tensor:
    """``batch`` sequences of ``block_size + 1`` tokens (inputs and targets), the same for a given step."""
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, CONFIG["vocab_size"], (batch, CONFIG["block_size"] + 1), generator=generator)


def lm_loss(model: nn.Module, batch: Tensor) -> Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, CONFIG["vocab_size"]), batch[:, 1:].reshape(-1))


def cast_input_as_cuda_autocast_does(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """torchao's ``Float8Linear.forward`` under CUDA autocast: ``input.to(autocast dtype)``, here for CPU's."""
    return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:]) if torch.is_autocast_enabled("cpu") else args


def torchao_reference(recipe: str, model: nn.Module) -> nn.Module:
    """torchao's own conversion, same config and filter (the input cast of CUDA autocast for rowwise_with_gw_hp)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    from lightning_amp_plus.weights.fp8 import eligible

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=eligible)
    if recipe not in RUNS_ON_CPU_UNDER_TORCHAO:
        for module in model.modules():
            if isinstance(module, Float8Linear):
                module.register_forward_pre_hook(cast_input_as_cuda_autocast_does)
    return model


class Faults:
    """Puts a NaN (or an outlier) into one layer's input on the batches asked for; a hook registered before any
    conversion (the conversion carries it over)."""

    def __init__(self, layer: nn.Module, value: float = float("nan"), factor: float | None = None) -> None:
        self.value, self.factor, self.on = value, factor, False
        layer.register_forward_pre_hook(self._hook)

    def _hook(self, _module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...] | None:
        if not self.on:
            return None
        x = args[0].clone()
        if self.factor is None:
            x[1, 5, 7] = self.value
        else:
            x[:, 3] *= self.factor  # one token of every sequence
        return (x, *args[1:])


class Batches(Dataset[tuple[Tensor, int]]):
    """The token batches of the given steps (one sample is one whole batch), with the step number."""

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = list(steps)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return tokens(self.steps[index]), self.steps[index]


def loader(steps: Iterable[int]) -> DataLoader[Any]:
    return DataLoader(Batches(steps), batch_size=None, shuffle=False)


class GPTModule(pl.LightningModule):
    """The GPT under the Trainer (``build``: :func:`gpt` or :func:`llama`); ``recipe`` converts it with torchao first
    (the reference); ``faulty`` are the steps whose batch gets a NaN (or, with ``factor``, an outlier) at
    :data:`LAYER`'s input."""

    def __init__(
        self,
        recipe: str | None = None,
        faulty: Iterable[int] = (),
        factor: float | None = None,
        seed: int = 0,
        build: Callable[[int], nn.Module] = gpt,
    ) -> None:
        super().__init__()
        self.gpt = build(seed)
        self.faults = Faults(self.gpt.get_submodule(LAYER), factor=factor)
        self.faulty = set(faulty)
        self.converted_when_optimizers_were_made: bool | None = None
        if recipe is not None:
            torchao_reference(recipe, self.gpt)

    def training_step(self, batch: tuple[Tensor, int], _index: int) -> Tensor:
        tokens_, step = batch
        self.faults.on = int(step) in self.faulty
        return lm_loss(self.gpt, tokens_)

    def validation_step(self, batch: tuple[Tensor, int], _index: int) -> Tensor:
        loss = lm_loss(self.gpt, batch[0])
        self.log("val_loss", loss, batch_size=len(batch[0]))
        return loss

    def test_step(self, batch: tuple[Tensor, int], _index: int) -> Tensor:
        loss = lm_loss(self.gpt, batch[0])
        self.log("test_loss", loss, batch_size=len(batch[0]))
        return loss

    def predict_step(self, batch: tuple[Tensor, int], _index: int) -> Tensor:
        return self.gpt(batch[0][:, :-1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        from torchao.float8.float8_linear import Float8Linear

        self.converted_when_optimizers_were_made = isinstance(self.gpt.lm_head, Float8Linear)
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


def assert_same_parameters(ours: nn.Module, reference: nn.Module, what: str) -> None:
    pairs = list(zip(ours.named_parameters(), reference.named_parameters(), strict=True))
    for (name, a), (_, b) in pairs:
        assert torch.equal(a, b), f"{what}: {name} differs"
