"""Hold learning-rate schedulers still while their optimizer's steps are being skipped.

Lightning steps schedulers after every optimizer step, skipped or not, so a run that skips steps drifts along its LR
schedule (Lightning #5558, #16228, #18828; PyTorch warns "lr_scheduler.step() before optimizer.step()"). A held
scheduler's ``step()`` is a no-op when every optimizer step since its last step was skipped.

A fused optimizer's skip is decided on the device, and reading it there at every scheduler step would wait for the
device at every step. So the ledger never waits: it judges by the outcomes known on the host (those read already, and
those whose values have arrived in host memory: :meth:`~.pending.PendingReads.read_ready`), counts a step not known
yet as applied, and when such a step turns out skipped, holds the scheduler's next step instead (a debt). On the CPU
every fused step's values arrive at once: the hold is exact. On an accelerator the values of the step just taken
arrive with the device's progress: on a skip the LR may move one or two steps late, then comes back to the schedule.

The hold is installed by giving each scheduler instance a subclass of its own class whose ``step`` consults the
instance's ``StepLedger`` (kept in a weak mapping). Nothing is added to the instance's ``__dict__`` (which
``scheduler.state_dict()`` returns whole), so checkpoints are unchanged, ``isinstance`` checks still pass, and
``release`` restores the original class (``tests/step/test_schedulers.py`` checks each of these).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SchedulerHold", "StepLedger", "hold", "release"]

# Outcomes kept per optimizer before those already known are compacted to plain booleans.
_COMPACT_AT = 512


def _known(outcome: Any) -> bool:
    return isinstance(outcome, bool) or bool(getattr(outcome, "resolved", True))


def _skipped(outcome: Any) -> bool:
    return outcome if isinstance(outcome, bool) else bool(outcome.skipped)


@dataclass
class _View:
    """What one held scheduler has seen of its optimizer's steps.

    How many, the intervals it stepped for while some of their outcomes were unknown, and the steps it owes back
    (intervals that turned out all skipped).
    """

    seen: int = 0
    open: list[tuple[int, int]] = field(default_factory=list)
    debt: int = 0


class StepLedger:
    """Each optimizer's step outcomes in order; for each held scheduler, what it has seen and owes.

    An outcome is anything with ``skipped`` (read only once known) and, if its fate may still be on the device,
    ``resolved`` (a ``PendingStep``); a plain ``StepResult`` is known at once.

    State: the outcomes by optimizer (and how many were dropped from the front), each scheduler's view, the count of
    scheduler steps held, and ``read_ready`` (takes the fused steps whose values have arrived, without waiting).
    """

    def __init__(self, read_ready: Callable[[], None] | None = None) -> None:
        self.read_ready: Callable[[], None] = read_ready or (lambda: None)
        self.held_steps = 0
        self._steps: dict[int, list[Any]] = {}
        self._dropped: dict[int, int] = {}
        self._views: weakref.WeakKeyDictionary[Any, _View] = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled with the plugin when `ddp_spawn` starts its processes: the outcomes and the views belong to objects
        # of this process only (and a weak mapping cannot be pickled anyway).
        return {"held_steps": self.held_steps}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.held_steps = state["held_steps"]

    def record_outcome(self, optimizer: object, outcome: Any) -> None:
        """Note one step of ``optimizer`` (its outcome is read only when known on the host)."""
        steps = self._steps.setdefault(id(optimizer), [])
        steps.append(outcome)
        if len(steps) > _COMPACT_AT:
            self._steps[id(optimizer)] = [_skipped(o) if _known(o) else o for o in steps]
            self._trim(id(optimizer))

    def watch(self, scheduler: Any) -> None:
        """Start ``scheduler``'s view at its optimizer's steps so far (the steps before are not its business)."""
        key = id(scheduler.optimizer)
        if scheduler not in self._views:
            self._views[scheduler] = _View(seen=self._dropped.get(key, 0) + len(self._steps.get(key, [])))

    def should_hold(self, scheduler: Any) -> bool:
        """Whether ``scheduler``'s step now is held; records the scheduler's view either way.

        Held: every step of its optimizer since its last step known skipped, or a step owed for an earlier interval
        that turned out all skipped.
        """
        self.read_ready()
        key = id(scheduler.optimizer)
        steps, dropped = self._steps.get(key, []), self._dropped.get(key, 0)
        self.watch(scheduler)
        view = self._views[scheduler]
        still_open = []
        for start, end in view.open:
            outcomes = steps[start - dropped : end - dropped]
            if not all(_known(o) for o in outcomes):
                still_open.append((start, end))
            elif all(_skipped(o) for o in outcomes):
                view.debt += 1  # it stepped for an interval whose every step was skipped after all
        view.open = still_open
        start, end = view.seen, dropped + len(steps)
        view.seen = end
        outcomes = steps[start - dropped :]
        known = all(_known(o) for o in outcomes)
        if not outcomes:
            held = False  # no optimizer step since its last: it steps, as a scheduler stepped by hand would
        elif known and all(_skipped(o) for o in outcomes):
            held = True
        elif view.debt:
            view.debt, held = view.debt - 1, True
        else:
            held = False
            if not known:
                view.open.append((start, end))
        self.held_steps += held
        self._trim(key)
        return held

    def _trim(self, key: int) -> None:
        """Drop the outcomes no scheduler of that optimizer can ask about any more."""
        views = [view for scheduler, view in self._views.items() if id(scheduler.optimizer) == key]
        if not views:
            return
        needed = min(min([view.seen, *(start for start, _ in view.open)]) for view in views)
        dropped = self._dropped.get(key, 0)
        if needed > dropped:
            self._steps[key] = self._steps.get(key, [])[needed - dropped :]
            self._dropped[key] = needed


# One held subclass per scheduler class; which ledger a held scheduler consults is looked up by the instance.
_HELD_CLASSES: dict[type, type] = {}
_LEDGER_OF: weakref.WeakKeyDictionary[Any, StepLedger] = weakref.WeakKeyDictionary()


def _held_class(cls: type) -> type:
    if cls not in _HELD_CLASSES:
        original_step = getattr(cls, "step")  # noqa: B009 (mypy cannot see `step` on a bare `type`)

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            ledger = _LEDGER_OF.get(self)
            if ledger is not None and ledger.should_hold(self):
                return None
            return original_step(self, *args, **kwargs)

        def __reduce_ex__(self: Any, protocol: Any) -> Any:
            # Pickle (and copy) as the original class: the held class is a runtime attachment pickle cannot find by
            # name. A copy is therefore an ordinary scheduler, not held.
            return _rebuild, (cls, self.__dict__)

        namespace = {"step": step, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__}
        _HELD_CLASSES[cls] = type(cls.__name__, (cls,), {**namespace, "_amp_plus_held_from": cls})
    return _HELD_CLASSES[cls]


def _rebuild(cls: type, state: dict[str, Any]) -> Any:
    """Recreate a scheduler of ``cls`` from its ``__dict__`` (the unpickling side of a held scheduler)."""
    scheduler: Any = object.__new__(cls)
    scheduler.__dict__.update(state)
    return scheduler


def hold(scheduler: Any, ledger: StepLedger) -> None:
    """Make ``scheduler.step()`` consult ``ledger`` (idempotent)."""
    cls = getattr(type(scheduler), "_amp_plus_held_from", type(scheduler))
    _LEDGER_OF[scheduler] = ledger
    ledger.watch(scheduler)
    # A class swap, so that state_dict() and isinstance stay the scheduler's own (tests/step/test_schedulers.py).
    scheduler.__class__ = _held_class(cls)


def release(scheduler: Any) -> None:
    """Undo :func:`hold`."""
    _LEDGER_OF.pop(scheduler, None)
    original = getattr(type(scheduler), "_amp_plus_held_from", None)
    if original is not None:
        scheduler.__class__ = original


class SchedulerHold:
    """The schedulers one engine holds, and the ledger of its optimizers' steps they consult.

    State: the ledger and the schedulers held (given their own ``step`` back by :meth:`release`). The engine notes its
    optimizers' steps in the ledger while any scheduler is held.

    Args:
        read_ready: takes the fused steps whose values have arrived in host memory, without waiting.
    """

    def __init__(self, read_ready: Callable[[], None] | None = None) -> None:
        self.ledger = StepLedger(read_ready)
        self.schedulers: list[Any] = []

    @property
    def read_ready(self) -> Callable[[], None]:
        """What the ledger calls before judging: the engine's way to take arrived values without waiting."""
        return self.ledger.read_ready

    @read_ready.setter
    def read_ready(self, read_ready: Callable[[], None]) -> None:
        self.ledger.read_ready = read_ready

    def hold(self, scheduler: Any) -> None:
        """Hold ``scheduler`` still while every step of its optimizer since its last step was skipped."""
        hold(scheduler, self.ledger)
        self.schedulers.append(scheduler)

    def record(self, optimizer: object, outcome: Any) -> None:
        """Note one step of ``optimizer`` for the schedulers held."""
        self.ledger.record_outcome(optimizer, outcome)

    @property
    def held_steps(self) -> int:
        """Scheduler steps held back because every step of their optimizer since the last one was skipped."""
        return self.ledger.held_steps

    @held_steps.setter
    def held_steps(self, value: int) -> None:
        self.ledger.held_steps = value

    def release(self) -> None:
        """Give every held scheduler its own ``step`` back."""
        for scheduler in self.schedulers:
            release(scheduler)
        self.schedulers.clear()
