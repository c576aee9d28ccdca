"""FP8 training on torchao (``weights/fp8/``): against torchao's own path, bit for bit, and in the cases it gets wrong.

References: torchao's ``convert_to_float8_training`` with the same config and filter in a plain
``torch.autocast("cpu", torch.bfloat16)`` loop with AdamW on FP32 weights (the training numerics); a ``no_grad``
forward (evaluation under inference mode); an independent float64 computation of float8's rounding thresholds (the
readings); a model whose layer was never converted (the fallback). The model is litgpt's GPT, as its users train it,
2 layers and 64 wide: 9 Linear layers, all eligible.
"""

from __future__ import annotations

import copy
import io
import sys
import warnings
from typing import Any
from unittest import mock

import processes
import pytest
import torch
import torch.nn.functional as F
from processes import REPO, repo_env
from torch import Tensor, nn

torchao_float8 = pytest.importorskip("torchao.float8", reason="FP8 training needs torchao (the fp8 extra)")
litgpt = pytest.importorskip("litgpt", reason="the reference model is litgpt's GPT")

from fp8_models import CONFIG, LINEARS, gpt, torchao_reference  # noqa: E402
from helpers import host_reads  # noqa: E402
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from lightning_amp_plus.weights.fp8 import (  # noqa: E402
    RECIPES,
    CastReading,
    FallbackRule,
    FP8Training,
    convert_in_place,
)

STEPS = 4
OUTLIER_LAYER = "transformer.h.0.mlp.proj"
CLEAN_LIMIT_PCT = 0.1  # "layers not touched stay near 0": <= 0.09% was measured on a larger trained GPT


def tokens(step: int, batch: int = 4) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, CONFIG["vocab_size"], (batch, CONFIG["block_size"] + 1), generator=generator)
    return data[:, :-1], data[:, 1:]


def loss_of(model: nn.Module, step: int) -> Tensor:
    x, y = tokens(step)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, CONFIG["vocab_size"]), y.reshape(-1))


def train(
    model: nn.Module,
    steps: range,
    optimizer: torch.optim.Optimizer | None = None,
    fp8: FP8Training | None = None,
    check_every: int = 0,
) -> tuple[torch.optim.Optimizer, list[float]]:
    """The plain loop: bf16 autocast, AdamW on the FP32 weights; with ``fp8``, the check steps armed as a loop would."""
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in steps:
        checking = fp8 is not None and check_every and step % check_every == 0
        if checking:
            fp8.start_check()  # type: ignore[union-attr]
        loss = loss_of(model, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if fp8 is not None:
            if checking:
                fp8.finish_check()
            fp8.end_step()
        losses.append(loss.item())
    return optimizer, losses


def assert_same_parameters(ours: nn.Module, reference: nn.Module, what: str) -> None:
    for (name, a), (_, b) in zip(ours.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(a, b), f"{what}: {name} differs"


# --------------------------------------------------------------------------------------- bit for bit torchao's own path
@pytest.mark.parametrize("recipe", RECIPES)
def test_training_equals_torchaos_own_path_bit_for_bit(recipe: str) -> None:
    reference = torchao_reference(recipe, gpt())
    _, reference_losses = train(reference, range(STEPS))
    model = gpt()
    fp8 = FP8Training(recipe, fallback=None)
    assert len(fp8.convert(model)) == LINEARS
    # Readings on every other step and the non-finite flags on every step: they read, they never change the numbers.
    _, losses = train(model, range(STEPS), fp8=fp8, check_every=2)
    assert losses == reference_losses
    assert_same_parameters(model, reference, f"{recipe} after {STEPS} steps")


def test_rowwise_with_gw_hp_fails_on_cpu_under_torchao_alone_and_trains_here() -> None:
    model = gpt()
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp"))
    with pytest.raises(RuntimeError, match="same dtype"):  # premise: torchao's bf16 grad_weight GEMM gets an FP32 input
        loss_of(model, 0).backward()
    model = gpt()
    FP8Training("rowwise_with_gw_hp").convert(model)
    _, losses = train(model, range(2))
    assert all(torch.isfinite(torch.tensor(losses)))


def test_the_inputs_are_left_as_torchao_leaves_them_on_cpu_for_the_recipes_it_runs() -> None:
    seen: dict[str, torch.dtype] = {}
    torchaos = Float8Linear.forward
    for recipe in RECIPES:
        model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32))  # LayerNorm's output stays FP32 under autocast
        FP8Training(recipe).convert(model)

        def spy(layer: nn.Module, value: Tensor, recipe: str = recipe) -> Tensor:
            seen[recipe] = value.dtype  # the input as torchao's casts read it
            return torchaos(layer, value)

        with mock.patch.object(Float8Linear, "forward", spy), torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(4, 32))
    assert seen == {"tensorwise": torch.float32, "rowwise": torch.float32, "rowwise_with_gw_hp": torch.bfloat16}


# ------------------------------------------------------------------------------------------------- in place, once
def test_the_modules_and_parameters_stay_the_same_objects() -> None:
    model = gpt()
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters())
    keys = list(model.state_dict())
    FP8Training().convert(model)
    assert {name: id(m) for name, m in model.named_modules()} == {name: id(m) for name, m in modules.items()}
    assert dict(model.named_parameters()) == parameters  # the same Parameter objects under the same names
    assert list(model.state_dict()) == keys
    assert all(type(m) is Float8Linear for m in model.modules() if isinstance(m, nn.Linear))


def test_hooks_buffers_attributes_and_mode_of_a_linear_are_carried_over() -> None:
    calls: list[str] = []
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    layer = model[0]
    layer.register_forward_pre_hook(lambda *_: calls.append("pre"))
    handle = layer.register_forward_hook(lambda *_: calls.append("forward"))
    layer.register_full_backward_hook(lambda *_: calls.append("backward"))
    layer.register_buffer("mask", torch.ones(32))
    layer.tag = "kept"
    layer.eval()
    premise = copy.deepcopy(model)
    convert_to_float8_training(premise, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    assert not premise[0]._forward_hooks and not hasattr(premise[0], "tag")  # premise: torchao's swap drops them

    FP8Training().convert(model)
    assert model[0] is layer and type(layer) is Float8Linear
    model(torch.randn(2, 16, requires_grad=True)).sum().backward()
    assert calls == ["pre", "forward", "backward"]
    assert torch.equal(layer.mask, torch.ones(32)) and layer.tag == "kept" and not layer.training
    handle.remove()  # a handle taken before the conversion still removes its hook
    model(torch.randn(2, 16))
    assert calls[-2:] == ["backward", "pre"]


def test_a_deep_copy_of_a_converted_model_runs_its_own_layers() -> None:
    # A converted layer's forward is a method of its guard, which holds the layer: a copy (torch's AveragedModel, an EMA
    # callback's) must run its own layers on its own weights, not the original's.
    def halve(model: nn.Module) -> nn.Module:
        with torch.no_grad():
            torch._foreach_mul_(list(model.parameters()), 0.5)
        return model

    model = gpt()
    FP8Training().convert(model)
    twin = halve(copy.deepcopy(model))
    expected = halve(gpt())
    FP8Training().convert(expected)
    assert torch.equal(loss_of(twin, 0), loss_of(expected, 0))
    assert not torch.equal(loss_of(twin, 0), loss_of(model, 0))  # premise: the halved weights change the loss


def test_a_second_conversion_is_a_no_op_and_a_fallen_back_layer_stays_plain() -> None:
    model = gpt()
    fp8 = FP8Training()
    first = fp8.convert(model)
    fp8.fall_back(OUTLIER_LAYER)
    state = copy.deepcopy(model.state_dict())
    assert fp8.convert(model) == []  # e.g. validate or a second fit after fit
    assert type(model.get_submodule(OUTLIER_LAYER)) is nn.Linear
    assert sorted(fp8.layers) == sorted(set(first) - {OUTLIER_LAYER})
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    again = convert_in_place(model, "tensorwise")  # torchao itself would convert a Float8Linear again
    assert list(again) == [OUTLIER_LAYER]  # only the plain one: what is FP8 already is left alone


def test_a_shared_linear_is_converted_once() -> None:
    shared = nn.Linear(16, 16)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert list(convert_in_place(model, "tensorwise")) == ["0"]
    assert model[0] is model[2] is shared and type(shared) is Float8Linear


def test_a_checkpoint_loads_strictly_into_the_unconverted_model() -> None:
    model = gpt()
    FP8Training().convert(model)
    train(model, range(2))
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    plain = gpt(seed=1)
    plain.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
    assert_same_parameters(plain, model, "the loaded checkpoint")
    assert not any(isinstance(m, Float8Linear) for m in plain.modules())


def test_a_bare_linear_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"wrap it, e\.g\. nn\.Sequential\(linear\)"):
        FP8Training().convert(nn.Linear(16, 16))


# ------------------------------------------------------------------------------------------------------ which layers
def test_eligible_layers_are_exact_linears_with_both_dims_divisible_by_16() -> None:
    class Scaled(nn.Linear):  # its own forward: torchao's layer would silently replace it
        def forward(self, x: Tensor) -> Tensor:
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 30), nn.Linear(30, 32), Scaled(32, 32), nn.Linear(32, 16))
    assert list(convert_in_place(model, "tensorwise")) == ["0", "4"]


def test_the_user_filter_sees_the_names_of_named_modules() -> None:
    seen: list[str] = []

    def not_the_head(module: nn.Module, name: str) -> bool:
        seen.append(name)
        return name != "lm_head"

    model = gpt()
    names = FP8Training(modules=not_the_head).convert(model)
    assert set(seen) == {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert "lm_head" not in names and len(names) == LINEARS - 1
    assert type(model.lm_head) is nn.Linear


@pytest.mark.parametrize("recipe", RECIPES)
def test_auto_keeps_torchaos_large_gemms_and_says_when_it_converts_nothing(recipe: str) -> None:
    with pytest.warns(UserWarning, match=r"fp8_modules='auto' kept none of the 9 eligible Linear layers"):
        assert FP8Training(recipe, modules="auto").convert(gpt()) == []
    with torch.device("meta"):  # shapes only: torchao's filter looks at nothing else
        big = nn.Sequential(nn.Linear(4096, 8192), nn.Linear(8192, 4096), nn.Linear(4096, 64))
    assert FP8Training(recipe, modules="auto").convert(big) == ["0", "1"]


def test_a_model_without_an_eligible_layer_says_so() -> None:
    with pytest.warns(UserWarning, match=r"none of its 2 nn.Linear layers is eligible"):
        FP8Training().convert(nn.Sequential(nn.Linear(30, 32), nn.Linear(32, 10)))


# -------------------------------------------------------------------------------------------- evaluation, inference
@pytest.mark.parametrize("recipe", RECIPES)
def test_inference_mode_evaluation_equals_no_grad_evaluation(recipe: str) -> None:
    premise = gpt()
    convert_to_float8_training(premise, config=Float8LinearConfig.from_recipe_name(recipe))
    x, _ = tokens(0)
    premise_fails = pytest.raises((NotImplementedError, AssertionError))  # premise: torchao alone
    with premise_fails, torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        premise(x)
    model = gpt()
    FP8Training(recipe).convert(model)
    train(model, range(1))
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(x)
    assert torch.equal(got, expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(loss_of(model, 1))  # training goes on after evaluation


def test_lightning_validate_and_predict_run_with_inference_mode_on_a_converted_model() -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = gpt()
            FP8Training().convert(self.net)

        def validation_step(self, batch: Tensor, _index: int) -> Tensor:
            loss = F.cross_entropy(self.net(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten())
            self.log("val_loss", loss)
            return loss

        def predict_step(self, batch: Tensor, _index: int) -> Tensor:
            return self.net(batch[:, :-1])

    sequences = torch.randint(0, CONFIG["vocab_size"], (8, CONFIG["block_size"] + 1))
    data = DataLoader(sequences, batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu", precision="bf16-mixed", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    assert trainer.predict_loop.inference_mode  # premise: Lightning's default
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        (metrics,) = trainer.validate(Module(), data, verbose=False)
        predictions = trainer.predict(Module(), data)
    assert torch.isfinite(torch.tensor(metrics["val_loss"]))
    assert predictions is not None and all(torch.isfinite(p).all() for p in predictions)  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------------------- readings
def scale_by_hand(values: Tensor, dim: int | None, power_of_2: bool, top: float) -> Tensor:
    """The format's maximum over the amax, in float64 as torchao does, then FP32 (rounded down to a power of two)."""
    amax = values.abs().amax() if dim is None else values.abs().amax(dim=dim, keepdim=True)
    scale = (top / amax.double().clamp(min=1e-12)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def counts_by_hand(
    values: Tensor, dim: int | None, power_of_2: bool, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[int, int, int]:
    """Nonzero, flushed, subnormal from the format's rounding thresholds (round to nearest, ties to even), not from a
    cast: with ``tiny`` the smallest subnormal and ``normal`` the smallest normal number, |v| <= tiny / 2 rounds to 0,
    tiny / 2 < |v| < normal - tiny / 2 to a subnormal (e4m3: 2**-10 and 7.5 * 2**-9), larger to a normal number."""
    info = torch.finfo(dtype)
    normal = info.smallest_normal
    tiny = normal * info.eps  # one unit in the last place at the bottom binade
    scaled = (values.float() * scale_by_hand(values, dim, power_of_2, info.max)).abs().double()
    nonzero = values != 0
    flushed = nonzero & (scaled <= tiny / 2)
    subnormal = (scaled > tiny / 2) & (scaled < normal - tiny / 2)
    return int(nonzero.sum()), int(flushed.sum()), int(subnormal.sum())


def with_outlier(model: nn.Module, factor: float) -> None:
    """One token's input to one MLP layer multiplied by ``factor`` (registered before the conversion: carried over)."""

    def scale_one_token(_module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        x = args[0].clone()
        x[0, 3] *= factor
        return (x,)

    model.get_submodule(OUTLIER_LAYER).register_forward_pre_hook(scale_one_token)


def capture(layer: nn.Module) -> dict[str, Tensor]:
    """The input the layer's casts read and its output's gradient (hooks registered after the conversion's)."""
    seen: dict[str, Tensor] = {}
    layer.register_forward_pre_hook(lambda _m, args: seen.__setitem__("input", args[0].detach()))

    def on_output(_module: nn.Module, _args: Any, output: Tensor) -> None:
        output.register_hook(lambda g: seen.__setitem__("grad_output", g.detach()))

    layer.register_forward_hook(on_output)
    return seen


def read_once(model: nn.Module, fp8: FP8Training) -> dict[tuple[str, str], CastReading]:
    fp8.start_check()
    loss_of(model, 0).backward()
    return {(r.layer, r.cast): r for r in fp8.finish_check().readings}


def test_a_token_outlier_flushes_a_few_percent_of_a_tensorwise_input_and_nothing_elsewhere() -> None:
    model = gpt()
    with_outlier(model, 1e4)
    fp8 = FP8Training("tensorwise", fallback=None)
    fp8.convert(model)
    seen = capture(model.get_submodule(OUTLIER_LAYER))
    readings = read_once(model, fp8)
    assert {cast for _, cast in readings} == {"input", "weight", "grad_output"}
    assert len(readings) == 3 * LINEARS
    hit = readings[(OUTLIER_LAYER, "input")]
    assert 1.0 < hit.flushed_pct < 20.0 and hit.subnormal_pct > 20.0  # a larger GPT: 4.4% flushed, 58% subnormal
    nonzero, flushed, subnormal = counts_by_hand(seen["input"].reshape(-1, 256), None, power_of_2=False)
    assert (hit.nonzero, hit.flushed_pct, hit.subnormal_pct) == (
        nonzero, 100 * flushed / nonzero, 100 * subnormal / nonzero,
    )  # fmt: skip
    grad = readings[(OUTLIER_LAYER, "grad_output")]
    nonzero, flushed, subnormal = counts_by_hand(seen["grad_output"].reshape(-1, 64), None, False, torch.float8_e5m2)
    assert (grad.nonzero, grad.flushed_pct, grad.subnormal_pct) == (
        nonzero, 100 * flushed / nonzero, 100 * subnormal / nonzero,
    )  # fmt: skip
    clean = [r for key, r in readings.items() if key != (OUTLIER_LAYER, "input")]
    assert max(r.flushed_pct for r in clean) <= CLEAN_LIMIT_PCT


def test_rowwise_keeps_the_forward_cast_clean_and_its_weight_gradient_cast_along_tokens_flushes() -> None:
    model = gpt()
    with_outlier(model, 1e4)
    fp8 = FP8Training("rowwise", fallback=None)
    fp8.convert(model)
    seen = capture(model.get_submodule(OUTLIER_LAYER))
    readings = read_once(model, fp8)
    layer_input = seen["input"].reshape(-1, 256)
    forward = readings[(OUTLIER_LAYER, "input")]
    along_tokens = readings[(OUTLIER_LAYER, "input_for_grad_weight")]
    assert forward.flushed_pct == 0.0
    assert along_tokens.flushed_pct > 1.0  # a larger GPT: 1.9%
    for reading, dim in ((forward, -1), (along_tokens, 0)):
        nonzero, flushed, subnormal = counts_by_hand(layer_input, dim, power_of_2=True)
        assert (reading.nonzero, reading.flushed_pct, reading.subnormal_pct) == (
            nonzero, 100 * flushed / nonzero, 100 * subnormal / nonzero,
        )  # fmt: skip


def test_rowwise_with_gw_hp_reads_only_the_casts_it_makes() -> None:
    model = gpt()
    fp8 = FP8Training("rowwise_with_gw_hp", fallback=None)
    fp8.convert(model)
    casts = {cast for _, cast in read_once(model, fp8)}
    assert casts == {"input", "weight", "grad_output", "weight_for_grad_input"}  # grad_weight's GEMM is in bf16


def test_no_reading_outside_check_steps_and_no_hook_added_or_removed_for_one() -> None:
    model = gpt()
    fp8 = FP8Training(fallback=None)
    fp8.convert(model)

    def hooks() -> dict[str, tuple[int, Any]]:
        return {name: (len(m._forward_pre_hooks) + len(m._forward_hooks), m.forward) for name, m in fp8.layers.items()}

    before = hooks()
    fp8.start_check()
    assert fp8.armed
    loss_of(model, 0).backward()
    assert len(fp8.finish_check().readings) == 3 * LINEARS
    assert hooks() == before
    loss_of(model, 1).backward()  # not a check step
    assert fp8.finish_check().readings == []


def test_the_first_check_step_reads_the_forward_order_once_while_a_layer_never_runs() -> None:
    # Step 0 is both a check step and the first after the conversion: its readings and the layers' places in the
    # forward order are read once each. A layer that never runs keeps its place unknown, so a second read of the
    # places would find something to read (a layer a model holds but does not call: a spare head, a frozen branch).
    model = nn.ModuleDict({"used": nn.Linear(32, 32), "spare": nn.Linear(32, 32)})
    fp8 = FP8Training(fallback=None)
    assert fp8.convert(model) == ["used", "spare"]
    fp8.before_forward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model["used"](torch.randn(16, 32)).float().square().mean().backward()
    calls: list[str] = []
    with host_reads(calls):
        check = fp8.after_step()
    assert check is not None and {reading.layer for reading in check.readings} == {"used"}
    assert calls == ["tolist", "tolist"]  # the places, then the readings' counts


# -------------------------------------------------------------------------------------------------------- non-finite
def poison(layer: nn.Module, value: float) -> None:
    def hook(_module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        x = args[0].clone()
        x[1, 5, 7] = value
        return (x,)

    layer.register_forward_pre_hook(hook)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_input_names_its_layer_first(value: float) -> None:
    model = gpt()
    poison(model.get_submodule(OUTLIER_LAYER), value)
    fp8 = FP8Training()
    fp8.convert(model)
    loss = loss_of(model, 0)
    loss.backward()
    assert not torch.isfinite(loss)
    layers = fp8.nonfinite_layers()
    assert layers[0] == OUTLIER_LAYER
    # The poisoned value spreads forward to every later layer, then backward to all; the earlier ones only in backward.
    assert set(layers) == set(fp8.layers)
    assert layers.index("transformer.h.1.attn.qkv") < layers.index("transformer.h.0.mlp.fc")
    fp8.end_step()
    assert fp8.nonfinite_layers() == []


def test_a_gradient_that_turns_non_finite_in_backward_names_the_first_layer_in_backward_order() -> None:
    model = gpt()

    def overflow_in_backward(_module: nn.Module, _args: Any, output: Tensor) -> None:
        output.register_hook(lambda g: g * float("inf"))

    # Registered before the conversion: its tensor hook runs before the layer's own, as the gradient reaches the layer.
    model.get_submodule("transformer.h.1.mlp.fc").register_forward_hook(overflow_in_backward)
    fp8 = FP8Training()
    fp8.convert(model)
    loss_of(model, 0).backward()
    layers = fp8.nonfinite_layers()
    assert layers[0] == "transformer.h.1.mlp.fc"
    assert "lm_head" not in layers and "transformer.h.1.mlp.proj" not in layers  # after it in the forward: clean


def test_a_clean_step_flags_nothing_and_micro_batches_accumulate() -> None:
    model = gpt()
    fp8 = FP8Training()
    fp8.convert(model)
    loss_of(model, 0).backward()
    assert fp8.nonfinite_layers() == []
    poison(model.get_submodule("lm_head"), float("nan"))
    loss_of(model, 1).backward()  # a second micro-batch of the same step
    assert fp8.nonfinite_layers()[0] == "lm_head"


def test_a_non_finite_weight_is_named() -> None:
    model = gpt()
    fp8 = FP8Training()
    fp8.convert(model)
    with torch.no_grad():
        model.get_submodule(OUTLIER_LAYER).weight[0, 0] = float("nan")
    assert fp8.nonfinite_layers() == [OUTLIER_LAYER]  # read when skipped: no forward needed


# ---------------------------------------------------------------------------------------------------------- fallback
def test_a_forward_the_module_object_carried_is_given_back_by_a_fallback() -> None:
    # A converted layer's forward is an attribute of its module object; one the object carried before (a library may
    # set its own) gives way to torchao's while the layer is in FP8, and comes back with a fallback.
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    calls: list[str] = []
    plain = model[0].forward

    def own(x: Tensor) -> Tensor:
        calls.append("own")
        return plain(x)

    model[0].forward = own
    fp8 = FP8Training(fallback=None)
    fp8.convert(model)
    model(torch.randn(2, 16))
    assert calls == [] and model[0].forward != own
    fp8.fall_back("0")
    model(torch.randn(2, 16))
    assert calls == ["own"] and model[0].forward is own


def test_a_fallen_back_layer_continues_bit_for_bit_as_one_never_converted() -> None:
    model = gpt()
    fp8 = FP8Training(fallback=None)
    fp8.convert(model)
    optimizer, _ = train(model, range(STEPS), fp8=fp8)
    layer = model.get_submodule(OUTLIER_LAYER)
    weight, state = layer.weight, optimizer.state[layer.weight]
    moments = {key: value.clone() for key, value in state.items()}
    # The reference at this point: a model whose layer was never converted, with the same values and optimizer state.
    reference = gpt()
    FP8Training(modules=lambda _m, name: name != OUTLIER_LAYER).convert(reference)
    reference.load_state_dict(model.state_dict())
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1)
    reference_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # torch would share the `step` tensors

    fp8.fall_back(OUTLIER_LAYER)
    assert type(layer) is nn.Linear and layer is model.get_submodule(OUTLIER_LAYER) and layer.weight is weight
    assert optimizer.state[weight] is state and all(torch.equal(state[k], v) for k, v in moments.items())
    assert OUTLIER_LAYER not in fp8.layers and fp8.fallen_back == [OUTLIER_LAYER]
    train(model, range(STEPS, 2 * STEPS), optimizer, fp8=fp8)
    train(reference, range(STEPS, 2 * STEPS), reference_optimizer)
    assert_same_parameters(model, reference, f"{STEPS} steps after the fallback")


def test_the_rule_falls_back_a_layer_flushing_at_two_readings_in_a_row_and_warns_naming_it() -> None:
    model = gpt()
    with_outlier(model, 1e4)
    fp8 = FP8Training("tensorwise", check_interval=1, fallback=1.0)
    fp8.convert(model)
    first = read_once(model, fp8)
    assert first[(OUTLIER_LAYER, "input")].flushed_pct > 1.0 and fp8.fallen_back == []
    with pytest.warns(UserWarning, match=rf"FP8 layer `{OUTLIER_LAYER}` flushed .*% of its input cast"):
        read_once(model, fp8)
    assert fp8.fallen_back == [OUTLIER_LAYER] and len(fp8.layers) == LINEARS - 1


def test_a_resumed_run_falls_back_the_same_layers_whether_loaded_before_or_after_the_conversion() -> None:
    fp8 = FP8Training(fallback=2.0)
    fp8.convert(gpt())
    fp8.rule.streaks["lm_head"] = 1
    fp8.fall_back(OUTLIER_LAYER)
    state = fp8.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)  # plain values: loads with weights_only=True
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state == {"version": 2, "steps": 0, "fallen_back": [OUTLIER_LAYER], "streaks": {"lm_head": 1}, "said": []}

    after = FP8Training()
    converted_after = gpt()
    after.convert(converted_after)
    after.load_state_dict(state)
    before = FP8Training()
    before.load_state_dict(state)
    converted_before = gpt()
    before.convert(converted_before)
    for resumed, model in ((after, converted_after), (before, converted_before)):
        assert resumed.fallen_back == [OUTLIER_LAYER] and resumed.rule.streaks == {"lm_head": 1}
        assert type(model.get_submodule(OUTLIER_LAYER)) is nn.Linear and len(resumed.layers) == LINEARS - 1


def test_a_recorded_layer_the_model_does_not_have_is_said() -> None:
    fp8 = FP8Training()
    fp8.convert(gpt())
    with pytest.warns(UserWarning, match=r"fallen-back layers this model has not converted: \['head'\]"):
        fp8.load_state_dict({"version": 2, "steps": 3, "fallen_back": ["head"], "streaks": {}})
    assert fp8.fallen_back == ["head"] and len(fp8.layers) == LINEARS


@pytest.mark.parametrize(
    "state",
    [
        {"fallen_back": "lm_head"},
        {"version": 2, "fallen_back": []},  # version 2 counts its steps
        {"version": 2, "steps": -1, "fallen_back": []},
        {"version": 3, "steps": 0, "fallen_back": []},
    ],
)
def test_a_state_that_is_not_ours_is_refused(state: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="Not an FP8 training state"):
        FP8Training().load_state_dict(state)


def test_a_version_1_state_restores_its_fallbacks_and_counts_and_says_the_steps_start_from_0() -> None:
    fp8 = FP8Training(check_interval=2)
    fp8.convert(gpt())
    with pytest.warns(UserWarning, match=r"version 1\), which did not save the steps counted: the fallen-back layers"):
        fp8.load_state_dict({"version": 1, "fallen_back": [OUTLIER_LAYER], "streaks": {"lm_head": 1}})
    assert fp8.fallen_back == [OUTLIER_LAYER] and fp8.rule.streaks == {"lm_head": 1}
    assert fp8.state_dict()["steps"] == 0


def test_the_rule_counts_readings_in_a_row_resets_on_a_clean_one_and_none_names_a_layer_once() -> None:
    def reading(pct: float, layer: str = "fc") -> list[CastReading]:
        return [CastReading(layer, "input", pct, 0.0, 100), CastReading(layer, "grad_output", 0.0, 0.0, 100)]

    rule = FallbackRule(1.0)
    assert rule.update(reading(5.0)) == [] and rule.update(reading(0.5)) == []  # reset
    assert rule.update(reading(5.0)) == [] and rule.update(reading(1.5, "other")) == []  # no reading: count kept
    assert rule.update(reading(5.0)) == ["fc"]
    assert rule.update(reading(1.0, "edge")) == [] and rule.update(reading(1.0, "edge")) == []  # not above
    never = FallbackRule(None)  # watches at 1% and names each layer once (FP8Training warns, never falls back)
    assert [never.update(reading(100.0)) for _ in range(4)] == [[], ["fc"], [], []]
    assert never.update(reading(0.5)) == [] and [never.update(reading(2.0)) for _ in range(2)] == [[], []]
    assert never.state_dict() == {"streaks": {"fc": 2}, "said": ["fc"]}


# ------------------------------------------------------------------------------------------------- options, install
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"recipe": "delayed"}, ValueError, r"`FP8Training\(recipe='delayed'\)` is not an FP8 recipe: use 'tensor"),
        ({"modules": ["fc"]}, TypeError, r"`FP8Training\(modules=\['fc'\]\)` must be None .*, 'auto' .* or a callable"),
        ({"check_interval": 0}, ValueError, r"`FP8Training\(check_interval=0\)` must be an int >= 1, e\.g\. 50"),
        ({"fallback": 100}, ValueError, r"`FP8Training\(fallback=100\)` must be None .* or a percent in \(0, 100\)"),
        ({"fallback": True}, ValueError, r"`FP8Training\(fallback=True\)` must be None"),
    ],
)
def test_bad_options_are_refused_naming_the_argument_and_value(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        FP8Training(**kwargs)


def test_the_package_imports_torchao_lazily_and_refuses_fp8_without_it_naming_the_install_command() -> None:
    # One process (importing Lightning takes most of its time): nothing imports torchao before a model is converted,
    # so hiding it afterwards is what a user without the fp8 extra has.
    code = (
        "import sys\n"
        "import lightning_amp_plus, lightning_amp_plus.plugins.precision, lightning_amp_plus.plugins.fsdp\n"
        "from lightning_amp_plus.weights.fp8 import FP8Training\n"
        "print('torchao imported:', 'torchao' in sys.modules)\n"
        "import hide_packages\n"
        "hide_packages.hide(['torchao'])\n"
        "try:\n"
        "    FP8Training()\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error)\n"
    )
    env = repo_env()
    env["PYTHONPATH"] += f":{REPO / 'tests'}"
    done = processes.run([sys.executable, "-c", code], timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "torchao imported: False" in done.stdout
    assert 'pip install "lightning-amp-plus[fp8]"' in done.stdout


class GradientTimes(torch.autograd.Function):
    """The identity in forward; multiplies the gradient by ``factor`` (a tensor: a new value recompiles nothing)."""

    @staticmethod
    def forward(ctx: Any, value: Tensor, factor: Tensor) -> Tensor:
        ctx.save_for_backward(factor)
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (factor,) = ctx.saved_tensors
        return grad * factor, None


class Poison(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.factor = torch.ones(())

    def forward(self, value: Tensor) -> Tensor:
        out: Tensor = GradientTimes.apply(value, self.factor)
        return out


def test_a_compiled_model_breaks_no_graph_and_still_names_where_a_non_finite_value_started() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    poison = Poison()
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), poison, nn.Linear(128, 64))
    fp8 = FP8Training()
    fp8.convert(model)
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(32, 64)

    def step(value: Tensor) -> list[str]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            compiled(value).float().square().mean().backward()
        found = fp8.nonfinite_layers()
        fp8.end_step()
        return found

    assert [step(x), step(x)] == [[], []]
    poisoned = x.clone()
    poisoned[3, 5] = float("nan")
    assert step(poisoned) == ["0", "3"]  # in forward: the origin, then its spread
    poison.factor.fill_(float("inf"))
    assert step(x) == ["0"]  # in backward: the gradient turned non-finite between the layers reaches layer 0 only
    poison.factor.fill_(1.0)
    fp8.start_check()
    assert step(x) == [] and len(fp8.finish_check().readings) == 6
    # The first step's (its layers stamp their place in the forward order), the ordinary steps', the check step's.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 3
    assert not torch._dynamo.utils.counters["graph_break"]


def test_layers_checkpointed_by_a_wrapper_are_named_as_the_state_dict_names_them() -> None:
    # apply_activation_checkpointing puts `_checkpoint_wrapped_module` into named_modules()' names (torch's state dict
    # leaves it out, and so does the monitor); before, the FP8 layers, their readings and their fallbacks carried it.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    plain, checkpointed = gpt(), gpt()
    apply_activation_checkpointing(checkpointed, check_fn=lambda module: isinstance(module, litgpt.model.Block))
    assert any("_checkpoint_wrapped_module" in name for name, _ in checkpointed.named_modules())  # premise
    names = {}
    for model in (plain, checkpointed):
        fp8 = FP8Training("tensorwise")
        fp8.convert(model)
        fp8.start_check()
        loss_of(model, 0).backward()
        readings = [(reading.layer, reading.cast) for reading in fp8.finish_check().readings]
        fp8.fall_back(OUTLIER_LAYER)
        fp8.convert(model)  # the layer fallen back stays in bf16
        names[model is plain] = (list(fp8.layers), readings, fp8.fallen_back, fp8.state_dict()["fallen_back"])
    assert names[False] == names[True]
    assert len(names[True][0]) == LINEARS - 1 and names[True][2] == [OUTLIER_LAYER]
    assert type(checkpointed.get_submodule("transformer.h.0._checkpoint_wrapped_module.mlp.proj")) is nn.Linear
    saved = {**fp8.state_dict(), "fallen_back": ["transformer.h.0._checkpoint_wrapped_module.mlp.proj"]}  # as before
    resumed = FP8Training("tensorwise")
    resumed.load_state_dict(saved)
    assert resumed.fallen_back == [OUTLIER_LAYER]
