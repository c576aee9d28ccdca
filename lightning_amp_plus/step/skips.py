"""Why a run of skipped steps cannot make progress, in words: what the diagnosis that stops such a run says.

A skip that backing off the loss scale could not help (the scale at its floor, a backoff factor of 1, an overflow the
hysteresis tolerates, no loss scale at all, or a spike the guard skips) is *stuck*; the step engine counts them and,
at ``max_consecutive_skips`` in a row, raises ``FloatingPointError`` with :func:`diagnosis`.

Examples:
    >>> print(diagnosis(stuck=3, skipped=5, limit=3, names=["fc.weight"], verdict=None, stall=BF16_STALL))
    ... # doctest: +NORMALIZE_WHITESPACE
    Training cannot make progress: 3 optimizer steps in a row were skipped for non-finite gradients (5 skipped in
    all); non-finite gradients in 1 parameter(s): fc.weight. The model produces inf/NaN gradients. Try: check the
    inputs and the loss for inf/NaN, lower the learning rate, or clip gradients. To keep going anyway, raise
    `max_consecutive_skips` (now 3) or set it to None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_amp_plus.step.spikes import SpikeVerdict

__all__ = ["BF16_STALL", "SPIKE_STALL", "Stall", "diagnosis"]

_NAMES_SHOWN = 10


@dataclass(frozen=True)
class Stall:
    """Why a run of stuck skips happened: what stood still, why, and what to try."""

    what: str
    why: str
    fix: str


BF16_STALL = Stall(
    "for non-finite gradients",
    "The model produces inf/NaN gradients.",
    "check the inputs and the loss for inf/NaN, lower the learning rate, or clip gradients",
)
"""Why a check without a loss scale (bf16) stalls: nothing but the model can make the gradients finite."""

SPIKE_STALL = Stall(
    "as gradient-norm spikes (SpikeGuard, action='skip')",
    "The gradient norm rose and stayed above the guard's limit: a skipped spike never enters the running statistics, "
    "so after a lasting rise (a new phase of the data, a learning-rate restart) every step is judged a spike.",
    "SpikeGuard(action='clip'), whose clipped steps enter the statistics and so follow a lasting rise, or a higher "
    "`threshold`",
)
"""Why a run of spike skips stalls: the guard's statistics cannot follow a lasting rise it keeps skipping."""


def diagnosis(
    *,
    stuck: int,
    skipped: int,
    limit: int | None,
    names: list[str] | None,
    verdict: SpikeVerdict | None,
    stall: Stall,
) -> str:
    """The message that stops the run: the gradients at fault, what stood still and why, and what to try.

    Args:
        stuck: stuck skips in a row.
        skipped: skips in all.
        limit: ``max_consecutive_skips``.
        names: the last skipped step's non-finite gradients (``None``: not looked up, on the fused path).
        verdict: the spike guard's verdict on the last skipped step, if it skipped a spike.
        stall: why such skips are stuck.
    """
    if verdict is not None:
        where = (
            f"the last gradient norm, {verdict.norm:.4g}, was above the guard's limit {verdict.threshold_norm:.4g} "
            f"(mean {verdict.mean:.4g} + threshold x std {verdict.std:.4g} of the steps taken)"
        )
    elif names:
        more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
        where = f"non-finite gradients in {len(names)} parameter(s): {', '.join(names[:_NAMES_SHOWN])}{more}"
    elif names is None:
        where = (
            "the fused optimizer skipped on the device, where the non-finite gradients are not named (they are when "
            "something reads the gradient norms: a MixedPrecisionMonitor, or unscale_ before the step)"
        )
    else:
        where = (
            "no gradient in this process is non-finite (the inf/NaN was on another rank, or the gradients' global L2 "
            "norm overflows float32)"
        )
    return (
        f"Training cannot make progress: {stuck} optimizer steps in a row were skipped {stall.what} "
        f"({skipped} skipped in all); {where}. {stall.why} Try: {stall.fix}. To keep going anyway, raise "
        f"`max_consecutive_skips` (now {limit}) or set it to None."
    )
