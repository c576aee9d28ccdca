"""``MixedPrecisionMonitor``: the loss scale, skipped steps, non-finite values and memory at every step.

A Trainer callback, and the same readings for Fabric and plain loops through :meth:`MixedPrecisionMonitor.observe`.
Where the steps come from is decided once, when training starts: this package's plugins record every optimizer step's
:class:`~lightning_amp_plus.step.engine.StepResult` (``_EngineSteps``); under Lightning's own plugins the monitor
sees each step in ``on_before_optimizer_step`` and reads a ``GradScaler``'s skips off its scale (``_ScaleReadSteps``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_amp_plus._checks import check_bool, check_int, check_real
from lightning_amp_plus._paths import written_as
from lightning_amp_plus.diagnostics.autopsy import Autopsy
from lightning_amp_plus.diagnostics.headroom import LayerHeadroom
from lightning_amp_plus.monitor import memory as _memory
from lightning_amp_plus.monitor.chart import check_chart_path, write_chart
from lightning_amp_plus.monitor.examiner import Examiner, Replay, trainer_replay
from lightning_amp_plus.monitor.fp8 import FP8Outlier, FP8Watch
from lightning_amp_plus.monitor.history import AmpHistory, StepEntry
from lightning_amp_plus.monitor.nonfinite import NonfiniteCheck
from lightning_amp_plus.monitor.step_sources import EngineSteps, ScaleReadSteps, StepSource, source_for
from lightning_amp_plus.monitor.summary import summary
from lightning_amp_plus.step.engine import StepEngine, StepResult
from lightning_amp_plus.step.sharding import is_dtensor

__all__ = ["MixedPrecisionMonitor"]

_POLICIES = ("warn", "raise", "stop")
# Why a skipped step's cause was not examined, as the summary says it (AmpHistory.unexamined).
_AUTOPSY_OFF = (
    "the monitor's autopsy, which replays such a step and says where its first inf/NaN starts, is off: "
    "MixedPrecisionMonitor(autopsy=True) turns it on"
)
_NO_REPLAY_GIVEN = (
    "in a Fabric or plain loop the monitor's autopsy replays such a step, and says where its first inf/NaN starts, "
    "when observe() is given model=... and replay=..."
)


class MixedPrecisionMonitor(Callback):
    """Report the loss scale, skipped steps, gradient norm, non-finite values and memory at every optimizer step.

    Logged with Lightning's ``self.log`` (so TensorBoard, CSV, W&B... all receive them), on rank zero only, on the steps
    Lightning writes to its loggers (``Trainer(log_every_n_steps=...)``; between them only a changed loss scale goes
    to the progress bar, since each ``self.log`` call costs about a millisecond). Every step is still recorded in
    :attr:`history` for the summary and the chart:

    * ``amp/loss_scale``: the scale this step's gradients were scaled by (absent without a scaler).
    * ``amp/skipped_steps`` (total so far) and ``amp/step_skipped`` (1.0 when a step of this batch was skipped).
    * ``amp/spikes``: under the plugin's ``spike_guard``, the gradient-norm spikes it skipped or clipped in this run.
    * ``amp/grad_norm``: the global norm of the unscaled gradients, taken from the plugin's own check (only under this
      package's plugins, whose check measures it once the monitor reads them; never recomputed). When several
      optimizers step in one batch (manual optimization), it is the norm over all of their gradients, and
      ``amp/grad_norm_opt{i}`` gives each optimizer's own (``i``: its position in ``trainer.optimizers``).
    * ``amp/cuda_allocated_mb``, ``amp/cuda_reserved_mb``, ``amp/cuda_peak_mb`` (the peak within the step) on CUDA;
      on CPU ``amp/cpu_rss_mb``, the process's resident memory, instead.
    * ``amp/fp8_flushed_max``: under ``"fp8-mixed"``, on each FP8 check step, the largest share (percent) of a cast's
      nonzero values flushed to zero; a cast above ``fp8_flush_warn_pct`` is kept in :attr:`fp8_outliers` and warned
      about once per layer and cast (see ``monitor/fp8.py``).

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
    monitor replays that batch once with hooks (same parameters, same random numbers; the RNG streams, buffers,
    gradients, torchmetrics states and the modules' plain attributes are put back: the run ends as it would without)
    and says where the first inf/NaN came from and why
    (:class:`~lightning_amp_plus.diagnostics.autopsy.Autopsy` in :attr:`autopsies`: ``"forward"``, an output that no
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
    is written (needs matplotlib: ``pip install 'lightning-amp-plus[report]'``). Also when ``fit`` stops early: on
    Ctrl-C (Lightning's graceful shutdown), on the scaler's diagnosis or on any error, both come out before the
    exception goes on (``on_exception``), whatever launched the run (the Trainer, LightningCLI, ``amp-plus``).
    The chart never replaces a file: where one has that name, it goes to the next free numbered name
    (``amp-1.png``...) and the printed line says so.

    Works with this package's plugins, Lightning's ``MixedPrecision`` (its ``torch.amp.GradScaler``: a skip shows as a
    scale backoff) and plain ``32-true`` (then it reports what applies). In a Fabric (or plain) loop, call
    :meth:`observe` after each optimizer step and log what it returns; :meth:`summary` and :meth:`write_chart` at the
    end.

    Args:
        check_interval: check parameters (and unguarded gradients) every this many optimizer steps (>= 1).
        on_nonfinite: ``"warn"``, ``"raise"`` or ``"stop"``.
        skip_window: how many recent steps the skip rate is taken over.
        skip_warn_rate: warn when the skip rate over the window exceeds this fraction.
        log_memory: read and log memory (CUDA's, or the process's resident memory on CPU): under the Trainer on the
            steps Lightning logs (every ``log_every_n_steps``; never without a logger), in a Fabric loop at every
            :meth:`observe`.
        prog_bar: show the loss scale on the progress bar.
        report_path: where to write the PNG chart at the end of ``fit`` (``None``: no chart); a ``.png`` path in a
            folder that can be written or created, checked at construction. An existing file there is kept: the
            chart then goes to ``<name>-1.png`` (or the next free number), as the printed line says.
        autopsy: find where each skipped step's inf/NaN started (see above).
        autopsy_limit: the most autopsies per run (>= 1).
        headroom_interval: read per-layer headroom every this many optimizer steps (0: never); under ``"fp8-mixed"``
            with ``fp8_fallback=None``, the FP8 casts too (under the Trainer).
        fp8_flush_warn_pct: under ``"fp8-mixed"``, keep and warn about a cast that flushes more than this percent of
            its nonzero values to zero at a check step (a number in [0, 100)).

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
        fp8_flush_warn_pct: float = 1.0,
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
        warn_pct = check_real(
            name, "fp8_flush_warn_pct", fp8_flush_warn_pct, "a percent in [0, 100), e.g. 1.0", lambda p: 0 <= p < 100
        )
        self._check = NonfiniteCheck(check_interval, on_nonfinite)
        self.log_memory = log_memory
        self._examiner = Examiner(autopsy, autopsy_limit, headroom_interval)
        # Checked now, before any training: a chart that cannot be written must not cost a whole run.
        self.report_path = None if report_path is None else check_chart_path(report_path)
        self.history = AmpHistory()
        """Every step's record and the non-finite events: what the summary and the chart are made from."""
        self._source: StepSource = ScaleReadSteps(None)
        self._watch = _SkipWatch(skip_window, skip_warn_rate)
        self._memory = _memory.MemoryReader()
        self._step_metrics = _StepMetrics(prog_bar)
        self._fp8 = FP8Watch(warn_pct, rank_zero_warn)
        self._training = False  # a fit is under way whose summary is not out yet
        self._replaying = False  # this fit's batches are replayed (set at its start: what it depends on is fixed)

    # ---------------------------------------------------------------------------------------------- readings
    @property
    def check_interval(self) -> int:
        """Optimizer steps between two checks for inf/NaN."""
        return self._check.interval

    @property
    def on_nonfinite(self) -> str:
        """What a non-finite finding does: ``"warn"``, ``"raise"`` or ``"stop"``."""
        return self._check.policy

    @property
    def debug_path(self) -> Path | None:
        """The file the ``"stop"`` policy saved, once it has."""
        return self._check.debug_path

    @property
    def should_stop(self) -> bool:
        """Set by the ``"stop"`` policy in a Fabric loop (:meth:`observe`): end your loop when it is True."""
        return self._check.should_stop

    @property
    def prog_bar(self) -> bool:
        """Whether the loss scale is shown on the progress bar."""
        return self._step_metrics.prog_bar

    @property
    def skip_window(self) -> int:
        """How many recent steps the skip rate is taken over."""
        return self._watch.window

    @property
    def skip_warn_rate(self) -> float:
        """The skip rate over the window above which the monitor warns."""
        return self._watch.warn_rate

    @property
    def fp8_outliers(self) -> list[FP8Outlier]:
        """Under ``"fp8-mixed"``: each cast above ``fp8_flush_warn_pct`` at a check step (``.step``, ``.layer``...)."""
        return self._fp8.outliers

    @property
    def autopsies(self) -> list[Autopsy]:
        """The autopsies of this run, oldest first (at most ``autopsy_limit``; a cause found again is said once)."""
        return self._examiner.autopsies

    @property
    def headroom(self) -> dict[str, LayerHeadroom]:
        """The latest headroom reading, by module name (empty until one is made)."""
        return self._examiner.headroom

    @property
    def autopsy(self) -> bool:
        """Whether skipped steps get an autopsy."""
        return self._examiner.autopsy

    @property
    def autopsy_limit(self) -> int:
        """The most autopsies a run makes."""
        return self._examiner.autopsy_limit

    @property
    def headroom_interval(self) -> int:
        """Optimizer steps between two headroom readings (0: none)."""
        return self._examiner.headroom_interval

    # ------------------------------------------------------------------------------------------------- the step
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        plugin = trainer.precision_plugin
        self._start(source_for(plugin, trainer), "CUDA memory" if _on_cuda(trainer) else None, plugin)
        self._training = True  # until this fit's summary is out
        self._check.named(pl_module)  # read once: the parameters are fixed during fit
        unreplayable = _unreplayable(self._source, type(plugin).__name__, pl_module, self._check.named())
        self.history.unexamined = unreplayable or self.history.unexamined  # the set-up's reason before autopsy=False
        # Replayed: our plugins, automatic optimization, rank zero, an unsharded model, an autopsy or headroom asked.
        self._replaying = unreplayable is None and trainer.is_global_zero and self._examiner.active

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._source.begin_batch()
        if self._replaying:
            self._examiner.batch_start()
        self._fp8.arm(trainer.global_step, self.headroom_interval)
        self._step_metrics.everything = _logs_this_step(trainer)
        if self._step_metrics.everything and self.log_memory and _on_cuda(trainer):
            _memory.reset_cuda_peak(trainer.strategy.root_device)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._source.before_step()
        if self._check.due(trainer.global_step) and not self._source.guarded:
            self._check.check("gradients", trainer.global_step, self.history, trainer, pl_module, rank_zero_warn)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        steps = self._source.take()
        if not steps:
            return  # an accumulating micro-batch: no optimizer step to report
        memory = self._memory.of_trainer(trainer) if self.log_memory and self._step_metrics.everything else {}
        metrics = self._step_metrics.of(steps, memory) | self._fp8.take(trainer.global_step - 1)
        for key, value in metrics.items():
            on_bar = self.prog_bar and key == "amp/loss_scale"
            pl_module.log(key, value, on_step=True, on_epoch=False, rank_zero_only=True, prog_bar=on_bar)
        peak = memory.get("cuda_peak_mb", memory.get("cpu_rss_mb"))
        # global_step counts every optimizer step, skipped or not
        self._record(steps, trainer.global_step - len(steps), peak)
        if self._replaying:
            replay = trainer_replay(trainer, pl_module, batch, batch_idx)
            self._examiner.examine(steps, trainer.global_step, replay, outputs, self.history)
            for key, value in self._examiner.headroom_metrics().items():
                pl_module.log(key, value, on_step=True, on_epoch=False, rank_zero_only=True)
        # global_step counts finished steps: checked after every check_interval-th step, reported at its index.
        if self._check.due(trainer.global_step) and not self.should_stop:
            self._check.check("parameters", trainer.global_step - 1, self.history, trainer, pl_module, rank_zero_warn)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A step that stopped the run (the scaler's skip limit) never reached on_train_batch_end: record it too, so the
        # history (and the summary made of it) holds every step taken.
        steps = self._source.take()
        self._record(steps, trainer.global_step, None)
        # Ctrl-C (Lightning's graceful shutdown), the scaler's diagnosis, any error: fit ends without on_fit_end, so
        # the summary and the chart of the steps taken are written here, whatever launched the run.
        if self._training and trainer.is_global_zero:
            self._finish()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._finish()

    # ------------------------------------------------------------------------------- Fabric and plain loops
    def batch_start(self) -> None:
        """Fabric and plain loops: call before each batch's forward if you pass ``replay`` to :meth:`observe`.

        It snapshots the random state (about 2 us) so that a replay of the batch draws the same dropout masks.
        """
        self._examiner.batch_start()

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
        if not isinstance(self._source, EngineSteps) or self._source.engine is not engine:
            self._start(EngineSteps(plugin, from_first=True), None, plugin, from_first=True)
        steps = self._source.take()
        if not steps:
            return {}
        first = steps[0].index if step is None else step
        memory = self._memory.of_model(model) if self.log_memory else {}
        last = (first or 0) + len(steps) - 1
        self._step_metrics.everything = True  # a Fabric loop logs what it is given, every step
        metrics = self._step_metrics.of(steps, memory) | self._fp8.take(last)
        self._record(steps, first or 0, memory.get("cuda_peak_mb", memory.get("cpu_rss_mb")))
        if model is not None and replay is not None:
            self._examiner.examine(steps, last + 1, Replay.of_fabric(plugin, model, replay), None, self.history)
            metrics.update(self._examiner.headroom_metrics())
        else:
            self.history.unexamined = _NO_REPLAY_GIVEN
        if model is not None:
            self._check.named(model)  # its parameters, read once per model: the check's and the summary's
        if model is not None and self._check.due(last + 1):
            self._check.check("parameters", last, self.history, None, model, rank_zero_warn)
        return metrics

    def summary(self) -> str:
        """The one-paragraph summary of the run so far (what ``fit`` prints at its end)."""
        self.history.notes = self._source.notes([param for _, param in self._check.named()])
        return summary(self.history)

    def write_chart(self, path: str | Path | None = None) -> Path:
        """Write the PNG chart of the run so far to ``path`` (default: ``report_path``); return where it went.

        Where a file has that name already, the chart goes to the next free numbered name (``amp-1.png``...): the
        file is left as it was.
        """
        target = self.report_path if path is None else check_chart_path(path, "path")
        if target is None:
            raise ValueError("`MixedPrecisionMonitor.write_chart()` needs a path: pass one, or set report_path.")
        return write_chart(self.history, target)

    # -------------------------------------------------------------------------------------------------- helpers
    def _start(self, source: StepSource, memory_kind: str | None, plugin: Any, from_first: bool = False) -> None:
        self._source = source
        self._fp8.start(plugin, from_first=from_first)  # its checks before now are an earlier run's (Trainer)
        self.history = AmpHistory(memory_kind=memory_kind or "process memory", fp8=self._fp8.record)
        self.history.unexamined = None if self._examiner.autopsy else _AUTOPSY_OFF
        self._watch = _SkipWatch(self.skip_window, self.skip_warn_rate)  # afresh for each run
        self._check.should_stop = False
        self._examiner.reset()
        # Our plugins' count is a total since the first run, restored from checkpoints: new skips are what it adds.
        self._step_metrics.skips_seen, self._step_metrics.spikes_seen = source.skips_so_far(), 0

    def _finish(self) -> None:
        """The end of a fit (finished or stopped): the summary printed and the chart written, once."""
        self._training = False
        print(self.summary())
        if self.report_path is None:
            return
        try:
            written = write_chart(self.history, self.report_path)
        except Exception as error:  # while fit stops for another reason, a chart that fails must not hide that one
            rank_zero_warn(f"MixedPrecisionMonitor: the chart could not be written to {self.report_path}: {error!r}")
            return
        print(f"MixedPrecisionMonitor: chart written to {written_as(self.report_path, written)}", flush=True)

    def _record(self, steps: list[StepResult], first: int, peak: float | None) -> None:
        self._fp8.nonfinite(first + len(steps) - 1, any(result.overflowed for result in steps))  # before any replay
        self._watch.record(self.history, steps, first, peak, self._source.floor())


# --------------------------------------------------------------------------------------------- step sources
def _on_cuda(trainer: pl.Trainer) -> bool:
    return trainer.strategy.root_device.type == "cuda"


def _logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this training step's metrics to its loggers (``log_every_n_steps``, or stopping).

    Asked the way Lightning's own ``LearningRateMonitor`` asks it; outside a running loop the answer is yes.
    """
    connector = getattr(trainer, "_logger_connector", None)
    return True if connector is None else bool(connector.should_update_logs)


def _unreplayable(
    source: StepSource, plugin: str, module: pl.LightningModule, named: list[tuple[str, Tensor]]
) -> str | None:
    """Why the monitor cannot replay this Trainer run's batches (the summary's words), or ``None`` where it can.

    ``plugin`` is the precision plugin's class name; ``named``, the module's parameters by name.
    """
    if not isinstance(source, EngineSteps):  # a replay runs on the plugin's engine (its autocast, its scale floor)
        return (
            "the monitor's autopsy, which replays such a step and says where its first inf/NaN starts, runs under this "
            f"package's plugins, not under {plugin}"
        )
    if not module.automatic_optimization:
        return (
            "the monitor's autopsy replays steps of automatic optimization only, and this LightningModule steps its "
            "optimizers itself"
        )
    if any(is_dtensor(p) or getattr(p, "_fsdp_flattened", False) for _, p in named):
        return "the monitor's autopsy replays no step of a sharded model (FSDP, FSDP2): its forward needs every rank"
    return None


class _StepMetrics:
    """The ``amp/...`` metrics of each batch, and what they carry from batch to batch.

    State: the skips counted so far (a resumed run's included), the spikes the guard judged in this run, and the loss
    scale last shown on the progress bar.
    """

    def __init__(self, prog_bar: bool) -> None:
        self.prog_bar = prog_bar
        self.skips_seen = 0
        self.spikes_seen = 0
        self.bar_scale: float | None = None
        self.everything = True
        """Whether this batch's metrics are all logged (the steps Lightning logs, and every step in a Fabric loop)."""

    def of(self, steps: list[StepResult], memory: dict[str, float]) -> dict[str, float]:
        """The ``amp/...`` metrics of one batch's optimizer steps (all of them when :attr:`everything`)."""
        everything = self.everything
        # `self.log` costs about a millisecond a call, so everything is logged only on the steps Lightning writes to
        # its loggers; between them only a changed loss scale is, for the progress bar.
        self.skips_seen += sum(step.skipped for step in steps)
        verdicts = [step.spike_verdict for step in steps if step.spike_verdict is not None]
        self.spikes_seen += sum(verdict.spike for verdict in verdicts)
        scale = steps[0].scale  # one scale per batch: the scaler updates once for all of the batch's steps
        metrics: dict[str, float] = {}
        if scale is not None and (everything or (self.prog_bar and scale != self.bar_scale)):
            metrics["amp/loss_scale"] = self.bar_scale = scale
        if not everything:
            return metrics
        metrics["amp/skipped_steps"] = float(self.skips_seen)
        metrics["amp/step_skipped"] = float(any(step.skipped for step in steps))
        if verdicts:  # under a spike guard: the spikes it judged so far (skipped or clipped)
            metrics["amp/spikes"] = float(self.spikes_seen)
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


class _SkipWatch:
    """Records each step in the history, and warns when the skips run high or the scale sits at its floor.

    Each warning comes once: too many recent steps skipped, the loss scale at its floor.

    State: the recent steps' skip flags, whether a step was applied yet, whether the floor was warned about.
    """

    def __init__(self, window: int, warn_rate: float) -> None:
        self.window, self.warn_rate = window, warn_rate
        self._recent: deque[bool] = deque(maxlen=window)
        self._applied_yet = False
        self._floor_warned = False

    def record(
        self, history: AmpHistory, steps: list[StepResult], first: int, peak: float | None, floor: float | None
    ) -> None:
        """Record ``steps``, numbered from ``first``, and look at each in turn.

        ``peak`` is the memory peak; ``floor`` the loss scale's, if known.
        """
        for offset, result in enumerate(steps):
            index = first + offset
            entry = StepEntry(index, result.scale, result.skipped, result.grad_norm, peak, result.spike_verdict)
            history.steps.append(entry)
            if result.overflow_params:
                history.nonfinite_events.append((index, "overflowed gradients", list(result.overflow_params)))
            self._watch(history, floor)

    def _watch(self, history: AmpHistory, floor: float | None) -> None:
        last = history.steps[-1]
        if not self._applied_yet and not last.skipped:
            # The skips before the first applied step were the scale finding its level from `init_scale`: not a
            # problem. A run that never applies a step keeps them, and its window fills with skips.
            self._applied_yet = True
            self._recent.clear()
        self._recent.append(last.overflowed)  # a spike the guard skipped is no overflow
        window = len(self._recent)
        if window == self._recent.maxlen and sum(self._recent) / window > self.warn_rate:
            rank_zero_warn(
                f"MixedPrecisionMonitor: {sum(self._recent)} of the last {window} optimizer steps were skipped for "
                f"non-finite gradients (more than {self.warn_rate:.0%}); last overflowing parameters: "
                f"{history.nonfinite_events[-1][2] if history.nonfinite_events else 'unknown'}. If it persists, lower "
                "the learning rate, clip gradients, or check the data for inf/NaN.",
                category=RuntimeWarning,
            )
            self._recent.clear()  # warn at most once per window
        # Only a step skipped at the floor shows gradients overflowing unscaled (a scale may start at its floor).
        at_floor = floor is not None and last.scale is not None and last.scale <= floor
        if at_floor and last.skipped and not self._floor_warned:
            self._floor_warned = True
            rank_zero_warn(
                f"MixedPrecisionMonitor: the loss scale has reached its floor (min_scale={floor:g}) at step "
                f"{last.step}: gradients overflow even without scaling.",
                category=RuntimeWarning,
            )
