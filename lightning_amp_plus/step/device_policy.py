"""The loss-scale policy run on the device, from an overflow flag the host has not read.

On the fused-optimizer path the step's overflow flag is a device tensor handed to the optimizer, and reading it on the
host would stall the device every step. The next ``scale()`` still needs the next scale on the device, so the rules of
:class:`~.policy.ScalePolicy` run there too, as a table lookup: the flag and the two trackers are
compared against thresholds, the three bits pick one of the policy's four transitions from a small table, and one
multiply-add applies it (about ten tiny kernels, no host read, no branch). The host replays the same rules from the
flags when it reads them (see ``DynamicLossScaler``), and both give the same numbers bit for bit: the trackers are
exact integers in float64, and the scale is multiplied in float64 and rounded once to float32, as the host does.

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

import torch
from torch import Tensor

from lightning_amp_plus.step.policy import ScalePolicy

__all__ = ["DevicePolicy"]

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
