"""``FSDPMixedPrecisionPlugin``: ``MixedPrecisionPlugin`` for Lightning's ``FSDPStrategy`` (FSDP1, flat shards).

``FSDPStrategy`` accepts only ``FSDPPrecision`` plugins, and Lightning's ``FSDPPrecision`` refuses any other scaler,
autocasts on CUDA only and raises on clipping by norm. This plugin is an ``FSDPPrecision`` whose step is
``MixedPrecisionPlugin``'s: our scaler and skip semantics, the gradient norm of the flat shards from one weighted SUM
over the world (see :mod:`lightning_amp_plus.numerics.sharding`), clipping by norm and by value, the monitor.
``FSDPPrecision`` keeps what it does right for the mixed precisions: FP32 inputs and initialisation, no conversion.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from torch import nn
from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_amp_plus.numerics.scaler import DynamicLossScaler
from lightning_amp_plus.precision import _DEFAULT_SKIPS, MixedPrecisionPlugin

__all__ = ["FSDPMixedPrecisionPlugin"]


class FSDPMixedPrecisionPlugin(MixedPrecisionPlugin, FSDPPrecision):  # type: ignore[misc]
    """Mixed precision under ``FSDPStrategy`` with our loss scaler: ``Trainer(strategy="fsdp", plugins=[this])``.

    The options are ``MixedPrecisionPlugin``'s that apply under FSDP. ``master_weights=True`` maps to FSDP's own
    mixed-precision parameters, ``MixedPrecision(param_dtype=half, reduce_dtype=torch.float32)``: the sharded FP32
    flat parameters are the masters the optimizer steps, forward and backward run on all-gathered half copies, and
    gradients are reduce-scattered in FP32. No second copy is kept. Without it, the FP32 shards compute under autocast,
    as ``MixedPrecisionPlugin`` does elsewhere.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: the autocast device type; ``None`` takes the model's.
        scaler: the loss scaler for ``"16-mixed"`` (default: a :class:`DynamicLossScaler`).
        skip_nonfinite: with bf16, skip steps with non-finite gradients (fp16 always does).
        hold_schedulers_on_skip: hold the LR schedulers of skipped steps.
        max_consecutive_skips: skipped steps in a row that stop training with a diagnosis.
        master_weights: FP32 sharded parameters with half compute (FSDP's ``MixedPrecision``, see above).

    Example:
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
        max_consecutive_skips: int | None = _DEFAULT_SKIPS,
        master_weights: bool = False,
    ) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(
                f"`FSDPMixedPrecisionPlugin(precision={precision!r})` is not supported: use '16-mixed' or "
                "'bf16-mixed' (for '32-true', '16-true' or 'bf16-true' under FSDP, use Lightning's "
                f"Trainer(strategy='fsdp', precision={precision!r}))."
            )
        super().__init__(
            precision,
            device,
            scaler,
            skip_nonfinite=skip_nonfinite,
            hold_schedulers_on_skip=hold_schedulers_on_skip,
            max_consecutive_skips=max_consecutive_skips,
            master_weights=master_weights,
        )
        # FSDPPrecision's own hooks (inputs, tensor and module initialisation) read this: FP32 in the mixed modes.
        self._desired_input_dtype = torch.float32

    @property
    def mixed_precision_config(self) -> FSDPMixedPrecision | None:  # type: ignore[override]
        """What ``FSDPStrategy`` wraps the model with: with master weights, half parameters and FP32 reduction.

        Without master weights none (``FSDPStrategy`` accepts that: FP32 shards under autocast). Buffers keep their
        dtype (normalisation statistics stay FP32).
        """
        if not self.master_weights:
            return None
        return FSDPMixedPrecision(param_dtype=self.half_dtype, reduce_dtype=torch.float32)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return module  # FSDP keeps the FP32 shards; with master weights it makes the half copies itself

    def _set_up_master_weights(self, model: nn.Module, module: nn.Module) -> None:
        # Done by FSDP (`mixed_precision_config`), before this hook. Only a policy given to the strategy as well could
        # be in the way: Lightning takes the strategy's over the plugin's without a word.
        strategy = getattr(getattr(module, "_trainer", None), "strategy", None)
        if getattr(strategy, "mixed_precision", None) is not None:
            raise ValueError(
                "FSDPMixedPrecisionPlugin(master_weights=True) and FSDPStrategy(mixed_precision=...) both set FSDP's "
                "mixed precision, and the strategy's would win: pass one of them (master_weights=True gives "
                "MixedPrecision(param_dtype=half, reduce_dtype=torch.float32))."
            )

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self._checker is None:  # FSDPPrecision's own raises: a sharded norm needs the plugin's measuring pass
            raise ValueError(
                "FSDPMixedPrecisionPlugin('bf16-mixed', skip_nonfinite=False) cannot clip by norm: the global norm of "
                "the shards is measured by the plugin's gradient check. Use skip_nonfinite=True (the default), or "
                "gradient_clip_algorithm='value'."
            )
        super().clip_grad_by_norm(optimizer, clip_val)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint of Lightning's FSDPPrecision holds its ShardedGradScaler state (GradScaler's keys).
        if type(self).__qualname__ not in checkpoint and "FSDPPrecision" in checkpoint:
            state = checkpoint["FSDPPrecision"]
            if state:
                self._load_grad_scaler_state(state, "FSDPPrecision")
            return
        super().on_load_checkpoint(checkpoint)
