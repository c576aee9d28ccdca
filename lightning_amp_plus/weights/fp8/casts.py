"""The casts an FP8 recipe makes, and what one of them does to a tensor, computed with torchao's own scale functions.

A Linear trained in FP8 runs three GEMMs: ``output = input @ weight.T``, ``grad_input = grad_output @ weight`` and
``grad_weight = grad_output.T @ input``. Each operand of each GEMM is cast to a float8 format with its own scale, or
left in high precision, as the recipe's ``Float8LinearConfig`` says. A tensorwise scale is one number per tensor, so an
operand used by two GEMMs is cast the same way twice: one cast. A rowwise scale is one number per row along the axis
the GEMM reduces over, so the input scaled per token for ``output`` and per feature (along the tokens) for
``grad_weight`` are two casts that can flush very different values. The cast names are the config's own:

- ``input``, ``weight``: the input and the weight, for ``output``;
- ``grad_output``: the output's gradient, for ``grad_input``;
- ``input_for_grad_weight``, ``weight_for_grad_input``, ``grad_output_for_grad_weight``: the same operands for the
  other GEMM, listed only where they are cast differently (rowwise along another axis, or another config).

torchao is imported when a function here runs, never when this module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = [
    "Cast",
    "all_gathers_in_fp8",
    "cast_counts",
    "has_high_precision_gemm",
    "operand_2d",
    "recipe_casts",
    "recipe_config",
    "recipe_name",
]

Operand = Literal["input", "weight", "grad_output"]

# (cast name, operand, config attribute, axis torchao scales across for that GEMM, the cast it repeats if equal).
# The axes are torchao's (float8_linear.py): the input and the output's gradient as 2-D (tokens, features), the weight
# transposed (in_features, out_features), as the GEMMs take them.
_LAYOUT: tuple[tuple[str, Operand, str, int, str | None], ...] = (
    ("input", "input", "cast_config_input", -1, None),
    ("weight", "weight", "cast_config_weight", 0, None),
    ("grad_output", "grad_output", "cast_config_grad_output", -1, None),
    ("input_for_grad_weight", "input", "cast_config_input_for_grad_weight", 0, "input"),
    ("weight_for_grad_input", "weight", "cast_config_weight_for_grad_input", -1, "weight"),
    ("grad_output_for_grad_weight", "grad_output", "cast_config_grad_output_for_grad_weight", 0, "grad_output"),
)


@dataclass(frozen=True)
class Cast:
    """One float8 cast of a recipe: which operand, to which format, with which scale.

    Attributes:
        name: the config's name for it (``"input"``, ``"input_for_grad_weight"``, ...).
        operand: ``"input"``, ``"weight"`` or ``"grad_output"``.
        dtype: the target float8 format (``torch.float8_e4m3fn``, ``torch.float8_e5m2``).
        dim: the axis of the 2-D operand (:func:`operand_2d`) the scale is taken across (rowwise), ``None`` for one
            scale per tensor.
        power_of_2: whether the scale is rounded down to a power of two (the rowwise recipes).
    """

    name: str
    operand: Operand
    dtype: torch.dtype
    dim: int | None
    power_of_2: bool


def recipe_config(recipe: Any) -> Any:
    """The ``Float8LinearConfig`` of a recipe, as torchao's ``from_recipe_name`` makes it (a config is itself)."""
    from torchao.float8 import Float8LinearConfig

    return recipe if isinstance(recipe, Float8LinearConfig) else Float8LinearConfig.from_recipe_name(recipe)


def recipe_name(recipe: Any) -> str:
    """The recipe a name or a ``Float8LinearConfig`` follows: ``"tensorwise"``, or ``"rowwise"`` for axiswise scales.

    What torchao's speed filter is chosen by (``fp8_modules="auto"``); a config's own casts are read from it.
    """
    if isinstance(recipe, str):
        return recipe
    from torchao.float8.config import ScalingGranularity

    rowwise = recipe.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
    return "rowwise" if rowwise else "tensorwise"


def all_gathers_in_fp8(recipe: Any) -> bool:
    """Whether a config all-gathers the weights in float8 under FSDP2 (``enable_fsdp_float8_all_gather``).

    A recipe name never does.
    """
    return not isinstance(recipe, str) and bool(getattr(recipe, "enable_fsdp_float8_all_gather", False))


def has_high_precision_gemm(config: Any) -> bool:
    """Whether a ``Float8LinearConfig`` leaves a GEMM in high precision (``rowwise_with_gw_hp``'s ``grad_weight``)."""
    from torchao.float8.config import ScalingType

    casts = (config.cast_config_input_for_grad_weight, config.cast_config_grad_output_for_grad_weight)
    return any(cast.scaling_type is ScalingType.DISABLED for cast in casts)


def recipe_casts(config: Any) -> tuple[Cast, ...]:
    """The float8 casts a ``Float8LinearConfig`` makes, in the order of the table above.

    A cast left in high precision (``ScalingType.DISABLED``) is not one; a ``*_for_*`` cast is listed only when it
    scales differently from the main cast of its operand (another config, or a rowwise scale along another axis).
    """
    from torchao.float8.config import ScalingGranularity, ScalingType

    casts: dict[str, Cast] = {}
    for name, operand, attribute, dim, repeats in _LAYOUT:
        cast_config = getattr(config, attribute)
        if cast_config.scaling_type is ScalingType.DISABLED:
            continue
        rowwise = cast_config.scaling_granularity is ScalingGranularity.AXISWISE
        power_of_2 = config.round_scales_to_power_of_2
        cast = Cast(name, operand, cast_config.target_dtype, dim if rowwise else None, power_of_2)
        main = casts.get(repeats) if repeats else None
        if main is not None and (main.dtype, main.dim, main.power_of_2) == (cast.dtype, cast.dim, cast.power_of_2):
            continue
        casts[name] = cast
    return tuple(casts.values())


def operand_2d(operand: Operand, tensor: Tensor) -> Tensor:
    """The operand as torchao's GEMMs take it: the input and the gradient as (tokens, features), the weight transposed.

    Examples:
        >>> operand_2d("input", torch.zeros(2, 3, 16)).shape, operand_2d("weight", torch.zeros(32, 16)).shape
        (torch.Size([6, 16]), torch.Size([16, 32]))
    """
    if operand == "weight":
        return tensor.t()
    return tensor.reshape(-1, tensor.shape[-1])


def cast_counts(operand: Tensor, cast: Cast) -> Tensor:
    """``[nonzero, flushed, subnormal]`` (int64, on the device) for ``cast`` of the 2-D ``operand``.

    The scale is torchao's (``tensor_to_scale``: the float8 maximum over the amax, per tensor or per row, rounded down
    to a power of two where the recipe does), the cast torchao's (``to_fp8_saturated`` of the FP32 product); a value is
    flushed when it is nonzero and its float8 image is zero, left subnormal when its image is nonzero and below the
    format's smallest normal number. Allocates about four FP32 copies of the operand in eager (check steps only);
    compiled, inductor fuses them into the counts' reductions.
    """
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    granularity = ScalingGranularity.TENSORWISE if cast.dim is None else ScalingGranularity.AXISWISE
    values = operand.detach()
    scale = tensor_to_scale(values, cast.dtype, False, None, granularity, cast.dim, cast.power_of_2)
    image = to_fp8_saturated(values.to(torch.float32) * scale, cast.dtype).to(torch.float32)
    nonzero = values != 0
    flushed = nonzero & (image == 0)
    subnormal = (image != 0) & (image.abs() < torch.finfo(cast.dtype).smallest_normal)
    return torch.stack([nonzero.sum(), flushed.sum(), subnormal.sum()])
