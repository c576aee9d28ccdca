"""The loss scale: its policy (a small state machine), the same rules run on the device, and the one place it lives.

* :class:`ScalePolicy`: grow the scale after clean steps, back it off after overflows, within bounds; plain Python
  numbers, kept apart from the code that touches gradients (as Megatron-LM's ``DynamicGradScaler`` is) so that it can
  be read and tested on its own.
* :class:`DevicePolicy`: the same rules on device tensors, for the fused-optimizer path, whose overflow flag stays on
  the device (reading it on the host would stall the device every step).
* :class:`LossScale`: the scale in one place: the policy's state and the float32 tensor losses are multiplied by,
  current either on the host or, after fused steps, on the device, with one documented switch between the two.

The device policy is a table lookup: the flag and the two trackers are compared against thresholds, the three bits
pick one of the policy's four transitions from a small table, and one multiply-add applies it (about ten tiny kernels,
no host read, no branch). Host and device give the same numbers bit for bit: the trackers are exact integers in
float64, and the scale is multiplied in float64 and rounded once to float32, as the host does.

The four transitions (``g``: growth tracker, ``h``: hysteresis tracker, ``s``: scale):

======================  ==========  =================  ==========================
case                    ``g``       ``h``              ``s``
======================  ==========  =================  ==========================
clean, no growth due    ``g + 1``   ``h``              ``s``
clean, growth due       0           ``hysteresis``     ``min(s * growth, max)``
overflow, ``h >= 2``    0           ``h - 1``          ``s``
overflow, ``h <= 1``    0           0                  ``max(s * backoff, min)``
======================  ==========  =================  ==========================
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_amp_plus._checks import read_count, read_number, show
from lightning_amp_plus.step.float32 import f32
from lightning_amp_plus.step.outcome import Stall

_FLOAT32_MAX = torch.finfo(torch.float32).max

__all__ = ["DevicePolicy", "LossScale", "ScalePolicy"]


@dataclass
class ScalePolicy:
    """Grow the scale after clean steps, back it off after overflows, within ``[min_scale, max_scale]``.

    On an overflow the hysteresis tracker is decremented and, once it reaches zero, the scale is multiplied by
    ``backoff_factor`` (never below ``min_scale``); later overflows back off at once until the scale grows again. On a
    clean step the growth tracker counts up and, every ``growth_interval`` clean steps in a row, the scale is multiplied
    by ``growth_factor`` (never above ``max_scale``) and the hysteresis tracker is refilled (Megatron-LM's rule). With
    ``hysteresis=1`` this is exactly ``torch.amp.GradScaler``'s policy.

    Validation of the constants is the caller's job (see ``DynamicLossScaler``).

    Examples:
        >>> policy = ScalePolicy(8.0, 2.0, 0.5, growth_interval=2, hysteresis=1, min_scale=1.0, max_scale=2.0**24)
        >>> [policy.update(found_inf) for found_inf in (False, False, True)]
        [False, True, True]
        >>> policy.scale
        8.0
    """

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float
    max_scale: float
    growth_tracker: int = 0
    hysteresis_tracker: int = field(default=-1)

    def __post_init__(self) -> None:
        # The scale mirrors a float32 tensor: keep it float32 so host and device agree bit for bit. Products are taken
        # in float64 and rounded once, as torch's update kernel does (float scale times double factor).
        self.scale, self.min_scale, self.max_scale = f32(self.scale), f32(self.min_scale), f32(self.max_scale)
        if self.hysteresis_tracker < 0:
            self.hysteresis_tracker = self.hysteresis

    @property
    def fixed(self) -> bool:
        """True when the bounds pin the scale: it can never change."""
        return self.min_scale == self.max_scale

    def backoffs_to_floor(self) -> int:
        """The most overflows in a row that can lower the scale: the backoffs from ``max_scale`` down to ``min_scale``.

        Backing off is monotone, so from any scale within the bounds it takes at most this many. 0 when the scale can
        never be lowered (``backoff_factor=1.0``, or equal bounds).

        Examples:
            >>> ScalePolicy(2.0**16, 2.0, 0.5, 2000, 1, min_scale=1.0, max_scale=2.0**24).backoffs_to_floor()
            24
        """
        if self.backoff_factor >= 1.0 or self.min_scale >= self.max_scale:
            return 0
        # Each backoff multiplies by at most backoff_factor * (1 + 2**-24) after float32 rounding: an upper bound.
        widest = self.backoff_factor * (1.0 + 2.0**-24)
        bound = math.floor(math.log(self.max_scale / self.min_scale) / -math.log(widest)) + 1
        if bound > 100_000:  # not worth walking; the bound holds
            return bound
        scale, count = self.max_scale, 0
        while scale > self.min_scale:
            scale, count = max(f32(scale * self.backoff_factor), self.min_scale), count + 1
        return count

    def backs_off_on_overflow(self) -> bool:
        """Whether an overflow now would lower the scale: the hysteresis is used up and the scale is above its floor.

        Examples:
            >>> ScalePolicy(1.0, 2.0, 0.5, 10, 1, min_scale=1.0, max_scale=8.0).backs_off_on_overflow()
            False
        """
        return self.backs_off_at(self.scale, self.hysteresis_tracker)

    def backs_off_at(self, scale: float, hysteresis_tracker: float) -> bool:
        """Whether an overflow at ``scale`` with that hysteresis tracker would lower the scale (this policy's rules)."""
        return hysteresis_tracker <= 1 and max(f32(scale * self.backoff_factor), self.min_scale) < scale

    def update(self, found_inf: bool) -> bool:
        """Advance by one step; return whether the scale changed."""
        before = self.scale
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker = max(self.hysteresis_tracker - 1, 0)
            if self.hysteresis_tracker == 0:
                self.scale = max(f32(self.scale * self.backoff_factor), self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker >= self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = min(f32(self.scale * self.growth_factor), self.max_scale)
        return self.scale != before


# Columns of the state vector and of the table's rows.
_FLAG, _GROWTH, _HYSTERESIS = 0, 1, 2
# A row: multipliers of (flag, g, h), addends of (flag, g, h), scale factor.
_MULT, _ADD, _FACTOR = slice(0, 3), slice(3, 6), 6


def _constants(policy: ScalePolicy) -> tuple[float, ...]:
    return (policy.growth_factor, policy.backoff_factor, float(policy.growth_interval), float(policy.hysteresis))


class DevicePolicy:
    """``ScalePolicy.update`` on device tensors: the scale (float32, in place) and the trackers (float64).

    Built on the scale's device from a host policy; :meth:`load` copies the host's trackers over (no host read),
    :meth:`advance` applies one step's flag.

    Examples:
        >>> host = ScalePolicy(8.0, 2.0, 0.5, growth_interval=2, hysteresis=1, min_scale=1.0, max_scale=2.0**24)
        >>> scale = torch.full((), 8.0)
        >>> device = DevicePolicy(host, scale)
        >>> for flag in (0.0, 0.0, 1.0):
        ...     device.advance(scale, torch.tensor(flag), host)
        >>> scale.item(), [host.update(f) for f in (False, False, True)], host.scale
        (8.0, [False, True, True], 8.0)
    """

    def __init__(self, policy: ScalePolicy, scale: Tensor) -> None:
        self.device = scale.device
        self._key = _constants(policy)
        # (flag, growth tracker, hysteresis tracker); the flag slot receives each step's flag.
        self.state = torch.zeros(3, dtype=torch.float64, device=self.device)
        # Bits: flag >= 0.5 (overflow), g >= growth_interval - 1 (a clean step now grows), h >= 2 (an overflow now is
        # tolerated). Their weights make the row index.
        self._thresholds = torch.zeros(3, dtype=torch.float64, device=self.device)
        self._weights = torch.zeros(3, dtype=torch.long, device=self.device)
        self._table = torch.zeros(8, 7, dtype=torch.float64, device=self.device)
        self._build(policy)
        self.load(policy)

    def _build(self, policy: ScalePolicy) -> None:
        # Written with fill_ (a kernel taking the value as an argument): a copy from pageable host memory would
        # synchronise with the device.
        for column, value in enumerate((0.5, policy.growth_interval - 1.0, 2.0)):
            self._thresholds[column].fill_(value)
        for column, weight in enumerate((4, 2, 1)):
            self._weights[column].fill_(weight)
        self._table.zero_()
        hysteresis = float(policy.hysteresis)
        for index in range(8):
            overflow, grows, tolerates = index & 4, index & 2, index & 1
            row = self._table[index]
            if overflow and tolerates:  # h - 1, scale kept
                row[3 + _HYSTERESIS].fill_(-1.0)
                row[_HYSTERESIS].fill_(1.0)
                row[_FACTOR].fill_(1.0)
            elif overflow:  # back off; h = max(h - 1, 0) = 0 for h in {0, 1}
                row[_FACTOR].fill_(policy.backoff_factor)
            elif grows:
                row[3 + _HYSTERESIS].fill_(hysteresis)
                row[_FACTOR].fill_(policy.growth_factor)
            else:  # g + 1, h and scale kept
                row[_GROWTH].fill_(1.0)
                row[_HYSTERESIS].fill_(1.0)
                row[3 + _GROWTH].fill_(1.0)
                row[_FACTOR].fill_(1.0)

    def load(self, policy: ScalePolicy) -> None:
        """Copy the host policy's trackers (and constants, if they changed) to the device."""
        if _constants(policy) != self._key:
            self._key = _constants(policy)
            self._build(policy)
        self.state[_GROWTH].fill_(float(policy.growth_tracker))
        self.state[_HYSTERESIS].fill_(float(policy.hysteresis_tracker))

    def advance(self, scale: Tensor, found_inf: Tensor, policy: ScalePolicy) -> None:
        """One step of the policy with ``found_inf`` (0.0 or 1.0, on the device): updates ``scale`` in place."""
        state = self.state
        state[_FLAG : _FLAG + 1].copy_(found_inf.reshape(1))
        bits = torch.ge(state, self._thresholds)
        index = (bits * self._weights).sum(0, keepdim=True)
        row = torch.index_select(self._table, 0, index)[0]
        torch.addcmul(row[_ADD], state, row[_MULT], out=state)
        # float64 product rounded once to float32 by the copy, as the host's f32(scale * factor); clamping before the
        # rounding gives the same number, because the bounds are float32 values.
        product = scale.to(torch.float64).mul_(row[_FACTOR]).clamp_(policy.min_scale, policy.max_scale)
        scale.copy_(product)


class LossScale:
    """The loss scale in one place: the policy's state and the float32 tensor a loss is multiplied by.

    The state is current in one of two places, named by :attr:`on_device`:

    * on the host (the usual case, and always on the unscale path, which reads each step's overflow flag on the host
      anyway): :attr:`policy` holds the scale and its trackers, and the tensor holds the same scale, written when the
      policy changes it (a host value written to the device: no host read);
    * on the device, after a fused step (whose overflow flag stays on the device): the tensor and the device policy's
      trackers are current and :attr:`policy` is stale, until :meth:`settle` reads them back (one host read).

    Reads (:meth:`value`, :meth:`snapshot`) never switch between the two.

    State: the host policy, the scale tensor (moved to the first device a loss is scaled on), the device policy (made
    at the first fused step) and where the state is current.

    Examples:
        >>> scale = LossScale(ScalePolicy(8.0, 2.0, 0.5, 1, 1, min_scale=1.0, max_scale=2.0**24))
        >>> scale.update(found_inf=False); scale.value()
        16.0
        >>> scale.advance(torch.tensor(1.0)); scale.on_device, scale.value(), scale.on_device
        (True, 8.0, True)
        >>> scale.settle().scale, scale.on_device
        (8.0, False)
    """

    def __init__(self, policy: ScalePolicy) -> None:
        self.policy = policy
        self.on_device = False
        self._tensor = torch.full((), policy.scale, dtype=torch.float32)
        self._placed = False
        self._device: DevicePolicy | None = None

    @property
    def device(self) -> torch.device:
        """Where the scale lives (the first device a loss was scaled on; the CPU before)."""
        return self._tensor.device

    def tensor(self, device: torch.device) -> Tensor:
        """The scale as a float32 tensor on ``device``: the first device asked keeps it, another gets a copy."""
        if not self._placed:
            self._placed = True
            self._tensor = self._tensor.to(device)
        return self._tensor if self._tensor.device == device else self._tensor.to(device, non_blocking=True)

    def value(self) -> float:
        """The scale now, as a Python float (a host read when the state is on the device)."""
        return float(self._tensor.item()) if self.on_device else self.policy.scale

    def snapshot(self) -> ScalePolicy:
        """A copy of the policy as it is now (the device's state read into it when it is current there)."""
        if not self.on_device:
            return ScalePolicy(**vars(self.policy))
        assert self._device is not None
        scale, growth, hysteresis = torch.cat([self._tensor.double().reshape(1), self._device.state[1:]]).tolist()
        copy = ScalePolicy(**vars(self.policy))
        copy.scale, copy.growth_tracker, copy.hysteresis_tracker = scale, int(growth), int(hysteresis)
        return copy

    def settle(self) -> ScalePolicy:
        """Make the host policy current (one host read if the device's state was) and return it."""
        if self.on_device:
            self.policy, self.on_device = self.snapshot(), False
        return self.policy

    def update(self, found_inf: bool) -> None:
        """One step of the policy on the host, from an overflow flag known there."""
        policy = self.settle()
        if policy.min_scale != policy.max_scale and policy.update(found_inf):  # equal bounds: a fixed scale
            self._tensor.fill_(policy.scale)  # no host read: a host value written to the device

    def advance(self, found_inf: Tensor) -> None:
        """One step of the policy on the device, from a flag on the device (1.0 on overflow, else 0.0): no host read."""
        if self.policy.min_scale != self.policy.max_scale:  # equal bounds: a fixed scale
            self._to_device().advance(self._tensor, found_inf.to(self._tensor.device), self.policy)

    def step_values(self) -> Tensor:
        """``[scale, hysteresis tracker]`` in float32 on the scale's device, for a fused step's record: no host read."""
        state = self._to_device().state
        return torch.cat([self._tensor.reshape(1), state[_HYSTERESIS:].float()])

    def _to_device(self) -> DevicePolicy:
        """Make the device's state current (the host's trackers written there: no host read) and return its policy."""
        if self._device is None or self._device.device != self._tensor.device:
            self._device = DevicePolicy(self.policy, self._tensor)
        elif not self.on_device:
            self._device.load(self.policy)
        self.on_device = True
        return self._device

    def backs_off(self, scale: float, hysteresis_tracker: float) -> bool:
        """Whether an overflow at that scale and tracker lowers the scale (else the skip it causes is stuck)."""
        return self.policy.backs_off_at(scale, hysteresis_tracker)

    def stall(self, scale: float | None) -> Stall:
        """Why skips at ``scale`` are stuck, and what to try (for the diagnosis that stops a run)."""
        policy = self.policy
        scale = policy.scale if scale is None else scale
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
        policy = self.snapshot()
        return {
            "scale": policy.scale,
            "growth_factor": policy.growth_factor,
            "backoff_factor": policy.backoff_factor,
            "growth_interval": policy.growth_interval,
            "_growth_tracker": policy.growth_tracker,
            "hysteresis": policy.hysteresis,
            "_hysteresis_tracker": policy.hysteresis_tracker,
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
        policy = self.settle()
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

    def set(self, scale: float, growth_tracker: int | None = None, hysteresis_tracker: int | None = None) -> None:
        """Set the scale (and the trackers, when given), on the host."""
        policy = self.settle()
        policy.scale = f32(scale)
        if growth_tracker is not None:
            policy.growth_tracker = growth_tracker
        if hysteresis_tracker is not None:
            policy.hysteresis_tracker = hysteresis_tracker
        self._tensor.fill_(policy.scale)

    def reconfigure(self, **constants: float) -> None:
        """Change the policy's constants (``growth_factor=...``), on the host."""
        policy = self.settle()
        for name, value in constants.items():
            setattr(policy, name, value)

    def __getstate__(self) -> dict[str, object]:
        """Pickled with the host policy current and the tensor on the CPU (placed again at the first use)."""
        return {"policy": self.snapshot()}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["policy"])  # type: ignore[misc]
