"""``MixedPrecisionMonitor``: the loss scale, skipped steps, non-finite values and memory at every step.

A Trainer callback, and the same readings for Fabric and plain loops through :meth:`MixedPrecisionMonitor.observe`.
Where the steps come from is decided once, when training starts: this package's plugins record every optimizer step's
:class:`~lightning_amp_plus.numerics.outcome.StepResult` (``_EngineSteps``); under Lightning's own plugins the monitor
sees each step in ``on_before_optimizer_step`` and reads a ``GradScaler``'s skips off its scale (``_ScaleReadSteps``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal, Protocol

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_amp_plus import _memory
from lightning_amp_plus.numerics.autopsy import Autopsy, run_autopsy
from lightning_amp_plus.numerics.checks import check_bool, check_int, check_real
from lightning_amp_plus.numerics.engine import StepEngine
from lightning_amp_plus.numerics.grads import nonfinite_names
from lightning_amp_plus.numerics.headroom import LayerHeadroom, measure_headroom
from lightning_amp_plus.numerics.outcome import StepResult
from lightning_amp_plus.numerics.replay import RngState
from lightning_amp_plus.numerics.sharding import is_dtensor, local_view
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
    * ``amp/grad_norm``: the global norm of the unscaled gradients, taken from the plugin's own check (only under this
      package's plugins, which measure it anyway; never recomputed). When several optimizers step in one batch (manual
      optimization), it is the norm over all of their gradients, and ``amp/grad_norm_opt{i}`` gives each optimizer's
      own (``i``: its position in ``trainer.optimizers``).
    * ``amp/cuda_allocated_mb``, ``amp/cuda_reserved_mb``, ``amp/cuda_peak_mb`` (the peak within the step) on CUDA;
      on CPU ``amp/cpu_rss_mb``, the process's resident memory, instead.

    Every optimizer step is counted and recorded, also when several optimizers step in one batch.

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

    **Autopsy** (``autopsy=True``, under this package's plugins): when a step is skipped for non-finite gradients, the
    monitor replays that batch once with hooks (same parameters, same random numbers; nothing of the replay is left
    behind: the run ends as it would without) and says where the first inf/NaN came from and why
    (:class:`~lightning_amp_plus.numerics.autopsy.Autopsy` in :attr:`autopsies`: ``"forward"``, an output that no
    loss scale can keep finite; ``"scale"``, gradients finite at a lower scale; ``"backward"``, non-finite even at the
    scale's floor), at most ``autopsy_limit`` per run (a cause found again is said once). Healthy steps pay only a
    random-state snapshot (about 2 us).
    Skips while the scale first comes down from ``init_scale`` (before the first applied step) are routine: no
    autopsy is made for a finite loss then, and none of kind ``"scale"`` is reported or counted; the other kinds are
    always reported. Replayed: the last micro-batch's ``training_step`` (its ``self.log`` calls silenced), under
    automatic optimization, on rank zero, unsharded models.

    **Headroom** (``headroom_interval=N``): every N optimizer steps one FP32 replay of the batch reads, per layer,
    how far activations stay from each format's largest value and how many gradient values the half dtype flushes to
    zero or makes subnormal at the current scale (:attr:`headroom`), logged as ``amp/headroom/<layer>/...``, drawn
    in the chart and summarised at the end.

    At the end of ``fit`` a one-paragraph summary is printed (steps, skips and rate, scale range, first and last
    overflow, peak memory, non-finite events, autopsies, the tightest headroom) and, with ``report_path``, a PNG chart
    is written (needs matplotlib: ``pip install 'lightning-amp-plus[report]'``).

    Works with this package's plugins, Lightning's ``MixedPrecision`` (its ``torch.amp.GradScaler``: a skip shows as a
    scale backoff) and plain ``32-true`` (then it reports what applies). In a Fabric (or plain) loop, call
    :meth:`observe` after each optimizer step and log what it returns; :meth:`summary` and :meth:`write_chart` at the
    end.

    Args:
        check_interval: check parameters (and unguarded gradients) every this many optimizer steps (>= 1).
        on_nonfinite: ``"warn"``, ``"raise"`` or ``"stop"``.
        skip_window: how many recent steps the skip rate is taken over.
        skip_warn_rate: warn when the skip rate over the window exceeds this fraction.
        log_memory: log memory every step.
        prog_bar: show the loss scale on the progress bar.
        report_path: where to write the PNG chart at the end of ``fit`` (``None``: no chart); a ``.png`` path in a
            folder that can be written or created, checked at construction.
        autopsy: find where each skipped step's inf/NaN started (see above).
        autopsy_limit: the most autopsies per run (>= 1).
        headroom_interval: read per-layer headroom every this many optimizer steps (0: never).

    Examples:
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
        autopsy: bool = True,
        autopsy_limit: int = 3,
        headroom_interval: int = 0,
    ) -> None:
        name = type(self).__name__
        check_interval = check_int(name, "check_interval", check_interval, 1, hint=", e.g. 1 (every step)")
        if on_nonfinite not in _POLICIES:
            raise ValueError(f"`{name}(on_nonfinite={on_nonfinite!r})` must be one of {_POLICIES}.")
        skip_window = check_int(name, "skip_window", skip_window, 1, hint=", e.g. 100")
        skip_warn_rate = check_real(
            name, "skip_warn_rate", skip_warn_rate, "a fraction in [0, 1], e.g. 0.05", lambda rate: 0 <= rate <= 1
        )
        check_bool(name, "log_memory", log_memory)
        check_bool(name, "prog_bar", prog_bar)
        check_bool(name, "autopsy", autopsy)
        autopsy_limit = check_int(name, "autopsy_limit", autopsy_limit, 1, hint=", e.g. 3")
        headroom_interval = check_int(name, "headroom_interval", headroom_interval, 0, hint=" (0: never), e.g. 50")
        self.check_interval = check_interval
        self.on_nonfinite = on_nonfinite
        self.skip_window = skip_window
        self.skip_warn_rate = skip_warn_rate
        self.log_memory = log_memory
        self.prog_bar = prog_bar
        self.autopsy = autopsy
        self.autopsy_limit = autopsy_limit
        self.headroom_interval = headroom_interval
        # Checked now, before any training: a chart that cannot be written must not cost a whole run.
        self.report_path = None if report_path is None else check_chart_path(report_path)
        self.history = AmpHistory()
        """Every step's record and the non-finite events: what the summary and the chart are made from."""
        self.debug_path: Path | None = None
        """The file the ``"stop"`` policy saved, once it has."""
        self.should_stop = False
        """Set by the ``"stop"`` policy in a Fabric loop (:meth:`observe`): end your loop when it is True."""
        self.autopsies: list[Autopsy] = []
        """The autopsies of this run, oldest first: at most ``autopsy_limit`` are made, and a cause (kind and module)
        found again is not repeated."""
        self._autopsies_made = 0
        self.headroom: dict[str, LayerHeadroom] = {}
        """The latest headroom reading, by module name (empty until one is made)."""
        self._rng: RngState | None = None
        self._headroom_logged: dict[str, LayerHeadroom] | None = None
        self._source: _StepSource = _ScaleReadSteps(None)
        self._recent: deque[bool] = deque(maxlen=skip_window)
        self._applied_yet = False
        self._skips_seen = 0
        self._floor_warned = False
        self._cpu_memory_said = False
        self._log_this_step = True
        self._bar_scale: float | None = None
        self._named: list[tuple[str, Tensor]] = []

    # ------------------------------------------------------------------------------------------------- the step
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(_source_for(trainer.precision_plugin, trainer), "CUDA memory" if _on_cuda(trainer) else None)
        # Walking the module tree every step costs more than the check itself: the parameters are fixed during fit.
        self._named = list(pl_module.named_parameters())

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._source.begin_batch()
        if self._replays(trainer, pl_module):
            self._rng = RngState.capture()  # what a replay of this batch needs (about 2 us)
        self._log_this_step = _logs_this_step(trainer)
        if self._log_this_step and self.log_memory and _on_cuda(trainer):
            _memory.reset_cuda_peak(trainer.strategy.root_device)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._source.before_step()
        if self._checking(trainer.global_step) and not self._source.guarded:
            named = [(n, p.grad) for n, p in self._named if p.grad is not None]
            self._found(trainer, pl_module, "gradients", nonfinite_names(named), trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        steps = self._source.take()
        if not steps:
            return  # an accumulating micro-batch: no optimizer step to report
        memory = self._memory(trainer) if self.log_memory and self._log_this_step else {}
        for key, value in self._metrics(steps, memory, everything=self._log_this_step).items():
            pl_module.log(key, value, on_step=True, on_epoch=False, rank_zero_only=True,
                          prog_bar=self.prog_bar and key == "amp/loss_scale")  # fmt: skip
        peak = memory.get("cuda_peak_mb", memory.get("cpu_rss_mb"))
        # global_step counts every optimizer step, skipped or not
        self._record(steps, trainer.global_step - len(steps), peak)
        if self._rng is not None:
            self._examine(steps, trainer.global_step, _trainer_replay(trainer, pl_module, batch, batch_idx), outputs)
            for key, value in self._headroom_metrics().items():
                pl_module.log(key, value, on_step=True, on_epoch=False, rank_zero_only=True)
        # global_step counts finished steps: checked after every check_interval-th step, reported at its index.
        if self._checking(trainer.global_step) and not self.should_stop:
            self._found(trainer, pl_module, "parameters", nonfinite_names(self._named), trainer.global_step - 1)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A step that stopped the run (the scaler's skip limit) never reached on_train_batch_end: record it too, so the
        # history (and the summary made of it) holds every step taken.
        steps = self._source.take()
        self._record(steps, trainer.global_step, None)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._finish()

    # ------------------------------------------------------------------------------- Fabric and plain loops
    def batch_start(self) -> None:
        """Fabric and plain loops: call before each batch's forward if you pass ``replay`` to :meth:`observe`.

        It snapshots the random state (about 2 us) so that a replay of the batch draws the same dropout masks.
        """
        if self.autopsy or self.headroom_interval:
            self._rng = RngState.capture()

    def observe(
        self,
        plugin: Any,
        *,
        model: nn.Module | None = None,
        step: int | None = None,
        replay: Callable[[], Tensor] | None = None,
    ) -> dict[str, float]:
        """Record the optimizer steps ``plugin`` took since the last call; return this step's metrics for a logger.

        For a Fabric loop (``fabric.log_dict(monitor.observe(plugin, model=model))`` after ``optimizer.step()``)
        or a plain one: ``plugin`` is one of this package's plugins (or anything with a ``StepEngine`` as ``engine``).
        With ``model``, its parameters are checked for inf/NaN every ``check_interval`` steps, handled by
        ``on_nonfinite`` (``"stop"`` saves the debug file in the working folder and sets :attr:`should_stop`).

        Args:
            plugin: the precision plugin whose steps to read.
            model: the model whose parameters to check, and to replay (optional; Fabric's wrapper is fine).
            step: the step number to record (default: the plugin's count of optimizer steps before these).
            replay: recomputes this batch's loss with ``model`` (e.g. ``lambda: loss_fn(model(x), y)``), for the
                autopsy of a skipped step and the headroom readings; call :meth:`batch_start` before the batch's
                forward. Without it, neither is made.

        Returns:
            The ``amp/...`` metrics of the class docstring for the steps taken since the last call (``{}`` if none).
        """
        engine = getattr(plugin, "engine", None)
        if not isinstance(engine, StepEngine):
            raise TypeError(
                f"`MixedPrecisionMonitor.observe(plugin={plugin!r})` reads this package's plugins (for Fabric: "
                "lightning_amp_plus.fabric.MixedPrecisionPlugin), which record their steps."
            )
        if not isinstance(self._source, _EngineSteps) or self._source.engine is not engine:
            self._start(_EngineSteps(plugin, from_first=True), None)
        steps = self._source.take()
        if not steps:
            return {}
        first = steps[0].index if step is None else step
        memory = self._cpu_or_cuda_memory(model) if self.log_memory else {}
        metrics = self._metrics(steps, memory, everything=True)
        self._record(steps, first or 0, memory.get("cuda_peak_mb", memory.get("cpu_rss_mb")))
        last = (first or 0) + len(steps) - 1
        if model is not None and replay is not None and self._rng is not None:
            self._examine(steps, last + 1, _Replay.of_fabric(plugin, model, replay), None)
            metrics.update(self._headroom_metrics())
        if model is not None and self._checking(last + 1):
            self._found(None, model, "parameters", nonfinite_names(list(model.named_parameters())), last)
        return metrics

    def summary(self) -> str:
        """The one-paragraph summary of the run so far (what ``fit`` prints at its end)."""
        self.history.notes = self._source.notes()
        return summary(self.history)

    def write_chart(self, path: str | Path | None = None) -> Path:
        """Write the PNG chart of the run so far to ``path`` (default: ``report_path``); return where it went."""
        target = self.report_path if path is None else check_chart_path(path, "path")
        if target is None:
            raise ValueError("`MixedPrecisionMonitor.write_chart()` needs a path: pass one, or set report_path.")
        write_chart(self.history, target)
        return target

    # ------------------------------------------------------------------------------------ autopsy and headroom
    def _replays(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Whether this run's batches may be replayed: our plugins, automatic optimization, rank zero, unsharded."""
        if not (self.autopsy or self.headroom_interval) or not isinstance(self._source, _EngineSteps):
            return False
        if not pl_module.automatic_optimization or not trainer.is_global_zero:
            return False
        return not any(is_dtensor(p) or getattr(p, "_fsdp_flattened", False) for _, p in self._named)

    def _examine(self, steps: list[StepResult], count: int, replay: _Replay | None, outputs: Any) -> None:
        """After an optimizer step: a skipped step's autopsy, a headroom reading when due (``count``: steps done)."""
        rng, self._rng = self._rng, None
        if replay is None or rng is None:
            return
        skipped = next((result for result in steps if result.skipped), None)
        if skipped is not None and self.autopsy and self._autopsies_made < self.autopsy_limit:
            self._autopsy(skipped, replay, rng, count - 1, outputs)
        if self.headroom_interval and count % self.headroom_interval == 0:
            self.headroom = replay.headroom(rng, steps[-1].scale or 1.0)
            self.history.headroom.append((count - 1, self.headroom))

    def _autopsy(self, result: StepResult, replay: _Replay, rng: RngState, step: int, outputs: Any) -> None:
        descending = not self._applied_before(step) and replay.min_scale < (result.scale or 1.0)
        if descending and _finite_loss(outputs):
            return  # the scale coming down from init_scale: routine, and a replay would only say "scale"
        found = replay.autopsy(rng, result.scale or 1.0, step)
        if found is None or (descending and found.kind == "scale"):
            return  # did not reproduce (a rank-local fault), or routine: not reported, not counted
        self._autopsies_made += 1
        if any((earlier.kind, earlier.module) == (found.kind, found.module) for earlier in self.autopsies):
            return  # the same cause again (a fault that persists): said once
        self.autopsies.append(found)
        self.history.autopsies.append(found)
        rank_zero_warn(f"MixedPrecisionMonitor: {found.message}", category=RuntimeWarning)

    def _applied_before(self, step: int) -> bool:
        return any(not record.skipped for record in self.history.steps if record.step < step)

    def _headroom_metrics(self) -> dict[str, float]:
        """The latest reading as metrics, once (then forgotten), keyed ``amp/headroom/<layer>/<field>``."""
        reading = self.history.headroom[-1] if self.history.headroom else None
        if reading is None or reading[1] is self._headroom_logged:
            return {}
        self._headroom_logged = reading[1]
        metrics: dict[str, float] = {}
        for name, layer in reading[1].items():
            prefix = f"amp/headroom/{name or 'model'}/"
            metrics[prefix + "act_absmax"] = layer.act_absmax
            metrics[prefix + "grad_absmax"] = layer.grad_absmax
            metrics[prefix + "grad_flushed_pct"] = layer.grad_flushed_pct
            metrics[prefix + "grad_subnormal_pct"] = layer.grad_subnormal_pct
            metrics[prefix + "headroom_bits"] = layer.headroom_bits[str(layer.dtype).removeprefix("torch.")]
        return metrics

    # -------------------------------------------------------------------------------------------------- helpers
    def _start(self, source: _StepSource, memory_kind: str | None) -> None:
        self._source = source
        self.history = AmpHistory(memory_kind=memory_kind or "process memory")
        self._recent.clear()
        self._applied_yet = False
        self._floor_warned = False
        self.should_stop = False
        self.autopsies = []
        self._autopsies_made = 0
        self.headroom = {}
        # Our plugins' count is a total since the first run, restored from checkpoints: new skips are what it adds.
        self._skips_seen = source.skips_so_far()

    def _finish(self) -> None:
        print(self.summary())
        if self.report_path is not None:
            write_chart(self.history, self.report_path)
            print(f"MixedPrecisionMonitor: chart written to {self.report_path}")

    def _record(self, steps: list[StepResult], first: int, peak: float | None) -> None:
        for offset, result in enumerate(steps):
            index = first + offset
            self.history.steps.append(StepRecord(index, result.scale, result.skipped, result.grad_norm, peak))
            if result.overflow_params:
                self.history.nonfinite_events.append((index, "overflowed gradients", list(result.overflow_params)))
            self._watch_skips()

    def _metrics(self, steps: list[StepResult], memory: dict[str, float], *, everything: bool) -> dict[str, float]:
        # `self.log` costs about a millisecond a call, so everything is logged only on the steps Lightning writes to
        # its loggers; between them only a changed loss scale is, for the progress bar.
        self._skips_seen += sum(step.skipped for step in steps)
        scale = steps[0].scale  # one scale per batch: the scaler updates once for all of the batch's steps
        metrics: dict[str, float] = {}
        if scale is not None and (everything or (self.prog_bar and scale != self._bar_scale)):
            metrics["amp/loss_scale"] = self._bar_scale = scale
        if not everything:
            return metrics
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
        return metrics

    def _checking(self, count: int) -> bool:
        # Inside a step `count` is the index of the step being taken; after it, the number of steps finished.
        return count % self.check_interval == 0

    def _watch_skips(self) -> None:
        last = self.history.steps[-1]
        if not self._applied_yet and not last.skipped:
            # The skips before the first applied step were the scale finding its level from `init_scale`: not a
            # problem. A run that never applies a step keeps them, and its window fills with skips.
            self._applied_yet = True
            self._recent.clear()
        self._recent.append(last.skipped)
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
        floor = self._source.floor()
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
        if _on_cuda(trainer):
            return _memory.cuda_memory_mb(trainer.strategy.root_device)
        return self._cpu_memory()

    def _cpu_or_cuda_memory(self, model: nn.Module | None) -> dict[str, float]:
        param = None if model is None else next(model.parameters(), None)
        if param is not None and param.device.type == "cuda":
            return _memory.cuda_memory_mb(param.device)
        return self._cpu_memory()

    def _cpu_memory(self) -> dict[str, float]:
        if not self._cpu_memory_said:
            self._cpu_memory_said = True
            rank_zero_info(
                "MixedPrecisionMonitor: not on CUDA, so it reports the process's resident memory (amp/cpu_rss_mb) "
                "instead of CUDA memory."
            )
        return {"cpu_rss_mb": _memory.process_rss_mb()}

    def _found(self, trainer: pl.Trainer | None, module: nn.Module, kind: str, names: list[str], step: int) -> None:
        if not names:
            return
        self.history.nonfinite_events.append((step, kind, names))
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        message = f"MixedPrecisionMonitor: non-finite {kind} at step {step}: {shown}."
        if self.on_nonfinite == "raise":
            raise FloatingPointError(message + " (on_nonfinite='raise')")
        if self.on_nonfinite == "warn":
            rank_zero_warn(message)
            return
        self.debug_path = self._save_debug(trainer, module, kind, names, step)
        self.should_stop = True
        if trainer is not None:
            trainer.should_stop = True
        if kind == "gradients":
            # Nothing else guards this step: drop its gradients so the optimizer leaves the parameters alone.
            for _, param in self._named:
                param.grad = None
        rank_zero_warn(f"{message} Training stops; what you need to debug it is in {self.debug_path}.")

    def _save_debug(
        self, trainer: pl.Trainer | None, module: nn.Module, kind: str, names: list[str], step: int
    ) -> Path:
        folder = Path(trainer.default_root_dir) if trainer is not None else Path.cwd()
        path = folder / f"amp_nonfinite_step{step if trainer is None else trainer.global_step}.pt"
        # On every rank: under FSDP the module's state_dict() is a collective; rank zero alone would wait forever.
        state = {key: local_view(value).detach().cpu() for key, value in module.state_dict().items()}
        if trainer is None or trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            named = self._named or list(module.named_parameters())
            grads = {n: local_view(p.grad).detach().cpu() for n, p in named if p.grad is not None}
            scale = self.history.steps[-1].scale if self.history.steps else None
            torch.save(
                {
                    "global_step": step if trainer is None else trainer.global_step,
                    "kind": kind,
                    "names": names,
                    "loss_scale": scale,
                    "state_dict": state,
                    "grads": grads,
                    "history": [asdict(record) for record in self.history.steps[-100:]],
                },
                path,
            )
        return path


# --------------------------------------------------------------------------------------------- step sources
class _StepSource(Protocol):
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

    def notes(self) -> list[str]:
        """What the summary should say about how the steps were taken (compensated weights), if anything."""


class _EngineSteps:
    """The package's plugins: the engine records every optimizer step's result (nothing is read off the scale)."""

    def __init__(self, plugin: Any, *, from_first: bool = False) -> None:
        self._plugin = plugin
        self.engine: StepEngine = plugin.engine
        self.guarded = self.engine.guard is not None
        # The Trainer's monitor starts with the run; a Fabric loop's first observe() comes after its first step.
        self._next = self.engine.steps_taken - (len(self.engine.recent_steps) if from_first else 0)

    def floor(self) -> float | None:
        floor: float | None = getattr(self._plugin, "min_scale", None)
        return floor

    def skips_so_far(self) -> int:
        return self.engine.skipped_steps - sum(result.skipped for result in self.engine.results_since(self._next))

    def begin_batch(self) -> None:
        pass

    def before_step(self) -> None:
        pass

    def take(self) -> list[StepResult]:
        steps = self.engine.results_since(self._next)
        self._next = self.engine.steps_taken  # consumed: never reported twice
        return steps

    def notes(self) -> list[str]:
        footprints = self.engine.footprints()
        if not footprints:
            return []
        per_parameter = sum(f.weights + f.compensation + f.states for f in footprints) / max(
            sum(f.parameters for f in footprints), 1
        )
        return [
            f"bf16 weights compensated ({self.engine.compensation}): {per_parameter:.1f} bytes per parameter of "
            "weights, compensation and optimizer state"
        ]


class _ScaleReadSteps:
    """Lightning's own plugins: each step is seen before it runs; a ``GradScaler``'s skip shows as a scale backoff."""

    def __init__(self, trainer: pl.Trainer | None) -> None:
        self._trainer = trainer
        self.guarded = trainer is not None and trainer.scaler is not None
        self._scales: list[float | None] = []

    def floor(self) -> float | None:
        return None

    def skips_so_far(self) -> int:
        return 0  # a GradScaler does not count them

    def begin_batch(self) -> None:
        self._scales.clear()

    def before_step(self) -> None:
        scaler = None if self._trainer is None else self._trainer.scaler
        self._scales.append(None if scaler is None else float(scaler.get_scale()))

    def take(self) -> list[StepResult]:
        scales, self._scales = self._scales, []
        scaler = None if self._trainer is None else self._trainer.scaler
        if scaler is None or not scales:
            return [StepResult.known(skipped=False, scale=None, grad_norm=None, index=i) for i in range(len(scales))]
        # torch.amp.GradScaler backs the scale off exactly when it skipped a step, and Lightning's plugin updates it
        # after every optimizer step: each step's outcome is the scale the next one (or the batch's end) sees.
        after = [*scales[1:], float(scaler.get_scale())]
        return [
            StepResult.known(
                skipped=before is not None and next_scale is not None and next_scale < before,
                scale=before,
                grad_norm=None,
                index=i,
                optimizer=i,
            )
            for i, (before, next_scale) in enumerate(zip(scales, after, strict=True))
        ]

    def notes(self) -> list[str]:
        return []


def _source_for(plugin: Any, trainer: pl.Trainer) -> _StepSource:
    return _EngineSteps(plugin) if isinstance(getattr(plugin, "engine", None), StepEngine) else _ScaleReadSteps(trainer)


def _on_cuda(trainer: pl.Trainer) -> bool:
    return trainer.strategy.root_device.type == "cuda"


def _logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this training step's metrics to its loggers (``log_every_n_steps``, or stopping).

    Asked the way Lightning's own ``LearningRateMonitor`` asks it; outside a running loop the answer is yes.
    """
    connector = getattr(trainer, "_logger_connector", None)
    return True if connector is None else bool(connector.should_update_logs)


class _Replay:
    """What the autopsy and the headroom need to replay one batch: the model, its loss, the precision's autocast."""

    def __init__(
        self,
        model: nn.Module,
        run: Callable[[], Tensor],
        autocast: Callable[[], AbstractContextManager[Any]],
        dtype: torch.dtype,
        min_scale: float,
        suspended: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self.model, self.run, self.autocast, self.dtype, self.min_scale = model, run, autocast, dtype, min_scale
        self._suspended = suspended  # the front end's own autocast, off during a replay that sets its own

    @classmethod
    def of_fabric(cls, plugin: Any, model: nn.Module, run: Callable[[], Tensor]) -> _Replay:
        module = getattr(model, "module", model)  # Fabric's wrapper holds the user's module as `.module`
        min_scale = plugin.min_scale if getattr(plugin, "min_scale", None) is not None else 1.0
        suspended = getattr(plugin, "autocast_suspended", nullcontext)
        return cls(module, run, _autocast_of(plugin), plugin.half_dtype, min_scale, suspended)

    def autopsy(self, rng: RngState, scale: float, step: int) -> Autopsy | None:
        with self._suspended():
            return run_autopsy(
                self.model, self.run, rng=rng, scale=scale, step=step, dtype=self.dtype, autocast=self.autocast,
                min_scale=self.min_scale,
            )  # fmt: skip

    def headroom(self, rng: RngState, scale: float) -> dict[str, LayerHeadroom]:
        with self._suspended():
            return measure_headroom(self.model, self.run, scale=scale, dtype=self.dtype, rng=rng)


def _trainer_replay(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> _Replay:
    plugin: Any = trainer.precision_plugin  # one of ours (see MixedPrecisionMonitor._replays)

    def run() -> Tensor:
        with _silenced(pl_module):  # a replay logs nothing: the run's metrics stay the run's
            output = pl_module.training_step(batch, batch_idx)
        loss = output.get("loss") if isinstance(output, dict) else output
        if not isinstance(loss, Tensor):
            raise RuntimeError("The replayed training_step returned no loss.")
        return loss

    min_scale = getattr(plugin, "min_scale", None)
    return _Replay(pl_module, run, _autocast_of(plugin), plugin.half_dtype, 1.0 if min_scale is None else min_scale)


def _autocast_of(plugin: Any) -> Callable[[], AbstractContextManager[Any]]:
    # The precision's own forward context, as the step ran it (its autocast, or bf16-true's dtype); a Fabric plugin's
    # even while its wrapper's is suspended for the replay.
    context: Callable[[], AbstractContextManager[Any]] = getattr(plugin, "precision_context", plugin.forward_context)
    return context


@contextmanager
def _silenced(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing inside (instance attributes shadow the methods, then go)."""
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log
        del module.log_dict


def _finite_loss(outputs: Any) -> bool:
    """Whether the training_step's loss was finite (``outputs`` as Lightning hands them to on_train_batch_end)."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return isinstance(loss, Tensor) and bool(torch.isfinite(loss).all())
