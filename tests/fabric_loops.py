"""A plain Lightning Fabric training loop, declared once and run under any precision plugin (the Fabric tests' runner).

A :class:`Loop` says what one run does (steps, accumulation, clipping, injected faults, optimizer, schedule); a
:class:`FabricRun` runs it step by step under a plugin, ours or Fabric's own, and keeps the parameters after every
optimizer step, so tests compare two runs step for step (``assert_same_runs``). The loop is the one Fabric's docs and
litgpt write: ``fabric.setup``, ``no_backward_sync`` while accumulating, ``fabric.backward(loss / accumulate)``,
optional ``fabric.clip_gradients``, ``optimizer.step()``, ``optimizer.zero_grad()``.

Faults are injected into the loss of the last micro-batch of a step: ``loss * inf`` gives every gradient inf or NaN
(an fp16 overflow as a loss scaler meets it), ``loss * nan`` a NaN everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn

from lightning_amp_plus import DynamicLossScaler
from lightning_amp_plus.fabric import MixedPrecisionPlugin

START_SCALE = 2.0**10
# Growth every 3 clean steps keeps the scale moving within a short run: equal scales then mean something.
GROWTH_INTERVAL = 3
FEATURES, HIDDEN, OUTPUTS, BATCH = 16, 32, 8, 8

Optimizer = Literal["sgd", "adamw", "adamw-fused", "adamw-foreach"]


@dataclass(frozen=True)
class Loop:
    """What one run does.

    Args:
        steps: optimizer steps.
        accumulate: micro-batches per optimizer step (all but the last under ``fabric.no_backward_sync``).
        clip: ``"norm"`` (``fabric.clip_gradients(max_norm=...)``), ``"value"`` (``clip_val=...``) or ``None``.
        max_norm: the clipping norm (small enough that it clips).
        clip_val: the clipping value (small enough that it clips).
        error_if_nonfinite: passed to ``fabric.clip_gradients`` by norm. Fabric's default, True, raises on a step whose
            gradients hold inf/NaN, with Fabric's plugin and ours alike; False (the default here) clips on and lets the
            plugin skip the step.
        overflow_at: steps whose last micro-batch loss is multiplied by inf.
        nan_at: steps whose last micro-batch loss is multiplied by NaN.
        step_skipped_at: steps at which ``optimizer.step()`` is not called (only ``zero_grad``): what skipping a step
            means, written out, for a reference run.
        optimizer: SGD with momentum, AdamW (torch's default implementation), fused or foreach AdamW.
        schedule: a LambdaLR schedule (linear warm-up, then cosine), stepped after every optimizer step.
    """

    steps: int = 6
    accumulate: int = 1
    clip: Literal["norm", "value"] | None = None
    max_norm: float = 0.25
    clip_val: float = 0.02
    error_if_nonfinite: bool = False
    overflow_at: tuple[int, ...] = ()
    nan_at: tuple[int, ...] = ()
    step_skipped_at: tuple[int, ...] = ()
    optimizer: Optimizer = "adamw"
    schedule: bool = False


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUTPUTS))


def make_optimizer(kind: Optimizer, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    options = {"adamw": {}, "adamw-fused": {"fused": True}, "adamw-foreach": {"foreach": True}}[kind]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **options)


def lr_factor(step: int, warmup: int = 2, total: int = 12) -> float:
    """Linear warm-up, then cosine decay to 10%: the shape of litgpt's schedule."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def batch(step: int, micro: int) -> tuple[Tensor, Tensor]:
    """A batch that depends only on the step and the micro-batch (a resumed run sees the same ones)."""
    generator = torch.Generator().manual_seed(10_000 + 97 * step + micro)
    return torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, OUTPUTS, generator=generator)


def ours(precision: str = "16-mixed", **options: Any) -> MixedPrecisionPlugin:
    """Our Fabric plugin on CPU, with the fp16 scaler the references get."""
    scaler = (
        DynamicLossScaler(init_scale=START_SCALE, growth_interval=GROWTH_INTERVAL) if precision == "16-mixed" else None
    )
    return MixedPrecisionPlugin(precision, "cpu", scaler, **options)  # type: ignore[arg-type]


def fabrics(precision: str = "16-mixed") -> MixedPrecision:
    """Fabric's own plugin at the same precision, fp16 with ``torch.amp.GradScaler`` set like ours."""
    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=START_SCALE, growth_interval=GROWTH_INTERVAL)
        return MixedPrecision("16-mixed", "cpu", scaler=scaler)
    return MixedPrecision("bf16-mixed", "cpu")


class UnscalesBeforeFusedSteps(MixedPrecision):
    """Fabric's built-in with its refusal of fused optimizers under clipping lifted: GradScaler itself handles an
    ``unscale_`` before a fused step (the kernel then gets no ``grad_scale``, only ``found_inf``)."""

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        assert self.scaler is not None
        self.scaler.unscale_(optimizer)


class FabricRun:
    """One run of a :class:`Loop` under ``plugin`` on one CPU device; :meth:`step` runs one optimizer step.

    ``fabric`` is the Fabric class (``lightning.Fabric``, or ``lightning_fabric.Fabric``: the standalone package).

    Attributes:
        params: the parameters after each optimizer step (copies), in ``model.parameters()`` order.
        clip_norms: what ``fabric.clip_gradients`` returned at each step (``None`` without clipping by norm).
        losses: each step's last micro-batch loss (before any fault).
    """

    def __init__(
        self, plugin: Precision, loop: Loop, *, seed: int = 0, fabric: Any = L.Fabric, **fabric_kwargs: Any
    ) -> None:
        self.plugin, self.loop = plugin, loop
        self.fabric = fabric(accelerator="cpu", devices=1, plugins=[plugin], **fabric_kwargs)
        torch.manual_seed(seed)
        self.module = make_model()
        model, optimizer = self.fabric.setup(self.module, make_optimizer(loop.optimizer, self.module.parameters()))
        self.model, self.optimizer = model, optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lr_factor) if loop.schedule else None
        self.params: list[list[Tensor]] = []
        self.clip_norms: list[float | None] = []
        self.losses: list[float] = []
        self.next_step = 0

    def step(self) -> None:
        loop, fabric, step = self.loop, self.fabric, self.next_step
        for micro in range(loop.accumulate):
            x, y = batch(step, micro)
            last = micro == loop.accumulate - 1
            with fabric.no_backward_sync(self.model, enabled=not last):
                loss = F.mse_loss(self.model(x), y)
                if last:
                    self.losses.append(float(loss.detach()))
                    loss = loss * (math.inf if step in loop.overflow_at else math.nan if step in loop.nan_at else 1.0)
                fabric.backward(loss / loop.accumulate)
        norm = None
        if loop.clip == "norm":
            total = fabric.clip_gradients(
                self.model, self.optimizer, max_norm=loop.max_norm, error_if_nonfinite=loop.error_if_nonfinite
            )
            norm = None if total is None else float(total)
        elif loop.clip == "value":
            fabric.clip_gradients(self.model, self.optimizer, clip_val=loop.clip_val)
        if step not in loop.step_skipped_at:
            self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()
        self.clip_norms.append(norm)
        self.params.append([p.detach().clone() for p in self.model.parameters()])
        self.next_step += 1

    def run(self, steps: int | None = None) -> FabricRun:
        """Run up to ``steps`` optimizer steps in all (default: the loop's); return ``self``."""
        while self.next_step < (self.loop.steps if steps is None else steps):
            self.step()
        return self

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds: the model, the optimizer, the plugin, the schedule and the step."""
        state: dict[str, Any] = {"model": self.model, "optimizer": self.optimizer, "amp": self.plugin}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler
        return state

    def save(self, path: Path) -> None:
        self.fabric.save(path, {**self.state(), "step": self.next_step})

    def load(self, path: Path) -> None:
        remainder = self.fabric.load(path, self.state())
        self.next_step = remainder["step"]


def train(plugin: Precision, loop: Loop, **kwargs: Any) -> FabricRun:
    return FabricRun(plugin, loop, **kwargs).run()


def assert_same_runs(a: FabricRun, b: FabricRun, *, rtol: float = 0.0, atol: float = 0.0, what: str = "") -> None:
    """The parameters after every step are equal (bit for bit by default); the message names the step and tensor."""
    assert len(a.params) == len(b.params), f"{what}: {len(a.params)} steps against {len(b.params)}"
    names = [name for name, _ in a.module.named_parameters()]
    for step, (mine, theirs) in enumerate(zip(a.params, b.params, strict=True)):
        for name, p, q in zip(names, mine, theirs, strict=True):
            torch.testing.assert_close(
                p, q, rtol=rtol, atol=atol, msg=lambda m, s=step, n=name: f"{what} step {s}, {n}: {m}"
            )


def max_difference(a: FabricRun, b: FabricRun) -> float:
    """The largest absolute difference between the two runs' parameters over all steps."""
    return max(
        float((p - q).abs().max())
        for mine, theirs in zip(a.params, b.params, strict=True)
        for p, q in zip(mine, theirs, strict=True)
    )
