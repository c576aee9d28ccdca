"""The options of FP8 training, checked: the recipe, which layers, how often to read the casts, when to fall back.

Each check returns the value to keep or raises an error naming the owner's argument, the value and the fix; the
plugins' ``fp8_*`` arguments and :class:`~lightning_amp_plus.weights.fp8.FP8Training`'s go through the same checks.
torchao is imported only to tell a ``Float8LinearConfig`` or to say it is missing (:func:`require_torchao`).
"""

from __future__ import annotations

from lightning_amp_plus._checks import check_int, real, show
from lightning_amp_plus.weights.fp8.casts import all_gathers_in_fp8
from lightning_amp_plus.weights.fp8.convert import RECIPES, Float8Config, Modules, Recipe
from lightning_amp_plus.weights.fp8.fallback import DEFAULT_THRESHOLD_PCT

__all__ = [
    "DEFAULT_CHECK_INTERVAL",
    "DEFAULT_FALLBACK",
    "DEFAULT_RECIPE",
    "INSTALL",
    "check_all_gather",
    "check_check_interval",
    "check_fallback",
    "check_modules",
    "check_recipe",
    "require_torchao",
]

# Chosen from benchmarks/bench_fp8.py (docs/fp8.md, "What was measured"): the three recipes train the tiny GPT alike
# and tensorwise is the fastest on GPUs; a check every 50 steps costs about 1% of a CPU step and falls back within
# 100 steps (95-96% of the loss gap recovered; at 100 a late outlier is never caught); 1% flushed is above every clean
# layer at two readings in a row (at most 0.65%) and far below the outlier layers (28-53%).
DEFAULT_RECIPE: Recipe = "tensorwise"
DEFAULT_CHECK_INTERVAL = 50
DEFAULT_FALLBACK: float | None = DEFAULT_THRESHOLD_PCT
INSTALL = 'pip install "lightning-amp-plus[fp8]"'


def require_torchao(owner: str = "FP8Training") -> None:
    """Raise ``ModuleNotFoundError`` naming the install command unless torchao's float8 training can be imported."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        raise ModuleNotFoundError(
            f"`{owner}` trains in FP8 with torchao, which is not installed ({error}): {INSTALL} (torchao 0.18.0)."
        ) from None


def check_recipe(owner: str, name: str, value: object) -> Recipe | Float8Config:
    """``value`` if it is a recipe name or a torchao ``Float8LinearConfig``, else ``ValueError``.

    The names are :data:`~lightning_amp_plus.weights.fp8.convert.RECIPES`.

    Examples:
        >>> check_recipe("MixedPrecisionPlugin", "fp8_recipe", "delayed")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `MixedPrecisionPlugin(fp8_recipe='delayed')` is not an FP8 recipe: use 'tensorwise', 'rowwise' or...
    """
    for recipe in RECIPES:
        if value == recipe:
            return recipe
    if not isinstance(value, str) and _is_float8_config(value):
        return value
    raise ValueError(
        f"`{owner}({name}={show(value)})` is not an FP8 recipe: use 'tensorwise', 'rowwise' or 'rowwise_with_gw_hp' "
        "(or a torchao Float8LinearConfig)."
    )


def _is_float8_config(value: object) -> bool:
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError:  # without torchao nothing is a config of it
        return False
    return isinstance(value, Float8LinearConfig)


def check_all_gather(owner: str, recipe: object, fallback: float | None, names: tuple[str, str]) -> None:
    """Refuse a fallback with weights all-gathered in FP8 under FSDP2 (``enable_fsdp_float8_all_gather``).

    A fallen-back layer would keep torchao's all-gather weight type, whose scale
    ``precompute_float8_dynamic_scale_for_fsdp`` refreshes only for FP8 layers: its weights would be gathered in FP8
    under a stale scale. ``names``: how ``owner`` calls the recipe and the fallback arguments.
    """
    if fallback is not None and not isinstance(recipe, str) and all_gathers_in_fp8(recipe):
        raise ValueError(
            f"`{owner}({names[0]}=Float8LinearConfig(enable_fsdp_float8_all_gather=True), {names[1]}={fallback!r})`: "
            "a layer that falls back would keep torchao's FP8 all-gather weight, whose scale torchao refreshes only "
            "for FP8 layers, so FSDP2 would gather it in FP8 under a stale scale. Pass "
            f"{names[1]}=None (read and warn, never fall back), or all-gather in bf16 (drop "
            "enable_fsdp_float8_all_gather)."
        )


def check_modules(owner: str, name: str, value: object) -> Modules:
    """``value`` if it is ``None``, ``"auto"`` or callable, else ``TypeError``.

    Examples:
        >>> check_modules("MixedPrecisionPlugin", "fp8_modules", ["fc1"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: `MixedPrecisionPlugin(fp8_modules=['fc1'])` must be None (every eligible Linear), 'auto' (torch...
    """
    if value is None or value == "auto" or callable(value):
        return value
    raise TypeError(
        f"`{owner}({name}={show(value)})` must be None (every eligible Linear), 'auto' (torchao's speed filter) or a "
        "callable (module, name) -> bool, e.g. lambda module, name: name != 'lm_head'."
    )


def check_check_interval(owner: str, name: str, value: object) -> int:
    """``value`` as an int >= 1, else ``ValueError``."""
    return check_int(owner, name, value, minimum=1, hint=", e.g. 50 (read the casts every 50 optimizer steps)")


def check_fallback(owner: str, name: str, value: object) -> float | None:
    """``None``, or ``value`` as a float in (0, 100), else ``ValueError``.

    Examples:
        >>> check_fallback("MixedPrecisionPlugin", "fp8_fallback", 0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `MixedPrecisionPlugin(fp8_fallback=0)` must be None (never fall back: read and warn) or a percent...
    """
    number = real(value)
    if value is None:
        return None
    if number is None or not 0 < number < 100:
        raise ValueError(
            f"`{owner}({name}={show(value)})` must be None (never fall back: read and warn) or a percent in (0, 100), "
            "e.g. 1.0 (a layer flushing more than 1% of a cast's values at two readings in a row goes back to bf16)."
        )
    return number
