"""The scale policy state machine, against a plain-Python model of the same rules."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_amp_plus._policy import ScaleConfig, ScaleState, update_scale_


def reference_policy(found: list[bool], init: float, cfg: ScaleConfig) -> list[float]:
    """The policy written out in plain Python: the scale after each step."""
    scale, growth, hyst = init, 0, cfg.hysteresis
    out = []
    for overflow in found:
        if overflow:
            hyst -= 1
            if hyst <= 0:
                scale = max(scale * cfg.backoff_factor, cfg.min_scale)
                hyst = 0
            growth = 0
        else:
            growth += 1
            if growth >= cfg.growth_interval:
                scale = min(scale * cfg.growth_factor, cfg.max_scale)
                growth = 0
                hyst = cfg.hysteresis
        out.append(scale)
    return out


def run_policy(found: list[bool], init: float, cfg: ScaleConfig) -> list[float]:
    state = ScaleState.create(init, cfg.hysteresis)
    out = []
    for overflow in found:
        update_scale_(state, torch.tensor(float(overflow)), cfg)
        out.append(state.scale.item())
    return out


def config(**kw: float) -> ScaleConfig:
    base = dict(
        growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=1, min_scale=1.0, max_scale=2.0**24
    )
    base.update(kw)
    return ScaleConfig(**base)  # type: ignore[arg-type]


def test_scale_grows_after_growth_interval_clean_steps() -> None:
    assert run_policy([False] * 7, 8.0, config()) == [8, 8, 16, 16, 16, 32, 32]


def test_overflow_backs_off_and_restarts_the_growth_count() -> None:
    assert run_policy([False, False, True, False, False, False], 8.0, config()) == [8, 8, 4, 4, 4, 8]


def test_hysteresis_tolerates_overflows_until_used_up_and_refills_on_growth() -> None:
    cfg = config(hysteresis=2)
    # First overflow tolerated, second backs off, third backs off again (no growth in between refilled it).
    assert run_policy([True, True, True], 8.0, cfg) == [8, 4, 2]
    # A growth refills the hysteresis: the next single overflow is tolerated again.
    assert run_policy([True, False, False, False, True], 8.0, cfg) == [8, 8, 8, 16, 16]


def test_scale_never_goes_below_the_floor_even_after_thousands_of_overflows() -> None:
    out = run_policy([True] * 2000, 2.0**16, config(min_scale=0.25))
    assert min(out) == 0.25 and out[-1] == 0.25


def test_scale_never_exceeds_the_ceiling() -> None:
    out = run_policy([False] * 300, 2.0**10, config(growth_interval=1, max_scale=2.0**14))
    assert max(out) == 2.0**14


@pytest.mark.parametrize("seed", range(5))
def test_policy_matches_the_plain_python_model_on_random_overflow_sequences(seed: int) -> None:
    rng = random.Random(seed)
    cfg = config(
        growth_interval=rng.randint(1, 5),
        hysteresis=rng.randint(1, 3),
        backoff_factor=rng.choice([0.5, 0.25]),
        growth_factor=rng.choice([2.0, 4.0]),
        min_scale=2.0 ** rng.randint(-4, 2),
        max_scale=2.0 ** rng.randint(10, 20),
    )
    found = [rng.random() < 0.3 for _ in range(400)]
    assert run_policy(found, 2.0**8, cfg) == reference_policy(found, 2.0**8, cfg)
