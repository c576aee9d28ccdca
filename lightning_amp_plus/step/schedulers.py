"""Hold learning-rate schedulers still while their optimizer's steps are being skipped.

Lightning steps schedulers after every optimizer step, skipped or not, so a run that skips steps drifts along its LR
schedule (Lightning #5558, #16228, #18828; PyTorch warns "lr_scheduler.step() before optimizer.step()"). A held
scheduler's ``step()`` is a no-op when every optimizer step since its last step was skipped.

The hold is installed by giving each scheduler instance a subclass of its own class whose ``step`` consults the
instance's ``StepLedger`` (kept in a weak mapping). Nothing is added to the instance's ``__dict__``, so
``scheduler.state_dict()`` and checkpoints are unchanged, ``isinstance`` checks still pass, and ``release`` restores the
original class.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["SchedulerHold", "StepLedger", "hold", "release"]

# Outcomes of fused-path steps kept unread at most (reading them is one host read for all).
_PENDING_MAX = 256


class StepLedger:
    """Counts, per optimizer, the steps called and the steps applied; and per scheduler, what it last saw.

    A step's outcome may be known only later (a fused optimizer skips on the device): :meth:`record_outcome` takes
    anything with a ``skipped`` attribute, and it is read only when a scheduler of that optimizer asks.
    """

    def __init__(self) -> None:
        self._counts: dict[int, tuple[int, int]] = {}
        self._pending: dict[int, list[Any]] = {}
        self._seen: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()
        self.held_steps = 0

    def __getstate__(self) -> dict[str, Any]:
        # Pickled with the plugin when `ddp_spawn` starts its processes: what each scheduler last saw belongs to
        # scheduler objects of this process only, and a weak mapping cannot be pickled anyway.
        self._settle_all()
        return {"_counts": self._counts, "held_steps": self.held_steps}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pending = {}
        self._seen = weakref.WeakKeyDictionary()

    def record_outcome(self, optimizer: object, outcome: Any) -> None:
        """Note one step of ``optimizer`` whose ``outcome.skipped`` is read only when a scheduler asks.

        An outcome already known (``outcome.resolved``) is counted at once; pending ones wait, but never more than
        ``_PENDING_MAX`` of them (then they are read), so a run whose schedulers never ask keeps no growing list.
        """
        pending = self._pending.setdefault(id(optimizer), [])
        pending.append(outcome)
        if getattr(outcome, "resolved", True) or len(pending) > _PENDING_MAX:
            self._settle(id(optimizer))

    def should_hold(self, scheduler: Any) -> bool:
        """True when ``scheduler``'s optimizer stepped since the scheduler's last step and every such step was skipped.

        Records the scheduler's view either way, so each optimizer step is judged once.
        """
        self._settle(id(scheduler.optimizer))
        now = self._counts.get(id(scheduler.optimizer), (0, 0))
        called, done = self._seen.get(scheduler, (0, 0))
        self._seen[scheduler] = now
        held = now[0] > called and now[1] == done
        self.held_steps += int(held)
        return held

    def _settle(self, key: int) -> None:
        called, done = self._counts.get(key, (0, 0))
        for outcome in self._pending.pop(key, ()):
            called, done = called + 1, done + int(not outcome.skipped)
        self._counts[key] = (called, done)

    def _settle_all(self) -> None:
        for key in list(self._pending):
            self._settle(key)


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
    """

    def __init__(self) -> None:
        self.ledger = StepLedger()
        self.schedulers: list[Any] = []

    def hold(self, scheduler: Any) -> None:
        """Hold ``scheduler`` still while every step of its optimizer since its last step was skipped."""
        hold(scheduler, self.ledger)
        self.schedulers.append(scheduler)

    @property
    def held_steps(self) -> int:
        """Scheduler steps held back because every step of their optimizer since the last one was skipped."""
        return self.ledger.held_steps

    def release(self) -> None:
        """Give every held scheduler its own ``step`` back."""
        for scheduler in self.schedulers:
            release(scheduler)
        self.schedulers.clear()
