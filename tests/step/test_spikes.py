"""The spike guard: its statistics against moments computed independently with numpy, its decisions, torch's clipping
coefficient, checkpoints that resume bit for bit, and the errors that name the argument, the value and the fix."""

from __future__ import annotations

import dataclasses
import math
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_amp_plus.step.spikes import SpikeGuard, SpikeVerdict


def norms(count: int, seed: int = 0) -> list[float]:
    """Gradient-norm-like numbers: a decaying level with multiplicative noise, as float32 values (what a norm read from
    a float32 tensor is)."""
    rng = random.Random(seed)
    return [float(np.float32((0.3 + math.exp(-i / 50)) * math.exp(rng.gauss(0.0, 0.2)))) for i in range(count)]


def reference_moments(entered: list[float], alpha: float) -> tuple[float, float]:
    """The weighted mean and population variance of ``entered``, each entry weighted as the guard documents: the entry
    of step n gets ``max(1/n, 1 - alpha)`` and every earlier weight is multiplied by one minus that."""
    weights: list[float] = []
    for n in range(1, len(entered) + 1):
        w = max(1.0 / n, 1.0 - alpha)
        weights = [x * (1.0 - w) for x in weights] + [w]
    mean = float(np.average(entered, weights=weights))
    return mean, float(np.average((np.asarray(entered) - mean) ** 2, weights=weights))


def feed(guard: SpikeGuard, values: list[float]) -> list[SpikeVerdict]:
    """Judge each value and observe the verdict (a skip verdict enters nothing, as a skipped step)."""
    verdicts = []
    for value in values:
        verdict = guard.judge(value)
        guard.observe(verdict)
        verdicts.append(verdict)
    return verdicts


# ------------------------------------------------------------------------------------------------ the statistics
@pytest.mark.parametrize("count", [1, 2, 33, 34, 500])
def test_with_alpha_one_the_statistics_are_the_mean_and_population_variance_of_every_norm_taken(count: int) -> None:
    values = norms(count)
    guard = SpikeGuard(warmup=10**9, alpha=1.0)  # no decision: every norm enters
    feed(guard, values)
    # Tolerance: a running update and numpy's two-pass sums round differently in the last bits.
    assert guard.mean == pytest.approx(float(np.mean(values)), rel=1e-12)
    assert guard.var == pytest.approx(float(np.var(values)), rel=1e-10, abs=1e-15)
    assert guard.steps == count


@pytest.mark.parametrize("alpha", [0.97, 0.99, 0.5])
def test_the_statistics_weight_the_first_steps_alike_then_decay_exponentially(alpha: float) -> None:
    values = norms(300, seed=1)
    guard = SpikeGuard(warmup=10**9, alpha=alpha)
    for n in range(1, len(values) + 1):
        feed(guard, values[n - 1 : n])
        if n in (1, 2, 20, 33, 34, 35, 100, 300):
            mean, var = reference_moments(values[:n], alpha)
            assert guard.mean == pytest.approx(mean, rel=1e-12), n  # rounding order only
            assert guard.var == pytest.approx(var, rel=1e-9, abs=1e-15), n


def test_the_verdict_reports_the_statistics_of_the_steps_taken_before_it() -> None:
    values = norms(60)
    guard = SpikeGuard(threshold=3.0, warmup=20)
    assert not any(verdict.spike for verdict in feed(guard, values))  # every norm entered, as the reference has it
    mean, var = reference_moments(values, 0.97)
    verdict = guard.judge(values[-1])
    assert verdict.mean == pytest.approx(mean, rel=1e-12)
    assert verdict.std == pytest.approx(math.sqrt(var), rel=1e-9)
    assert verdict.threshold_norm == verdict.mean + 3.0 * verdict.std
    assert verdict.steps == 60 and verdict.norm == values[-1]


def test_judging_changes_nothing() -> None:
    guard = SpikeGuard(warmup=5)
    feed(guard, norms(10))
    before = guard.state_dict()
    for value in (0.1, 1e6, 0.0):
        guard.judge(value)
    assert guard.state_dict() == before


# ------------------------------------------------------------------------------------------------ the decisions
def test_no_decision_during_the_warmup_steps() -> None:
    guard = SpikeGuard(threshold=3.0, warmup=10)
    values = norms(10)
    for value in values:
        verdict = guard.judge(1e6)  # a spike, but the statistics are not ready
        assert verdict.action == "take" and verdict.threshold_norm == math.inf and verdict.coefficient == 1.0
        guard.observe(guard.judge(value))
    assert guard.judge(1e6).action == "skip"


def test_no_decision_while_the_norms_taken_show_no_spread() -> None:
    guard = SpikeGuard(threshold=3.0, warmup=0)
    assert guard.judge(5.0).action == "take"  # nothing taken yet
    feed(guard, [2.0, 2.0, 2.0])
    assert guard.judge(100.0).action == "take" and guard.judge(100.0).std == 0.0
    feed(guard, [2.5])
    assert guard.judge(100.0).action == "skip"


@pytest.mark.parametrize("action", ["skip", "clip"])
def test_a_norm_above_mean_plus_threshold_std_is_a_spike_and_one_at_it_is_not(action: Any) -> None:
    guard = SpikeGuard(threshold=4.0, warmup=30, action=action)
    feed(guard, norms(40))
    limit = guard.judge(0.0).threshold_norm
    at, above = guard.judge(limit), guard.judge(math.nextafter(limit, math.inf))
    assert (at.action, at.spike) == ("take", False)
    assert (above.action, above.spike) == (action, True)
    assert guard.judge(limit * 100).action == action


def test_a_skipped_spike_enters_nothing_what_follows_is_as_if_it_was_never_seen() -> None:
    values = norms(200, seed=3)
    spiked = [*values[:120], 1e4, *values[120:]]
    with_spike, without = SpikeGuard(threshold=6.0, warmup=50), SpikeGuard(threshold=6.0, warmup=50)
    verdicts = feed(with_spike, spiked)
    assert verdicts[120].action == "skip"
    assert verdicts[:120] + verdicts[121:] == feed(without, values)  # every field, bit for bit
    assert with_spike.state_dict() == without.state_dict()


def test_a_clipped_step_enters_its_norm_after_clipping() -> None:
    values = norms(80, seed=4)
    guard = SpikeGuard(threshold=5.0, warmup=50, action="clip")
    assert not any(verdict.spike for verdict in feed(guard, values))
    verdict = guard.judge(1e3)
    guard.observe(verdict)
    mean, var = reference_moments([*values, verdict.threshold_norm], 0.97)
    assert verdict.action == "clip" and guard.steps == 81
    assert guard.mean == pytest.approx(mean, rel=1e-12)
    assert guard.var == pytest.approx(var, rel=1e-9)


def test_a_spike_on_a_skip_guard_has_no_coefficient() -> None:
    guard = SpikeGuard(threshold=3.0, warmup=5)
    feed(guard, norms(5))
    assert guard.judge(1e3).coefficient == 1.0


@pytest.mark.parametrize("spike", [1.86, 2.5, 30.0, 1e4, 1e18])
def test_the_clip_coefficient_is_the_one_torchs_clip_grad_norm_applies_at_the_threshold_norm(spike: float) -> None:
    generator = torch.Generator().manual_seed(0)
    guard = SpikeGuard(threshold=3.0, warmup=20, action="clip")
    feed(guard, norms(30))
    shapes = [(64, 32), (32,), (10, 3, 3, 3)]
    raw = [torch.randn(shape, generator=generator) for shape in shapes]
    total = torch.nn.utils.get_total_norm(raw).item()
    grads = [g * (spike / total) for g in raw]
    norm = torch.nn.utils.get_total_norm(grads).item()
    verdict = guard.judge(norm)
    assert verdict.action == "clip" and verdict.coefficient < 1.0
    ours = [g.clone() for g in grads]
    torch._foreach_mul_(ours, verdict.coefficient)
    theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(theirs, grads, strict=True):
        param.grad = grad.clone()
    torch.nn.utils.clip_grad_norm_(theirs, max_norm=verdict.threshold_norm)
    for mine, param in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, param.grad, rtol=0, atol=0)  # bit for bit
    clipped = torch.nn.utils.get_total_norm(ours).item()
    assert clipped == pytest.approx(verdict.threshold_norm, rel=1e-5)


def test_a_numpy_norm_is_judged_as_a_python_float() -> None:
    guard = SpikeGuard(warmup=3)
    feed(guard, [np.float32(1.0), np.float64(1.5), 2])  # type: ignore[list-item]
    verdict = guard.judge(np.float32(1.25))  # type: ignore[arg-type]
    assert type(verdict.norm) is float and type(guard.mean) is float and verdict.action == "take"


def test_verdicts_are_frozen_records() -> None:
    verdict = SpikeGuard().judge(1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        verdict.action = "skip"  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------ checkpoints
def spiky(count: int, every: int, seed: int = 5) -> list[float]:
    values = norms(count, seed)
    return [v * 1e3 if i % every == every - 1 and i > 60 else v for i, v in enumerate(values)]


@pytest.mark.parametrize("action", ["skip", "clip"])
@pytest.mark.parametrize("resume_at", [0, 30, 75, 150])
def test_a_resumed_guard_judges_exactly_as_the_uninterrupted_one(action: Any, resume_at: int, tmp_path: Path) -> None:
    values = spiky(300, every=37)
    uninterrupted = feed(SpikeGuard(threshold=6.0, warmup=50, action=action), values)
    assert any(v.spike for v in uninterrupted[resume_at:])  # spikes after the resume point
    first = SpikeGuard(threshold=6.0, warmup=50, action=action)
    before = feed(first, values[:resume_at])
    torch.save({"guard": first.state_dict()}, tmp_path / "ckpt.pt")
    resumed = SpikeGuard(threshold=6.0, warmup=50, action=action)
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True)["guard"])
    assert before + feed(resumed, values[resume_at:]) == uninterrupted  # every field, bit for bit


def test_the_state_holds_plain_python_numbers_and_strings() -> None:
    guard = SpikeGuard(np.float64(8.0), np.int64(20), "clip", np.float32(0.5))  # type: ignore[arg-type]
    feed(guard, norms(30))
    state = guard.state_dict()
    assert {key: type(value) for key, value in state.items()} == {
        "steps": int,
        "mean": float,
        "var": float,
        "threshold": float,
        "warmup": int,
        "action": str,
        "alpha": float,
    }


def test_loading_a_state_saved_with_other_settings_keeps_these_and_says_so() -> None:
    saved = SpikeGuard(threshold=6.0, warmup=50)
    feed(saved, norms(60))
    guard = SpikeGuard(threshold=8.0, warmup=50, action="clip")
    with pytest.warns(UserWarning, match=r"threshold=6\.0 \(now 8\.0\), action='skip' \(now 'clip'\)"):
        guard.load_state_dict(saved.state_dict())
    assert (guard.threshold, guard.action, guard.steps, guard.mean) == (8.0, "clip", 60, saved.mean)


def test_loading_the_statistics_alone_warns_about_nothing() -> None:
    guard = SpikeGuard()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.load_state_dict({"steps": 3, "mean": 1.0, "var": 0.25})
    assert (guard.steps, guard.mean, guard.var) == (3, 1.0, 0.25)


@pytest.mark.parametrize(
    ("state", "error", "match"),
    [
        ([1, 2, 3], TypeError, "expects a dict, got list"),
        ({"steps": 3, "mean": 1.0}, ValueError, r"has no 'var' \(keys: \['mean', 'steps'\]\)"),
        ({"scale": 65536.0}, ValueError, "has no 'steps', 'mean', 'var'"),
        ({"steps": -1, "mean": 1.0, "var": 0.1}, ValueError, r"steps=-1; expected an int in \[0, 2\*\*62\]"),
        ({"steps": 2**63, "mean": 1.0, "var": 0.1}, ValueError, "steps=9223372036854775808"),
        ({"steps": 1.5, "mean": 1.0, "var": 0.1}, TypeError, r"steps=1\.5 \(float\); expected an int"),
        ({"steps": True, "mean": 1.0, "var": 0.1}, TypeError, r"steps=True \(bool\)"),
        ({"steps": 3, "mean": "1.0", "var": 0.1}, TypeError, r"mean='1\.0' \(str\); expected a float"),
        ({"steps": 3, "mean": math.nan, "var": 0.1}, ValueError, r"mean=nan; expected a finite number >= 0"),
        ({"steps": 3, "mean": 1.0, "var": -0.1}, ValueError, r"var=-0\.1; expected a finite number >= 0"),
        ({"steps": 3, "mean": 1.0, "var": math.inf}, ValueError, "var=inf"),
    ],
)
def test_a_corrupt_state_is_refused_naming_the_key_and_the_value(state: Any, error: type, match: str) -> None:
    guard = SpikeGuard()
    feed(guard, norms(5))
    before = guard.state_dict()
    with pytest.raises(error, match=match):
        guard.load_state_dict(state)
    assert guard.state_dict() == before  # nothing half-loaded


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold": 0}, r"`SpikeGuard\(threshold=0\)` must be a finite number > 0 .*e\.g\. 25"),
        ({"threshold": -2.5}, r"threshold=-2\.5\)` must be a finite number > 0"),
        ({"threshold": math.inf}, r"threshold=inf\)` must be"),
        ({"threshold": "10"}, r"threshold='10'\)` must be"),
        ({"threshold": True}, r"threshold=True\)` must be"),
        ({"warmup": -1}, r"`SpikeGuard\(warmup=-1\)` must be an int >= 0 \(steps taken .*e\.g\. 100"),
        ({"warmup": 2.0}, r"warmup=2\.0\)` must be an int >= 0"),
        ({"warmup": None}, r"warmup=None\)` must be an int >= 0"),
        ({"action": "drop"}, r"`SpikeGuard\(action='drop'\)` is not supported: use 'skip' .* or 'clip'"),
        ({"action": None}, r"action=None\)` is not supported"),
        ({"alpha": 0.0}, r"`SpikeGuard\(alpha=0\.0\)` must be in \(0, 1\], e\.g\. 0\.97"),
        ({"alpha": 1.01}, r"alpha=1\.01\)` must be in \(0, 1\]"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument_the_value_and_the_fix(kwargs: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpikeGuard(**kwargs)


@pytest.mark.parametrize("norm", [math.inf, -math.inf, math.nan, -1.0, "1.0", None])
def test_a_non_finite_or_negative_norm_is_never_judged(norm: Any) -> None:
    guard = SpikeGuard(warmup=0)
    with pytest.raises(
        ValueError, match=r"judge\(norm=.*\)`: the guard judges finite gradient norms >= 0 only.*overflow"
    ):
        guard.judge(norm)


def test_a_verdict_is_observed_once() -> None:
    guard = SpikeGuard()
    verdict = guard.judge(1.0)
    guard.observe(verdict)
    with pytest.raises(RuntimeError, match="judged when 0 steps had been taken, but 1 have now"):
        guard.observe(verdict)


def test_the_repr_shows_the_settings() -> None:
    assert repr(SpikeGuard(action="clip")) == "SpikeGuard(threshold=25.0, warmup=100, action='clip', alpha=0.97)"
