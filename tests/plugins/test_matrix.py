"""The plugins' training matrix: every case declared once, one runner, each case against its reference, bit for bit.

Axes: front end (the Trainer, Fabric) x precision (16-mixed, bf16-mixed, bf16-true) x optimizer (foreach Adam, fused
Adam) x clipping (none, by norm, by value) x gradient accumulation (1, 2) x manual optimization (the Trainer's) x master
weights (the mixed precisions) x compensation (bf16-true). Each case trains the same tiny model from the same seed on
the same batches under our plugin and under its reference, with an overflow injected at one step in fp16, and the
parameters and optimizer state after the run are compared bit for bit.

The reference is somebody else's behaviour wherever it exists:

* ``"lightning"``: Lightning's own ``MixedPrecision`` / ``HalfPrecision`` plugin at the same precision (automatic
  optimization);
* ``"fabric"``: Fabric's own ``MixedPrecision`` / ``HalfPrecision`` in the same Fabric loop;
* ``"loop"``: torch's AMP recipe in a plain loop (``torch.amp.GradScaler``: scale, unscale, clip, step, update), as the
  front end runs the forward, where the built-in cannot serve: Lightning's refuses to clip with a fused optimizer (fp16,
  and bf16: Lightning #21435), Fabric's refuses to clip a fused optimizer's gradients in fp16, and under manual
  optimization Lightning's fp16 plugin clips the still-scaled gradients (this plugin follows torch's recipe);
* ``"compensator"``: compensated bf16 weights have no built-in: the reference is the same plain loop stepping the
  optimizer with :class:`~lightning_amp_plus.weights.compensated.Compensator` (whose updates ``tests/weights`` checks
  against torch's FP32 optimizers).

bf16 weights are not clipped by norm here: the plugin measures half gradients with float32 accumulation (torch's
``clip_grad_norm_`` accumulates in bf16), a deliberate difference ``tests/step/test_grads.py`` covers.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import FP16_ON_CPU_WARNING, START_SCALE, make_net, make_trainer, regression_data
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalf
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
from lightning.fabric.plugins.precision.utils import _DtypeContextManager
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_amp_plus.fabric as amp_fabric
from lightning_amp_plus import DynamicLossScaler, MixedPrecisionPlugin
from lightning_amp_plus.weights.compensated import Compensator

pytestmark = [
    pytest.mark.filterwarnings(FP16_ON_CPU_WARNING),
    pytest.mark.filterwarnings(r"ignore:lightning_amp_plus.fabric.MixedPrecisionPlugin\('16-mixed'\) on CPU"),
]

STEPS = 5
OVERFLOW_STEP = 2  # fp16 only: the built-in bf16 plugins do not skip a non-finite step (their weights would turn NaN)
BATCH = 8
CLIP = {"norm": 0.05, "value": 0.01}
HALF = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    front: str  # "trainer" or "fabric"
    precision: str
    optimizer: str  # "foreach" or "fused"
    clip: str | None  # None, "norm" or "value"
    accumulate: int
    manual: bool = False  # the Trainer's manual optimization
    master_weights: bool = False
    compensation: str | None = None  # bf16-true: "kahan", "stochastic" or None (plain bf16-true)

    def __str__(self) -> str:
        parts = [self.front, self.precision, self.optimizer, f"acc{self.accumulate}", f"clip-{self.clip}"]
        parts += (
            ["manual"] * self.manual
            + ["master"] * self.master_weights
            + [str(self.compensation)] * (self.precision == "bf16-true")
        )
        return "-".join(parts)

    @property
    def reference(self) -> str:
        if self.compensation is not None:
            return "compensator"
        fused_clip = self.optimizer == "fused" and self.clip is not None
        if self.front == "trainer":
            return "loop" if self.manual or (fused_clip and self.precision != "bf16-true") else "lightning"
        return "loop" if fused_clip and self.precision == "16-mixed" else "fabric"

    @property
    def overflow_step(self) -> int | None:
        return OVERFLOW_STEP if self.precision == "16-mixed" else None


def cases() -> Iterator[Case]:
    for front, precision, optimizer, clip, accumulate in itertools.product(
        ("trainer", "fabric"), ("16-mixed", "bf16-mixed"), ("foreach", "fused"), (None, "norm", "value"), (1, 2)
    ):
        yield Case(front, precision, optimizer, clip, accumulate)
        if front == "trainer":
            yield Case(front, precision, optimizer, clip, accumulate, manual=True)
            yield Case(front, precision, optimizer, clip, accumulate, master_weights=True)
    for front, compensation, optimizer, clip, accumulate in itertools.product(
        ("trainer", "fabric"), (None, "kahan", "stochastic"), ("foreach", "fused"), (None, "value"), (1, 2)
    ):
        yield Case(front, "bf16-true", optimizer, clip, accumulate, compensation=compensation)
        if front == "trainer":
            yield Case(front, "bf16-true", optimizer, clip, accumulate, manual=True, compensation=compensation)


CASES = list(cases())


# --------------------------------------------------------------------------------------------------- the pieces
def batches(case: Case) -> list[tuple[Tensor, Tensor]]:
    data = regression_data(BATCH * STEPS * case.accumulate)
    return list(DataLoader(data, batch_size=BATCH, shuffle=False))


def optimizer_of(case: Case, params: Any) -> torch.optim.Optimizer:
    fused = case.optimizer == "fused"
    return torch.optim.Adam(params, lr=0.05, weight_decay=0.01, fused=fused, foreach=None if fused else True)


def fresh_net(case: Case) -> nn.Sequential:
    torch.manual_seed(0)
    return make_net()


def loss_of(case: Case, output: Tensor, y: Tensor, step: int) -> Tensor:
    # y.float(): the bf16-true Trainer hands a bf16 target, and torch 2.6 cannot backpropagate an mse_loss of an FP32
    # input and a bf16 target ("Found dtype BFloat16 but expected Float"); the loss is the same number either way.
    loss = F.mse_loss(output.float(), y.float())
    return loss * float("inf") if step == case.overflow_step else loss


def clip_(case: Case, params: list[Tensor]) -> None:
    if case.clip == "norm":
        torch.nn.utils.clip_grad_norm_(params, CLIP["norm"])
    elif case.clip == "value":
        torch.nn.utils.clip_grad_value_(params, CLIP["value"])


@dataclass
class Run:
    """What a run left: the parameters and the optimizer's state, the final loss scale, the steps it skipped."""

    tensors: list[Tensor]
    scale: float | None
    skipped: int | None  # None: the reference does not count them (a GradScaler)


def tensors_of(net: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    state = [t.detach().clone() for s in optimizer.state.values() for t in s.values() if isinstance(t, Tensor)]
    return [p.detach().clone() for p in net.parameters()] + state


def counted(plugin: Any) -> int | None:
    return plugin.skipped_steps if isinstance(plugin, MixedPrecisionPlugin | amp_fabric.MixedPrecisionPlugin) else None


# ------------------------------------------------------------------------------------------------- the Trainer
class Matrix(pl.LightningModule):
    """The net, the loss with its injected overflow, Adam with a StepLR; manual optimization on request."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        self.net = fresh_net(case)
        self.automatic_optimization = not case.manual

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        x, y = batch
        step = batch_idx // self.case.accumulate
        loss = loss_of(self.case, self.net(x), y, step)
        if self.automatic_optimization:
            return loss
        self.manual_backward(loss / self.case.accumulate)
        if (batch_idx + 1) % self.case.accumulate == 0:
            opt = self.optimizers()
            if self.case.clip is not None:
                self.clip_gradients(opt, gradient_clip_val=CLIP[self.case.clip], gradient_clip_algorithm=self.case.clip)
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()  # type: ignore[union-attr]
        return None

    def configure_optimizers(self) -> Any:
        optimizer = optimizer_of(self.case, self.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def trainer_run(case: Case, plugin: Any) -> Run:
    model = Matrix(case)
    kwargs: dict[str, Any] = {"max_steps": STEPS, "max_epochs": -1}
    if not case.manual:
        kwargs["accumulate_grad_batches"] = case.accumulate
        if case.clip is not None:
            kwargs.update(gradient_clip_val=CLIP[case.clip], gradient_clip_algorithm=case.clip)
    trainer = make_trainer(plugin, **kwargs)
    trainer.fit(model, DataLoader(batches(case), batch_size=None))
    scale = None if trainer.scaler is None else float(trainer.scaler.get_scale())
    return Run(tensors_of(model.net, model.optimizers().optimizer), scale, counted(plugin))  # type: ignore[union-attr]


def trainer_ours(case: Case) -> MixedPrecisionPlugin:
    scaler = DynamicLossScaler(init_scale=START_SCALE, growth_interval=10_000) if case.precision == "16-mixed" else None
    # hold_schedulers_on_skip=False: as the built-in, which steps the scheduler after a skipped step.
    return MixedPrecisionPlugin(
        case.precision,  # type: ignore[arg-type]
        device="cpu",
        scaler=scaler,
        hold_schedulers_on_skip=False,
        master_weights=case.master_weights,
        compensation=case.compensation if case.precision == "bf16-true" else None,  # type: ignore[arg-type]
    )


def trainer_lightnings(case: Case) -> Any:
    if case.precision == "bf16-true":
        return HalfPrecision("bf16-true")
    plugin = MixedPrecision(case.precision, device="cpu")  # type: ignore[arg-type]
    if plugin.scaler is not None:
        plugin.scaler = torch.amp.GradScaler("cpu", init_scale=START_SCALE, growth_interval=10_000)
    return plugin


# --------------------------------------------------------------------------------------------------- Fabric
def fabric_run(case: Case, plugin: Any) -> Run:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = fresh_net(case)
    model, optimizer = fabric.setup(net, optimizer_of(case, net.parameters()))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=0.5)
    data = batches(case)
    for step in range(STEPS):
        for micro in range(case.accumulate):
            x, y = data[step * case.accumulate + micro]
            fabric.backward(loss_of(case, model(x), y, step) / case.accumulate)
        if case.clip == "norm":
            # Fabric's own fp16 plugin leaves an overflow's inf gradients to the clip, which raises by default.
            fabric.clip_gradients(model, optimizer, max_norm=CLIP["norm"], error_if_nonfinite=False)
        elif case.clip == "value":
            fabric.clip_gradients(model, optimizer, clip_val=CLIP["value"])
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    if isinstance(plugin, amp_fabric.MixedPrecisionPlugin):  # its scale moves at the next backward, or when saved
        saved = plugin.state_dict().get("scaler", {})
        scale = saved.get("scale") if plugin.scaler is not None else None
    else:  # Fabric's own: MixedPrecision has a scaler (None for bf16), HalfPrecision none at all
        scaler = getattr(plugin, "scaler", None)
        scale = None if scaler is None else float(scaler.get_scale())
    return Run(tensors_of(net, optimizer.optimizer), scale, counted(plugin))


def fabric_ours(case: Case) -> amp_fabric.MixedPrecisionPlugin:
    scaler = DynamicLossScaler(init_scale=START_SCALE, growth_interval=10_000) if case.precision == "16-mixed" else None
    return amp_fabric.MixedPrecisionPlugin(
        case.precision,  # type: ignore[arg-type]
        device="cpu",
        scaler=scaler,
        compensation=case.compensation if case.precision == "bf16-true" else None,  # type: ignore[arg-type]
    )


def fabric_builtin(case: Case) -> Any:
    if case.precision == "bf16-true":
        return FabricHalf("bf16-true")
    scaler = torch.amp.GradScaler("cpu", init_scale=START_SCALE, growth_interval=10_000)
    return FabricMixed(case.precision, device="cpu", scaler=scaler if case.precision == "16-mixed" else None)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------- the plain-loop reference
def loop_run(case: Case) -> Run:
    """torch's recipe, running the forward as the case's front end does.

    The Trainer: the loss under autocast without the cast cache (bf16-true: the whole batch cast to bf16, the loss
    under bf16 default tensors). Fabric: the model's input cast to the half dtype, the model alone under its forward
    context (autocast with the cache), its output cast back to FP32 and the loss taken outside.
    """
    net = fresh_net(case)
    half_weights = case.precision == "bf16-true"
    if half_weights:
        net = net.to(torch.bfloat16)
    optimizer = optimizer_of(case, net.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    fp16 = case.precision == "16-mixed"
    scaler = torch.amp.GradScaler("cpu", init_scale=START_SCALE, growth_interval=10_000, enabled=fp16)
    compensator = None if case.compensation is None else Compensator(optimizer, case.compensation, seed=0)  # type: ignore[arg-type]
    data = batches(case)
    for step in range(STEPS):
        for micro in range(case.accumulate):
            x, y = data[step * case.accumulate + micro]
            scaler.scale(_forward_loss(case, net, x, y, step) / case.accumulate).backward()
        scaler.unscale_(optimizer)
        clip_(case, [p for p in net.parameters() if p.grad is not None])
        if compensator is not None:
            compensator.step()
        else:
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scheduler.step()
    return Run(tensors_of(net, optimizer), float(scaler.get_scale()) if fp16 else None, None)


def _forward_loss(case: Case, net: nn.Module, x: Tensor, y: Tensor, step: int) -> Tensor:
    half = HALF[case.precision]
    if case.precision == "bf16-true":
        context: AbstractContextManager[Any] = _DtypeContextManager(torch.bfloat16)
    else:
        context = torch.autocast("cpu", dtype=half, cache_enabled=case.front == "fabric")
    if case.front == "trainer":
        if case.precision == "bf16-true":
            x, y = x.to(half), y.to(half)  # Lightning's bf16-true converts the whole batch
        with context:
            return loss_of(case, net(x), y, step)
    with context:
        output = net(x.to(half))  # Fabric converts the model's inputs only
    return loss_of(case, output.float(), y, step)


# ------------------------------------------------------------------------------------------------------ runner
def run(case: Case, ours: bool) -> Run:
    if case.front == "trainer":
        if ours:
            return trainer_run(case, trainer_ours(case))
        if case.reference == "lightning":
            return trainer_run(case, trainer_lightnings(case))
    else:
        if ours:
            return fabric_run(case, fabric_ours(case))
        if case.reference == "fabric":
            return fabric_run(case, fabric_builtin(case))
    return loop_run(case)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_every_case_trains_bit_for_bit_as_its_reference(case: Case) -> None:
    expected = run(case, ours=False)
    actual = run(case, ours=True)
    # The overflow was skipped and counted; the scale backed off for it exactly as the reference's.
    assert actual.skipped == (1 if case.overflow_step is not None else 0)
    assert actual.scale == expected.scale
    assert len(actual.tensors) == len(expected.tensors)
    for index, (got, want) in enumerate(zip(actual.tensors, expected.tensors, strict=True)):
        torch.testing.assert_close(
            got, want, rtol=0, atol=0, msg=lambda m, i=index: f"{case} ({case.reference}) tensor {i}: {m}"
        )


def test_the_matrix_has_every_reference_and_an_overflow_in_each_fp16_case() -> None:
    assert {case.reference for case in CASES} == {"lightning", "fabric", "loop", "compensator"}
    assert all(case.overflow_step is not None for case in CASES if case.precision == "16-mixed")
    assert len(CASES) == len(set(map(str, CASES)))  # every case declared once
