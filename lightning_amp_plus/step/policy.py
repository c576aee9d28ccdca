"""The loss-scale policy: a small state machine over plain Python numbers.

Kept apart from the code that touches gradients (as Megatron-LM's ``DynamicGradScaler`` is) so that it can be read and
tested on its own. It runs on the host whenever the step's overflow flag is known there (the unscale path reads it
back to decide the skip, so deciding the next scale there costs nothing); the device copy of the scale is then written
only when the scale changes. On the fused-optimizer path the flag stays on the device, and
:mod:`lightning_amp_plus.step.device_policy` runs the same rules there; the host replays them later from the flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_amp_plus.step.float32 import f32

__all__ = ["ScalePolicy"]


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
        return self.hysteresis_tracker <= 1 and max(f32(self.scale * self.backoff_factor), self.min_scale) < self.scale

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
