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

**Fallback**: :func:`fall_back` makes a converted layer what it would be had it never been converted, over the same
Parameters, so the optimizer's state for them carries on: a plain ``nn.Linear``, or, where a wrapper swapped its class
for a subclass of its own (FSDP2's ``fully_shard`` makes it ``FSDPFloat8Linear``), the class that wrapper gives an
``nn.Linear`` (``FSDPLinear``: still an ``FSDPModule``, whose gradients FSDP2 reduce-scatters).

The forward a converted layer gains (:class:`~lightning_amp_plus.weights.fp8.training.LayerGuard`) is attached by
:func:`~lightning_amp_plus.weights.fp8.training.convert_in_place`, which converts with :func:`convert_layers`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, Protocol

from torch import Tensor, nn

from lightning_amp_plus.diagnostics.names import plain_name

__all__ = [
    "GUARD",
    "RECIPES",
    "Float8Config",
    "Guard",
    "ModuleFilter",
    "Modules",
    "Recipe",
    "convert_layers",
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
GUARD = "_fp8_guard"
"""The key of a converted layer's :class:`Guard` in its ``__dict__`` (an attribute, not a submodule)."""


class Guard(Protocol):
    """What a converted layer carries under :data:`GUARD`: its forward and the attributes the conversion added."""

    added: tuple[str, ...]

    def detach(self) -> None:
        """Give the layer its forward back."""


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


def convert_layers(
    model: nn.Module, config: Float8Config, modules: Modules = None, skip: Collection[str] = ()
) -> dict[str, tuple[str, ...]]:
    """Convert the chosen Linear layers of ``model`` to torchao's FP8 training layer, in place.

    Args:
        model: the model (its submodules are converted; a bare ``nn.Linear`` cannot be replaced in place: wrap it).
        config: torchao's ``Float8LinearConfig``.
        modules: ``None``, ``"auto"`` or a callable ``(module, name) -> bool`` (see the module's docstring).
        skip: names never to convert (the layers fallen back, named as :func:`convert_in_place` names them).

    Returns:
        The names of the layers this call converted, in ``named_modules()`` order, each with the names of the
        attributes torchao's layer added to it (a fallback removes them).

    Raises:
        ValueError: ``model`` is itself an eligible ``nn.Linear``.
    """
    from torchao.float8 import convert_to_float8_training

    from lightning_amp_plus.weights.fp8.casts import recipe_name

    if eligible(model):
        raise ValueError(
            "A bare nn.Linear cannot be converted to FP8 in place (the conversion replaces submodules): wrap it, "
            "e.g. nn.Sequential(linear)."
        )
    chosen = _chooser(recipe_name(config), modules, skip)
    picked: dict[str, nn.Linear] = {}

    def accept(module: nn.Module, name: str) -> bool:
        # torchao walks the tree once per place a module is used: a shared Linear is converted once, at its first name.
        if any(module is seen for seen in picked.values()) or not chosen(module, name):
            return False
        picked[name] = module  # type: ignore[assignment]  # eligible: exactly an nn.Linear
        return True

    convert_to_float8_training(model, config=config, module_filter_fn=accept)
    added = {name: _adopt(model, name, original) for name, original in picked.items()}
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return dict(sorted(added.items(), key=lambda item: order.get(item[0], len(order))))


def fall_back(layer: nn.Module) -> None:
    """Make a layer converted here what it would be had it never been converted, over the same Parameters.

    Its forward and the attributes torchao added go, and its class becomes ``nn.Linear``, or the class a wrapper that
    swapped the layer's class gives an ``nn.Linear`` (FSDP2's ``fully_shard``: ``FSDPLinear``, see
    :func:`_class_without_fp8`).

    Raises:
        ValueError: ``layer`` was not converted here.
    """
    guard = guard_of(layer)
    if guard is None:
        raise ValueError(f"{type(layer).__name__} was not converted to FP8 here: nothing to fall back.")
    plain = _class_without_fp8(type(layer))
    del layer.__dict__[GUARD]
    guard.detach()
    for key in guard.added:
        layer.__dict__.pop(key, None)
    # The class swap undoes the conversion's own (_adopt): tests/distributed/test_fp8_distributed.py checks that a
    # layer fully_shard wrapped stays an FSDPModule and trains under no_backward_sync.
    layer.__class__ = plain


def _class_without_fp8(cls: type) -> type:
    """``nn.Linear`` for torchao's ``Float8Linear``; for a wrapper's subclass of it, that wrapper's ``nn.Linear`` class.

    FSDP2's ``fully_shard`` gives a module the class ``FSDP<cls>(FSDPModule, <cls>)``, made once per class and kept
    in its cache (``get_cls_to_fsdp_cls``): a layer sharded after its conversion is ``FSDPFloat8Linear``, and falls
    back to the ``FSDPLinear`` that ``fully_shard`` gives a Linear never converted (the cached class, made the same
    way and cached if no Linear was sharded yet). A plain ``Linear`` would no longer be an ``FSDPModule``: Lightning
    Fabric's ``no_backward_sync`` and FSDP2 itself look for that class, and the layer would silently stop training.
    """
    from torchao.float8.float8_linear import Float8Linear

    if cls is Float8Linear:
        return nn.Linear
    if Float8Linear not in cls.__bases__:
        raise ValueError(f"{cls.__name__} is not Float8Linear nor a wrapper's subclass of it: no way back to bf16.")
    bases = tuple(nn.Linear if base is Float8Linear else base for base in cls.__bases__)
    cache = _wrapper_classes(cls)
    known = cache.get(nn.Linear)
    if known is not None and known.__bases__ == bases:
        return known
    namespace = {key: value for key, value in vars(cls).items() if key not in ("__dict__", "__weakref__")}
    name = cls.__name__.replace(Float8Linear.__name__, nn.Linear.__name__)
    plain = type(name, bases, {**namespace, "__qualname__": name})
    cache[nn.Linear] = plain
    return plain


def _wrapper_classes(cls: type) -> dict[type, type]:
    """The cache of wrapper classes the wrapper behind ``cls`` keeps (FSDP2's), or a fresh dict for another wrapper."""
    from torch.distributed.fsdp import FSDPModule

    if issubclass(cls, FSDPModule):
        # fully_shard's own cache (torch 2.14 names it in its module's __all__; not re-exported by the package).
        from torch.distributed.fsdp._fully_shard._fully_shard import get_cls_to_fsdp_cls

        return get_cls_to_fsdp_cls()
    return {}


def converted(layer: nn.Module) -> bool:
    """Whether ``layer`` was converted here and has not fallen back."""
    return guard_of(layer) is not None


def guard_of(layer: nn.Module) -> Guard | None:
    """The guard the conversion attached to ``layer`` (its forward), or ``None``."""
    return layer.__dict__.get(GUARD)


def _chooser(recipe: str, modules: Modules, skip: Collection[str]) -> ModuleFilter:
    user: ModuleFilter | None = None
    if modules == "auto":
        from torchao.float8 import _auto_filter_for_recipe

        user = _auto_filter_for_recipe("rowwise" if recipe == "rowwise_with_gw_hp" else recipe, filter_fqns=[])
    elif callable(modules):
        user = modules

    def chosen(module: nn.Module, name: str) -> bool:
        return eligible(module, name) and plain_name(name) not in skip and (user is None or bool(user(module, name)))

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
    # The user's module object stays, with its hooks, buffers and attributes, which torchao's swap for a new object
    # drops: tests/weights/test_fp8.py (test_hooks_buffers_attributes_and_mode_of_a_linear_are_carried_over).
    original.__class__ = type(built)
    setattr(parent, child, original)
    return added


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
