"""Objects kept one per optimizer, by the optimizer's position in the engine, made at first use.

A front end may meet its optimizers only at their first step (Fabric): a state loaded before an optimizer's object is
made waits, by position, until it is. The step engine keeps its compensators (:mod:`~lightning_amp_plus.weights.
compensated`) and its spike guards (:mod:`~.spikes`) this way, and saves them as a list by position (``None`` where
an optimizer has none yet).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["ByPosition"]


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None: ...


_T = TypeVar("_T", bound=_Stateful)


class ByPosition(Generic[_T]):
    """One object per optimizer position, made at first use; states loaded early wait for their object.

    State: the objects made (:attr:`made`), and the states loaded for positions that have none yet.

    Examples:
        >>> from lightning_amp_plus.step.spikes import SpikeGuard
        >>> guards: ByPosition[SpikeGuard] = ByPosition()
        >>> seen = SpikeGuard(warmup=0); seen.observe(seen.judge(1.0))
        >>> guards.load_state_dict([None, seen.state_dict()])  # before position 1's guard is made: it waits
        >>> guards.get(1, lambda: SpikeGuard(warmup=0)).steps, [state is None for state in guards.state_dict()]
        (1, [True, False])
    """

    def __init__(self) -> None:
        self.made: dict[int, _T] = {}
        self._waiting: dict[int, Mapping[str, Any]] = {}

    def get(self, position: int, make: Callable[[], _T]) -> _T:
        """The object at ``position``: made by ``make`` and given any waiting state the first time."""
        if position not in self.made:
            made = make()
            if position in self._waiting:
                made.load_state_dict(self._waiting.pop(position))
            self.made[position] = made
        return self.made[position]

    def state_dict(self) -> list[dict[str, Any] | None]:
        """Each position's state (``None`` for a position with no object yet)."""
        slots = max(self.made, default=-1) + 1
        return [self.made[i].state_dict() if i in self.made else None for i in range(slots)]

    def load_state_dict(self, states: Sequence[Mapping[str, Any] | None]) -> None:
        """Load each position's state into its object, or keep it until that object is made."""
        for position, saved in enumerate(states):
            if saved is None:
                continue
            if position in self.made:
                self.made[position].load_state_dict(saved)
            else:
                self._waiting[position] = saved
