"""``"fp8-mixed"`` on 2 CPU processes over gloo: DDP and FSDP2 (``ModelParallelStrategy``), the Trainer and Fabric.

One pool of worker processes (:mod:`launch`) runs every scenario; each rank trains litgpt's tiny GPT
(:mod:`fp8_models`) on batches of its own, and the tests compare what the ranks recorded.

* DDP: an activation outlier in ONE rank's batches: the readings are reduced across the ranks (both read the same
  shares), both fall back the same layer at the same step, and the replicas stay equal; a NaN in one rank's batch: the
  step is skipped on both ranks, both name the FP8 layer where it started, and the replicas stay equal and finite.
* FSDP2 (``fully_shard(..., mp_policy=plugin.mp_policy)``; under the Trainer the LightningModule converts in
  ``configure_model`` with ``plugin.fp8.convert(self)`` before sharding, under Fabric the plugin converts at
  ``fabric.setup`` before the strategy shards): the shards after the run equal those of torchao's own
  ``convert_to_float8_training`` sharded the same way under Lightning's (Fabric's) built-in ``bf16-mixed``, bit for
  bit, for tensorwise, and for FP8 all-gather (``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``), where the
  plugin calls torchao's ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step itself (counted) as
  the reference loop does; a NaN in one rank's batch: the step is skipped on both ranks (each rank's shards untouched),
  both name the FP8 layer where it started from their own shards' flags, and the shards stay finite.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
from fp8_models import LAYER, LINEARS, LR, Faults, GPTModule, gpt, llama, lm_loss, tokens
from launch import WORLD, run_pool, scenario
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

pytest.importorskip("torchao.float8", reason="fp8-mixed needs torchao (the fp8 extra)")
pytest.importorskip("litgpt", reason="the model is litgpt's GPT")

import lightning_amp_plus.fabric as amp_fabric
from lightning_amp_plus import MixedPrecisionPlugin

pytestmark = pytest.mark.integration  # starts a pool of processes

FAULT_RANK = 1
STEPS = 4
NAN_STEP = 2
OUTLIER = 1e4


# ------------------------------------------------------------------------------------------------ the data
def rank_tokens(step: int, rank: int) -> Tensor:
    return tokens(step + 1000 * rank)  # every rank its own batches


class RankBatches(Dataset[tuple[Tensor, int]]):
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> tuple[Tensor, int]:
        return rank_tokens(step, torch.distributed.get_rank()), step


def rank_loader(steps: int) -> DataLoader[Any]:
    return DataLoader(RankBatches(steps), batch_size=None, shuffle=False)


def trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": WORLD,
        "strategy": strategy,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "max_epochs": 1,
        "use_distributed_sampler": False,  # the batches are the rank's own already
    }
    return pl.Trainer(**{**options, **kwargs})


def plain(tensor: Tensor) -> Tensor:
    """This rank's piece of a parameter as a plain tensor (a shard under FSDP2, unwrapped from torchao's subclass)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return getattr(local, "_tensor", local).detach().clone()  # FP8 all-gather wraps the shard in a tensor subclass


def pieces(module: nn.Module) -> dict[str, Tensor]:
    return {name: plain(p) for name, p in module.named_parameters()}


def fp8_record(plugin: Any) -> dict[str, Any]:
    return {
        "layers": sorted(plugin.fp8.layers),
        "fallen_back": plugin.fp8.fallen_back,
        "checks": [
            (check.step, check.fell_back, [(r.layer, r.cast, r.flushed_pct) for r in check.readings])
            for check in plugin.fp8.checks
        ],
        "skipped": [result.skipped for result in plugin.recent_steps],
        "nonfinite": plugin.fp8.nonfinite_layers() if plugin.skipped_steps else [],
    }


# ------------------------------------------------------------------------------------------------------ DDP
class RankGPT(GPTModule):
    """The GPT whose ``faulty`` steps put the fault into :data:`LAYER`'s input on :data:`FAULT_RANK` only."""

    def training_step(self, batch: tuple[Tensor, int], _index: int) -> Tensor:
        tokens_, step = batch
        self.faults.on = int(step) in self.faulty and self.global_rank == FAULT_RANK
        return lm_loss(self.gpt, tokens_)


def trainer_ddp(faulty: tuple[int, ...], factor: float | None) -> dict[str, Any]:
    plugin = MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1)
    module = RankGPT(faulty=faulty, factor=factor)
    trainer("ddp", plugins=[plugin]).fit(module, rank_loader(STEPS))
    return {**fp8_record(plugin), "params": pieces(module)}


def fabric_ddp(faulty: tuple[int, ...], factor: float | None) -> dict[str, Any]:
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy="ddp", plugins=[plugin])
    fabric.launch()
    model = gpt()
    faults = Faults(model.get_submodule(LAYER), factor=factor)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    for step in range(STEPS):
        faults.on = step in faulty and fabric.global_rank == FAULT_RANK
        fabric.backward(lm_loss(model, rank_tokens(step, fabric.global_rank)))
        optimizer.step()
        optimizer.zero_grad()
    return {**fp8_record(plugin), "params": pieces(model)}


def fabric_ddp_watching() -> list[str]:
    """``fp8_fallback=None`` and the outlier in rank 1's batches: the warnings this rank gave."""
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1, fp8_fallback=None)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy="ddp", plugins=[plugin])
    fabric.launch()
    model = gpt()
    Faults(model.get_submodule(LAYER), factor=OUTLIER).on = fabric.global_rank == FAULT_RANK
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            fabric.backward(lm_loss(model, rank_tokens(step, fabric.global_rank)))
            optimizer.step()
            optimizer.zero_grad()
    return [str(w.message) for w in caught if str(w.message).startswith("FP8 layer")]


def ddp(out: Path) -> dict[str, Any]:
    runs: dict[str, Any] = {
        f"{front_end}/{fault}": run(faulty, factor)
        for front_end, run in (("trainer", trainer_ddp), ("fabric", fabric_ddp))
        for fault, faulty, factor in (("outlier", tuple(range(STEPS)), OUTLIER), ("nan", (NAN_STEP,), None))
    }
    return {**runs, "watching": fabric_ddp_watching()}


# ---------------------------------------------------------------------------------------------------- FSDP2
def recipe_config(all_gather: bool) -> Any:
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(enable_fsdp_float8_all_gather=True) if all_gather else "tensorwise"


def torchao_convert(model: nn.Module, all_gather: bool) -> None:
    """torchao's own conversion, with the config and filter the plugin uses."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_amp_plus.weights.fp8 import eligible

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True) if all_gather else Float8LinearConfig()
    convert_to_float8_training(model, config=config, module_filter_fn=eligible)


def half_policy() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # plugin.mp_policy's


def shard_gpt(model: nn.Module, mesh: Any) -> nn.Module:
    """Each block, then the root, as litgpt shards its GPT under FSDP."""
    from torch.distributed.fsdp import fully_shard

    transformer: Any = model.transformer
    for block in transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=half_policy())
    return fully_shard(model, mesh=mesh, mp_policy=half_policy())


class ShardedGPT(RankGPT):
    """Under ``ModelParallelStrategy``: ours converts through the plugin in ``configure_model``, then shards.

    ``reference``: converted by torchao itself (at construction), sharded the same way, and torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` called after each optimizer step as its documentation asks.
    """

    def __init__(self, all_gather: bool, reference: bool) -> None:
        super().__init__()
        self.all_gather, self.reference = all_gather, reference
        if reference:
            torchao_convert(self.gpt, all_gather)

    def configure_model(self) -> None:
        if not self.reference:
            plugin = self.trainer.precision_plugin
            assert isinstance(plugin, MixedPrecisionPlugin) and plugin.fp8 is not None
            plugin.fp8.convert(self)  # torchao converts before sharding
        shard_gpt(self.gpt, self.device_mesh["data_parallel"])

    def on_train_batch_end(self, *_: Any) -> None:
        if self.reference and self.all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.gpt)


class PrecomputeCalls:
    """Counts the calls of torchao's ``precompute_float8_dynamic_scale_for_fsdp`` (as the plugin imports it)."""

    def __enter__(self) -> PrecomputeCalls:
        import torchao.float8

        self.calls = 0
        self.original = torchao.float8.precompute_float8_dynamic_scale_for_fsdp

        def counted(module: nn.Module) -> None:
            self.calls += 1
            self.original(module)

        torchao.float8.precompute_float8_dynamic_scale_for_fsdp = counted
        return self

    def __exit__(self, *_: object) -> None:
        import torchao.float8

        torchao.float8.precompute_float8_dynamic_scale_for_fsdp = self.original


def model_parallel() -> ModelParallelStrategy:
    return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)


def trainer_fsdp2(all_gather: bool) -> dict[str, Any]:
    reference = ShardedGPT(all_gather, reference=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(model_parallel(), precision="bf16-mixed").fit(reference, rank_loader(STEPS))
    plugin = MixedPrecisionPlugin("fp8-mixed", fp8_recipe=recipe_config(all_gather), fp8_fallback=None)
    ours = ShardedGPT(all_gather, reference=False)
    with PrecomputeCalls() as calls:
        trainer(model_parallel(), plugins=[plugin]).fit(ours, rank_loader(STEPS))
    return {
        **fp8_record(plugin),
        "params": pieces(ours),
        "reference": pieces(reference),
        "precompute_calls": calls.calls,
        "sharded": all(isinstance(p, DTensor) for p in ours.parameters()),
    }


def fabric_fsdp2_run(plugin: Any, all_gather: bool) -> tuple[nn.Module, int]:
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    shard = lambda model, mesh: shard_gpt(model, mesh["data_parallel"])  # noqa: E731
    strategy = FabricModelParallel(shard, data_parallel_size=WORLD, tensor_parallel_size=1)
    given = {"precision": plugin} if isinstance(plugin, str) else {"plugins": [plugin]}
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, **given)
    fabric.launch()
    model = gpt()
    if isinstance(plugin, str):
        torchao_convert(model, all_gather)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    with PrecomputeCalls() as calls:
        for step in range(STEPS):
            fabric.backward(lm_loss(model, rank_tokens(step, fabric.global_rank)))
            optimizer.step()
            optimizer.zero_grad()
            if isinstance(plugin, str) and all_gather:
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

                precompute_float8_dynamic_scale_for_fsdp(model)
    return model, calls.calls


def fabric_fsdp2(all_gather: bool) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference, _ = fabric_fsdp2_run("bf16-mixed", all_gather)
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_recipe=recipe_config(all_gather), fp8_fallback=None)
    ours, calls = fabric_fsdp2_run(plugin, all_gather)
    return {
        **fp8_record(plugin),
        "params": pieces(ours),
        "reference": pieces(reference),
        "precompute_calls": calls,
        "sharded": all(isinstance(p, DTensor) for p in ours.parameters()),
    }


def trainer_fsdp2_nan() -> dict[str, Any]:
    plugin = MixedPrecisionPlugin("fp8-mixed")
    module = ShardedGPT(all_gather=False, reference=False)
    module.faulty = {NAN_STEP}  # a NaN at the layer's input on FAULT_RANK's batch only
    trainer(model_parallel(), plugins=[plugin]).fit(module, rank_loader(STEPS))
    return {**fp8_record(plugin), "params": pieces(module)}


def fabric_fsdp2_nan() -> dict[str, Any]:
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed")
    shard = lambda model, mesh: shard_gpt(model, mesh["data_parallel"])  # noqa: E731
    strategy = FabricModelParallel(shard, data_parallel_size=WORLD, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, plugins=[plugin])
    fabric.launch()
    model = gpt()
    faults = Faults(model.get_submodule(LAYER))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    around: list[dict[str, Tensor]] = []
    for step in range(STEPS):
        faults.on = step == NAN_STEP and fabric.global_rank == FAULT_RANK
        fabric.backward(lm_loss(model, rank_tokens(step, fabric.global_rank)))
        around += [pieces(model)] if step == NAN_STEP else []
        optimizer.step()
        around += [pieces(model)] if step == NAN_STEP else []
        optimizer.zero_grad()
    return {**fp8_record(plugin), "params": pieces(model), "around the nan": around}


def fsdp2_nan(out: Path) -> dict[str, Any]:
    return {"trainer": trainer_fsdp2_nan(), "fabric": fabric_fsdp2_nan()}


class ShardedUnconverted(RankGPT):
    """Shards in ``configure_model`` without converting first."""

    def configure_model(self) -> None:
        shard_gpt(self.gpt, self.device_mesh["data_parallel"])


def sharded_before_converted() -> str:
    try:
        trainer(model_parallel(), plugins=[MixedPrecisionPlugin("fp8-mixed")]).fit(
            ShardedUnconverted(), rank_loader(STEPS)
        )
    except ValueError as error:
        return str(error)
    return "no error"


def fsdp2(out: Path) -> dict[str, Any]:
    runs: dict[str, Any] = {
        f"{front_end}/{'all_gather' if all_gather else 'tensorwise'}": run(all_gather)
        for front_end, run in (("trainer", trainer_fsdp2), ("fabric", fabric_fsdp2))
        for all_gather in (False, True)
    }
    return {**runs, "sharded first": sharded_before_converted()}


# ---------------------------------------------------------------------------- FSDP2: a fallback, torchtitan's sharding
HEAD, ALONE = "lm_head", "transformer.h.1.mlp.proj"  # the two layers that fall back
MICRO_BATCHES = 2


def shard_torchtitan(model: nn.Module, mesh: Any) -> nn.Module:
    """As torchtitan shards a Llama: each block, ``[norm, output]`` together, the root; one Linear also alone."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.get_submodule(ALONE), mesh=mesh, mp_policy=half_policy())
    transformer: Any = model.transformer
    for block in transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=half_policy())
    fully_shard([transformer.ln_f, model.lm_head], mesh=mesh, mp_policy=half_policy())
    return fully_shard(model, mesh=mesh, mp_policy=half_policy())


def accumulate(fabric: L.Fabric, model: nn.Module, optimizer: Any, steps: range) -> None:
    """litgpt's loop: micro-batches under ``no_backward_sync`` but the last, then one optimizer step."""
    for step in steps:
        for micro in range(MICRO_BATCHES):
            with fabric.no_backward_sync(model, enabled=micro < MICRO_BATCHES - 1):
                batch = rank_tokens(MICRO_BATCHES * step + micro, fabric.global_rank)
                fabric.backward(lm_loss(model, batch) / MICRO_BATCHES)
        optimizer.step()
        optimizer.zero_grad()


def torchtitan_fabric(given: dict[str, Any]) -> L.Fabric:
    from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel

    shard = lambda model, mesh: shard_torchtitan(model, mesh["data_parallel"])  # noqa: E731
    strategy = FabricModelParallel(shard, data_parallel_size=WORLD, tensor_parallel_size=1)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, **given)
    fabric.launch()
    return fabric


def with_outliers(model: nn.Module) -> nn.Module:
    for name in (HEAD, ALONE):
        Faults(model.get_submodule(name), factor=OUTLIER).on = True
    return model


def fallback_reference(steps: int, fallback_step: int) -> tuple[Any, dict[str, Tensor]]:
    """torchao's path: every layer converted until the fallback's step, then the two layers never converted.

    Model A (all converted) trains up to the fallback's step; model B, converted but for the two layers and sharded the
    same way, takes A's parameters and optimizer state (torch's distributed state-dict helpers) and goes on.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_amp_plus.weights.fp8 import eligible

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = torchtitan_fabric({"precision": "bf16-mixed"})
    models, optimizers = [], []
    for leave in ((), (HEAD, ALONE)):
        model = llama()
        chosen = lambda module, name, leave=leave: eligible(module, name) and name not in leave  # noqa: E731
        convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=chosen)
        with_outliers(model)  # after torchao's conversion, which drops the hooks of the layers it swaps
        models.append(fabric.setup_module(model))
        optimizers.append(fabric.setup_optimizers(torch.optim.AdamW(models[-1].parameters(), lr=LR, weight_decay=0.1)))
    (a, b), (a_optimizer, b_optimizer) = models, optimizers
    accumulate(fabric, a, a_optimizer, range(fallback_step + 1))
    state, optimizer_state = get_state_dict(a.module, a_optimizer.optimizer)
    set_state_dict(b.module, b_optimizer.optimizer, model_state_dict=state, optim_state_dict=optimizer_state)
    at_fallback = pieces(b.module)
    accumulate(fabric, b, b_optimizer, range(fallback_step + 1, steps))
    return b, at_fallback


def fsdp2_fallback(out: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    reference, at_fallback = fallback_reference(STEPS, fallback_step=1)
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1, fp8_fallback=1.0)
    fabric = torchtitan_fabric({"plugins": [plugin]})
    model = fabric.setup_module(with_outliers(llama()))  # the conversion keeps the hooks
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    accumulate(fabric, model, optimizer, range(STEPS))
    layers = {name: model.module.get_submodule(name) for name in (HEAD, ALONE)}
    references = {name: reference.module.get_submodule(name) for name in (HEAD, ALONE)}
    return {
        **fp8_record(plugin),
        "params": pieces(model.module),
        "reference": pieces(reference.module),
        "reference at fallback": at_fallback,
        # Whether each layer's class is the one fully_shard gave the reference's never-converted Linear, and its name.
        "classes": {
            name: (type(layers[name]) is type(references[name]), type(layers[name]).__name__) for name in layers
        },
        "fsdp modules": {name: isinstance(layer, FSDPModule) for name, layer in layers.items()},
    }


SCENARIOS = {"ddp": ddp, "fsdp2": fsdp2, "fsdp2 fallback": fsdp2_fallback, "fsdp2 nan": fsdp2_nan}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_pool(SCENARIOS, tmp_path_factory.mktemp("fp8_distributed"))


def assert_equal_pieces(a: dict[str, Tensor], b: dict[str, Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


# ----------------------------------------------------------------------------------------------------- tests
FRONT_ENDS = {"trainer": f"gpt.{LAYER}", "fabric": LAYER}  # the layer's name as each front end names it


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_an_outlier_on_one_rank_is_read_on_both_and_both_fall_back_the_same_layer_under_ddp(
    ranks: list[dict[str, Any]], front_end: str
) -> None:
    zero, one = (runs[f"{front_end}/outlier"] for runs in scenario(ranks, "ddp"))
    layer = FRONT_ENDS[front_end]
    assert zero["checks"] == one["checks"]  # the readings are the reduced ones on both ranks
    first = {(name, cast): pct for name, cast, pct in zero["checks"][0][2]}
    assert first[(layer, "input")] > 1.0  # rank 0's own batches have no outlier: it reads rank 1's too
    assert zero["fallen_back"] == one["fallen_back"] == [layer]
    assert [check[1] for check in zero["checks"]] == [[], [layer], [], []]  # at the second reading, on both
    assert len(zero["layers"]) == LINEARS - 1
    assert_equal_pieces(zero["params"], one["params"], "the two replicas")


def test_with_fp8_fallback_none_rank_zero_alone_warns_once_naming_the_layer_another_rank_flushes(
    ranks: list[dict[str, Any]],
) -> None:
    zero, one = scenario(ranks, "ddp")
    assert len(zero["watching"]) == 1 and one["watching"] == []
    assert zero["watching"][0].startswith(f"FP8 layer `{LAYER}` flushed ")
    assert "with fp8_fallback=None it stays in FP8" in zero["watching"][0]


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_nan_in_one_ranks_batch_skips_the_step_on_both_ranks_and_both_name_the_layer_under_ddp(
    ranks: list[dict[str, Any]], front_end: str
) -> None:
    zero, one = (runs[f"{front_end}/nan"] for runs in scenario(ranks, "ddp"))
    skipped = [step == NAN_STEP for step in range(STEPS)]
    assert zero["skipped"] == one["skipped"] == skipped
    assert zero["nonfinite"] == one["nonfinite"] and zero["nonfinite"][0] == FRONT_ENDS[front_end]
    assert zero["fallen_back"] == one["fallen_back"] == []
    assert_equal_pieces(zero["params"], one["params"], "the two replicas")
    assert all(torch.isfinite(p).all() for p in zero["params"].values())


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_nan_in_one_ranks_batch_skips_the_step_on_both_ranks_and_both_name_the_layer_under_fsdp2(
    ranks: list[dict[str, Any]], front_end: str
) -> None:
    zero, one = (runs[front_end] for runs in scenario(ranks, "fsdp2 nan"))
    skipped = [step == NAN_STEP for step in range(STEPS)]
    assert zero["skipped"] == one["skipped"] == skipped
    assert zero["nonfinite"] == one["nonfinite"] and zero["nonfinite"][0] == FRONT_ENDS[front_end]
    for rank in (zero, one):  # each rank's shards: finite, and (Fabric) untouched by the skipped step
        assert all(torch.isfinite(p).all() for p in rank["params"].values())
        if front_end == "fabric":
            before, after = rank["around the nan"]
            assert_equal_pieces(before, after, "the shards across the skipped step")


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("recipe", ["tensorwise", "all_gather"])
def test_under_fsdp2_the_shards_equal_torchaos_own_path_under_the_builtin_bf16_mixed_bit_for_bit(
    ranks: list[dict[str, Any]], front_end: str, recipe: str
) -> None:
    for rank in scenario(ranks, "fsdp2"):
        run = rank[f"{front_end}/{recipe}"]
        assert run["sharded"] and len(run["layers"]) == LINEARS
        assert run["skipped"] == [False] * STEPS
        assert [check[0] for check in run["checks"]] == [0]  # readings on the sharded layers (step 0 of 4)
        casts = {cast for _, cast, _ in run["checks"][0][2]}
        # FP8 all-gather casts the weight from the shards: the layer never sees its high-precision values to read.
        assert casts == ({"input", "grad_output"} if recipe == "all_gather" else {"input", "weight", "grad_output"})
        assert_equal_pieces(run["params"], run["reference"], f"{front_end}, {recipe}, a rank's shards")


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_with_fp8_all_gather_the_plugin_precomputes_the_scales_after_each_optimizer_step(
    ranks: list[dict[str, Any]], front_end: str
) -> None:
    for rank in scenario(ranks, "fsdp2"):
        assert rank[f"{front_end}/all_gather"]["precompute_calls"] == STEPS
        assert rank[f"{front_end}/tensorwise"]["precompute_calls"] == 0  # the weights are all-gathered in bf16


def test_a_model_sharded_before_the_plugin_could_convert_it_is_refused_naming_the_fix(
    ranks: list[dict[str, Any]],
) -> None:
    for rank in scenario(ranks, "fsdp2"):
        message = rank["sharded first"]
        assert "are sharded already (fully_shard ran before the plugin could convert them)" in message
        assert "`self.trainer.precision_plugin.fp8.convert(self)`, then `fully_shard(" in message


def test_under_fsdp2_a_fallen_back_layer_stays_an_fsdp_module_trains_under_no_backward_sync_and_equals_torchao(
    ranks: list[dict[str, Any]],
) -> None:
    # torchtitan's sharding ([norm, output] together; here one MLP projection alone too), litgpt's accumulation: the
    # layers that fall back at step 1 then equal torchao's path with those layers never converted from step 2 on.
    for rank in scenario(ranks, "fsdp2 fallback"):
        assert rank["fallen_back"] == [ALONE, HEAD]  # in forward order
        assert [check[1] for check in rank["checks"]] == [[], [ALONE, HEAD], [], []]  # at the second reading
        for name in (f"{HEAD}.weight", f"{ALONE}.weight"):  # premise: the fallen layers train after the fallback
            assert not torch.equal(rank["reference"][name], rank["reference at fallback"][name]), name
        assert_equal_pieces(rank["params"], rank["reference"], "a rank's shards after the fallback")
        # The class fully_shard gave the reference's never-converted Linear layers.
        assert rank["classes"] == {HEAD: (True, "FSDPLinear"), ALONE: (True, "FSDPLinear")}
        assert rank["fsdp modules"] == {HEAD: True, ALONE: True}
