"""FP8 training of a model's Linear layers on torchao, in one object a training loop (or a precision plugin) drives.

:class:`FP8Training` holds the choices (recipe, which layers, how often to read the casts, when to fall back) and the
state of a run: the converted layers, the layers fallen back, the readings' counts, the non-finite flags. A loop calls
:meth:`~FP8Training.convert` once before building the optimizer, :meth:`~FP8Training.start_check` before the forward of
a check step and :meth:`~FP8Training.finish_check` after its optimizer step, :meth:`~FP8Training.nonfinite_layers`
when a step was skipped, and :meth:`~FP8Training.end_step` after every step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_amp_plus._checks import check_int, real, show
from lightning_amp_plus.weights.fp8.convert import (
    RECIPES,
    Modules,
    Recipe,
    convert_in_place,
    converted,
    fall_back,
    warn_if_none,
)
from lightning_amp_plus.weights.fp8.fallback import FallbackRule
from lightning_amp_plus.weights.fp8.nonfinite import NonfiniteLog
from lightning_amp_plus.weights.fp8.readings import CastReading, Readings, worst_flush

__all__ = [
    "DEFAULT_CHECK_INTERVAL",
    "DEFAULT_FALLBACK",
    "DEFAULT_RECIPE",
    "FP8Check",
    "FP8Training",
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
DEFAULT_FALLBACK: float | None = 1.0
INSTALL = 'pip install "lightning-amp-plus[fp8]"'


def require_torchao(owner: str = "FP8Training") -> None:
    """Raise ``ModuleNotFoundError`` naming the install command unless torchao's float8 training can be imported."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        raise ModuleNotFoundError(
            f"`{owner}` trains in FP8 with torchao, which is not installed ({error}): {INSTALL} (torchao 0.18.0)."
        ) from None


def check_recipe(owner: str, name: str, value: object) -> Recipe:
    """``value`` if it is one of :data:`~lightning_amp_plus.weights.fp8.convert.RECIPES`, else ``ValueError``.

    Examples:
        >>> check_recipe("MixedPrecisionPlugin", "fp8_recipe", "delayed")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `MixedPrecisionPlugin(fp8_recipe='delayed')` is not an FP8 recipe: use 'tensorwise', 'rowwise' or...
    """
    for recipe in RECIPES:
        if value == recipe:
            return recipe
    raise ValueError(
        f"`{owner}({name}={show(value)})` is not an FP8 recipe: use 'tensorwise', 'rowwise' or 'rowwise_with_gw_hp'."
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
        ValueError: `MixedPrecisionPlugin(fp8_fallback=0)` must be None (never fall back) or a percent in (0, 100)...
    """
    number = real(value)
    if value is None:
        return None
    if number is None or not 0 < number < 100:
        raise ValueError(
            f"`{owner}({name}={show(value)})` must be None (never fall back) or a percent in (0, 100), e.g. 1.0 (a "
            "layer flushing more than 1% of a cast's values at two readings in a row goes back to bf16)."
        )
    return number


@dataclass(frozen=True)
class FP8Check:
    """What one check step found.

    Attributes:
        readings: one per converted layer and cast.
        fell_back: the layers sent back to bf16 at this check (by the rule).
    """

    readings: list[CastReading]
    fell_back: list[str]


class FP8Training:
    """FP8 training of a model's eligible Linear layers with torchao, readings of its casts and a fallback to bf16.

    Args:
        recipe: torchao's recipe, ``"tensorwise"`` (one scale per tensor: the fastest), ``"rowwise"`` (one scale
            per row, e4m3 everywhere) or ``"rowwise_with_gw_hp"`` (rowwise, the weight gradient in high precision).
        modules: which eligible layers: ``None`` (all), ``"auto"`` (torchao's speed filter) or a callable
            ``(module, name) -> bool`` (see :mod:`~lightning_amp_plus.weights.fp8.convert`).
        check_interval: read the casts every this many optimizer steps (:meth:`is_check_step`).
        fallback: percent flushed above which a layer, at two readings in a row, goes back to bf16; ``None`` to
            only read.
        owner: the class named in error messages and warnings (a front end passes its own).

    Raises:
        ModuleNotFoundError: torchao is not installed (the message says how to install it).

    Examples:
        >>> import pytest; _ = pytest.importorskip("torchao.float8")  # the example needs the fp8 extra
        >>> import torch
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))  # 64x10: not eligible
        >>> fp8 = FP8Training("tensorwise")
        >>> fp8.convert(model)
        ['0']
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> fp8.start_check()
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     loss = model(torch.randn(32, 64)).float().square().mean()
        >>> loss.backward(); optimizer.step()
        >>> [(r.cast, r.flushed_pct) for r in fp8.finish_check().readings]
        [('input', 0.0), ('weight', 0.0), ('grad_output', 0.0)]
    """

    def __init__(
        self,
        recipe: Recipe = DEFAULT_RECIPE,
        modules: Modules = None,
        check_interval: int = DEFAULT_CHECK_INTERVAL,
        fallback: float | None = DEFAULT_FALLBACK,
        owner: str = "FP8Training",
    ) -> None:
        self.recipe = check_recipe(owner, "recipe", recipe)
        self.modules = check_modules(owner, "modules", modules)
        self.check_interval = check_check_interval(owner, "check_interval", check_interval)
        self.rule = FallbackRule(check_fallback(owner, "fallback", fallback))
        self.owner = owner
        require_torchao(owner)
        self.log = NonfiniteLog()
        self.readings = Readings()
        self._layers: dict[str, nn.Linear] = {}
        self._fallen: list[str] = []

    @property
    def layers(self) -> dict[str, nn.Linear]:
        """The layers training in FP8 now, by name (converted and not fallen back)."""
        return {name: layer for name, layer in self._layers.items() if converted(layer)}

    @property
    def fallen_back(self) -> list[str]:
        """The layers sent back to bf16, in the order they fell back."""
        return list(self._fallen)

    def convert(self, model: nn.Module) -> list[str]:
        """Convert ``model``'s chosen layers in place (a second call converts only what is new); return their names.

        Warns when the model ends up with no FP8 layer at all, saying why.
        """
        before = len(self.layers)
        now = convert_in_place(model, self.recipe, self.modules, skip=set(self._fallen), log=self.log)
        self._layers.update(now)
        warn_if_none(now, before, model, self.modules)
        return list(now)

    def is_check_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from 0) reads the casts."""
        return step % self.check_interval == 0

    def start_check(self) -> None:
        """Read the casts of every FP8 layer until :meth:`finish_check` (call before the step's first forward)."""
        self.readings.arm(self.layers)

    def finish_check(self, reduce: Callable[[Tensor], Tensor] | None = None) -> FP8Check:
        """Read the check step's casts (one host sync), apply the fallback rule, and fall back the layers it names.

        Args:
            reduce: applied to the counts before they are read (e.g. a SUM all-reduce across data-parallel ranks, so
                that every rank falls back the same layers).
        """
        readings = self.readings.take(reduce)
        due = self.rule.update(readings)
        worst = worst_flush(readings)
        for name in due:
            reading = worst[name]
            self.fall_back(name)
            warnings.warn(
                f"FP8 layer `{name}` flushed {reading.flushed_pct:.2f}% of its {reading.cast} cast's nonzero values "
                f"to zero at {self.rule.in_a_row} readings in a row (fallback above {self.rule.threshold_pct:g}%): it "
                "computes in bf16 from now on, over the same parameters and optimizer state.",
                UserWarning,
                stacklevel=2,
            )
        return FP8Check(readings, due)

    def nonfinite_layers(self) -> list[str]:
        """The FP8 layers whose casts met a NaN or inf since the last :meth:`end_step`, the origin first.

        One host sync: read it when the step is known to be skipped.
        """
        return self.log.read({name: layer.weight for name, layer in self.layers.items()})

    def end_step(self) -> None:
        """Clear the non-finite flags (no sync): after every optimizer step, skipped or not."""
        self.log.reset()

    def fall_back(self, name: str) -> None:
        """Send FP8 layer ``name`` back to a plain ``nn.Linear`` over the same Parameters, and record it.

        Raises:
            KeyError: ``name`` is not an FP8 layer.
        """
        layer = self.layers.get(name)
        if layer is None:
            raise KeyError(f"{name!r} is not an FP8 layer; FP8 layers: {sorted(self.layers)}.")
        fall_back(layer)
        self._fallen.append(name)

    def state_dict(self) -> dict[str, Any]:
        """Plain values: the layers fallen back and the rule's counts."""
        return {"version": 1, "fallen_back": list(self._fallen), **self.rule.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: the recorded layers fall back now if converted, or are never converted.

        Raises:
            ValueError: the state is not one :meth:`state_dict` wrote.
        """
        fallen = state.get("fallen_back")
        if state.get("version") != 1 or not isinstance(fallen, list) or not all(isinstance(n, str) for n in fallen):
            raise ValueError(f"Not an FP8 training state (version 1, 'fallen_back': [names]): {show(dict(state))}.")
        self.rule.load_state_dict(state)
        live = self.layers
        # Loaded after a conversion, a recorded name should be one of the converted layers.
        missing = [name for name in fallen if name not in live and name not in self._fallen] if self._layers else []
        for name in fallen:
            if name in live:
                self.fall_back(name)
            elif name not in self._fallen:
                self._fallen.append(name)
        if missing:
            warnings.warn(
                f"The FP8 state records fallen-back layers this model has not converted: {missing}.",
                UserWarning,
                stacklevel=2,
            )
