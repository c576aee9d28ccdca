"""``FSDPMixedPrecisionPlugin`` for Lightning Fabric's ``FSDPStrategy``, by composition over the Fabric plugin.

Fabric's ``FSDPStrategy`` accepts only ``FSDPPrecision`` plugins, and Fabric's ``FSDPPrecision`` refuses any other
scaler and autocasts on CUDA only. This plugin is an ``FSDPPrecision`` that holds a
:class:`~lightning_amp_plus.fabric.MixedPrecisionPlugin` and hands it the step's hooks (one implementation of Fabric's
step); ``FSDPPrecision`` keeps FP32 inputs and initialisation, no conversion, and FSDP's own mixed-precision
parameters for ``master_weights=True``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from lightning.fabric.plugins.precision import FSDPPrecision
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_amp_plus.plugins.core import DEFAULT_SKIPS, Readings, check_fsdp_precision, half_dtype
from lightning_amp_plus.plugins.fabric import MixedPrecisionPlugin
from lightning_amp_plus.step.scaler import DynamicLossScaler
from lightning_amp_plus.step.spikes import SpikeGuard

__all__ = ["FSDPMixedPrecisionPlugin"]


class FSDPMixedPrecisionPlugin(Readings, FSDPPrecision):  # type: ignore[misc]  # `scaler`: ours
    """Mixed precision under Fabric's ``FSDPStrategy`` with our scaler: ``L.Fabric(strategy="fsdp", plugins=[this])``.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: the autocast device type; ``None`` takes the model's.
        scaler: the loss scaler for ``"16-mixed"`` (default: a :class:`~lightning_amp_plus.DynamicLossScaler`).
        skip_nonfinite: with bf16, skip steps with non-finite gradients (fp16 always does).
        max_consecutive_skips: skipped steps in a row that stop training with a diagnosis.
        master_weights: FSDP's own mixed-precision parameters, ``MixedPrecision(param_dtype=half,
            reduce_dtype=torch.float32)``: the FP32 shards are the masters, forward and backward run on all-gathered
            half copies. Without it the FP32 shards compute under autocast.
        spike_guard: a :class:`~lightning_amp_plus.SpikeGuard`, as ``MixedPrecisionPlugin``'s (the norm it judges is
            the global one, the same on every rank).

    The global norm and the skip decision come from one SUM all-reduce over the world of the ranks' shards (taken as
    fully sharded, FSDP's default; under ``HYBRID_SHARD`` or ``NO_SHARD`` the reported norm counts each replica, the
    skip decision stays right). Clipping by norm is FSDP's own ``clip_grad_norm_``, as Fabric calls it.

    Examples:
        >>> plugin = FSDPMixedPrecisionPlugin("bf16-mixed", master_weights=True)
        >>> plugin.mixed_precision_config.param_dtype, isinstance(plugin, FSDPPrecision)
        (torch.bfloat16, True)
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "16-mixed",
        device: str | None = None,
        scaler: DynamicLossScaler | None = None,
        *,
        skip_nonfinite: bool = True,
        max_consecutive_skips: int | None = DEFAULT_SKIPS,
        master_weights: bool = False,
        spike_guard: SpikeGuard | None = None,
    ) -> None:
        check_fsdp_precision(type(self).__name__, precision, "Fabric")
        # FSDPPrecision.__init__ would make a ShardedGradScaler of its own: its attributes are set here instead.
        self._step = _FSDPSteps(
            precision,
            device,
            scaler,
            skip_nonfinite=skip_nonfinite,
            max_consecutive_skips=max_consecutive_skips,
            master_weights=master_weights,  # widens a half-built model before FSDP wraps it; FSDP makes the copies
            spike_guard=spike_guard,
        )
        self.precision = precision
        self.settings, self.engine, self._scaler = self._step.settings, self._step.engine, self._step._scaler
        # FSDPPrecision's own hooks (inputs, tensor and module initialisation) read this: FP32 in the mixed modes.
        self._desired_input_dtype = torch.float32

    def __repr__(self) -> str:
        return f"lightning_amp_plus.fabric.FSDPMixedPrecisionPlugin({self.precision!r})"

    def _use_scaler(self, scaler: DynamicLossScaler) -> None:
        self._step._use_scaler(scaler)
        self._scaler, self.engine = scaler, scaler.engine

    @property
    def mixed_precision_config(self) -> FSDPMixedPrecision | None:  # type: ignore[override]
        """What ``FSDPStrategy`` wraps the model with: with master weights, half parameters and FP32 reduction."""
        if not self.settings.master_weights:
            return None
        return FSDPMixedPrecision(param_dtype=half_dtype(self.precision), reduce_dtype=torch.float32)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return self._step.convert_module(module)  # names, the device; FSDP keeps the FP32 shards

    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        return self._step.forward_context()

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self._step.backward(tensor, model, *args, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        self._step.unscale_gradients(optimizer)

    @override
    def main_params(self, optimizer: Optimizer) -> list[Tensor]:  # type: ignore[override]
        return self._step.main_params(optimizer)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        return self._step.optimizer_step(optimizer, **kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._step.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._step.load_state_dict(state_dict)

    @override
    def teardown(self) -> None:
        self._step.teardown()


class _FSDPSteps(MixedPrecisionPlugin):
    """The Fabric plugin's hooks as the FSDP plugin holds them: its messages name ``FSDPMixedPrecisionPlugin``."""

    def _name(self) -> str:
        return FSDPMixedPrecisionPlugin.__name__
