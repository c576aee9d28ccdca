"""FP32 master weights for a model held in fp16/bf16: the buffers and the passes over them, without Lightning.

The model keeps its parameters in a half dtype (forward and backward run in it, gradients arrive in it, and DDP
all-reduces them in it); the optimizer steps FP32 *master* copies instead, so that updates far smaller than a half
weight's spacing (1/2048 of the weight in fp16, 1/256 in bf16) are not rounded away. Per step:

1. The half gradients are widened into FP32 master gradients one tensor at a time, each freed as soon as it is read
   (so the two never coexist in full); a loss scaler then unscales, checks and measures the master gradients.
2. The optimizer steps the masters; a skipped step leaves them untouched. While it steps, the model's half weights are
   released (:meth:`MasterWeights.half_weights_released`): the masters hold their values, and the step then needs no
   more memory than an FP32 model's step.
3. The master gradients are freed (no FP32 gradient is kept between steps unless FP32 accumulation asks for it), then
   the masters are rounded into the model, one multi-tensor copy per device.

Parameters that stay FP32 in the model (normalisation layers, by default) are their own masters: the optimizer steps
them directly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["HALF_DTYPES", "MasterWeights", "convert_to_half_", "default_fp32_modules"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def default_fp32_modules() -> tuple[type[nn.Module], ...]:
    """The module types kept in FP32 by default: normalisation layers.

    Their statistics and small affine parameters need FP32's precision, and their kernels accept half inputs with
    FP32 weights (on CPU and CUDA alike).

    Example:
        >>> nn.LayerNorm in default_fp32_modules()
        True
    """
    from torch.nn.modules.batchnorm import _NormBase  # BatchNorm*, SyncBatchNorm, InstanceNorm*

    return (_NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.RMSNorm)


def convert_to_half_(
    module: nn.Module, dtype: torch.dtype, keep_fp32: Sequence[type[nn.Module]] = ()
) -> dict[Tensor, Tensor]:
    """Convert ``module``'s floating parameters and buffers to ``dtype`` in place, except inside ``keep_fp32`` types.

    In place means the parameter objects stay the same (only their data changes), so references held elsewhere (a DDP
    wrapper, an optimizer built later) stay valid.

    Returns:
        For each converted parameter that requires grad, an FP32 copy of its value before the conversion: the exact
        starting point of its master (not the half value converted back).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
        >>> originals = convert_to_half_(net, torch.float16, default_fp32_modules())
        >>> net[0].weight.dtype, net[1].weight.dtype, len(originals)
        (torch.float16, torch.float32, 2)
    """
    if dtype not in HALF_DTYPES:
        raise ValueError(f"`convert_to_half_(dtype={dtype})` takes torch.float16 or torch.bfloat16.")
    keep = tuple(keep_fp32)
    originals: dict[Tensor, Tensor] = {}
    for submodule in _modules_outside(module, keep):
        for param in submodule.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                if param.requires_grad:
                    originals[param] = param.detach().to(torch.float32, copy=True)
                with torch.no_grad():
                    param.data = param.data.to(dtype)
        for name, buffer in submodule.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                setattr(submodule, name, buffer.to(dtype))
        if isinstance(submodule, nn.RNNBase):
            # cuDNN wants an RNN's weights in one contiguous chunk; the conversion gave each its own memory.
            submodule.flatten_parameters()
    return originals


def _modules_outside(module: nn.Module, keep: tuple[type[nn.Module], ...]) -> Iterator[nn.Module]:
    """``module`` and its descendants, skipping every subtree rooted at a ``keep`` type."""
    if keep and isinstance(module, keep):
        return
    yield module
    for child in module.children():
        yield from _modules_outside(child, keep)


class MasterWeights:
    """FP32 masters swapped into an optimizer in place of its half-precision parameters.

    The optimizer's param groups keep their order and options (lr, weight decay, ...), so LR schedulers and per-group
    settings work unchanged; only the tensors in ``group["params"]`` change. Its state, if any, moves to the masters.

    Args:
        optimizer: an optimizer built on the model's parameters (some of them fp16/bf16).
        initial: FP32 starting values for some half parameters (from :func:`convert_to_half_`); others start from
            their half value.
        keep_allocated: half parameters whose memory must never be released during the step (by identity), e.g.
            cuDNN RNN weights, which must stay in the one flat chunk ``flatten_parameters`` made.

    Example:
        >>> model = nn.Linear(1, 1, bias=False).to(torch.float16)
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(1.0)
        >>> opt = torch.optim.SGD(model.parameters(), lr=1.0)
        >>> masters = MasterWeights(opt)
        >>> for _ in range(1000):
        ...     model.weight.grad = torch.full_like(model.weight, -1e-4)
        ...     masters.grads_to_masters_()
        ...     with masters.half_weights_released():
        ...         _ = opt.step()
        >>> round(masters.masters[0].item(), 4), round(model.weight.item(), 3)  # fp16 alone would stay at 1.0
        (1.1, 1.1)
    """

    def __init__(
        self,
        optimizer: Optimizer,
        initial: Mapping[Tensor, Tensor] | None = None,
        keep_allocated: Collection[Tensor] = (),
    ) -> None:
        self.model_params: list[Tensor] = []
        self.masters: list[Tensor] = []
        initial = initial or {}
        for group in optimizer.param_groups:
            for index, param in enumerate(group["params"]):
                if param.dtype not in HALF_DTYPES:
                    continue  # FP32 already (a normalisation layer): it is its own master
                master = _master_for(param, initial.get(param))
                group["params"][index] = master
                if param in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(param)
                self.model_params.append(param)
                self.masters.append(master)
        # `optimizer.zero_grad()` must clear the model's half gradients too (they are not the optimizer's any more),
        # e.g. under manual optimization. Lightning calls zero_grad through a wrapper class built from the
        # optimizer's class, so the override goes into the class (a cached subclass), not onto the instance.
        setattr(optimizer, _HALF_PARAMS, self.model_params)
        optimizer.__class__ = _clearing_class(type(optimizer))
        kept = {id(param) for param in keep_allocated}
        self._releasable = [param for param in self.model_params if id(param) not in kept]

    def __len__(self) -> int:
        return len(self.masters)

    def pairs(self) -> Iterator[tuple[Tensor, Tensor]]:
        """``(model_param, master)`` for every half parameter."""
        return zip(self.model_params, self.masters, strict=True)

    def named_masters(self, named_model_params: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
        """Give each master the name of its model parameter (for diagnostics); FP32 parameters keep their own."""
        master_of = {id(param): master for param, master in self.pairs()}
        return [(name, master_of.get(id(param), param)) for name, param in named_model_params]

    def grads_to_masters_(self) -> None:
        """Add the half gradients into the FP32 master gradients (copy if none yet) and free the half ones.

        One tensor at a time, each half gradient freed right after it is read: at no moment do all the half and all
        the FP32 gradients exist together. Before each step, and after each backward for FP32 gradient accumulation.
        """
        for param, master in self.pairs():
            grad = param.grad
            if grad is None:
                continue
            if master.grad is None:
                master.grad = grad.to(torch.float32)
            else:
                master.grad.add_(grad)
            param.grad = None

    def drop_grads_(self) -> None:
        """Free the master gradients and any half ones: nothing FP32 is kept between steps."""
        for param, master in self.pairs():
            master.grad = None
            param.grad = None

    @torch.no_grad()
    def copy_to_model_(self) -> None:
        """Round the masters into the model's half parameters: one multi-tensor copy per device."""
        by_device: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = defaultdict(lambda: ([], []))
        for param, master in self.pairs():
            targets, sources = by_device[param.device]
            targets.append(param)
            sources.append(master)
        for targets, sources in by_device.values():
            torch._foreach_copy_(targets, sources)

    @contextmanager
    def half_weights_released(self) -> Iterator[None]:
        """Release the model's half weights for the optimizer step; afterwards round the masters back into them.

        The step reads and writes only masters, their gradients and the optimizer state: the half copies are dead
        weight there, 2 bytes per parameter at the step's peak. They are released on entry; on exit (also on an
        error) the master gradients are freed first, then the half weights are re-allocated (one flat buffer per
        device and dtype) and the masters rounded into them in one multi-tensor copy per device.
        """
        for param in self._releasable:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        try:
            yield
        finally:
            self.drop_grads_()
            self._reallocate(self._releasable)
            self.copy_to_model_()

    def _reallocate(self, params: list[Tensor]) -> None:
        shape_of = {id(param): master.shape for param, master in self.pairs()}
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
        for param in params:
            groups[(param.device, param.dtype)].append(param)
        for (device, dtype), group in groups.items():
            sizes = [shape_of[id(param)].numel() for param in group]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            for param, piece in zip(group, torch.split(flat, sizes), strict=True):
                param.data = piece.view(shape_of[id(param)])


_HALF_PARAMS = "_lightning_amp_plus_half_params"
_CLEARING_CLASSES: dict[type, type] = {}


class _ClearsHalfGrads:
    """Mixed into an optimizer's class: ``zero_grad`` also clears the half gradients behind its FP32 masters."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]
        for param in getattr(self, _HALF_PARAMS, ()):
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()


def _clearing_class(cls: type) -> type:
    if issubclass(cls, _ClearsHalfGrads):
        return cls
    if cls not in _CLEARING_CLASSES:
        _CLEARING_CLASSES[cls] = type(cls.__name__, (_ClearsHalfGrads, cls), {"__module__": cls.__module__})
    return _CLEARING_CLASSES[cls]


def _master_for(param: Tensor, initial: Tensor | None) -> nn.Parameter:
    value = param.detach().to(torch.float32, copy=True) if initial is None else initial
    return nn.Parameter(value.to(param.device), requires_grad=param.requires_grad)
