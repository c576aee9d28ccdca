"""The user's own module inside the wrappers Lightning, Fabric and torch put around it, and its parameters' names.

Diagnostics name parameters as the user wrote them (``net.2.weight``), not as a wrapper prefixes them
(``_forward_module.``, ``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``).
"""

from __future__ import annotations

from lightning.fabric.wrappers import _FabricModule
from torch import Tensor, nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

__all__ = ["unwrapped", "user_names"]


def user_names(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameter names as the user wrote them, for diagnostics.

    Fabric's, DDP's and ``torch.compile``'s wrappers are looked through (their ``named_parameters()`` prefix every name
    with ``_forward_module.``, ``module.`` or ``_orig_mod.``), and FSDP1's ``_fsdp_wrapped_module.`` is dropped.
    """
    return [(name.replace("_fsdp_wrapped_module.", ""), param) for name, param in unwrapped(module).named_parameters()]


def unwrapped(module: nn.Module) -> nn.Module:
    """The user's own module inside Fabric's ``_FabricModule``, DDP, FSDP1 and ``torch.compile``'s wrappers (nested).

    Only these wrappers are looked through: a ``module`` attribute of any other module (a LightningModule's included)
    is the user's own submodule.
    """
    while True:
        if isinstance(module, (_FabricModule, DistributedDataParallel, FullyShardedDataParallel)):
            module = module.module
        elif isinstance(module, OptimizedModule):
            module = module._orig_mod
        else:
            return module
