"""The monitor's autopsy of skipped steps and its headroom readings: when to replay a batch, and what it found.

:class:`Examiner` decides after each optimizer step whether to replay its batch (an autopsy of a skipped step, a
headroom reading every ``headroom_interval`` steps) and keeps what the replays found. :class:`Replay` is what a
replay needs from the front end: the model, a function that recomputes the batch's loss, the precision's forward
context; :func:`trainer_replay` makes it from a Trainer's ``training_step``, :meth:`Replay.of_fabric` from a Fabric
loop's closure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_amp_plus.diagnostics.autopsy import Autopsy, run_autopsy
from lightning_amp_plus.diagnostics.headroom import LayerHeadroom, measure_headroom
from lightning_amp_plus.diagnostics.replay import RngState, Unreplayable
from lightning_amp_plus.monitor.history import AmpHistory
from lightning_amp_plus.plugins.wrappers import unwrapped
from lightning_amp_plus.step.engine import StepResult

__all__ = ["Examiner", "Replay", "trainer_replay"]


class Examiner:
    """Autopsies of skipped steps and headroom readings for one run.

    Args:
        autopsy: make autopsies of skipped steps.
        autopsy_limit: the most autopsies a run makes (a routine one of the first descent is not counted).
        headroom_interval: read headroom every this many optimizer steps (0: never).

    State: the autopsies kept and the count made, the latest headroom reading and whether it was logged, and the
    random state of the batch in flight (captured at its start). Replays stop for the run once one meets a model whose
    gradients it cannot take (:class:`~lightning_amp_plus.diagnostics.replay.Unreplayable`): the run's history says so
    (``AmpHistory.replays_stopped``), and the run goes on without them.
    """

    def __init__(self, autopsy: bool, autopsy_limit: int, headroom_interval: int) -> None:
        self.autopsy, self.autopsy_limit, self.headroom_interval = autopsy, autopsy_limit, headroom_interval
        self.autopsies: list[Autopsy] = []
        self.headroom: dict[str, LayerHeadroom] = {}
        self._made = 0
        self._logged: dict[str, LayerHeadroom] | None = None
        self._rng: RngState | None = None

    @property
    def active(self) -> bool:
        """Whether anything may be replayed at all."""
        return self.autopsy or self.headroom_interval > 0

    def reset(self) -> None:
        """A new run."""
        self.autopsies, self.headroom, self._made, self._logged, self._rng = [], {}, 0, None, None

    def batch_start(self) -> None:
        """Snapshot the random state a replay of this batch needs (about 2 us)."""
        if self.active:
            self._rng = RngState.capture()

    def examine(self, steps: list[StepResult], count: int, replay: Replay, outputs: Any, history: AmpHistory) -> None:
        """After an optimizer step: a skipped step's autopsy, a headroom reading when due (``count``: steps done)."""
        rng, self._rng = self._rng, None
        skipped = next((result for result in steps if result.overflowed), None)  # a spike is not an overflow
        if rng is None:  # a loop that did not call batch_start(): the batch's random numbers cannot be drawn again
            if skipped is not None and self.autopsy:
                history.unexamined = (
                    "the monitor's autopsy replays a step of a loop that calls monitor.batch_start() before the "
                    "batch's forward, for its random state"
                )
            return
        if history.replays_stopped is not None:
            return  # history.unexamined says why
        try:
            if skipped is not None and self.autopsy and self._made < self.autopsy_limit:
                self._autopsy(skipped, replay, rng, count - 1, outputs, history)
            elif skipped is not None and self.autopsy:
                history.unexamined = f"the monitor had made the autopsy_limit={self.autopsy_limit} autopsies of the run"
            if self.headroom_interval and count % self.headroom_interval == 0:
                self.headroom = replay.headroom(rng, steps[-1].scale or 1.0)
                history.headroom.append((count - 1, self.headroom))
        except Unreplayable as refused:
            # A model a replay cannot take gradients of does not end the run: said once, in the summary too, and no
            # replay is tried again.
            if self.autopsy:  # else the summary keeps saying that the autopsy is off
                history.unexamined = f"the monitor's replays stopped at step {count - 1}: {refused}"
            history.replays_stopped = (count - 1, str(refused))
            rank_zero_warn(
                f"MixedPrecisionMonitor: no autopsy or headroom reading from step {count - 1} on: {refused}.",
                category=RuntimeWarning,
            )

    def _autopsy(
        self, result: StepResult, replay: Replay, rng: RngState, step: int, outputs: Any, history: AmpHistory
    ) -> None:
        applied_before = any(not record.skipped for record in history.steps if record.step < step)
        descending = not applied_before and replay.min_scale < (result.scale or 1.0)
        if descending and _finite_loss(outputs):
            return  # the scale coming down from init_scale: routine, and a replay would only say "scale"
        found = replay.autopsy(rng, result.scale or 1.0, step)
        # What the replay found, for the summary; None: finite at this scale, not a stable overflow of this batch.
        history.replayed[step] = None if found is None else found.kind
        if found is None:
            return  # not counted
        if descending and found.kind == "scale":
            return  # routine: not reported, not counted
        self._made += 1
        if any((earlier.kind, earlier.module) == (found.kind, found.module) for earlier in self.autopsies):
            return  # the same cause again (a fault that persists): said once
        self.autopsies.append(found)
        history.autopsies.append(found)
        rank_zero_warn(f"MixedPrecisionMonitor: {found.message}", category=RuntimeWarning)

    def headroom_metrics(self) -> dict[str, float]:
        """The latest reading as metrics, once (then forgotten), keyed ``amp/headroom/<layer>/<field>``."""
        if not self.headroom or self.headroom is self._logged:
            return {}
        self._logged = self.headroom
        metrics: dict[str, float] = {}
        for name, layer in self.headroom.items():
            prefix = f"amp/headroom/{name or 'model'}/"
            metrics[prefix + "act_absmax"] = layer.act_absmax
            metrics[prefix + "grad_absmax"] = layer.grad_absmax
            metrics[prefix + "grad_flushed_pct"] = layer.grad_flushed_pct
            metrics[prefix + "grad_subnormal_pct"] = layer.grad_subnormal_pct
            metrics[prefix + "headroom_bits"] = layer.headroom_bits[str(layer.dtype).removeprefix("torch.")]
        return metrics


class Replay:
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
    def of_fabric(cls, plugin: Any, model: nn.Module, run: Callable[[], Tensor]) -> Replay:
        """A Fabric loop's batch: ``run`` recomputes its loss with ``model`` (Fabric's wrapper is fine)."""
        module = unwrapped(model)  # the user's module: names as the user wrote them
        suspended = getattr(plugin, "autocast_suspended", nullcontext)
        return cls(module, run, _autocast_of(plugin), half_dtype(plugin.precision), _min_scale(plugin), suspended)

    def autopsy(self, rng: RngState, scale: float, step: int) -> Autopsy | None:
        """Where the batch's first inf/NaN started (``None`` if the replay is finite)."""
        with self._suspended(), _attributes_kept(self.model):
            return run_autopsy(
                self.model,
                self.run,
                rng=rng,
                scale=scale,
                step=step,
                dtype=self.dtype,
                autocast=self.autocast,
                min_scale=self.min_scale,
            )

    def headroom(self, rng: RngState, scale: float) -> dict[str, LayerHeadroom]:
        """Per-layer headroom from an FP32 replay of the batch."""
        with self._suspended(), _attributes_kept(self.model):
            return measure_headroom(self.model, self.run, scale=scale, dtype=self.dtype, rng=rng)


def trainer_replay(trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> Replay:
    """The replay of a Trainer's batch: its ``training_step`` again, its ``self.log`` calls silenced."""
    plugin: Any = trainer.precision_plugin  # one of ours (see MixedPrecisionMonitor.on_train_start)

    def run() -> Tensor:
        with _silenced(pl_module):  # a replay logs nothing: the run's metrics stay the run's
            output = pl_module.training_step(batch, batch_idx)
        loss = output.get("loss") if isinstance(output, dict) else output
        if not isinstance(loss, Tensor):
            raise RuntimeError("The replayed training_step returned no loss.")
        return loss

    return Replay(pl_module, run, _autocast_of(plugin), half_dtype(plugin.precision), _min_scale(plugin))


def _min_scale(plugin: Any) -> float:
    """The loss scale's floor (1.0 without a loss scale: a replay then scales nothing)."""
    loss_scale = plugin.engine.loss_scale
    return 1.0 if loss_scale is None else float(loss_scale.policy.min_scale)


def _autocast_of(plugin: Any) -> Callable[[], AbstractContextManager[Any]]:
    # The precision's own forward context, as the step ran it (its autocast, or bf16-true's dtype); a Fabric plugin's
    # even while its wrapper's is suspended for the replay.
    context: Callable[[], AbstractContextManager[Any]] = plugin.autocast_context_manager
    return context


def half_dtype(precision: str) -> torch.dtype:
    """The half dtype a replay computes in: fp16 for ``"16-mixed"``, else bf16."""
    return torch.float16 if precision == "16-mixed" else torch.bfloat16


@contextmanager
def _attributes_kept(model: nn.Module) -> Iterator[None]:
    """Put back what a replayed ``training_step`` may change besides parameters, buffers and gradients.

    ``numerics.replay.untouched`` restores those; a ``training_step`` also updates torchmetrics' states
    (``self.train_acc(preds, y)``), appends to lists (``self.outputs.append(loss)``) and counts in plain attributes
    (``self.seen += len(x)``). Restored here: every metric's states and update count, and each module's public
    attributes that are numbers, strings, ``None``, lists or dicts (the same list and dict objects, their items as
    they were: a shallow copy). Tensors held in other attributes are not copied.
    """
    saved = [(module, _attributes(module)) for module in model.modules()]
    try:
        yield
    finally:
        for module, attributes in saved:
            for name, (value, items) in attributes.items():
                setattr(module, name, value)
                if isinstance(value, list):
                    value[:] = items
                elif isinstance(value, dict):
                    value.clear()
                    value.update(items)


def _attributes(module: nn.Module) -> dict[str, tuple[Any, Any]]:
    """``{name: (the value, a shallow copy of its items)}`` for the attributes ``_attributes_kept`` restores."""
    kept: dict[str, tuple[Any, Any]] = {}
    for name, value in vars(module).items():
        if name.startswith("_") or name == "training":
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            kept[name] = (value, None)
        elif isinstance(value, list):
            kept[name] = (value, list(value))
        elif isinstance(value, dict):
            kept[name] = (value, dict(value))
    if isinstance(module, Metric):
        for name in module._defaults:  # the metric's states: tensors updated in place, or lists of tensors
            state = getattr(module, name)
            kept[name] = (state.clone(), None) if isinstance(state, Tensor) else (state, list(state))
        for name in ("_update_count", "_computed", "_forward_cache"):
            kept[name] = (getattr(module, name), None)
    return kept


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
