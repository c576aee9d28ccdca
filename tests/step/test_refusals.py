"""What the scaler and the engine refuse, and what reading a pending step must not do.

Each refusal names the argument or attribute, the value and the fix; each case here was a line the CPU suite never
executed (``.ci/run``'s coverage report) although the CHANGELOG or a docstring promised it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_amp_plus import DynamicLossScaler
from lightning_amp_plus.step.engine import PendingStep


def stepped(fused: bool) -> tuple[DynamicLossScaler, torch.optim.Optimizer]:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
    scaler = DynamicLossScaler(init_scale=8.0)
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    return scaler, optimizer


@pytest.mark.parametrize(("name", "fix"), [("process_group", "engine.ranks"), ("sharding", "engine.ranks")])
def test_the_engine_refuses_the_names_ranks_replaced_naming_ranks(name: str, fix: str) -> None:
    engine = DynamicLossScaler().engine
    with pytest.raises(AttributeError, match=rf"`StepEngine` has no attribute '{name}'.*`{fix}`"):
        setattr(engine, name, object())
    assert name not in vars(engine)


def test_the_engine_refuses_any_name_it_does_not_have_without_a_fix_to_name() -> None:
    engine = DynamicLossScaler().engine
    with pytest.raises(AttributeError, match=r"no attribute 'measure_norm': setting it would do nothing\.$"):
        engine.measure_norm = True  # type: ignore[attr-defined]


def test_the_scaler_refuses_a_name_gradscaler_does_not_have_and_points_to_the_engine() -> None:
    scaler = DynamicLossScaler()
    with pytest.raises(AttributeError, match=r"no attribute 'process_group'.*`scaler\.engine\.ranks`"):
        scaler.process_group = None  # type: ignore[attr-defined]


def test_a_closure_given_to_step_is_refused_with_the_loop_that_works() -> None:
    scaler, optimizer = stepped(fused=False)
    with pytest.raises(ValueError, match=r"closures are not supported.*call `step\(optimizer\)`"):
        scaler.step(optimizer, lambda: 0.0)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("inf"), float("nan"), True, "1"])
def test_clip_grad_norm_refuses_a_max_norm_that_is_not_a_finite_positive_number(max_norm: object) -> None:
    scaler, optimizer = stepped(fused=False)
    scaler.unscale_(optimizer)
    with pytest.raises(ValueError, match=r"max_norm=.*must be a finite number > 0"):
        scaler.clip_grad_norm_(optimizer, max_norm)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_the_skip_limit_set_later_is_checked_as_the_constructor_checks_it(value: object) -> None:
    engine = DynamicLossScaler().engine
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        engine.max_consecutive_skips = value  # type: ignore[assignment]
    engine.max_consecutive_skips = None
    assert engine.max_consecutive_skips is None


def test_the_repr_of_a_pending_step_reads_nothing() -> None:
    scaler, optimizer = stepped(fused=True)
    scaler.step(optimizer)
    pending = scaler.result(optimizer)
    assert isinstance(pending, PendingStep)
    assert repr(pending) == f"PendingStep(index={pending.index}, unread)"
    assert pending._result is None  # still unread: the repr read no value (the host buffer is read by ctypes)
    assert pending.skipped is False and repr(pending) == repr(pending.result)
