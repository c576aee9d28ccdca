"""``MixedPrecisionPlugin``: the Lightning face of the scaler and of FP32 master weights.

A ``lightning.pytorch.plugins.precision.Precision`` subclass; the numerics live in
:mod:`lightning_amp_plus.numerics.scaler` (loss scaling, the gradient check) and
:mod:`lightning_amp_plus.numerics.master` (half copies of FP32 weights).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from contextlib import contextmanager
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_amp_plus.numerics import schedulers as _schedulers
from lightning_amp_plus.numerics.checks import COUNTER_MAX, check_bool, check_int
from lightning_amp_plus.numerics.master import (
    HalfCopies,
    managed_parameters,
    repeated_uses,
    rnn_modules,
    widen_to_fp32_,
)
from lightning_amp_plus.numerics.scaler import DynamicLossScaler
from lightning_amp_plus.numerics.sharding import Sharding, is_dtensor

__all__ = ["MixedPrecisionPlugin", "OptimizerStep", "skipped_steps"]

_PRECISIONS = ("16-mixed", "bf16-mixed")
_FORMAT = "lightning_amp_plus/1"
# Keys under which Lightning's own plugin (and Lightning 1.x's native AMP) stored a GradScaler state.
_FOREIGN_KEYS = ("MixedPrecision", "native_amp_scaling_state")
_RECENT_STEPS = 1024


# The default of `max_consecutive_skips`. With a scaler passed too, any other value must equal the scaler's own limit.
_DEFAULT_SKIPS = 50


class OptimizerStep:
    """What one optimizer step under :class:`MixedPrecisionPlugin` looked like (see ``recent_steps``).

    Read from the scaler's lazy outcome of the step: on the fused-optimizer path, which skips on the device, reading
    ``skipped`` (or another field but ``index`` and ``optimizer``) is the host read the step itself did not make.

    Attributes:
        index: the plugin's count of optimizer steps before this one (0 for the first step of the first fit).
        optimizer: the optimizer's position in ``trainer.optimizers``.
        scale: the loss scale this step's gradients carried (``None`` without a scaler).
        skipped: whether the step was skipped for non-finite gradients.
        grad_norm: the global norm of this optimizer's unscaled gradients (``None`` if not measured).
        overflow_params: on a skipped step, the parameters whose gradients were non-finite.
    """

    def __init__(
        self,
        index: int,
        optimizer: int,
        scale: float | None = None,
        skipped: bool = False,
        grad_norm: float | None = None,
        overflow_params: tuple[str, ...] = (),
        *,
        outcome: Any = None,
        scaled: bool = True,
    ) -> None:
        self.index = index
        self.optimizer = optimizer
        self._values = (scale, skipped, grad_norm, overflow_params)
        self._outcome = outcome
        self._scaled = scaled

    @property
    def scale(self) -> float | None:  # noqa: D102 (documented in the class docstring)
        if self._outcome is None:
            return self._values[0]
        return float(self._outcome.scale) if self._scaled else None

    @property
    def skipped(self) -> bool:  # noqa: D102
        return self._values[1] if self._outcome is None else bool(self._outcome.skipped)

    @property
    def grad_norm(self) -> float | None:  # noqa: D102
        return self._values[2] if self._outcome is None else self._outcome.grad_norm

    @property
    def overflow_params(self) -> tuple[str, ...]:  # noqa: D102
        return self._values[3] if self._outcome is None else tuple(self._outcome.overflow_params)

    def __repr__(self) -> str:
        return (
            f"OptimizerStep(index={self.index}, optimizer={self.optimizer}, scale={self.scale}, "
            f"skipped={self.skipped}, grad_norm={self.grad_norm})"
        )


class MixedPrecisionPlugin(Precision):
    """Mixed-precision training with autocast, a from-scratch dynamic loss scaler and optional FP32 master weights.

    ``"16-mixed"`` runs forward under fp16 autocast and scales the loss with a :class:`DynamicLossScaler`;
    ``"bf16-mixed"`` runs under bf16 autocast without scaling. In both, an optimizer step whose gradients hold inf/NaN
    is skipped: parameters and optimizer state stay untouched and, by default, so do the LR schedulers of that
    optimizer.

    Each optimizer step reads as the recipe: the closure runs (forward under autocast, backward of the scaled loss);
    the gradients are made ready (with master weights: FP32 weights and gradients back; then unscaled exactly once,
    checked and measured in one pass); ``on_before_optimizer_step`` hooks and clipping (by norm, reusing the measured
    norm, or by value) see them; the step is taken or skipped; the scale is updated once per training batch, also
    when several optimizers step in one batch under manual optimization.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: the autocast device type (``"cuda"``, ``"cpu"``, ``"mps"``); ``None`` takes the model's device at setup.
        scaler: the loss scaler for ``"16-mixed"`` (a default :class:`DynamicLossScaler` if ``None``); not for bf16.
        skip_nonfinite: with ``"bf16-mixed"``, skip steps whose gradients are non-finite (on by default). fp16 always
            checks, as loss scaling requires.
        hold_schedulers_on_skip: do not advance an LR scheduler when every step of its optimizer since its last
            step was skipped (on by default). Off, schedulers step as in Lightning's built-in plugin.
        max_consecutive_skips: skipped steps in a row after which training stops with a diagnosis (``None``: never;
            default 50). It configures the default fp16 scaler and the bf16 check; with your own ``scaler``, that
            scaler's limit applies, and a limit other than 50 passed here too must equal it.
        master_weights: keep FP32 master weights and compute in the half dtype (see the README's "FP32 master
            weights"): in a single process the model's parameters hold FP32 between optimizer steps and a half copy,
            made once per step, for forward and backward; under DDP the gradients are all-reduced in the half dtype.
        half_modules: with ``master_weights``, the module types whose own parameters compute from half copies
            (``None``: the layers autocast runs in half,
            :func:`~lightning_amp_plus.numerics.master.default_half_modules`: Linear, Conv, attention, RNNs;
            ``(nn.Module,)``: every floating parameter). All others stay FP32.
        keep_fp32: with ``master_weights``, module types whose whole subtree stays FP32 anyway (e.g. a discriminator
            applied twice per loss, see the README).
        fp32_grad_accumulation: with ``master_weights`` and gradient accumulation, sum the micro-batches' half
            gradients in FP32, as ``*-mixed`` does (the default; 4 bytes per parameter between micro-batches).
            ``False`` sums them in the half dtype (2 bytes).

    Attributes:
        scaler: the :class:`DynamicLossScaler` (``None`` for bf16); ``trainer.scaler`` returns it. Assigning another
            scaler replaces it for every part of the step.
        recent_steps: the last optimizer steps, newest last (:class:`OptimizerStep`; up to 1024 kept).

    Example:
        >>> from lightning import Trainer
        >>> plugin = MixedPrecisionPlugin("bf16-mixed", device="cpu")
        >>> trainer = Trainer(plugins=[plugin], accelerator="cpu", logger=False, enable_progress_bar=False)
        >>> trainer.precision, trainer.scaler
        ('bf16-mixed', None)
        >>> MixedPrecisionPlugin("16-mixed", master_weights=True).master_weights
        True
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: str | None = None,
        scaler: DynamicLossScaler | None = None,
        *,
        skip_nonfinite: bool = True,
        hold_schedulers_on_skip: bool = True,
        max_consecutive_skips: int | None = _DEFAULT_SKIPS,
        master_weights: bool = False,
        half_modules: Sequence[type[nn.Module]] | None = None,
        keep_fp32: Sequence[type[nn.Module]] | None = None,
        fp32_grad_accumulation: bool = True,
    ) -> None:
        name = type(self).__name__
        if precision not in _PRECISIONS:
            raise ValueError(f"`{name}(precision={precision!r})` is not supported: use '16-mixed' or 'bf16-mixed'.")
        if device is not None and (not isinstance(device, str) or device.split(":")[0] not in ("cuda", "cpu", "mps")):
            raise ValueError(f"`{name}(device={device!r})` is not supported: use 'cuda', 'cpu', 'mps' or None (auto).")
        for option, value in (
            ("skip_nonfinite", skip_nonfinite),
            ("hold_schedulers_on_skip", hold_schedulers_on_skip),
            ("master_weights", master_weights),
            ("fp32_grad_accumulation", fp32_grad_accumulation),
        ):
            check_bool(name, option, value)
        _check_skip_limit(name, max_consecutive_skips)
        _check_master_options(name, master_weights, half_modules, keep_fp32, fp32_grad_accumulation)
        self.precision = precision
        self.device = None if device is None else device.split(":")[0]
        self.master_weights = master_weights
        self.half_modules: tuple[type[nn.Module], ...] | None = None if half_modules is None else tuple(half_modules)
        self.keep_fp32: tuple[type[nn.Module], ...] = () if keep_fp32 is None else tuple(keep_fp32)
        self.fp32_grad_accumulation = fp32_grad_accumulation
        self.hold_schedulers_on_skip = hold_schedulers_on_skip
        self._skip_limit = None if max_consecutive_skips is None else int(max_consecutive_skips)
        self._skip_limit_given = max_consecutive_skips != _DEFAULT_SKIPS
        self._scaler: DynamicLossScaler | None = None
        self._checker: DynamicLossScaler | None = None
        self._param_names: list[tuple[str, Tensor]] = []
        if precision == "16-mixed" and scaler is None:
            self._set_scaler(DynamicLossScaler(max_consecutive_skips=self._skip_limit), "")
        elif scaler is not None:
            self._set_scaler(scaler, f"`{name}(precision={precision!r}, scaler={scaler!r})`")
        elif skip_nonfinite:
            # A scale pinned at 1: the same check-and-skip machinery, no multiply.
            self._checker = DynamicLossScaler(
                init_scale=1.0, min_scale=1.0, max_scale=1.0, max_consecutive_skips=self._skip_limit
            )
        self._ledger = _schedulers.StepLedger()
        self._held: list[Any] = []
        self._update_pending = False
        # Master weights: the half copies of a single-process model (None under DDP, which all-reduces in half).
        self._copies: HalfCopies | None = None
        self._module: nn.Module | None = None
        self._step_open = False  # between the first micro-batch of a step and its optimizer step
        self._batches_narrowed = 0
        self._optimizer_index: dict[int, int] = {}
        self._steps_taken = 0
        self._last_outcome: dict[int, Any] = {}
        self.recent_steps: deque[OptimizerStep] = deque(maxlen=_RECENT_STEPS)
        self._hooks_read_gradients = True

    # ------------------------------------------------------------------------------------------------ the scaler
    @property
    def scaler(self) -> DynamicLossScaler | None:
        """The loss scaler (``None`` for bf16). Assigning one makes it scale, unscale, check and update alike."""
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: DynamicLossScaler | None) -> None:
        self._set_scaler(scaler, f"`{type(self).__name__}.scaler = {scaler!r}`")

    def _set_scaler(self, scaler: DynamicLossScaler | None, where: str) -> None:
        if self.precision == "bf16-mixed":
            if scaler is None:
                return
            raise ValueError(
                f"{where}: bf16 has fp32's range and needs no loss scaling. Drop `scaler`, or use precision='16-mixed'."
            )
        if not isinstance(scaler, DynamicLossScaler):
            raise TypeError(
                f"{where}: fp16 needs a lightning_amp_plus.DynamicLossScaler. To migrate from torch.amp.GradScaler, "
                "load its state: `DynamicLossScaler().load_state_dict(grad_scaler.state_dict())`."
            )
        if self._skip_limit_given and scaler.max_consecutive_skips != self._skip_limit:
            raise ValueError(
                f"{where}: the scaler's max_consecutive_skips={scaler.max_consecutive_skips!r} differs from "
                f"MixedPrecisionPlugin(max_consecutive_skips={self._skip_limit!r}): set the limit in one place, e.g. "
                f"DynamicLossScaler(..., max_consecutive_skips={self._skip_limit!r})."
            )
        previous = self._checker
        if previous is not None and previous is not scaler:
            # Assigned after set-up (as users do with Lightning's plugin): the new scaler reduces where the old one did
            # and names the same parameters.
            scaler.process_group, scaler.sharding = previous.process_group, previous.sharding
            scaler.set_parameter_names(self._param_names)
        self._scaler = self._checker = scaler

    # ------------------------------------------------------------------------------------------------ visibility
    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients since the start (0 when nothing is checked)."""
        return 0 if self._checker is None else self._checker.skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped."""
        return self._checker is not None and self._checker.last_step_skipped

    @property
    def last_grad_norm(self) -> float | None:
        """The global norm of the unscaled gradients at the last step (measured by the check; ``None`` if unchecked)."""
        return None if self._checker is None else self._checker.last_grad_norm

    @property
    def skip_nonfinite(self) -> bool:
        """Whether steps with non-finite gradients are skipped (always for fp16; by default for bf16)."""
        return self._checker is not None

    @property
    def last_overflow_params(self) -> list[str]:
        """Names of the parameters whose gradients were non-finite at the last skipped step."""
        return [] if self._checker is None else self._checker.last_overflow_params

    @property
    def min_scale(self) -> float | None:
        """The scaler's floor (``None`` without a scaler)."""
        return None if self._scaler is None else self._scaler.min_scale

    @property
    def held_scheduler_steps(self) -> int:
        """Scheduler steps held back because every step of their optimizer since the last one was skipped."""
        return self._ledger.held_steps

    @property
    def steps_taken(self) -> int:
        """Optimizer steps this plugin has driven (applied or skipped), over every fit."""
        return self._steps_taken

    @property
    def mp_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for master weights under ``ModelParallelStrategy``: FP32 shards, half math.

        Pass it to ``fully_shard(..., mp_policy=self.trainer.precision_plugin.mp_policy)`` in ``configure_model``:
        the FP32 sharded parameters are then the masters the optimizer steps, the forward and backward run on
        all-gathered half copies, and the gradients are reduce-scattered in FP32.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.half_dtype, reduce_dtype=torch.float32)

    @property
    def half_dtype(self) -> torch.dtype:
        """The autocast dtype (and, with ``master_weights``, the compute dtype): fp16 or bf16."""
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16

    # -------------------------------------------------------------------------------------------------- set-up
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.master_weights and _fitting(module):
            # The masters are FP32: parameters built in a half dtype are widened now, before DDP wraps the model.
            widen_to_fp32_(managed_parameters(module, self.half_modules, self.keep_fp32))
        return module

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        self._refuse_deepspeed(model)
        self._resolve_device(model)
        module = _unwrap(model)
        for optimizer in optimizers:
            self._refuse_lbfgs(optimizer)
        self._optimizer_index = {id(_inner(opt)): index for index, opt in enumerate(optimizers)}
        self._hooks_read_gradients = _hooks_may_read_gradients(module)
        self._param_names = _user_names(module)  # for diagnostics: the scaler's overflow names, master-weight warnings
        if self.master_weights and _fitting(module, default=bool(optimizers)):
            self._set_up_master_weights(model, module)
        if self._checker is not None:
            sharding = _sharding_of(model, module)
            if sharding is not None:
                # Each rank holds a shard: one weighted SUM over the world gives the norm and the skip decision.
                self._checker.sharding = sharding
            elif _world_size() > 1 and self._checker.process_group is None:
                # One skip decision for all ranks: an overflow seen on one rank only (a rank-local fault, unused
                # parameters) must skip the step everywhere, or the replicas drift apart.
                self._checker.process_group = torch.distributed.group.WORLD
            self._checker.set_parameter_names(self._param_names)
        if self.hold_schedulers_on_skip and self._checker is not None:
            for config in lr_schedulers:
                scheduler = getattr(config, "scheduler", config)
                _schedulers.hold(scheduler, self._ledger)
                self._held.append(scheduler)
        return super().connect(model, optimizers, lr_schedulers)

    def _set_up_master_weights(self, model: nn.Module, module: nn.Module) -> None:
        sharded = [name for name, p in module.named_parameters() if _is_dtensor(p)]
        if sharded:
            raise ValueError(
                f"{type(self).__name__}(master_weights=True) does not apply to sharded (DTensor) parameters "
                f"({', '.join(sharded[:3])}, ...): under ModelParallelStrategy the FP32 shards are the master weights. "
                "Compute in half through FSDP2's own policy instead: `fully_shard(module, mp_policy=plugin.mp_policy)` "
                "in configure_model, with master_weights=False."
            )
        if isinstance(model, DistributedDataParallel):
            # DDP's reducer follows each parameter's gradient accumulator, which a change of the parameter's dtype
            # replaces: under DDP the parameters stay FP32 (autocast casts them per op) and the gradients travel in
            # the half dtype instead, compressed by a DDP communication hook (half the bytes).
            self._compress_all_reduce(model)
            return
        if model is not module or _world_size() > 1:
            raise TypeError(
                f"{type(self).__name__}(master_weights=True) runs in a single process or under DDP "
                f"(strategy='ddp'), not under {type(model).__name__}. Use a DDP strategy, or master_weights=False."
            )
        params = managed_parameters(module, self.half_modules, self.keep_fp32)
        self._batches_narrowed = 0
        self._module = module
        self._step_open = False
        self._copies = HalfCopies(params, self.half_dtype, rnn_modules(module))
        self._copies.hook_state_dicts(module)

    def _compress_all_reduce(self, model: DistributedDataParallel) -> None:
        fp16 = self.half_dtype == torch.float16
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
        for scheduler in self._held:
            _schedulers.release(scheduler)
        self._held.clear()
        if self._copies is not None:
            # After fit the model holds its FP32 weights (and FP32 gradients), as an FP32 model would.
            self._copies.widen_()
            self._copies.unhook()
            self._copies = None
        super().teardown()

    def _resolve_device(self, model: nn.Module) -> None:
        if self.device is None:
            param = next(model.parameters(), None)
            self.device = param.device.type if param is not None else "cpu"
        if self.device == "cuda" and self.precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
            raise ValueError(
                f"`{type(self).__name__}(precision='bf16-mixed')`: this GPU ({torch.cuda.get_device_name()}) does not "
                "support bfloat16. Use precision='16-mixed'."
            )
        if self.device == "cpu" and self.precision == "16-mixed":
            rank_zero_warn(
                "MixedPrecisionPlugin('16-mixed') on CPU: fp16 autocast is correct there but slow (many times slower "
                "than fp32 on most CPUs). For speed on CPU prefer 'bf16-mixed' or 32-bit.",
                category=UserWarning,
            )

    def _refuse_deepspeed(self, model: nn.Module) -> None:
        # Lightning checks the plugin type for FSDP and XLA, not for DeepSpeed, whose engine does its own fp16/bf16,
        # loss scaling and master weights: two scalers on one model would corrupt each other silently.
        if type(model).__module__.split(".")[0] == "deepspeed":
            raise TypeError(
                f"{type(self).__name__} cannot run under DeepSpeed: its engine does its own mixed precision and loss "
                "scaling. Use Trainer(strategy='deepspeed', precision='16-mixed' or 'bf16-mixed') without this plugin."
            )

    def _refuse_lbfgs(self, optimizer: Any) -> None:
        if isinstance(_inner(optimizer), LBFGS) and (self._checker is not None or self.master_weights):
            raise TypeError(
                f"{type(self).__name__}({self.precision!r}) cannot drive torch.optim.LBFGS: it re-evaluates the "
                "closure inside `step()`, where gradients cannot be checked, unscaled or widened first. Use another "
                "optimizer, or MixedPrecisionPlugin('bf16-mixed', skip_nonfinite=False) without master_weights."
            )

    # ---------------------------------------------------------------------------------------------- autocast
    def autocast_context_manager(self) -> torch.autocast:
        """The ``torch.autocast`` context for this precision and device."""
        # cache_enabled=False as Lightning's own plugin: the cast cache breaks under activation checkpointing.
        return torch.autocast(self.device or _default_device(), dtype=self.half_dtype, cache_enabled=False)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self.autocast_context_manager():
            yield

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        if self._copies is not None:
            # The step's half copies, made once whatever the number of micro-batches. At the start of a step under
            # automatic optimization, the last step's gradients would be zeroed before the next backward: freed now,
            # they stay out of the forward's memory.
            self._copies.narrow_(drop_grads=not self._step_open and self._zeroed_before_backward())
            self._step_open = True
            self._batches_narrowed += 1
        with self.forward_context():
            yield
        if self._update_pending:
            # Manual optimization: every opt.step() of this batch is done; update the scale once for all of them.
            if self._checker is not None:
                self._checker.update()
            self._update_pending = False
            if self._copies is not None:
                self._copies.widen_idle_()

    # ----------------------------------------------------------------------------------------------- backward
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self._copies is not None:
            if self.fp32_grad_accumulation:
                # A backward that adds to earlier micro-batches' half gradients adds in FP32 (as *-mixed): widened
                # here, not after each backward, so a step without accumulation never holds both half copies and
                # FP32 gradients.
                self._copies.widen_grads_()
            if self._batches_narrowed <= 1:
                self._warn_repeated_uses(tensor)
        # Hooks see the true loss; only backward sees the scaled one. Precision's own hook (the on_before_backward
        # calls), named: under FSDP the next class along is FSDPPrecision, whose hook would scale a second time.
        tensor = Precision.pre_backward(self, tensor, module)
        return tensor if self._scaler is None else self._scaler.scale(tensor)

    def _warn_repeated_uses(self, loss: Tensor) -> None:
        """Once per fit (its first batch): name the half copies that this backward will sum gradients into."""
        copies = self._copies
        assert copies is not None
        uses = repeated_uses(loss, [p for p in copies.params if copies.holds_half(p)])
        if not uses:
            return
        names = {id(param): name for name, param in self._param_names}
        listed = ", ".join(f"{names.get(id(p), '?')} ({n} uses)" for p, n in list(uses.items())[:8])
        more = f" and {len(uses) - 8} more" if len(uses) > 8 else ""
        rank_zero_warn(
            f"{type(self).__name__}(master_weights=True): {listed}{more} feed this loss more than once, so autograd "
            f"sums their gradients in {str(self.half_dtype).removeprefix('torch.')} (one rounding per extra use), "
            "where Lightning's *-mixed sums them in FP32. To sum them in FP32, keep their modules FP32 "
            "(keep_fp32=(YourModule,)), or use each once per loss (e.g. one forward over a concatenated batch).",
            category=UserWarning,
        )

    # --------------------------------------------------------------------------------------------------- step
    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self._checker is None and self._copies is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self._refuse_lbfgs(optimizer)
        closure_result = closure()  # forward under autocast, backward of the scaled loss
        if closure_result is None and model.automatic_optimization:
            return self._no_step(optimizer, model)  # training_step returned None: no backward ran
        # FP32 weights and gradients; unscaled, checked and measured once: here when a hook may read them, else in the
        # scaler's step (where a fused optimizer's own kernel unscales them: no host read in the step).
        self._prepare_grads(optimizer, unscale=self._hooks_read_gradients)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping
        return self._step_with_ready_grads(optimizer, model, **kwargs)

    def _prepare_grads(self, optimizer: Optimizer, unscale: bool = True) -> None:
        """Bring the step's gradients to where the optimizer reads them, unscaled and checked: once per step.

        With ``unscale=False`` (nothing before the step reads them) they stay scaled and the scaler's ``step`` takes
        its own path: a fused optimizer (``Adam/AdamW/SGD/Adagrad(fused=True)``) unscales them in its kernel and skips
        on the device; any other is unscaled and checked there, in the same pass over the parameters.
        """
        if self._copies is not None:
            self._copies.widen_(_params_of(optimizer))
        if self._checker is not None and unscale:
            self._checker.unscale_(optimizer)

    def _step_with_ready_grads(self, optimizer: Optimizer, model: pl.LightningModule, **kwargs: Any) -> Any:
        """Step (or skip) with the prepared gradients; count the step; update the scale once per batch."""
        if self._checker is None:
            output = optimizer.step(**kwargs)
        else:
            try:
                output = self._checker.step(optimizer, **kwargs)
            finally:
                self._record_step(optimizer)
            if model.automatic_optimization:
                self._checker.update()
        if not model.automatic_optimization:
            self._update_pending = True
        elif self._copies is not None:
            self._copies.widen_idle_()  # frozen parameters: FP32 again until the next step
        self._step_open = False
        return output

    def _no_step(self, optimizer: Optimizer, model: pl.LightningModule) -> None:
        """A batch that reached the optimizer without a backward: hooks run (as Lightning's), nothing is stepped."""
        self._after_closure(model, optimizer)
        if self._checker is not None:
            self._checker.discard(optimizer)  # the next step is unscaled and checked afresh
        if self._copies is not None:
            self._copies.widen_idle_()
        self._step_open = False

    def _zeroed_before_backward(self) -> bool:
        """Whether Lightning will zero the gradients before the next backward (automatic optimization, as shipped).

        Not when the module overrides ``optimizer_zero_grad`` (it may keep them), nor while Lightning skips backward
        altogether (``StochasticWeightAveraging``'s batch-norm epoch, which then steps with the gradients left).
        """
        module = self._module
        if not isinstance(module, pl.LightningModule) or not module.automatic_optimization:
            return False
        if type(module).optimizer_zero_grad is not pl.LightningModule.optimizer_zero_grad:
            return False
        trainer = module._trainer
        return trainer is None or not getattr(trainer.fit_loop, "_skip_backward", False)

    def _record_step(self, optimizer: Optimizer) -> None:
        """Note the step for the schedulers and in ``recent_steps``, without reading its outcome (it may be pending)."""
        checker = self._checker
        assert checker is not None
        outcome = checker.outcome(optimizer)
        if outcome is None or outcome is self._last_outcome.get(id(optimizer)):
            return  # the step did not get as far as the scaler's record of it (an error before)
        self._last_outcome[id(optimizer)] = outcome
        if self._held:
            self._ledger.record_outcome(optimizer, outcome)
        index = self._optimizer_index.get(id(optimizer), 0)
        self.recent_steps.append(
            OptimizerStep(self._steps_taken, index, outcome=outcome, scaled=self._scaler is not None)
        )
        self._steps_taken += 1

    # ------------------------------------------------------------------------------------------------ clipping
    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # `LightningModule.clip_gradients` passes the wrapper, `optimizer_step` the optimizer inside it: unwrap, so
        # that both reach the scaler's record of the same optimizer and the gradients are unscaled only once.
        optimizer = _inner(optimizer)
        if clip_val <= 0:
            return  # Lightning asks at every step; nothing to clip, so the gradients may stay as they are (fused path)
        # Under manual optimization users clip before opt.step(): prepare first (a no-op if already done).
        self._prepare_grads(optimizer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self._checker is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self._checker.clip_grad_norm_(optimizer, float(clip_val))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self._checker is not None and self._checker.found_inf(optimizer):
            return  # non-finite gradients: the step will be skipped, so there is nothing worth clipping
        if all(param.grad is None for param in _params_of(optimizer)):
            return  # no backward reached them (torch's clip_grad_value_ fails on an empty list)
        super().clip_grad_by_value(optimizer, clip_val)

    # --------------------------------------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        if self._checker is None:
            return {}
        # The FP32 weights themselves are in checkpoint["state_dict"]: the model holds them (see numerics.master).
        return {
            "format": _FORMAT,
            "precision": self.precision,
            "master_weights": self.master_weights,
            "held_scheduler_steps": self._ledger.held_steps,
            "scaler": self._checker.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"The checkpoint's {type(self).__name__} state is a {type(state_dict).__name__}, not a dict."
            )
        if "format" not in state_dict and "scale" in state_dict:
            self._load_grad_scaler_state(state_dict, "MixedPrecisionPlugin")
            return
        if state_dict.get("format") != _FORMAT or "scaler" not in state_dict or "precision" not in state_dict:
            raise ValueError(self._unreadable_state(state_dict))
        self._check_saved_setting(state_dict, "precision", self.precision)
        self._check_saved_setting(state_dict, "master_weights", self.master_weights)
        held = _saved_count(state_dict, "held_scheduler_steps", type(self).__qualname__)
        if self._checker is not None:
            self._checker.load_state_dict(state_dict["scaler"])
        self._ledger.held_steps = held

    def _check_saved_setting(self, state_dict: dict[str, Any], key: str, mine: object) -> None:
        if key not in state_dict:
            return  # written before the setting was saved: nothing to compare
        saved = state_dict[key]
        if type(saved) is not type(mine) or saved != mine:
            # As the constructor reads: the precision positionally, the other settings by keyword.
            then, now = (repr(saved), repr(mine)) if key == "precision" else (f"{key}={saved!r}", f"{key}={mine!r}")
            raise ValueError(
                f"The checkpoint was trained with MixedPrecisionPlugin({then}), this run uses {now}. "
                f"Resume with {key}={saved!r}, or delete checkpoint['{type(self).__qualname__}'] to start this "
                "setting with a fresh scaler."
            )

    def _unreadable_state(self, state_dict: dict[str, Any]) -> str:
        keys = sorted(map(str, state_dict))  # keys of any type: the message must not fail itself
        if "format" not in state_dict:
            problem = f"has keys {keys} and no 'format'"
        elif state_dict["format"] != _FORMAT:
            problem = f"has format={state_dict['format']!r}, which this version does not read ('{_FORMAT}')"
        else:
            missing = [key for key in ("precision", "scaler") if key not in state_dict]
            problem = f"lacks {', '.join(repr(key) for key in missing)}"
        return (
            f"The checkpoint's {type(self).__name__} state {problem}: expected a '{_FORMAT}' state with 'precision' "
            "and 'scaler', or a GradScaler state. Remove that key from the checkpoint to start with a fresh scaler."
        )

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if type(self).__qualname__ in checkpoint:
            return  # ours (or a GradScaler state under the old class name): load_state_dict handles it
        for key in _FOREIGN_KEYS:
            if key in checkpoint:
                self._load_grad_scaler_state(checkpoint[key], key)
                return

    def _load_grad_scaler_state(self, state: dict[str, Any], key: str) -> None:
        if self._scaler is None:
            rank_zero_warn(
                f"The checkpoint holds an fp16 GradScaler state under {key!r}; bf16 uses no scaler: ignored."
            )
            return
        if not isinstance(state, dict):
            raise TypeError(
                f"The checkpoint's {key!r} entry is a {type(state).__name__}, not a GradScaler state dict. Remove "
                "that key from the checkpoint to start with a fresh scaler."
            )
        self._scaler.load_state_dict(state)


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _inner(optimizer: Any) -> Any:
    """The optimizer inside Lightning's ``LightningOptimizer`` wrapper (or the optimizer itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _hooks_may_read_gradients(module: nn.Module) -> bool:
    """Whether an ``on_before_optimizer_step`` hook (the module's or a callback's) may read the gradients.

    Such hooks are promised unscaled gradients, so a fused optimizer then takes the scaler's unscale path. Callbacks
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


def _params_of(optimizer: Optimizer) -> Iterable[Tensor]:
    return (param for group in optimizer.param_groups for param in group["params"])


def _is_dtensor(param: Tensor) -> bool:
    return is_dtensor(param) or is_dtensor(param.data)


def _sharding_of(model: nn.Module, module: nn.Module) -> Sharding | None:
    """How the gradients are spread over the ranks: ``None`` unless sharded (FSDP's flat shards, FSDP2's DTensors)."""
    world = _world_size()
    if any(_is_dtensor(param) for param in module.parameters()):
        # FSDP2: DTensor gradients say where they live; a parameter left as a plain tensor is on every rank.
        return Sharding(replicas=world)
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    if isinstance(model, FullyShardedDataParallel):
        # FSDP1: a FULL_SHARD / SHARD_GRAD_OP shard lives on one rank, a NO_SHARD one on all, a HYBRID_SHARD one on
        # every replica of the shard group.
        if model.sharding_strategy == ShardingStrategy.NO_SHARD:
            return Sharding(replicas=world)
        group = model.process_group
        return Sharding(replicas=world if group is None else world // group.size())
    return None


def _user_names(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameter names as the user wrote them (without FSDP's wrapper prefixes), for diagnostics."""
    return [(name.replace("_fsdp_wrapped_module.", ""), param) for name, param in module.named_parameters()]


def _fitting(module: nn.Module, default: bool = True) -> bool:
    """Whether the Trainer that holds ``module`` is fitting (``Strategy.setup`` runs for validate/test/predict too)."""
    trainer = getattr(_unwrap(module), "_trainer", None)
    if trainer is None:
        return default
    return bool(trainer.state.fn == "fit")


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and Lightning wrappers.

    Unwrapping stops at the LightningModule: a ``module`` attribute there is the user's own submodule.
    """
    inner: nn.Module = model
    while not isinstance(inner, pl.LightningModule) and isinstance(getattr(inner, "module", None), nn.Module):
        inner = cast(nn.Module, inner.module)
    return inner


def _check_skip_limit(name: str, value: object) -> None:
    if value is not None:
        hint = " (skipped steps in a row before training stops with a diagnosis), or None to never stop"
        check_int(name, "max_consecutive_skips", value, minimum=1, hint=hint)


def _saved_count(state: dict[str, Any], key: str, owner: str) -> int:
    value = state.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"The checkpoint's {owner} state holds {key}={value!r} ({type(value).__name__}); expected an int >= 0. "
            f"Remove checkpoint['{owner}'] to start with a fresh scaler."
        )
    if not 0 <= value <= COUNTER_MAX:
        raise ValueError(
            f"The checkpoint's {owner} state holds {key}={value}; expected an int in [0, 2**62]. "
            f"Remove checkpoint['{owner}'] to start with a fresh scaler."
        )
    return value


def _check_master_options(
    name: str,
    master_weights: bool,
    half_modules: Sequence[type[nn.Module]] | None,
    keep_fp32: Sequence[type[nn.Module]] | None,
    fp32_grad_accumulation: bool,
) -> None:
    if master_weights:
        for option, value, example in (("half_modules", half_modules, "nn.Linear"), ("keep_fp32", keep_fp32, "MyHead")):
            if value is not None and (
                isinstance(value, (str, bytes))
                or not isinstance(value, Sequence)
                or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in value)
            ):
                raise TypeError(
                    f"`{name}({option}={value!r})` must be a sequence of nn.Module subclasses, e.g. ({example},)."
                )
        return
    settings: tuple[tuple[str, object, object], ...] = (
        ("half_modules", half_modules, None),
        ("keep_fp32", keep_fp32, None),
        ("fp32_grad_accumulation", fp32_grad_accumulation, True),
    )
    for option, given, default in settings:
        if given != default:
            raise ValueError(
                f"`{name}({option}={given!r})` applies to FP32 master weights only: add master_weights=True, or "
                f"drop {option}."
            )


def skipped_steps(source: pl.Trainer | Precision) -> int | None:
    """The optimizer steps the precision plugin skipped for non-finite gradients; ``None`` where it does not count them.

    ``source`` is a Trainer (its ``precision_plugin`` is read) or a precision plugin. :class:`MixedPrecisionPlugin`
    counts its skips (:attr:`~MixedPrecisionPlugin.skipped_steps`, 0 when it checks nothing). A plugin with a loss
    scaler of its own (Lightning's ``MixedPrecision("16-mixed")`` and its ``torch.amp.GradScaler``, or another fp16
    mixed plugin) skips steps without counting them: ``None``, not a number that may be wrong. Any other plugin never
    skips a step (``32-true``, bf16 without a scaler): 0.

    Example:
        >>> from lightning.pytorch.plugins.precision import MixedPrecision
        >>> skipped_steps(MixedPrecisionPlugin("bf16-mixed")), skipped_steps(MixedPrecision("16-mixed", "cpu"))
        (0, None)
        >>> skipped_steps(pl.Trainer(precision="32-true", logger=False))
        0
    """
    plugin = source.precision_plugin if isinstance(source, pl.Trainer) else source
    if isinstance(plugin, MixedPrecisionPlugin):
        return plugin.skipped_steps
    if getattr(plugin, "scaler", None) is not None or getattr(plugin, "precision", None) == "16-mixed":
        return None
    return 0
