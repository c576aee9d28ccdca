"""Where ``MixedPrecisionMonitor`` learns about each optimizer step: chosen once, when training starts.

This package's plugins record every optimizer step's :class:`~lightning_amp_plus.step.engine.StepResult` in their
engine (:class:`EngineSteps`); under Lightning's own plugins the monitor sees each step in ``on_before_optimizer_step``
and reads a ``GradScaler``'s skips off its scale (:class:`ScaleReadSteps`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import lightning.pytorch as pl
from torch import Tensor

from lightning_amp_plus.step.engine import PendingStep, StepEngine, StepResult
from lightning_amp_plus.step.sharding import local_view
from lightning_amp_plus.weights.compensated import per_model_parameter

__all__ = ["EngineSteps", "ScaleReadSteps", "StepSource", "source_for"]


class StepSource(Protocol):
    """Where the monitor learns about each optimizer step (chosen once, when training starts)."""

    guarded: bool
    """Whether something checks each step's gradients and skips the step on inf/NaN."""

    def floor(self) -> float | None:
        """The loss scale's floor, if known."""

    def skips_so_far(self) -> int:
        """Skips counted before training started (restored from a checkpoint)."""

    def begin_batch(self) -> None:
        """A training batch starts."""

    def before_step(self) -> None:
        """An optimizer step is about to run (``on_before_optimizer_step``)."""

    def take(self) -> list[StepResult]:
        """The steps taken since the last call, in order."""

    def notes(self, params: Sequence[Tensor] = ()) -> list[str]:
        """What the summary should say about how the steps were taken (compensated weights), if anything.

        ``params``: the model's parameters, frozen ones included (none if the model is not known).
        """


class EngineSteps:
    """The package's plugins: the engine records every optimizer step's result (nothing is read off the scale)."""

    def __init__(self, plugin: Any, *, from_first: bool = False) -> None:
        self._plugin = plugin
        self.engine: StepEngine = plugin.engine
        self.engine.read_norms()  # the monitor reads each step's norm: measured from here on (else none is)
        self.guarded = self.engine.check
        # The Trainer's monitor starts with the run; a Fabric loop's first observe() comes after its first step.
        recent = self.engine.log.recent
        self._next = 0 if not recent else (recent[0].index if from_first else recent[-1].index + 1) or 0

    def floor(self) -> float | None:
        """The loss scale's floor, if known."""
        scale = self.engine.loss_scale
        return None if scale is None else scale.policy.min_scale

    def skips_so_far(self) -> int:
        """Skips counted before training started (restored from a checkpoint)."""
        return self.engine.skipped_steps - sum(result.skipped for result in self._since())

    def begin_batch(self) -> None:
        """A training batch starts."""
        pass

    def before_step(self) -> None:
        """An optimizer step is about to run (``on_before_optimizer_step``)."""
        pass

    def take(self) -> list[StepResult]:
        """The steps taken since the last call, in order."""
        steps = self._since()
        if steps:
            self._next = (steps[-1].index or 0) + 1  # consumed: never reported twice
        return steps

    def _since(self) -> list[StepResult]:
        """The engine's results numbered ``_next`` and later, oldest first."""
        # A fused step's values are read here: the monitor reads every step's norm (a reader, by its own choice).
        recent = self.engine.log.recent
        return [_read(result) for result in recent if (result.index or 0) >= self._next]

    def notes(self, params: Sequence[Tensor] = ()) -> list[str]:
        """What the summary should say about how the steps were taken (compensated weights), if anything.

        The bytes are given per trainable parameter (those the optimizers train) and, when the model's ``params`` are
        known, per model parameter (frozen ones included): two named figures, so that neither changes meaning with
        what the optimizer was handed.
        """
        compensators = getattr(self._plugin, "compensators", None)
        footprints = [] if compensators is None else compensators.footprints()
        if compensators is None or not footprints:
            return []
        trainable = sum(f.parameters for f in footprints)
        per_trainable = sum(f.weights + f.compensation + f.states for f in footprints) / max(trainable, 1)
        said = f"{per_trainable:.1f} bytes per trainable parameter"
        if params:
            total = sum(local_view(p).numel() for p in {id(p): p for p in params}.values())
            per_model = per_model_parameter(params, footprints)
            said += f" and {per_model:.1f} per model parameter ({trainable:,} of {total:,} parameters train)"
        return [
            f"bf16 weights compensated ({compensators.method}): weights, compensation and optimizer state hold " + said
        ]


class ScaleReadSteps:
    """Lightning's own plugins: each step is seen before it runs; a ``GradScaler``'s skip shows as a scale backoff."""

    def __init__(self, trainer: pl.Trainer | None) -> None:
        self._trainer = trainer
        self.guarded = trainer is not None and trainer.scaler is not None
        self._scales: list[float | None] = []

    def floor(self) -> float | None:
        """The loss scale's floor, if known."""
        return None

    def skips_so_far(self) -> int:
        """Skips counted before training started (restored from a checkpoint)."""
        return 0  # a GradScaler does not count them

    def begin_batch(self) -> None:
        """A training batch starts."""
        self._scales.clear()

    def before_step(self) -> None:
        """An optimizer step is about to run (``on_before_optimizer_step``)."""
        scaler = None if self._trainer is None else self._trainer.scaler
        self._scales.append(None if scaler is None else float(scaler.get_scale()))

    def take(self) -> list[StepResult]:
        """The steps taken since the last call, in order."""
        scales, self._scales = self._scales, []
        scaler = None if self._trainer is None else self._trainer.scaler
        if scaler is None or not scales:
            return [StepResult(skipped=False, index=i) for i in range(len(scales))]
        # torch.amp.GradScaler backs the scale off exactly when it skipped a step, and Lightning's plugin updates it
        # after every optimizer step: each step's outcome is the scale the next one (or the batch's end) sees.
        after = [*scales[1:], float(scaler.get_scale())]
        return [
            StepResult(
                skipped=before is not None and next_scale is not None and next_scale < before,
                scale=before,
                grad_norm=None,
                index=i,
                optimizer=i,
            )
            for i, (before, next_scale) in enumerate(zip(scales, after, strict=True))
        ]

    def notes(self, params: Sequence[Tensor] = ()) -> list[str]:
        """What the summary should say about how the steps were taken (compensated weights), if anything."""
        return []


def source_for(plugin: Any, trainer: pl.Trainer) -> StepSource:
    """The source for ``plugin``: its engine's records if it has one, else what ``trainer``'s scaler shows."""
    return EngineSteps(plugin) if isinstance(getattr(plugin, "engine", None), StepEngine) else ScaleReadSteps(trainer)


def _read(step: StepResult | PendingStep) -> StepResult:
    return step.result if isinstance(step, PendingStep) else step
