"""``MixedPrecisionMonitor``: the loss scale, skipped steps, non-finite values and memory at every step."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_amp_plus import _memory
from lightning_amp_plus.numerics.checks import check_bool, check_int, check_real
from lightning_amp_plus.numerics.grads import nonfinite_names
from lightning_amp_plus.numerics.sharding import local_view
from lightning_amp_plus.precision import MixedPrecisionPlugin, OptimizerStep, skipped_steps
from lightning_amp_plus.report import AmpHistory, StepRecord, check_chart_path, summary, write_chart

__all__ = ["MixedPrecisionMonitor"]

_POLICIES = ("warn", "raise", "stop")


class MixedPrecisionMonitor(Callback):
    """Report the loss scale, skipped steps, gradient norm, non-finite values and memory at every optimizer step.

    Logged with Lightning's ``self.log`` (so TensorBoard, CSV, W&B... all receive them), on rank zero only, on the steps
    Lightning writes to its loggers (``Trainer(log_every_n_steps=...)``; between them only a changed loss scale goes
    to the progress bar, since each ``self.log`` call costs about a millisecond). Every step is still recorded in
    :attr:`history` for the summary and the chart:

    * ``amp/loss_scale``: the scale this step's gradients were scaled by (absent without a scaler).
    * ``amp/skipped_steps`` (total so far) and ``amp/step_skipped`` (1.0 when a step of this batch was skipped).
    * ``amp/grad_norm``: the global norm of the unscaled gradients, taken from the scaler's own pass (only under
      ``MixedPrecisionPlugin``, which measures it anyway; never recomputed). When several optimizers step in one
      batch (manual optimization), it is the norm over all of their gradients, and ``amp/grad_norm_opt{i}`` gives
      each optimizer's own (``i``: its position in ``trainer.optimizers``).

    Every optimizer step is counted and recorded, also when several optimizers step in one batch.
    * ``amp/cuda_allocated_mb``, ``amp/cuda_reserved_mb``, ``amp/cuda_peak_mb`` (the peak within the step) on CUDA;
      on CPU ``amp/cpu_rss_mb``, the process's resident memory, instead.

    Non-finite values: every ``check_interval`` steps the monitor looks for parameters (after the step) holding inf/NaN
    and names them. Gradients are checked too when nothing else guards the step (``32-true``, or bf16 without the
    plugin's skip); under a loss scaler, non-finite gradients are ordinary overflows: the step is skipped and counted,
    and the monitor records which parameters overflowed (the scaler already knows) and warns when the skip rate over
    ``skip_window`` steps passes ``skip_warn_rate`` (the skips before the first applied step are the scale descending
    from ``init_scale`` and are not counted, unless no step is ever applied), or when the scale sits at its floor. A
    finding is handled by ``on_nonfinite``: ``"warn"`` names them; ``"raise"`` raises ``FloatingPointError`` naming
    them; ``"stop"`` saves a debug file (names, step, scale, model state, gradients) under ``trainer.default_root_dir``
    and ends ``fit`` gracefully; when nothing else guards the step, its non-finite gradients are dropped first, so the
    parameters stay as they were.

    At the end of ``fit`` a one-paragraph summary is printed (steps, skips and rate, scale range, first and last
    overflow, peak memory, non-finite events) and, with ``report_path``, a PNG chart is written (needs matplotlib:
    ``pip install 'lightning-amp-plus[report]'``).

    Works with ``MixedPrecisionPlugin``, Lightning's ``MixedPrecision`` (its ``torch.amp.GradScaler``: a skip shows as a
    scale backoff) and plain ``32-true`` (then it reports what applies).

    Args:
        check_interval: check parameters (and unguarded gradients) every this many optimizer steps (at least 1).
        on_nonfinite: ``"warn"``, ``"raise"`` or ``"stop"``.
        skip_window: how many recent steps the skip rate is taken over.
        skip_warn_rate: warn when the skip rate over the window exceeds this fraction.
        log_memory: log memory every step.
        prog_bar: show the loss scale on the progress bar.
        report_path: where to write the PNG chart at the end of ``fit`` (``None``: no chart); a ``.png`` path in a
            folder that can be written or created, checked at construction.

    Example:
        >>> from lightning import Trainer
        >>> monitor = MixedPrecisionMonitor(check_interval=10, on_nonfinite="stop")
        >>> trainer = Trainer(callbacks=[monitor], logger=False, enable_progress_bar=False)
    """

    # Its on_before_optimizer_step reads gradients only where no scaler checks them: a fused optimizer under our
    # plugin may keep them scaled for its own kernel (see MixedPrecisionPlugin).
    reads_unscaled_gradients = False

    def __init__(
        self,
        *,
        check_interval: int = 1,
        on_nonfinite: Literal["warn", "raise", "stop"] = "warn",
        skip_window: int = 100,
        skip_warn_rate: float = 0.05,
        log_memory: bool = True,
        prog_bar: bool = True,
        report_path: str | Path | None = None,
    ) -> None:
        name = type(self).__name__
        # No 0 ("never"): the summary would then report "no non-finite values found" about values nobody looked at.
        check_interval = check_int(
            name,
            "check_interval",
            check_interval,
            1,
            hint=": 1 checks after every step, N after every Nth (e.g. 100, to read the device less often)",
        )
        if on_nonfinite not in _POLICIES:
            raise ValueError(f"`{name}(on_nonfinite={on_nonfinite!r})` must be one of {_POLICIES}.")
        skip_window = check_int(name, "skip_window", skip_window, 1, hint=", e.g. 100")
        skip_warn_rate = check_real(
            name, "skip_warn_rate", skip_warn_rate, "a fraction in [0, 1], e.g. 0.05", lambda rate: 0 <= rate <= 1
        )
        check_bool(name, "log_memory", log_memory)
        check_bool(name, "prog_bar", prog_bar)
        self.check_interval = check_interval
        self.on_nonfinite = on_nonfinite
        self.skip_window = skip_window
        self.skip_warn_rate = skip_warn_rate
        self.log_memory = log_memory
        self.prog_bar = prog_bar
        # Checked now, before any training: a chart that cannot be written must not cost a whole run.
        self.report_path = None if report_path is None else check_chart_path(report_path)
        self.history = AmpHistory()
        """Every step's record and the non-finite events: what the summary and the chart are made from."""
        self.debug_path: Path | None = None
        """The file the ``"stop"`` policy saved, once it has."""
        self._recent: deque[bool] = deque(maxlen=skip_window)
        self._applied_yet = False
        self._skips_seen = 0
        self._first_step = 0
        self._scales_before: list[float | None] = []
        self._floor_warned = False
        self._cpu_memory_said = False
        self._log_this_step = True
        self._bar_scale: float | None = None
        self._stopping = False
        self._named: list[tuple[str, torch.Tensor]] = []

    # ------------------------------------------------------------------------------------------------- the step
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.history = AmpHistory(memory_kind="CUDA memory" if self._on_cuda(trainer) else "process memory")
        self._recent.clear()
        self._applied_yet = False
        # Our plugin's count is a total since the first run, restored from checkpoints: new skips are what it adds.
        # Another plugin's skips (None: it does not count them) are counted here from 0, off the scale.
        self._skips_seen = skipped_steps(trainer) or 0
        self._floor_warned = False
        self._stopping = False
        # Walking the module tree every step costs more than the check itself: the parameters are fixed during fit.
        self._named = list(pl_module.named_parameters())

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._scales_before.clear()
        plugin = trainer.precision_plugin
        self._first_step = plugin.steps_taken if isinstance(plugin, MixedPrecisionPlugin) else 0
        self._log_this_step = _logs_this_step(trainer)
        if self._log_this_step and self.log_memory and self._on_cuda(trainer):
            _memory.reset_cuda_peak(trainer.strategy.root_device)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        # Once per optimizer step (several per batch under manual optimization): the scale its gradients carry. Our
        # plugin records it with the step (read here, it would cost a fused optimizer's step a host read).
        ours = isinstance(trainer.precision_plugin, MixedPrecisionPlugin)
        self._scales_before.append(None if ours or trainer.scaler is None else float(trainer.scaler.get_scale()))
        if self._checking(trainer) and not self._guarded(trainer):
            named = [(n, p.grad) for n, p in self._named if p.grad is not None]
            self._found(trainer, pl_module, "gradients", nonfinite_names(named), trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        steps = self._steps_of_this_batch(trainer)
        if not steps:
            return  # an accumulating micro-batch: no optimizer step to report
        memory = self._memory(trainer) if self.log_memory and self._log_this_step else {}
        self._log(pl_module, steps, memory)
        peak = memory.get("cuda_peak_mb", memory.get("cpu_rss_mb"))
        # global_step counts every optimizer step, skipped or not
        self._record(trainer, steps, trainer.global_step - len(steps), peak)
        if self._checking(trainer) and not self._stopping:
            self._found(trainer, pl_module, "parameters", nonfinite_names(self._named), trainer.global_step - 1)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A step that stopped the run (the scaler's skip limit) never reached on_train_batch_end: record it too, so the
        # history (and the summary made of it) holds every step taken.
        steps = self._steps_of_this_batch(trainer) if isinstance(trainer.precision_plugin, MixedPrecisionPlugin) else []
        self._record(trainer, steps, trainer.global_step, None)

    def _record(self, trainer: pl.Trainer, steps: list[OptimizerStep], first: int, peak: float | None) -> None:
        for offset, step in enumerate(steps):
            index = first + offset
            self.history.steps.append(StepRecord(index, step.scale, step.skipped, step.grad_norm, peak))
            if step.overflow_params:
                self.history.nonfinite_events.append((index, "overflowed gradients", list(step.overflow_params)))
            self._watch_skips(trainer)

    def _steps_of_this_batch(self, trainer: pl.Trainer) -> list[OptimizerStep]:
        """Every optimizer step this batch took, in order: from our plugin's own record, or read off the scale."""
        plugin = trainer.precision_plugin
        if isinstance(plugin, MixedPrecisionPlugin):
            steps = [step for step in plugin.recent_steps if step.index >= self._first_step]
            self._first_step = plugin.steps_taken  # consumed: never reported twice
            self._skips_seen += sum(step.skipped for step in steps)
            return steps
        scales = self._scales_before
        if trainer.scaler is None or not scales:
            return [OptimizerStep(i, i, None, False, None) for i in range(len(scales))]
        # torch.amp.GradScaler backs the scale off exactly when it skipped a step, and Lightning's plugin updates it
        # after every optimizer step: each step's outcome is the scale the next one (or the batch's end) sees.
        after = [*scales[1:], float(trainer.scaler.get_scale())]
        steps = [
            OptimizerStep(i, i, before, next_scale is not None and before is not None and next_scale < before, None)
            for i, (before, next_scale) in enumerate(zip(scales, after, strict=True))
        ]
        self._skips_seen += sum(step.skipped for step in steps)
        return steps

    # ----------------------------------------------------------------------------------------------- the end
    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        print(summary(self.history))
        if self.report_path is not None:
            write_chart(self.history, self.report_path)
            print(f"MixedPrecisionMonitor: chart written to {self.report_path}")

    # -------------------------------------------------------------------------------------------------- helpers
    def _log(self, pl_module: pl.LightningModule, steps: list[OptimizerStep], memory: dict[str, float]) -> None:
        # `self.log` costs about a millisecond a call, so the metrics are logged only on the steps Lightning writes
        # to its loggers; between them only a changed loss scale is logged, for the progress bar.
        scale = steps[0].scale  # one scale per batch: the scaler updates once for all of the batch's steps
        metrics: dict[str, float] = {}
        if scale is not None and (self._log_this_step or (self.prog_bar and scale != self._bar_scale)):
            metrics["amp/loss_scale"] = self._bar_scale = scale
        if self._log_this_step:
            metrics["amp/skipped_steps"] = float(self._skips_seen)
            metrics["amp/step_skipped"] = float(any(step.skipped for step in steps))
            norms = [step.grad_norm for step in steps if step.grad_norm is not None]
            if norms:
                # Over every optimizer step of the batch (their parameters are disjoint): the norm of all gradients.
                metrics["amp/grad_norm"] = math.sqrt(sum(norm * norm for norm in norms))
            if len({step.optimizer for step in steps}) > 1:
                for step in steps:
                    if step.grad_norm is not None:
                        metrics[f"amp/grad_norm_opt{step.optimizer}"] = step.grad_norm
            metrics.update({f"amp/{key}": value for key, value in memory.items()})
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, rank_zero_only=True,
                          prog_bar=self.prog_bar and key == "amp/loss_scale")  # fmt: skip

    @staticmethod
    def _on_cuda(trainer: pl.Trainer) -> bool:
        return trainer.strategy.root_device.type == "cuda"

    def _checking(self, trainer: pl.Trainer) -> bool:
        # global_step counts finished steps: inside the step it is the index of the step being taken.
        return self.check_interval > 0 and trainer.global_step % self.check_interval == 0

    def _guarded(self, trainer: pl.Trainer) -> bool:
        """Whether something already checks this step's gradients and skips it on inf/NaN."""
        plugin = trainer.precision_plugin
        if isinstance(plugin, MixedPrecisionPlugin):
            return plugin.skip_nonfinite
        return trainer.scaler is not None

    def _watch_skips(self, trainer: pl.Trainer) -> None:
        last_skipped = self.history.steps[-1].skipped
        if not self._applied_yet and not last_skipped:
            # The skips before the first applied step were the scale finding its level from `init_scale`: not a
            # problem. A run that never applies a step keeps them, and its window fills with skips.
            self._applied_yet = True
            self._recent.clear()
        self._recent.append(last_skipped)
        window = len(self._recent)
        if window == self.skip_window and sum(self._recent) / window > self.skip_warn_rate:
            rank_zero_warn(
                f"MixedPrecisionMonitor: {sum(self._recent)} of the last {window} optimizer steps were skipped for "
                f"non-finite gradients (more than {self.skip_warn_rate:.0%}); last overflowing parameters: "
                f"{self.history.nonfinite_events[-1][2] if self.history.nonfinite_events else 'unknown'}. If it "
                "persists, lower the learning rate, clip gradients, or check the data for inf/NaN.",
                category=RuntimeWarning,
            )
            self._recent.clear()  # warn at most once per window
        plugin = trainer.precision_plugin
        floor = plugin.min_scale if isinstance(plugin, MixedPrecisionPlugin) else None
        last = self.history.steps[-1]
        # Only a step skipped at the floor shows gradients overflowing unscaled (a scale may start at its floor).
        at_floor = floor is not None and last.scale is not None and last.scale <= floor
        if at_floor and last.skipped and not self._floor_warned:
            self._floor_warned = True
            rank_zero_warn(
                f"MixedPrecisionMonitor: the loss scale has reached its floor (min_scale={floor:g}) at step "
                f"{last.step}: gradients overflow even without scaling.",
                category=RuntimeWarning,
            )

    def _memory(self, trainer: pl.Trainer) -> dict[str, float]:
        if self._on_cuda(trainer):
            return _memory.cuda_memory_mb(trainer.strategy.root_device)
        if not self._cpu_memory_said:
            self._cpu_memory_said = True
            rank_zero_info(
                "MixedPrecisionMonitor: not on CUDA, so it reports the process's resident memory (amp/cpu_rss_mb) "
                "instead of CUDA memory."
            )
        return {"cpu_rss_mb": _memory.process_rss_mb()}

    def _found(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, kind: str, names: list[str], step: int
    ) -> None:
        if not names:
            return
        self.history.nonfinite_events.append((step, kind, names))
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        message = f"MixedPrecisionMonitor: non-finite {kind} at step {step}: {shown}."
        if self.on_nonfinite == "raise":
            raise FloatingPointError(message + " (on_nonfinite='raise')")
        if self.on_nonfinite == "stop":
            self.debug_path = self._save_debug(trainer, pl_module, kind, names)
            trainer.should_stop = True
            self._stopping = True
            if kind == "gradients":
                # Nothing else guards this step: drop its gradients so the optimizer leaves the parameters alone.
                for _, param in self._named:
                    param.grad = None
            rank_zero_warn(f"{message} Training stops; what you need to debug it is in {self.debug_path}.")
            return
        rank_zero_warn(message)

    def _save_debug(self, trainer: pl.Trainer, pl_module: pl.LightningModule, kind: str, names: list[str]) -> Path:
        path = Path(trainer.default_root_dir) / f"amp_nonfinite_step{trainer.global_step}.pt"
        # On every rank: under FSDP the module's state_dict() is a collective; rank zero alone would wait forever.
        state = {key: local_view(value).detach().cpu() for key, value in pl_module.state_dict().items()}
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            grads = {n: local_view(p.grad).detach().cpu() for n, p in self._named if p.grad is not None}
            torch.save(
                {
                    "global_step": trainer.global_step,
                    "kind": kind,
                    "names": names,
                    "loss_scale": None if trainer.scaler is None else float(trainer.scaler.get_scale()),
                    "state_dict": state,
                    "grads": grads,
                    "history": [asdict(record) for record in self.history.steps[-100:]],
                },
                path,
            )
        return path


def _logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this training step's metrics to its loggers (``log_every_n_steps``, or stopping).

    Asked the way Lightning's own ``LearningRateMonitor`` asks it; outside a running loop the answer is yes.
    """
    connector = getattr(trainer, "_logger_connector", None)
    return True if connector is None else bool(connector.should_update_logs)
