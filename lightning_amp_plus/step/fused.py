"""The fused path's passes: measure the still-scaled gradients; step an optimizer that unscales and skips itself.

``torch.optim`` optimizers built with ``fused=True`` take GradScaler's protocol: ``grad_scale`` (the loss scale) and
``found_inf`` (1.0 to skip) set on the optimizer before ``step()``; the kernel divides and skips on the device. The
engine decides when the path is taken (``StepEngine.uses_fused_path``); the values it measures here wait on the
device (:class:`~.outcome.PendingReads`) until something reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_amp_plus.step.grads import measure
from lightning_amp_plus.step.sharding import Sharding, local_views, max_across_ranks

__all__ = ["measure_scaled", "step_with_flags"]


@torch.no_grad()
def measure_scaled(
    grads: Sequence[Tensor], sharding: Sharding | None, process_group: Any, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Each gradient's norm and the global norm (the same on every rank), read-only, on ``device``: no host read.

    Examples:
        >>> measure_scaled([torch.tensor([3.0, 4.0]), torch.tensor([12.0])], None, None, torch.device("cpu"))
        (tensor([ 5., 12.]), tensor(13.))
    """
    norms = measure(grads if sharding is None else local_views(grads), device)
    if sharding is not None:
        return norms, sharding.all_reduce_((norms.square() * sharding.weights(grads, device)).sum()).sqrt()
    total = torch.linalg.vector_norm(norms)
    return norms, total if process_group is None else max_across_ranks(total, process_group)


def step_with_flags(
    optimizer: Optimizer, inner: Optimizer, scale: Tensor | None, found_inf: Tensor, kwargs: dict[str, Any]
) -> Any:
    """``optimizer.step(**kwargs)`` with ``grad_scale`` and ``found_inf`` set on ``inner``; both removed after.

    ``inner`` is the optimizer that runs the kernel (a wrapper such as Lightning's ``LightningOptimizer`` would keep
    the attributes itself). As GradScaler: a ``grad_scale`` the user set is multiplied in.
    """
    user_scale = getattr(inner, "grad_scale", None)
    if scale is not None and user_scale is not None:
        scale = scale * user_scale
    inner.grad_scale = user_scale if scale is None else scale  # type: ignore[attr-defined]
    inner.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(**kwargs)
    finally:
        del inner.grad_scale  # type: ignore[attr-defined]
        del inner.found_inf  # type: ignore[attr-defined]
