"""``FSDPMixedPrecisionPlugin``: ``MixedPrecisionPlugin``'s step for Lightning's ``FSDPStrategy`` (FSDP1, flat shards).

``FSDPStrategy`` accepts only ``FSDPPrecision`` plugins, and Lightning's ``FSDPPrecision`` refuses any other scaler,
autocasts on CUDA only and raises on clipping by norm. This plugin is an ``FSDPPrecision`` that holds a
:class:`~lightning_amp_plus.plugins.trainer.MixedPrecisionPlugin` and hands it the step's hooks (composition: one
implementation of the Trainer's step): our scaler and skip semantics, the gradient norm of the flat shards from one
weighted SUM over the world (see :mod:`lightning_amp_plus.step.sharding`), clipping by norm and by value, the
monitor. ``FSDPPrecision`` keeps what it does right for the mixed precisions: FP32 inputs and initialisation, no
conversion.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_amp_plus.plugins import state as _plugin_state
from lightning_amp_plus.plugins.core import DEFAULT_SKIPS, Readings, check_fsdp_precision, half_dtype, plugin_str
from lightning_amp_plus.plugins.trainer import MixedPrecisionPlugin, fitting, widen_for_fit_
from lightning_amp_plus.plugins.wrappers import unwrapped
from lightning_amp_plus.step.scaler import DynamicLossScaler
from lightning_amp_plus.step.spikes import SpikeGuard

__all__ = ["FSDPMixedPrecisionPlugin"]


class FSDPMixedPrecisionPlugin(Readings, FSDPPrecision):  # type: ignore[misc]  # `scaler`: ours
    """Mixed precision under ``FSDPStrategy`` with our loss scaler: ``Trainer(strategy="fsdp", plugins=[this])``.

    The options are ``MixedPrecisionPlugin``'s that apply under FSDP. ``master_weights=True`` maps to FSDP's own
    mixed-precision parameters, ``MixedPrecision(param_dtype=half, reduce_dtype=torch.float32)``: the sharded FP32
    flat parameters are the masters the optimizer steps, forward and backward run on all-gathered half copies, and
    gradients are reduce-scattered in FP32. Without it, the FP32 shards compute under autocast, as
    ``MixedPrecisionPlugin`` does elsewhere.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: the autocast device type; ``None`` takes the model's.
        scaler: the loss scaler for ``"16-mixed"`` (default: a :class:`DynamicLossScaler`).
        skip_nonfinite: with bf16, skip steps with non-finite gradients (fp16 always does).
        hold_schedulers_on_skip: hold the LR schedulers of skipped steps.
        max_consecutive_skips: skipped steps in a row that stop training with a diagnosis.
        master_weights: FP32 sharded parameters with half compute (FSDP's ``MixedPrecision``, see above).
        spike_guard: a :class:`~lightning_amp_plus.SpikeGuard`, as ``MixedPrecisionPlugin``'s (the norm it judges is
            the global one, the same on every rank).

    Examples:
        >>> plugin = FSDPMixedPrecisionPlugin("bf16-mixed", master_weights=True)
        >>> plugin.mixed_precision_config.param_dtype, plugin.mixed_precision_config.reduce_dtype
        (torch.bfloat16, torch.float32)
        >>> isinstance(plugin, FSDPPrecision), FSDPMixedPrecisionPlugin("16-mixed").mixed_precision_config is None
        (True, True)
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: str | None = None,
        scaler: DynamicLossScaler | None = None,
        *,
        skip_nonfinite: bool = True,
        hold_schedulers_on_skip: bool = True,
        max_consecutive_skips: int | None = DEFAULT_SKIPS,
        master_weights: bool = False,
        spike_guard: SpikeGuard | None = None,
    ) -> None:
        check_fsdp_precision(type(self).__name__, precision, "Trainer")
        # FSDPPrecision.__init__ would make a ShardedGradScaler of its own: its attributes are set here instead.
        self._step = MixedPrecisionPlugin(
            precision,
            device,
            scaler,
            skip_nonfinite=skip_nonfinite,
            hold_schedulers_on_skip=hold_schedulers_on_skip,
            max_consecutive_skips=max_consecutive_skips,
            master_weights=master_weights,  # the setting only: FSDP makes the half copies (mixed_precision_config)
            spike_guard=spike_guard,
        )
        self._step._checkpoint_key = type(self).__qualname__
        self.precision = precision
        self.settings, self.engine, self._scaler = self._step.settings, self._step.engine, self._step._scaler
        # FSDPPrecision's own hooks (inputs, tensor and module initialisation) read this: FP32 in the mixed modes.
        self._desired_input_dtype = torch.float32

    def __str__(self) -> str:
        return plugin_str(self)  # names the fix where pytorch_lightning's Trainer refuses the plugin

    def _use_scaler(self, scaler: DynamicLossScaler) -> None:
        self._step._use_scaler(scaler)
        self._scaler, self.engine = scaler, scaler.engine

    @property
    def mixed_precision_config(self) -> FSDPMixedPrecision | None:  # type: ignore[override]
        """What ``FSDPStrategy`` wraps the model with: with master weights, half parameters and FP32 reduction.

        Without master weights none (``FSDPStrategy`` accepts that: FP32 shards under autocast). Buffers keep their
        dtype (normalisation statistics stay FP32).
        """
        if not self.settings.master_weights:
            return None
        return FSDPMixedPrecision(param_dtype=half_dtype(self.precision), reduce_dtype=torch.float32)

    # --------------------------------------------------------------------------------------- the step's hooks
    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        # FSDP keeps the shards in the parameters' dtype and, with master weights, makes the half copies itself. The
        # masters are FP32: a model built in a half dtype is widened now (parameters and floating buffers), before
        # FSDP flattens it into shards.
        if self.settings.master_weights and fitting(module):
            widen_for_fit_(type(self).__name__, module)
        return module

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        if self.settings.master_weights:
            self._refuse_a_second_policy(model)
        return self._step.connect(model, optimizers, lr_schedulers)

    @override
    def forward_context(self) -> AbstractContextManager[None]:
        return self._step.forward_context()

    @override
    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        with self._step.train_step_context():
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        return self._step.pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        return self._step.optimizer_step(optimizer, model, closure, **kwargs)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if clip_val > 0 and gradient_clip_algorithm == GradClipAlgorithmType.NORM and not self.engine.check:
            # FSDPPrecision's own raises: a sharded norm needs the plugin's measuring pass.
            raise ValueError(
                "FSDPMixedPrecisionPlugin('bf16-mixed', skip_nonfinite=False) cannot clip by norm: the global norm of "
                "the shards is measured by the plugin's gradient check. Use skip_nonfinite=True (the default), or "
                "gradient_clip_algorithm='value'."
            )
        self._step.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._step.clip_grad_by_norm(optimizer, clip_val)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self._step.clip_grad_by_value(optimizer, clip_val)

    @override
    def teardown(self) -> None:
        self._step.teardown()

    # --------------------------------------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        return self._step.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._step.load_state_dict(state_dict)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint of Lightning's FSDPPrecision holds its ShardedGradScaler state (GradScaler's keys).
        if type(self).__qualname__ not in checkpoint and "FSDPPrecision" in checkpoint:
            state = checkpoint["FSDPPrecision"]
            if state:
                _plugin_state.load_grad_scaler_state(state, self.engine, "FSDPPrecision")
            return
        self._step.on_load_checkpoint(checkpoint)

    # ------------------------------------------------------------------------------------------------- private
    def _refuse_a_second_policy(self, model: nn.Module) -> None:
        # Master weights are done by FSDP (`mixed_precision_config`), before this hook. Only a policy given to the
        # strategy as well could be in the way: Lightning takes the strategy's over the plugin's without a word.
        strategy = getattr(getattr(unwrapped(model), "_trainer", None), "strategy", None)
        if getattr(strategy, "mixed_precision", None) is not None:
            raise ValueError(
                "FSDPMixedPrecisionPlugin(master_weights=True) and FSDPStrategy(mixed_precision=...) both set FSDP's "
                "mixed precision, and the strategy's would win: pass one of them (master_weights=True gives "
                "MixedPrecision(param_dtype=half, reduce_dtype=torch.float32))."
            )
