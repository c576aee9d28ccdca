"""``MixedPrecisionPlugin``: the Lightning face of the scaler.

A ``lightning.pytorch.plugins.precision.Precision`` subclass; the numerics live in :mod:`lightning_amp_plus.scaler`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn
from torch import Tensor, nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_amp_plus import _schedulers
from lightning_amp_plus._master import MasterWeights, convert_to_half_, default_fp32_modules
from lightning_amp_plus.scaler import DynamicLossScaler

__all__ = ["MixedPrecisionPlugin"]

_PRECISIONS = ("16-mixed", "bf16-mixed")
_FORMAT = "lightning_amp_plus/1"
# Keys under which Lightning's own plugin (and Lightning < 1.x) stored a GradScaler state.
_FOREIGN_KEYS = ("MixedPrecision", "native_amp_scaling_state")


class MixedPrecisionPlugin(Precision):
    """Mixed-precision training with autocast and a from-scratch dynamic loss scaler.

    ``"16-mixed"`` runs forward under fp16 autocast and scales the loss with a :class:`DynamicLossScaler`;
    ``"bf16-mixed"`` runs under bf16 autocast without scaling. In both, an optimizer step whose gradients hold inf/NaN
    is skipped: parameters and optimizer state stay untouched and, by default, so do the LR schedulers of that
    optimizer.

    Per optimizer step: the closure runs (forward under autocast, backward on the scaled loss); the gradients are
    unscaled exactly once, checked and measured in one pass; ``on_before_optimizer_step`` hooks and gradient clipping
    (by norm, reusing the measured norm, or by value) see unscaled gradients; the step is taken or skipped; the scale is
    updated once per training batch, also when several optimizers step in one batch under manual optimization.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: the autocast device type (``"cuda"``, ``"cpu"``, ``"mps"``); ``None`` takes the model's device at setup.
        scaler: the loss scaler for ``"16-mixed"`` (a default :class:`DynamicLossScaler` if ``None``); not for bf16.
        skip_nonfinite: with ``"bf16-mixed"``, skip steps whose gradients are non-finite (on by default). fp16 always
            checks, as loss scaling requires.
        hold_schedulers_on_skip: do not advance an LR scheduler when every step of its optimizer since its last
            step was skipped (on by default). Off, schedulers step as in Lightning's built-in plugin.
        max_consecutive_skips: for bf16, how many skipped steps in a row stop training with a diagnosis (``None``
            never). For fp16 the scaler's own ``max_consecutive_skips`` applies.
        master_weights: hold the model in the half dtype (fp16 or bf16) and let the optimizer step FP32 master copies
            (see the README's "FP32 master weights"). Off by default: the model stays FP32, as with Lightning's plugin.
        keep_fp32: with ``master_weights``, the module types whose parameters and buffers stay FP32 (``None``:
            normalisation layers, see :func:`~lightning_amp_plus._master.default_fp32_modules`; ``()``: none).
        fp32_grad_accumulation: with ``master_weights`` and gradient accumulation, add each micro-batch's half
            gradients into FP32 master gradients right after its backward (kept between micro-batches: 4 bytes per
            parameter) instead of accumulating in the model's half gradients (the default, which rounds each sum to
            the half dtype). Single-process only.

    Attributes:
        scaler: the :class:`DynamicLossScaler` (``None`` for bf16); ``trainer.scaler`` returns it.
        held_scheduler_steps: scheduler steps not taken because their optimizer's steps were skipped.

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
        max_consecutive_skips: int | None = 50,
        master_weights: bool = False,
        keep_fp32: Sequence[type[nn.Module]] | None = None,
        fp32_grad_accumulation: bool = False,
    ) -> None:
        name = type(self).__name__
        if precision not in _PRECISIONS:
            raise ValueError(f"`{name}(precision={precision!r})` is not supported: use '16-mixed' or 'bf16-mixed'.")
        if device is not None and (not isinstance(device, str) or device.split(":")[0] not in ("cuda", "cpu", "mps")):
            raise ValueError(f"`{name}(device={device!r})` is not supported: use 'cuda', 'cpu', 'mps' or None (auto).")
        if scaler is not None and not isinstance(scaler, DynamicLossScaler):
            raise TypeError(
                f"`{name}(scaler={scaler!r})` must be a lightning_amp_plus.DynamicLossScaler. To migrate from "
                "torch.amp.GradScaler, load its state: `DynamicLossScaler().load_state_dict(grad_scaler.state_dict())`."
            )
        if scaler is not None and precision == "bf16-mixed":
            raise ValueError(
                f"`{name}(precision='bf16-mixed', scaler=...)`: bf16 has fp32's range and needs no loss scaling. "
                "Drop `scaler`, or use precision='16-mixed'."
            )
        _check_master_options(name, master_weights, keep_fp32, fp32_grad_accumulation)
        self.precision = precision
        self.device = None if device is None else device.split(":")[0]
        self.master_weights = master_weights
        self.keep_fp32: tuple[type[nn.Module], ...] = default_fp32_modules() if keep_fp32 is None else tuple(keep_fp32)
        self.fp32_grad_accumulation = fp32_grad_accumulation
        # Master state: FP32 values of the half parameters (from the conversion, then the masters themselves, so a
        # second fit continues from them), the masters of each optimizer, and the hook that saves them.
        self._fp32_values: dict[Tensor, Tensor] = {}
        self._masters: dict[int, MasterWeights] = {}
        self._state_dict_hook: Any = None
        self.scaler: DynamicLossScaler | None = None
        if precision == "16-mixed":
            self.scaler = scaler if scaler is not None else DynamicLossScaler()
            self._checker: DynamicLossScaler | None = self.scaler
        elif skip_nonfinite:
            # A scale pinned at 1: the same check-and-skip machinery, no multiply.
            self._checker = DynamicLossScaler(
                1.0, min_scale=1.0, max_scale=1.0, max_consecutive_skips=max_consecutive_skips
            )
        else:
            self._checker = None
        self.hold_schedulers_on_skip = hold_schedulers_on_skip
        self._ledger = _schedulers.StepLedger()
        self._held: list[Any] = []
        self._update_pending = False

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
        return None if self.scaler is None else self.scaler.min_scale

    @property
    def held_scheduler_steps(self) -> int:
        """Scheduler steps held back because every step of their optimizer since the last one was skipped."""
        return self._ledger.held_steps

    @property
    def half_dtype(self) -> torch.dtype:
        """The autocast dtype (and, with ``master_weights``, the model's): ``torch.float16`` or ``torch.bfloat16``."""
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16

    def grad_holder(self, param: Tensor) -> Tensor:
        """The tensor whose ``.grad`` the optimizer reads for ``param``: its FP32 master, or ``param`` itself."""
        return self._fp32_values.get(param, param) if self._masters else param

    def master_params(self, optimizer: Optimizer) -> list[Tensor]:
        """The FP32 masters that ``optimizer`` steps in place of the model's half parameters (empty without them)."""
        masters = self._masters.get(id(getattr(optimizer, "optimizer", optimizer)))
        return [] if masters is None else list(masters.masters)

    # -------------------------------------------------------------------------------------------------- set-up
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.master_weights:
            # In place: DDPStrategy ignores the returned module. The FP32 values are kept before rounding, so the
            # masters start from the exact initial (or checkpoint-restored) weights.
            self._fp32_values.update(convert_to_half_(module, self.half_dtype, self.keep_fp32))
        return module

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        self._refuse_deepspeed(model)
        self._resolve_device(model)
        if self.master_weights:
            self._make_masters(model, optimizers)
        if self._checker is not None:
            if _world_size() > 1 and self._checker.process_group is None:
                # One skip decision for all ranks: an overflow seen on one rank only (a rank-local fault, unused
                # parameters) must skip the step everywhere, or the replicas drift apart.
                self._checker.process_group = torch.distributed.group.WORLD
            names = _unwrapped_names(model)
            for masters in self._masters.values():
                names = masters.named_masters(names)
            self._checker.set_parameter_names(names)
            for optimizer in optimizers:
                self._refuse_lbfgs(optimizer)
        if self.hold_schedulers_on_skip and self._checker is not None:
            for config in lr_schedulers:
                scheduler = getattr(config, "scheduler", config)
                _schedulers.hold(scheduler, self._ledger)
                self._held.append(scheduler)
        return super().connect(model, optimizers, lr_schedulers)

    def _make_masters(self, model: nn.Module, optimizers: list[Optimizer]) -> None:
        if self.fp32_grad_accumulation and _world_size() > 1:
            raise ValueError(
                f"`{type(self).__name__}(fp32_grad_accumulation=True)` works in a single process only: across "
                "processes the accumulated FP32 gradients would not be all-reduced. Drop the option (gradients "
                "then accumulate in the half dtype and DDP all-reduces them)."
            )
        self._masters.clear()
        # cuDNN RNN weights must stay in the flat chunk flatten_parameters() made: never released during the step.
        rnn_params = [p for m in model.modules() if isinstance(m, nn.RNNBase) for p in m.parameters()]
        for optimizer in optimizers:
            self._refuse_lbfgs(optimizer)
            masters = MasterWeights(optimizer, self._fp32_values, keep_allocated=rnn_params)
            self._masters[id(optimizer)] = masters
        # From now on the masters are the FP32 values: a second fit of the same model continues from them.
        self._fp32_values = {param: master for m in self._masters.values() for param, master in m.pairs()}
        self._hook_state_dict(_unwrap(model))

    def _hook_state_dict(self, module: nn.Module) -> None:
        """Make ``module.state_dict()`` (and so every checkpoint) hold the FP32 masters, not the rounded half values."""
        if self._state_dict_hook is not None:
            self._state_dict_hook.remove()
        # The masters reach the model's state_dict before convert_module runs on resume (Lightning restores the
        # weights first, into the FP32 model), so they come back exact; see `convert_to_half_`.
        master_of = self._fp32_values
        names = {name: master_of[p] for name, p in module.named_parameters() if p in master_of}

        def use_masters(_module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
            for name, master in names.items():
                if prefix + name in state:
                    state[prefix + name] = master.detach()

        self._state_dict_hook = module.register_state_dict_post_hook(use_masters)  # type: ignore[no-untyped-call]

    @override
    def teardown(self) -> None:
        for scheduler in self._held:
            _schedulers.release(scheduler)
        self._held.clear()
        # The masters (and the state_dict hook that returns them) outlive fit on purpose: the model is still held in
        # the half dtype, and `model.state_dict()` must keep giving its FP32 values.
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
        if self.master_weights and isinstance(getattr(optimizer, "optimizer", optimizer), LBFGS):
            raise TypeError(
                f"{type(self).__name__}(master_weights=True) cannot drive torch.optim.LBFGS: it re-evaluates the "
                "closure inside `step()`, where half gradients cannot be moved to the FP32 masters. Use another "
                "optimizer, or master_weights=False."
            )
        if isinstance(getattr(optimizer, "optimizer", optimizer), LBFGS):
            raise TypeError(
                f"{type(self).__name__}({self.precision!r}) cannot drive torch.optim.LBFGS: it re-evaluates the "
                "closure inside `step()`, where gradients cannot be checked and unscaled first. Use another "
                "optimizer, or MixedPrecisionPlugin('bf16-mixed', skip_nonfinite=False)."
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
        with self.forward_context():
            yield
        # Manual optimization: every opt.step() of this batch is done; update the scale once for all of them.
        if self._update_pending and self._checker is not None:
            self._checker.update()
            self._update_pending = False

    # ----------------------------------------------------------------------------------------------- backward
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        # Hooks see the true loss; only backward sees the scaled one.
        tensor = super().pre_backward(tensor, module)
        return tensor if self.scaler is None else self.scaler.scale(tensor)

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.fp32_grad_accumulation:
            # After every backward, also of micro-batches that do not step: the sum is kept in FP32.
            for masters in self._masters.values():
                masters.grads_to_masters_()
        return super().post_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        masters = self._masters.get(id(optimizer))
        if self._checker is None and masters is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self._refuse_lbfgs(optimizer)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: no backward ran, there is nothing to check or step.
            self._after_closure(model, optimizer)
            return closure_result
        self._unscale(optimizer)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping: unscaled gradients
        applying = self._checker is None or not self._checker.found_inf(optimizer)
        # A step that will apply runs without the model's half weights; they come back rounded from the masters.
        with masters.half_weights_released() if masters is not None and applying else nullcontext():
            if self._checker is None:
                step_output = optimizer.step(**kwargs)
            else:
                step_output = self._checker.step(optimizer, **kwargs)
                self._ledger.record(optimizer, applied=applying)
        if masters is not None and not applying:
            masters.drop_grads_()  # the skipped step's gradients; an applied step's were freed leaving the context
        if self._checker is not None:
            if model.automatic_optimization:
                self._checker.update()
            else:
                self._update_pending = True
        return step_output

    def _unscale(self, optimizer: Optimizer) -> None:
        """Bring the step's gradients to where the optimizer reads them, unscaled and checked: once per step."""
        masters = self._masters.get(id(optimizer))
        if masters is not None:
            # Widened into FP32 master gradients tensor by tensor (a no-op after FP32 accumulation, or the 2nd time).
            masters.grads_to_masters_()
        if self._checker is None:
            return
        self._checker.unscale_(optimizer)

    # ------------------------------------------------------------------------------------------------ clipping
    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if isinstance(optimizer, LightningOptimizer):
            # `LightningModule.clip_gradients` passes the wrapper, `optimizer_step` the optimizer inside it: unwrap, so
            # that both reach the scaler's record of the same optimizer and the gradients are unscaled only once.
            optimizer = optimizer.optimizer
        # Under manual optimization users clip before opt.step(): unscale first (a no-op if already done).
        self._unscale(optimizer)
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
        super().clip_grad_by_value(optimizer, clip_val)

    # --------------------------------------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        if self._checker is None:
            return {}
        # The masters themselves are in checkpoint["state_dict"] (see _hook_state_dict), not here.
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
        saved = state_dict.get("precision")
        if saved != self.precision:
            raise ValueError(
                f"The checkpoint was trained with MixedPrecisionPlugin({saved!r}), this run uses {self.precision!r}. "
                f"Resume with precision={saved!r}, or delete checkpoint['{type(self).__qualname__}'] to start the "
                "new precision with a fresh scaler."
            )
        if self._checker is not None:
            self._checker.load_state_dict(state_dict["scaler"])
        held = state_dict.get("held_scheduler_steps", 0)
        self._ledger.held_steps = held if isinstance(held, int) and held >= 0 else 0

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
        if self.scaler is None:
            rank_zero_warn(
                f"The checkpoint holds an fp16 GradScaler state under {key!r}; bf16 uses no scaler: ignored."
            )
            return
        if not isinstance(state, dict):
            raise TypeError(
                f"The checkpoint's {key!r} entry is a {type(state).__name__}, not a GradScaler state dict. Remove "
                "that key from the checkpoint to start with a fresh scaler."
            )
        self.scaler.load_state_dict(state)


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and Lightning wrappers.

    Unwrapping stops at the LightningModule: a ``module`` attribute there is the user's own submodule.
    """
    inner: nn.Module = model
    while not isinstance(inner, pl.LightningModule) and isinstance(getattr(inner, "module", None), nn.Module):
        inner = cast(nn.Module, inner.module)
    return inner


def _unwrapped_names(model: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameter names as the user wrote them: without the ``module.`` prefixes that DDP and Lightning wrappers add."""
    return list(_unwrap(model).named_parameters())


def _check_master_options(
    name: str, master_weights: bool, keep_fp32: Sequence[type[nn.Module]] | None, fp32_grad_accumulation: bool
) -> None:
    if master_weights:
        if keep_fp32 is not None and not all(isinstance(t, type) and issubclass(t, nn.Module) for t in keep_fp32):
            raise TypeError(
                f"`{name}(keep_fp32={keep_fp32!r})` must be a sequence of nn.Module subclasses, e.g. (nn.LayerNorm,)."
            )
        return
    for option, value, default in (
        ("keep_fp32", keep_fp32, None),
        ("fp32_grad_accumulation", fp32_grad_accumulation, False),
    ):
        if value != default:
            raise ValueError(
                f"`{name}({option}={value!r})` applies to FP32 master weights only: add master_weights=True, or "
                f"drop {option}."
            )
