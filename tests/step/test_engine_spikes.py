"""The spike guard inside the step engine, against torch's own recipes.

* ``action="skip"``: a run whose spike is skipped equals, bit for bit, the same run with that batch removed (plain
  torch steps without a loss scale; ``torch.amp.GradScaler``'s recipe with one: the scale does not move for a spike).
* ``action="clip"``: equals torch's recipe with ``clip_grad_norm_(max_norm=threshold_norm)`` at the spike step, before
  the user's own ``clip_grad_norm_``.
* A clean run is the same with and without the guard; an overflow stays an overflow (never judged); the guard's
  statistics resume exactly from a checkpoint; a lasting rise under ``"skip"`` stops with the guard's diagnosis.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_amp_plus import SpikeGuard
from lightning_amp_plus.step.engine import PendingStep, StepEngine
from lightning_amp_plus.step.policy import LossScale, ScalePolicy

SPIKE = 3  # the batch whose loss is multiplied by 1e3 (after the warm-up)
STEPS = 12
WARMUP = 3


def model_and_optimizer(kind: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if kind == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    if kind == "fused-adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def batches(
    spikes: Sequence[int] = (SPIKE,), count: int = STEPS, factor: float = 1e3
) -> list[tuple[Tensor, Tensor, float]]:
    """Inputs, targets and a loss factor per step: ``factor`` on the spike steps (a finite spike, no overflow)."""
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator), factor if i in spikes else 1.0)
        for i in range(count)
    ]


def loss_of(model: nn.Module, batch: tuple[Tensor, Tensor, float]) -> Tensor:
    x, y, factor = batch
    return nn.functional.mse_loss(model(x), y) * factor


def policy() -> ScalePolicy:
    # A growth interval of 3: the scale grows during the run, so a spike that moved it would show.
    return ScalePolicy(2.0, 0.5, 3, 1, 1.0, 2.0**24)


def run_engine(
    engine: StepEngine, kind: str, data: list[tuple[Tensor, Tensor, float]], clip: float | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optimizer = model_and_optimizer(kind)
    engine.track(optimizer)
    for batch in data:
        engine.scale_loss(loss_of(model, batch)).backward()
        if clip is not None:
            engine.clip_by_norm(optimizer, clip)
        engine.step(optimizer)
        engine.update()
        optimizer.zero_grad()
    return model, optimizer


def run_torch(
    kind: str,
    data: list[tuple[Tensor, Tensor, float]],
    scaled: bool,
    clip: float | None = None,
    before_step: Callable[[int, nn.Module], None] | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, float | None]:
    """torch's recipe: plain steps, or GradScaler's (unscale_, clip, step, update) with the same scale policy."""
    model, optimizer = model_and_optimizer(kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, enabled=scaled)
    for index, batch in enumerate(data):
        scaler.scale(loss_of(model, batch)).backward()
        scaler.unscale_(optimizer)
        if before_step is not None:
            before_step(index, model)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return model, optimizer, scaler.get_scale() if scaled else None


def assert_same(ours: tuple[nn.Module, torch.optim.Optimizer], theirs: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    torch.testing.assert_close(ours[0].state_dict(), theirs[0].state_dict(), rtol=0, atol=0)
    torch.testing.assert_close(ours[1].state_dict()["state"], theirs[1].state_dict()["state"], rtol=0, atol=0)


def engine_with(guard: SpikeGuard | None, scaled: bool) -> StepEngine:
    return StepEngine(LossScale(policy(), 2.0**10) if scaled else None, spike_guard=guard)


CASES = [(kind, scaled) for kind in ("adamw", "sgd", "fused-adamw") for scaled in (False, True)]
IDS = [f"{kind}-{'scaled' if scaled else 'bf16-check'}" for kind, scaled in CASES]


# ---------------------------------------------------------------------------------------------------------- skip
@pytest.mark.parametrize(("kind", "scaled"), CASES, ids=IDS)
def test_a_skipped_spike_leaves_the_run_as_if_its_batch_had_never_been_seen(kind: str, scaled: bool) -> None:
    data = batches()
    engine = engine_with(SpikeGuard(warmup=WARMUP), scaled)
    ours = run_engine(engine, kind, data)
    without = [batch for index, batch in enumerate(data) if index != SPIKE]
    theirs = run_torch(kind, without, scaled)
    assert_same(ours, theirs)
    if scaled:
        assert engine.loss_scale is not None and engine.loss_scale.value() == theirs[2]
    results = list(engine.log.recent)
    assert [r.index for r in results if r.skipped] == [SPIKE]
    spike = results[SPIKE]
    assert spike.spike_verdict is not None and spike.spike_verdict.action == "skip"
    assert not spike.overflowed and spike.overflow_params == [] and engine.skipped_steps == 1
    assert spike.grad_norm is not None and spike.grad_norm > spike.spike_verdict.threshold_norm
    assert engine.spike_guards is not None and engine.spike_guards.of(0).steps == STEPS - 1


# ---------------------------------------------------------------------------------------------------------- clip
@pytest.mark.parametrize("user_clip", [None, 0.5], ids=["no-user-clip", "user-clip"])
@pytest.mark.parametrize(("kind", "scaled"), CASES, ids=IDS)
def test_a_clipped_spike_equals_clip_grad_norm_to_the_threshold_before_the_users_clip(
    kind: str, scaled: bool, user_clip: float | None
) -> None:
    data = batches()
    engine = engine_with(SpikeGuard(warmup=WARMUP, action="clip"), scaled)
    ours = run_engine(engine, kind, data, clip=user_clip)
    verdict = engine.log.recent[SPIKE].spike_verdict
    assert verdict is not None and verdict.action == "clip" and verdict.coefficient < 1.0
    flagged = [r.index for r in engine.log.recent if r.spike_verdict is not None and r.spike_verdict.spike]
    assert flagged == [SPIKE] and engine.skipped_steps == 0

    def clip_the_spike(index: int, model: nn.Module) -> None:
        if index == SPIKE:
            torch.nn.utils.clip_grad_norm_(model.parameters(), verdict.threshold_norm)

    theirs = run_torch(kind, data, scaled, clip=user_clip, before_step=clip_the_spike)
    assert_same(ours, theirs)
    # The result's norm is that of the clipped gradients (the one the user's clip saw): at the threshold.
    assert engine.log.recent[SPIKE].grad_norm == pytest.approx(verdict.threshold_norm, rel=1e-5)


# --------------------------------------------------------------------------------------------- clean, overflow
@pytest.mark.parametrize("action", ["skip", "clip"])
@pytest.mark.parametrize(("kind", "scaled"), CASES, ids=IDS)
def test_a_clean_run_is_the_same_with_and_without_the_guard(kind: str, scaled: bool, action: Any) -> None:
    data = batches(spikes=())
    guarded = engine_with(SpikeGuard(warmup=WARMUP, action=action), scaled)
    ours = run_engine(guarded, kind, data)
    # The reference: torch's recipe (the engine's fused path would unscale inside the kernel, a different rounding).
    assert_same(ours, run_torch(kind, data, scaled)[:2])
    assert all(r.spike_verdict is not None and not r.spike_verdict.spike for r in guarded.log.recent)
    assert guarded.spike_guards is not None and guarded.spike_guards.of(0).steps == STEPS


def test_an_overflow_stays_an_overflow_the_guard_never_judges_it() -> None:
    data = batches(spikes=())
    data[SPIKE] = (data[SPIKE][0], data[SPIKE][1], float("inf"))
    engine = engine_with(SpikeGuard(warmup=WARMUP), scaled=True)
    run_engine(engine, "adamw", data)
    result = engine.log.recent[SPIKE]
    assert result.skipped and result.overflowed and result.spike_verdict is None
    assert engine.spike_guards is not None and engine.spike_guards.of(0).steps == STEPS - 1
    # The scale backed off for the overflow, as GradScaler's does.
    torch_scale = run_torch("adamw", data, scaled=True)[2]
    assert engine.loss_scale is not None and engine.loss_scale.value() == torch_scale


def test_the_guard_turns_the_fused_path_off() -> None:
    model, optimizer = model_and_optimizer("fused-adamw")
    for guard in (None, SpikeGuard()):
        engine = engine_with(guard, scaled=True)
        engine.scale_loss(loss_of(model, batches()[0])).backward()
        engine.step(optimizer)
        assert isinstance(engine.log.recent[-1], PendingStep) is (guard is None)  # the fused path's mark
        engine.update()
        optimizer.zero_grad()


# ------------------------------------------------------------------------------------- optimizers, checkpoints
def test_each_optimizer_has_a_guard_of_its_own_the_first_the_one_given() -> None:
    given = SpikeGuard(warmup=WARMUP)
    engine = engine_with(given, scaled=False)
    torch.manual_seed(0)
    first, second = nn.Linear(4, 1), nn.Linear(4, 1)
    optimizers = [torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)]
    for optimizer in optimizers:
        engine.track(optimizer)
    for step in range(8):
        x = torch.randn(2, 4)
        losses = [first(x).sum(), second(x).sum() * (100.0 if step % 2 else 1.0)]  # norms unlike the first's
        for loss, optimizer in zip(losses, optimizers, strict=True):
            loss.backward()
            engine.step(optimizer)
            optimizer.zero_grad()
        engine.update()
    assert engine.spike_guards is not None
    assert engine.spike_guards.of(0) is given and engine.spike_guards.of(1) is not given
    assert given.steps == 8 and engine.spike_guards.of(1).steps == 8
    assert engine.spike_guards.of(1).mean > 10 * given.mean
    assert (engine.spike_guards.of(1).threshold, engine.spike_guards.of(1).warmup) == (given.threshold, WARMUP)


@pytest.mark.parametrize("action", ["skip", "clip"])
def test_a_run_resumed_from_the_engines_state_judges_and_steps_as_the_uninterrupted_one(action: Any) -> None:
    data = batches(spikes=(6,))
    whole = engine_with(SpikeGuard(warmup=WARMUP, action=action), scaled=True)
    expected = run_engine(whole, "adamw", data)

    first = engine_with(SpikeGuard(warmup=WARMUP, action=action), scaled=True)
    model, optimizer = run_engine(first, "adamw", data[:5])
    saved = copy.deepcopy((first.state_dict(), model.state_dict(), optimizer.state_dict()))
    assert saved[0]["spike_guard"][0]["steps"] == 5

    resumed = engine_with(SpikeGuard(warmup=WARMUP, action=action), scaled=True)
    resumed.load_state_dict(**saved[0])
    model, optimizer = model_and_optimizer("adamw")
    model.load_state_dict(saved[1])
    optimizer.load_state_dict(saved[2])
    resumed.track(optimizer)
    for batch in data[5:]:
        resumed.scale_loss(loss_of(model, batch)).backward()
        resumed.step(optimizer)
        resumed.update()
        optimizer.zero_grad()
    assert_same((model, optimizer), expected)
    assert resumed.state_dict() == whole.state_dict()


def test_a_state_loaded_before_the_optimizer_is_known_waits_for_its_guard() -> None:
    saved = engine_with(SpikeGuard(warmup=WARMUP), scaled=False)
    run_engine(saved, "sgd", batches(spikes=()))
    fresh = engine_with(SpikeGuard(warmup=WARMUP), scaled=False)
    fresh.load_state_dict(**saved.state_dict())
    assert (
        fresh.spike_guards is not None and fresh.spike_guards.of(0).state_dict() == saved.state_dict()["spike_guard"][0]
    )


# ------------------------------------------------------------------------------------------------ a lasting rise
def test_a_lasting_rise_under_skip_stops_with_the_guards_diagnosis() -> None:
    engine = StepEngine(None, spike_guard=SpikeGuard(warmup=WARMUP), max_consecutive_skips=4)
    data = batches(spikes=range(SPIKE, STEPS))  # from SPIKE on, every batch is 1e3 times larger
    with pytest.raises(FloatingPointError) as caught:
        run_engine(engine, "sgd", data)
    message = str(caught.value)
    assert "4 optimizer steps in a row were skipped as gradient-norm spikes" in message
    assert "above the guard's limit" in message and "SpikeGuard(action='clip')" in message
    assert engine.skipped_steps == 4


def test_clip_follows_a_lasting_rise_its_clipped_steps_entering_the_statistics() -> None:
    engine = StepEngine(None, spike_guard=SpikeGuard(warmup=WARMUP, action="clip"))
    run_engine(engine, "adamw", batches(spikes=range(SPIKE, 60), count=60, factor=30.0))
    flagged = [r.index for r in engine.log.recent if r.spike_verdict is not None and r.spike_verdict.spike]
    # A 30x rise is clipped for a while (each clipped step raises the mean towards its limit), then taken.
    assert flagged and flagged[0] == SPIKE and max(flagged) < 40 and engine.skipped_steps == 0


# ------------------------------------------------------------------------------------------------------ refusals
def test_a_guard_without_the_check_is_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match=r"spike_guard=SpikeGuard\(.*\).*check"):
        StepEngine(None, check=False, spike_guard=SpikeGuard())


def test_something_else_than_a_guard_is_refused() -> None:
    with pytest.raises(TypeError, match=r"`spike_guard=25.0` \(float\).*SpikeGuard\(\)"):
        StepEngine(None, spike_guard=25.0)  # type: ignore[arg-type]
