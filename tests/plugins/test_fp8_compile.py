"""``"fp8-mixed"`` under ``torch.compile``, against torchao's own compiled path: graphs, graph breaks, the numbers.

The reference is torchao's ``convert_to_float8_training`` (same config, same filter) under Lightning's (Fabric's) own
``bf16-mixed``, compiled the same way; the model litgpt's GPT shaped as a Llama (:func:`fp8_models.llama`), 4-5 steps.
Graphs and breaks are dynamo's own counts (``torch._dynamo.utils.counters``): ``stats/unique_graphs``, every graph
dynamo made (first compilations and recompilations alike), and ``graph_break``.

* Graphs and breaks, and the numbers bit for bit, with the ``aot_eager`` backend (dynamo and AOT autograd as inductor
  gets them, eager kernels): no break, one graph more than torchao's (the check step's), none recompiled after.
* Compiled block by block (torchtitan's way, ``fullgraph=True``): the blocks share their graphs, as torchao's do
  (one more, the check step's), no break, torchao's numbers bit for bit, the layers read in the forward order.
* Under inductor, where fusion decides the rounding: the ordinary steps equal torchao's compiled path bit for bit;
  the check steps' readings change how inductor fuses the step's kernels, by less than torchao's compiled path differs
  from its own eager one (the suite runs one intra-op thread, which makes inductor's CPU reductions deterministic).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from fp8_models import CPU_EMULATED, LLAMA_LINEARS, LR, GPTModule, llama, lm_loss, loader, tokens, torchao_reference
from helpers import make_trainer
from torch import nn
from torch._dynamo.utils import counters

pytest.importorskip("torchao.float8", reason="fp8-mixed needs torchao (the fp8 extra)")
pytest.importorskip("litgpt", reason="the model is litgpt's GPT")

import lightning_amp_plus.fabric as amp_fabric
from lightning_amp_plus import MixedPrecisionPlugin
from lightning_amp_plus.weights.fp8 import FP8Training

pytestmark = pytest.mark.filterwarnings(CPU_EMULATED)

STEPS = 5  # checks at steps 0, 2 and 4: the check step's graph is met again after an ordinary one
INTERVAL = 2


@contextmanager
def compiling() -> Iterator[None]:
    """Dynamo's caches and counters cleared first."""
    torch._dynamo.reset()
    counters.clear()
    yield


def compiled() -> dict[str, int]:
    return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


class LlamaModule(GPTModule):
    """The Llama-shaped GPT under the Trainer; its step reads only the tokens (a step number read in the compiled step
    would be a constant to dynamo, and each new one a recompilation of its own)."""

    def training_step(self, batch: tuple[torch.Tensor, int], _index: int) -> torch.Tensor:
        return lm_loss(self.gpt, batch[0])


def trainer_fit(backend: str | None, ours: bool, steps: int = STEPS) -> tuple[nn.Module, dict[str, int], Any]:
    """A Trainer fit of the Llama-shaped GPT, compiled with ``backend`` (``None``: eager), ours or torchao's."""
    module = LlamaModule(None if ours else "tensorwise", build=llama)
    plugin = MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=INTERVAL) if ours else None
    given: dict[str, Any] = {"plugins": [plugin]} if ours else {"precision": "bf16-mixed"}
    with compiling(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*bfloat16 Automatic Mixed Precision.*")
        model = module if backend is None else torch.compile(module, backend=backend)
        make_trainer(max_steps=steps, **given).fit(model, loader(range(steps)))
        return module, compiled(), plugin


def fabric_loop(backend: str, ours: bool) -> tuple[nn.Module, dict[str, int], Any]:
    """litgpt's way: the model compiled, then ``fabric.setup`` (which compiles what it wraps again, alike)."""
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=INTERVAL) if ours else None
    given: dict[str, Any] = {"plugins": [plugin]} if ours else {"precision": "bf16-mixed"}
    with compiling(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*bfloat16 Automatic Mixed Precision.*")
        fabric = L.Fabric(accelerator="cpu", devices=1, **given)
        model = llama() if ours else torchao_reference("tensorwise", llama())
        wrapped = fabric.setup_module(torch.compile(model, backend=backend))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(wrapped.parameters(), lr=LR, weight_decay=0.1))
        for step in range(STEPS):
            fabric.backward(lm_loss(wrapped, tokens(step)))
            optimizer.step()
            optimizer.zero_grad()
        return model, compiled(), plugin


# ---------------------------------------------------------------------------------------------- graphs and breaks
def test_a_compiled_trainer_fit_breaks_no_graph_adds_one_for_the_check_step_and_equals_torchao_bit_for_bit() -> None:
    reference, theirs, _ = trainer_fit("aot_eager", ours=False)
    ours, mine, plugin = trainer_fit("aot_eager", ours=True)
    assert theirs == {"graphs": 1, "breaks": 0}  # premise: torchao's compiled path
    assert mine == {"graphs": theirs["graphs"] + 1, "breaks": 0}  # the check step's, compiled once for 3 check steps
    assert len(plugin.fp8.layers) == LLAMA_LINEARS and [check.step for check in plugin.fp8.checks] == [0, 2, 4]
    assert max_difference(ours, reference) == 0.0


def test_a_compiled_fabric_loop_breaks_no_graph_adds_one_for_the_check_step_and_equals_torchao_bit_for_bit() -> None:
    reference, theirs, _ = fabric_loop("aot_eager", ours=False)
    ours, mine, plugin = fabric_loop("aot_eager", ours=True)
    assert theirs == {"graphs": 1, "breaks": 0}
    assert mine == {"graphs": theirs["graphs"] + 1, "breaks": 0}
    assert [check.step for check in plugin.fp8.checks] == [0, 2, 4]
    assert max_difference(ours, reference) == 0.0


# ------------------------------------------------------------------------------------------------------- inductor
def plain_loop(compile_it: bool, fp8: FP8Training | None) -> nn.Module:
    """torchao's recipe as its documentation runs it (bf16 autocast, AdamW), or ours with ``fp8`` (no check step)."""
    model = llama()
    if fp8 is None:
        torchao_reference("tensorwise", model)
    else:
        fp8.convert(model)
    forward = torch.compile(model, backend="inductor") if compile_it else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(4):
        batch = tokens(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = forward(batch[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        if fp8 is not None:
            fp8.end_step()
    return model


# Inductor compiles C++ kernels in subprocesses (g++): 75 s and 120 s on 2 shared cores with its cache cold, 10-30 s
# warm: the integration tier.
@pytest.mark.integration
def test_under_inductor_the_ordinary_steps_equal_torchaos_compiled_path_bit_for_bit() -> None:
    # The non-finite flags and the probes compile into the graph and leave inductor's kernels as torchao's.
    torch._dynamo.reset()
    reference = plain_loop(True, None)
    torch._dynamo.reset()
    ours = plain_loop(True, FP8Training("tensorwise", fallback=None))
    assert max_difference(ours, reference) == 0.0


@pytest.mark.integration
def test_under_inductor_a_trainer_fit_with_check_steps_stays_within_torchaos_compiled_versus_eager_difference() -> None:
    # The check step's readings consume the casts' operands, which changes how inductor fuses that step's kernels.
    eager, _, _ = trainer_fit(None, ours=False, steps=4)
    reference, theirs, _ = trainer_fit("inductor", ours=False, steps=4)
    ours, mine, _ = trainer_fit("inductor", ours=True, steps=4)
    assert mine == {"graphs": theirs["graphs"] + 1, "breaks": 0}
    compile_difference = max_difference(reference, eager)
    assert max_difference(ours, reference) <= compile_difference


# ------------------------------------------------------------------------------------------------ block by block
BLOCKS = 5  # before, each block compiled two graphs of its own: 10, past dynamo's default recompile_limit (8)


def fabric_loop_block_by_block(ours: bool) -> tuple[nn.Module, dict[str, int], Any]:
    """torchtitan's way: each block compiled on its own with ``fullgraph=True``, the rest of the model eager."""
    import litgpt
    from fp8_models import LLAMA

    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=INTERVAL) if ours else None
    given: dict[str, Any] = {"plugins": [plugin]} if ours else {"precision": "bf16-mixed"}
    torch.manual_seed(0)
    model = litgpt.GPT(litgpt.Config(**{**LLAMA, "n_layer": BLOCKS}))
    with compiling(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*bfloat16 Automatic Mixed Precision.*")
        # Dynamo's own look at a block's input when it traces a block called from eager code (torch 2.14).
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor")
        fabric = L.Fabric(accelerator="cpu", devices=1, **given)
        wrapped = fabric.setup_module(model if ours else torchao_reference("tensorwise", model))
        blocks = model.transformer.h
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(wrapped.parameters(), lr=LR, weight_decay=0.1))
        for step in range(3):  # a check step, an ordinary one, a check step again
            fabric.backward(lm_loss(wrapped, tokens(step)))
            optimizer.step()
            optimizer.zero_grad()
        return model, compiled(), plugin


@pytest.mark.integration  # 25-28 s on 2 shared cores
def test_compiled_block_by_block_the_blocks_share_their_graphs_and_equal_torchao_bit_for_bit() -> None:
    # Before, each layer's hooks noted its place in the forward order when dynamo traced them, and its forward hook ran
    # even when the forward raised: dynamo guarded both on the layer, each block compiled two graphs of its own, and
    # past four blocks fullgraph=True failed (FailOnRecompileLimitHit). Now the order is stamped on the device.
    reference, theirs, _ = fabric_loop_block_by_block(ours=False)
    ours, mine, plugin = fabric_loop_block_by_block(ours=True)
    assert theirs == {"graphs": 1, "breaks": 0}
    assert mine == {"graphs": theirs["graphs"] + 1, "breaks": 0}  # the check step's, shared by the blocks too
    read = list(dict.fromkeys(reading.layer for reading in plugin.fp8.checks[-1].readings))
    forward = ("attn.qkv", "attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj")
    assert read == [f"transformer.h.{i}.{layer}" for i in range(BLOCKS) for layer in forward] + ["lm_head"]
    assert max_difference(ours, reference) == 0.0
