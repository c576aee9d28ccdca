"""The fused path's steps whose values are still on the device, on their way to host memory: :class:`PendingReads`.

A fused optimizer skips on the device, so its step's values (the overflow flag, the loss scale it carried, the
hysteresis tracker, and a norm when something reads norms) stay there after ``step()`` returns. Each step's values
are copied into one host buffer as soon as they exist, asynchronously on an accelerator (pinned memory, an event
recorded on the values' device), synchronously on the CPU; they are read from that buffer's host memory:

* :meth:`PendingReads.read_ready` takes the steps whose copy has arrived, waiting for nothing: no device sync, ever
  (what a held LR scheduler uses at every step: :mod:`~.schedulers`);
* :meth:`PendingReads.read` takes every step, waiting for the newest copy: one device sync for all of them (what a
  read of a field, a skip count or the skip limit uses).

The buffer is read through a ``ctypes`` view of its host memory, not through tensor calls: reading it is a load from
host memory, not a transfer (``tests/step/test_pending.py`` counts both: none per step).

Examples:
    >>> class Step:  # what the engine's PendingStep does with its row
    ...     def _resolve(self, row): print("read", row)
    >>> reads = PendingReads()
    >>> reads.add(Step(), torch.tensor([1.0, 0.0, 8.0, 1.0]))
    >>> reads.read()
    read [1.0, 0.0, 8.0, 1.0]
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["PENDING_MAX", "WIDTH", "PendingReads", "Unread"]

PENDING_MAX = 256
"""Fused steps whose values may wait unread, when no skip limit asks for them sooner."""
WIDTH = 4
"""A step's values: ``[flag, scaled norm, scale, hysteresis tracker]`` (NaN where there is none)."""
_SLOTS = PENDING_MAX + 16  # room for the optimizers of one more iteration past the limit


class Unread(Protocol):
    """A step waiting for its values (the engine's ``PendingStep``)."""

    def _resolve(self, row: list[float]) -> None:
        """Take the step's values, read from host memory."""


class PendingReads:
    """Fused steps not counted yet, oldest first, with their values on their way to host memory.

    State: :attr:`entries` (the steps not counted yet), the host buffer and its view, and each unread step's slot and
    event.
    """

    def __init__(self) -> None:
        self.entries: list[Unread] = []
        self._buffer: Tensor | None = None
        self._view: ctypes.Array[ctypes.c_float] | None = None
        self._unread: list[tuple[Unread, int, torch.Event | None]] = []

    def add(self, step: Unread, values: Tensor) -> None:
        """Keep ``step`` with its device ``values`` (``WIDTH`` floats): their copy to host memory starts now."""
        slot = len(self.entries)
        self.entries.append(step)
        if slot >= _SLOTS:  # past the buffer (a caller that never updates): read the slow way, now
            step._resolve(values.tolist())
            return
        pinned, arrival = _transfer(values.device)
        self._host_buffer(pinned)[slot].copy_(values, non_blocking=pinned)
        self._unread.append((step, slot, None if arrival is None else arrival()))

    def read_ready(self) -> None:
        """Read the steps whose values have arrived in host memory, waiting for nothing (no device sync)."""
        waiting = []
        for entry in self._unread:
            step, slot, event = entry
            if event is None or event.query():
                step._resolve(self._row(slot))
            else:
                waiting.append(entry)
        self._unread = waiting

    def read(self) -> None:
        """Read every unread step's values: one wait for the newest copy (a device sync), none on the CPU."""
        # Newest first: copies complete in order on a stream, so once the newest is in, the others on its stream are
        # too (one wait); a copy on another device's stream is waited for on its own.
        for _, _, event in reversed(self._unread):
            if event is not None and not event.query():
                event.synchronize()
        self.read_ready()

    def take(self) -> list[Unread]:
        """The steps not counted yet, read, oldest first; forgotten here (the caller counts them)."""
        self.read()
        steps, self.entries = self.entries, []
        return steps

    def _host_buffer(self, pinned: bool) -> Tensor:  # made at the first step, for its device
        if self._buffer is None:
            # Pinned for an accelerator's values, so that their copies are asynchronous; plain memory for the CPU's.
            self._buffer = torch.full((_SLOTS, WIDTH), math.nan, dtype=torch.float32, pin_memory=pinned)
            # The buffer's host memory as floats, read without a tensor call; the view lives as long as the buffer.
            self._view = (ctypes.c_float * (_SLOTS * WIDTH)).from_address(self._buffer.data_ptr())
        return self._buffer

    def _row(self, slot: int) -> list[float]:
        assert self._view is not None
        start = slot * WIDTH
        return [float(value) for value in self._view[start : start + WIDTH]]

    def __getstate__(self) -> dict[str, object]:
        """Pickled with every step read (device values, events and host views belong to this process)."""
        self.read()
        return {"entries": self.entries}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]
        self.entries = state["entries"]  # type: ignore[assignment]


def _transfer(device: torch.device) -> tuple[bool, Callable[[], torch.Event] | None]:
    """How values on ``device`` reach host memory: pinned, and an event marking their arrival, or a plain copy.

    From an accelerator the copy goes into pinned memory without a wait; from the CPU it is a plain copy. The CPU
    suite runs the accelerator's way with a stand-in event (``tests/step/test_pending.py``).
    """
    if device.type == "cpu":
        return False, None
    return True, functools.partial(_event_after_copy, device)


def _event_after_copy(device: torch.device) -> torch.Event:
    """An event recorded on ``device``'s current stream, after the copy queued there."""
    event = torch.Event(device=device)
    event.record(torch.get_device_module(device).current_stream(device))
    return event
