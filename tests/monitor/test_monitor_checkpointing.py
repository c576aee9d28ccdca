"""The monitor's replays (the overflow autopsy, the headroom readings) on models trained with activation checkpointing.

Checkpointing changes what is kept for backward, not what is computed: the monitor must find what it finds without
it. Checkpointed as torch's ``apply_activation_checkpointing`` wraps blocks (what Lightning's
``activation_checkpointing_policy`` and torchtitan do: non-reentrant, the names then carry
``_checkpoint_wrapped_module``) and as ``checkpoint(block, x, use_reentrant=False)`` is called in a forward, the
autopsies, the headroom readings and the skipped step's parameter names are those of the same run without
checkpointing, under the Trainer and under Fabric. ``use_reentrant=True`` (transformers'
``gradient_checkpointing_enable()`` default) computes the checkpointed layers' gradients only into ``.grad``, which
a replay must not write: the monitor says so once, with the fix, makes no more replays, and the run goes on exactly as
without the monitor (it used to end the fit with torch's error at the first headroom reading). A fault found in the
forward needs no gradient, and is still found there.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from autopsy_models import MLP, InfBackward, batch
from helpers import FP16_ON_CPU_WARNING, make_trainer, parameters_of
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionMonitor, MixedPrecisionPlugin
from lightning_amp_plus import fabric as amp_fabric

pytestmark = pytest.mark.filterwarnings(FP16_ON_CPU_WARNING)

STEPS = 6
FAULT_BATCH = 3
NO_REPLAY = "no autopsy or headroom reading from step 1 on: "
USE_NON_REENTRANT = (
    "the replay's gradients (torch.autograd.grad, which writes no .grad) cannot be taken through "
    "torch.utils.checkpoint(use_reentrant=True), which computes the gradients of the layers it checkpoints only into "
    ".grad: checkpoint with use_reentrant=False, as torch recommends (the same gradients; transformers: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))"
)


class Fault(nn.Module):
    """The identity, or while ``active`` a fault: ``"forward"`` (the output times 1e6: past fp16's range),
    ``"backward"`` (a backward that returns inf)."""

    def __init__(self, kind: str | None) -> None:
        super().__init__()
        self.kind, self.active = kind, False

    def forward(self, x: Tensor) -> Tensor:
        if self.active and self.kind == "forward":
            return x * 1e6
        if self.active and self.kind == "backward":
            return InfBackward.apply(x)  # type: ignore[no-any-return]
        return x


class Checkpointed(pl.LightningModule):
    """The autopsy tests' MLP with a fault in ``blocks.1``, its blocks after the first checkpointed ``how``.

    ``how``: ``None`` (not checkpointed), ``"wrapper"`` (``apply_activation_checkpointing``), ``"non-reentrant"`` or
    ``"reentrant"`` (``checkpoint(block, x, use_reentrant=...)`` in the forward). The first block is never
    checkpointed: a reentrant checkpoint of a block whose input needs no gradient gives its weights none.
    ``"loss"`` as ``fault``: the loss is made inf (no module at fault).
    """

    def __init__(self, how: str | None, fault: str | None) -> None:
        super().__init__()
        self.model = MLP(extra=Fault(None if fault == "loss" else fault))
        self.how, self.fault = how, fault
        if how == "wrapper":
            blocks = set(self.model.blocks[1:])
            apply_activation_checkpointing(self.model, check_fn=lambda module: module in blocks)

    def switch(self, batch_idx: int) -> None:
        active = batch_idx == FAULT_BATCH
        extra = self.model.get_submodule("blocks.1").get_submodule(
            "_checkpoint_wrapped_module.extra" if self.how == "wrapper" else "extra"
        )
        assert isinstance(extra, Fault)
        extra.active = active

    def forward(self, x: Tensor) -> Tensor:
        for i, block in enumerate(self.model.blocks):
            if i > 0 and self.how in ("non-reentrant", "reentrant"):
                x = checkpoint(block, x, use_reentrant=self.how == "reentrant")
            else:
                x = block(x)
        return self.model.head(x)  # type: ignore[no-any-return]

    def loss(self, x: Tensor, y: Tensor, batch_idx: int) -> Tensor:
        self.switch(batch_idx)
        loss = F.mse_loss(self(x).float(), y)
        return loss * math.inf if self.fault == "loss" and batch_idx == FAULT_BATCH else loss

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.loss(*batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def batches() -> list[tuple[Tensor, Tensor]]:
    x, y = batch(seed=3, n=8 * STEPS)
    return list(zip(x.split(8), y.split(8), strict=True))


def trainer_fit(
    module: Checkpointed, monitor: MixedPrecisionMonitor | None, trained: nn.Module | None = None
) -> MixedPrecisionPlugin:
    """A Trainer fit of ``module`` (given as ``trained``: e.g. ``torch.compile(module)``)."""
    plugin = MixedPrecisionPlugin("16-mixed", "cpu", DynamicLossScaler(init_scale=2.0**10))
    x, y = batch(seed=3, n=8 * STEPS)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    trainer = make_trainer(plugin, max_steps=STEPS, callbacks=[] if monitor is None else [monitor])
    trainer.fit(module if trained is None else trained, loader)  # type: ignore[arg-type]  # a compiled LightningModule
    return plugin


def fabric_fit(
    module: Checkpointed, monitor: MixedPrecisionMonitor | None, trained: nn.Module | None = None
) -> amp_fabric.MixedPrecisionPlugin:
    """A Fabric loop over ``module`` (set up as ``trained``: e.g. ``torch.compile(module)``), ``monitor`` observing."""
    plugin = amp_fabric.MixedPrecisionPlugin("16-mixed", "cpu", DynamicLossScaler(init_scale=2.0**10))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = module if trained is None else trained
    model, optimizer = fabric.setup(net, torch.optim.Adam(module.parameters(), lr=1e-3))
    for i, (x, y) in enumerate(batches()):
        if monitor is not None:
            monitor.batch_start()
        fabric.backward(_loss(model, x, y, i))
        optimizer.step()
        optimizer.zero_grad()
        if monitor is not None:
            monitor.observe(plugin, model=model, replay=lambda x=x, y=y, i=i: _loss(model, x, y, i))
    return plugin


def _loss(model: Any, x: Tensor, y: Tensor, batch_idx: int) -> Tensor:
    """A Fabric loop's loss: the module's, its forward through Fabric's wrapper (and so under its autocast)."""
    module: Checkpointed = model.module
    module.switch(batch_idx)
    loss = F.mse_loss(model(x).float(), y)
    return loss * math.inf if module.fault == "loss" and batch_idx == FAULT_BATCH else loss


FRONTS: dict[str, Callable[[Checkpointed, MixedPrecisionMonitor | None], Any]] = {
    "trainer": trainer_fit,
    "fabric": fabric_fit,
}


def seen(monitor: MixedPrecisionMonitor) -> dict[str, Any]:
    """What the monitor found: autopsies, headroom readings (their reprs: a NaN share equals itself), names."""
    return {
        "skipped": monitor.history.skipped,
        "autopsies": [(a.step, a.kind, a.module, a.module_type, a.safe_scale, a.message) for a in monitor.autopsies],
        "headroom": repr(monitor.history.headroom),
        "nonfinite": monitor.history.nonfinite_events,
    }


@pytest.mark.parametrize("front", sorted(FRONTS))
@pytest.mark.parametrize("fault", ["forward", "backward"])
@pytest.mark.parametrize("how", ["wrapper", "non-reentrant"])
def test_under_non_reentrant_checkpointing_the_monitor_finds_what_it_finds_without_and_names_it_alike(
    how: str, fault: str, front: str
) -> None:
    found = {}
    for checkpointed in (None, how):
        monitor = MixedPrecisionMonitor(headroom_interval=2, log_memory=False)
        module = Checkpointed(checkpointed, fault)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*MixedPrecisionMonitor.*", RuntimeWarning)
            FRONTS[front](module, monitor)
        found[checkpointed] = (seen(monitor), parameters_of(module))
    (plain, plain_params), (checkpointed_seen, checkpointed_params) = found[None], found[how]
    assert checkpointed_seen == plain
    assert plain["skipped"] == [FAULT_BATCH]
    assert [a[:3] for a in plain["autopsies"]] == [(FAULT_BATCH, fault, "model.blocks.1.extra")]
    assert "'model.blocks.1.fc'" in plain["headroom"]
    wrapped = [name for name, _ in Checkpointed(how, fault).named_parameters() if "_checkpoint_wrapped_module" in name]
    assert bool(wrapped) == (how == "wrapper")  # torch's names, which its state dict leaves out, and so the monitor
    for mine, theirs in zip(checkpointed_params, plain_params, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("front", sorted(FRONTS))
def test_under_reentrant_checkpointing_the_monitor_says_once_why_it_stops_replaying_and_the_run_goes_on(
    front: str,
) -> None:
    monitor = MixedPrecisionMonitor(headroom_interval=2, log_memory=False)
    module = Checkpointed("reentrant", "backward")
    with pytest.warns(RuntimeWarning) as record:
        plugin = FRONTS[front](module, monitor)
    said = [str(w.message) for w in record if "MixedPrecisionMonitor" in str(w.message)]
    assert said == [f"MixedPrecisionMonitor: {NO_REPLAY}{USE_NON_REENTRANT}."]
    assert monitor.history.replays_stopped == (1, USE_NON_REENTRANT) and monitor.history.headroom == []
    assert monitor.history.skipped == [FAULT_BATCH] and monitor.autopsies == [] and plugin.skipped_steps == 1
    summary = monitor.summary()
    assert f"{NO_REPLAY}{USE_NON_REENTRANT}" in summary
    assert f"not examined (the monitor's replays stopped at step 1: {USE_NON_REENTRANT});" in summary
    without = Checkpointed("reentrant", "backward")
    FRONTS[front](without, None)
    for mine, theirs in zip(parameters_of(module), parameters_of(without), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("front", sorted(FRONTS))
@pytest.mark.parametrize("fault", ["forward", "loss"])
def test_under_reentrant_checkpointing_a_fault_in_the_forward_is_still_found_and_torch_says_nothing(
    fault: str, front: str
) -> None:
    found = {}
    for how in (None, "reentrant"):
        monitor = MixedPrecisionMonitor(log_memory=False)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            FRONTS[front](Checkpointed(how, fault), monitor)
        assert not [w for w in record if "requires_grad" in str(w.message)]
        found[how] = seen(monitor)
    assert found["reentrant"] == found[None] and len(found[None]["autopsies"]) == 1
    assert found[None]["autopsies"][0][1] == "forward"
