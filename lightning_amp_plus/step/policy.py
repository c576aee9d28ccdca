"""The loss scale: one state machine, run where the scale lives.

* :class:`ScalePolicy`: the constants (growth and backoff factors, the growth interval, the hysteresis, the floor and
  the ceiling), and what they imply (whether an overflow lowers the scale, how many can).
* :class:`LossScale`: the state (the float32 scale a loss is multiplied by, and the two trackers), its reads, and the
  one transition, :meth:`LossScale.advance`. It runs on the scale's device from an overflow flag on that device, so
  the unscale path (whose flag the host has read anyway) and the fused-optimizer path (whose flag stays on the device)
  move the scale with the same code and no host read. Kept apart from the code that touches gradients, as
  Megatron-LM's ``DynamicGradScaler`` is, so it can be read and tested on its own.

The transitions (``g``: growth tracker, ``h``: hysteresis tracker, ``s``: scale):

======================  ==========  =================  ==========================
case                    ``g``       ``h``              ``s``
======================  ==========  =================  ==========================
clean, no growth due    ``g + 1``   ``h``              ``s``
clean, growth due       0           ``hysteresis``     ``min(s * growth, max)``
overflow, ``h >= 2``    0           ``h - 1``          ``s``
overflow, ``h <= 1``    0           ``max(h - 1, 0)``  ``max(s * backoff, min)``
======================  ==========  =================  ==========================

The scale and the growth tracker move by ``torch.amp.GradScaler``'s own update kernel (``torch._amp_update_scale_``:
one op, products taken in float64 and rounded once to float32, a growth that would leave float32's range not taken),
then the bounds clamp the scale (one op): with ``hysteresis=1`` the machine is GradScaler's, bit for bit, within the
bounds (``tests/step/test_policy.py`` runs GradScaler's update beside it). The hysteresis is a few ops around the
kernel, run only when ``hysteresis > 1``: an overflow it tolerates reaches the kernel as a clean step from a growth
tracker of -1, which leaves the scale and ends at 0 (the same test file checks it against Megatron-LM's rule). With
``hysteresis=1`` the hysteresis tracker stays where it is: every overflow backs off whatever it holds. The trackers are
int32, as GradScaler's growth tracker (the kernel's type): intervals up to ``2**31 - 1``.
"""

from __future__ import annotations

import dataclasses
import math
import struct
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

    The three tensors live on the device of the first loss scaled (the CPU before) and move only by
    :meth:`advance` or an explicit :meth:`set`; :meth:`read` brings them to the host
    (one read). The policy's constants are :attr:`policy`, replaced whole by :meth:`reconfigure`.

    State: :attr:`policy`, :attr:`scale` (0-d float32), :attr:`growth` and :attr:`hysteresis` (0-d int32), and
    :attr:`wide`, the dtype the step's exact reads of the scale with its flag use on their device (:func:`wide_dtype`),
    set when they are placed.

    Examples:
        >>> scale = LossScale(ScalePolicy(2.0, 0.5, 1, 1, min_scale=1.0, max_scale=2.0**24), 8.0)
        >>> scale.advance(torch.tensor(0.0)); scale.value()
        16.0
        >>> scale.advance(torch.tensor(1.0)); scale.read()
        (8.0, 0, 1)
    """

    def __init__(self, policy: ScalePolicy, init_scale: float) -> None:
        self.policy = policy
        self.scale = torch.full((), f32(init_scale), dtype=torch.float32)
        self.growth = torch.zeros((), dtype=torch.int32)
        self.hysteresis = torch.full((), policy.hysteresis, dtype=torch.int32)
        self.wide = torch.float64
        self._placed = False

    def tensor(self, device: torch.device) -> Tensor:
        """The scale on ``device``: the first device asked keeps the state, another gets a copy."""
        if not self._placed:
            self._placed = True
            self.scale, self.growth = self.scale.to(device), self.growth.to(device)
            self.hysteresis = self.hysteresis.to(device)
            self.wide = wide_dtype(device)
        return self.scale if self.scale.device == device else self.scale.to(device, non_blocking=True)

    def advance(self, found_inf: Tensor) -> None:
        """One step of the policy, in place, on the scale's device: no host read.

        ``found_inf`` is the step's overflow flag (float32, nonzero: an overflow), one element on any device.

        Examples:
            >>> scale = LossScale(ScalePolicy(2.0, 0.5, 2, 2, min_scale=1.0, max_scale=2.0**24), 8.0)
            >>> for found_inf in (0.0, 0.0, 1.0, 1.0):
            ...     scale.advance(torch.tensor(found_inf)); print(scale.read())
            (8.0, 1, 2)
            (16.0, 0, 2)
            (16.0, 0, 1)
            (8.0, 0, 0)
        """
        policy, scale, growth = self.policy, self.scale, self.growth
        if policy.min_scale == policy.max_scale:
            return  # equal bounds: a fixed scale (its trackers mean nothing)
        found = found_inf if found_inf.device == scale.device else found_inf.to(scale.device)
        if policy.hysteresis > 1:
            overflow = found.reshape(()) != 0
            tolerated = overflow & (self.hysteresis >= 2)
            # A tolerated overflow is the kernel's clean step from -1: the scale stays, the tracker ends at 0.
            growth.masked_fill_(tolerated, -1)
            found = found.reshape(()).masked_fill(tolerated, 0.0)
        torch._amp_update_scale_(
            scale, growth, found, policy.growth_factor, policy.backoff_factor, policy.growth_interval
        )
        scale.clamp_(policy.min_scale, policy.max_scale)
        if policy.hysteresis > 1:
            self.hysteresis.sub_(overflow.int()).clamp_(min=0)
            self.hysteresis.masked_fill_(~overflow & (growth == 0), policy.hysteresis)  # a growth refills it

    def read(self) -> tuple[float, int, int]:
        """``(scale, growth tracker, hysteresis tracker)`` on the host (one read), each exact on every device.

        Read as int32: the trackers as they are and the float32 scale by its bits. Through the wide dtype, a tracker
        past ``2**24`` would round on MPS, whose wide dtype is float32 (``tests/step/test_policy.py``).
        """
        bits = self.scale.reshape(1).view(torch.int32)
        scale_bits, growth, hysteresis = torch.cat([bits, self.growth.reshape(1), self.hysteresis.reshape(1)]).tolist()
        return struct.unpack("<f", struct.pack("<i", scale_bits))[0], growth, hysteresis

    def value(self) -> float:
        """The scale now, as a Python float (a host read)."""
        return self.read()[0]

    def set(self, scale: float, growth_tracker: int | None = None, hysteresis_tracker: int | None = None) -> None:
        """Set the scale (and the trackers, when given): host values written to the device, no read."""
        self.scale.fill_(f32(scale))
        if growth_tracker is not None:
            self.growth.fill_(growth_tracker)
        if hysteresis_tracker is not None:
            self.hysteresis.fill_(hysteresis_tracker)

    def reconfigure(self, **constants: float) -> None:
        """Change the policy's constants (``growth_factor=...``); the state stays, the trackers within the new ones.

        No host read: a growth tracker past a shorter interval is brought to its end on the device (the next clean
        step grows, as it would have), a hysteresis tracker past a smaller hysteresis to the new one.
        """
        self.policy = dataclasses.replace(self.policy, **constants)  # type: ignore[arg-type]
        self.growth.clamp_(max=self.policy.growth_interval - 1)
        self.hysteresis.clamp_(max=self.policy.hysteresis)

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
