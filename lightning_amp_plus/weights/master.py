"""FP32 master weights: the model's own parameters hold FP32 at all times; half values live only inside autocast's ops.

Lightning's ``*-mixed`` keeps an FP32 model and lets autocast cast each weight to the half dtype at each use, so the
optimizer always steps FP32 weights (updates far below a half weight's spacing survive) and everything that touches the
model between two uses (a ``training_step``, a hook, a callback, an EMA, a checkpoint) sees and changes FP32 values.
That is the design kept here, for every model: master weights are the model's own ``Parameter`` objects, in FP32.

What ``master_weights=True`` adds is for models that are not FP32: a model built or loaded in half precision
(``model.to(torch.bfloat16)``, ``from_pretrained(torch_dtype=torch.bfloat16)``) has every floating parameter widened
to FP32 once, before training (:func:`widen_to_fp32_`); from then on it trains exactly as an FP32 model under
``*-mixed``. Half copies that live *in* the parameters between uses (an earlier design of this package swapped
``param.data`` for the whole step) leak: user code during the step then reads and writes rounded copies.

Examples:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)).to(torch.bfloat16)
    >>> widen_to_fp32_(half_parameters(model))
    >>> {p.dtype for p in model.parameters()}
    {torch.float32}
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

__all__ = ["HALF_DTYPES", "half_parameters", "widen_to_fp32_"]

HALF_DTYPES = (torch.float16, torch.bfloat16)


def half_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module`` held in fp16 or bf16 (float64 and non-floating ones are left alone), each once.

    Examples:
        >>> lin = nn.Linear(2, 2); lin.weight.data = lin.weight.data.half()
        >>> [p.shape for p in half_parameters(lin)]
        [torch.Size([2, 2])]
    """
    return [param for param in module.parameters() if param.dtype in HALF_DTYPES]


@torch.no_grad()
def widen_to_fp32_(params: Iterable[Tensor]) -> None:
    """Make the data of each parameter not in FP32 yet an FP32 copy (the ``Parameter`` objects stay the same).

    The objects stay, so every reference to them (an optimizer built before, tied weights) stays valid. A gradient
    already there is widened too, so that it matches its parameter.

    Examples:
        >>> w = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> widen_to_fp32_([w]); w.dtype
        torch.float32
    """
    for param in params:
        if param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)
            if param.grad is not None:
                param.grad = param.grad.to(torch.float32)
