"""``CPUFSDPStrategy``: Lightning's ``FSDPStrategy`` made to run on CPU processes over gloo, for tests only.

Lightning 2.6.6 runs ``FSDPStrategy`` on CUDA only, for two reasons this subclass lifts:

* the accelerator connector refuses it with ``accelerator="cpu"`` ("The strategy `fsdp` requires a GPU accelerator"),
  but that check reads ``type(strategy) is FSDPStrategy``: an instance of a subclass passes;
* ``FSDPStrategy._setup_model`` wraps with ``device_id=self.root_device.index``, which is ``None`` for a CPU device,
  and torch's ``FullyShardedDataParallel`` then has no device to run on: it needs ``device_id=torch.device("cpu")``.

One more difference is a torch bug that only a CPU run meets: a *full* optimizer state dict (``state_dict_type="full"``)
comes out wrong. torch's FSDP gathers each optimizer state of a flat parameter (Adam's ``exp_avg``, then
``exp_avg_sq``) into one reused buffer and, with ``offload_to_cpu=True`` (Lightning's setting for more than one rank),
keeps ``view.cpu()`` of it: a copy on GPU, the same view on CPU, so every state ends up holding the values of the last
one gathered (checked on torch 2.14.1: the saved ``exp_avg`` equals ``exp_avg_sq``, and a resumed run diverges).
``optimizer_state`` here gathers with ``offload_to_cpu=False``, which clones (the tensors are on the CPU anyway).

Everything else (flat-parameter sharding, ``FSDPPrecision``, ``mixed_precision_config``, sharded checkpoints, the
full model state dict, loading) is Lightning's own code, unchanged, so a test under this strategy exercises what users
run on GPUs, on CPU. It is not package API: FSDP on CPU is not something Lightning supports, and users would have no
reason to want it. :func:`cpu_fsdp_strategy` makes the same subclass over the standalone ``pytorch_lightning``
package's ``FSDPStrategy``.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import Tensor, nn
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    OptimStateKeyType,
    StateDictType,
)
from torch.optim import Optimizer


def cpu_fsdp_strategy(package: str = "lightning.pytorch") -> type:
    """The CPU twin of the Trainer's ``FSDPStrategy`` in ``package`` (``lightning.pytorch``, ``pytorch_lightning``)."""
    fsdp = importlib.import_module(f"{package}.strategies")
    lightning_optimizer = importlib.import_module(f"{package}.core.optimizer").LightningOptimizer

    class CPUFSDPStrategy(fsdp.FSDPStrategy):  # type: ignore[misc,name-defined]
        """``FSDPStrategy`` wrapping the model for the CPU (``device_id=torch.device("cpu")``); the rest is Lightning's.

        Args:
            **kwargs: those of ``FSDPStrategy`` (``sharding_strategy``, ``state_dict_type``, ``use_orig_params``, ...).
        """

        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("process_group_backend", "gloo")
            super().__init__(**kwargs)

        def _setup_model(self, model: nn.Module) -> nn.Module:
            if not any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
                # Lightning's own wrapping, with the one argument it gets wrong on CPU.
                model = FullyShardedDataParallel(
                    module=model,
                    cpu_offload=self.cpu_offload,
                    mixed_precision=self.mixed_precision_config,
                    sharding_strategy=self.sharding_strategy,
                    device_id=self.root_device,
                    **self.kwargs,
                )
            # Lightning's own post-wrapping steps (torchmetrics to the device, activation checkpointing). An auto-wrap
            # policy was applied above: keep it from warning that the model is already wrapped.
            policy = self.kwargs.pop("auto_wrap_policy", None)
            try:
                return super()._setup_model(model)  # type: ignore[no-any-return]
            finally:
                if policy is not None:
                    self.kwargs["auto_wrap_policy"] = policy

        def optimizer_state(self, optimizer: Optimizer) -> dict[str, Tensor]:
            if self._state_dict_type != "full":
                return super().optimizer_state(optimizer)  # type: ignore[no-any-return]
            if isinstance(optimizer, lightning_optimizer):
                optimizer = optimizer._optimizer
            assert self.model is not None
            # As Lightning's, rank 0 only, but without the offload to CPU that aliases the gathered states (module doc).
            with FullyShardedDataParallel.state_dict_type(
                self.model,
                StateDictType.FULL_STATE_DICT,
                FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
            ):
                state: dict[str, Any] = FullyShardedDataParallel.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:
                # Lightning stores the full optimizer state keyed by parameter index, as a plain optimizer's.
                state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
            return state

    return CPUFSDPStrategy


CPUFSDPStrategy = cpu_fsdp_strategy()
