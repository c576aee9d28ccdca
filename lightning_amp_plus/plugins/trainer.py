"""``MixedPrecisionPlugin``: the Trainer's face of the step engine.

A ``lightning.pytorch.plugins.precision.Precision`` that adapts the Trainer's hooks to
:class:`~lightning_amp_plus.step.engine.StepEngine` (the numerics of a step: scale, unscale-check-measure, clip,
step or skip, update). Following one optimizer step: :meth:`MixedPrecisionPlugin.optimizer_step` here, then
``StepEngine.prepare`` / ``StepEngine.step`` / ``StepEngine.end_batch`` (``step/engine.py``), which call the passes of
``step/grads.py`` and the loss scale of ``step/policy.py``; ``docs/design.md`` shows the trace.

State owned here: the settings, the autocast device, whether a hook reads gradients before the step, the hooks that
keep ``keep_fp32`` modules in FP32, whether the batch's scale update is due (manual optimization), and under
``"fp8-mixed"`` the FP8 training (``fp8``, :mod:`~lightning_amp_plus.plugins.fp8`). The engine owns the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.optim import LBFGS, Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_amp_plus.plugins import fp8 as _fp8
from lightning_amp_plus.plugins import state as _plugin_state
from lightning_amp_plus.plugins.core import (
    DEFAULT_SKIPS,
    Readings,
    check_device_supports,
    checked_settings,
    default_device,
    engine_for,
    half_dtype,
    plugin_str,
    refuse_deepspeed,
)
from lightning_amp_plus.plugins.ranks import refuse_sharded_master_weights, set_up_ranks
from lightning_amp_plus.plugins.wrappers import unwrapped, user_names
from lightning_amp_plus.step.engine import StepEngine
from lightning_amp_plus.step.scaler import DynamicLossScaler
from lightning_amp_plus.step.spikes import SpikeGuard
from lightning_amp_plus.weights.fp8 import FP8Training
from lightning_amp_plus.weights.fp8.convert import Float8Config, Modules, Recipe
from lightning_amp_plus.weights.fp8.training import DEFAULT_CHECK_INTERVAL, DEFAULT_FALLBACK, DEFAULT_RECIPE
from lightning_amp_plus.weights.fp32_modules import compute_in_fp32
from lightning_amp_plus.weights.master import refuse_half_copies, refuse_half_masters, widen_model_

__all__ = ["MixedPrecisionPlugin", "skipped_steps"]

# Keys under which Lightning's own plugin (and Lightning 1.x's native AMP) stored a GradScaler state.
_FOREIGN_KEYS = ("MixedPrecision", "native_amp_scaling_state")


class MixedPrecisionPlugin(Readings, Precision):
    """Mixed-precision training with autocast, a from-scratch dynamic loss scaler, FP32 master weights, or bf16 weights.

    ``"16-mixed"`` runs forward under fp16 autocast and scales the loss with a :class:`DynamicLossScaler`;
    ``"bf16-mixed"`` runs under bf16 autocast without scaling; ``"bf16-true"`` holds the model in bf16 (the memory of
    Lightning's ``bf16-true``) and steps it with compensated updates (``compensation``), so updates too small for a
    bf16 weight are not lost; ``"fp8-mixed"`` is ``"bf16-mixed"`` with the eligible ``nn.Linear`` layers converted in
    place to torchao's FP8 training layers at set-up (``fp8_*`` options; the documentation's "FP8 training" page). In
    all of them, an optimizer step whose gradients hold inf/NaN is skipped: parameters and optimizer state stay
    untouched and, by default, so do the LR schedulers of that optimizer.

    Each optimizer step reads as the recipe: the closure runs (forward under autocast, backward of the scaled loss);
    the gradients are unscaled exactly once and checked; ``on_before_optimizer_step`` hooks and clipping (by norm, with
    the norm the check measured: ``clip_grad_norm_``'s result bit for bit; or by value) see them; the step is taken or
    skipped; the scale is updated once per training batch, also when several optimizers step in one batch under manual
    optimization. The norm is measured when something needs it (a clip, a hook that reads the gradients, a
    :class:`~lightning_amp_plus.MixedPrecisionMonitor`, a spike guard); otherwise the check is GradScaler's one pass and
    ``recent_steps[-1].grad_norm`` is ``None``.

    Args:
        precision: ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"fp8-mixed"`` (needs torchao:
            ``pip install "lightning-amp-plus[fp8]"``; CUDA from compute capability 8.9, or CPU, emulated).
        device: the autocast device type (``"cuda"``, ``"cpu"``, ``"mps"``); ``None`` takes the model's device at setup.
        scaler: the loss scaler for ``"16-mixed"`` (a default :class:`DynamicLossScaler` if ``None``); not for bf16.
        skip_nonfinite: with ``"bf16-mixed"``, skip steps whose gradients are non-finite (on by default). fp16 always
            checks, as loss scaling requires.
        hold_schedulers_on_skip: do not advance an LR scheduler when every step of its optimizer since its last
            step was skipped (on by default). Off, schedulers step as in Lightning's built-in plugin.
        max_consecutive_skips: skipped steps in a row after which training stops with a diagnosis (``None``: never;
            default 50). It configures the default fp16 scaler and the bf16 check; with your own ``scaler``, that
            scaler's limit applies, and a limit other than 50 passed here too must equal it.
        master_weights: every floating parameter is an FP32 master: a model built or loaded in fp16/bf16 is widened
            to FP32 before training, then trains as an FP32 model under ``*-mixed`` (autocast computes in half from
            the FP32 weights; hooks and callbacks see and change FP32 values). Under DDP the gradients are also
            all-reduced in the half dtype (half the bytes). See the documentation's "Master weights" page.
        keep_fp32: module types whose forward runs in FP32 (autocast off inside them, their inputs widened): for a
            layer whose fp16 output overflows, or that needs FP32 precision.
        compensation: with ``"bf16-true"``, how the bf16 weights keep updates smaller than their spacing:
            ``"kahan"`` (a bf16 buffer holds each update's rounding error; the default, ``"auto"``),
            ``"stochastic"`` (unbiased random rounding, no buffer) or ``None`` (Lightning's plain ``bf16-true``:
            such updates are lost). The model's own ``torch.optim.AdamW``, ``Adam`` or ``SGD`` is stepped so (others
            are refused at setup); its state keeps torch's format. Refused with the mixed precisions.
        rounding_seed: the seed of stochastic rounding's random stream (the same on every rank).
        spike_guard: a :class:`~lightning_amp_plus.SpikeGuard` that judges each step's finite gradient norm against
            the running statistics of the steps taken before it: a spike is skipped (counted as a skipped step, the
            LR schedulers held, the loss scale left alone) or clipped down to the guard's limit before any clipping of
            yours, by its ``action``. One guard per optimizer (the first is the one given); saved in checkpoints.
            Fused optimizers then take the unscale path (the norm is read on the host). Refused with
            ``skip_nonfinite=False`` (nothing measures the norm). See the documentation's "Spike guard" page.
        fp8_recipe: with ``"fp8-mixed"``, torchao's recipe: ``"tensorwise"`` (default), ``"rowwise"``,
            ``"rowwise_with_gw_hp"``, or a ``Float8LinearConfig``.
        fp8_modules: with ``"fp8-mixed"``, which eligible layers (exactly ``nn.Linear``, both weight dimensions
            divisible by 16) train in FP8: ``None`` (all), ``"auto"`` (torchao's speed filter) or a callable
            ``(module, name) -> bool`` (names as the LightningModule's ``named_modules()``).
        fp8_check_interval: with ``"fp8-mixed"``, read every FP8 cast's flushed and subnormal shares every this many
            optimizer steps (``plugin.fp8.checks``; the monitor shows them).
        fp8_fallback: with ``"fp8-mixed"``, a layer whose casts flush more than this percent at two readings in a
            row computes in bf16 from then on (a warning names it; the checkpoint records it); ``None``: warn only.

    Attributes:
        settings: the options above, checked (:class:`~lightning_amp_plus.plugins.core.Settings`).
        device: the autocast device type in use (the one given, or the model's, learnt at set-up).
        scaler: the :class:`DynamicLossScaler` (``None`` for bf16); ``trainer.scaler`` returns it. Assigning another
            scaler replaces it for every part of the step.
        engine: the :class:`~lightning_amp_plus.step.engine.StepEngine` doing the step's numerics.
        recent_steps: the last optimizer steps' results, newest last (up to 1024 kept).
        skipped_steps: the optimizer steps skipped since the start.
        fp8: under ``"fp8-mixed"``, the :class:`~lightning_amp_plus.weights.fp8.FP8Training` of the run (its
            ``layers``, ``fallen_back``, ``checks`` and ``nonfinite_layers()``: the FP8 layers whose casts met the
            NaN or inf of the last skipped step, the origin first); ``None`` otherwise.

    Examples:
        >>> from lightning import Trainer
        >>> plugin = MixedPrecisionPlugin("bf16-mixed", device="cpu")
        >>> trainer = Trainer(plugins=[plugin], accelerator="cpu", logger=False, enable_progress_bar=False)
        >>> trainer.precision, trainer.scaler
        ('bf16-mixed', None)
        >>> MixedPrecisionPlugin("16-mixed", master_weights=True).settings.master_weights
        True
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed", "bf16-true", "fp8-mixed"] = "16-mixed",
        device: str | None = None,
        scaler: DynamicLossScaler | None = None,
        *,
        skip_nonfinite: bool = True,
        hold_schedulers_on_skip: bool = True,
        max_consecutive_skips: int | None = DEFAULT_SKIPS,
        master_weights: bool = False,
        keep_fp32: Sequence[type[nn.Module]] | None = None,
        compensation: Literal["auto", "kahan", "stochastic"] | None = "auto",
        rounding_seed: int = 0,
        spike_guard: SpikeGuard | None = None,
        fp8_recipe: Recipe | Float8Config = DEFAULT_RECIPE,
        fp8_modules: Modules = None,
        fp8_check_interval: int = DEFAULT_CHECK_INTERVAL,
        fp8_fallback: float | None = DEFAULT_FALLBACK,
    ) -> None:
        name = type(self).__name__
        self.settings = checked_settings(
            name,
            precision,
            device,
            skip_nonfinite=skip_nonfinite,
            hold_schedulers_on_skip=hold_schedulers_on_skip,
            max_consecutive_skips=max_consecutive_skips,
            master_weights=master_weights,
            keep_fp32=keep_fp32,
            compensation=compensation,
            rounding_seed=rounding_seed,
            spike_guard=spike_guard,
            fp8_recipe=fp8_recipe,
            fp8_modules=fp8_modules,
            fp8_check_interval=fp8_check_interval,
            fp8_fallback=fp8_fallback,
        )
        self.precision = precision  # type: ignore[assignment]  # "fp8-mixed" is ours: trainer.precision reports it
        self.device = self.settings.device
        self.engine, self._scaler = engine_for(name, self.settings, scaler)
        self.fp8: FP8Training | None = _fp8.fp8_for(name, self.settings)
        self._half_weights = precision == "bf16-true"
        self._half_dtype = half_dtype(precision)
        self._hooks_read_gradients = True
        self._fp32_hooks: list[RemovableHandle] = []
        self._update_pending = False
        self._device_checked = False  # the slow-fp16-on-CPU warning is given once
        self._checkpoint_key = type(self).__qualname__

    def __str__(self) -> str:
        return plugin_str(self)  # names the fix where pytorch_lightning's Trainer refuses the plugin

    # -------------------------------------------------------------------------------------------------- set-up
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if getattr(unwrapped(module), "_trainer", None) is None:
            # Only Lightning Fabric converts a module that no Trainer holds (at `fabric.setup`, before any forward).
            raise TypeError(
                f"{type(self).__name__} is the Trainer's plugin; with Lightning Fabric use "
                f"lightning_amp_plus.fabric.MixedPrecisionPlugin({self.precision!r}) instead "
                "(`L.Fabric(plugins=[lightning_amp_plus.fabric.MixedPrecisionPlugin(...)])`)."
            )
        if self._half_weights:
            return module.to(dtype=torch.bfloat16)  # as Lightning's bf16-true: parameters and buffers
        if self.settings.master_weights and fitting(module):
            refuse_sharded_master_weights(type(self).__name__, module)
            # The masters are FP32: a model built in a half dtype is widened now, before DDP wraps it.
            widen_for_fit_(type(self).__name__, module)
        if self.fp8 is not None:
            # Before the optimizers are made (Lightning calls configure_optimizers after this hook); a model converted
            # already (validate or test after fit, a second fit) gains nothing.
            _fp8.convert_for(type(self).__name__, self.fp8, unwrapped(module))
        return module

    @override
    def tensor_init_context(self) -> AbstractContextManager[Any]:
        return _DtypeContextManager(torch.bfloat16) if self._half_weights else nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager[Any]:
        return self.tensor_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        if not self._half_weights:
            return data
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.bfloat16)

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        refuse_deepspeed(type(self).__name__, model, "Trainer")
        for optimizer in optimizers:
            self._refuse_lbfgs(optimizer)
        module = unwrapped(model)
        self._resolve_device(model)
        self.engine.set_optimizers(optimizers)
        self._hooks_read_gradients = _hooks_may_read_gradients(module)
        self._keep_modules_fp32(module)
        if self.settings.master_weights and isinstance(model, DistributedDataParallel) and fitting(module):
            self._compress_all_reduce(model)
        if self.engine.check:
            set_up_ranks(self.engine, list(module.parameters()), model)
            self.engine.name_parameters(user_names(module))
        if self.settings.hold_schedulers_on_skip and self.engine.check:  # nothing checked: no step is ever skipped
            for config in lr_schedulers:
                self.engine.held_schedulers.hold(getattr(config, "scheduler", config))
        return super().connect(model, optimizers, lr_schedulers)

    def _keep_modules_fp32(self, module: nn.Module) -> None:
        self._remove_fp32_hooks()
        self._fp32_hooks = compute_in_fp32(module, self.settings.keep_fp32, self.device or default_device())

    def _remove_fp32_hooks(self) -> None:
        for handle in self._fp32_hooks:
            handle.remove()
        self._fp32_hooks = []

    def _compress_all_reduce(self, model: DistributedDataParallel) -> None:
        # Master weights under DDP: the gradients travel in the half dtype (half the bytes), as DDP's hook compresses.
        fp16 = half_dtype(self.precision) == torch.float16
        hook = default_hooks.fp16_compress_hook if fp16 else default_hooks.bf16_compress_hook
        try:
            model.register_comm_hook(None, hook)  # None: the default process group
        except RuntimeError:
            rank_zero_warn(
                f"{type(self).__name__}(master_weights=True): the DDP model already has a communication hook, so its "
                "gradients are all-reduced as that hook does, not compressed to the half dtype.",
                category=UserWarning,
            )

    @override
    def teardown(self) -> None:
        self.engine.held_schedulers.release()
        self._remove_fp32_hooks()
        super().teardown()

    def _resolve_device(self, model: nn.Module) -> None:
        if self.device is None:
            param = next(model.parameters(), None)
            self.device = param.device.type if param is not None else "cpu"
        check_device_supports(type(self).__name__, self.device, self.precision, warn=not self._device_checked)
        self._device_checked = True

    def _refuse_lbfgs(self, optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, LBFGS) and self.engine.check:
            raise TypeError(
                f"{type(self).__name__}({self.precision!r}) cannot drive torch.optim.LBFGS: it re-evaluates the "
                "closure inside `step()`, where gradients cannot be checked or unscaled first. Use another "
                "optimizer, or MixedPrecisionPlugin('bf16-mixed', skip_nonfinite=False)."
            )

    # ---------------------------------------------------------------------------------------------- autocast
    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        # bf16-true: tensors made during forward default to bf16, as under Lightning's bf16-true. Mixed: autocast,
        # with cache_enabled=False as Lightning's own plugin (the cast cache breaks under activation checkpointing).
        if self._half_weights:
            with _DtypeContextManager(torch.bfloat16):
                yield
            return
        with torch.autocast(self.device or default_device(), dtype=self._half_dtype, cache_enabled=False):
            yield

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        if self.fp8 is not None:
            self.fp8.before_forward()  # a check step's readings start with its first micro-batch
        with self.forward_context():
            yield
        if self._update_pending:
            # Manual optimization: every opt.step() of this batch is done; update the scale once for all of them.
            self._update_pending = False
            self.engine.end_batch()

    # ----------------------------------------------------------------------------------------------- backward
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        # Hooks see the true loss; only backward sees the scaled one.
        return self.engine.scale_loss(super().pre_backward(tensor, module))

    # --------------------------------------------------------------------------------------------------- step
    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.settings.master_weights:
            self._refuse_half_masters(optimizer, model)  # a half tensor written into a master since the last step
        if not self.engine.check:
            checked = self._checked(closure, optimizer, model) if self.settings.master_weights else closure
            return super().optimizer_step(optimizer, model=model, closure=checked, **kwargs)
        closure_result = closure()  # forward under autocast, backward of the scaled loss
        if self.settings.master_weights:
            self._refuse_half_masters(optimizer, model)  # ...or during this step (training_step, backward hooks)
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: no backward ran. Hooks run (as Lightning's); nothing is stepped.
            self._after_closure(model, optimizer)
            self.engine.discard(optimizer)
            return None
        if self._hooks_read_gradients:
            # Unscaled, checked and measured now, because a hook may read them; otherwise in the step (where a fused
            # optimizer unscales in its own kernel: no host read).
            self.engine.prepare(optimizer)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping
        output = self.engine.step(optimizer, **kwargs)
        if self.fp8 is not None:
            _fp8.after_step(self.fp8, self.engine.result(optimizer))
        if model.automatic_optimization:
            self.engine.end_batch()
        else:
            self._update_pending = True
        return output

    def _refuse_half_masters(self, optimizer: Any, model: nn.Module) -> None:
        refuse_half_masters(type(self).__name__, optimizer, lambda: user_names(model))

    def _checked(self, closure: Callable[[], Any], optimizer: Any, model: nn.Module) -> Callable[[], Any]:
        """``closure``, then the master check (Lightning's own step runs the closure inside ``optimizer.step``)."""

        def checked() -> Any:
            result = closure()
            self._refuse_half_masters(optimizer, model)
            return result

        return checked

    # ------------------------------------------------------------------------------------------------ clipping
    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.engine.clip_by_norm(optimizer, float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.engine.clip_by_value(optimizer, float(clip_val))

    # --------------------------------------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        # The weights themselves are in checkpoint["state_dict"]: the model holds them (FP32, or bf16 for bf16-true).
        return _plugin_state.save_state(self.engine, self.settings, self.fp8)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _plugin_state.load_state(
            state_dict, self.engine, owner=self._checkpoint_key, settings=self.settings, fp8=self.fp8
        )

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._checkpoint_key in checkpoint:
            return  # ours (or a GradScaler state under the old class name): load_state_dict handles it
        for key in _FOREIGN_KEYS:
            if key in checkpoint:
                _plugin_state.load_grad_scaler_state(checkpoint[key], self.engine, key)
                return


def widen_for_fit_(name: str, module: nn.Module) -> None:
    """Widen a model built or loaded in half to FP32 masters at the Trainer's first precision hook, ``convert_module``.

    The Trainer runs the callbacks' and the LightningModule's ``setup`` before that hook, on the model as it was
    given: a half copy kept there (``StochasticWeightAveraging``'s, ``EMAWeightAveraging``'s, ``ModelPruning``'s lottery
    ticket) would later average or restore half values into the FP32 masters. So such a copy is refused first, naming
    the fix (``widen_model_(model)`` before ``fit``).
    """
    trainer = getattr(unwrapped(module), "_trainer", None)
    holders = [*getattr(trainer, "callbacks", []), unwrapped(module)]
    when = "in a `setup` hook (the Trainer runs those before any precision plugin hook)"
    refuse_half_copies(name, module, holders, when)
    widen_model_(module)


def _hooks_may_read_gradients(module: nn.Module) -> bool:
    """Whether an ``on_before_optimizer_step`` hook (the module's or a callback's) may read the gradients.

    Such hooks are promised unscaled gradients, so a fused optimizer then takes the guard's unscale path. Callbacks
    that declare ``reads_unscaled_gradients = False`` (``MixedPrecisionMonitor`` does) do not count.
    """
    if not isinstance(module, pl.LightningModule):
        return True
    if type(module).on_before_optimizer_step is not pl.LightningModule.on_before_optimizer_step:
        return True
    callbacks: list[pl.Callback] = getattr(module._trainer, "callbacks", [])
    return any(
        type(callback).on_before_optimizer_step is not pl.Callback.on_before_optimizer_step
        and getattr(callback, "reads_unscaled_gradients", True)
        for callback in callbacks
    )


def fitting(module: nn.Module, default: bool = True) -> bool:
    """Whether the Trainer that holds ``module`` is fitting (``Strategy.setup`` runs for validate/test/predict too)."""
    trainer = getattr(unwrapped(module), "_trainer", None)
    if trainer is None:
        return default
    return bool(trainer.state.fn == "fit")


def skipped_steps(source: pl.Trainer | Precision) -> int | None:
    """The optimizer steps the precision plugin skipped for non-finite gradients; ``None`` where it does not count them.

    ``source`` is a Trainer (its ``precision_plugin`` is read) or a precision plugin. This package's plugins count
    their skips (0 when they check nothing). A plugin with a loss scaler of its own (Lightning's
    ``MixedPrecision("16-mixed")`` and its ``torch.amp.GradScaler``, or another fp16 mixed plugin) skips steps without
    counting them: ``None``, not a number that may be wrong. Any other plugin never skips a step (``32-true``, bf16
    without a scaler): 0.

    Examples:
        >>> from lightning.pytorch.plugins.precision import MixedPrecision
        >>> skipped_steps(MixedPrecisionPlugin("bf16-mixed")), skipped_steps(MixedPrecision("16-mixed", "cpu"))
        (0, None)
        >>> skipped_steps(pl.Trainer(precision="32-true", logger=False))
        0
    """
    plugin = source.precision_plugin if isinstance(source, pl.Trainer) else source
    engine = getattr(plugin, "engine", None)
    if isinstance(engine, StepEngine):
        return engine.skipped_steps
    if getattr(plugin, "scaler", None) is not None or getattr(plugin, "precision", None) == "16-mixed":
        return None
    return 0
