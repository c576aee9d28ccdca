"""``FSDPMixedPrecisionPlugin``: the plugin under ``FSDPStrategy`` (FSDP1, flat shards), on both front ends.

``FSDPStrategy`` accepts only ``FSDPPrecision`` plugins, and Lightning's ``FSDPPrecision`` refuses any other scaler,
autocasts on CUDA only and raises on clipping by norm. These plugins are the ``MixedPrecisionPlugin`` of their front
end (``FabricFSDPMixedPrecisionPlugin``: Fabric's; ``FSDPMixedPrecisionPlugin``: the Trainer's) and an
``FSDPPrecision``, with what FSDP adds written once (:class:`_Sharded`): FSDP's own mixed-precision parameters for
``master_weights=True``, FP32 inputs and initialisation, and the options FSDP1 cannot honour refused. The step is the
plugin's: our scaler and skip semantics, the gradient norm of the flat shards from one weighted SUM over the world
(:mod:`lightning_amp_plus.step.sharding`), clipping by norm, the monitor.

Where a hook exists in both parents, the plugin's wins (it comes first), except where ``_Sharded`` or the class body
says otherwise.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.plugins.precision import FSDPPrecision as FabricFSDPPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import FSDPPrecision as TrainerFSDPPrecision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecision
from torch.optim import Optimizer
from typing_extensions import Unpack, override

from lightning_amp_plus.plugins import state as _state
from lightning_amp_plus.plugins.options import FP8, PluginOptions, Precision, Settings
from lightning_amp_plus.plugins.precision import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from lightning_amp_plus.plugins.wrappers import unwrapped
from lightning_amp_plus.step.scaler import DynamicLossScaler

__all__ = ["FSDPMixedPrecisionPlugin", "FabricFSDPMixedPrecisionPlugin"]

_REFUSED = {
    "keep_fp32": "FSDP1 flattens the modules into shards, where per-module FP32 regions are not supported. Drop "
    "keep_fp32, or use ModelParallelStrategy (FSDP2) with MixedPrecisionPlugin.",
    "compensation": "compensated bf16 weights are not defined on FSDP1's flat shards. Drop compensation.",
    "rounding_seed": "compensated bf16 weights are not defined on FSDP1's flat shards. Drop rounding_seed.",
    **{
        name: "torchao trains in FP8 under FSDP2, not FSDP1's flat parameters: use ModelParallelStrategy with "
        f"MixedPrecisionPlugin('{FP8}'). Drop {name}."
        for name in ("fp8_recipe", "fp8_modules", "fp8_check_interval", "fp8_fallback")
    },
}


class _Sharded:
    """What FSDP adds to a front end's plugin.

    The precisions and options FSDP1 takes, FSDP's own mixed precision for master weights, FP32 inputs and
    initialisation (the shards stay FP32; autocast computes in half).
    """

    settings: Settings
    precision: Any
    _framework: str

    def __init__(
        self,
        precision: Precision = "16-mixed",
        device: str | None = None,
        scaler: DynamicLossScaler | None = None,
        **options: Unpack[PluginOptions],
    ) -> None:
        name = self._name()
        if precision == FP8:
            raise ValueError(
                f"`{name}('{FP8}')` is not supported: torchao trains in FP8 under FSDP2, not FSDP1's flat parameters. "
                f"Use {self._framework}(strategy=ModelParallelStrategy(...)) with MixedPrecisionPlugin('{FP8}') and "
                "`fully_shard(..., mp_policy=plugin.mp_policy)` (docs: FP8 training, FSDP2)."
            )
        if precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(
                f"`{name}(precision={precision!r})` is not supported: use '16-mixed' or 'bf16-mixed' (for '32-true', "
                f"'16-true' or 'bf16-true' under FSDP, use {self._framework}(strategy='fsdp', precision={precision!r}) "
                "without this plugin)."
            )
        # The plugin's own set-up, not FSDPPrecision.__init__ (it makes a ShardedGradScaler of its own, which `scaler`
        # refuses). FSDPPrecision's hooks that read its `_desired_input_dtype` are overridden here and in the plugin;
        # ThroughputMonitor reads the plugin's (the half dtype, as of Lightning's FSDPPrecision at this precision).
        FabricMixedPrecisionPlugin.__init__(self, precision, device, scaler, **options)  # type: ignore[arg-type]

    def _name(self) -> str:
        return "FSDPMixedPrecisionPlugin"

    def _refused(self) -> dict[str, str]:
        return {**super()._refused(), **_REFUSED}  # type: ignore[misc]

    @property
    def mixed_precision_config(self) -> FSDPMixedPrecision | None:
        """What ``FSDPStrategy`` wraps the model with: with master weights, half parameters and FP32 reduction.

        Without master weights none (``FSDPStrategy`` accepts that: FP32 shards under autocast). Buffers keep their
        dtype (normalisation statistics stay FP32).
        """
        if not self.settings.master_weights:
            return None
        half = torch.float16 if self.precision == "16-mixed" else torch.bfloat16
        return FSDPMixedPrecision(param_dtype=half, reduce_dtype=torch.float32)

    def tensor_init_context(self) -> AbstractContextManager[Any]:
        return _DtypeContextManager(torch.float32)

    def module_init_context(self) -> AbstractContextManager[Any]:
        return _DtypeContextManager(torch.float32)

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.float32)


class FabricFSDPMixedPrecisionPlugin(_Sharded, FabricMixedPrecisionPlugin, FabricFSDPPrecision):  # type: ignore[misc]
    """Mixed precision under Fabric's ``FSDPStrategy`` with our scaler: ``L.Fabric(strategy="fsdp", plugins=[this])``.

    ``lightning_amp_plus.fabric.FSDPMixedPrecisionPlugin``. The options are ``MixedPrecisionPlugin``'s that FSDP1
    takes: ``"16-mixed"`` or ``"bf16-mixed"``; ``master_weights=True`` is FSDP's own mixed-precision parameters,
    ``MixedPrecision(param_dtype=half, reduce_dtype=torch.float32)`` (the FP32 shards are the masters, forward and
    backward run on all-gathered half copies); without it the FP32 shards compute under autocast.

    The skip decision comes from one SUM all-reduce over the world of the ranks' overflow flags, the global norm (when
    something reads it) from one of the ranks' squared shard norms (the shards taken as fully sharded, FSDP's default;
    under ``HYBRID_SHARD`` or ``NO_SHARD`` the reported norm counts each replica, the skip decision stays right).
    Clipping by norm is FSDP's own ``clip_grad_norm_``, as Fabric calls it.

    Examples:
        >>> plugin = FabricFSDPMixedPrecisionPlugin("bf16-mixed", master_weights=True)
        >>> plugin.mixed_precision_config.param_dtype, isinstance(plugin, FabricFSDPPrecision)
        (torch.bfloat16, True)
    """

    _framework = "Fabric"
    _public_name = "FSDPMixedPrecisionPlugin"


class FSDPMixedPrecisionPlugin(_Sharded, MixedPrecisionPlugin, TrainerFSDPPrecision):  # type: ignore[misc]
    """Mixed precision under ``FSDPStrategy`` with our loss scaler: ``Trainer(strategy="fsdp", plugins=[this])``.

    The options are ``MixedPrecisionPlugin``'s that FSDP1 takes: ``"16-mixed"`` or ``"bf16-mixed"``, and
    ``master_weights=True`` is FSDP's own mixed-precision parameters, ``MixedPrecision(param_dtype=half,
    reduce_dtype=torch.float32)``: the sharded FP32 flat parameters are the masters the optimizer steps, forward and
    backward run on all-gathered half copies, and gradients are reduce-scattered in FP32. Without it, the FP32 shards
    compute under autocast, as ``MixedPrecisionPlugin`` does elsewhere.

    Examples:
        >>> plugin = FSDPMixedPrecisionPlugin("bf16-mixed", master_weights=True)
        >>> plugin.mixed_precision_config.param_dtype, plugin.mixed_precision_config.reduce_dtype
        (torch.bfloat16, torch.float32)
        >>> config = FSDPMixedPrecisionPlugin("16-mixed").mixed_precision_config
        >>> isinstance(plugin, TrainerFSDPPrecision), config is None
        (True, True)
    """

    _framework = "Trainer"

    def _checkpoint_key(self) -> str:
        return type(self).__qualname__

    @override
    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        # Master weights are FSDP's (`mixed_precision_config`), set before this hook. Only a policy given to the
        # strategy as well could be in the way: Lightning takes the strategy's over the plugin's without a word.
        strategy = getattr(getattr(unwrapped(model), "_trainer", None), "strategy", None)
        if self.settings.master_weights and getattr(strategy, "mixed_precision", None) is not None:
            raise ValueError(
                "FSDPMixedPrecisionPlugin(master_weights=True) and FSDPStrategy(mixed_precision=...) both set FSDP's "
                "mixed precision, and the strategy's would win: pass one of them (master_weights=True gives "
                "MixedPrecision(param_dtype=half, reduce_dtype=torch.float32))."
            )
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if not self.engine.check:
            # torch's clip_grad_norm_ would measure this rank's shards alone: the global norm is the check's.
            raise ValueError(
                "FSDPMixedPrecisionPlugin('bf16-mixed', skip_nonfinite=False) cannot clip by norm: the global norm of "
                "the shards is measured by the plugin's gradient check. Use skip_nonfinite=True (the default), or "
                "gradient_clip_algorithm='value'."
            )
        super().clip_grad_by_norm(optimizer, clip_val)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint of Lightning's FSDPPrecision holds its ShardedGradScaler state (GradScaler's keys).
        if self._checkpoint_key() not in checkpoint and "FSDPPrecision" in checkpoint:
            if checkpoint["FSDPPrecision"]:
                _state.load_grad_scaler_state(checkpoint["FSDPPrecision"], self.engine, "under 'FSDPPrecision'")
            return
        super().on_load_checkpoint(checkpoint)
