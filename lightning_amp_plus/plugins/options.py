"""The plugins' options: declared once, checked once, resolved for the precision chosen.

:class:`PluginOptions` is what a user may pass to any of the plugins (``**options``: the Trainer's and Fabric's
``MixedPrecisionPlugin``, and the FSDP ones); :class:`Settings` is what a plugin runs with, made by
:meth:`Settings.checked` from the options actually given. The command line (``lightning_amp_plus.cli``) and the
checkpoint state read the same :class:`Settings`.

One rule over all the checks: an option given to a plugin that would ignore it is refused (the fp8_* options with a
precision other than ``"fp8-mixed"``, ``rounding_seed`` without stochastic rounding, the skip options with the check
turned off, what a front end cannot honour), and every error names the plugin, the argument, its value and the fix.

Examples:
    >>> Settings.checked("MixedPrecisionPlugin", "bf16-true", None, {}).compensation
    'kahan'
    >>> Settings.checked("MixedPrecisionPlugin", "bf16-mixed", None, {"fp8_recipe": "tensorwise"})
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: `MixedPrecisionPlugin('bf16-mixed', fp8_recipe='tensorwise')`: fp8_recipe configures FP8 training, ...
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from torch import nn

from lightning_amp_plus._checks import check_bool, check_int, show
from lightning_amp_plus.plugins.ignored import Spelling, ignored_problem
from lightning_amp_plus.step.spikes import SpikeGuard
from lightning_amp_plus.weights.compensated import Method
from lightning_amp_plus.weights.fp8.convert import Float8Config, Modules, Recipe

__all__ = ["DEFAULT_SKIPS", "FP8", "PRECISIONS", "PluginOptions", "Precision", "Settings"]

Precision = Literal["16-mixed", "bf16-mixed", "bf16-true", "fp8-mixed"]
PRECISIONS: tuple[str, ...] = ("16-mixed", "bf16-mixed", "bf16-true", "fp8-mixed")
FP8 = "fp8-mixed"
DEFAULT_SKIPS = 50
"""The default of ``max_consecutive_skips``."""
# What users type for a precision this plugin calls otherwise.
_ALIASES = {
    **dict.fromkeys(("16", "fp16", "float16", "half", "16-true"), "16-mixed"),
    **dict.fromkeys(("bf16", "bfloat16"), "bf16-mixed"),
    **dict.fromkeys(("fp8", "float8"), FP8),
}


class PluginOptions(TypedDict, total=False):
    """The options every plugin takes by keyword (see ``MixedPrecisionPlugin`` for what each does)."""

    skip_nonfinite: bool
    hold_schedulers_on_skip: bool
    max_consecutive_skips: int | None
    master_weights: bool
    keep_fp32: Sequence[type[nn.Module]] | None
    compensation: Literal["auto", "kahan", "stochastic"] | None
    rounding_seed: int
    spike_guard: SpikeGuard | None
    fp8_recipe: Recipe | Float8Config
    fp8_modules: Modules
    fp8_check_interval: int
    fp8_fallback: float | None


@dataclass(frozen=True)
class Settings:
    """A plugin's options, checked, with the defaults its precision gives them (``plugin.settings``).

    Attributes:
        precision: ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"fp8-mixed"``.
        device: the autocast device type given, or ``None`` to take the model's (``plugin.device`` is the one in use).
        skip_nonfinite: whether steps with non-finite gradients are skipped (always under fp16 and FP8).
        hold_schedulers_on_skip: whether LR schedulers are held while their optimizer's steps are skipped.
        max_consecutive_skips: stuck skips in a row that stop training (``None``: never).
        master_weights: whether a half-built model is widened to FP32 masters.
        keep_fp32: the module types whose forward runs in FP32.
        compensation: the compensation of bf16 weights (``None`` for the mixed precisions and plain bf16-true).
        rounding_seed: the seed of stochastic rounding.
        spike_guard: the guard of each step's gradient norm (``None``: none).
        fp8_recipe: under ``"fp8-mixed"``, torchao's recipe (a name or a ``Float8LinearConfig``); else ``None``.
        fp8_modules: under ``"fp8-mixed"``, which eligible Linear layers train in FP8 (``None``: all).
        fp8_check_interval: under ``"fp8-mixed"``, optimizer steps between two readings of the casts; else ``None``.
        fp8_fallback: under ``"fp8-mixed"``, the percent flushed above which a layer falls back (``None``: never).
        given: the options given explicitly (the rest are the defaults above).
    """

    precision: str
    device: str | None = None
    skip_nonfinite: bool = True
    hold_schedulers_on_skip: bool = True
    max_consecutive_skips: int | None = DEFAULT_SKIPS
    master_weights: bool = False
    keep_fp32: tuple[type[nn.Module], ...] = ()
    compensation: Method | None = None
    rounding_seed: int = 0
    spike_guard: SpikeGuard | None = None
    fp8_recipe: Any = None
    fp8_modules: Any = None
    fp8_check_interval: int | None = None
    fp8_fallback: float | None = None
    given: frozenset[str] = frozenset()

    @classmethod
    def checked(
        cls,
        owner: str,
        precision: object,
        device: object,
        options: Mapping[str, object],
        *,
        refused: Mapping[str, str] | None = None,
    ) -> Settings:
        """Check ``options`` (what was passed by keyword) for ``owner`` at ``precision``; resolve the defaults.

        Args:
            owner: the plugin's class name, as messages give it.
            precision: the precision asked for.
            device: the autocast device type asked for (``None``: the model's).
            options: the options given, by name.
            refused: options this plugin cannot honour, with the reason (a front end's or a strategy's limits).

        Raises:
            TypeError: an unknown option, or an option of the wrong type.
            ValueError: a bad value, or an option the plugin would ignore (the message says what to do instead).
        """
        _check_precision(owner, precision)
        assert isinstance(precision, str)
        call = _Call(owner, precision)
        unknown = sorted(set(options) - set(PluginOptions.__annotations__))
        if unknown:
            close = difflib.get_close_matches(unknown[0], PluginOptions.__annotations__, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"`{owner}()` got an unexpected keyword argument {unknown[0]!r}{hint}")
        for name, why in (refused or {}).items():
            if name in options:
                raise ValueError(f"{call.show(name, options[name])}: {why}")
        given = frozenset(options)
        get = options.get
        for name in ("skip_nonfinite", "hold_schedulers_on_skip", "master_weights"):
            check_bool(owner, name, get(name, True))
        skip_nonfinite = bool(get("skip_nonfinite", True))
        limit = get("max_consecutive_skips", DEFAULT_SKIPS)
        if limit is not None:
            hint = " (skipped steps in a row before training stops with a diagnosis), or None to never stop"
            limit = check_int(owner, "max_consecutive_skips", limit, minimum=1, hint=hint)
        keep_fp32 = _module_types(owner, "keep_fp32", get("keep_fp32"))
        compensation = _compensation(call, get("compensation", "auto"))
        seed = check_int(owner, "rounding_seed", get("rounding_seed", 0), 0)
        guard = get("spike_guard")
        if guard is not None and not isinstance(guard, SpikeGuard):
            raise TypeError(
                f"`{owner}(spike_guard={guard!r})` ({type(guard).__name__}) is not supported: pass a "
                "lightning_amp_plus.SpikeGuard, e.g. `spike_guard=SpikeGuard()` or `SpikeGuard(action='clip')`, or "
                "None."
            )
        call.refuse_ignored(options, skip_nonfinite, compensation)
        fp8 = _fp8_options(owner, options) if precision == FP8 else {}
        return cls(
            precision=precision,
            device=_device(owner, device),
            skip_nonfinite=skip_nonfinite,
            hold_schedulers_on_skip=bool(get("hold_schedulers_on_skip", True)),
            max_consecutive_skips=limit,
            master_weights=bool(get("master_weights", False)),
            keep_fp32=keep_fp32,
            compensation=compensation,
            rounding_seed=seed,
            spike_guard=guard,
            given=given,
            **fp8,
        )


@dataclass(frozen=True)
class _Call:
    """How an error shows the call it refuses: ``MixedPrecisionPlugin('bf16-mixed', fp8_recipe='rowwise')``."""

    owner: str
    precision: str

    def show(self, name: str, value: object) -> str:
        return f"`{self.owner}({self.precision!r}, {name}={show(value)})`"

    def refuse_ignored(self, options: Mapping[str, object], skip_nonfinite: bool, compensation: str | None) -> None:
        """Refuse each option given that this precision (and these settings) would ignore."""
        precision = self.precision
        # Given with a meaning: a compensation other than "auto"/None, FP32 masters or modules asked for.
        meant = [
            name
            for name in PluginOptions.__annotations__
            if (
                name in options
                and (name.startswith("fp8_") or (name == "compensation" and options[name] not in ("auto", None)))
            )
            or (name in ("master_weights", "keep_fp32") and options.get(name))
        ]
        problem = ignored_problem(precision, meant, Spelling())
        if problem is not None:
            shown = ", ".join(f"{name}={show(options[name])}" for name in meant)
            raise ValueError(f"`{self.owner}({precision!r}, {shown})`: {problem}")
        if "rounding_seed" in options and compensation != "stochastic":
            raise ValueError(
                f"{self.show('rounding_seed', options['rounding_seed'])}: the seed drives stochastic rounding, which "
                "this plugin does not do. Use precision='bf16-true' with compensation='stochastic', or drop "
                "rounding_seed."
            )
        if not skip_nonfinite:
            if precision == "16-mixed":
                raise ValueError(
                    f"{self.show('skip_nonfinite', False)}: fp16 loss scaling checks every step (an overflow is how "
                    "the scale learns to back off). Drop skip_nonfinite, or use 'bf16-mixed'."
                )
            if precision == FP8:
                raise ValueError(
                    f"{self.show('skip_nonfinite', False)}: one NaN or inf in an FP8 layer's input makes its whole "
                    "output non-finite, and the check that skips such a step is what keeps it from reaching the "
                    "weights and names the layer. Keep skip_nonfinite=True (the default)."
                )
            for name in ("max_consecutive_skips", "hold_schedulers_on_skip", "spike_guard"):
                if name in options and (name != "spike_guard" or options[name] is not None):
                    raise ValueError(
                        f"`{self.owner}({precision!r}, skip_nonfinite=False, {name}={show(options[name])})`: with "
                        f"skip_nonfinite=False no step is checked or skipped, so {name} would do nothing. Keep "
                        f"skip_nonfinite=True, or drop {name}."
                    )


def _check_precision(owner: str, precision: object) -> None:
    """Refuse a precision the plugins do not take, naming the one meant where it is clear."""
    if isinstance(precision, str) and precision in PRECISIONS:
        return
    meant = _ALIASES.get(str(precision).lower()) if isinstance(precision, str | int) else None
    if meant is None and isinstance(precision, str):
        close = difflib.get_close_matches(precision, PRECISIONS, n=1)
        meant = close[0] if close else None
    hint = f" Did you mean {meant!r}?" if meant is not None else ""
    raise ValueError(
        f"`{owner}(precision={precision!r})` is not supported: use '16-mixed', 'bf16-mixed', 'bf16-true' or "
        f"'fp8-mixed'.{hint} (For '32-true', train without this plugin.)"
    )


def _device(owner: str, device: object) -> str | None:
    """The autocast device type (``"cuda:1"`` is ``"cuda"``), or ``None`` to take the model's."""
    if device is None:
        return None
    if not isinstance(device, str) or device.split(":")[0] not in ("cuda", "cpu", "mps"):
        raise ValueError(f"`{owner}(device={device!r})` is not supported: use 'cuda', 'cpu', 'mps' or None (auto).")
    return device.split(":")[0]


def _compensation(call: _Call, compensation: object) -> Method | None:
    """The compensation to use: ``"auto"`` is Kahan for bf16-true and none otherwise; another for mixed is refused."""
    if compensation not in ("auto", "kahan", "stochastic", None):
        raise ValueError(
            f"`{call.owner}(compensation={compensation!r})` is not supported: use 'kahan', 'stochastic', None (plain "
            "bf16-true, which loses updates smaller than half a bf16 spacing) or 'auto' (Kahan for bf16-true)."
        )
    if call.precision != "bf16-true":
        return None  # one given with a meaning is refused with the other ignored options (Settings.checked)
    return "kahan" if compensation == "auto" else compensation  # type: ignore[return-value]


def _module_types(owner: str, option: str, value: object) -> tuple[type[nn.Module], ...]:
    """A sequence of ``nn.Module`` subclasses (``None``: empty), as a tuple."""
    if value is None:
        return ()
    if (
        isinstance(value, str | bytes)
        or not isinstance(value, Sequence)
        or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in value)
    ):
        raise TypeError(f"`{owner}({option}={value!r})` must be a sequence of nn.Module subclasses, e.g. (MyHead,).")
    return tuple(value)


def _fp8_options(owner: str, options: Mapping[str, object]) -> dict[str, Any]:
    """The fp8_* options checked, with their defaults (torchao is needed from here on: the message says how)."""
    from lightning_amp_plus.weights.fp8.options import (
        DEFAULT_CHECK_INTERVAL,
        DEFAULT_FALLBACK,
        DEFAULT_RECIPE,
        check_all_gather,
        check_check_interval,
        check_fallback,
        check_modules,
        check_recipe,
        require_torchao,
    )

    recipe = check_recipe(owner, "fp8_recipe", options.get("fp8_recipe", DEFAULT_RECIPE))
    fallback = check_fallback(owner, "fp8_fallback", options.get("fp8_fallback", DEFAULT_FALLBACK))
    checked = {
        "fp8_recipe": recipe,
        "fp8_modules": check_modules(owner, "fp8_modules", options.get("fp8_modules")),
        "fp8_check_interval": check_check_interval(
            owner, "fp8_check_interval", options.get("fp8_check_interval", DEFAULT_CHECK_INTERVAL)
        ),
        "fp8_fallback": fallback,
    }
    require_torchao(owner)
    check_all_gather(owner, recipe, fallback, ("fp8_recipe", "fp8_fallback"))
    return checked
