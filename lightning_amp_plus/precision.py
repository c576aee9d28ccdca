"""``MixedPrecisionPlugin``: the Lightning face of the scaler.

A ``lightning.pytorch.plugins.precision.Precision`` subclass; the numerics live in :mod:`lightning_amp_plus.scaler`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
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

    Attributes:
        scaler: the :class:`DynamicLossScaler` (``None`` for bf16); ``trainer.scaler`` returns it.
        held_scheduler_steps: scheduler steps not taken because their optimizer's steps were skipped.

    Example:
        >>> from lightning import Trainer
        >>> plugin = MixedPrecisionPlugin("bf16-mixed", device="cpu")
        >>> trainer = Trainer(plugins=[plugin], accelerator="cpu", logger=False, enable_progress_bar=False)
        >>> trainer.precision, trainer.scaler
        ('bf16-mixed', None)
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
        self.precision = precision
        self.device = None if device is None else device.split(":")[0]
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

    # -------------------------------------------------------------------------------------------------- set-up
    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        self._resolve_device(model)
        if self._checker is not None:
            self._checker.set_parameter_names(_unwrapped_names(model))
            for optimizer in optimizers:
                self._refuse_lbfgs(optimizer)
        if self.hold_schedulers_on_skip and self._checker is not None:
            for config in lr_schedulers:
                scheduler = getattr(config, "scheduler", config)
                _schedulers.hold(scheduler, self._ledger)
                self._held.append(scheduler)
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def teardown(self) -> None:
        for scheduler in self._held:
            _schedulers.release(scheduler)
        self._held.clear()
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

    def _refuse_lbfgs(self, optimizer: Any) -> None:
        if isinstance(getattr(optimizer, "optimizer", optimizer), LBFGS):
            raise TypeError(
                f"{type(self).__name__}({self.precision!r}) cannot drive torch.optim.LBFGS: it re-evaluates the "
                "closure inside `step()`, where gradients cannot be checked and unscaled first. Use another "
                "optimizer, or MixedPrecisionPlugin('bf16-mixed', skip_nonfinite=False)."
            )

    # ---------------------------------------------------------------------------------------------- autocast
    def autocast_context_manager(self) -> torch.autocast:
        """The ``torch.autocast`` context for this precision and device."""
        dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
        # cache_enabled=False as Lightning's own plugin: the cast cache breaks under activation checkpointing.
        return torch.autocast(self.device or _default_device(), dtype=dtype, cache_enabled=False)

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
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self._checker is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        self._refuse_lbfgs(optimizer)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: no backward ran, there is nothing to check or step.
            self._after_closure(model, optimizer)
            return closure_result
        self._checker.unscale_(optimizer)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping: unscaled gradients
        step_output = self._checker.step(optimizer, **kwargs)
        self._ledger.record(optimizer, applied=not self._checker.last_step_skipped)
        if model.automatic_optimization:
            self._checker.update()
        else:
            self._update_pending = True
        return step_output

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
        if self._checker is not None:
            # Under manual optimization users clip before opt.step(): unscale first (a no-op if already done).
            self._checker.unscale_(optimizer)
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
        return {"format": _FORMAT, "precision": self.precision, "scaler": self._checker.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"The checkpoint's {type(self).__name__} state is a {type(state_dict).__name__}, not a dict."
            )
        if "format" not in state_dict and "scale" in state_dict:
            self._load_grad_scaler_state(state_dict, "MixedPrecisionPlugin")
            return
        if state_dict.get("format") != _FORMAT or "scaler" not in state_dict:
            raise ValueError(
                f"The checkpoint's {type(self).__name__} state has keys {sorted(state_dict)}: expected a "
                f"'{_FORMAT}' state with 'precision' and 'scaler', or a GradScaler state. Remove that key from the "
                "checkpoint to start with a fresh scaler."
            )
        saved = state_dict.get("precision")
        if saved != self.precision:
            raise ValueError(
                f"The checkpoint was trained with MixedPrecisionPlugin({saved!r}), this run uses {self.precision!r}. "
                f"Resume with precision={saved!r}, or delete checkpoint['{type(self).__qualname__}'] to start the "
                "new precision with a fresh scaler."
            )
        if self._checker is not None:
            self._checker.load_state_dict(state_dict["scaler"])

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
        self.scaler.load_state_dict(state)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _unwrapped_names(model: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameter names as the user wrote them: without the ``module.`` prefixes that DDP and Lightning wrappers add.

    Unwrapping stops at the LightningModule: a ``module`` attribute there is the user's own submodule.
    """
    inner: nn.Module = model
    while not isinstance(inner, pl.LightningModule) and isinstance(getattr(inner, "module", None), nn.Module):
        inner = cast(nn.Module, inner.module)
    return list(inner.named_parameters())
