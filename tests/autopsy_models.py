"""Small models with injected numerical faults, and the "nothing left behind" checks, shared by the autopsy and headroom
tests and ``bench_autopsy.py``.

Faults on a 3-block MLP (width 16, batch 8, MSE loss) under fp16 autocast on CPU:

* A (``fault_a``): ``blocks.1.fc``'s weights are 1e5, so its forward output (~5e5) exceeds fp16's 65504.
* B (``fault_b``): a healthy model at scale 2**24: the scaled gradient of the loss overflows fp16 where it enters the
  model's half output; at scale 1 it is finite.
* B in a layer (``fault_b_in_layer``): ``blocks.1.fc``'s weights are 1e3 times larger and its inputs 1e3 times
  smaller: the forward is unchanged in size, but its backward multiplies the incoming gradient by ~1e3 * 16, which
  overflows fp16 at scale 2**14 and not at 2**9.
* C (``fault_c``): ``blocks.1.extra`` is an identity whose custom backward returns inf: non-finite at any scale, in
  FP32 too.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

WIDTH = 16


class Block(nn.Module):
    """Linear -> [BatchNorm] -> ReLU (in place, as torchvision's) -> [Dropout] -> extra."""

    def __init__(self, width: int, extra: nn.Module | None = None, dropout: float = 0.0, norm: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width) if norm else nn.Identity()
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.extra = extra if extra is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.extra(self.drop(self.act(self.norm(self.fc(x)))))


class MLP(nn.Module):
    """``depth`` blocks and a Linear head; ``extra`` goes into ``blocks.1``."""

    def __init__(
        self, depth: int = 3, extra: nn.Module | None = None, dropout: float = 0.0, norm: bool = False, seed: int = 0
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([Block(WIDTH, extra if i == 1 else None, dropout, norm) for i in range(depth)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class InfBackward(torch.autograd.Function):
    """The identity, with a backward that returns inf (NaN where the incoming gradient is 0)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * math.inf


class BrokenBackward(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return InfBackward.apply(x)  # type: ignore[no-any-return]


def batch(seed: int = 1, n: int = 8) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, WIDTH, generator=generator), torch.randn(n, 1, generator=generator)


def mse(model: nn.Module, data: tuple[Tensor, Tensor]) -> Callable[[], Tensor]:
    """The ``run`` of a batch: the forward and its MSE loss in FP32 (the model's output upcast)."""
    x, y = data
    return lambda: F.mse_loss(model(x).float(), y)


def fault_a() -> MLP:
    model = MLP()
    with torch.no_grad():
        model.blocks[1].fc.weight.fill_(1e5)
    return model


def fault_b() -> MLP:
    return MLP()


def fault_b_in_layer() -> MLP:
    model = MLP()
    with torch.no_grad():
        model.blocks[0].fc.weight.mul_(1e-3)
        model.blocks[0].fc.bias.fill_(1e-3)
        model.blocks[1].fc.weight.mul_(1e3)
    return model


def fault_c() -> MLP:
    return MLP(extra=BrokenBackward())


def without_inplace(model: nn.Module) -> nn.Module:
    """A deepcopy whose ReLUs are not in place (same values), so that full backward hooks can watch it."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    return twin


def plain_gradients(
    model: nn.Module, data: tuple[Tensor, Tensor], dtype: torch.dtype | None, scale: float
) -> tuple[Tensor, list[Tensor]]:
    """An independent replay: a deepcopy's forward under ``dtype`` autocast (FP32 for ``None``), then
    ``(loss * scale).backward()``; the loss and the parameters' gradients."""
    twin = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = mse(twin, data)()
    (loss * scale).backward()
    return loss.detach(), [p.grad for p in twin.parameters() if p.grad is not None]


def finite(tensors: list[Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def draws_everything(model: nn.Module, data: tuple[Tensor, Tensor]) -> Callable[[], Tensor]:
    """A ``run`` that also draws from Python's and NumPy's generators (as some training steps do)."""
    forward = mse(model, data)
    return lambda: forward() * (1.0 + 0.0 * random.random() + 0.0 * float(np.random.rand()))


def snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "grad_ids": {n: id(p.grad) for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "buffer_ids": {n: id(b) for n, b in model.named_buffers()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()
        ),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key in ("params", "buffers"):
        for name, value in before[key].items():
            assert torch.equal(value, after[key][name]), f"{key} {name} changed"
    for name, grad in before["grads"].items():
        other = after["grads"][name]
        assert (grad is None) == (other is None) and (grad is None or torch.equal(grad, other)), f"grad {name} changed"
    for key in ("grad_ids", "buffer_ids", "training", "hooks", "python_rng", "autocast"):
        assert before[key] == after[key], f"{key} changed"
    assert torch.equal(before["torch_rng"], after["torch_rng"]) and np.array_equal(
        before["numpy_rng"], after["numpy_rng"]
    )
