"""The user's own module inside the wrappers Lightning, Fabric and torch put around it, and its parameters' names.

Diagnostics name parameters as the user wrote them (``net.2.weight``), not as a wrapper prefixes them
(``_forward_module.``, ``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``).
"""

from __future__ import annotations

from torch import Tensor, nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from lightning_amp_plus.diagnostics.names import plain_name

__all__ = ["unwrapped", "user_names"]


def user_names(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Parameter names as the user wrote them, for diagnostics.

    Fabric's, DDP's and ``torch.compile``'s wrappers are looked through (their ``named_parameters()`` prefix every name
    with ``_forward_module.``, ``module.`` or ``_orig_mod.``), and the parts FSDP1 and activation checkpointing add
    inside the model (``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``) are dropped, as from its state dict.
    """
    return [(plain_name(name), param) for name, param in unwrapped(module).named_parameters()]


def unwrapped(module: nn.Module) -> nn.Module:
    """The user's own module inside Fabric's ``_FabricModule``, DDP, FSDP1 and ``torch.compile``'s wrappers (nested).

    Only these wrappers are looked through: a ``module`` attribute of any other module (a LightningModule's included)
    is the user's own submodule. Fabric's wrapper is looked through whichever of Lightning's Fabric packages made it
    (``lightning.fabric``, ``lightning_fabric``: a class each), so that a monitor of one namespace names the layers of a
    loop run by the other as the user wrote them.

    Examples:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> unwrapped(torch.compile(net)) is net, unwrapped(net) is net
        (True, True)
    """
    while True:
        if isinstance(module, (DistributedDataParallel, FullyShardedDataParallel)):
            module = module.module
        elif _is_fabric_wrapper(module):
            inner = module.module  # the wrapper's property: the user's module
            assert isinstance(inner, nn.Module)
            module = inner
        elif isinstance(module, OptimizedModule):
            module = module._orig_mod
        else:
            return module


def _is_fabric_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is Fabric's ``_FabricModule`` (or a subclass), from either of Lightning's Fabric packages.

    By name: importing the other package's class would import that package (this module is loaded over each,
    :mod:`lightning_amp_plus._standalone`, and the load renames the packages' dotted names, so the test names neither).
    """
    return any(
        cls.__name__ == "_FabricModule" and cls.__module__.endswith("fabric.wrappers") for cls in type(module).__mro__
    )
