"""The spike guard: judge a step's finite gradient norm against the running statistics of the steps taken before it.

A finite spike (a bad batch, an optimizer-state resonance) gives a gradient many times the usual norm. Taken, it moves
SGD's weights by as much and pollutes Adam's second moment for about ``1 / (1 - beta2)`` steps. The guard sees the
global L2 norm of the unscaled gradients, which the step engine measures for it after the overflow check, and says,
before the update, whether the step is ordinary (``"take"``) or a spike to ``"skip"`` or to ``"clip"`` down to the
threshold.

The statistic (chosen by ``benchmarks/bench_spikes.py``; see ``docs/spike-guard.md`` for the numbers): a running mean
and variance of the norms of the steps taken, weighted exponentially with the decay ``alpha`` as ZClip does, except
over the first ``1 / (1 - alpha)`` steps, which are weighted alike (the plain mean and population variance, Welford's
update, so the first norms do not weigh more than their share). ``alpha=1`` keeps the plain mean and variance of
every step. The update (West, 1979) keeps three plain numbers::

    w = max(1 / steps, 1 - alpha)        # steps counts the norm being entered
    d = norm - mean
    mean += w * d
    var = (1 - w) * (var + w * d * d)

Pure Python: the verdict is the same on every rank, since every rank judges the same norm with the same numbers.

:class:`SpikeGuards` is the step engine's part: one guard per optimizer (a GAN's generator and critic have norms of
their own), the first the guard the user gave. The engine judges the norm its overflow check measured, skips a
``"skip"`` spike as it skips an overflow (counted, the LR scheduler held, the loss scale left as after a finite step),
clips a ``"clip"`` spike before any clipping of the user's, and observes the steps it applied.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_amp_plus._checks import COUNTER_MAX, check_int, check_real, is_int, real, show
from lightning_amp_plus.step.float32 import f32
from lightning_amp_plus.step.positions import ByPosition

__all__ = ["DEFAULT_ALPHA", "DEFAULT_THRESHOLD", "DEFAULT_WARMUP", "SpikeGuard", "SpikeGuards", "SpikeVerdict"]

DEFAULT_THRESHOLD = 25.0
"""Standard deviations above the running mean that make a spike (the benchmark's choice; see the module docstring)."""
DEFAULT_WARMUP = 100
"""Steps taken before the first decision."""
DEFAULT_ALPHA = 0.97
"""The decay of the running statistics (ZClip's): a norm's weight halves in about 23 steps."""

# torch.nn.utils.clip_grad_norm_ divides by (norm + 1e-6): the same for the same coefficient, bit for bit.
_CLIP_EPS = 1e-6
_SETTINGS = ("threshold", "warmup", "action", "alpha")


@dataclass(frozen=True)
class SpikeVerdict:
    """What :meth:`SpikeGuard.judge` decided about one step's gradient norm.

    Attributes:
        action: ``"take"`` (an ordinary step, or no decision yet), ``"skip"`` (a spike: do not apply the step) or
            ``"clip"`` (a spike: multiply the gradients by ``coefficient``, then apply the step).
        norm: the norm judged.
        coefficient: for ``"clip"``, what to multiply the gradients by to bring their norm down to ``threshold_norm``,
            computed as ``torch.nn.utils.clip_grad_norm_(max_norm=threshold_norm)`` computes its coefficient
            (float32, the same bits); 1.0 otherwise.
        mean: the running mean of the norms of the steps taken before this one.
        std: their running standard deviation.
        threshold_norm: ``mean + threshold * std``: a norm above it is a spike; ``inf`` while no decision is made.
        steps: the steps taken before this one (entered in the statistics), for :meth:`SpikeGuard.observe`'s check.
    """

    action: Literal["take", "skip", "clip"]
    norm: float
    coefficient: float
    mean: float
    std: float
    threshold_norm: float
    steps: int

    @property
    def spike(self) -> bool:
        """Whether the step is a spike (``"skip"`` or ``"clip"``)."""
        return self.action != "take"


class SpikeGuard:
    """Flag a step whose finite gradient norm is far above the running mean of the steps taken before it.

    A step is a spike when its norm exceeds ``mean + threshold * std`` of the norms of the steps taken so far (see
    the module docstring for the statistic). No decision is made during the first ``warmup`` steps taken, nor while
    the norms taken show no spread (``std == 0``: fewer than two steps, or all alike): every step is taken then.

    The caller measures the global L2 norm of the unscaled gradients of a step (before any clipping of its own), asks
    :meth:`judge` (a pure read), acts on the verdict, and hands the verdict of a step it applied to :meth:`observe`:

    * ``"take"``: the step is applied; its norm enters the statistics.
    * ``"skip"``: the step is not applied, and the spike does not enter the statistics: what follows is the same as
      if the batch had never been seen.
    * ``"clip"``: the gradients are multiplied by ``verdict.coefficient`` (down to ``threshold_norm``) and the step is
      applied; its norm after clipping, ``threshold_norm``, enters the statistics (as ZClip does), so that a lasting
      rise of the norm is followed within a few steps instead of being clipped for ever.

    A non-finite norm is never judged: an overflow stays an overflow, and the caller skips it before asking.

    Args:
        threshold: standard deviations above the running mean that make a spike (> 0).
        warmup: steps taken before the first decision (>= 0).
        action: what to do with a spike: ``"skip"`` or ``"clip"``.
        alpha: the decay of the running statistics, in (0, 1]: ZClip's 0.97 follows the last ~30 steps; 1 weighs
            every step taken alike.

    State (mutable, saved by :meth:`state_dict`): ``steps``, the steps taken (entered); ``mean`` and ``var``, the
    running mean and variance of their norms. The settings (``threshold``, ``warmup``, ``action``, ``alpha``) do not
    change.

    Examples:
        >>> guard = SpikeGuard(threshold=4.0, warmup=5)
        >>> for norm in (1.0, 1.2, 0.9, 1.1, 1.0):
        ...     guard.observe(guard.judge(norm))
        >>> guard.judge(1.3).action
        'take'
        >>> verdict = guard.judge(50.0)
        >>> verdict.action, round(verdict.mean, 2), round(verdict.std, 3), round(verdict.threshold_norm, 3)
        ('skip', 1.04, 0.102, 1.448)
        >>> guard.observe(verdict)  # a skipped spike enters nothing
        >>> guard.steps
        5
        >>> SpikeGuard(threshold=4.0, warmup=5, action="clip").judge(50.0).coefficient  # no decision yet
        1.0
    """

    def __init__(
        self,
        threshold: float = DEFAULT_THRESHOLD,
        warmup: int = DEFAULT_WARMUP,
        action: Literal["skip", "clip"] = "skip",
        alpha: float = DEFAULT_ALPHA,
    ) -> None:
        name = type(self).__name__
        rule = f"a finite number > 0 (standard deviations above the mean), e.g. {DEFAULT_THRESHOLD:g}"
        self.threshold = check_real(name, "threshold", threshold, rule, lambda x: x > 0)
        self.warmup = check_int(
            name, "warmup", warmup, minimum=0, hint=f" (steps taken before the first decision), e.g. {DEFAULT_WARMUP}"
        )
        if action not in ("skip", "clip"):
            raise ValueError(
                f"`{name}(action={show(action)})` is not supported: use 'skip' (the step is not applied) or 'clip' "
                "(the gradients are scaled down to the threshold)."
            )
        self.action: Literal["skip", "clip"] = action
        self.alpha = check_real(
            name, "alpha", alpha, f"in (0, 1], e.g. {DEFAULT_ALPHA} (1 weighs every step alike)", lambda x: 0 < x <= 1
        )
        self.steps = 0
        self.mean = 0.0
        self.var = 0.0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(threshold={self.threshold!r}, warmup={self.warmup!r}, action={self.action!r}, "
            f"alpha={self.alpha!r})"
        )

    def judge(self, norm: float) -> SpikeVerdict:
        """The verdict on a step whose gradients have the global L2 norm ``norm``; changes nothing.

        Raises:
            ValueError: ``norm`` is not a finite number >= 0 (an overflow is the caller's to skip, never judged).
        """
        value = real(norm)
        if value is None or value < 0:
            raise ValueError(
                f"`{type(self).__name__}.judge(norm={show(norm)})`: the guard judges finite gradient norms >= 0 only; "
                "a step whose gradients hold inf/NaN is an overflow: skip it without asking the guard."
            )
        std = math.sqrt(self.var)
        if self.steps < self.warmup or std == 0.0:
            return SpikeVerdict("take", value, 1.0, self.mean, std, math.inf, self.steps)
        limit = self.mean + self.threshold * std
        if value <= limit:
            return SpikeVerdict("take", value, 1.0, self.mean, std, limit, self.steps)
        coefficient = 1.0
        if self.action == "clip":
            # torch's clip_grad_norm_ computes max_norm / (norm + eps) on a float32 tensor: reciprocal(norm + eps) *
            # max_norm, each rounded to float32 (a float64 holds each exact result before rounding).
            coefficient = min(f32(f32(1.0 / f32(f32(value) + f32(_CLIP_EPS))) * f32(limit)), 1.0)
        return SpikeVerdict(self.action, value, coefficient, self.mean, std, limit, self.steps)

    def observe(self, verdict: SpikeVerdict) -> None:
        """Enter the step that ``verdict`` judged, once it was applied; a ``"skip"`` verdict enters nothing.

        A taken step enters its norm, a clipped one its norm after clipping (``threshold_norm``). Call it once per
        applied step, with the verdict :meth:`judge` gave for that step; a step that was not applied (skipped for a
        spike or an overflow) is not observed.

        Raises:
            RuntimeError: the verdict was judged against other statistics (observed twice, or judged before another
                step was observed).
        """
        if verdict.steps != self.steps:
            raise RuntimeError(
                f"`{type(self).__name__}.observe`: the verdict was judged when {verdict.steps} steps had been taken, "
                f"but {self.steps} have now: judge each step once, then observe that verdict once."
            )
        if verdict.action == "skip":
            return
        norm = verdict.threshold_norm if verdict.action == "clip" else verdict.norm
        self.steps += 1
        weight = max(1.0 / self.steps, 1.0 - self.alpha)
        delta = norm - self.mean
        self.mean += weight * delta
        self.var = (1.0 - weight) * (self.var + weight * delta * delta)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The statistics and the settings, as plain Python numbers and strings (``torch.load(weights_only=True)``).

        Examples:
            >>> SpikeGuard().state_dict()
            {'steps': 0, 'mean': 0.0, 'var': 0.0, 'threshold': 25.0, 'warmup': 100, 'action': 'skip', 'alpha': 0.97}
        """
        return {
            "steps": self.steps,
            "mean": self.mean,
            "var": self.var,
            "threshold": self.threshold,
            "warmup": self.warmup,
            "action": self.action,
            "alpha": self.alpha,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the statistics saved by :meth:`state_dict`: the guard then judges as the saved one would have.

        The settings this guard was built with stay in force; if the saved ones differ, a warning names them (the
        resumed run then judges differently from the saved one, which may be meant).

        Raises:
            TypeError: the state is not a mapping, or a statistic is not a number of its kind.
            ValueError: a statistic is missing, or out of range (a negative or non-finite mean or variance, a step
                count below 0 or above 2**62): the state is corrupt.
        """
        name = type(self).__name__
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"`{name}.load_state_dict` expects a dict, got {type(state_dict).__name__}.")
        missing = [key for key in ("steps", "mean", "var") if key not in state_dict]
        if missing:
            raise ValueError(
                f"The {name} state has no {', '.join(map(repr, missing))} (keys: {sorted(map(str, state_dict))}): "
                f"it is not a {name}.state_dict()."
            )
        steps = state_dict["steps"]
        if not is_int(steps):
            raise TypeError(f"The {name} state holds steps={show(steps)} ({type(steps).__name__}); expected an int.")
        if not 0 <= steps <= COUNTER_MAX:
            raise ValueError(
                f"The {name} state holds steps={show(steps)}; expected an int in [0, 2**62]: it is corrupt."
            )
        statistics = {key: self._read_statistic(state_dict, key) for key in ("mean", "var")}
        differ = [
            f"{key}={state_dict[key]!r} (now {getattr(self, key)!r})"
            for key in _SETTINGS
            if _differs(self, key, state_dict)
        ]
        if differ:
            warnings.warn(
                f"The {name} state was saved with {', '.join(differ)}; this guard's settings are kept, so the resumed "
                "run judges differently from the saved one.",
                stacklevel=2,
            )
        self.steps, self.mean, self.var = int(steps), statistics["mean"], statistics["var"]

    def _read_statistic(self, state: Mapping[str, Any], key: str) -> float:
        value = state[key]
        name = type(self).__name__
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"The {name} state holds {key}={show(value)} ({type(value).__name__}); expected a float.")
        number = real(value)
        if number is None or number < 0:
            raise ValueError(
                f"The {name} state holds {key}={show(value)}; expected a finite number >= 0: the state is corrupt."
            )
        return number


class SpikeGuards:
    """One :class:`SpikeGuard` per optimizer of a step engine, by the optimizer's position, made at first use.

    The first optimizer's guard is the one given; each other optimizer gets a fresh guard with its settings. A state
    loaded before an optimizer's guard is made waits, by position, until it is (Fabric meets its optimizers at their
    first step).

    State: the guards by optimizer position, and the states loaded for positions that have none yet (a
    :class:`~.positions.ByPosition`).

    Examples:
        >>> guards = SpikeGuards(SpikeGuard(warmup=0))
        >>> guards.of(0).observe(guards.of(0).judge(1.0)); guards.of(1).steps
        0
        >>> [state["steps"] for state in guards.state_dict()]
        [1, 0]
    """

    def __init__(self, guard: SpikeGuard) -> None:
        if not isinstance(guard, SpikeGuard):
            raise TypeError(
                f"`spike_guard={show(guard)}` ({type(guard).__name__}) is not supported: pass a SpikeGuard, e.g. "
                "`spike_guard=SpikeGuard()` (or `SpikeGuard(action='clip')`), or None for no guard."
            )
        self.guard = guard
        self._guards: ByPosition[SpikeGuard] = ByPosition()

    def of(self, position: int) -> SpikeGuard:
        """The guard of the optimizer at ``position``, made and given any waiting state the first time."""
        first = not self._guards.made and position == 0
        return self._guards.get(position, lambda: self.guard if first else _like(self.guard))

    def state_dict(self) -> list[dict[str, Any] | None]:
        """Each position's guard state (``None`` for a position with no guard yet)."""
        return self._guards.state_dict()

    def load_state_dict(self, states: list[Mapping[str, Any] | None]) -> None:
        """Load each position's state into its guard, or keep it until that guard is made (checked then).

        Raises:
            TypeError: ``states`` is not a list of states (or ``None``).
        """
        if not isinstance(states, list) or not all(state is None or isinstance(state, Mapping) for state in states):
            raise TypeError(
                f"A spike guard state must be a list of SpikeGuard states (one per optimizer), got {show(states)}."
            )
        self._guards.load_state_dict(states)


def _like(guard: SpikeGuard) -> SpikeGuard:
    return SpikeGuard(threshold=guard.threshold, warmup=guard.warmup, action=guard.action, alpha=guard.alpha)


def _differs(guard: SpikeGuard, key: str, state: Mapping[str, Any]) -> bool:
    """Whether ``state`` holds the setting ``key`` with a value other than ``guard``'s (absent: no difference)."""
    return key in state and state[key] != getattr(guard, key)
