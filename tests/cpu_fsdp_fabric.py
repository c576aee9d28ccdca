"""``CPUFabricFSDPStrategy``: Lightning *Fabric*'s ``FSDPStrategy`` made to run on CPU processes over gloo, tests only.

The Fabric twin of :mod:`cpu_fsdp` (the Trainer's). Lightning 2.6.6 runs Fabric's ``FSDPStrategy`` on CUDA only, for two
reasons this subclass lifts:

* Fabric's accelerator connector refuses it with ``accelerator="cpu"`` ("FSDP is only available on GPU"), but that
  check reads ``type(strategy) is FSDPStrategy``: an instance of a subclass passes;
* ``FSDPStrategy.setup_module`` wraps with ``device_id=self.root_device.index``, which is ``None`` for a CPU device,
  and torch's ``FullyShardedDataParallel`` then has no device to run on: it needs ``device_id=torch.device("cpu")``.

Everything else (flat-parameter sharding with ``use_orig_params=True``, ``FSDPPrecision`` required of the plugin,
``no_backward_sync``, FSDP's own ``clip_grad_norm_``, sharded checkpoints) is Fabric's own code, unchanged. Not package
API: FSDP on CPU is not something Lightning supports. :func:`cpu_fsdp_strategy` makes the same subclass over the
standalone ``lightning_fabric`` package's ``FSDPStrategy``.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel


def cpu_fsdp_strategy(package: str = "lightning.fabric") -> type:
    """The CPU twin of ``FSDPStrategy`` of Fabric's ``package`` (``"lightning.fabric"`` or ``"lightning_fabric"``)."""
    fsdp = importlib.import_module(f"{package}.strategies.fsdp")

    class CPUFabricFSDPStrategy(fsdp.FSDPStrategy):  # type: ignore[misc,name-defined]
        """Fabric's ``FSDPStrategy`` that wraps the model for the CPU (``device_id=torch.device("cpu")``).

        Args:
            **kwargs: those of Fabric's ``FSDPStrategy`` (``sharding_strategy``, ``state_dict_type``, ...).
        """

        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("process_group_backend", "gloo")
            super().__init__(**kwargs)

        def setup_module(self, module: nn.Module) -> nn.Module:
            if any(isinstance(submodule, FullyShardedDataParallel) for submodule in module.modules()):
                return super().setup_module(module)  # type: ignore[no-any-return]
            # Fabric's own wrapping, with the one argument it gets wrong on CPU; then its own post-wrapping steps.
            module = FullyShardedDataParallel(
                module=module,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.root_device,
                **self._fsdp_kwargs,
            )
            fsdp._move_torchmetrics_to_device(module, self.root_device)
            fsdp._setup_activation_checkpointing(module, self._activation_checkpointing_kwargs)
            return module

    return CPUFabricFSDPStrategy


CPUFabricFSDPStrategy = cpu_fsdp_strategy()
