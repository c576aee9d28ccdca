"""``PendingReads``: fused steps' values reach host memory without a wait and are read from it without a tensor call.

On the CPU a step's values are copied at once. An accelerator's way (pinned memory, a non-blocking copy, an event
marking the arrival) runs here too, with a stand-in event whose arrival the test decides: ``read_ready`` takes only
what has arrived, waiting for nothing; ``read`` waits once, for the newest copy (copies complete in order on a stream).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from helpers import host_reads

from lightning_amp_plus.step import pending
from lightning_amp_plus.step.pending import PendingReads


class Step:
    """What the engine's PendingStep does with its row: keeps it."""

    def __init__(self) -> None:
        self.row: list[float] | None = None

    def _resolve(self, row: list[float]) -> None:
        self.row = row


class Arrival:
    """A stand-in for an accelerator's event on one stream: arrived when the test says so, or once a later copy on the
    stream has (copies complete in order); ``synchronize`` is a wait, counted."""

    waits = 0
    stream: ClassVar[list[Arrival]] = []

    def __init__(self) -> None:
        self.arrived = False
        Arrival.stream.append(self)

    def query(self) -> bool:
        return self.arrived

    def synchronize(self) -> None:
        Arrival.waits += 1
        for event in Arrival.stream[: Arrival.stream.index(self) + 1]:
            event.arrived = True


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> list[Arrival]:
    """The accelerator's way for CPU values: unpinned here (pinning needs a driver), every other step the same."""
    events: list[Arrival] = []

    def arrival() -> Arrival:
        events.append(Arrival())
        return events[-1]

    monkeypatch.setattr(pending, "_transfer", lambda device: (False, arrival))
    Arrival.waits, Arrival.stream = 0, []
    return events


def values(step: int) -> torch.Tensor:
    return torch.tensor([float(step % 2), 1.5 * step, 2.0**step, 1.0])


def test_on_the_cpu_each_steps_values_are_read_from_host_memory_without_a_tensor_call() -> None:
    reads, steps, calls = PendingReads(), [Step() for _ in range(3)], []
    with host_reads(calls):
        for index, step in enumerate(steps):
            reads.add(step, values(index))
        reads.read_ready()
    assert calls == []  # a load from host memory through the ctypes view: no item/tolist/numpy
    assert [step.row for step in steps] == [values(index).tolist() for index in range(3)]


def test_read_ready_takes_only_what_has_arrived_and_waits_for_nothing(accelerator: list[Arrival]) -> None:
    reads, steps = PendingReads(), [Step() for _ in range(3)]
    for index, step in enumerate(steps):
        reads.add(step, values(index))
    accelerator[0].arrived = True
    reads.read_ready()
    assert [step.row is not None for step in steps] == [True, False, False] and Arrival.waits == 0


def test_read_waits_once_for_the_newest_copy_and_reads_every_step(accelerator: list[Arrival]) -> None:
    reads, steps = PendingReads(), [Step() for _ in range(4)]
    for index, step in enumerate(steps):
        reads.add(step, values(index))
    reads.read()
    assert Arrival.waits == 1 and accelerator[-1].arrived  # the newest: the others are in before it on the stream
    assert [step.row for step in steps] == [values(index).tolist() for index in range(4)]


def test_take_hands_over_every_step_read_oldest_first_and_forgets_them(accelerator: list[Arrival]) -> None:
    reads, steps = PendingReads(), [Step() for _ in range(3)]
    for index, step in enumerate(steps):
        reads.add(step, values(index))
    taken: list[Any] = reads.take()
    assert taken == steps and all(step.row is not None for step in steps)
    assert reads.entries == [] and reads.take() == []


def test_past_the_buffer_a_step_is_read_at_once() -> None:
    reads = PendingReads()
    steps = [Step() for _ in range(pending._SLOTS + 2)]
    for index, step in enumerate(steps):
        reads.add(step, values(index))
    assert steps[-1].row == values(len(steps) - 1).tolist()  # read the slow way, now
    reads.read()
    assert all(step.row is not None for step in steps)
