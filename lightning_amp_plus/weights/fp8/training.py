"""FP8 training of a model's Linear layers on torchao, in one object a training loop (or a precision plugin) drives.

:class:`FP8Training` holds the choices (recipe, which layers, how often to read the casts, when to fall back) and the
state of a run: the converted layers, the layers fallen back, the readings' counts, the non-finite flags. A loop calls
:meth:`~FP8Training.convert` once before building the optimizer, then either

* :meth:`~FP8Training.before_forward` before each training forward and :meth:`~FP8Training.after_step` after each
  optimizer step, skipped or not (what the precision plugins do: the check steps come every ``check_interval`` steps,
  the flags of a skipped step are kept for :meth:`~FP8Training.nonfinite_layers`), or
* each part itself: :meth:`~FP8Training.start_check` before the forward of a check step and
  :meth:`~FP8Training.finish_check` after its optimizer step, :meth:`~FP8Training.nonfinite_layers` when a step was
  skipped, and :meth:`~FP8Training.end_step` after every step.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor, nn

from lightning_amp_plus._checks import check_int, real, show
from lightning_amp_plus.weights.fp8.casts import all_gathers_in_fp8
from lightning_amp_plus.weights.fp8.convert import (
    RECIPES,
    Float8Config,
    Modules,
    Recipe,
    convert_in_place,
    converted,
    fall_back,
    warn_what_stays_in_bf16,
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
    "Outcome",
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
    from lightning_amp_plus.weights.fp8.casts import all_gathers_in_fp8

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
        step: the optimizer step it read (counted from 0 by :meth:`FP8Training.after_step`; ``None`` when the loop
            drives the check itself).
    """

    readings: list[CastReading]
    fell_back: list[str]
    step: int | None = None


class Outcome(Protocol):
    """What :meth:`FP8Training.after_step` needs to know of a step.

    A :class:`~lightning_amp_plus.step.engine.StepResult` has it; a fused optimizer's step whose fate is still on the
    device (a :class:`~lightning_amp_plus.step.engine.PendingStep`) also says whether it is ``resolved``.
    """

    @property
    def overflowed(self) -> bool:
        """Whether the step was skipped because its gradients held inf/NaN."""


def _resolved(outcome: Outcome) -> bool:
    """Whether the step's fate is known on the host (reading ``overflowed`` then costs no device read)."""
    return bool(getattr(outcome, "resolved", True))


class FP8Training:
    """FP8 training of a model's eligible Linear layers with torchao, readings of its casts and a fallback to bf16.

    Args:
        recipe: torchao's recipe, ``"tensorwise"`` (one scale per tensor: the fastest), ``"rowwise"`` (one scale
            per row, e4m3 everywhere) or ``"rowwise_with_gw_hp"`` (rowwise, the weight gradient in high precision);
            or a torchao ``Float8LinearConfig`` (e.g. ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``:
            tensorwise, the weights all-gathered in FP8 under FSDP2, which needs ``fallback=None``).
        modules: which eligible layers: ``None`` (all), ``"auto"`` (torchao's speed filter) or a callable
            ``(module, name) -> bool`` (see :mod:`~lightning_amp_plus.weights.fp8.convert`).
        check_interval: read the casts every this many optimizer steps (:meth:`is_check_step`).
        fallback: percent flushed above which a layer, at two readings in a row, goes back to bf16; ``None`` to
            only read.
        owner: the class named in error messages and warnings (a front end passes its own).

    Attributes:
        checks: the latest check steps' findings (:class:`FP8Check`, up to 16, the newest last) that
            :meth:`after_step` made.

    Raises:
        ModuleNotFoundError: torchao is not installed (the message says how to install it).
        ValueError: a bad option (the message names it), or a fallback with the weights all-gathered in FP8.

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
        recipe: Recipe | Float8Config = DEFAULT_RECIPE,
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
        check_all_gather(owner, self.recipe, self.rule.threshold_pct, ("recipe", "fallback"))
        self.log = NonfiniteLog()
        self.readings = Readings()
        self.checks: deque[FP8Check] = deque(maxlen=16)
        self._layers: dict[str, nn.Linear] = {}
        self._fallen: list[str] = []
        self._steps = 0  # optimizer steps seen by after_step
        # The non-finite flags of skipped steps (and, on a fused optimizer's path, of steps whose skip is still on the
        # device), each with the step's outcome, oldest first: what nonfinite_layers reads once the current step's
        # flags are clear.
        self._flags: list[tuple[Outcome, Callable[[], list[str]]]] = []

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

        Warns, at the first conversion, when the model ends up with no FP8 layer at all (saying why), or when some of
        its layers with a weight matrix are not ``nn.Linear`` (they compute in bf16: GPT-2's ``Conv1D``).
        """
        before = len(self.layers)
        now = convert_in_place(model, self.recipe, self.modules, skip=set(self._fallen), log=self.log)
        self._layers.update(now)
        warn_what_stays_in_bf16(now, before, model, self.modules)
        return list(now)

    def is_check_step(self, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from 0) reads the casts."""
        return step % self.check_interval == 0

    def start_check(self) -> None:
        """Read the casts of every FP8 layer until :meth:`finish_check` (call before the step's first forward)."""
        self.readings.arm(self.layers)

    def finish_check(
        self, reduce: Callable[[Tensor], Tensor] | None = None, warn: Callable[[str], None] | None = None
    ) -> FP8Check:
        """Read the check step's casts (one host sync), apply the fallback rule, and fall back the layers it names.

        Args:
            reduce: applied to the counts before they are read (e.g. a SUM all-reduce across data-parallel ranks, so
                that every rank falls back the same layers).
            warn: says that a layer fell back (default: a ``UserWarning``; a plugin passes rank zero's warning).
        """
        readings = self.readings.take(reduce)
        due = self.rule.update(readings)
        worst = worst_flush(readings)
        for name in due:
            reading = worst[name]
            self.fall_back(name)
            message = (
                f"FP8 layer `{name}` flushed {reading.flushed_pct:.2f}% of its {reading.cast} cast's nonzero values "
                f"to zero at {self.rule.in_a_row} readings in a row (fallback above {self.rule.threshold_pct:g}%): it "
                "computes in bf16 from now on, over the same parameters and optimizer state."
            )
            if warn is None:
                warnings.warn(message, UserWarning, stacklevel=2)
            else:
                warn(message)
        return FP8Check(readings, due)

    def before_forward(self) -> None:
        """Before each training forward (each micro-batch's): arm the readings if the coming step is a check step.

        The coming step is the number of steps :meth:`after_step` has seen (a check every ``check_interval`` steps,
        from step 0); once armed, the readings stay on until :meth:`after_step`, so micro-batches add up.
        """
        if self.is_check_step(self._steps) and not self.readings.armed and self.layers:
            self.start_check()

    def after_step(
        self,
        outcome: Outcome | None = None,
        *,
        reduce: Callable[[Tensor], Tensor] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> FP8Check | None:
        """After each optimizer step, skipped or not: the check's readings, the non-finite flags kept, the step counted.

        1. If the readings are armed (a check step, or :meth:`start_check` called by someone), they are read and the
           fallback rule applied (:meth:`finish_check`); the result is returned and kept in :attr:`checks`.
        2. If the step was skipped for non-finite gradients (``outcome.overflowed``), its flags are kept for
           :meth:`nonfinite_layers`: read from the device only when asked. Where the skip is still on the device (a
           fused optimizer's step: ``outcome.resolved`` is false), the flags are kept without reading it.
        3. The flags are cleared; with the weights all-gathered in FP8 under FSDP2, their scales are computed for the
           next all-gather (torchao's ``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce).

        Args:
            outcome: what became of the step (``.overflowed``, and ``.resolved`` if pending); ``None`` for a step
                known to be applied.
            reduce: applied on the device to the readings' counts and to the kept flags (a SUM all-reduce across
                data-parallel ranks: every rank falls back the same layers and names the layers any rank's casts
                met). Every rank must call this method at every step.
            warn: says that a layer fell back (see :meth:`finish_check`).
        """
        check = None
        if self.readings.armed:
            found = self.finish_check(reduce, warn)
            check = FP8Check(found.readings, found.fell_back, self._steps)
            self.checks.append(check)
        if outcome is not None and (not _resolved(outcome) or outcome.overflowed):
            # A step known to be skipped is read with its weights; one whose fate is on the device, without (a pass
            # over every weight at every step would cost more than the step's flags).
            weights = self._weights() if _resolved(outcome) else {}
            kept = [(earlier, names) for earlier, names in self._flags if not _resolved(earlier) or earlier.overflowed]
            last = max((i for i, (earlier, _) in enumerate(kept) if _resolved(earlier)), default=0)
            self._flags = [*kept[last:], (outcome, self.log.snapshot(weights, reduce))]
        self.end_step()
        if all_gathers_in_fp8(self.recipe) and self.layers:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(self.layers.values()))
        self._steps += 1
        return check

    def nonfinite_layers(self) -> list[str]:
        """The FP8 layers whose casts met a NaN or inf, the origin first.

        Those of the step under way (since the last :meth:`end_step`) if any; else those of the last step
        :meth:`after_step` saw skipped for non-finite gradients (``[]`` if none). One host sync: read it when a step
        is known to be skipped.
        """
        current = self.log.read(self._weights())
        if current:
            return current
        for outcome, names in reversed(self._flags):
            if outcome.overflowed:
                return names()
        return []

    def _weights(self) -> dict[str, Tensor]:
        return {name: layer.weight for name, layer in self.layers.items()}

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
