"""Modules that compute in FP32 inside an autocast region: autocast is off within their forward, their inputs FP32.

For a layer whose forward overflows fp16 (an output above 65504 that no loss scale can prevent) or whose precision
matters more than its speed: ``MixedPrecisionPlugin(keep_fp32=(TheModule,))`` runs every instance of those types as
an FP32 model would, whatever autocast does around them. Their outputs are FP32; the ops after them are cast by
autocast as usual.

Examples:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))
    >>> handles = compute_in_fp32(model, (nn.Sequential,), "cpu")  # the inner Sequential (the root is excluded)
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     model[0](torch.ones(1, 4)).dtype, model[1](torch.ones(1, 4)).dtype
    (torch.bfloat16, torch.float32)
    >>> for handle in handles: handle.remove()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["compute_in_fp32"]


def compute_in_fp32(module: nn.Module, types: Sequence[type[nn.Module]], device_type: str) -> list[RemovableHandle]:
    """Make every submodule of ``module`` (not ``module`` itself) of one of ``types`` compute in FP32 under autocast.

    Args:
        module: the model.
        types: the module types to keep in FP32 (their whole forward, children included).
        device_type: the autocast device type to turn off inside them (``"cuda"``, ``"cpu"``...).

    Returns:
        The hook handles (``handle.remove()`` undoes it).
    """
    kinds = tuple(types)
    handles: list[RemovableHandle] = []
    if not kinds:
        return handles
    for name, submodule in module.named_modules():
        if name and isinstance(submodule, kinds):
            region = _FP32Region(device_type)
            handles.append(submodule.register_forward_pre_hook(region.enter))
            handles.append(submodule.register_forward_hook(region.leave, always_call=True))
    return handles


class _FP32Region:
    """Autocast turned off for the duration of one module's forward (re-entrant: a module may call itself)."""

    def __init__(self, device_type: str) -> None:
        self._device_type = device_type
        self._open: list[torch.autocast] = []

    def enter(self, _module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        region = torch.autocast(self._device_type, enabled=False)
        region.__enter__()  # type: ignore[no-untyped-call]
        self._open.append(region)
        return tuple(_widen(arg) for arg in args)

    def leave(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)


def _widen(value: Any) -> Any:
    """Half-precision floating tensors in ``value`` (nested lists and tuples too) as FP32."""
    if isinstance(value, Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_widen(item) for item in value)
    return value
