"""Property-based tests: the loss scaler's state machine against a plain-Python reference model of its policy.

The reference (:class:`Reference`) is written from the docstrings of ``ScalePolicy`` and ``DynamicLossScaler``, not from
the code of ``step/policy.py``: it counts the overflows since the last growth (where the package counts a hysteresis
tracker down) and rounds to float32 with its own helper (:func:`to_f32`, itself checked against torch's float64 ->
float32 cast).

Every test is derandomized (``derandomize=True``, no example database) so CI sees the same examples on every run.
The end-to-end properties draw the optimizer too: plain SGD (the unscale path, one host read per step) or fused SGD
(the fused path: the policy advances on the device and the host replays it from the flags later); both must follow the
same reference.
"""

from __future__ import annotations

import io
import math
import struct
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, NamedTuple

import torch
from helpers import host_reads, skip_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lightning_amp_plus import DynamicLossScaler
from lightning_amp_plus.step.policy import LossScale, ScalePolicy

F32_TINY = 2.0**-126  # the smallest normal float32
F32_MAX = (2.0 - 2.0**-23) * 2.0**127
INF, NAN = math.inf, math.nan


def examples(count: int) -> settings:
    """``count`` examples, the same on every run, with no time limit per example (the first pays torch's warm-up)."""
    return settings(deadline=None, derandomize=True, database=None, max_examples=count)


# ---------------------------------------------------------------------------------------------- the reference model
def to_f32(value: float) -> float:
    """Round a float64 to the nearest float32 (ties to even), or to +-inf beyond float32's range."""
    try:
        rounded: float = struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:  # struct refuses what rounds past FLT_MAX; float32 arithmetic gives inf there
        return math.copysign(INF, value)
    return rounded


@dataclass(frozen=True)
class Hyper:
    """``DynamicLossScaler``'s constructor arguments."""

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float
    max_scale: float
    max_consecutive_skips: int | None = None

    def scaler(self) -> DynamicLossScaler:
        return DynamicLossScaler(**asdict(self))

    def loss_scale(self) -> LossScale:
        kwargs = asdict(self)
        del kwargs["max_consecutive_skips"]
        init = kwargs.pop("init_scale")
        return LossScale(ScalePolicy(**kwargs), init)


@dataclass
class Reference:
    """The documented scaler, one optimizer, in plain Python.

    * A clean step counts towards growth; ``growth_interval`` clean steps in a row multiply the scale by
      ``growth_factor`` (capped at ``max_scale``) and start a new hysteresis period, even when the cap holds the scale;
      as GradScaler, a growth whose float32 product is inf is not taken (the scale stays).
    * An overflow restarts the growth count; the ``hysteresis``-th overflow since the last growth (or the start)
      multiplies the scale by ``backoff_factor`` (floored at ``min_scale``), and so does every later one until the
      next growth.
    * The scale is a float32: bounds and initial scale are rounded to float32, products are taken in float64 and rounded
      once to float32.
    * An overflow skips the optimizer step. A skip that backing off could not help (the coming update does not lower
      the scale: it is at min_scale, the hysteresis tolerates the overflow, or the backoff rounds to no change) counts
      towards ``max_consecutive_skips``; that many such skips within one run of skips raise ``FloatingPointError`` (in
      ``step``, before ``update``). A clean step ends the run.
    """

    hyper: Hyper
    scale: float = field(init=False)
    min_scale: float = field(init=False)
    max_scale: float = field(init=False)
    clean_in_a_row: int = 0
    overflows_since_growth: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0
    stuck_skips: int = 0
    last_step_skipped: bool = False

    def __post_init__(self) -> None:
        self.scale = to_f32(self.hyper.init_scale)
        self.min_scale = to_f32(self.hyper.min_scale)
        self.max_scale = to_f32(self.hyper.max_scale)

    def update(self, overflow: bool) -> bool:
        """The policy: advance by one step, return whether the scale changed."""
        before = self.scale
        if overflow:
            self.clean_in_a_row = 0
            self.overflows_since_growth += 1
            if self.overflows_since_growth >= self.hyper.hysteresis:
                self.scale = max(to_f32(self.scale * self.hyper.backoff_factor), self.min_scale)
        else:
            self.clean_in_a_row += 1
            if self.clean_in_a_row == self.hyper.growth_interval:
                self.clean_in_a_row = 0
                self.overflows_since_growth = 0
                grown = to_f32(self.scale * self.hyper.growth_factor)
                self.scale = min(grown, self.max_scale) if math.isfinite(grown) else self.scale
        return self.scale != before

    def step(self, overflow: bool) -> bool:
        """The optimizer step's bookkeeping; return whether the skip limit is reached (``FloatingPointError``)."""
        self.last_step_skipped = overflow
        if not overflow:
            self.consecutive_skips = self.stuck_skips = 0
            return False
        self.skipped_steps += 1
        self.consecutive_skips += 1
        backs_off = self.overflows_since_growth + 1 >= self.hyper.hysteresis
        lowers = backs_off and max(to_f32(self.scale * self.hyper.backoff_factor), self.min_scale) < self.scale
        if not lowers:
            self.stuck_skips += 1
        limit = self.hyper.max_consecutive_skips
        return limit is not None and self.stuck_skips >= limit


class Seen(NamedTuple):
    """What one training step leaves observable (after ``update``, or right after ``step`` raised)."""

    skipped: bool
    raised: bool
    scale: float
    skipped_steps: int
    consecutive_skips: int


def reference_trace(hyper: Hyper, overflows: Sequence[bool]) -> list[Seen]:
    ref, seen = Reference(hyper), []
    for overflow in overflows:
        raised = ref.step(overflow)
        if not raised:
            ref.update(overflow)
        seen.append(Seen(ref.last_step_skipped, raised, ref.scale, ref.skipped_steps, ref.consecutive_skips))
        if raised:
            break
    return seen


def test_the_references_float32_rounding_is_torchs_float64_to_float32_cast() -> None:
    @given(st.floats(allow_nan=False))
    @examples(300)
    def check(value: float) -> None:
        assert to_f32(value) == torch.tensor(value, dtype=torch.float64).to(torch.float32).item()

    check()


# ------------------------------------------------------------------------------------------------------- strategies
# Poison for one step: (value written into the gradient, flat index over the toy's parameters), or None (clean).
Poison = tuple[float, int] | None
SHAPES = ((3,), (2, 2))
NUMEL = sum(math.prod(shape) for shape in SHAPES)


NO_LIMIT: st.SearchStrategy[int | None] = st.none()


# Backoff factors within 2**-22 of 1 round to no backoff in float32; the constructor refuses them (1.0 itself is fine).
BACKOFF_MAX = 1.0 - 2.0**-22


def backoffs(low: float, high: float) -> st.SearchStrategy[float]:
    """Factors in ``[low, high)``, the ones the constructor refuses left out; with ``high == 1``, also 1.0 itself."""
    below = st.floats(low, min(high, BACKOFF_MAX), exclude_max=high <= BACKOFF_MAX)
    return st.one_of(below, st.just(1.0)) if high >= 1.0 else below


@st.composite
def hyperparameters(
    draw: st.DrawFn,
    *,
    scales: tuple[float, float] = (F32_TINY, F32_MAX),
    below: float = 2.0**20,
    above: float = 2.0**20,
    backoff: tuple[float, float] = (0.1, 1.0),
    limit: st.SearchStrategy[int | None] = NO_LIMIT,
) -> Hyper:
    """Random constants: any factors, bounds up to ``below``/``above`` times the initial scale (not powers of two)."""
    init = draw(st.floats(*scales))
    # Clamped to float32's normal range, as the constructor requires; init / x <= init and init * x >= init for x >= 1.
    min_scale = max(init / draw(st.floats(1.0, below)), F32_TINY)
    max_scale = min(init * draw(st.floats(1.0, above)), F32_MAX)
    return Hyper(
        init_scale=init,
        growth_factor=draw(st.floats(1.0, 4.0, exclude_min=True)),
        backoff_factor=draw(backoffs(*backoff)),
        growth_interval=draw(st.integers(1, 20)),
        hysteresis=draw(st.integers(1, 5)),
        min_scale=min_scale,
        max_scale=max_scale,
        max_consecutive_skips=draw(limit),
    )


POISONS = (INF, -INF, NAN)


@st.composite
def plans(draw: st.DrawFn, max_steps: int, min_steps: int = 1) -> list[Poison]:
    """Steps, each clean or with inf/-inf/NaN in one gradient entry; the overflow density is drawn too (0..100%).

    One byte per step, drawn in one go (drawing each step's choices separately made generation the bulk of the run):
    a byte at or above the density's threshold poisons the step, and its residues pick the value and the entry. Bytes
    shrink towards 0, i.e. towards clean steps.
    """
    density = draw(st.integers(0, 10))
    threshold = (10 - density) * 256 // 10  # 256 (never) .. 0 (always)
    plan: list[Poison] = []
    steps = draw(st.integers(min_steps, max_steps))  # drawn apart: binary() alone favours very short plans
    for byte in draw(st.binary(min_size=steps, max_size=steps)):
        plan.append((POISONS[byte % len(POISONS)], byte % NUMEL) if byte >= threshold else None)
    return plan


def overflows_of(plan: Sequence[Poison]) -> list[bool]:
    return [poison is not None for poison in plan]


# Gradient coefficients kept in [0.25, 4] in magnitude (or 0): with scales in [2**-60, 2**60] the scaled gradients stay
# normal float32 numbers, so unscaling loses no more than rounding.
coefficient = st.one_of(st.just(0.0), st.floats(0.25, 4.0, width=32), st.floats(-4.0, -0.25, width=32))
coefficients = st.lists(coefficient, min_size=NUMEL, max_size=NUMEL)
starts = st.lists(st.floats(-8.0, 8.0, width=32), min_size=NUMEL, max_size=NUMEL)


# ---------------------------------------------------------------------------------------------------- the toy model
def split(values: Sequence[float]) -> list[Tensor]:
    flat, out, at = torch.tensor(values, dtype=torch.float32), [], 0
    for shape in SHAPES:
        size = math.prod(shape)
        out.append(flat[at : at + size].reshape(shape).clone())
        at += size
    return out


class Toy:
    """SGD on two fp32 parameters with ``loss = sum(c * p)``: the true gradient is ``c`` at every step.

    ``fused=True``: torch's fused SGD, which the scaler drives through its fused path (the optimizer unscales and
    skips on the device, the host reads the flags later).
    """

    def __init__(self, start: Sequence[float], coefs: Sequence[float], lr: float = 0.1, fused: bool = False) -> None:
        self.params = [nn.Parameter(value) for value in split(start)]
        self.coefs = split(coefs)
        self.opt = torch.optim.SGD(self.params, lr=lr, fused=fused)

    def backward(self, scaler: Any, poison: Poison) -> None:
        """Backward of the scaled loss (gradients ``c * scale``, one float32 rounding), then the poison, if any."""
        self.opt.zero_grad(set_to_none=True)
        loss = sum(((p * c).sum() for p, c in zip(self.params, self.coefs, strict=True)), torch.zeros(()))
        scaler.scale(loss).backward()
        if poison is not None:
            value, index = poison
            for p in self.params:
                if index < p.numel():
                    assert p.grad is not None
                    with torch.no_grad():
                        p.grad.view(-1)[index] = value
                    return
                index -= p.numel()

    def values(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params]).clone()


def assert_invariants(scaler: DynamicLossScaler, hyper: Hyper) -> None:
    scale = scaler.get_scale()
    assert math.isfinite(scale) and scale > 0
    assert scale >= F32_TINY, f"denormal scale {scale!r}"
    # The bounds are float32 numbers (the documented contract): the requested ones, rounded.
    assert to_f32(hyper.min_scale) <= scale <= to_f32(hyper.max_scale)
    assert to_f32(scale) == scale, f"{scale!r} is not a float32 value"
    # The device copy the loss is multiplied by holds the same number (1 * scale is exact).
    device_value = scaler.scale(torch.ones((), dtype=torch.float32))
    assert device_value.dtype == torch.float32 and device_value.item() == scale


def run(
    scaler: Any, toy: Toy, plan: Sequence[Poison], *, check: Hyper | None = None
) -> tuple[list[Seen], list[Tensor]]:
    """Train ``toy`` through ``plan``; return what each step left observable and the parameters after it.

    With ``check`` (the scaler's constants), the invariants are asserted after every step and ``update()`` must read
    nothing from the device. Stops at the first ``FloatingPointError`` (recorded as ``raised``), which the unscale
    path raises in ``step()`` and the fused path, which learns of the skips later, in ``update()``.
    """
    seen: list[Seen] = []
    values: list[Tensor] = []
    for poison in plan:
        toy.backward(scaler, poison)
        raised = False
        try:
            scaler.step(toy.opt)
            calls: list[str] = []
            with host_reads(calls) if check is not None else nullcontext():
                scaler.update()
            assert calls == [], f"update() read {calls} from the device"
        except FloatingPointError:
            raised = True
        if check is not None and not raised:
            assert_invariants(scaler, check)
        if isinstance(scaler, DynamicLossScaler):
            result = scaler.result(toy.opt)
            assert result is not None
            counts = (result.skipped, raised, scaler.get_scale(), scaler.skipped_steps)
            seen.append(Seen(*counts, scaler.state_dict()["consecutive_skips"]))
        else:  # torch.amp.GradScaler: the scale only
            seen.append(Seen(False, raised, scaler.get_scale(), 0, 0))
        values.append(toy.values())
        if raised:
            break
    return seen, values


def at_step(step: int, message: str) -> str:
    return f"step {step}: {message}"


# ------------------------------------------------------------------------------------------------------- properties
@given(hyper=hyperparameters(), plan=plans(max_steps=200))
@examples(300)
def test_the_scale_machine_follows_the_reference(hyper: Hyper, plan: list[Poison]) -> None:
    scale, ref = hyper.loss_scale(), Reference(hyper)
    assert scale.value() == ref.scale
    for step, overflow in enumerate(overflows_of(plan)):
        before = scale.value()
        scale.advance(torch.tensor(float(overflow)))
        changed, expected_change = scale.value() != before, ref.update(overflow)
        assert (changed, scale.value()) == (expected_change, ref.scale), f"step {step} (overflow={overflow})"


@given(
    hyper=hyperparameters(scales=(2.0**-40, 2.0**40)),
    plan=plans(max_steps=40),
    start=starts,
    coefs=coefficients,
    lr=st.floats(1e-3, 1.0),
    fused=st.booleans(),
)
@examples(100)
def test_scaler_driving_sgd_follows_the_reference(
    hyper: Hyper, plan: list[Poison], start: list[float], coefs: list[float], lr: float, fused: bool
) -> None:
    toy = Toy(start, coefs, lr, fused)
    seen, values = run(hyper.scaler(), toy, plan)
    assert seen == reference_trace(hyper, overflows_of(plan))

    # The parameters follow p -= lr * c on clean steps (the gradient unscaled), computed here in float64.
    p0 = torch.tensor(start, dtype=torch.float64)
    c = torch.tensor(coefs, dtype=torch.float64)
    before, clean = torch.tensor(start, dtype=torch.float32), 0
    for step, (poison, after) in enumerate(zip(plan, values, strict=True)):
        if poison is not None:
            assert torch.equal(after, before), f"step {step} was skipped but the parameters moved"
        else:
            clean += 1
            expected = p0 - clean * lr * c
            # Per clean step: the inverse scale, c * scale, the unscaled gradient, lr and lr * grad are each rounded to
            # float32 (< 5 * 2**-24 of lr * |c| in all), and the sum to half an ulp of |p|: at most
            # 2**-21 * (lr * max|c| + max|p|) per step, accumulated over the clean steps.
            c_max = float(c.abs().max())
            p_max = float(p0.abs().max()) + clean * lr * c_max
            atol = clean * 2.0**-21 * (lr * c_max + p_max)
            torch.testing.assert_close(after.double(), expected, rtol=0, atol=atol, msg=partial(at_step, step))
        before = after


@given(hyper=hyperparameters(), plan=plans(max_steps=40), coefs=coefficients, fused=st.booleans())
@examples(80)
def test_scale_stays_a_normal_float32_within_bounds_and_update_never_reads_the_device(
    hyper: Hyper, plan: list[Poison], coefs: list[float], fused: bool
) -> None:
    # Any bounds in float32's normal range, up to its max: scaled gradients may overflow on their own at huge scales
    # (then the step is skipped, as it should be), so only the invariants are checked here, not the sequence.
    scaler = hyper.scaler()
    assert_invariants(scaler, hyper)
    seen, _ = run(scaler, Toy([1.0] * NUMEL, coefs, fused=fused), plan, check=hyper)
    assert len(seen) == len(plan)


@given(
    # Bounds close to the initial scale and a brisk backoff, so that runs often reach the floor or the ceiling, and
    # a cut can fall inside a run of skips at the floor (the skip limit's counter must survive the round trip).
    hyper=hyperparameters(
        scales=(2.0**-40, 2.0**40),
        below=2.0**4,
        above=2.0**8,
        backoff=(0.1, 0.9),
        limit=st.one_of(st.none(), st.integers(1, 8)),
    ),
    plan_and_cut=plans(max_steps=30).flatmap(lambda plan: st.tuples(st.just(plan), st.integers(0, len(plan)))),
    start=starts,
    coefs=coefficients,
    fused=st.booleans(),
)
@examples(80)
def test_a_state_dict_round_trip_at_any_step_continues_like_an_uninterrupted_run(
    hyper: Hyper, plan_and_cut: tuple[list[Poison], int], start: list[float], coefs: list[float], fused: bool
) -> None:
    plan, k = plan_and_cut
    whole = hyper.scaler()
    seen_whole, values_whole = run(whole, Toy(start, coefs, fused=fused), plan)

    first, toy = hyper.scaler(), Toy(start, coefs, fused=fused)
    seen, values = run(first, toy, plan[:k])
    last = first
    if not (seen and seen[-1].raised):
        buffer = io.BytesIO()
        torch.save(first.state_dict(), buffer)  # through a checkpoint file, as Lightning saves it
        buffer.seek(0)
        last = hyper.scaler()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # same hyperparameters, scale within bounds: nothing to warn about
            last.load_state_dict(torch.load(buffer, weights_only=True))
        more_seen, more_values = run(last, toy, plan[k:])
        seen, values = seen + more_seen, values + more_values

    assert seen == seen_whole
    assert last.state_dict() == whole.state_dict()
    # The same float32 operations in the same order: bit-identical parameters.
    torch.testing.assert_close(torch.stack(values), torch.stack(values_whole), rtol=0, atol=0)


@st.composite
def grad_scaler_like(draw: st.DrawFn) -> Hyper:
    """hysteresis=1 and bounds that never bind within 30 steps (GradScaler has none).

    Within 30 steps the scale stays in [init * 0.1**30, init * 4**30], inside [1e-30, 1.2e36] for an initial scale in
    [1, 1e18]: neither float32's normal minimum nor its maximum, the bounds used, is ever reached.
    """
    return Hyper(
        init_scale=draw(st.floats(1.0, 1e18)),
        growth_factor=draw(st.floats(1.0, 4.0, exclude_min=True)),
        backoff_factor=draw(st.floats(0.1, BACKOFF_MAX)),
        growth_interval=draw(st.integers(1, 20)),
        hysteresis=1,
        min_scale=F32_TINY,
        max_scale=F32_MAX,
    )


@given(hyper=grad_scaler_like(), plan=plans(max_steps=30), start=starts, coefs=coefficients, fused=st.booleans())
@examples(60)
def test_with_hysteresis_1_and_loose_bounds_the_scale_is_grad_scalers(
    hyper: Hyper, plan: list[Poison], start: list[float], coefs: list[float], fused: bool
) -> None:
    ours, our_values = run(hyper.scaler(), Toy(start, coefs, fused=fused), plan)
    grad_scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=hyper.init_scale,
        growth_factor=hyper.growth_factor,
        backoff_factor=hyper.backoff_factor,
        growth_interval=hyper.growth_interval,
    )
    theirs, their_values = run(grad_scaler, Toy(start, coefs, fused=fused), plan)
    assert [s.scale for s in ours] == [s.scale for s in theirs]
    # Same scaled gradients, same float32 inverse scale, same skip decisions, same SGD: bit-identical parameters.
    torch.testing.assert_close(torch.stack(our_values), torch.stack(their_values), rtol=0, atol=0)


@given(
    hyper=hyperparameters(
        scales=(2.0**-40, 2.0**40), below=2.0**4, above=2.0**8, backoff=(0.1, 0.9), limit=st.integers(1, 8)
    ),
    prefix=plans(max_steps=20),
    coefs=coefficients,
    fused=st.booleans(),
)
@examples(60)
def test_the_skip_limit_raises_exactly_where_the_reference_does_and_within_the_documented_bound(
    hyper: Hyper, prefix: list[Poison], coefs: list[float], fused: bool
) -> None:
    # A random start, then overflows until the reference reaches the limit: within 2**12 of the floor, backing off by
    # at most 0.9, that takes at most ~80 + hysteresis + limit steps.
    plan = list(prefix)
    while not reference_trace(hyper, overflows_of(plan))[-1].raised:
        plan.append((INF, 0))
        assert len(plan) < 200, "the reference never reached the limit"
    expected = reference_trace(hyper, overflows_of(plan))

    scaler = hyper.scaler()
    seen, _ = run(scaler, Toy([1.0] * NUMEL, coefs, fused=fused), plan)
    # Not before (every earlier step ran through update), and at exactly the step the reference raises at.
    assert seen == expected
    assert seen[-1].raised
    bound = skip_bound(scaler)
    assert bound is not None and seen[-1].consecutive_skips <= bound


@given(
    hyper=hyperparameters(
        scales=(2.0**-60, 2.0**60),
        below=2.0**16,
        above=2.0**4,
        backoff=(0.1, 0.9),
        limit=st.integers(1, 6),
    ),
    huge_hysteresis=st.booleans(),
    no_backoff=st.booleans(),
    fused=st.booleans(),
)
@examples(60)
def test_a_run_whose_every_step_overflows_stops_within_max_skips_in_a_row(
    hyper: Hyper, huge_hysteresis: bool, no_backoff: bool, fused: bool
) -> None:
    # Whatever the policy: a hysteresis that never runs out, a backoff of 1 that never lowers the scale, a scale far
    # above its floor. The bound is read off the settings before the run.
    hyper = replace(
        hyper,
        hysteresis=10**9 if huge_hysteresis else hyper.hysteresis,
        backoff_factor=1.0 if no_backoff else hyper.backoff_factor,
    )
    scaler = hyper.scaler()
    bound = skip_bound(scaler)
    assert bound is not None
    seen, _ = run(scaler, Toy([1.0] * NUMEL, [1.0] * NUMEL, fused=fused), [(INF, 0)] * (bound + 1))
    assert seen[-1].raised and len(seen) <= bound
    assert all(step.skipped for step in seen[:-1])
