"""What a converted Linear gains besides torchao's conversion: two hooks that fix what torchao 0.18 lacks.

* **The input cast off CUDA.** torchao's ``Float8Linear.forward`` casts its input to the autocast dtype only under
  CUDA autocast. Under CPU autocast the input stays FP32 while autocast makes the FP8 GEMM's output bf16, and a recipe
  that computes a GEMM in high precision (``rowwise_with_gw_hp``: ``grad_weight`` in bf16) then multiplies a bf16
  gradient by the FP32 input in its first backward and fails (``BFloat16 != float``). For such recipes the input is
  cast under any device's autocast as torchao casts it under CUDA's; the recipes that run on CPU as torchao leaves
  them (``tensorwise``, ``rowwise``) are left alone, so they stay bit for bit torchao's own path on every device.
* **Evaluation under ``torch.inference_mode()``** (Lightning's ``validate``/``test``/``predict`` default): torchao's
  float8 tensor does not implement what inference mode dispatches (``aten.to.dtype``, an axiswise ``reshape``), so
  the forward raises. It runs instead with inference mode off and gradients off, which is exactly the forward of
  ``torch.no_grad()`` evaluation (fit's own validation): the same FP8 numerics, a plain (not inference) output.

And the layer reports its output (what its forward casts met) and its output's gradient (what its backward casts
read) to a :class:`~lightning_amp_plus.weights.fp8.nonfinite.NonfiniteLog` (device flags, no host sync). Under
``torch.compile`` the hooks compile into the graph without a break; the output gradients are then not reported (a
tensor hook that writes a tensor from backward fails to compile), and the inference-mode branch is not needed (a
compiled FP8 model runs under inference mode as it is: checked on CPU, equal to its ``no_grad`` forward).

The hook pair is one :class:`LayerGuard` per layer; the conversion attaches it, a fallback detaches it.
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from lightning_amp_plus.weights.fp8.nonfinite import NonfiniteLog

__all__ = ["LayerGuard", "input_as_cast"]


def input_as_cast(value: Any, every_device: bool) -> Any:
    """``value`` as the FP8 layer's casts take it.

    In CUDA's autocast dtype under CUDA autocast (torchao's own rule), and, if ``every_device``, in the autocast dtype
    of its device under that device's autocast.

    Examples:
        >>> x = torch.ones(2, 16)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     input_as_cast(x, every_device=False).dtype, input_as_cast(x, every_device=True).dtype
        (torch.float32, torch.bfloat16)
    """
    if not isinstance(value, Tensor) or not value.is_floating_point():
        return value
    if torch.is_autocast_enabled("cuda"):
        return value.to(torch.get_autocast_dtype("cuda"))
    device = value.device.type
    if every_device and device != "cuda" and torch.is_autocast_enabled(device):
        return value.to(torch.get_autocast_dtype(device))
    return value


def compiling() -> bool:
    """Whether torch.compile is tracing (a constant to dynamo)."""
    return bool(torch.compiler.is_compiling())


class LayerGuard:
    """The hooks of one converted layer: input cast, inference-mode evaluation, non-finite reports.

    Args:
        name: the layer's name (``named_modules()`` of the model that was converted).
        cast_every_device: cast the input under any device's autocast (the recipes with a high-precision GEMM).
        log: where the layer reports what its casts see, or ``None``.
        added: the attribute names the conversion added to the module (removed again by a fallback).
    """

    def __init__(self, name: str, cast_every_device: bool, log: NonfiniteLog | None, added: tuple[str, ...]) -> None:
        self.name = name
        self.cast_every_device = cast_every_device
        self.log = log
        self.added = added
        self.handles: list[RemovableHandle] = []
        self._open: list[ExitStack | None] = []

    def attach(self, layer: nn.Module) -> None:
        """Register the hooks on ``layer``."""
        self.handles = [
            layer.register_forward_pre_hook(self.before, with_kwargs=True),
            layer.register_forward_hook(self.after, always_call=True),
        ]

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def before(self, _layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The forward pre-hook: cast the input, leave inference mode if on."""
        # One entry per call, popped by `after` (which runs even when the forward raises): calls may nest.
        region = None
        # torch.compile cannot trace the inference-mode test (a graph break per layer), and needs no help there: a
        # compiled FP8 model runs under inference mode as it is.
        if not compiling() and torch.is_inference_mode_enabled():
            # torchao's float8 tensor cannot run under inference mode: the no_grad forward gives the same numbers.
            region = ExitStack()
            region.enter_context(torch.inference_mode(False))
            region.enter_context(torch.no_grad())
        self._open.append(region)
        return self._cast(args, kwargs)

    def after(self, _layer: nn.Module, _args: Any, output: Any) -> None:
        """The forward hook (also when the forward raised): restore inference mode, or report the output.

        And watch the output's gradient.
        """
        region = self._open.pop() if self._open else None
        if region is not None:
            region.close()
            return
        if self.log is None or not isinstance(output, Tensor) or not torch.is_grad_enabled():
            return
        self.log.saw_output(self.name, output)
        # Not under compile: a hook writing a tensor from backward fails AOT autograd's partition.
        if output.requires_grad and not compiling():
            output.register_hook(partial(self.log.saw_grad, self.name))  # type: ignore[no-untyped-call]

    def _cast(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (input_as_cast(args[0], self.cast_every_device), *args[1:]), kwargs
        if "input" in kwargs:
            return args, {**kwargs, "input": input_as_cast(kwargs["input"], self.cast_every_device)}
        return args, kwargs
