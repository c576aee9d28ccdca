"""DynamicLossScaler as a drop-in for torch.amp.GradScaler: constructor, enabled=False, accessors, pickling, dtypes.

The reference is GradScaler itself: each behaviour is checked on both classes where GradScaler has it.
"""

from __future__ import annotations

import copy
import inspect
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import call_counts
from torch import nn

from lightning_amp_plus import DynamicLossScaler
from lightning_amp_plus.step.engine import StepResult

INF = float("inf")
Scaler = DynamicLossScaler | torch.amp.GradScaler


def both(**kwargs: Any) -> list[Any]:
    """A GradScaler and a DynamicLossScaler built with the same GradScaler arguments (the device first)."""
    return [
        pytest.param(lambda: torch.amp.GradScaler("cpu", **kwargs), id="GradScaler"),
        pytest.param(lambda: DynamicLossScaler("cpu", **kwargs), id="DynamicLossScaler"),
    ]


# ------------------------------------------------------------------------------------------------ the constructor
def test_the_constructor_takes_grad_scalers_arguments_in_grad_scalers_order() -> None:
    theirs = list(inspect.signature(torch.amp.GradScaler.__init__).parameters.values())[1:]
    ours = list(inspect.signature(DynamicLossScaler.__init__).parameters.values())[1 : len(theirs) + 1]
    assert [p.name for p in ours] == [p.name for p in theirs]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in ours)
    # Same defaults, except the device: GradScaler's "cuda", ours None (the scale follows the loss).
    assert [p.default for p in ours[1:]] == [p.default for p in theirs[1:]]


# ids: "cuda" alone would read as the CUDA marker's keyword and skip the case on CPU machines.
@pytest.mark.parametrize("device", ["cuda", "cpu", torch.device("cpu"), None], ids=lambda d: f"device={d!r}")
def test_the_first_argument_is_the_device_as_in_grad_scaler(device: Any) -> None:
    scaler = DynamicLossScaler(device, init_scale=1024)
    assert scaler.get_scale() == 1024.0 and scaler.is_enabled()
    assert DynamicLossScaler(device, 512.0).get_scale() == 512.0  # init_scale second, positionally


def test_the_scale_follows_the_loss_whatever_device_was_named() -> None:
    # GradScaler("cuda") disables itself without CUDA; ours keeps scaling where the loss is (a documented difference).
    scaler = DynamicLossScaler("cuda", init_scale=4.0)
    assert scaler.scale(torch.tensor(1.5)).item() == 6.0


def test_a_number_first_is_refused_as_a_device_naming_the_keyword_for_the_scale() -> None:
    # GradScaler's first argument is the device: a scale given there is a mistake, said as such.
    with pytest.raises(ValueError, match=r"device=256\.0.*device type.*init_scale="):
        DynamicLossScaler(2.0**8)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kwargs", "error"), [({"device": "no-such-device"}, ValueError), ({"enabled": 1}, TypeError)])
def test_a_bad_device_or_enabled_flag_raises_naming_it(kwargs: dict[str, Any], error: type[Exception]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(error, match=rf"{name}={kwargs[name]!r}"):
        DynamicLossScaler(**kwargs)


def test_every_public_grad_scaler_method_exists() -> None:
    public = [name for name in dir(torch.amp.GradScaler) if not name.startswith("_")]
    assert public  # scale, unscale_, step, update, get_scale, the accessors, state_dict...
    assert [name for name in public if not callable(getattr(DynamicLossScaler, name, None))] == []


# ------------------------------------------------------------------------------------------------ enabled=False
def one_step(scaler: Scaler, closure: bool = False) -> tuple[Any, nn.Parameter, Any]:
    w = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.5)
    loss = (w * 2).sum()
    scaled = scaler.scale(loss)
    scaled.backward()
    scaler.unscale_(opt)
    result = scaler.step(opt, lambda: loss) if closure else scaler.step(opt)
    scaler.update()
    return (scaled is loss), w, result


@pytest.mark.parametrize("make", both(enabled=False))
def test_when_disabled_every_method_is_a_pass_through(make: Callable[[], Scaler]) -> None:
    scaler = make()
    same_loss, w, result = one_step(scaler, closure=True)
    assert same_loss and not scaler.is_enabled()
    # unscale_ did nothing, step() stepped with the closure and returned its loss, update() did nothing.
    torch.testing.assert_close(w.detach(), torch.zeros(3), rtol=0, atol=0)
    assert result is not None and result.item() == 6.0
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    scaler.load_state_dict({"scale": 8.0})  # ignored, as GradScaler ignores it
    assert scaler.get_scale() == 1.0


# ----------------------------------------------------------------------------------------- patched on an instance
CALLS = ("scale", "unscale_", "step", "update")


def calls_in_a_loop(scaler: Scaler, unscale: bool, fused: bool) -> dict[str, int]:
    """Each method's calls in 3 steps of AdamW, counted by ``mock.patch.object`` on the instance."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), fused=fused)
    with call_counts(scaler, CALLS) as patched:
        for _ in range(3):
            scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
            if unscale:  # nanoGPT's loop: unscale_, then torch's clip
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return {name: method.call_count for name, method in patched.items()}


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("unscale", [False, True], ids=["step-alone", "unscale_-then-step"])
def test_patched_methods_count_the_calls_they_count_on_grad_scaler(unscale: bool, fused: bool) -> None:
    # GradScaler's step calls self.unscale_ when nothing did (unless the optimizer unscales in its kernel): a patched
    # unscale_ sees that call too. Lightning's and users' tests patch these on the instance.
    ours = calls_in_a_loop(DynamicLossScaler("cpu"), unscale, fused)
    assert ours == calls_in_a_loop(torch.amp.GradScaler("cpu"), unscale, fused)
    assert ours["unscale_"] == (0 if fused and not unscale else 3)


def test_when_disabled_the_extras_are_pass_throughs_too() -> None:
    scaler = DynamicLossScaler(enabled=False)
    w = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([w], lr=0.1)
    (w * 3).sum().backward()
    reference = nn.Parameter(torch.ones(4))
    reference.grad = torch.full((4,), 3.0)
    expected = torch.nn.utils.clip_grad_norm_([reference], 1.0)
    assert scaler.clip_grad_norm_(opt, max_norm=1.0) == float(expected) == pytest.approx(6.0)
    torch.testing.assert_close(w.grad, reference.grad, rtol=0, atol=0)  # clipped by torch's own clip_grad_norm_
    assert not scaler.engine.found_inf(opt) and scaler.skipped_steps == 0


def test_the_nanogpt_pattern_trains_exactly_as_without_a_scaler_in_bf16() -> None:
    def train(scaler: Scaler | None) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.randn(4, 8, generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                scaler.clip_grad_norm_(opt, 1e9)
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
        return model

    dtype = "bfloat16"
    ours = train(DynamicLossScaler(enabled=(dtype == "float16")))
    plain = train(None)
    for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same operations: bit-identical


# ------------------------------------------------------------------------------------------------------ accessors
@pytest.mark.parametrize("make", both(init_scale=8.0, growth_interval=1))
def test_the_factor_and_interval_setters_change_the_policy_as_grad_scalers_do(make: Callable[[], Scaler]) -> None:
    scaler = make()
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(2)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (4.0, 0.25, 2)
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    scales = []
    for bad in (False, False, True):
        opt.zero_grad()
        scaler.scale(w.sum() * (INF if bad else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [8.0, 32.0, 8.0]


@pytest.mark.parametrize(
    ("setter", "value"),
    [("set_growth_factor", 0.5), ("set_backoff_factor", 1.5), ("set_backoff_factor", 0.0), ("set_growth_interval", 0)],
)
def test_the_setters_refuse_values_the_constructor_refuses(setter: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"{setter}\(.*={value!r}\)"):
        getattr(DynamicLossScaler(), setter)(value)


@pytest.mark.parametrize("make", both(init_scale=8.0))
def test_update_accepts_a_new_scale_as_a_tensor(make: Callable[[], Scaler]) -> None:
    scaler = make()
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=torch.tensor(1024.0))
    assert scaler.get_scale() == 1024.0


@pytest.mark.parametrize(
    "bad", [torch.ones(2), torch.ones((), requires_grad=True), torch.tensor(3), torch.tensor(-1.0)], ids=str
)
def test_update_refuses_a_tensor_that_is_not_one_positive_float(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="new_scale"):
        DynamicLossScaler().update(new_scale=bad)


# ------------------------------------------------------------------------------------------------------- pickling
def train_steps(scaler: Scaler, model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    scales = []
    for step in steps:
        opt.zero_grad()
        x = torch.full((2, 4), float(step % 3))
        loss = model(x).pow(2).mean() * (INF if step % 4 == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("fused", [False, True])
def test_a_pickled_scaler_continues_exactly_like_the_original(fused: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=fused)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=2, hysteresis=2)
    train_steps(scaler, model, opt, range(6))
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state_dict() == scaler.state_dict()
    model2 = copy.deepcopy(model)
    opt2 = type(opt)(model2.parameters(), lr=0.1, fused=fused)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # a copy: loading shares the tensors otherwise
    assert train_steps(clone, model2, opt2, range(6, 12)) == train_steps(scaler, model, opt, range(6, 12))
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert clone.skipped_steps == scaler.skipped_steps


@pytest.mark.parametrize("make", both())
def test_pickling_in_the_middle_of_an_iteration_is_refused(make: Callable[[], Scaler]) -> None:
    scaler = make()
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    with pytest.raises((RuntimeError, AssertionError), match="pickled"):
        pickle.dumps(scaler)
    scaler.update()
    pickle.dumps(scaler)


# ---------------------------------------------------------------------------------------------------------- dtypes
def grad_scaler_parity(make_model: Callable[[], nn.Module], batch: Callable[[int], torch.Tensor], steps: int) -> None:
    """Train the same model with GradScaler and with ours (an overflow injected at step 2): identical results."""

    def run(scaler: Scaler) -> tuple[list[float], nn.Module]:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scales = []
        for step in range(steps):
            opt.zero_grad()
            loss = model(batch(step)).sum() * (INF if step == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, model

    ours, our_model = run(DynamicLossScaler(init_scale=2.0**10, growth_interval=3))
    theirs, their_model = run(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3))
    assert ours == theirs
    for a, b in zip(our_model.parameters(), their_model.parameters(), strict=True):
        # Both multiply by the same power-of-two inverse scale and skip the same step.
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_float64_gradients_are_unscaled_and_checked_as_grad_scaler_does() -> None:
    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Linear(4, 1).double()

    grad_scaler_parity(make_model, lambda step: torch.full((3, 4), 0.5 + step, dtype=torch.float64), steps=8)


def test_sparse_gradients_are_unscaled_and_checked_as_grad_scaler_does() -> None:
    def make_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Embedding(10, 3, sparse=True)

    # Repeated indices: the sparse gradient has duplicates (uncoalesced), as embeddings produce.
    grad_scaler_parity(make_model, lambda step: torch.tensor([step % 10, 3, 3, 7]), steps=8)


def test_the_norm_of_a_sparse_gradient_is_that_of_its_dense_equivalent() -> None:
    emb = nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=8.0)
    scaler.scale(emb(torch.tensor([1, 3, 3, 3])).sum()).backward()
    assert emb.weight.grad is not None and not emb.weight.grad.is_coalesced()
    scaler.unscale_(opt)
    dense = emb.weight.grad.to_dense()
    norm = scaler.clip_grad_norm_(opt, 1e9)  # measured for the clip
    scaler.step(opt)
    torch.testing.assert_close(torch.tensor(norm), torch.linalg.vector_norm(dense))
    assert scaler.result(opt).grad_norm == norm  # type: ignore[union-attr]
    torch.testing.assert_close(dense[3], torch.full((3,), 3.0), rtol=0, atol=0)  # three ones, unscaled


def test_fp16_sparse_duplicates_that_overflow_once_summed_are_caught() -> None:
    # 64000 + 64000 is beyond fp16's 65504: fine stored apart, inf once the optimizer sums them (as in torch's test).
    p = nn.Parameter(torch.zeros(2, 3, dtype=torch.float16).to_sparse())
    opt = torch.optim.SGD([p], lr=1.0)
    indices = torch.tensor([[0, 1, 0], [2, 0, 2]])
    values = torch.tensor([64000.0, 32.0, 64000.0])
    p.grad = torch.sparse_coo_tensor(indices, values, (2, 3), dtype=torch.float16, check_invariants=True)
    scaler = DynamicLossScaler(init_scale=1.0)
    scaler.unscale_(opt)
    assert scaler.engine.found_inf(opt)


def test_when_disabled_every_step_has_an_applied_outcome() -> None:
    scaler = DynamicLossScaler(enabled=False)
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1, fused=True)
    (w * INF).sum().backward()
    scaler.step(opt)
    outcome = scaler.result(opt)
    assert isinstance(outcome, StepResult) and not outcome.skipped and outcome.scale is None  # no fused path
