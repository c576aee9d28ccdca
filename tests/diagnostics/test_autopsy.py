"""The overflow autopsy: each injected fault is classified and located, and the replay leaves nothing behind.

Every fault first checks its premise with an independent computation (a deepcopy run plainly, or watched with full
backward hooks), so a test cannot pass on a fault that is not what it claims.
"""

from __future__ import annotations

import copy
import math
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from autopsy_models import (
    MLP,
    WIDTH,
    assert_same,
    batch,
    draws_everything,
    fault_a,
    fault_b,
    fault_b_in_layer,
    fault_c,
    finite,
    mse,
    plain_gradients,
    snapshot,
    without_inplace,
)
from torch import Tensor, nn

from lightning_amp_plus.diagnostics.autopsy import Autopsy, run_autopsy
from lightning_amp_plus.diagnostics.replay import RngState
from lightning_amp_plus.step.scaler import DynamicLossScaler

FP16, BF16 = torch.float16, torch.bfloat16
INF = math.inf


def autopsy_of(model: nn.Module, scale: float, dtype: torch.dtype = FP16, data: Any = None, **kw: Any) -> Autopsy:
    record = run_autopsy(
        model, mse(model, data or batch()), rng=RngState.capture(), scale=scale, step=5, dtype=dtype, **kw
    )
    assert record is not None
    return record


def output_of(model: nn.Module, name: str, dtype: torch.dtype | None, data: Any = None) -> Tensor:
    """The output of module ``name`` in a plain forward of a deepcopy (``dtype`` autocast, or FP32 for ``None``)."""
    twin = copy.deepcopy(model)
    seen: list[Tensor] = []
    twin.get_submodule(name).register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        mse(twin, data or batch())()
    return seen[0]


def backward_of(model: nn.Module, name: str, dtype: torch.dtype | None, scale: float) -> tuple[bool, bool]:
    """Whether module ``name``'s incoming gradients are finite, and whether those its backward makes are, in a plain
    replay of a deepcopy watched by a full backward hook (the independent way, possible without in-place ReLUs)."""
    twin = without_inplace(model)
    seen: list[tuple[bool, bool]] = []

    def hook(module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        seen.append((finite([g for g in grad_out if g is not None]), finite([g for g in grad_in if g is not None])))

    twin.get_submodule(name).register_full_backward_hook(hook)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = mse(twin, batch())()
    (loss * scale).backward()
    return seen[0]


# --- A: a forward output beyond fp16's range ---------------------------------------------------------------------


def test_a_forward_overflow_is_blamed_on_the_layer_with_the_fp32_value_and_keep_fp32_advice() -> None:
    model = fault_a()
    fp32, half = output_of(model, "blocks.1.fc", None), output_of(model, "blocks.1.fc", FP16)
    inputs = output_of(model, "blocks.0", FP16)
    assert finite([fp32]) and fp32.abs().max() > 65504 and not finite([half]) and finite([inputs])  # the premise

    record = autopsy_of(model, scale=2.0**16)

    assert (record.kind, record.module, record.module_type, record.safe_scale) == (
        "forward",
        "blocks.1.fc",
        "Linear",
        None,
    )
    assert record.finite_in_fp32 is True
    assert record.stats is not None and record.stats.fp32_outputs is not None and record.stats.inputs is not None
    with torch.no_grad():  # the rerun's value: the layer in FP32 on the half inputs it was given
        rerun = model.blocks[1].fc(inputs.float())
    assert record.stats.fp32_outputs.abs_max == rerun.abs().max().item()
    assert record.stats.inputs.abs_max == inputs.abs().max().item()
    assert record.stats.weights is not None and record.stats.weights.abs_max == 1e5
    assert record.stats.outputs is not None and record.stats.outputs.nonfinite == half.numel() - int(
        half.isfinite().sum()
    )
    assert record.stats.grad_outputs is None  # no gradients in a forward autopsy
    assert "exceeds float16's 65504" in record.message and "keep_fp32=(Linear,)" in record.message
    assert "or train in bf16" in record.message and record.message.startswith("step 5: layer `blocks.1.fc` (Linear)")


# --- B: gradients that overflow at the scale used and not below it --------------------------------------------------


def test_b_gradients_inf_at_2_24_but_finite_at_1_are_a_scale_fault_in_the_loss_gradient() -> None:
    model = fault_b()
    data = batch()
    assert not finite(plain_gradients(model, data, FP16, 2.0**24)[1]) and finite(
        plain_gradients(model, data, FP16, 1.0)[1]
    )
    twin = copy.deepcopy(model)  # where it starts: the scaled loss gradient entering the model's half output
    with torch.autocast("cpu", dtype=FP16):
        out = twin(data[0])
    (grad,) = torch.autograd.grad(F.mse_loss(out.float(), data[1]) * 2.0**24, out)
    assert grad.dtype == FP16 and not finite([grad])

    record = autopsy_of(model, scale=2.0**24)

    assert (record.kind, record.module, record.stats) == ("scale", None, None)
    assert record.safe_scale is not None and record.safe_scale < 2.0**24
    assert "before any module's backward" in record.message and "backing off the scale fixes this" in record.message


def test_b_in_a_layer_blames_the_layer_whose_backward_overflows() -> None:
    model = fault_b_in_layer()
    assert backward_of(model, "blocks.1.fc", FP16, 2.0**14) == (True, False)  # finite in, non-finite out
    assert backward_of(model, "blocks.1.fc", FP16, 1.0) == (True, True)
    assert finite([output_of(model, "head", FP16)])

    record = autopsy_of(model, scale=2.0**14)

    assert (record.kind, record.module, record.module_type) == ("scale", "blocks.1.fc", "Linear")
    assert record.stats is not None and record.stats.grad_outputs is not None and record.stats.grad_inputs is not None
    assert record.stats.grad_outputs.finite and not record.stats.grad_inputs.finite
    assert "in the backward of `blocks.1.fc` (Linear)" in record.message


@pytest.mark.parametrize(("make", "scale"), [(fault_b, 2.0**24), (fault_b_in_layer, 2.0**14)], ids=["loss", "layer"])
def test_safe_scale_is_finite_and_twice_it_is_not(make: Callable[[], nn.Module], scale: float) -> None:
    model = make()
    record = autopsy_of(model, scale=scale)
    assert record.safe_scale is not None and math.log2(record.safe_scale).is_integer()
    assert finite(plain_gradients(model, batch(), FP16, record.safe_scale)[1])
    assert not finite(plain_gradients(model, batch(), FP16, 2 * record.safe_scale)[1])


def test_a_scale_below_the_floor_is_searched_from_min_scale() -> None:
    model = fault_b()
    record = autopsy_of(model, scale=2.0**24, min_scale=2.0**4)
    assert record.kind == "scale" and record.min_scale == 2.0**4
    assert record.safe_scale is not None and 2.0**4 <= record.safe_scale < 2.0**24
    assert finite(plain_gradients(model, batch(), FP16, record.safe_scale)[1])
    assert not finite(plain_gradients(model, batch(), FP16, 2 * record.safe_scale)[1])


# --- C: a backward that makes inf at any scale ----------------------------------------------------------------------


def test_c_a_broken_backward_is_blamed_at_every_scale_and_in_fp32() -> None:
    model = fault_c()
    assert backward_of(model, "blocks.1.extra", FP16, 1.0) == (True, False)
    assert not finite(plain_gradients(model, batch(), None, 1.0)[1])  # FP32 too: the op is broken

    record = autopsy_of(model, scale=2.0**16)

    assert (record.kind, record.module, record.module_type) == ("backward", "blocks.1.extra", "BrokenBackward")
    assert (record.safe_scale, record.finite_in_fp32) == (None, False)
    assert record.stats is not None and record.stats.grad_inputs is not None and not record.stats.grad_inputs.finite
    assert "its backward is broken" in record.message and "no loss scale can fix this" in record.message


def test_a_half_backward_that_overflows_at_scale_1_but_not_in_fp32_gets_keep_fp32_advice() -> None:
    # blocks.1.fc's outputs reach ~1e4, so the head's weight gradient (its inputs times the incoming gradient, summed
    # over the batch) leaves fp16's range at scale 1; FP32 holds it.
    model = MLP()
    with torch.no_grad():
        model.blocks[1].fc.weight.fill_(3e3)
    assert finite([output_of(model, "head", FP16)])
    assert not finite(plain_gradients(model, batch(), FP16, 1.0)[1]) and finite(
        plain_gradients(model, batch(), None, 1.0)[1]
    )

    record = autopsy_of(model, scale=2.0**16)

    assert (record.kind, record.module, record.finite_in_fp32) == ("backward", "head", True)
    assert record.stats is not None and record.stats.grad_weights is not None and not record.stats.grad_weights.finite
    assert "the FP32 backward is finite" in record.message and "keep_fp32=(Linear,)" in record.message


# --- forward faults beyond overflow; bf16 ---------------------------------------------------------------------------


class NaiveNorm(nn.Module):
    """A hand-written normalisation with the variance as E[x^2] - E[x]^2, which cancels to below 0 in bf16."""

    def forward(self, x: Tensor) -> Tensor:
        mean = x.mean(-1, keepdim=True)
        return (x - mean) / ((x * x).mean(-1, keepdim=True) - mean * mean).sqrt()


def norm_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(OrderedDict(fc=nn.Linear(WIDTH, WIDTH), norm=NaiveNorm(), head=nn.Linear(WIDTH, 1)))
    with torch.no_grad():
        net.fc.bias.fill_(20.0)
    return net


def test_a_bf16_nan_made_in_forward_is_blamed_and_found_finite_in_fp32() -> None:
    model = norm_net()
    fc_out = output_of(model, "fc", BF16)
    half, upcast = NaiveNorm()(fc_out), NaiveNorm()(fc_out.float())
    assert torch.isnan(half).any() and finite([upcast]) and finite([fc_out])  # the premise: bf16 cancellation

    record = autopsy_of(model, scale=1.0, dtype=BF16)

    assert (record.kind, record.module, record.module_type, record.finite_in_fp32) == (
        "forward",
        "norm",
        "NaiveNorm",
        True,
    )
    assert record.stats is not None and record.stats.fp32_outputs is not None
    assert record.stats.fp32_outputs.abs_max == pytest.approx(upcast.abs().max().item(), rel=1e-6)
    assert "is NaN in bfloat16" in record.message and "keep_fp32=(NaiveNorm,)" in record.message
    assert "train in bf16" not in record.message


class LogOf(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x - 10.0)


@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_a_nan_that_fp32_makes_too_is_not_called_a_precision_problem(dtype: torch.dtype) -> None:
    model = MLP(extra=LogOf())
    assert finite([output_of(model, "blocks.1.act", dtype)]) and not finite([output_of(model, "blocks.1.extra", None)])

    record = autopsy_of(model, scale=1.0, dtype=dtype)

    assert (record.kind, record.module, record.finite_in_fp32) == ("forward", "blocks.1.extra", False)
    assert "not a precision problem" in record.message and "keep_fp32" not in record.message


@pytest.mark.parametrize(("loss", "fp32_finite"), [("pow", True), ("log", False)])
def test_a_loss_made_non_finite_outside_any_module_names_no_module(loss: str, fp32_finite: bool) -> None:
    model = MLP()
    x, _ = batch()
    compute = {
        "pow": lambda out: (out * 1e4).pow(2).mean(),  # the fp16 square of ~5e2 overflows; FP32's does not
        "log": lambda out: torch.log(out.float() - 1e3).mean(),
    }[loss]
    with torch.autocast("cpu", dtype=FP16):
        out = copy.deepcopy(model)(x)
    assert finite([out]) and not finite([compute(out)]) and finite([compute(out.float())]) == fp32_finite

    record = run_autopsy(model, lambda: compute(model(x)), rng=RngState.capture(), scale=2.0**16, step=0, dtype=FP16)

    assert record is not None and (record.kind, record.module, record.stats) == ("forward", None, None)
    assert record.finite_in_fp32 is fp32_finite
    assert "every module's output is finite" in record.message
    assert ("`.float()`" in record.message) == fp32_finite


# --- masks: -inf on purpose is no cause ------------------------------------------------------------------------------


class CausalMask(nn.Module):
    def forward(self, n: int) -> Tensor:
        return torch.full((n, n), -INF).triu(1)


class Attention(nn.Module):
    """Single-head causal self-attention; the mask is made inside (functionally, or by a child module) or passed in."""

    def __init__(self, dim: int, child_mask: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.mask = CausalMask() if child_mask else None
        self.sharpness = 1.0

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        n = x.shape[-2]
        if mask is None:
            mask = self.mask(n) if self.mask is not None else torch.full((n, n), -INF).triu(1)
        scores = (q * self.sharpness) @ k.transpose(-1, -2) / math.sqrt(x.shape[-1]) + mask
        return scores.softmax(-1) @ v


class AttentionNet(nn.Module):
    """embed -> attn -> big -> head; the causal mask (-inf above the diagonal) comes from ``mask``: "inside" the
    attention (functionally), a "child" module of it, a "sibling" module passed to it, or the "parent"'s own code; the
    fp16 overflow is in ``fault``: "big" (after the attention), "qkv" (a child of it) or "scores" (its own code)."""

    def __init__(self, mask: str, fault: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mask_source = mask
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.attn = Attention(WIDTH, child_mask=mask == "child")
        self.mask = CausalMask() if mask == "sibling" else None
        self.big = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 1)
        with torch.no_grad():
            if fault == "big":
                self.big.weight.fill_(1e5)
            elif fault == "qkv":
                self.attn.qkv.weight.fill_(1e5)
        if fault == "scores":
            self.attn.sharpness = 1e5

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        n = h.shape[-2]
        mask = {"sibling": lambda: self.mask(n), "parent": lambda: torch.full((n, n), -INF).triu(1)}.get(
            self.mask_source, lambda: None
        )()
        return self.head(self.big(self.attn(h, mask=mask))).squeeze(-1)


@pytest.mark.parametrize("fault", ["big", "qkv", "scores"])
@pytest.mark.parametrize("mask", ["inside", "child", "sibling", "parent"])
def test_an_attention_mask_of_minus_inf_is_never_blamed_and_never_hides_the_fault(mask: str, fault: str) -> None:
    model = AttentionNet(mask, fault)
    x, y = torch.randn(2, 6, WIDTH, generator=torch.Generator().manual_seed(3)), torch.randn(2, 6)
    data = (x, y)
    culprit = {"big": "big", "qkv": "attn.qkv", "scores": "attn"}[fault]
    # The premise: the culprit's output is non-finite in fp16 and finite in FP32; nothing before it is non-finite
    # but the mask; the attention's output is finite when the fault comes after it.
    assert not finite([output_of(model, culprit, FP16, data)]) and finite([output_of(model, culprit, None, data)])
    assert finite([output_of(model, "embed", FP16, data)])
    if fault == "big":
        assert finite([output_of(model, "attn", FP16, data)])
    if mask in ("child", "sibling"):
        made = output_of(model, "attn.mask" if mask == "child" else "mask", FP16, data)
        assert torch.isneginf(made).any()  # a module whose output is -inf on purpose

    record = autopsy_of(model, scale=2.0**16, data=data)

    assert (record.kind, record.module, record.finite_in_fp32) == ("forward", culprit, True)
    assert "already held inf/NaN" not in record.message


# --- nothing reproduces ---------------------------------------------------------------------------------------------


def test_a_replay_finite_everywhere_gives_none() -> None:
    model = MLP()
    assert finite(plain_gradients(model, batch(), FP16, 2.0**10)[1])
    assert run_autopsy(model, mse(model, batch()), rng=RngState.capture(), scale=2.0**10, step=0, dtype=FP16) is None


# --- nothing left behind -------------------------------------------------------------------------------------------


def with_dropout_and_norm(make: Callable[[], MLP]) -> MLP:
    model = make()
    fresh = MLP(extra=model.blocks[1].extra, dropout=0.25, norm=True)
    fresh.load_state_dict(model.state_dict(), strict=False)
    return fresh


@pytest.mark.parametrize("grads", ["none", "set"])
@pytest.mark.parametrize("make", [fault_a, fault_b, fault_c], ids=["A", "B", "C"])
def test_the_autopsy_leaves_grads_buffers_flags_rng_autocast_and_hooks_as_they_were(
    make: Callable[[], MLP], grads: str
) -> None:
    model = with_dropout_and_norm(make)
    model.blocks[2].eval()  # a mixed training flag, which must survive
    data = batch()
    if grads == "set":
        for p in model.parameters():
            p.grad = torch.randn_like(p)
    rng = RngState.capture()
    torch.rand(3), random.random(), np.random.rand()  # the step drew after the batch started
    before = snapshot(model)

    record = run_autopsy(model, draws_everything(model, data), rng=rng, scale=2.0**24, step=1, dtype=FP16)

    assert record is not None and record.kind == {fault_a: "forward", fault_b: "scale", fault_c: "backward"}[make]
    assert_same(before, snapshot(model))


def test_the_autopsy_leaves_state_as_it_was_when_the_replay_raises() -> None:
    model = with_dropout_and_norm(fault_b)
    data = batch()
    calls = iter(range(100))

    def flaky() -> Tensor:
        if next(calls) == 1:  # the second replay fails
            raise RuntimeError("boom")
        return mse(model, data)()

    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"):
        run_autopsy(model, flaky, rng=RngState.capture(), scale=2.0**24, step=1, dtype=FP16)
    assert_same(before, snapshot(model))


def train(autopsy: bool, steps: int = 6) -> tuple[nn.Module, torch.optim.Optimizer, DynamicLossScaler, list[Autopsy]]:
    """A short fp16 training of a dropout + BatchNorm MLP: the scale starts at 2**24 (the first steps skip: "scale"),
    and step 4's batch is 1e6 times too large (a forward overflow)."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = MLP(dropout=0.25, norm=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0**24, growth_interval=2)
    found: list[Autopsy] = []
    for step in range(steps):
        x, y = batch(seed=100 + step)
        if step == 4:
            x = x * 1e6
        rng = RngState.capture() if autopsy else None
        forward = draws_everything(model, (x, y))
        with torch.autocast("cpu", dtype=FP16):
            loss = forward()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        result = scaler.result(opt)
        if autopsy and result is not None and result.skipped:
            assert rng is not None
            scale = result.scale
            assert scale is not None
            record = run_autopsy(model, forward, rng=rng, scale=scale, step=step, dtype=FP16)
            assert record is not None
            found.append(record)
        opt.zero_grad()
    return model, opt, scaler, found


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Bit for bit, NaNs included."""
    if a.is_floating_point():
        a, b = (
            a.view(torch.int32 if a.element_size() == 4 else torch.int16),
            b.view(torch.int32 if b.element_size() == 4 else torch.int16),
        )
    return torch.equal(a, b)


def test_a_training_with_autopsies_ends_bit_identical_to_one_without() -> None:
    model_a, opt_a, scaler_a, found = train(autopsy=True)
    rng_a = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    model_b, opt_b, scaler_b, _ = train(autopsy=False)
    rng_b = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()

    assert {record.kind for record in found} == {"scale", "forward"}  # the premise: autopsies ran, of both kinds
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values(), strict=True):
        assert same_bits(a, b), f"{name} differs"  # BatchNorm's running stats took step 4's NaN in both runs
    for a, b in zip(opt_a.state.values(), opt_b.state.values(), strict=True):
        assert all(same_bits(a[key], b[key]) for key in a)
    assert scaler_a.state_dict() == scaler_b.state_dict()
    assert torch.equal(rng_a[0], rng_b[0]) and rng_a[1] == rng_b[1] and np.array_equal(rng_a[2], rng_b[2])


# --- arguments and the record ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"dtype": torch.float32},
            ValueError,
            r"`run_autopsy\(dtype=torch.float32\)` must be torch.float16 or torch.bfloat16",
        ),
        ({"scale": 0.0}, ValueError, r"`run_autopsy\(scale=0.0\)` must be a finite number > 0"),
        ({"scale": INF}, ValueError, r"`run_autopsy\(scale=inf\)` must be a finite number > 0"),
        ({"min_scale": -1.0}, ValueError, r"`run_autopsy\(min_scale=-1.0\)` must be a finite number > 0"),
        ({"step": -1}, ValueError, r"`run_autopsy\(step=-1\)` must be an int >= 0"),
        (
            {"rng": None},
            TypeError,
            r"`run_autopsy\(rng=None\)` must be an RngState: capture one .* `RngState.capture\(\)`",
        ),
        ({"run": "loss"}, TypeError, r"`run_autopsy\(run='loss'\)` must be a callable"),
        ({"autocast": "fp16"}, TypeError, r"`run_autopsy\(autocast='fp16'\)` must be a callable returning a context"),
    ],
)
def test_a_bad_argument_raises_naming_it_its_value_and_the_fix(change: dict[str, Any], error: type, match: str) -> None:
    model = MLP()
    kwargs: dict[str, Any] = {
        "run": mse(model, batch()),
        "rng": RngState.capture(),
        "scale": 2.0,
        "step": 0,
        "dtype": FP16,
    }
    with pytest.raises(error, match=match):
        run_autopsy(model, **{**kwargs, **change})


def test_a_run_that_returns_no_scalar_loss_raises_type_error() -> None:
    model = MLP()
    x, _ = batch()
    with pytest.raises(TypeError, match=r"`run\(\)` returned a tensor of shape \(8, 1\)"):
        run_autopsy(model, lambda: model(x), rng=RngState.capture(), scale=2.0, step=0, dtype=FP16)


def test_rng_state_with_host_puts_back_torch_python_and_numpy_streams() -> None:
    state = RngState.capture(host=True)
    drawn = torch.rand(4), random.random(), np.random.rand()
    state.restore()
    assert torch.equal(drawn[0], torch.rand(4)) and drawn[1] == random.random() and drawn[2] == np.random.rand()


def test_the_batch_start_capture_holds_torchs_generators_only() -> None:
    # Python's and NumPy's cost more than torch's and a forward rarely draws from them; the replay restores them anyway.
    state = RngState.capture()
    torch_draw = torch.rand(4)
    random.random()
    python_after = random.getstate()
    state.restore()
    assert (state.python, state.numpy) == (None, None)
    assert torch.equal(torch_draw, torch.rand(4)) and random.getstate() == python_after


def test_a_caller_that_carries_autocast_itself_gets_the_same_diagnosis_with_fp32_unknown() -> None:
    model = fault_c()
    forward = mse(model, batch())

    def carried() -> Tensor:
        with torch.autocast("cpu", dtype=FP16):
            return forward()

    record = run_autopsy(model, carried, rng=RngState.capture(), scale=2.0**16, step=0, dtype=FP16)
    assert record is not None and (record.kind, record.module, record.finite_in_fp32) == (
        "backward",
        "blocks.1.extra",
        None,
    )
    assert "its backward is broken" in record.message and "in FP32" not in record.message
