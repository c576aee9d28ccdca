"""DynamicLossScaler in a plain PyTorch loop: parity with torch.amp.GradScaler, the floor, limits, state, syncs."""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import assert_same_parameters, host_reads, skip_bound
from torch import nn

from lightning_amp_plus import DynamicLossScaler

INF_STEPS = {5, 6, 40, 41, 42, 43, 120, 199}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def batches(n: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    for step in range(n):
        x = torch.randn(4, 8, generator=gen)
        yield step, x, x.sum(1, keepdim=True)


def loss_at(model: nn.Module, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    return loss * float("inf") if step in INF_STEPS else loss


def train(
    scaler: Any, steps: int = 200, clip: float | None = None, opt_cls: type = torch.optim.Adam
) -> tuple[list[float], nn.Module]:
    model = make_model()
    opt = opt_cls(model.parameters(), lr=1e-2)
    scales = []
    for step, x, y in batches(steps):
        opt.zero_grad()
        scaler.scale(loss_at(model, step, x, y)).backward()
        scaler.unscale_(opt)
        if clip is not None:
            if isinstance(scaler, DynamicLossScaler):
                scaler.clip_grad_norm_(opt, clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, model


# ------------------------------------------------------------------------------------------------------------ parity
def test_parity_with_grad_scaler_over_200_fp16_steps_with_injected_overflows() -> None:
    ours, model_ours = train(DynamicLossScaler(growth_interval=10))
    torchs, model_torch = train(torch.amp.GradScaler("cpu", growth_interval=10))
    assert ours == torchs
    assert min(ours) < 2.0**16 < max(ours)  # the run both grew and backed off
    # Same unscale (multiply by the same power-of-two inverse), same skip decisions, same Adam: bit-identical.
    assert_same_parameters(model_ours, model_torch, rtol=0, atol=0)


def test_parity_with_grad_scaler_and_clip_grad_norm() -> None:
    ours, model_ours = train(DynamicLossScaler(growth_interval=10), clip=0.5)
    torchs, model_torch = train(torch.amp.GradScaler("cpu", growth_interval=10), clip=0.5)
    assert ours == torchs
    # The norm is torch's get_total_norm of the unscaled gradients and the coefficient is formed as torch forms it:
    # clip_grad_norm_'s gradients, so the same Adam steps, bit for bit.
    assert_same_parameters(model_ours, model_torch, rtol=0, atol=0)


def test_last_grad_norm_is_the_unscaled_norm_clip_grad_norm_reports() -> None:
    model = make_model()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    _, x, y = next(batches(1))
    scaler.scale(loss_at(model, 0, x, y)).backward()
    norm = scaler.clip_grad_norm_(opt, 1e9)
    loss_at(reference, 0, x, y).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    # fp16 autocast: gradients of the scaled and unscaled loss differ by fp16 rounding of intermediate values.
    torch.testing.assert_close(torch.tensor(norm), expected, rtol=1e-3, atol=0)
    assert scaler.result(opt) is None  # not stepped yet
    scaler.step(opt)
    assert scaler.result(opt).grad_norm == norm


# ----------------------------------------------------------------------------------------------- floor and limits
def test_scale_never_reaches_zero_so_parameters_stay_finite_where_grad_scaler_produces_nan() -> None:
    def run(scaler: Any) -> tuple[float, torch.Tensor]:
        weight = nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([weight], lr=0.1)
        for step in range(230):
            loss = (weight * 2).sum() * (float("inf") if step < 200 else 1.0)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale(), weight.detach()

    torch_scale, torch_weight = run(torch.amp.GradScaler("cpu"))
    assert torch_scale == 0.0 and torch_weight.isnan().all()  # the hole, reproduced
    our_scale, our_weight = run(DynamicLossScaler(max_consecutive_skips=None))
    assert our_scale == 1.0
    # 30 clean SGD steps of lr * grad = 0.1 * 2 each, from 1.0: exact in float32 up to rounding of 0.2 steps.
    torch.testing.assert_close(our_weight, torch.full((4,), 1.0 - 30 * 0.2), rtol=1e-5, atol=1e-5)


def test_skip_limit_raises_a_diagnosis_naming_parameters_scale_and_skips() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=4.0, max_consecutive_skips=3)
    scaler.engine.name_parameters(model)
    x = torch.randn(2, 8)
    with pytest.raises(FloatingPointError) as info:
        for _ in range(10):
            opt.zero_grad()
            model(x).sum().backward()
            model[2].weight.grad[0, 0] = float("nan")
            scaler.step(opt)
            scaler.update()
    message = str(info.value)
    # 4 -> 2 -> 1 (two skips above the floor), then three at the floor: five skipped in all.
    assert "3 optimizer steps in a row" in message and "5 skipped in all" in message
    assert "2.weight" in message and "0.weight" not in message
    assert "min_scale=1" in message and "max_consecutive_skips" in message
    assert scaler.skipped_steps == 5 and scaler.result(opt).overflow_params == ["2.weight"]


def overflow_forever(scaler: DynamicLossScaler, steps: int, fused: bool = False) -> int:
    """Step a one-parameter SGD whose every gradient is inf; return the steps taken before FloatingPointError."""
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1, fused=fused)
    for step in range(steps):
        opt.zero_grad()
        scaler.scale(w.sum() * float("inf")).backward()
        try:
            scaler.step(opt)
            scaler.update()
        except FloatingPointError:
            return step + 1
    return steps


@pytest.mark.parametrize("fused", [False, True], ids=["unscale-path", "fused-path"])
@pytest.mark.parametrize(
    ("kwargs", "bound"),
    [
        # The cases: a scale far above its floor with a hysteresis that never runs out, no backoff at all.
        ({"init_scale": 2.0**24, "hysteresis": 10**6}, 50),
        ({"backoff_factor": 1.0}, 50),
        ({"hysteresis": 10**9}, 50),
        # The defaults: 16 backoffs from 2**16 to the floor (at most 24, from max_scale), then 50 at the floor.
        ({}, 16 + 50),
        ({"init_scale": 2.0**24}, 24 + 50),
        # Two overflows tolerated (they count: backing off did not help), 16 backoffs, 3 more at the floor.
        ({"hysteresis": 3, "max_consecutive_skips": 5}, 16 + 5),
    ],
)
def test_a_run_whose_every_step_is_skipped_stops_within_the_bound_read_off_the_settings(
    kwargs: dict[str, Any], bound: int, fused: bool
) -> None:
    scaler = DynamicLossScaler(**kwargs)
    stopped_at = overflow_forever(scaler, steps=200, fused=fused)
    assert stopped_at == bound
    assert stopped_at <= skip_bound(scaler)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"init_scale": 4.0, "max_consecutive_skips": 2}, ["at its floor (scale=1, min_scale=1)", "lower `min_scale`"]),
        ({"hysteresis": 10**6, "max_consecutive_skips": 2}, ["hysteresis=1000000", "lower `hysteresis`"]),
        ({"backoff_factor": 1.0, "max_consecutive_skips": 2}, ["backoff_factor=1", "`backoff_factor` below 1"]),
    ],
)
def test_the_diagnosis_says_why_the_scale_could_not_help_and_what_to_change(
    kwargs: dict[str, Any], expected: list[str]
) -> None:
    scaler = DynamicLossScaler(**kwargs)
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(FloatingPointError) as info:
        overflow_forever_raising(scaler, w, opt)
    assert all(text in str(info.value) for text in expected), str(info.value)


def overflow_forever_raising(scaler: DynamicLossScaler, w: nn.Parameter, opt: torch.optim.Optimizer) -> None:
    for _ in range(100):
        opt.zero_grad()
        scaler.scale(w.sum() * float("inf")).backward()
        scaler.step(opt)
        scaler.update()


def test_the_documented_bound_is_max_consecutive_skips_plus_the_backoffs_to_the_floor() -> None:
    assert skip_bound(DynamicLossScaler()) == 50 + 24
    bounds = {"init_scale": 1.0, "min_scale": 2.0**-10, "max_scale": 2.0**10}
    assert skip_bound(DynamicLossScaler(**bounds, backoff_factor=0.25)) == 50 + 10
    assert skip_bound(DynamicLossScaler(backoff_factor=1.0)) == 50
    assert skip_bound(DynamicLossScaler(max_consecutive_skips=None)) is None


@pytest.mark.parametrize("tracker", ["_hysteresis_tracker", "_growth_tracker"])
def test_a_loaded_state_with_huge_trackers_does_not_postpone_the_stop(tracker: str) -> None:
    scaler = DynamicLossScaler(max_consecutive_skips=3)
    state = scaler.state_dict()
    state[tracker] = 2**40  # legal, but far beyond this scaler's hysteresis and growth interval
    scaler.load_state_dict(state)
    assert overflow_forever(scaler, steps=200) <= 3 + 24


def test_absurd_counters_in_a_state_are_refused_naming_the_key() -> None:
    for key in ("_hysteresis_tracker", "_growth_tracker", "skipped_steps", "consecutive_skips", "_floor_skips"):
        with pytest.raises(ValueError, match=rf"{key}=~1\.000e\+30 .*\[0, 2\*\*62\]"):
            DynamicLossScaler().load_state_dict({"scale": 8.0, key: 10**30})
        with pytest.raises(ValueError, match=rf"{key}=4611686018427387905;"):
            DynamicLossScaler().load_state_dict({"scale": 8.0, key: 2**62 + 1})


def test_a_scale_beyond_any_float_raises_a_value_error_naming_it_not_an_overflow_error() -> None:
    with pytest.raises(ValueError, match=r"init_scale=~1\.000e\+400 .*\[min_scale, max_scale\]"):
        DynamicLossScaler(init_scale=10**400)
    with pytest.raises(ValueError, match=r"scale=~1\.000e\+400 .*beyond the float range"):
        DynamicLossScaler().load_state_dict({"scale": 10**400})
    with pytest.raises(ValueError, match=r"scale=1e\+300.*within float32"):
        DynamicLossScaler().load_state_dict({"scale": 1e300})


def test_unnamed_parameters_are_called_by_their_place_in_the_optimizer() -> None:
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    scaler = DynamicLossScaler()
    (a.sum() + b.sum()).backward()
    b.grad[1] = float("inf")
    assert scaler.step(opt) is None
    assert scaler.result(opt).overflow_params == ["param_groups[1][0]"]


def test_a_skipped_step_leaves_parameters_and_optimizer_state_untouched() -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler()
    x = torch.randn(2, 8)
    scaler.scale(model(x).sum()).backward()
    scaler.step(opt)
    scaler.update()
    params = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    scaler.scale(model(x).sum() * float("inf")).backward()
    assert scaler.step(opt) is None and scaler.result(opt).skipped
    scaler.update()
    for key, value in model.state_dict().items():
        assert torch.equal(value, params[key]), key
    for index, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, state["state"][index][key]), (index, key)
    assert scaler.skipped_steps == 1 and scaler.state_dict()["consecutive_skips"] == 1


def test_hysteresis_skips_every_overflow_but_backs_off_only_when_used_up() -> None:
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = DynamicLossScaler(init_scale=8.0, hysteresis=2)
    scales = []
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(w.sum() * float("inf")).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [8.0, 4.0, 2.0] and scaler.skipped_steps == 3


# ------------------------------------------------------------------------------------------------------ call rules
def test_unscale_twice_unscales_once() -> None:
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = DynamicLossScaler(init_scale=8.0)
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    scaler.unscale_(opt)
    assert w.grad.tolist() == [1.0, 1.0]


def test_step_twice_before_update_is_an_error() -> None:
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = DynamicLossScaler()
    scaler.scale(w.sum()).backward()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="update"):
        scaler.step(opt)


def test_step_with_a_closure_is_refused() -> None:
    w = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="closure"):
        DynamicLossScaler().step(torch.optim.SGD([w], lr=0.1), closure=lambda: None)


def test_scale_accepts_lists_and_tuples_and_refuses_other_types() -> None:
    scaler = DynamicLossScaler(init_scale=2.0)
    assert [t.item() for t in scaler.scale([torch.tensor(1.0), torch.tensor(3.0)])] == [2.0, 6.0]
    assert isinstance(scaler.scale((torch.tensor(1.0),)), tuple)
    with pytest.raises(TypeError, match="outputs"):
        scaler.scale(1.0)  # type: ignore[arg-type]


def test_update_with_a_new_scale_sets_it_within_the_bounds() -> None:
    scaler = DynamicLossScaler(max_scale=2.0**20)
    scaler.update(new_scale=2.0**30)
    assert scaler.get_scale() == 2.0**20


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"init_scale": 2.0**30}, "init_scale"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"growth_interval": 2**31}, "growth_interval"),  # past the int32 trackers (GradScaler's type)
        ({"hysteresis": 0}, "hysteresis"),
        ({"hysteresis": 2**31}, "hysteresis"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": 1e-45}, "min_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"max_scale": 0.5}, "max_scale"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
        ({"max_consecutive_skips": True}, "max_consecutive_skips"),
    ],
)
def test_invalid_arguments_raise_naming_the_argument_and_the_value(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}={kwargs[name]!r}".replace("(", r"\(").replace(")", r"\)")):
        DynamicLossScaler(**kwargs)


# ------------------------------------------------------------------------------------------------------------ state
def advanced_scaler(**kwargs: Any) -> DynamicLossScaler:
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2, **kwargs)
    w = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.1)
    for bad in (False, True, False, True, True, False):
        opt.zero_grad()
        scaler.scale(w.sum() * (float("inf") if bad else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
    return scaler


def test_state_dict_holds_only_plain_python_values_and_survives_weights_only_load() -> None:
    state = advanced_scaler().state_dict()
    assert all(isinstance(v, (int, float, type(None))) for v in state.values())
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == state


def test_state_dict_round_trip_restores_scale_trackers_and_counters() -> None:
    original = advanced_scaler()
    restored = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    restored.load_state_dict(original.state_dict())
    assert restored.state_dict() == original.state_dict()
    assert restored.skipped_steps == 3


def test_a_grad_scaler_state_loads_so_runs_can_migrate_and_back() -> None:
    _, _ = train(grad_scaler := torch.amp.GradScaler("cpu", growth_interval=7), steps=50)
    ours = DynamicLossScaler(growth_interval=7)
    ours.load_state_dict(grad_scaler.state_dict())
    assert ours.get_scale() == grad_scaler.get_scale()
    assert ours.state_dict()["_growth_tracker"] == grad_scaler.state_dict()["_growth_tracker"]
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(ours.state_dict())
    assert back.get_scale() == grad_scaler.get_scale()


def test_differing_saved_hyperparameters_warn_and_the_constructors_stay() -> None:
    state = advanced_scaler().state_dict()
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=5)
    with pytest.warns(UserWarning, match="growth_interval"):
        scaler.load_state_dict(state)
    assert scaler.get_growth_interval() == 5


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([1, 2], TypeError, "expects a dict"),
        ({"growth_factor": 2.0}, ValueError, "no 'scale' key"),
        ({"scale": "big"}, TypeError, "scale='big'"),
        ({"scale": 0.0}, ValueError, "scale=0.0"),
        ({"scale": float("nan")}, ValueError, "scale=nan"),
        ({"scale": 8.0, "_growth_tracker": 1.5}, TypeError, "_growth_tracker=1.5"),
    ],
)
def test_corrupt_states_raise_naming_what_is_wrong(state: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        DynamicLossScaler().load_state_dict(state)


def test_a_saved_scale_outside_the_bounds_is_clamped_with_a_warning() -> None:
    scaler = DynamicLossScaler()
    with pytest.warns(UserWarning, match="clamped"):
        scaler.load_state_dict({"scale": 0.0001})
    assert scaler.get_scale() == 1.0


# ------------------------------------------------------------------------------------------------------ host syncs
def test_update_reads_nothing_back_from_the_device() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler()
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    scaler.step(opt)
    calls: list[str] = []
    with host_reads(calls):
        scaler.update()
    assert calls == []


def test_a_clean_step_with_the_scalers_own_clip_reads_from_the_device_exactly_once() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler()
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    calls: list[str] = []
    with host_reads(calls):
        scaler.unscale_(opt)
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    assert calls == ["tolist"]  # the flag, the norm, the scale and its tracker, together (GradScaler: its flag)


# ------------------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_parity_with_grad_scaler_on_cuda_and_no_sync_in_update() -> None:
    def run(scaler: Any) -> tuple[list[float], nn.Module]:
        model = make_model().cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scales = []
        for step, x, y in batches(100):
            x, y = x.cuda(), y.cuda()
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            loss = loss * float("inf") if step in INF_STEPS else loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            if isinstance(scaler, DynamicLossScaler):
                torch.cuda.set_sync_debug_mode("error")
            scaler.update()
            torch.cuda.set_sync_debug_mode("default")
            scales.append(scaler.get_scale())
        return scales, model

    ours, model_ours = run(DynamicLossScaler(growth_interval=10))
    torchs, model_torch = run(torch.amp.GradScaler("cuda", growth_interval=10))
    assert ours == torchs
    # foreach kernels on both sides; identical skip decisions; unscale by the same power of two.
    assert_same_parameters(model_ours, model_torch, rtol=0, atol=0)


def test_fp16_gradients_of_a_pure_fp16_model_are_unscaled_and_checked_where_grad_scaler_refuses_them() -> None:
    model = make_model().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8).half()
    with pytest.raises(ValueError, match="FP16 gradients"):
        grad_scaler = torch.amp.GradScaler("cpu")
        grad_scaler.scale(model(x).float().pow(2).mean()).backward()
        grad_scaler.unscale_(opt)
    opt.zero_grad()
    reference = copy.deepcopy(model)
    scaler = DynamicLossScaler(init_scale=2.0**10)
    scaler.scale(model(x).float().pow(2).mean()).backward()
    scaler.unscale_(opt)
    reference(x).float().pow(2).mean().backward()
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == torch.float16
        # Scaling by 2**10 then unscaling is exact except where the unscaled fp16 backward rounded small values.
        torch.testing.assert_close(p.grad, r.grad, rtol=2e-3, atol=1e-4)
    opt.zero_grad()
    scaler.update()
    (model(x).float().pow(2).mean() * float("inf")).backward()
    assert scaler.step(opt) is None and scaler.skipped_steps == 1


def test_a_shorter_growth_interval_grows_at_the_next_clean_step_where_grad_scaler_never_grows_again() -> None:
    # GradScaler's kernel grows when its tracker equals the interval: a tracker already past a shortened interval
    # counts on past it. Ours brings the tracker within the new interval (a deliberate difference, docs/migrating.md).
    def clean_updates(scaler: Any, count: int) -> None:
        param = nn.Parameter(torch.zeros(1))
        optimizer = torch.optim.SGD([param], lr=0.0)
        for _ in range(count):
            param.grad = torch.ones(1)
            scaler.scale(torch.ones(()))
            scaler.step(optimizer)
            scaler.update()

    ours = DynamicLossScaler(init_scale=8.0, growth_interval=10)
    torchs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=10)
    for scaler in (ours, torchs):
        clean_updates(scaler, 6)
        scaler.set_growth_interval(3)
        clean_updates(scaler, 5)
    assert ours.get_scale() == 32.0  # grew at the next clean step (16), then after 3 more (32)
    assert torchs.get_scale() == 8.0
