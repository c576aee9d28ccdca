"""Which Linear layers train in FP8, their conversion in place by torchao, and the way back to a plain Linear.

**Eligible**: a module whose type is exactly ``nn.Linear`` (a subclass may compute something else in its own
``forward``, which torchao's layer would silently replace), without children, whose weight's two dimensions are both
divisible by 16 (what the GPUs' float8 GEMMs need; torchao on CPU runs other shapes, so CPU tests would never catch
it). Then the user's choice, ``modules``:

* ``None``: every eligible layer;
* ``"auto"``: the eligible layers that torchao's recipe-aware speed filter keeps (``_auto_filter_for_recipe``, tuned
  on H100: it keeps only large GEMMs, and none of a small model's); torchao 0.18 has no filter for
  ``rowwise_with_gw_hp``, whose ``output`` and ``grad_input`` GEMMs are rowwise: the rowwise filter is used;
* a callable ``modules(module, name) -> bool``, with ``name`` as ``named_modules()`` of the converted model gives it.

**In place**: torchao's ``convert_to_float8_training`` builds each FP8 layer; its settings are then moved onto the
original module object, whose class becomes torchao's ``Float8Linear``. So the model's modules are the same objects
(references to them, a module shared at two places, FSDP's bookkeeping stay valid), the Parameters are the same
objects (the optimizer and checkpoints see no change), and hooks, buffers and attributes the Linear carried are kept
(torchao's swap alone drops them). A second conversion is a no-op: a converted layer is no longer exactly an
``nn.Linear``, and the layers named in ``skip`` (those fallen back) stay plain.

**Fallback**: :func:`fall_back` makes a converted layer a plain ``nn.Linear`` again over the same Parameters, so the
optimizer's state for them carries on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

from torch import Tensor, nn

from lightning_amp_plus.weights.fp8.layer import LayerGuard
from lightning_amp_plus.weights.fp8.nonfinite import NonfiniteLog

__all__ = [
    "RECIPES",
    "Float8Config",
    "ModuleFilter",
    "Modules",
    "Recipe",
    "convert_in_place",
    "converted",
    "eligible",
    "fall_back",
    "guard_of",
    "warn_what_stays_in_bf16",
]

Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
Float8Config = Any
"""torchao's ``Float8LinearConfig`` (torchao is imported only when a model is converted)."""
RECIPES: tuple[Recipe, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
ModuleFilter = Callable[[nn.Module, str], bool]
Modules = ModuleFilter | Literal["auto"] | None
_GUARD = "_fp8_guard"


def eligible(module: nn.Module, name: str = "") -> bool:
    """Whether ``module`` can train in FP8 on any device.

    Exactly an ``nn.Linear``, no children, both weight dimensions divisible by 16.

    Examples:
        >>> eligible(nn.Linear(32, 64)), eligible(nn.Linear(30, 64)), eligible(nn.Conv1d(16, 16, 1))
        (True, False, False)
    """
    if type(module) is not nn.Linear or next(module.children(), None) is not None:
        return False
    out_features, in_features = module.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def convert_in_place(
    model: nn.Module,
    recipe: Recipe | Float8Config,
    modules: Modules = None,
    skip: Collection[str] = (),
    log: NonfiniteLog | None = None,
) -> dict[str, nn.Linear]:
    """Convert the chosen Linear layers of ``model`` to torchao's FP8 training layer, in place.

    Args:
        model: the model (its submodules are converted; a bare ``nn.Linear`` cannot be replaced in place: wrap it).
        recipe: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``
            (``Float8LinearConfig.from_recipe_name(recipe)``), or a ``Float8LinearConfig`` of one's own (e.g.
            ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``: tensorwise, weights all-gathered in FP8).
        modules: ``None``, ``"auto"`` or a callable ``(module, name) -> bool`` (see the module's docstring).
        skip: names never to convert (the layers fallen back).
        log: where the converted layers report non-finite values, or ``None``.

    Returns:
        The layers this call converted, by name, in ``named_modules()`` order.

    Raises:
        ValueError: ``model`` is itself an eligible ``nn.Linear``.
    """
    from torchao.float8 import convert_to_float8_training

    from lightning_amp_plus.weights.fp8.casts import recipe_config, recipe_name

    if eligible(model):
        raise ValueError(
            "A bare nn.Linear cannot be converted to FP8 in place (the conversion replaces submodules): wrap it, "
            "e.g. nn.Sequential(linear)."
        )
    config = recipe_config(recipe)
    chosen = _chooser(recipe_name(recipe), modules, skip)
    picked: dict[str, nn.Linear] = {}

    def accept(module: nn.Module, name: str) -> bool:
        # torchao walks the tree once per place a module is used: a shared Linear is converted once, at its first name.
        if any(module is seen for seen in picked.values()) or not chosen(module, name):
            return False
        picked[name] = module  # type: ignore[assignment]  # eligible: exactly an nn.Linear
        return True

    convert_to_float8_training(model, config=config, module_filter_fn=accept)
    every_device = _has_high_precision_gemm(config)
    for name, original in picked.items():
        added = _adopt(model, name, original)
        guard = LayerGuard(name, every_device, log, (*added, _GUARD))
        original.__dict__[_GUARD] = guard
        guard.attach(original)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return dict(sorted(picked.items(), key=lambda item: order.get(item[0], len(order))))


def fall_back(layer: nn.Module) -> None:
    """Make a layer converted by :func:`convert_in_place` a plain ``nn.Linear`` again, over the same Parameters.

    Raises:
        ValueError: ``layer`` was not converted by :func:`convert_in_place`.
    """
    guard = layer.__dict__.pop(_GUARD, None)
    if not isinstance(guard, LayerGuard):
        raise ValueError(f"{type(layer).__name__} was not converted to FP8 here: nothing to fall back.")
    guard.detach()
    for key in guard.added:
        layer.__dict__.pop(key, None)
    layer.__class__ = nn.Linear


def converted(layer: nn.Module) -> bool:
    """Whether ``layer`` was converted by :func:`convert_in_place` and has not fallen back."""
    return guard_of(layer) is not None


def guard_of(layer: nn.Module) -> LayerGuard | None:
    """The hooks :func:`convert_in_place` attached to ``layer``, or ``None``."""
    guard = layer.__dict__.get(_GUARD)
    return guard if isinstance(guard, LayerGuard) else None


def _chooser(recipe: str, modules: Modules, skip: Collection[str]) -> ModuleFilter:
    user: ModuleFilter | None = None
    if modules == "auto":
        from torchao.float8 import _auto_filter_for_recipe

        user = _auto_filter_for_recipe("rowwise" if recipe == "rowwise_with_gw_hp" else recipe, filter_fqns=[])
    elif callable(modules):
        user = modules

    def chosen(module: nn.Module, name: str) -> bool:
        return eligible(module, name) and name not in skip and (user is None or bool(user(module, name)))

    return chosen


def _adopt(model: nn.Module, name: str, original: nn.Module) -> tuple[str, ...]:
    """Move torchao's new layer at ``name`` onto ``original`` and put ``original`` back in its place.

    What moves: the class, the settings torchao's layer adds (their names are returned), its Parameters if it wrapped
    them (FP8 all-gather).
    """
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    built = getattr(parent, child)
    added = tuple(key for key in built.__dict__ if key not in original.__dict__)
    original.__dict__.update({key: built.__dict__[key] for key in added})
    for key, parameter in built._parameters.items():
        if parameter is not original._parameters.get(key):
            original._parameters[key] = parameter
    original.__class__ = type(built)
    setattr(parent, child, original)
    return added


def _has_high_precision_gemm(config: Any) -> bool:
    """Whether the recipe leaves a GEMM in high precision (``rowwise_with_gw_hp``'s ``grad_weight``)."""
    from torchao.float8.config import ScalingType

    casts = (config.cast_config_input_for_grad_weight, config.cast_config_grad_output_for_grad_weight)
    return any(cast.scaling_type is ScalingType.DISABLED for cast in casts)


def warn_what_stays_in_bf16(
    converted_now: Collection[str], converted_before: int, model: nn.Module, modules: Modules
) -> None:
    """At a model's first conversion, say what stays in bf16: everything (and why), or its other matrix layers.

    A model whose matrix multiplies live in other module types (transformers' GPT-2 computes its attention and MLP in
    ``Conv1D``, ``nn.MultiheadAttention`` its output projection in a subclass of ``nn.Linear``) trains those in bf16;
    a run that says "fp8-mixed" names them rather than let it pass for FP8.
    """
    if converted_before:
        return
    others = _other_matrix_layers(model)
    if converted_now:
        if others:
            warnings.warn(
                f"{len(converted_now)} layer(s) of the model train in FP8 ({_some(list(converted_now))}); "
                f"{_count(others)} with a weight matrix are not exactly nn.Linear and compute in bf16: "
                f"{_by_type(others)} (torchao converts nn.Linear layers only).",
                UserWarning,
                stacklevel=3,
            )
        return
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    fit = [name for name, module in model.named_modules() if eligible(module, name)]
    if modules == "auto" and fit:
        reason = (
            f"fp8_modules='auto' kept none of the {len(fit)} eligible Linear layers: torchao's speed filter (tuned on "
            "H100) keeps only large GEMMs. Pass fp8_modules=None to convert every eligible layer."
        )
    elif fit:
        reason = f"the fp8_modules filter accepted none of the {len(fit)} eligible Linear layers."
    else:
        reason = (
            f"none of its {len(linears)} nn.Linear layers is eligible (exactly nn.Linear, both weight dimensions "
            "divisible by 16)."
        )
    if others:
        reason += f" Its {_count(others)} with a weight matrix that are not exactly nn.Linear never convert: "
        reason += f"{_by_type(others)}."
    warnings.warn(f"No layer of the model trains in FP8: {reason}", UserWarning, stacklevel=3)


def _other_matrix_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The modules with a 2-D ``weight`` of their own that are neither exactly ``nn.Linear`` nor an embedding."""
    from torchao.float8.float8_linear import Float8Linear

    return {
        name: module
        for name, module in model.named_modules()
        if type(module) is not nn.Linear
        and not isinstance(module, (Float8Linear, nn.Embedding, nn.EmbeddingBag))
        and isinstance(module._parameters.get("weight"), Tensor)
        and module._parameters["weight"].ndim == 2
    }


def _count(layers: Mapping[str, nn.Module]) -> str:
    return f"{len(layers)} layer{'s' if len(layers) != 1 else ''}"


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _by_type(layers: Mapping[str, nn.Module]) -> str:
    kinds: dict[str, list[str]] = {}
    for name, module in layers.items():
        kinds.setdefault(type(module).__name__, []).append(name)
    return "; ".join(f"{len(names)} {kind} ({_some(names)})" for kind, names in kinds.items())
