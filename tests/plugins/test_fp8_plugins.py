"""``"fp8-mixed"`` in the Trainer's and Fabric's ``MixedPrecisionPlugin``: against torchao's own path, and its faults.

References: torchao's ``convert_to_float8_training`` (same config, same filter) trained under Lightning's own
``bf16-mixed`` (the Trainer) and Fabric's own ``bf16-mixed``, bit for bit; for a skipped NaN step, the same reference
run without that batch; for evaluation, the ``no_grad`` forward fit's own validation uses. The model is litgpt's GPT
(:mod:`fp8_models`).
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from fp8_models import (
    CPU_EMULATED,
    LAYER,
    LINEARS,
    LR,
    Faults,
    GPTModule,
    assert_same_parameters,
    gpt,
    lm_loss,
    loader,
    tokens,
    torchao_reference,
)
from helpers import make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

pytest.importorskip("torchao.float8", reason="fp8-mixed needs torchao (the fp8 extra)")
pytest.importorskip("litgpt", reason="the model is litgpt's GPT")

from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear

import lightning_amp_plus.fabric as amp_fabric
from lightning_amp_plus import DynamicLossScaler, FSDPMixedPrecisionPlugin, MixedPrecisionPlugin
from lightning_amp_plus.plugins.fp8 import check_fp8_device
from lightning_amp_plus.step.engine import PendingStep
from lightning_amp_plus.weights.fp8 import RECIPES

pytestmark = pytest.mark.filterwarnings(CPU_EMULATED)

FRONT_ENDS = {"trainer": MixedPrecisionPlugin, "fabric": amp_fabric.MixedPrecisionPlugin}
STEPS = 4
FAULT_STEP = 2


# ---------------------------------------------------------------------------------------------------------- Fabric
def fabric_train(
    plugin: Any,
    steps: list[int],
    *,
    recipe: str | None = None,
    faulty: tuple[int, ...] = (),
    factor: float | None = None,
) -> tuple[nn.Module, Any]:
    """A plain Fabric loop over the batches of ``steps`` (``precision`` or ``plugins=[plugin]``)."""
    given = {"precision": plugin} if isinstance(plugin, str) else {"plugins": [plugin]}
    fabric = L.Fabric(accelerator="cpu", devices=1, **given)
    model = gpt()
    faults = Faults(model.get_submodule(LAYER), factor=factor)
    if recipe is not None:
        torchao_reference(recipe, model)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    for step in steps:
        faults.on = step in faulty
        fabric.backward(lm_loss(model, tokens(step)))
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def fabric_bf16(recipe: str, steps: list[int]) -> nn.Module:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*bfloat16 Automatic Mixed Precision.*")
        return fabric_train("bf16-mixed", steps, recipe=recipe)[0]


# ----------------------------------------------------------------------------------------- bit for bit torchao's path
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_trainer_plugin_equals_torchao_under_lightnings_bf16_mixed_bit_for_bit(recipe: str) -> None:
    reference = GPTModule(recipe)
    make_trainer(precision="bf16-mixed").fit(reference, loader(range(STEPS)))
    plugin = MixedPrecisionPlugin("fp8-mixed", fp8_recipe=recipe, fp8_check_interval=2)
    ours = GPTModule()
    make_trainer(plugins=[plugin]).fit(ours, loader(range(STEPS)))
    assert len(plugin.fp8.layers) == LINEARS and ours.converted_when_optimizers_were_made
    assert [check.step for check in plugin.fp8.checks] == [0, 2]  # readings on check steps change nothing
    assert_same_parameters(ours, reference, f"{recipe} after {STEPS} steps")


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_fabric_plugin_equals_torchao_under_fabrics_bf16_mixed_bit_for_bit(recipe: str) -> None:
    reference = fabric_bf16(recipe, list(range(STEPS)))
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_recipe=recipe, fp8_check_interval=2)
    ours, _ = fabric_train(plugin, list(range(STEPS)))
    assert len(plugin.fp8.layers) == LINEARS
    assert [check.step for check in plugin.fp8.checks] == [0, 2]
    assert_same_parameters(ours, reference, f"{recipe} after {STEPS} steps")


# ---------------------------------------------------------------------------------------------- never a poisoned run
def test_a_nan_in_an_fp8_layer_is_skipped_and_the_run_equals_the_run_without_that_batch_under_the_trainer() -> None:
    steps = list(range(STEPS + 1))
    reference = GPTModule("tensorwise")
    make_trainer(precision="bf16-mixed").fit(reference, loader([s for s in steps if s != FAULT_STEP]))
    plugin = MixedPrecisionPlugin("fp8-mixed")
    ours = GPTModule(faulty=[FAULT_STEP])
    make_trainer(plugins=[plugin]).fit(ours, loader(steps))
    assert plugin.skipped_steps == 1 and plugin.recent_steps[FAULT_STEP].overflowed
    layers = plugin.fp8.nonfinite_layers()  # named as the LightningModule's named_modules() names them
    assert layers[0] == f"gpt.{LAYER}" and set(layers) == set(plugin.fp8.layers)  # the origin first, then its spread
    assert_same_parameters(ours, reference, "after the skipped step")


def test_a_nan_in_an_fp8_layer_is_skipped_and_the_run_equals_the_run_without_that_batch_under_fabric() -> None:
    steps = list(range(STEPS + 1))
    reference = fabric_bf16("tensorwise", [s for s in steps if s != FAULT_STEP])
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed")
    ours, _ = fabric_train(plugin, steps, faulty=(FAULT_STEP,))
    assert plugin.skipped_steps == 1 and plugin.recent_steps[FAULT_STEP].overflowed
    assert plugin.fp8.nonfinite_layers()[0] == LAYER
    assert_same_parameters(ours, reference, "after the skipped step")


def test_a_nan_at_the_first_step_of_a_run_resumed_between_checks_names_its_layer_first() -> None:
    # The layers' places in the forward order are stamped on the check steps and on the first step after the
    # conversion, which here is not a check step (a run resumed at step 3, readings every 2): that step stamps alone.
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=2)
    plugin.fp8.load_state_dict({**plugin.fp8.state_dict(), "steps": 3})
    fabric_train(plugin, [FAULT_STEP], faulty=(FAULT_STEP,))
    assert plugin.skipped_steps == 1 and not plugin.fp8.checks  # premise: a skip, on no check step
    layers = plugin.fp8.nonfinite_layers()
    assert sorted(layers)[0] == "lm_head" and set(layers) == set(plugin.fp8.layers)  # premise: not the name order
    assert layers[0] == LAYER and layers.index("transformer.h.1.attn.qkv") < layers.index("lm_head")


def test_a_fused_optimizers_skip_keeps_the_flags_until_they_are_asked_for() -> None:
    # The fused path decides the skip on the device: the flags are kept without reading it, and named when asked.
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = gpt()
    faults = Faults(model.get_submodule(LAYER))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, fused=True))
    for step in range(STEPS):
        faults.on = step == 1
        fabric.backward(lm_loss(model, tokens(step)))
        optimizer.step()
        assert isinstance(plugin.recent_steps[-1], PendingStep)  # premise: the fused path, no host read in the step
        optimizer.zero_grad()
    assert not plugin.recent_steps[-1].resolved  # nothing read the last steps' values yet
    assert plugin.fp8.nonfinite_layers()[0] == LAYER
    assert [result.skipped for result in plugin.recent_steps] == [False, True, False, False]


# ----------------------------------------------------------------------------------------------- set-up and evaluation
def test_nothing_is_converted_twice_by_validate_test_and_a_second_fit() -> None:
    plugin = MixedPrecisionPlugin("fp8-mixed")
    module = GPTModule()
    fit = make_trainer(plugins=[plugin], limit_val_batches=1)
    fit.fit(module, loader(range(2)), loader([10]))
    layers = plugin.fp8.layers
    assert len(layers) == LINEARS
    (validated,) = fit.validate(module, loader([11]), verbose=False)  # inference_mode=True: Lightning's default
    (tested,) = fit.test(module, loader([12]), verbose=False)
    predictions = fit.predict(module, loader([13]))
    make_trainer(plugins=[plugin], max_epochs=1).fit(module, loader(range(2, 4)))
    assert plugin.fp8.layers == layers and all(type(layer) is Float8Linear for layer in layers.values())
    assert sum(isinstance(m, Float8Linear) for m in module.modules()) == LINEARS
    assert torch.isfinite(torch.tensor([validated["val_loss"], tested["test_loss"]])).all()
    assert predictions is not None and all(torch.isfinite(p).all() for p in predictions)  # type: ignore[union-attr]


def test_validate_predict_with_inference_mode_equal_fits_no_grad_validation() -> None:
    plugin = MixedPrecisionPlugin("fp8-mixed")
    module = GPTModule()
    run = make_trainer(plugins=[plugin])
    assert run.predict_loop.inference_mode  # premise: Lightning's default
    (predicted,) = run.predict(module, loader([7]))  # a model nobody trained: converted for evaluation
    assert len(plugin.fp8.layers) == LINEARS
    module.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = module.gpt(tokens(7)[:, :-1])
    assert torch.equal(predicted, expected)


def test_a_fabric_loop_evaluates_under_inference_mode_as_under_no_grad() -> None:
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed")
    model, _ = fabric_train(plugin, [0, 1])
    model.eval()
    with torch.no_grad():
        expected = model(tokens(9)[:, :-1])
    with torch.inference_mode():
        got = model(tokens(9)[:, :-1])
    assert torch.equal(got, expected)
    assert [check.step for check in plugin.fp8.checks] == [0]  # the evaluation forwards read nothing


@pytest.mark.filterwarnings("default")  # the emulation warning is what this test is about
def test_on_cpu_the_plugin_warns_once_that_fp8_is_emulated() -> None:
    plugin = MixedPrecisionPlugin("fp8-mixed")
    # Recorded, not pytest.warns: that re-emits Lightning's own remarks past the suite's filters when it exits.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugins=[plugin], max_steps=1).fit(GPTModule(), loader(range(1)))
        make_trainer(plugins=[plugin], max_steps=2).fit(GPTModule(), loader(range(1)))
    ours = [w for w in caught if "emulates" in str(w.message)]
    assert len(ours) == 1 and ours[0].category is UserWarning
    assert re.match(r"MixedPrecisionPlugin\('fp8-mixed'\) on CPU: torch emulates", str(ours[0].message))


def test_a_gpu_below_sm89_and_mps_are_refused_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB, compute capability 8\.0, sm80\) has no float8"):
        check_fp8_device("MixedPrecisionPlugin", "cuda", warn=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 9))
    check_fp8_device("MixedPrecisionPlugin", "cuda", warn=True)  # Ada: native
    with pytest.raises(ValueError, match="float8 matrix multiplies do not run on MPS"):
        check_fp8_device("MixedPrecisionPlugin", "mps", warn=True)


# ------------------------------------------------------------------------------------------------------ fallback
OUTLIER = 1e4


def test_the_trainer_plugin_falls_back_a_flushing_layer_warns_and_a_resumed_run_falls_back_the_same(
    tmp_path: Path,
) -> None:
    plugin = MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1)
    module = GPTModule(faulty=range(100), factor=OUTLIER)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    with pytest.warns(UserWarning, match=rf"FP8 layer `gpt\.{LAYER}` flushed .*% of its input cast"):
        make_trainer(plugins=[plugin], max_steps=3, enable_checkpointing=True, callbacks=[checkpoints]).fit(
            module, loader(range(3))
        )
    assert plugin.fp8.fallen_back == [f"gpt.{LAYER}"] and type(module.gpt.get_submodule(LAYER)) is nn.Linear
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["MixedPrecisionPlugin"]["fp8"]
    assert saved["fallen_back"] == [f"gpt.{LAYER}"]

    resumed = MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1)
    again = GPTModule()
    resuming = make_trainer(resumed, max_steps=4, max_epochs=2, enable_checkpointing=True, callbacks=[checkpoints])
    resuming.fit(again, loader(range(3)), ckpt_path=tmp_path / "last.ckpt")
    assert resumed.fp8.fallen_back == [f"gpt.{LAYER}"] and type(again.gpt.get_submodule(LAYER)) is nn.Linear
    assert len(resumed.fp8.layers) == LINEARS - 1


def test_the_fabric_plugin_falls_back_and_fabric_save_load_keeps_it(tmp_path: Path) -> None:
    plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = gpt()
    faults = Faults(model.get_submodule(LAYER), factor=OUTLIER)
    faults.on = True
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    with pytest.warns(UserWarning, match=rf"FP8 layer `{LAYER}` flushed"):
        for step in range(2):
            fabric.backward(lm_loss(model, tokens(step)))
            optimizer.step()
            optimizer.zero_grad()
    fabric.save(tmp_path / "state.pt", {"model": model, "optimizer": optimizer, "amp": plugin})

    resumed = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=1)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[resumed])
    again = fabric.setup_module(gpt(seed=1))
    again_optimizer = fabric.setup_optimizers(torch.optim.AdamW(again.parameters(), lr=LR))
    fabric.load(tmp_path / "state.pt", {"model": again, "optimizer": again_optimizer, "amp": resumed})
    assert resumed.fp8.fallen_back == [LAYER] and type(again.get_submodule(LAYER)) is nn.Linear
    assert_same_parameters(again, model, "the loaded model")


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_fp8_fallback_none_reads_warns_once_per_layer_without_a_monitor_and_never_falls_back(front_end: str) -> None:
    # The outlier layer flushes more than 1% at every reading: named once, at the second reading, with its share.
    plugin = FRONT_ENDS[front_end]("fp8-mixed", fp8_check_interval=1, fp8_fallback=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if front_end == "trainer":
            module = GPTModule(faulty=range(100), factor=OUTLIER)
            make_trainer(plugins=[plugin], max_steps=4).fit(module, loader(range(4)))
        else:
            fabric_train(plugin, list(range(4)), faulty=tuple(range(100)), factor=OUTLIER)
    layer = f"gpt.{LAYER}" if front_end == "trainer" else LAYER
    said = [str(w.message) for w in caught if str(w.message).startswith("FP8 layer")]
    second = max((r for r in plugin.fp8.checks[1].readings if r.layer == layer), key=lambda r: r.flushed_pct)
    assert said == [
        f"FP8 layer `{layer}` flushed {second.flushed_pct:.2f}% of its {second.cast} cast's nonzero values to zero at "
        "2 readings in a row (above 1%); with fp8_fallback=None it stays in FP8. Pass fp8_fallback=1 to send such a "
        "layer back to bf16, or keep it out of FP8 with fp8_modules. Said once per layer."
    ]
    assert all(w.category is UserWarning for w in caught if str(w.message).startswith("FP8 layer"))
    assert plugin.fp8.fallen_back == [] and len(plugin.fp8.layers) == LINEARS
    assert len(plugin.fp8.checks) == 4 and second.flushed_pct > 1.0


# ------------------------------------------------------------------------------------------------------- resume
# Epochs of 3 steps, readings every 2 (steps 0, 2, 4, 6, 8), the outlier from step 2 on: readings 2 and 4 flush, so the
# layer falls back at step 4. A checkpoint after step 2 is off the readings' grid and the fallback comes after it.
RESUME_AT, FALLBACK_STEP, RUN = 3, 4, 9


class OutlierFrom(GPTModule):
    """The outlier at :data:`LAYER`'s input from global step ``first`` on (the batches repeat each epoch)."""

    def __init__(self, first: int, seed: int = 0) -> None:
        super().__init__(factor=OUTLIER, seed=seed)
        self.first = first

    def training_step(self, batch: tuple[torch.Tensor, int], _index: int) -> torch.Tensor:
        self.faults.on = self.global_step >= self.first
        return lm_loss(self.gpt, batch[0])


def test_a_trainer_run_resumed_off_the_readings_grid_equals_the_uninterrupted_one_fallback_included(
    tmp_path: Path,
) -> None:
    def fit(epochs: int, save: bool = False, checkpoint: Path | None = None) -> tuple[MixedPrecisionPlugin, GPTModule]:
        plugin = MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=2)
        module = OutlierFrom(2, seed=0 if checkpoint is None else 1)  # a resumed run's own weights are overwritten
        saving = [ModelCheckpoint(dirpath=tmp_path, save_last=True)] if save else []
        run = make_trainer(plugin, max_epochs=epochs, enable_checkpointing=save, callbacks=saving)
        run.fit(module, loader(range(RESUME_AT)), ckpt_path=checkpoint)
        return plugin, module

    with pytest.warns(UserWarning, match=rf"FP8 layer `gpt\.{LAYER}` flushed"):
        whole, uninterrupted = fit(RUN // RESUME_AT)
    first, _ = fit(1, save=True)  # the checkpoint at the end of epoch 0: after step 2, a check step
    with pytest.warns(UserWarning, match=rf"FP8 layer `gpt\.{LAYER}` flushed"):
        resumed, module = fit(RUN // RESUME_AT, save=True, checkpoint=tmp_path / "last.ckpt")
    assert [check.step for check in resumed.fp8.checks] == [4, 6, 8]  # the uninterrupted run's, after the resume
    assert [c.fell_back for c in whole.fp8.checks] == [[], [], [f"gpt.{LAYER}"], [], []]  # at step 4 in both
    assert [c.fell_back for c in resumed.fp8.checks] == [[f"gpt.{LAYER}"], [], []]
    assert_same_parameters(module, uninterrupted, f"{RUN} steps, resumed after {RESUME_AT}")
    assert first.fp8.state_dict()["steps"] == RESUME_AT and resumed.fp8.state_dict() == whole.fp8.state_dict()


def test_a_fabric_run_resumed_off_the_readings_grid_equals_the_uninterrupted_one_fallback_included(
    tmp_path: Path,
) -> None:
    def run(steps: range, load: Path | None = None) -> tuple[Any, nn.Module]:
        plugin = amp_fabric.MixedPrecisionPlugin("fp8-mixed", fp8_check_interval=2)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = gpt(seed=0 if load is None else 1)
        faults = Faults(model.get_submodule(LAYER), factor=OUTLIER)
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
        state = {"model": model, "optimizer": optimizer, "amp": plugin}
        if load is not None:
            fabric.load(load, state)
        for step in steps:
            faults.on = step >= 2
            fabric.backward(lm_loss(model, tokens(step % RESUME_AT)))  # the batches of 3-step epochs
            optimizer.step()
            optimizer.zero_grad()
        fabric.save(tmp_path / "state.pt", state)
        return plugin, model

    with pytest.warns(UserWarning, match=rf"FP8 layer `{LAYER}` flushed"):
        whole, uninterrupted = run(range(RUN))
    first, _ = run(range(RESUME_AT))
    with pytest.warns(UserWarning, match=rf"FP8 layer `{LAYER}` flushed"):
        resumed, model = run(range(RESUME_AT, RUN), load=tmp_path / "state.pt")
    assert [check.step for check in resumed.fp8.checks] == [4, 6, 8]
    assert [c.fell_back for c in resumed.fp8.checks] == [[LAYER], [], []]
    assert_same_parameters(model, uninterrupted, f"{RUN} steps, resumed after {RESUME_AT}")
    assert first.fp8.state_dict()["steps"] == RESUME_AT and resumed.fp8.state_dict() == whole.fp8.state_dict()


# -------------------------------------------------------------------------------------------------------- refusals
def bad_options() -> list[tuple[dict[str, Any], type[Exception], str]]:
    all_gather = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return [
        ({"fp8_recipe": "delayed"}, ValueError, r"`{name}\(fp8_recipe='delayed'\)` is not an FP8 recipe"),
        (
            {"precision": "bf16-mixed", "fp8_recipe": "rowwise"},
            ValueError,
            r"`{name}\('bf16-mixed', fp8_recipe='rowwise'\)`: fp8_recipe configures FP8 training, which "
            r"precision='bf16-mixed' does not do. Use precision='fp8-mixed', or drop fp8_recipe.",
        ),
        (
            {"precision": "16-mixed", "fp8_fallback": None, "fp8_check_interval": 10},
            ValueError,
            r"`{name}\('16-mixed', fp8_check_interval=10, fp8_fallback=None\)`",
        ),
        (
            {"fp8_modules": ["lm_head"]},
            TypeError,
            r"`{name}\(fp8_modules=\['lm_head'\]\)` must be None .*, 'auto' .* or a callable",
        ),
        ({"fp8_check_interval": 0}, ValueError, r"`{name}\(fp8_check_interval=0\)` must be an int >= 1"),
        ({"fp8_fallback": 0.0}, ValueError, r"`{name}\(fp8_fallback=0\.0\)` must be None .* or a percent"),
        (
            {"scaler": DynamicLossScaler()},
            ValueError,
            r"fp8-mixed scales each FP8 cast by its own amax .* no loss scaling\. Drop `scaler`",
        ),
        ({"skip_nonfinite": False}, ValueError, r"`{name}\('fp8-mixed', skip_nonfinite=False\)`: one NaN or inf"),
        (
            {"fp8_recipe": all_gather},
            ValueError,
            r"enable_fsdp_float8_all_gather=True\), fp8_fallback=1\.0\)`: a layer that falls back would keep",
        ),
    ]


@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize(("kwargs", "error", "message"), bad_options())
def test_bad_fp8_options_are_refused_naming_the_argument_the_value_and_the_fix(
    front_end: str, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    name = "MixedPrecisionPlugin"
    with pytest.raises(error, match=message.replace("{name}", name)):
        FRONT_ENDS[front_end](**{"precision": "fp8-mixed", **kwargs})


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_fp8_mixed_without_torchao_is_refused_at_construction_naming_the_install(
    front_end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what `import torchao.float8` meets without torchao
    with pytest.raises(ModuleNotFoundError, match=re.escape('pip install "lightning-amp-plus[fp8]"')):
        FRONT_ENDS[front_end]("fp8-mixed")


@pytest.mark.parametrize("plugin", [FSDPMixedPrecisionPlugin, amp_fabric.FSDPMixedPrecisionPlugin])
def test_the_fsdp1_plugins_refuse_fp8_mixed_naming_fsdp2(plugin: type) -> None:
    with pytest.raises(ValueError, match=r"torchao trains in FP8 under FSDP2, not FSDP1's flat parameters"):
        plugin("fp8-mixed")


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_the_fp8_state_is_one_attribute_and_none_for_the_other_precisions(front_end: str) -> None:
    plugin = FRONT_ENDS[front_end]("fp8-mixed", fp8_recipe="rowwise", fp8_check_interval=7, fp8_fallback=2.5)
    assert (plugin.fp8.recipe, plugin.fp8.check_interval, plugin.fp8.rule.threshold_pct) == ("rowwise", 7, 2.5)
    assert (plugin.settings.fp8_recipe, plugin.settings.fp8_check_interval) == ("rowwise", 7)
    assert plugin.scaler is None and plugin.engine.check and plugin.engine.loss_scale is None  # the bf16 engine
    assert FRONT_ENDS[front_end]("bf16-mixed").fp8 is None
