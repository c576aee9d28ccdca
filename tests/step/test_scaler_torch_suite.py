"""PyTorch's own GradScaler tests (``test_grad_scaling_*`` in PyTorch's test suite), rewritten for CPU and run twice:
once with ``torch.amp.GradScaler``, to show each test holds for the reference, and once with ``DynamicLossScaler``.

Where ours differs on purpose, the test states both behaviours (documented in docs/migrating.md with the other
differences from GradScaler): hyperparameters are kept on ``load_state_dict``, the scale has a ceiling, a scale that
would overflow float32 is refused, and optimizers of GradScaler's old ``step(grad_scaler=...)`` protocol are stepped
without it.
"""

from __future__ import annotations

import copy
import itertools
import math
import pickle
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_amp_plus import DynamicLossScaler

INF, NAN = float("inf"), float("nan")
F32_MAX = torch.finfo(torch.float32).max
Scaler = Any  # torch.amp.GradScaler | DynamicLossScaler
MakeScaler = Callable[..., Scaler]


def grad_scaler(**kwargs: Any) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", **kwargs)


def ours(**kwargs: Any) -> DynamicLossScaler:
    # The suite's scales stay between 1 and 2**12 except where a test says otherwise; no skip limit in 4 steps.
    return DynamicLossScaler("cpu", **kwargs)


SCALERS = [pytest.param(grad_scaler, id="GradScaler"), pytest.param(ours, id="DynamicLossScaler")]


@dataclass
class Case:
    """A model and optimizer that will be scaled, an identical control pair that will not, and four batches."""

    control: nn.Sequential
    scaling: nn.Sequential
    opt_control: torch.optim.Optimizer
    opt_scaling: torch.optim.Optimizer
    data: list[tuple[Tensor, Tensor]]
    skip_iter: int = 2

    @staticmethod
    def make(optimizer: type[torch.optim.Optimizer] = torch.optim.SGD, **optimizer_kwargs: Any) -> Case:
        torch.manual_seed(0)
        control = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        scaling = copy.deepcopy(control)
        kwargs = {"lr": 1.0, **optimizer_kwargs}
        data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(4)]
        return Case(control, scaling, optimizer(control.parameters(), **kwargs),
                    optimizer(scaling.parameters(), **kwargs), data)  # fmt: skip

    def batches(self) -> Iterator[tuple[int, Tensor, Tensor]]:
        for i, (x, y) in enumerate(self.data):
            yield i, x, y


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output.float(), target)


Run = Callable[[Case, nn.Sequential, torch.optim.Optimizer, Scaler, bool], Scaler | None]


def run_scaling_case(
    make: MakeScaler,
    run: Run,
    unskipped: int,
    skipped: int,
    atol: float = 1e-7,
    optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
    **optimizer_kwargs: Any,
) -> None:
    """Train the control without scaling and the copy with it; compare scales, gradients, state and parameters.

    ``enabled`` True and False: scaling must be switchable without changing the loop. The scale starts at 128 and
    doubles at every clean step (growth_interval=1), so any mistake in growth or backoff shows in the final scale.
    """
    for enabled in (True, False):
        case = Case.make(optimizer, **optimizer_kwargs)
        scaler = make(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)
        run(case, case.control, case.opt_control, scaler, False)
        scaler = run(case, case.scaling, case.opt_scaling, scaler, True) or scaler
        if enabled:
            expected = 128.0 * scaler.get_growth_factor() ** unskipped * scaler.get_backoff_factor() ** skipped
            assert scaler.get_scale() == expected
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(case.control.parameters(), case.scaling.parameters(), strict=True):
            torch.testing.assert_close(s.grad, c.grad, atol=atol, rtol=1e-5)
            for key, value in case.opt_control.state[c].items():
                torch.testing.assert_close(case.opt_scaling.state[s][key], value, atol=atol, rtol=1e-5, msg=key)
            torch.testing.assert_close(s, c, atol=atol, rtol=1e-5)


def inject_inf(model: nn.Sequential) -> None:
    assert model[1].weight.grad is not None
    with torch.no_grad():
        model[1].weight.grad.fill_(INF)


# ------------------------------------------------------------------------------------------------ unit behaviours
@pytest.mark.parametrize("make", SCALERS)
def test_update_grows_after_the_interval_and_backs_off_on_an_overflow(make: MakeScaler) -> None:
    scaler = make(init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    scales = []
    for overflow in (False, False, True):  # two clean iterations, then a skipped one
        opt.zero_grad()
        scaler.scale(w.sum() * (INF if overflow else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [4.0, 8.0, 2.0]


@pytest.mark.parametrize("make", SCALERS)
@pytest.mark.parametrize("bad", [None, INF, NAN])
def test_unscale_divides_by_the_scale_and_an_inf_or_nan_skips_the_step(make: MakeScaler, bad: float | None) -> None:
    scaler = make(init_scale=4.0)
    p = nn.Parameter(torch.zeros(2, 3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler.scale(torch.zeros(()))  # creates GradScaler's scale tensor, as a loss would
    p.grad = torch.full((2, 3), 4.0)
    if bad is not None:
        p.grad[1, 2] = bad
    scaler.unscale_(opt)
    if bad is None:
        torch.testing.assert_close(p.grad, torch.ones(2, 3), rtol=0, atol=0)
    scaler.step(opt)
    scaler.update()
    expected = torch.zeros(2, 3) if bad is not None else -torch.ones(2, 3)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("make", SCALERS)
@pytest.mark.parametrize("bad", [None, INF, NAN])
def test_unscale_handles_sparse_gradients(make: MakeScaler, bad: float | None) -> None:
    scaler = make(init_scale=4.0)
    scaler.scale(torch.zeros(()))
    indices = torch.tensor([[0, 1, 1], [2, 0, 2]])
    values = torch.tensor([16.0, 32.0, 64.0 if bad is None else bad])
    s = torch.sparse_coo_tensor(indices, values, (2, 3), check_invariants=True)
    p = nn.Parameter(torch.zeros(2, 3).to_sparse())
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone()
    scaler.unscale_(opt)
    if bad is None:
        torch.testing.assert_close(p.grad.to_dense(), (s / 4).to_dense(), rtol=0, atol=0)
    scaler.step(opt)
    scaler.update()
    skipped = bad is not None
    assert torch.equal(p.detach().to_dense(), torch.zeros(2, 3)) == skipped


def test_unscale_handles_fp16_sparse_gradients_which_grad_scaler_refuses() -> None:
    # GradScaler.unscale_ raises on fp16 gradients (its test calls a private method with allow_fp16=True instead).
    indices = torch.tensor([[0, 1, 1], [2, 0, 2]])
    s = torch.sparse_coo_tensor(indices, torch.tensor([16.0, 32.0, 64.0]), (2, 3), check_invariants=True).half()
    p = nn.Parameter(torch.zeros(2, 3, dtype=torch.float16).to_sparse())
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = s.clone()
    scaler = ours(init_scale=4.0)
    scaler.unscale_(opt)
    assert not scaler.engine.found_inf(opt)
    torch.testing.assert_close(p.grad.to_dense(), (s / 4).to_dense(), rtol=0, atol=0)


@pytest.mark.parametrize("make", SCALERS)
@pytest.mark.parametrize("scaled_first", [True, False], ids=["scale-created", "lazy"])
def test_load_state_dict_restores_the_scale(make: MakeScaler, scaled_first: bool) -> None:
    s0 = make(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = make(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    if scaled_first:
        s1.scale(torch.full((1,), 4.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0
    hyperparameters = (s1.get_growth_factor(), s1.get_backoff_factor(), s1.get_growth_interval())
    if isinstance(s1, DynamicLossScaler):
        # Deliberate difference: the constructor's hyperparameters stay, and a warning names the saved ones.
        assert hyperparameters == (7.0, 0.8, 1)
        assert any("growth_factor" in str(w.message) for w in caught)
    else:
        assert hyperparameters == (4.0, 0.5, 2)


@pytest.mark.parametrize("make", SCALERS)
def test_scale_multiplies_nested_outputs(make: MakeScaler) -> None:
    scaler = make(init_scale=2.0)
    t = torch.full((1,), 4.0)
    outputs = scaler.scale((t.clone(), (t.clone(), t.clone()), [t.clone(), (t.clone(), t.clone())]))
    flat = [outputs[0], *outputs[1], outputs[2][0], *outputs[2][1]]
    assert [v.item() for v in flat] == [8.0] * 6
    assert [v.item() for v in scaler.scale(iter([t, t]))] == [8.0, 8.0]  # any iterable, lazily


@pytest.mark.parametrize("make", SCALERS)
def test_a_scale_that_keeps_growing_never_becomes_inf_or_nan(make: MakeScaler) -> None:
    # Ours has a ceiling (default 2**24, a deliberate difference): raised to float32's largest value here.
    bound = {} if make is grad_scaler else {"max_scale": F32_MAX}
    scaler = make(growth_interval=1, growth_factor=2.0**4, init_scale=1e38, **bound)
    model = nn.Linear(5, 1)
    opt = torch.optim.Adam(model.parameters())
    loss = ((model(torch.randn(1, 5)) - 1e-30 * torch.randn(1, 1)) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    scale = scaler.get_scale()
    assert scale == scale and scale != INF


# ------------------------------------------------------------------------------------------------ training loops
def autocast_run(try_pickle: bool) -> Run:
    def run(case: Case, model: nn.Sequential, opt: torch.optim.Optimizer, scaler: Scaler, scaled: bool) -> Scaler:
        for i, x, y in case.batches():
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaled):
                loss = loss_fn(model(x), y)
            if scaled:
                scaler.scale(loss).backward()
                if i == case.skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(opt)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if not scaler.is_enabled() or i != case.skip_iter:
                    opt.step()
        return scaler

    return run


OPTIMIZERS = [
    pytest.param(torch.optim.SGD, {}, id="SGD"),
    pytest.param(torch.optim.SGD, {"foreach": True}, id="SGD-foreach"),
    pytest.param(torch.optim.Adam, {}, id="Adam"),
    pytest.param(torch.optim.Adam, {"fused": True}, id="Adam-fused"),
    pytest.param(torch.optim.AdamW, {"foreach": True}, id="AdamW-foreach"),
    pytest.param(torch.optim.AdamW, {"fused": True}, id="AdamW-fused"),
]


@pytest.mark.parametrize("make", SCALERS)
@pytest.mark.parametrize(("optimizer", "kwargs"), OPTIMIZERS)
@pytest.mark.parametrize("try_pickle", [False, True], ids=["", "pickled-each-step"])
def test_scaling_with_autocast_matches_an_unscaled_fp32_run(
    make: MakeScaler, optimizer: type[torch.optim.Optimizer], kwargs: dict[str, Any], try_pickle: bool
) -> None:
    # fp16 autocast against pure fp32: fp16 rounding of activations and weights in the matmuls (~1e-3 relative)
    # carried through 3 steps at lr=1.0. Adam normalises each update, so its parameters move by ~lr whatever the
    # gradient's size: the same relative error becomes absolute there (torch's own test expects it to fail at 1e-3).
    atol = 1e-3 if optimizer is torch.optim.SGD else 5e-2
    run_scaling_case(make, autocast_run(try_pickle), unskipped=3, skipped=1, atol=atol, optimizer=optimizer, **kwargs)


@pytest.mark.parametrize(("optimizer", "kwargs"), OPTIMIZERS)
def test_scaling_with_autocast_is_bit_identical_to_grad_scaler(
    optimizer: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    runs = []
    for make in (grad_scaler, ours):
        case = Case.make(optimizer, **kwargs)
        scaler = make(init_scale=128.0, growth_interval=1)
        autocast_run(try_pickle=False)(case, case.scaling, case.opt_scaling, scaler, True)
        runs.append((scaler.get_scale(), list(case.scaling.parameters())))
    (theirs, their_params), (mine, my_params) = runs
    assert mine == theirs
    for a, b in zip(my_params, their_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same multiply by a power of two, the same skips


@pytest.mark.parametrize("make", SCALERS)
@pytest.mark.parametrize(
    ("optimizer", "amsgrad", "separate_unscale"),
    list(itertools.product((torch.optim.Adam, torch.optim.AdamW), (False, True), (False, True))),
)
def test_a_fused_optimizer_matches_its_unfused_twin(
    make: MakeScaler, optimizer: type[torch.optim.Optimizer], amsgrad: bool, separate_unscale: bool
) -> None:
    # The fused kernel unscales inside itself (or gets unscaled gradients after unscale_); the unfused one after the
    # scaler's unscale. Same math, different kernels: torch's assertEqual tolerances for float32.
    case = Case.make(optimizer, fused=True, amsgrad=amsgrad)
    opt_control = optimizer(case.control.parameters(), lr=1.0, fused=False, amsgrad=amsgrad)
    scaler = make(init_scale=128.0)
    for _, x, y in case.batches():
        for model, opt, unscale in ((case.control, opt_control, False), (case.scaling, case.opt_scaling, True)):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            if unscale and separate_unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
    for c, s in zip(case.control.parameters(), case.scaling.parameters(), strict=True):
        torch.testing.assert_close(s.grad, c.grad)
        torch.testing.assert_close(s, c)
        for key, value in opt_control.state[c].items():
            torch.testing.assert_close(case.opt_scaling.state[s][key].squeeze(), value.squeeze(), msg=key)


@pytest.mark.parametrize("make", SCALERS)
@pytest.mark.parametrize("kwargs", [{}, {"foreach": True}, {"fused": True}], ids=["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
def test_gradients_broken_after_unscale_reach_the_parameters(
    make: MakeScaler, optimizer: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    # The check belongs to unscale_: gradients made non-finite after it are stepped (in both scalers).
    case = Case.make(optimizer, **kwargs)
    scaler = make(init_scale=128.0)
    for _, x, y in case.batches():
        case.opt_control.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(case.control(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(case.opt_control)
        for j, param in enumerate(case.control.parameters()):
            assert param.grad is not None
            param.grad.copy_(torch.full_like(param.grad, INF if j % 2 else NAN))
        scaler.step(case.opt_control)
        scaler.update()
    assert all(not p.isfinite().all() for p in case.control.parameters())


@pytest.mark.parametrize("make", SCALERS)
def test_clipping_scaled_gradients_by_a_scaled_norm(make: MakeScaler) -> None:
    def run(case: Case, model: nn.Sequential, opt: torch.optim.Optimizer, scaler: Scaler, scaled: bool) -> None:
        max_norm = 0.2  # small enough to clip these gradients
        for i, x, y in case.batches():
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            if scaled:
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == case.skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != case.skip_iter:
                    opt.step()

    # Clipping at max_norm * scale on scaled gradients equals clipping unscaled ones up to float32 rounding.
    run_scaling_case(make, run, unskipped=3, skipped=1, atol=1e-5)


@pytest.mark.parametrize("make", SCALERS)
@pytest.mark.parametrize("ours_clip", [False, True], ids=["torch-clip", "scaler-clip"])
def test_clipping_after_a_separate_unscale(make: MakeScaler, ours_clip: bool) -> None:
    if ours_clip and make is grad_scaler:
        pytest.skip("GradScaler has no clip_grad_norm_")

    def run(case: Case, model: nn.Sequential, opt: torch.optim.Optimizer, scaler: Scaler, scaled: bool) -> None:
        max_norm = 0.2
        for i, x, y in case.batches():
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            if scaled:
                scaler.scale(loss).backward()
                if i == case.skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.unscale_(opt)
                if ours_clip:
                    scaler.clip_grad_norm_(opt, max_norm)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if not scaler.is_enabled() or i != case.skip_iter:
                    opt.step()

    # Our global norm sums per-tensor float32 squares, torch's takes the norm of per-tensor norms: last-bit
    # differences in the clip coefficient, carried through 3 SGD steps at lr=1.0.
    run_scaling_case(make, run, unskipped=3, skipped=1, atol=1e-6 if ours_clip else 1e-7)


@pytest.mark.parametrize("make", SCALERS)
def test_a_gradient_penalty_through_scaled_gradients(make: MakeScaler) -> None:
    def run(case: Case, model: nn.Sequential, opt: torch.optim.Optimizer, scaler: Scaler, scaled: bool) -> None:
        for i, x, y in case.batches():
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            if scaled:
                grads = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grads = tuple(g * inv_scale for g in grads)
            else:
                grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
            loss = loss + torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()
            if scaled:
                scaler.scale(loss).backward()
                if i == case.skip_iter and scaler.is_enabled():
                    inject_inf(model)
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                if not scaler.is_enabled() or i != case.skip_iter:
                    opt.step()

    run_scaling_case(make, run, unskipped=3, skipped=1)


@pytest.mark.parametrize("make", SCALERS)
def test_gradient_accumulation_over_two_batches(make: MakeScaler) -> None:
    def run(case: Case, model: nn.Sequential, opt: torch.optim.Optimizer, scaler: Scaler, scaled: bool) -> None:
        accumulate = 2
        for i, x, y in case.batches():
            loss = loss_fn(model(x), y) / accumulate
            (scaler.scale(loss) if scaled else loss).backward()
            if (i + 1) % accumulate == 0:
                if scaled:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()

    run_scaling_case(make, run, unskipped=2, skipped=0)


@pytest.mark.parametrize("make", SCALERS)
@pytest.mark.parametrize("enabled", [True, False])
def test_two_models_two_optimizers_two_losses(make: MakeScaler, enabled: bool) -> None:
    case0, case1 = Case.make(), Case.make()
    torch.manual_seed(1)
    for model in (case1.control, case1.scaling):  # the second pair starts elsewhere than the first
        for p in model.parameters():
            nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(p.numel()))
    scaler = make(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

    def run(model0: nn.Module, model1: nn.Sequential, opt0: Any, opt1: Any, scaled: bool) -> None:
        for i, x, y in case0.batches():
            opt0.zero_grad()
            opt1.zero_grad()
            out0, out1 = model0(x), model1(x)
            loss0 = loss_fn(0.3 * out0 + 0.7 * out1, y)
            loss1 = loss_fn(0.6 * out0 - 0.4 * out1, y)
            if scaled:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                if i == case0.skip_iter and scaler.is_enabled():
                    inject_inf(model1)
                scaler.unscale_(opt0)  # one optimizer unscaled separately, as a stress test
                scaler.step(opt0)
                scaler.step(opt1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                opt0.step()
                if not scaler.is_enabled() or i != case0.skip_iter:
                    opt1.step()

    run(case0.control, case1.control, case0.opt_control, case1.opt_control, False)
    run(case0.scaling, case1.scaling, case0.opt_scaling, case1.opt_scaling, True)
    expected = 128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() if enabled else 1.0
    assert scaler.get_scale() == expected
    pairs = itertools.chain(
        zip(case0.control.parameters(), case0.scaling.parameters(), strict=True),
        zip(case1.control.parameters(), case1.scaling.parameters(), strict=True),
    )
    for c, s in pairs:
        torch.testing.assert_close(s, c, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------- the fused-optimizer protocol
class PlaceHolder(torch.optim.Optimizer):
    """An optimizer declaring ``_step_supports_amp_scaling``; its ``step`` records what it was handed."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})
        self._step_supports_amp_scaling = True
        self.seen: dict[str, Any] = {}


class OldProtocol(PlaceHolder):
    def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:  # type: ignore[override]
        self.seen = {"grad_scaler": grad_scaler, "grad_scale": getattr(self, "grad_scale", None)}
        self.seen["grad"] = self.param_groups[0]["params"][0].grad.clone()


class NewProtocol(PlaceHolder):
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.seen = {"grad_scale": self.grad_scale, "found_inf": self.found_inf}


@pytest.mark.parametrize("make", SCALERS)
def test_an_optimizer_of_the_new_protocol_is_handed_the_scale_and_the_flag(make: MakeScaler) -> None:
    m = nn.Linear(4, 1)
    opt = NewProtocol(m.parameters())
    scaler = make(init_scale=2.0)
    scaler.scale(m(torch.randn(4, 4)).mean()).backward()
    scaler.step(opt)
    scaler.update()
    assert isinstance(opt.seen["grad_scale"], Tensor) and opt.seen["grad_scale"].item() == 2.0
    assert isinstance(opt.seen["found_inf"], Tensor) and opt.seen["found_inf"].item() == 0.0
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # removed after the step


@pytest.mark.parametrize("make", SCALERS)
def test_an_optimizer_of_the_old_protocol(make: MakeScaler) -> None:
    m = nn.Linear(4, 1)
    nn.init.ones_(m.weight)
    opt = OldProtocol(m.parameters())
    scaler = make(init_scale=2.0)
    scaler.scale(m(torch.ones(1, 4)).sum()).backward()
    if make is grad_scaler:
        with pytest.warns(FutureWarning):
            scaler.step(opt)
        assert opt.seen["grad_scaler"] is scaler  # it unscales itself (and must record GradScaler's checks)
    else:
        # Deliberate difference: ours is not GradScaler, so it unscales first and passes nothing.
        scaler.step(opt)
        assert opt.seen["grad_scaler"] is None and opt.seen["grad_scale"] is None
        torch.testing.assert_close(opt.seen["grad"], torch.ones(1, 4), rtol=0, atol=0)
        scaler.update()


# ------------------------------------------------------------------------ the deliberate differences, as documented
def one_param_step(scaler: Scaler, grad: float = 1.0, unscale_first: bool = False) -> nn.Parameter:
    w = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=1.0)
    scaler.scale(torch.zeros(()))
    w.grad = torch.full((2,), grad)
    if unscale_first:
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return w


def test_factors_of_exactly_one_are_accepted_where_grad_scaler_asserts() -> None:
    for kwargs in ({"growth_factor": 1.0}, {"backoff_factor": 1.0}):
        with pytest.raises(AssertionError):
            grad_scaler(**kwargs)
        assert ours(**kwargs).get_scale() == 2.0**16


def test_grad_scaler_for_cuda_without_cuda_disables_itself_ours_keeps_scaling() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.warns(UserWarning, match="CUDA is not available"):
        assert not torch.amp.GradScaler("cuda").is_enabled()
    assert DynamicLossScaler("cuda").is_enabled()


def test_a_second_unscale_is_a_no_op_and_unscale_after_step_raises() -> None:
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    theirs, mine = grad_scaler(init_scale=4.0), ours(init_scale=4.0)
    for scaler in (theirs, mine):
        w.grad = None
        scaler.scale(w.sum()).backward()
        scaler.unscale_(opt)
        if scaler is theirs:
            with pytest.raises(RuntimeError, match="already been called"):
                scaler.unscale_(opt)
        else:
            scaler.unscale_(opt)  # nothing happens: the gradients are unscaled once
            torch.testing.assert_close(w.grad, torch.ones(2), rtol=0, atol=0)
        scaler.step(opt)
        with pytest.raises(RuntimeError, match="after"):
            scaler.unscale_(opt)
        scaler.update()


def test_update_with_nothing_stepped_does_nothing_where_grad_scaler_raises() -> None:
    theirs, mine = grad_scaler(), ours(init_scale=8.0)
    theirs.scale(torch.zeros(()))
    with pytest.raises(AssertionError, match="No inf checks"):
        theirs.update()
    mine.update()
    assert mine.get_scale() == 8.0


def test_finite_gradients_whose_norm_overflows_float32_are_stepped_as_grad_scaler_steps_them_measured_or_not() -> None:
    # 1e20 is a finite float32; its square is not. GradScaler steps (and writes a parameter of -1e20). Only inf/NaN
    # values skip, so measuring the norm (after unscale_, or for a monitor) changes nothing: the same step each way.
    theirs = one_param_step(grad_scaler(init_scale=1.0), grad=1e20)
    measured_scaler = ours(init_scale=1.0)
    measured_scaler.engine.read_norms()  # what a monitor observing the scaler calls
    for mine in (
        one_param_step(ours(init_scale=1.0), grad=1e20),
        one_param_step(ours(init_scale=1.0), grad=1e20, unscale_first=True),
        one_param_step(measured_scaler, grad=1e20),
    ):
        assert torch.equal(mine.detach(), theirs.detach())
    assert torch.equal(theirs.detach(), torch.full((2,), -1e20))
    assert measured_scaler.skipped_steps == 0 and measured_scaler.get_scale() == 1.0


def test_a_clip_of_a_finite_gradient_whose_norm_overflows_float32_equals_clip_grad_norm() -> None:
    # The norm is inf: torch's coefficient max_norm / (inf + eps) is 0, and so is ours; the step is taken (its weight
    # decay moves the parameter: a skip would leave it at 1).
    def clipped(scaler: Scaler, clip: Any) -> nn.Parameter:
        w = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=1.0, momentum=0.9, weight_decay=0.5)
        scaler.scale(torch.zeros(()))
        w.grad = torch.full((2,), 1e20)
        scaler.unscale_(opt)
        assert clip(opt, w) == math.inf
        scaler.step(opt)
        scaler.update()
        return w

    theirs = clipped(grad_scaler(init_scale=1.0), lambda opt, w: float(torch.nn.utils.clip_grad_norm_([w], 1.0)))
    scaler = ours(init_scale=1.0)
    mine = clipped(scaler, lambda opt, w: scaler.clip_grad_norm_(opt, 1.0))
    assert torch.equal(mine.detach(), theirs.detach()) and torch.equal(theirs.detach(), torch.full((2,), 0.5))
    assert scaler.skipped_steps == 0


def test_get_scale_reads_nothing_from_the_device_on_the_unscale_path(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = ours(init_scale=8.0)
    one_param_step(mine)
    calls: list[str] = []
    monkeypatch.setattr(Tensor, "item", lambda self: calls.append("item") or 0.0)
    assert mine.get_scale() == 8.0 and calls == []
