"""The Trainer's plugin and Fabric's are one plugin: the same options train the same, bit for bit, on both front ends.

Each case is declared once (precision x compensation x ``skip_nonfinite`` x spike guard x foreach/fused AdamW x
clipping x gradient accumulation); one runner trains the same tiny model from the same seed on the same micro-batches,
with a fault injected (an inf, or a NaN, in one step's last micro-batch; a finite spike for the spike guard), once under
the Trainer (automatic optimization, ``accumulate_grad_batches``, ``gradient_clip_val``) and once in a Fabric loop
written as the Trainer runs it (``no_backward_sync``, ``fabric.backward(loss / accumulate)``, ``clip_gradients``,
``optimizer.step()``, ``optimizer.zero_grad()``). Compared bit for bit: the parameters after every step, the optimizer
state, the loss scale and the skip count (a run that stops at the skip limit stops at the same step on both).

The matrix is the product of the axes, less the combinations a plugin refuses (a spike guard or a skip limit with the
check off, compensation outside bf16-true, the check off under fp16): 228 cases, about 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import make_trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_amp_plus.fabric as amp_fabric
from lightning_amp_plus import DynamicLossScaler, MixedPrecisionPlugin, SpikeGuard

pytestmark = [
    pytest.mark.filterwarnings(r"ignore:.*MixedPrecisionPlugin\('16-mixed'\) on CPU:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*`training_step` returned `None`.*"),
]

STEPS, FAULT_STEP, SPIKE_STEP = 6, 2, 4
CLIP = {"norm": 0.05, "value": 0.01}
LR = 1e-2


@dataclass(frozen=True)
class Case:
    precision: str
    compensation: str | None = None  # bf16-true only
    skip_nonfinite: bool = True
    guard: str | None = None  # None, "skip" or "clip"
    optimizer: str = "foreach"  # "foreach" or "fused" AdamW
    clip: str | None = None  # None, "norm" or "value"
    accumulate: int = 1
    options: dict[str, Any] = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        parts = [self.precision, str(self.compensation) if self.precision == "bf16-true" else ""]
        parts += ["" if self.skip_nonfinite else "nocheck", f"guard-{self.guard}" if self.guard else ""]
        parts += [self.optimizer, f"clip-{self.clip}", f"acc{self.accumulate}"]
        return "-".join(p for p in parts if p)

    def plugin_options(self) -> dict[str, Any]:
        options: dict[str, Any] = dict(self.options)
        if self.precision == "bf16-true":
            options["compensation"] = self.compensation
        if not self.skip_nonfinite:
            options["skip_nonfinite"] = False
        if self.guard is not None:
            options["spike_guard"] = SpikeGuard(threshold=3.0, warmup=2, action=self.guard)  # type: ignore[arg-type]
        return options

    def scaler(self) -> DynamicLossScaler | None:
        # Growth every 2 clean steps: the scale moves both ways within the run.
        return DynamicLossScaler(init_scale=2.0**10, growth_interval=2) if self.precision == "16-mixed" else None


def cases() -> Iterator[Case]:
    kinds: list[tuple[str, str | None, bool]] = [("16-mixed", None, True)]
    kinds += [("bf16-mixed", None, check) for check in (True, False)]
    kinds += [("bf16-true", comp, check) for comp in ("kahan", "stochastic", None) for check in (True, False)]
    for (precision, compensation, check), optimizer, clip, accumulate in itertools.product(
        kinds, ("foreach", "fused"), (None, "norm", "value"), (1, 2)
    ):
        for guard in (None, "skip", "clip") if check else (None,):
            yield Case(precision, compensation, check, guard, optimizer, clip, accumulate)


CASES = list(cases())


# ------------------------------------------------------------------------------------------------- the pieces
def micro_batches(case: Case) -> list[tuple[Tensor, Tensor, float]]:
    """Inputs, targets and a loss factor per micro-batch: the fault on the last micro-batch of its step."""
    generator = torch.Generator().manual_seed(0)
    fault = math.inf if case.precision == "16-mixed" else math.nan
    out = []
    for step in range(STEPS):
        for micro in range(case.accumulate):
            last = micro == case.accumulate - 1
            factor = fault if step == FAULT_STEP and last else 1.0
            if step == SPIKE_STEP and last and case.guard is not None:
                factor = 30.0  # a finite spike: the guard's to judge
            # Values bf16 holds exactly: the Trainer hands bf16-true its batch in bf16, Fabric only the model's inputs.
            x, y = (torch.randn(shape, generator=generator).bfloat16().float() for shape in ((4, 8), (4, 4)))
            out.append((x, y, factor))
    return out


def loss_of(output: Tensor, target: Tensor) -> Tensor:
    """The loss in float32 on both front ends (Fabric hands its loop the model's output in float32)."""
    return F.mse_loss(output.float(), target.float())


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def optimizer_for(case: Case, params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, fused=case.optimizer == "fused")


@dataclass
class Run:
    """What a run left: the parameters after each step, the optimizer state, the scale, the skips, the plugin."""

    params: list[list[Tensor]] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    scale: float | None = None
    skipped: int = 0
    stopped: str | None = None


class Module(pl.LightningModule):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        self.net = net()
        self.run = Run()

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, factor = batch
        return loss_of(self.net(x), y) * factor

    def on_train_batch_end(self, *args: Any) -> None:
        if self.trainer.global_step > len(self.run.params):  # an optimizer step was taken (or skipped)
            self.run.params.append([p.detach().clone() for p in self.net.parameters()])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_for(self.case, self.net.parameters())


def trainer_run(case: Case) -> Run:
    plugin = MixedPrecisionPlugin(case.precision, "cpu", case.scaler(), **case.plugin_options())  # type: ignore[arg-type]
    module = Module(case)
    data = [(x, y, torch.tensor(f)) for x, y, f in micro_batches(case)]
    clip = {} if case.clip is None else {"gradient_clip_val": CLIP[case.clip], "gradient_clip_algorithm": case.clip}
    trainer = make_trainer(plugin, max_steps=STEPS, accumulate_grad_batches=case.accumulate, **clip)
    try:
        trainer.fit(module, DataLoader(data, batch_size=None))
    except FloatingPointError as error:
        module.run.stopped = str(error)
    return finish(module.run, plugin, trainer.optimizers[0], module.net)


def fabric_run(case: Case) -> Run:
    plugin = amp_fabric.MixedPrecisionPlugin(case.precision, "cpu", case.scaler(), **case.plugin_options())  # type: ignore[arg-type]
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    module = net()
    model, optimizer = fabric.setup(module, optimizer_for(case, module.parameters()))
    run, batches = Run(), iter(micro_batches(case))
    try:
        for _ in range(STEPS):
            for micro in range(case.accumulate):
                x, y, factor = next(batches)
                with fabric.no_backward_sync(model, enabled=micro < case.accumulate - 1):
                    fabric.backward(loss_of(model(x), y) * factor / case.accumulate)
            if case.clip == "norm":
                fabric.clip_gradients(model, optimizer, max_norm=CLIP["norm"], error_if_nonfinite=False)
            elif case.clip == "value":
                fabric.clip_gradients(model, optimizer, clip_val=CLIP["value"])
            optimizer.step()
            optimizer.zero_grad()
            run.params.append([p.detach().clone() for p in module.parameters()])
    except FloatingPointError as error:
        run.stopped = str(error)
    return finish(run, plugin, optimizer, module)


def finish(run: Run, plugin: Any, optimizer: Any, module: nn.Module) -> Run:
    run.state = optimizer.state_dict()["state"]
    plugin_state = plugin.state_dict()  # the scale as a checkpoint holds it (its last move made)
    run.scale = plugin_state["scaler"].get("scale") if plugin_state else None
    run.skipped = plugin.skipped_steps
    return run


def assert_same(case: Case, trainer: Run, fabric: Run) -> None:
    assert trainer.stopped == fabric.stopped, f"{case}: one front end stopped and not the other"
    assert len(trainer.params) == len(fabric.params) > 0, case
    for step, (a, b) in enumerate(zip(trainer.params, fabric.params, strict=True)):
        for index, (p, q) in enumerate(zip(a, b, strict=True)):
            # NaN where a run with the check off let it through: equal as NaN, and nothing else is tolerated.
            torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True, msg=f"{case}: step {step}, tensor {index}")
    torch.testing.assert_close(trainer.state, fabric.state, rtol=0, atol=0, equal_nan=True, msg=f"{case}: state")
    assert (trainer.scale, trainer.skipped) == (fabric.scale, fabric.skipped), case


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_trainer_and_fabric_train_every_option_bit_for_bit_alike(case: Case) -> None:
    assert_same(case, trainer_run(case), fabric_run(case))


def test_the_matrix_sees_every_kind_of_step() -> None:
    # Premises: the faults skip where something checks, the guard judges the spike, the scale moves.
    fp16 = fabric_run(Case("16-mixed", clip="norm"))
    assert fp16.skipped == 1 and fp16.scale is not None and fp16.scale != 2.0**10
    assert fabric_run(Case("bf16-mixed", guard="skip")).skipped == 2  # the NaN and the spike
    unchecked = fabric_run(Case("bf16-mixed", skip_nonfinite=False))
    assert unchecked.skipped == 0 and any(torch.isnan(p).any() for p in unchecked.params[-1])
    assert len(CASES) == 228
