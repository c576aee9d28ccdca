"""The scale policy state machine: its rules, torch's own update kernel as the reference for hysteresis=1, and the
device policy against the host one."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_amp_plus.step.policy import DevicePolicy, ScalePolicy


def policy(init: float = 8.0, **kw: float) -> ScalePolicy:
    base = dict(
        growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=1, min_scale=1.0, max_scale=2.0**24
    )
    base.update(kw)
    return ScalePolicy(init, **base)  # type: ignore[arg-type]


def run(p: ScalePolicy, found: list[bool]) -> list[float]:
    out = []
    for overflow in found:
        p.update(overflow)
        out.append(p.scale)
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


def test_update_says_whether_the_scale_changed() -> None:
    p = policy(growth_interval=2)
    assert [p.update(f) for f in (False, False, False, True)] == [False, True, False, True]


def test_overflow_backs_off_and_restarts_the_growth_count() -> None:
    assert run(policy(), [False, False, True, False, False, False]) == [8, 8, 4, 4, 4, 8]


def test_hysteresis_tolerates_overflows_until_used_up_and_refills_on_growth() -> None:
    # First overflow tolerated, second backs off, third backs off again (no growth in between refilled it).
    assert run(policy(hysteresis=2), [True, True, True]) == [8, 4, 2]
    # A growth refills the hysteresis: the next single overflow is tolerated again.
    assert run(policy(hysteresis=2), [True, False, False, False, True]) == [8, 8, 8, 16, 16]


def test_scale_never_goes_below_the_floor_even_after_thousands_of_overflows() -> None:
    out = run(policy(2.0**16, min_scale=0.25), [True] * 2000)
    assert min(out) == 0.25 and out[-1] == 0.25


def test_scale_never_exceeds_the_ceiling() -> None:
    assert max(run(policy(2.0**10, growth_interval=1, max_scale=2.0**14), [False] * 300)) == 2.0**14


def test_a_ceiling_near_float32_max_never_gives_inf() -> None:
    top = torch.finfo(torch.float32).max
    out = run(policy(2.0**120, growth_interval=1, growth_factor=4.0, max_scale=top), [False] * 10)
    assert out[-1] == top


def test_a_policy_with_equal_bounds_is_fixed_and_never_changes() -> None:
    p = policy(1.0, min_scale=1.0, max_scale=1.0)
    assert p.fixed and run(p, [True, False, False, False, True]) == [1.0] * 5


@pytest.mark.parametrize("seed", range(6))
def test_with_hysteresis_1_the_policy_equals_grad_scalers_update_kernel(seed: int) -> None:
    rng = random.Random(seed)
    # Factors that are not powers of two exercise the float32 rounding of every product.
    growth, backoff = rng.choice([2.0, 1.5, 3.1]), rng.choice([0.5, 0.3, 0.77])
    interval = rng.randint(1, 5)
    found = [rng.random() < 0.35 for _ in range(500)]
    ours = run(policy(1000.0, growth_factor=growth, backoff_factor=backoff, growth_interval=interval,
                      min_scale=1e-30, max_scale=3e38), found)  # fmt: skip
    reference = grad_scaler_kernel(found, 1000.0, growth, backoff, interval)
    # GradScaler has no bounds: compare up to where the walk first reaches one of ours (if it ever does).
    inside = next((i for i, s in enumerate(reference) if not (s * backoff > 1e-30 and s * growth < 3e38)), 500)
    assert inside >= 200
    assert ours[:inside] == reference[:inside]


# ----------------------------------------------------------------------------------------- the device policy
def device_run(p: ScalePolicy, found: list[bool]) -> list[float]:
    """The same steps through DevicePolicy (on CPU tensors): the scale after each."""
    scale = torch.full((), p.scale, dtype=torch.float32)
    device = DevicePolicy(p, scale)
    out = []
    for overflow in found:
        device.advance(scale, torch.tensor(float(overflow)), p)
        out.append(scale.item())
    return out


@pytest.mark.parametrize("seed", range(8))
def test_the_device_policy_equals_the_host_policy_bit_for_bit(seed: int) -> None:
    rng = random.Random(seed)
    kw = dict(
        growth_factor=rng.choice([2.0, 1.5, 3.1, 1.0001]),
        backoff_factor=rng.choice([0.5, 0.3, 0.77, 1.0]),
        growth_interval=rng.randint(1, 5),
        hysteresis=rng.randint(1, 4),
        # Tight bounds so that the floor and the ceiling are hit; bounds that are not powers of two.
        min_scale=rng.choice([1.0, 0.37, 3.0]),
        max_scale=rng.choice([2.0**10, 1000.0, 3.5]),
    )
    found = [rng.random() < rng.choice([0.1, 0.4, 0.8]) for _ in range(300)]
    host = policy(3.0, **kw)
    assert device_run(policy(3.0, **kw), found) == run(host, found)


def test_the_device_policy_keeps_the_trackers_the_host_would() -> None:
    host = policy(8.0, growth_interval=3, hysteresis=3)
    scale = torch.full((), 8.0)
    device = DevicePolicy(host, scale)
    mirror = policy(8.0, growth_interval=3, hysteresis=3)
    for overflow in (False, True, False, False, True, True, False):
        device.advance(scale, torch.tensor(float(overflow)), host)
        mirror.update(overflow)
        assert device.state[1:].tolist() == [mirror.growth_tracker, mirror.hysteresis_tracker]


def test_load_brings_the_device_trackers_and_constants_to_the_hosts() -> None:
    host = policy(8.0, growth_interval=2)
    scale = torch.full((), 8.0)
    device = DevicePolicy(host, scale)
    host.update(False)
    host.growth_factor = 4.0  # as set_growth_factor does
    device.load(host)
    device.advance(scale, torch.tensor(0.0), host)
    assert scale.item() == host.scale * 4.0


# ------------------------------------------------------------------------------------------ bounds on skipping
def walk_to_floor(p: ScalePolicy) -> int:
    """Overflows in a row from max_scale until the scale stops falling (a plain loop over the policy itself)."""
    p.scale, p.hysteresis_tracker, count = p.max_scale, 1, 0
    while p.backs_off_on_overflow():
        p.update(True)
        count += 1
    return count


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, 24),
        ({"backoff_factor": 0.3}, 14),  # 0.3**14 * 2**24 < 1 < 0.3**13 * 2**24
        ({"backoff_factor": 1.0}, 0),
        ({"min_scale": 2.0**24}, 0),
        ({"backoff_factor": 0.999}, 16_628),  # ln(2**24) / -ln(0.999) = 16_627.5, float32 rounding each time
    ],
)
def test_backoffs_to_floor_counts_the_overflows_that_can_lower_the_scale(kw: dict[str, float], expected: int) -> None:
    p = policy(2.0**24, **kw)
    assert p.backoffs_to_floor() == expected == walk_to_floor(policy(2.0**24, **kw))


def test_backoffs_to_floor_is_an_upper_bound_from_any_scale() -> None:
    for start in (2.0**24, 12345.0, 3.0, 1.0):
        p = policy(start, backoff_factor=0.77)
        count = 0
        while p.backs_off_on_overflow():
            p.update(True)
            count += 1
        assert count <= p.backoffs_to_floor()
