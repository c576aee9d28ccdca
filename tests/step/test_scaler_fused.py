"""The fused-optimizer path: the optimizer unscales and skips on the device, the scaler reads nothing in the step.

References: ``torch.amp.GradScaler`` driving the same fused optimizer (bit-identical parameters and optimizer state,
overflows included), and our own unscale path (the same counters, scales and diagnostics, exact whenever read).
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_same_parameters, host_reads
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile
from versions import needs

from lightning_amp_plus import DynamicLossScaler
from lightning_amp_plus.step.engine import PendingStep, StepResult
from lightning_amp_plus.step.pending import PendingReads

INF, NAN = float("inf"), float("nan")
# Step 0 overflows too: the optimizer's state is then created by a skipped step (GradScaler does the same).
OVERFLOWS = {0: INF, 5: NAN, 6: INF, 11: -INF, 12: INF, 13: INF, 30: NAN}
STEPS = 40
FUSED = [
    pytest.param(torch.optim.Adam, {}, id="Adam"),
    pytest.param(torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.1}, id="Adam-amsgrad"),
    pytest.param(torch.optim.AdamW, {}, id="AdamW"),
    pytest.param(torch.optim.SGD, {}, id="SGD"),
    pytest.param(torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, id="SGD-momentum"),
    pytest.param(torch.optim.Adagrad, {}, id="Adagrad"),
]


def make_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(dtype)


def batch(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(4, 8, generator=gen)
    return x, x.sum(1, keepdim=True)


def loss_at(model: nn.Module, step: int, dtype: torch.dtype = torch.float32) -> Tensor:
    x, y = batch(step)
    with torch.autocast("cpu", dtype=torch.float16, enabled=dtype == torch.float32):
        loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
    return loss


def poison(model: nn.Module, step: int, overflows: dict[int, float]) -> None:
    if step in overflows:
        with torch.no_grad():
            model[2].weight.grad[0, 3] = overflows[step]  # type: ignore[index]


def train(
    scaler: Any,
    opt_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    *,
    steps: int = STEPS,
    overflows: dict[int, float] | None = None,
    dtype: torch.dtype = torch.float32,
    fused: bool = True,
    read_each_step: bool = True,
) -> tuple[list[float], nn.Module, torch.optim.Optimizer]:
    overflows = OVERFLOWS if overflows is None else overflows
    model = make_model(dtype)
    opt = opt_cls(model.parameters(), lr=1e-2, fused=fused, **kwargs)
    scales = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss_at(model, step, dtype)).backward()
        poison(model, step, overflows)
        scaler.step(opt)
        scaler.update()
        if read_each_step:
            scales.append(scaler.get_scale())
    return scales, model, opt


def assert_same_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for index in sa:
        assert sa[index].keys() == sb[index].keys(), index
        for key, value in sa[index].items():
            torch.testing.assert_close(value, sb[index][key], rtol=0, atol=0, msg=f"state[{index}][{key}]")


# ------------------------------------------------------------------------------------ parity with GradScaler
@pytest.mark.parametrize(("opt_cls", "kwargs"), FUSED)
def test_parameters_and_optimizer_state_are_bit_identical_to_grad_scaler_with_the_same_fused_optimizer(
    opt_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    # SGD with momentum: no overflow at step 0, where torch's fused SGD would keep uninitialised momentum buffers
    # (see test_a_first_step_skipped_by_fused_sgd_with_momentum_leaves_no_buffers).
    overflows = {k: v for k, v in OVERFLOWS.items() if k or opt_cls is not torch.optim.SGD}
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=5, max_consecutive_skips=None)
    ours, our_model, our_opt = train(scaler, opt_cls, kwargs, overflows=overflows)
    theirs, their_model, their_opt = train(
        torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=5), opt_cls, kwargs, overflows=overflows
    )
    assert ours == theirs
    pairs = list(itertools.pairwise(ours))
    assert any(b > a for a, b in pairs) and any(b < a for a, b in pairs)  # the scale both grew and backed off
    # Same protocol, same kernel, same grad_scale tensor values, same found_inf: the same bits.
    assert_same_parameters(our_model, their_model)
    assert_same_state(our_opt, their_opt)
    assert scaler.skipped_steps == len(overflows)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_parameters_are_bit_identical_to_grad_scaler_too(dtype: torch.dtype) -> None:
    # A pure half model: GradScaler's fused path accepts half gradients (its unscale path refuses fp16 ones).
    scaler = DynamicLossScaler(init_scale=2.0**8, growth_interval=5, max_consecutive_skips=None)
    ours, our_model, our_opt = train(scaler, torch.optim.AdamW, {}, dtype=dtype)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=5)
    theirs, their_model, their_opt = train(grad_scaler, torch.optim.AdamW, {}, dtype=dtype)
    assert ours == theirs
    assert_same_parameters(our_model, their_model)
    assert_same_state(our_opt, their_opt)


def test_a_skipped_step_leaves_parameters_and_state_untouched_including_the_step_counter() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**8)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    for step, bad in enumerate((None, INF)):
        opt.zero_grad()
        scaler.scale(loss_at(model, step)).backward()
        if bad is not None:
            params, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
            poison(model, step, {step: bad})
        scaler.step(opt)
        scaler.update()
    outcome = scaler.result(opt)
    assert outcome is not None and outcome.skipped
    for key, value in model.state_dict().items():
        assert torch.equal(value, params[key]), key
    assert_same_state_dicts(opt.state_dict(), state)
    assert all(entry["step"].item() == 1.0 for entry in opt.state_dict()["state"].values())


def assert_same_state_dicts(a: dict[str, Any], b: dict[str, Any]) -> None:
    for index, entry in a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["state"][index][key]), (index, key)


def test_a_first_step_skipped_by_fused_sgd_with_momentum_leaves_no_buffers() -> None:
    # torch's fused SGD creates its momentum buffers with torch.empty on its first step and keeps them when
    # found_inf skips the kernel; the next step would then read uninitialised memory. Ours checks that first step on
    # the host and does not step at all; the run then equals the unfused SGD.
    runs = []
    for fused in (True, False):
        scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=5)
        runs.append(train(scaler, torch.optim.SGD, {"momentum": 0.9}, fused=fused, steps=10))
    (fused_scales, fused_model, _), (plain_scales, plain_model, _) = runs
    assert fused_scales == plain_scales
    # The fused kernel and the foreach loop round the same update differently in the last bit, no more.
    for a, b in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------- host reads
def scalar_reads_outside_the_optimizer(prof: profile) -> int:
    """``aten::_local_scalar_dense`` events (a device value read on the host) not made by the optimizer's step.

    The CPU fused kernels read their scalars themselves (in C++, no sync on CPU); CUDA's do not.
    """
    count = 0
    for event in prof.events():
        if event.name != "aten::_local_scalar_dense":
            continue
        parent, inside = event.cpu_parent, False
        while parent is not None:
            inside = inside or parent.name.startswith("Optimizer.step#")
            parent = parent.cpu_parent
        count += not inside
    return count


# torch's fused Adagrad takes the loss scale on the device from torch 2.12 (`_step_supports_amp_scaling`); before, the
# scaler unscales its gradients first, with a host read, as GradScaler does.
WITHOUT_HOST_READS = [
    pytest.param(*p.values, id=p.id, marks=needs("torch", "2.12", "fused Adagrad taking the loss scale on the device"))
    if p.id == "Adagrad"
    else p
    for p in FUSED
    if p.id != "SGD-momentum"
]


@pytest.mark.parametrize(("opt_cls", "kwargs"), WITHOUT_HOST_READS)
def test_the_scaler_reads_nothing_from_the_device_in_the_step_overflows_included(
    opt_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=5)  # the default skip limit, 50
    model = make_model()
    opt = opt_cls(model.parameters(), lr=1e-2, fused=True, **kwargs)
    calls: list[str] = []
    with profile(activities=[ProfilerActivity.CPU]) as prof, host_reads(calls):
        for step in range(20):
            opt.zero_grad(set_to_none=True)
            scaled = scaler.scale(loss_at(model, step))
            scaled.backward()
            poison(model, step, OVERFLOWS)
            scaler.step(opt)
            scaler.update()
    assert calls == [] and scalar_reads_outside_the_optimizer(prof) == 0
    # Read when asked, from host memory: the skips are counted; nobody measured norms, so nothing is named.
    assert scaler.skipped_steps == sum(step in OVERFLOWS for step in range(20))
    last_skip = next(result for result in reversed(scaler.engine.log.recent) if result.skipped)
    assert last_skip.overflow_params is None and last_skip.grad_norm is None


def test_with_a_reader_the_fused_path_measures_the_norm_and_names_the_non_finite_gradients() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**10)
    scaler.engine.read_norms()  # what a MixedPrecisionMonitor does
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    calls: list[str] = []
    with host_reads(calls):
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss_at(model, step)).backward()
            poison(model, step, {2: INF})
            scaler.step(opt)
            scaler.update()
    assert calls == []  # still no read in the step
    results = list(scaler.engine.log.recent)
    assert [r.skipped for r in results] == [False, False, True, False]
    assert results[2].overflow_params == ["param_groups[0][2]"] and results[2].grad_norm == INF
    assert all(0 < (r.grad_norm or 0) < INF for r in results if not r.skipped)


def test_with_a_skip_limit_the_flags_are_read_once_per_limit_steps_not_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[int] = []
    original = PendingReads.take

    def take(self: PendingReads) -> Any:
        reads.append(len(self.entries))
        return original(self)

    monkeypatch.setattr(PendingReads, "take", take)
    scaler = DynamicLossScaler(max_consecutive_skips=10)
    train(scaler, torch.optim.AdamW, {}, steps=35, overflows={}, read_each_step=False)
    # A clean run: counted at steps 10, 20 and 30, where 10 skips in a row would first have been possible.
    assert reads == [10] * 3


# --------------------------------------------------------------------------- counters, outcomes, the skip limit
def observed(scaler: DynamicLossScaler, opt: torch.optim.Optimizer) -> tuple[Any, ...]:
    result = scaler.result(opt)
    assert result is not None
    return (
        scaler.get_scale(),
        scaler.skipped_steps,
        scaler.state_dict()["consecutive_skips"],
        result.skipped,
        result.overflow_params,
        result.scale,
    )


def test_counters_read_at_any_time_equal_the_unscale_paths() -> None:
    def run(fused: bool, read_at: set[int]) -> list[tuple[Any, ...]]:
        scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=4, hysteresis=2)
        scaler.engine.read_norms()  # the fused path names the non-finite gradients for a reader
        scaler.engine.name_parameters(model := make_model())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
        seen = []
        for step in range(STEPS):
            opt.zero_grad()
            scaler.scale(loss_at(model, step)).backward()
            poison(model, step, OVERFLOWS)
            scaler.step(opt)
            scaler.update()
            if step in read_at:
                seen.append(observed(scaler, opt))
        return seen

    every = set(range(STEPS))
    reference = run(fused=False, read_at=every)
    assert run(fused=True, read_at=every) == reference
    sparse = {3, 12, 13, STEPS - 1}  # long stretches unread in between
    assert run(fused=True, read_at=sparse) == [reference[i] for i in sorted(sparse)]


def test_the_grad_norm_is_measured_on_the_fused_path_too() -> None:
    norms = []
    for fused in (False, True):
        scaler = DynamicLossScaler(init_scale=2.0**10)
        scaler.engine.read_norms()  # a reader asks for the norm, on either path
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        scaler.scale(loss_at(model, 0)).backward()
        scaler.step(opt)
        scaler.update()
        norms.append(scaler.result(opt).grad_norm)
    # The norm of the scaled gradients divided by the power-of-two scale: the unscaled norm, summed differently.
    torch.testing.assert_close(torch.tensor(norms[1]), torch.tensor(norms[0]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_plain_step_checks_in_gradscalers_one_pass_and_measures_no_norm(dtype: torch.dtype) -> None:
    # Nothing clips and nobody asked for the norm: the gradients are unscaled and checked by GradScaler's own kernel,
    # so they are GradScaler's bit for bit (fp16 gradients, which GradScaler refuses, through the same kernel).
    grads = {}
    for name in ("ours", "torch"):
        model = make_model(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves the unscaled gradients to compare
        scaler: Any = DynamicLossScaler(init_scale=2.0**10) if name == "ours" else torch.amp.GradScaler("cpu", 2.0**10)
        scaler.scale(loss_at(model, 0, dtype)).backward()
        if name == "torch" and dtype == torch.float16:
            found = torch.zeros(1)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [p.grad for p in model.parameters()], found, torch.full((1,), 2.0**-10)
            )
        else:
            scaler.step(opt)
            scaler.update()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        if name == "ours":
            result = scaler.result(opt)
            assert result is not None and result.grad_norm is None and not result.skipped
    for mine, theirs in zip(grads["ours"], grads["torch"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_a_plain_step_with_an_inf_is_skipped_and_named_without_a_norm() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**10)
    model = make_model()
    scaler.engine.name_parameters(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(loss_at(model, 0)).backward()
    first = next(iter(model.parameters()))
    assert first.grad is not None
    first.grad[0] = math.inf
    scaler.step(opt)
    scaler.update()
    result = scaler.result(opt)
    assert result is not None and result.skipped and result.grad_norm is None
    assert result.overflow_params == [next(iter(dict(model.named_parameters())))]
    assert scaler.get_scale() == 2.0**9 and scaler.skipped_steps == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_a_step_outcome_resolves_on_first_access_and_stays_valid() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**10)
    scaler.engine.read_norms()
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    outcomes = []
    for step in range(8):
        opt.zero_grad()
        scaler.scale(loss_at(model, step)).backward()
        poison(model, step, {3: INF})
        scaler.step(opt)
        outcome = scaler.result(opt)
        assert isinstance(outcome, PendingStep) and not outcome.resolved
        outcomes.append(outcome)
        scaler.update()
    assert not any(outcome.resolved for outcome in outcomes)
    assert outcomes[5].skipped is False  # one read resolves every pending step
    assert all(outcome.resolved for outcome in outcomes)
    assert [outcome.skipped for outcome in outcomes] == [step == 3 for step in range(8)]
    assert outcomes[3].scale == 2.0**10 and outcomes[4].scale == 2.0**9
    assert outcomes[3].overflow_params == ["param_groups[0][2]"] and outcomes[2].overflow_params == []
    assert outcomes[3].grad_norm == INF and 0 < (outcomes[2].grad_norm or 0) < INF


def test_on_the_unscale_path_the_outcome_is_resolved_when_step_returns() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**8)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler.scale(loss_at(model, 0)).backward()
    scaler.unscale_(opt)  # e.g. to clip: the fused optimizer then takes the unscale path
    scaler.step(opt)
    outcome = scaler.result(opt)
    assert isinstance(outcome, StepResult) and not outcome.skipped  # known when step returned


def test_the_skip_limit_raises_at_the_same_step_as_on_the_unscale_path_naming_the_parameter() -> None:
    def run(fused: bool) -> tuple[int, str, str]:
        scaler = DynamicLossScaler(init_scale=4.0, max_consecutive_skips=3)
        scaler.engine.name_parameters(model := make_model())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
        for step in range(20):
            opt.zero_grad()
            scaler.scale(loss_at(model, step)).backward()
            poison(model, step, {s: NAN for s in range(2, 20)})
            try:
                scaler.step(opt)
            except FloatingPointError as error:
                return step, "step", str(error)
            try:
                scaler.update()
            except FloatingPointError as error:
                return step, "update", str(error)
        raise AssertionError("no FloatingPointError")

    unscale_step, unscale_where, unscale_message = run(fused=False)
    fused_step, fused_where, fused_message = run(fused=True)
    # 4 -> 2 -> 1 in two skips, then three at the floor: the 5th skip, step 6.
    assert unscale_step == fused_step == 6
    assert (unscale_where, fused_where) == ("step", "step")  # the fused path reads its steps' values in that step
    assert fused_message == unscale_message
    assert "non-finite gradients in 1 parameter(s): 2.weight" in fused_message


def test_mixing_the_paths_counts_every_step_once_in_order() -> None:
    def run(clip_at: set[int] | None) -> list[tuple[Any, ...]]:
        scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        seen = []
        for step in range(30):
            opt.zero_grad()
            scaler.scale(loss_at(model, step)).backward()
            poison(model, step, OVERFLOWS)
            if clip_at is None or step in clip_at:
                scaler.unscale_(opt)  # the unscale path for this step
            scaler.step(opt)
            scaler.update()
            if step % 7 == 0 or step == 29:
                seen.append(observed(scaler, opt)[:4])
        return seen

    assert run(clip_at={4, 5, 9, 20, 21}) == run(clip_at=None)


def test_state_dict_mid_run_resolves_and_a_restored_scaler_continues_identically() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    for step in range(15):
        opt.zero_grad()
        scaler.scale(loss_at(model, step)).backward()
        poison(model, step, OVERFLOWS)
        scaler.step(opt)
        scaler.update()
    restored = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    restored.load_state_dict(scaler.state_dict())
    twin, twin_opt = copy.deepcopy(model), None
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-2, fused=True)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for step in range(15, 30):
        for s, m, o in ((scaler, model, opt), (restored, twin, twin_opt)):
            o.zero_grad()
            s.scale(loss_at(m, step)).backward()
            poison(m, step, OVERFLOWS)
            s.step(o)
            s.update()
    assert restored.state_dict() == scaler.state_dict()
    assert_same_parameters(model, twin)


# ------------------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize(("opt_cls", "kwargs"), [p for p in FUSED if p.id != "SGD-momentum"])
def test_on_cuda_the_fused_path_matches_grad_scaler_bit_for_bit_without_a_single_sync(
    opt_cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
) -> None:
    def run(scaler: Any, strict: bool) -> tuple[nn.Module, torch.optim.Optimizer, list[Any]]:
        model = make_model().cuda()
        opt = opt_cls(model.parameters(), lr=1e-2, fused=True, **kwargs)
        outcomes = []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            x, y = (t.cuda() for t in batch(step))
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            poison(model, step, OVERFLOWS)
            if strict:
                torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
            try:
                scaler.step(opt)
                scaler.update()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if isinstance(scaler, DynamicLossScaler):
                outcomes.append(scaler.result(opt))
        return model, opt, outcomes

    # max_consecutive_skips=None: no read is due within these steps, so none may happen.
    ours = DynamicLossScaler("cuda", init_scale=2.0**10, growth_interval=5, max_consecutive_skips=None)
    our_model, our_opt, outcomes = run(ours, strict=True)
    grad_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=5)
    their_model, their_opt, _ = run(grad_scaler, strict=False)
    torch.cuda.synchronize()
    assert all(isinstance(outcome, PendingStep) and not outcome.resolved for outcome in outcomes)
    assert ours.get_scale() == grad_scaler.get_scale()
    assert [outcome.skipped for outcome in outcomes] == [step in OVERFLOWS for step in range(STEPS)]
    assert_same_parameters(our_model, their_model)
    assert_same_state(our_opt, their_opt)


@pytest.mark.parametrize(
    ("make_opt", "before_unscale", "expected"),
    [
        (lambda ps: torch.optim.AdamW(ps, fused=True), True, True),
        (lambda ps: torch.optim.AdamW(ps, fused=True), False, False),  # after unscale_: the unscale path
        (lambda ps: torch.optim.AdamW(ps), True, False),  # foreach: no fused protocol
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True), True, False),  # no momentum buffers yet
        (lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True), True, True),
    ],
    ids=["fused", "fused-after-unscale", "foreach", "fused-sgd-first-step", "fused-sgd-no-momentum"],
)
def test_which_path_a_step_takes(
    make_opt: Callable[[Any], torch.optim.Optimizer], before_unscale: bool, expected: bool
) -> None:
    model = make_model()
    opt = make_opt(model.parameters())
    scaler = DynamicLossScaler(init_scale=2.0**8)
    scaler.scale(loss_at(model, 0)).backward()
    if not before_unscale:
        scaler.unscale_(opt)
    scaler.step(opt)
    outcome = scaler.result(opt)
    assert isinstance(outcome, PendingStep) is expected  # the fused path's step is read lazily


def test_through_lightnings_optimizer_wrapper_the_flag_reaches_the_optimizer_that_runs_the_kernel() -> None:
    # LightningOptimizer delegates reads to the optimizer it wraps but keeps attributes set on itself: grad_scale and
    # found_inf must go on the wrapped one, or its kernel would step scaled gradients unscaled.
    from lightning.pytorch.core.optimizer import LightningOptimizer

    class Wrapper(LightningOptimizer):
        def step(self, closure: Any = None, **kwargs: Any) -> Any:  # no Trainer here: step the wrapped optimizer
            return self.optimizer.step(closure)

    runs = []
    for wrap in (False, True):
        model = make_model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        opt = Wrapper(inner) if wrap else inner
        scaler = DynamicLossScaler(init_scale=2.0**10)
        for step in range(6):
            inner.zero_grad()
            scaler.scale(loss_at(model, step)).backward()
            poison(model, step, {3: INF})
            scaler.step(opt)
            assert isinstance(scaler.result(opt), PendingStep)  # the fused path
            scaler.update()
        runs.append((model, scaler.skipped_steps))
    (plain, plain_skips), (wrapped, wrapped_skips) = runs
    assert plain_skips == wrapped_skips == 1
    assert_same_parameters(plain, wrapped)
