"""``"fp8-mixed"`` in the precision plugins: its options, the FP8 training a plugin holds, and what each step adds.

Shared by the Trainer's and Fabric's ``MixedPrecisionPlugin`` (composition: each holds one
:class:`~lightning_amp_plus.weights.fp8.FP8Training` as ``plugin.fp8``, made by
:func:`fp8_for`; ``None`` for the other precisions). The
numerics are :mod:`~lightning_amp_plus.weights.fp8`'s; here the Lightning side of them:

* the options are checked with the plugin's others (:class:`~lightning_amp_plus.plugins.options.Settings`);
* the device: native float8 GEMMs on CUDA from compute capability 8.9 (Ada, Hopper, Blackwell), refused below it;
  emulated on CPU (correct, slow: one warning); refused on MPS (:func:`check_fp8_device`);
* the conversion at set-up (:func:`convert_for`), refused where ``fully_shard`` ran first (FSDP1's plugins refuse
  ``"fp8-mixed"``);
* after each optimizer step (:data:`after_step`): the check step's readings and the non-finite flags reduced across
  data-parallel ranks (one SUM all-reduce, so that every rank falls back the same layers), a fallback (or, with
  ``fp8_fallback=None``, a layer that would fall back) said on rank zero.

The step engine of ``"fp8-mixed"`` is bf16's: autocast to bf16, the check on, no loss scale.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Protocol

import torch
from lightning.fabric.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_amp_plus.plugins.ranks import world_size
from lightning_amp_plus.step.sharding import is_dtensor
from lightning_amp_plus.weights.fp8.convert import eligible
from lightning_amp_plus.weights.fp8.training import FP8Training

__all__ = ["FP8", "after_step", "check_fp8_device", "convert_for", "fp8_for"]

FP8 = "fp8-mixed"
NATIVE_CAPABILITY = (8, 9)
"""The first CUDA compute capability with float8 GEMMs (``torch._scaled_mm``): Ada (sm89), Hopper, Blackwell."""


class FP8Settings(Protocol):
    """What :func:`fp8_for` reads of a plugin's settings (:class:`~lightning_amp_plus.plugins.options.Settings`)."""

    @property
    def precision(self) -> str: ...
    @property
    def fp8_recipe(self) -> Any: ...
    @property
    def fp8_modules(self) -> Any: ...
    @property
    def fp8_check_interval(self) -> int | None: ...
    @property
    def fp8_fallback(self) -> float | None: ...


def fp8_for(name: str, settings: FP8Settings) -> FP8Training | None:
    """The :class:`~lightning_amp_plus.weights.fp8.FP8Training` a plugin holds as ``plugin.fp8`` (fp8-mixed only)."""
    if settings.precision != FP8 or settings.fp8_check_interval is None:
        return None
    return FP8Training(
        settings.fp8_recipe, settings.fp8_modules, settings.fp8_check_interval, settings.fp8_fallback, owner=name
    )


def check_fp8_device(name: str, device: str, warn: bool) -> None:
    """Refuse a device without float8 GEMMs; on CPU warn (when ``warn``) that they are emulated.

    Raises:
        ValueError: a CUDA device below compute capability 8.9, naming it; MPS.
    """
    if device == "cuda":
        capability = torch.cuda.get_device_capability()
        if capability < NATIVE_CAPABILITY:
            raise ValueError(
                f"`{name}('{FP8}')`: this GPU ({torch.cuda.get_device_name()}, compute capability "
                f"{capability[0]}.{capability[1]}, sm{capability[0]}{capability[1]}) has no float8 matrix multiply: "
                "torch._scaled_mm needs sm89 or newer (Ada, Hopper, Blackwell). Use 'bf16-mixed' on this GPU."
            )
    elif device == "mps":
        raise ValueError(
            f"`{name}('{FP8}')`: float8 matrix multiplies do not run on MPS. Use 'bf16-mixed', or train on CUDA "
            "(sm89 or newer) or CPU (emulated)."
        )
    elif warn and device == "cpu":
        rank_zero_warn(
            f"{name}('{FP8}') on CPU: torch emulates the float8 matrix multiplies there: the numerics are FP8's, the "
            "speed is not (several times slower than bf16-mixed). FP8 pays off on GPUs with compute capability 8.9 "
            "or newer.",
            category=UserWarning,
        )


def convert_for(name: str, fp8: FP8Training, module: nn.Module) -> None:
    """Convert ``module``'s chosen layers at set-up; a second set-up (validate after fit, a second fit) adds none.

    Raises:
        ValueError: eligible layers are sharded by ``fully_shard`` already and none was converted before it (torchao
            converts before sharding: under ``ModelParallelStrategy`` in ``configure_model``).
    """
    sharded = [
        layer_name
        for layer_name, layer in module.named_modules()
        if eligible(layer, layer_name) and is_dtensor(layer.weight)
    ]
    if sharded and not fp8.layers and not fp8.fallen_back:
        raise ValueError(
            f"`{name}('{FP8}')`: the Linear layers {sharded[:3]}{' ...' if len(sharded) > 3 else ''} are sharded "
            "already (fully_shard ran before the plugin could convert them), and torchao converts a layer to FP8 "
            "before it is sharded. Convert them first where you shard, e.g. in configure_model: "
            "`self.trainer.precision_plugin.fp8.convert(self)`, then `fully_shard(..., "
            "mp_policy=self.trainer.precision_plugin.mp_policy)`."
        )
    if not sharded:
        fp8.convert(module)


def _sum_over_ranks(tensor: Tensor) -> Tensor:
    """``tensor`` summed over the world (data-parallel ranks: DDP, FSDP2), in place; as it is in one process."""
    if world_size() > 1:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor


def _rank_zero_warn(message: str) -> None:
    rank_zero_warn(message, category=UserWarning)


after_step = partial(FP8Training.after_step, reduce=_sum_over_ranks, warn=_rank_zero_warn)
"""``after_step(fp8, result)``, after an optimizer step, skipped or not (the plugins' call): ``fp8.after_step(result)``
with the readings and flags summed over the ranks and a fallback said on rank zero.

The method itself with those two arguments bound: an ordinary step runs no function of this module (the rank count
and the warning are needed on check steps and skipped steps only).
"""
