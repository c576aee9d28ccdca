"""Fused-path steps whose overflow flag and gradient norm are still on the device, waiting for one host read.

On the fused-optimizer path the optimizer skips on the device, so a step's record is incomplete when ``step()``
returns: its flag and its (scaled) norm are device tensors. :class:`PendingReads` keeps those steps in order, with the
``update()`` calls between them (the scale policy must be replayed on the host in the same order), and reads every
flag and norm in one go when asked. On CUDA each step's two numbers are copied at once, asynchronously, into a pinned
host buffer (a ring of slots), so the read later waits only until the last check has run, not for the optimizer
kernels behind it.

Examples:
    >>> import torch
    >>> from lightning_amp_plus.step.outcome import StepRecord
    >>> pending = PendingReads()
    >>> record = StepRecord()
    >>> pending.add_step(record, flag=torch.tensor(1.0), norm=torch.tensor(float("inf")))
    >>> pending.add_update([record])
    >>> pending.unread, record.overflow
    (1, None)
    >>> [type(event).__name__ for event in pending.read()], record.overflow, pending.unread
    (['StepRecord', 'UpdateMark'], True, 0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_amp_plus.step.outcome import StepRecord

__all__ = ["PENDING_MAX", "PendingReads", "UpdateMark"]

# Fused-path steps whose flags may wait unread on the device, when no skip limit asks for them sooner.
PENDING_MAX = 256


@dataclass(eq=False)
class UpdateMark:
    """An ``update()`` made while flags were unread: the records whose overflow it combined."""

    records: list[StepRecord]


@dataclass(eq=False)
class _DeviceValues:
    """One step's flag and scaled norm on the device, and where they were copied on the host (CUDA)."""

    record: StepRecord
    flag: Tensor
    norm: Tensor
    slot: int | None = None
    event: torch.cuda.Event | None = None


class PendingReads:
    """The fused path's unread steps, in order, with the updates between them.

    State: the ordered events (steps and update marks) since the last read, and the pinned ring buffer (CUDA).
    """

    def __init__(self) -> None:
        self._events: list[_DeviceValues | UpdateMark] = []
        self._ring: Tensor | None = None

    @property
    def unread(self) -> int:
        """How many steps wait for their flags to be read."""
        return sum(isinstance(event, _DeviceValues) for event in self._events)

    def __bool__(self) -> bool:
        return bool(self._events)

    def add_step(self, record: StepRecord, flag: Tensor, norm: Tensor) -> None:
        """Keep a fused step's flag (1.0 on overflow, else 0.0) and scaled norm until the next :meth:`read`."""
        values = _DeviceValues(record, flag, norm)
        self._copy_to_host(values)
        self._events.append(values)

    def add_update(self, records: list[StepRecord]) -> None:
        """Note an ``update()`` over ``records`` (its effect on the scale is replayed after the steps before it)."""
        self._events.append(UpdateMark(records))

    def flags_of(self, records: list[StepRecord]) -> list[Tensor]:
        """The device flags of those of ``records`` still unread (for a policy that advances on the device)."""
        wanted = {id(record) for record in records}
        return [event.flag for event in self._events if isinstance(event, _DeviceValues) and id(event.record) in wanted]

    def ready(self, record: StepRecord) -> bool:
        """Whether reading ``record``'s values would not wait for the device."""
        for event in self._events:
            if isinstance(event, _DeviceValues) and event.record is record and event.event is not None:
                return bool(event.event.query())  # type: ignore[no-untyped-call]
        return True

    def read(self) -> list[StepRecord | UpdateMark]:
        """Read every pending flag and norm (one host read) into the records; return the events in order, forgotten.

        Each step's record gets ``overflow`` and ``scaled_norm``; the caller replays the events to fill in the scale
        and the unscaled norm.
        """
        values = [event for event in self._events if isinstance(event, _DeviceValues)]
        self._read_values(values)
        events: list[StepRecord | UpdateMark] = [
            event.record if isinstance(event, _DeviceValues) else event for event in self._events
        ]
        self._events = []
        return events

    def _read_values(self, values: list[_DeviceValues]) -> None:
        ringed = [value for value in values if value.event is not None and value.slot is not None]
        if ringed and self._ring is not None:
            last = ringed[-1].event
            assert last is not None
            last.synchronize()  # waits until the last check has run, not for the optimizer kernels after it
            rows = self._ring[: max(value.slot or 0 for value in ringed) + 1].tolist()
            for value in ringed:
                assert value.slot is not None
                value.record.overflow, value.record.scaled_norm = rows[value.slot][0] != 0.0, rows[value.slot][1]
        rest = [value for value in values if value.event is None]
        if rest:
            numbers = torch.stack([t for value in rest for t in (value.flag, value.norm.to(value.flag.device))])
            read = numbers.tolist()
            for index, value in enumerate(rest):
                value.record.overflow, value.record.scaled_norm = read[2 * index] != 0.0, read[2 * index + 1]
        for value in values:
            if not value.record.overflow:
                value.record.namer = None  # an applied step names nothing: drop the norms kept for the lookup

    def _copy_to_host(self, values: _DeviceValues) -> None:
        """On CUDA: start copying the step's flag and norm to pinned memory, so a later read waits for nothing else."""
        if values.flag.device.type != "cuda":
            return
        if self._ring is None:
            self._ring = torch.empty(PENDING_MAX + 16, 2, dtype=torch.float32, pin_memory=True)
        slot = self.unread
        if slot >= len(self._ring):
            return  # read the slow way
        self._ring[slot].copy_(torch.stack([values.flag, values.norm.to(values.flag.device)]), non_blocking=True)
        values.slot, values.event = slot, torch.cuda.Event()  # type: ignore[no-untyped-call]
        values.event.record()
