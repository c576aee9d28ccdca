"""The loss-scale policy: a small state machine that lives on the device.

Kept apart from the code that touches gradients (as Megatron-LM's ``DynamicGradScaler`` is) so that it can be read and
tested on its own. Every function here is pure tensor math with no host synchronisation: ``found_inf`` is a device
tensor and the decision to grow or back off is taken with ``torch.where``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ScaleConfig", "ScaleState", "update_scale_"]


@dataclass(frozen=True)
class ScaleConfig:
    """The constants of the policy. Validation is the caller's job (see ``DynamicLossScaler``)."""

    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float
    max_scale: float


@dataclass
class ScaleState:
    """The moving parts of the policy, each a 0-d tensor on the device of the scaled loss.

    Attributes:
        scale: the current loss scale (float32).
        growth_tracker: successful steps since the last growth or overflow (int32).
        hysteresis_tracker: overflows still tolerated before the next backoff (int32); refilled to ``hysteresis`` when
            the scale grows, as in Megatron-LM, so that sporadic overflows do eventually back the scale off.
    """

    scale: Tensor
    growth_tracker: Tensor
    hysteresis_tracker: Tensor

    @classmethod
    def create(cls, init_scale: float, hysteresis: int, device: torch.device | str = "cpu") -> ScaleState:
        """Build a fresh state on ``device``."""
        return cls(
            scale=torch.full((), init_scale, dtype=torch.float32, device=device),
            growth_tracker=torch.zeros((), dtype=torch.int32, device=device),
            hysteresis_tracker=torch.full((), hysteresis, dtype=torch.int32, device=device),
        )

    def to(self, device: torch.device) -> ScaleState:
        """Return the state moved to ``device`` (a no-op when it is already there)."""
        return ScaleState(self.scale.to(device), self.growth_tracker.to(device), self.hysteresis_tracker.to(device))


def update_scale_(state: ScaleState, found_inf: Tensor, config: ScaleConfig) -> None:
    """Advance the policy by one step, in place and without a host sync.

    On an overflow the hysteresis tracker is decremented and, once it reaches zero, the scale is multiplied by
    ``backoff_factor`` (never below ``min_scale``). On a clean step the growth tracker counts up and, every
    ``growth_interval`` clean steps in a row, the scale is multiplied by ``growth_factor`` (never above ``max_scale``)
    and the hysteresis tracker is refilled. With ``hysteresis=1`` this is exactly ``torch.amp.GradScaler``'s policy.

    Args:
        state: the tensors to update in place.
        found_inf: a tensor that is non-zero when any gradient of this step was non-finite.
        config: the policy's constants.

    Example:
        >>> cfg = ScaleConfig(2.0, 0.5, 2, hysteresis=1, min_scale=1.0, max_scale=2.0**24)
        >>> st = ScaleState.create(8.0, hysteresis=1)
        >>> for inf in (0.0, 0.0, 1.0):
        ...     update_scale_(st, torch.tensor(inf), cfg)
        >>> st.scale.item()
        8.0
    """
    overflow = found_inf.to(device=state.scale.device) > 0
    hysteresis_left = state.hysteresis_tracker - 1
    backoff = overflow & (hysteresis_left <= 0)
    grown_count = state.growth_tracker + 1
    grow = ~overflow & (grown_count >= config.growth_interval)

    backed_off = torch.clamp(state.scale * config.backoff_factor, min=config.min_scale)
    grown = torch.clamp(state.scale * config.growth_factor, max=config.max_scale)
    new_scale = torch.where(backoff, backed_off, torch.where(grow, grown, state.scale))

    zero = torch.zeros_like(state.growth_tracker)
    new_growth = torch.where(overflow | grow, zero, grown_count)
    refill = torch.full_like(state.hysteresis_tracker, config.hysteresis)
    new_hysteresis = torch.where(
        overflow, torch.clamp(hysteresis_left, min=0), torch.where(grow, refill, state.hysteresis_tracker)
    )

    state.scale.copy_(new_scale)
    state.growth_tracker.copy_(new_growth)
    state.hysteresis_tracker.copy_(new_hysteresis)
