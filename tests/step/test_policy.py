"""The loss scale's one state machine: its rules, torch's own update kernel as the reference for hysteresis=1, a plain
Python transcription of Megatron-LM's rule as the reference with hysteresis, and no host read when it moves."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import host_reads, walk_to_floor

from lightning_amp_plus.step.float32 import f32
from lightning_amp_plus.step.policy import LossScale, ScalePolicy


def policy(**kw: float) -> ScalePolicy:
    base = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=1, min_scale=1.0)
    base.update({"max_scale": 2.0**24, **kw})
    return ScalePolicy(**base)  # type: ignore[arg-type]


def run(p: ScalePolicy, found: list[bool], init: float = 8.0) -> list[float]:
    scale = LossScale(p, init)
    out = []
    for overflow in found:
        scale.advance(torch.tensor(float(overflow)))
        out.append(scale.value())
    return out


def megatron(p: ScalePolicy, found: list[bool], init: float) -> list[float]:
    """Megatron-LM's DynamicGradScaler rule, transcribed in plain Python with float32 rounding of each product."""
    scale, growth, hysteresis, out = f32(init), 0, p.hysteresis, []
    for overflow in found:
        if overflow:
            growth, hysteresis = 0, max(hysteresis - 1, 0)
            if hysteresis == 0:
                scale = max(f32(scale * p.backoff_factor), p.min_scale)
        else:
            growth += 1
            if growth >= p.growth_interval:
                growth, hysteresis = 0, p.hysteresis
                scale = min(f32(scale * p.growth_factor), p.max_scale)
        out.append(scale)
    return out


def grad_scaler_kernel(found: list[bool], init: float, growth: float, backoff: float, interval: int) -> list[float]:
    """torch.amp.GradScaler's own update (its private fused kernel, allowed in tests as the reference)."""
    scale, tracker, out = torch.tensor([init]), torch.zeros(1, dtype=torch.int32), []
    for overflow in found:
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(overflow)]), growth, backoff, interval)
        out.append(scale.item())
    return out


def test_scale_grows_after_growth_interval_clean_steps() -> None:
    assert run(policy(), [False] * 7) == [8, 8, 16, 16, 16, 32, 32]


def test_overflow_backs_off_and_restarts_the_growth_count() -> None:
    assert run(policy(), [False, False, True, False, False, False]) == [8, 8, 4, 4, 4, 8]


def test_hysteresis_tolerates_overflows_until_used_up_and_refills_on_growth() -> None:
    # First overflow tolerated, second backs off, third backs off again (no growth in between refilled it).
    assert run(policy(hysteresis=2), [True, True, True]) == [8, 4, 2]
    # A growth refills the hysteresis: the next single overflow is tolerated again.
    assert run(policy(hysteresis=2), [True, False, False, False, True]) == [8, 8, 8, 16, 16]


def test_scale_never_goes_below_the_floor_even_after_thousands_of_overflows() -> None:
    out = run(policy(min_scale=0.25), [True] * 2000, init=2.0**16)
    assert min(out) == 0.25 and out[-1] == 0.25


def test_scale_never_exceeds_the_ceiling() -> None:
    assert max(run(policy(growth_interval=1, max_scale=2.0**14), [False] * 300, init=2.0**10)) == 2.0**14


def test_a_ceiling_near_float32_max_never_gives_inf() -> None:
    # As GradScaler: a growth whose product leaves float32's range is not taken (the scale stays where it is).
    top = torch.finfo(torch.float32).max
    out = run(policy(growth_interval=1, growth_factor=4.0, max_scale=top), [False] * 10, init=2.0**120)
    assert out == grad_scaler_kernel([False] * 10, 2.0**120, 4.0, 0.5, 1)
    assert out[-1] == 2.0**126 and all(value <= top for value in out)


def test_a_policy_with_equal_bounds_is_fixed_and_never_changes() -> None:
    assert run(policy(min_scale=1.0, max_scale=1.0), [True, False, False, False, True], init=1.0) == [1.0] * 5


@pytest.mark.parametrize("seed", range(6))
def test_with_hysteresis_1_the_machine_equals_grad_scalers_update_kernel(seed: int) -> None:
    rng = random.Random(seed)
    # Factors that are not powers of two exercise the float32 rounding of every product.
    growth, backoff = rng.choice([2.0, 1.5, 3.1]), rng.choice([0.5, 0.3, 0.77])
    interval = rng.randint(1, 5)
    found = [rng.random() < 0.35 for _ in range(500)]
    p = policy(growth_factor=growth, backoff_factor=backoff, growth_interval=interval, min_scale=1e-30, max_scale=3e38)
    ours = run(p, found, init=1000.0)
    reference = grad_scaler_kernel(found, 1000.0, growth, backoff, interval)
    # GradScaler has no bounds: compare up to where the walk first reaches one of ours (if it ever does).
    inside = next((i for i, s in enumerate(reference) if not (s * backoff > 1e-30 and s * growth < 3e38)), 500)
    assert inside >= 200
    assert ours[:inside] == reference[:inside]


@pytest.mark.parametrize("seed", range(8))
def test_with_any_hysteresis_and_bounds_the_machine_equals_megatrons_rule(seed: int) -> None:
    rng = random.Random(seed)
    p = policy(
        growth_factor=rng.choice([2.0, 1.5, 3.1, 1.0001]),
        backoff_factor=rng.choice([0.5, 0.3, 0.77, 1.0]),
        growth_interval=rng.randint(1, 5),
        hysteresis=rng.randint(1, 4),
        # Tight bounds so that the floor and the ceiling are hit; bounds that are not powers of two.
        min_scale=rng.choice([1.0, 0.37, 3.0]),
        max_scale=rng.choice([2.0**10, 1000.0, 3.5]),
    )
    found = [rng.random() < rng.choice([0.1, 0.4, 0.8]) for _ in range(300)]
    assert run(p, found, init=3.0) == megatron(p, found, 3.0)


def test_the_trackers_are_megatrons() -> None:
    p = policy(growth_interval=3, hysteresis=3)
    scale = LossScale(p, 8.0)
    seen = []
    for overflow in (False, True, False, False, True, True, False):
        scale.advance(torch.tensor(float(overflow)))
        seen.append(scale.read()[1:])
    assert seen == [(1, 3), (0, 2), (1, 2), (2, 2), (0, 1), (0, 0), (1, 0)]


def test_a_shorter_growth_interval_set_on_the_way_grows_at_the_next_clean_step() -> None:
    # The update kernel grows when the tracker reaches the interval exactly: a tracker left past a shortened interval
    # would never grow again unless the change brings it within.
    scale = LossScale(policy(growth_interval=10), 8.0)
    for _ in range(6):
        scale.advance(torch.tensor(0.0))
    scale.reconfigure(growth_interval=3)
    scale.advance(torch.tensor(0.0))
    assert scale.read() == (16.0, 0, 1)


@pytest.mark.parametrize("wide", [torch.float64, torch.float32], ids=["float64", "float32 (MPS's)"])
def test_a_read_is_exact_whatever_the_devices_wide_dtype(wide: torch.dtype) -> None:
    # On MPS the wide dtype is float32, exact for integers only up to 2**24: the trackers must not go through it.
    scale = LossScale(policy(growth_interval=2**31 - 1, hysteresis=2**31 - 1), 1.0)
    scale.wide = wide
    odd = torch.tensor(1 / 3, dtype=torch.float32).item()
    scale.set(odd, growth_tracker=2**31 - 2, hysteresis_tracker=2**24 + 1)
    assert scale.read() == (odd, 2**31 - 2, 2**24 + 1)
    scale.set(torch.finfo(torch.float32).max)
    assert scale.value() == torch.finfo(torch.float32).max


def test_moving_the_scale_reads_nothing_on_the_host() -> None:
    # The fused path's flag stays on the device: the update must not wait for it.
    scale, calls = LossScale(policy(hysteresis=2), 8.0), []
    with host_reads(calls):
        for overflow in (True, False, True, True):
            scale.advance(torch.tensor(float(overflow)))
    assert calls == []


def test_a_constant_changed_on_the_way_applies_from_the_next_step() -> None:
    scale = LossScale(policy(growth_interval=2), 8.0)
    scale.advance(torch.tensor(0.0))
    scale.reconfigure(growth_factor=4.0)  # as set_growth_factor does
    scale.advance(torch.tensor(0.0))
    assert scale.value() == 32.0


# ------------------------------------------------------------------------------------------ bounds on skipping
@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, 24),
        ({"backoff_factor": 0.3}, 14),  # 0.3**14 * 2**24 < 1 < 0.3**13 * 2**24
        ({"backoff_factor": 1.0}, 0),
        ({"min_scale": 2.0**24}, 0),
    ],
)
def test_overflows_in_a_row_lower_the_scale_from_the_ceiling_to_the_floor_a_bounded_number_of_times(
    kw: dict[str, float], expected: int
) -> None:
    assert walk_to_floor(policy(**kw)) == expected
