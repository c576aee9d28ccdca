"""The loss scale: one state machine, run where the scale lives.

* :class:`ScalePolicy`: the constants (growth and backoff factors, the growth interval, the hysteresis, the floor and
  the ceiling), and what they imply (whether an overflow lowers the scale, how many can).
* :class:`LossScale`: the state (the float32 scale a loss is multiplied by, and the two trackers), its reads, and the
  one transition, :meth:`LossScale.advance`, written with tensor operations. It runs on the scale's device from an
  overflow flag on that device, so the unscale path (whose flag the host has read anyway) and the fused-optimizer path
  (whose flag stays on the device) move the scale with the same code and no host read. Kept apart from the code that
  touches gradients, as Megatron-LM's ``DynamicGradScaler`` is, so it can be read and tested on its own.

The transitions (``g``: growth tracker, ``h``: hysteresis tracker, ``s``: scale); with ``hysteresis=1`` they are
``torch.amp.GradScaler``'s, bit for bit (``tests/step/test_policy.py`` runs GradScaler's own update beside them):

======================  ==========  =================  ==========================
case                    ``g``       ``h``              ``s``
======================  ==========  =================  ==========================
clean, no growth due    ``g + 1``   ``h``              ``s``
clean, growth due       0           ``hysteresis``     ``min(s * growth, max)``
overflow, ``h >= 2``    0           ``h - 1``          ``s``
overflow, ``h <= 1``    0           0                  ``max(s * backoff, min)``
======================  ==========  =================  ==========================

Products are taken in float64 and rounded once to float32, as torch's update kernel does (a float scale times a double
factor); the trackers are exact integers in float64. MPS has no float64: there both are float32 (:func:`wide_dtype`), as
GradScaler's own arithmetic is on MPS.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_amp_plus._checks import read_count, read_number, show
from lightning_amp_plus.step.float32 import f32
from lightning_amp_plus.step.skips import Stall

__all__ = ["LossScale", "ScalePolicy", "wide_dtype"]

_FLOAT32_MAX = torch.finfo(torch.float32).max


def wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype the step's exact arithmetic and reads use on ``device``: float64, or float32 on MPS (which has none).

    Examples:
        >>> wide_dtype(torch.device("cpu")), wide_dtype(torch.device("mps"))
        (torch.float64, torch.float32)
    """
    return torch.float32 if device.type == "mps" else torch.float64


@dataclass(frozen=True)
class ScalePolicy:
    """Grow the scale after clean steps, back it off after overflows, within ``[min_scale, max_scale]``.

    On an overflow the hysteresis tracker is decremented and, once it reaches zero, the scale is multiplied by
    ``backoff_factor`` (never below ``min_scale``); later overflows back off at once until the scale grows again. On a
    clean step the growth tracker counts up and, every ``growth_interval`` clean steps in a row, the scale is multiplied
    by ``growth_factor`` (never above ``max_scale``) and the hysteresis tracker is refilled (Megatron-LM's rule).

    Validation of the constants is the caller's job (see ``DynamicLossScaler``); :class:`LossScale` runs the rule.
    """

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float
    max_scale: float

    def __post_init__(self) -> None:
        # The bounds are float32 values, as the scale is: clamping before the float32 rounding then equals clamping
        # after it.
        object.__setattr__(self, "min_scale", f32(self.min_scale))
        object.__setattr__(self, "max_scale", f32(self.max_scale))

    def backs_off(self, scale: float, hysteresis_tracker: float) -> bool:
        """Whether an overflow at ``scale`` with that hysteresis tracker lowers the scale (else its skip is stuck).

        Examples:
            >>> policy = ScalePolicy(2.0, 0.5, 10, 1, min_scale=1.0, max_scale=8.0)
            >>> policy.backs_off(4.0, 1), policy.backs_off(1.0, 1), policy.backs_off(4.0, 2)
            (True, False, False)
        """
        return hysteresis_tracker <= 1 and max(f32(scale * self.backoff_factor), self.min_scale) < scale


class LossScale:
    """The loss scale's state: the float32 scale a loss is multiplied by, and its growth and hysteresis trackers.

    Both tensors live on the device of the first loss scaled (the CPU before) and move only by
    :meth:`advance` or an explicit :meth:`set`; :meth:`read` brings them to the host
    (one read). The policy's constants are :attr:`policy`, replaced whole by :meth:`reconfigure`.

    State: :attr:`policy`, :attr:`scale`, :attr:`trackers`, and whether they have been placed on a device yet.

    Examples:
        >>> scale = LossScale(ScalePolicy(2.0, 0.5, 1, 1, min_scale=1.0, max_scale=2.0**24), 8.0)
        >>> scale.advance(torch.tensor(0.0)); scale.value()
        16.0
        >>> scale.advance(torch.tensor(1.0)); scale.read()
        (8.0, 0, 0)
    """

    def __init__(self, policy: ScalePolicy, init_scale: float) -> None:
        self.policy = policy
        self.scale = torch.full((), f32(init_scale), dtype=torch.float32)
        self.trackers = torch.tensor([0.0, float(policy.hysteresis)], dtype=torch.float64)
        self._placed = False

    def tensor(self, device: torch.device) -> Tensor:
        """The scale on ``device``: the first device asked keeps the state, another gets a copy."""
        if not self._placed:
            self._placed = True
            self.scale, self.trackers = self.scale.to(device), self.trackers.to(device, wide_dtype(device))
        return self.scale if self.scale.device == device else self.scale.to(device, non_blocking=True)

    def advance(self, found_inf: Tensor) -> None:
        """One step of the policy, in place, on the scale's device: no host read.

        ``found_inf`` is the step's overflow flag (nonzero: an overflow), one element on any device.

        Examples:
            >>> scale = LossScale(ScalePolicy(2.0, 0.5, 2, 1, min_scale=1.0, max_scale=2.0**24), 8.0)
            >>> for found_inf in (0.0, 0.0, 1.0):
            ...     scale.advance(torch.tensor(found_inf)); print(scale.read())
            (8.0, 1, 1)
            (16.0, 0, 1)
            (8.0, 0, 0)
        """
        policy, scale, trackers = self.policy, self.scale, self.trackers
        if policy.min_scale == policy.max_scale:
            return  # equal bounds: a fixed scale (its trackers mean nothing)
        overflow = found_inf.reshape(()).to(scale.device) != 0
        growth, hysteresis = trackers[0], trackers[1]
        tolerated = overflow & (hysteresis >= 2)
        backs_off = overflow & ~tolerated
        counted = growth + 1
        grows = ~overflow & (counted >= policy.growth_interval)
        one = torch.ones_like(growth)  # float64: the factors stay doubles in the product, as in torch's kernel
        factor = torch.where(backs_off, policy.backoff_factor, torch.where(grows, policy.growth_factor, one))
        product = scale.to(factor.dtype) * factor
        scale.copy_(product.clamp_(policy.min_scale, policy.max_scale))  # rounded once to float32
        kept = torch.where(tolerated, hysteresis - 1, torch.where(grows, float(policy.hysteresis), hysteresis))
        trackers.copy_(torch.stack([torch.where(overflow | grows, 0.0, counted), torch.where(backs_off, 0.0, kept)]))

    def read(self) -> tuple[float, int, int]:
        """``(scale, growth tracker, hysteresis tracker)`` on the host (one read)."""
        scale, growth, hysteresis = torch.cat([self.scale.to(self.trackers.dtype).reshape(1), self.trackers]).tolist()
        return scale, int(growth), int(hysteresis)

    def value(self) -> float:
        """The scale now, as a Python float (a host read)."""
        return self.read()[0]

    def set(self, scale: float, growth_tracker: int | None = None, hysteresis_tracker: int | None = None) -> None:
        """Set the scale (and the trackers, when given): host values written to the device, no read."""
        self.scale.fill_(f32(scale))
        if growth_tracker is not None:
            self.trackers[0].fill_(float(growth_tracker))
        if hysteresis_tracker is not None:
            self.trackers[1].fill_(float(hysteresis_tracker))

    def reconfigure(self, **constants: float) -> None:
        """Change the policy's constants (``growth_factor=...``); the state stays."""
        self.policy = dataclasses.replace(self.policy, **constants)  # type: ignore[arg-type]

    def stall(self, scale: float) -> Stall:
        """Why skips at ``scale`` are stuck, and what to try (for the diagnosis that stops a run)."""
        policy = self.policy
        if scale <= policy.min_scale:
            return Stall(
                f"with the loss scale at its floor (scale={scale:g}, min_scale={policy.min_scale:g})",
                "The model produces inf/NaN gradients even at the smallest loss scale allowed.",
                "check the inputs and the loss for inf/NaN, lower the learning rate, clip gradients, train in "
                "'bf16-mixed', or lower `min_scale`",
            )
        return Stall(
            f"without the loss scale coming down (scale={scale:g}, backoff_factor={policy.backoff_factor:g}, "
            f"hysteresis={policy.hysteresis})",
            "The scale cannot back off to where the gradients fit: the hysteresis or the backoff factor hold it.",
            "lower `hysteresis`, use a `backoff_factor` below 1 (e.g. 0.5), or a lower `init_scale`",
        )

    def state_dict(self) -> dict[str, float | int]:
        """The scale, its trackers and the policy's constants, under ``torch.amp.GradScaler``'s keys and ours."""
        scale, growth, hysteresis = self.read()
        policy = self.policy
        return {
            "scale": scale,
            "growth_factor": policy.growth_factor,
            "backoff_factor": policy.backoff_factor,
            "growth_interval": policy.growth_interval,
            "_growth_tracker": growth,
            "hysteresis": policy.hysteresis,
            "_hysteresis_tracker": hysteresis,
            "min_scale": policy.min_scale,
            "max_scale": policy.max_scale,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the scale and trackers of :meth:`state_dict` (or of a ``GradScaler``); the constants stay this one's.

        A scale outside ``[min_scale, max_scale]`` is clamped (with a warning); trackers beyond this policy's growth
        interval or hysteresis are brought within them.

        Raises:
            TypeError: a value has the wrong type.
            ValueError: the state has no scale, or a value is out of range.
        """
        if "scale" not in state:
            raise ValueError(
                "The scaler state has no 'scale' key (keys: "
                f"{sorted(map(str, state))}): it is not a DynamicLossScaler or torch.amp.GradScaler state."
            )
        scale = read_number(state, "scale", float)
        if not (math.isfinite(scale) and 0 < scale <= _FLOAT32_MAX):
            raise ValueError(
                f"The scaler state holds scale={show(state['scale'])}; a loss scale must be finite and > 0, "
                f"within float32 (<= {_FLOAT32_MAX:.3g}): the state is corrupt."
            )
        policy = self.policy
        growth = read_count(state, "_growth_tracker", 0)
        hysteresis = read_count(state, "_hysteresis_tracker", policy.hysteresis)
        if not policy.min_scale <= scale <= policy.max_scale:
            warnings.warn(
                f"The saved loss scale {scale:g} is outside [min_scale, max_scale] = [{policy.min_scale:g}, "
                f"{policy.max_scale:g}]; it is clamped to that range.",
                stacklevel=3,
            )
            scale = min(max(scale, policy.min_scale), policy.max_scale)
        # A tracker at or past its end acts as the end: g >= interval - 1 grows at the next clean step either way.
        self.set(scale, min(growth, policy.growth_interval - 1), min(hysteresis, policy.hysteresis))

    def __getstate__(self) -> dict[str, object]:
        """Pickled as host numbers (the state is placed on a device again at the first use)."""
        return {"policy": self.policy, "values": self.read()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        scale, growth, hysteresis = state["values"]
        self.__init__(state["policy"], scale)  # type: ignore[misc]
        self.set(scale, growth, hysteresis)
