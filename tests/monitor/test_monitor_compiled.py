"""The monitor's replays on a compiled model: run eagerly, they find what they find on the same model uncompiled.

A replay of a compiled model used to run through dynamo: its autocast state, its hooks and its scales recompiled the
graph the training steps run, 27 to 34 graphs in a 6-step run against 2 or 3 without the monitor, past dynamo's
recompile limit (8), after which the training steps ran uncompiled (under ``fullgraph=True``, failed); and where a
replay ran the graph, the autopsy's hooks, added after compilation, did not run inside it (dynamo does not guard on
module hooks): a backward fault in a layer was blamed on the loss ("check the loss computation"). Under the Trainer
(``trainer.fit(torch.compile(module))``, and its ``forward`` compiled alone) and Fabric
(``fabric.setup(torch.compile(model))``), ``aot_eager`` (dynamo and AOT autograd, eager kernels: the training steps
equal the uncompiled ones), with a fault in ``blocks.1`` at one batch.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import test_monitor_checkpointing as checkpointing
import torch
from helpers import FP16_ON_CPU_WARNING, parameters_of
from test_monitor_checkpointing import Checkpointed, seen
from torch._dynamo.utils import counters

from lightning_amp_plus import MixedPrecisionMonitor

pytestmark = [
    pytest.mark.filterwarnings(FP16_ON_CPU_WARNING),
    pytest.mark.filterwarnings("ignore:.*MixedPrecisionMonitor.*:RuntimeWarning"),
    # torch 2.6's dynamo instantiates a custom autograd Function it traces (the fault's), and torch warns about that.
    pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated"),
]


def trainer_fit(
    compiled: bool, fault: str, monitor: MixedPrecisionMonitor | None, forward: bool = False
) -> Checkpointed:
    """``trainer.fit(torch.compile(module))``, or with ``forward`` the module's ``forward`` compiled alone."""
    module = Checkpointed(None, fault)
    if compiled and forward:
        module.forward = torch.compile(module.forward, backend="aot_eager")  # type: ignore[method-assign]
    trained = torch.compile(module, backend="aot_eager") if compiled and not forward else None
    checkpointing.trainer_fit(module, monitor, trained)
    return module


def fabric_loop(compiled: bool, fault: str, monitor: MixedPrecisionMonitor | None) -> Checkpointed:
    """``fabric.setup(torch.compile(model))``."""
    module = Checkpointed(None, fault)
    checkpointing.fabric_fit(module, monitor, torch.compile(module, backend="aot_eager") if compiled else None)
    return module


FRONTS = {"trainer": trainer_fit, "fabric": fabric_loop}


def run(
    front: str, compiled: bool, fault: str, monitor: MixedPrecisionMonitor | None, **options: Any
) -> tuple[Checkpointed, int]:
    """The run, and how many graphs dynamo made in it."""
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        # Dynamo's own look at the module's input when it traces a forward called from eager code (torch 2.14).
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf Tensor")
        module = FRONTS[front](compiled, fault, monitor, **options)
    return module, counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("headroom_interval", [0, 1], ids=["autopsy", "autopsy-and-headroom"])
@pytest.mark.parametrize("fault", ["forward", "backward"])
@pytest.mark.parametrize("front", sorted(FRONTS))
def test_on_a_compiled_model_the_replays_find_what_they_find_uncompiled_and_recompile_nothing(
    front: str, fault: str, headroom_interval: int
) -> None:
    found: dict[bool, Any] = {}
    for compiled in (False, True):
        monitor = MixedPrecisionMonitor(headroom_interval=headroom_interval, log_memory=False)
        module, graphs = run(front, compiled, fault, monitor)
        found[compiled] = (seen(monitor), parameters_of(module), graphs)
    (plain, plain_params, _), (mine, params, graphs) = found[False], found[True]
    assert mine == plain
    assert [autopsy[1:3] for autopsy in plain["autopsies"]] == [(fault, "model.blocks.1.extra")]
    for a, b in zip(params, plain_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _, without_monitor = run(front, True, fault, None)
    assert graphs == without_monitor  # the replays compiled nothing of their own


def test_a_compiled_forward_replayed_blames_a_backward_fault_on_its_layer_as_uncompiled() -> None:
    found = []
    for compiled in (False, True):
        monitor = MixedPrecisionMonitor(log_memory=False)
        _, graphs = run("trainer", compiled, "backward", monitor, forward=True)
        found.append((seen(monitor)["autopsies"], graphs))
    (plain, _), (mine, graphs) = found
    assert mine == plain and [autopsy[1:3] for autopsy in plain] == [("backward", "model.blocks.1.extra")]
    _, without_monitor = run("trainer", True, "backward", None, forward=True)
    assert graphs == without_monitor
