"""What every front end (the Trainer's and Fabric's plugins) shares: its settings, its engine, its readings, its ranks.

No framework hooks here: the checks a plugin makes of its arguments (each error names the plugin, the argument, the
value and the fix), the step engine a precision gets, what every plugin shows of it (:class:`Readings`), and how the
engine learns where the gradients live across ranks (:mod:`~.ranks`).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities import rank_zero_warn
from torch import nn

from lightning_amp_plus._checks import check_bool, check_int
from lightning_amp_plus.plugins.fp8 import DEFAULTS as FP8_DEFAULTS
from lightning_amp_plus.plugins.fp8 import FP8, check_fp8_device, check_fp8_options, refuse_fsdp1
from lightning_amp_plus.plugins.ranks import fsdp2_policy
from lightning_amp_plus.step.engine import StepEngine
from lightning_amp_plus.step.outcome import StepResult
from lightning_amp_plus.step.scaler import DynamicLossScaler
from lightning_amp_plus.step.spikes import SpikeGuard, SpikeGuards
from lightning_amp_plus.weights.compensated import Method

__all__ = [
    "COMPENSATIONS",
    "DEFAULT_SKIPS",
    "PRECISIONS",
    "Readings",
    "Settings",
    "check_compensation",
    "check_device",
    "check_device_supports",
    "check_fsdp_precision",
    "check_module_types",
    "check_precision",
    "check_skip_limit",
    "check_spike_guard",
    "checked_settings",
    "default_device",
    "engine_for",
    "half_dtype",
    "plugin_str",
    "refuse_deepspeed",
    "refuse_for_half_weights",
]

PRECISIONS = ("16-mixed", "bf16-mixed", "bf16-true", "fp8-mixed")
COMPENSATIONS = ("auto", "kahan", "stochastic", None)
# The default of `max_consecutive_skips`. With a scaler passed too, any other value must equal the scaler's own limit.
DEFAULT_SKIPS = 50


@dataclass(frozen=True)
class Settings:
    """A plugin's options, checked: the Trainer's and Fabric's plugins take the same ones (see their docstrings).

    Attributes:
        precision: ``"16-mixed"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"fp8-mixed"``.
        device: the autocast device type given, or ``None`` to take the model's (``plugin.device`` is the one in use).
        skip_nonfinite: whether bf16 steps with non-finite gradients are skipped (fp16 always checks).
        hold_schedulers_on_skip: whether LR schedulers are held while their optimizer's steps are skipped.
        max_consecutive_skips: stuck skips in a row that stop training (``None``: never).
        master_weights: whether a half-built model is widened to FP32 masters.
        keep_fp32: the module types whose forward runs in FP32.
        compensation: the compensation of bf16 weights (``None`` for the mixed precisions and plain bf16-true).
        rounding_seed: the seed of stochastic rounding.
        spike_guard: the guard of each step's gradient norm (``None``: none); its statistics are the engine's.
        fp8_recipe: with ``"fp8-mixed"``, torchao's recipe (a name, or a ``Float8LinearConfig``); ``None`` otherwise.
        fp8_modules: with ``"fp8-mixed"``, which eligible Linear layers train in FP8 (``None``: all, ``"auto"``, or a
            callable ``(module, name) -> bool``).
        fp8_check_interval: with ``"fp8-mixed"``, optimizer steps between two readings of the casts; ``None``
            otherwise.
        fp8_fallback: with ``"fp8-mixed"``, the percent flushed above which a layer falls back to bf16 (``None``: it
            never does, and always ``None`` for the other precisions).
    """

    precision: str
    device: str | None
    skip_nonfinite: bool
    hold_schedulers_on_skip: bool
    max_consecutive_skips: int | None
    master_weights: bool
    keep_fp32: tuple[type[nn.Module], ...]
    compensation: Method | None
    rounding_seed: int
    spike_guard: SpikeGuard | None = None
    fp8_recipe: Any = None
    fp8_modules: Any = None
    fp8_check_interval: int | None = None
    fp8_fallback: float | None = None


class Readings:
    """What every plugin shows of its step engine: the scaler, the step results, the skip count, FSDP2's policy.

    A mixin over the plugin's ``engine`` and ``settings`` (the FSDP plugins' inner plugin shares its engine, so the
    four plugins read the same facts the same way). Reading never changes anything.
    """

    engine: StepEngine
    settings: Settings
    _scaler: DynamicLossScaler | None

    def _name(self) -> str:
        """The class name the messages give (the Fabric FSDP plugin's inner plugin speaks as the FSDP plugin)."""
        return type(self).__name__

    @property
    def scaler(self) -> DynamicLossScaler | None:
        """The loss scaler (``None`` for bf16): ``torch.amp.GradScaler``'s API over this plugin's engine.

        Assigning another :class:`~lightning_amp_plus.DynamicLossScaler` makes it scale, check and update from then
        on; the plugin's optimizers, names, ranks, held schedulers and recent results carry over to it.
        """
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: DynamicLossScaler | None) -> None:
        if scaler is None and self.settings.precision != "16-mixed":
            return  # bf16 has no scaler to replace (its check stays)
        checked = _checked_scaler(self.settings, scaler, f"`{self._name()}.scaler = {scaler!r}`")
        checked.engine.take_over(self.engine)
        self._use_scaler(checked)

    def _use_scaler(self, scaler: DynamicLossScaler) -> None:
        """Step with ``scaler``'s engine from now on (an FSDP plugin hands it to the plugin it holds)."""
        self._scaler, self.engine = scaler, scaler.engine

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for non-finite gradients since the start (0 when nothing is checked)."""
        return self.engine.skipped_steps

    @property
    def recent_steps(self) -> deque[StepResult]:
        """The last optimizer steps' results, newest last (:class:`~lightning_amp_plus.step.outcome.StepResult`)."""
        return self.engine.recent_steps

    @property
    def mp_policy(self) -> Any:
        """FSDP2's ``MixedPrecisionPolicy`` for half compute under ``ModelParallelStrategy``: FP32 shards, half math.

        Pass it to ``fully_shard(..., mp_policy=...)`` where the model is sharded (in a LightningModule's
        ``configure_model``, ``self.trainer.precision_plugin.mp_policy``): the FP32 sharded parameters are then the
        masters the optimizer steps, the forward and backward run on all-gathered half copies, and the gradients are
        reduce-scattered in FP32.
        """
        return fsdp2_policy(half_dtype(self.settings.precision))


def half_dtype(precision: str) -> torch.dtype:
    """The half dtype of a precision: fp16 for ``"16-mixed"``, else bf16 (autocast's, or the weights' for bf16-true)."""
    return torch.float16 if precision == "16-mixed" else torch.bfloat16


def checked_settings(
    name: str,
    precision: str,
    device: object,
    *,
    skip_nonfinite: object,
    hold_schedulers_on_skip: object = True,
    max_consecutive_skips: object,
    master_weights: object,
    keep_fp32: object,
    compensation: object,
    rounding_seed: object,
    spike_guard: object = None,
    fp8_recipe: object = FP8_DEFAULTS.recipe,
    fp8_modules: object = FP8_DEFAULTS.modules,
    fp8_check_interval: object = FP8_DEFAULTS.check_interval,
    fp8_fallback: object = FP8_DEFAULTS.fallback,
) -> Settings:
    """Check a plugin's arguments (each error names ``name``, the argument, the value and the fix)."""
    check_precision(name, precision)
    checked_device = check_device(name, device)
    check_bool(name, "skip_nonfinite", skip_nonfinite)
    check_bool(name, "hold_schedulers_on_skip", hold_schedulers_on_skip)
    check_bool(name, "master_weights", master_weights)
    check_skip_limit(name, max_consecutive_skips)
    modules = check_module_types(name, "keep_fp32", keep_fp32)
    method = check_compensation(name, precision, compensation)
    if precision == "bf16-true":
        refuse_for_half_weights(name, bool(master_weights), modules)
    limit = None if max_consecutive_skips is None else int(max_consecutive_skips)  # type: ignore[call-overload]
    seed = check_int(name, "rounding_seed", rounding_seed, 0)
    guard = check_spike_guard(name, precision, spike_guard, bool(skip_nonfinite))
    fp8 = check_fp8_options(
        name,
        precision,
        recipe=fp8_recipe,
        modules=fp8_modules,
        check_interval=fp8_check_interval,
        fallback=fp8_fallback,
        skip_nonfinite=bool(skip_nonfinite),
    )
    return Settings(
        precision,
        checked_device,
        bool(skip_nonfinite),
        bool(hold_schedulers_on_skip),
        limit,
        bool(master_weights),
        modules,
        method,
        seed,
        guard,
        *((fp8.recipe, fp8.modules, fp8.check_interval, fp8.fallback) if fp8 is not None else ()),
    )


def check_spike_guard(name: str, precision: str, guard: object, skip_nonfinite: bool) -> SpikeGuard | None:
    """A spike guard, or ``None``; refused where no norm is measured (a bf16 plugin told not to check).

    Raises:
        TypeError: ``guard`` is not a :class:`~lightning_amp_plus.step.spikes.SpikeGuard`.
        ValueError: ``skip_nonfinite=False`` under bf16.
    """
    if guard is None:
        return None
    if not isinstance(guard, SpikeGuard):
        raise TypeError(
            f"`{name}(spike_guard={guard!r})` ({type(guard).__name__}) is not supported: pass a "
            "lightning_amp_plus.SpikeGuard, e.g. `spike_guard=SpikeGuard()` or `SpikeGuard(action='clip')`, or None."
        )
    if precision != "16-mixed" and not skip_nonfinite:
        raise ValueError(
            f"`{name}({precision!r}, skip_nonfinite=False, spike_guard={guard!r})`: the guard judges the gradient norm "
            "that the check measures, and skip_nonfinite=False turns the check off. Keep skip_nonfinite=True, or drop "
            "spike_guard."
        )
    return guard


def engine_for(name: str, settings: Settings, scaler: object) -> tuple[StepEngine, DynamicLossScaler | None]:
    """The engine a plugin starts with, and its scaler: under fp16 the scaler's own (given or default) engine.

    Raises:
        ValueError: a scaler with bf16, or a skip limit that differs from the given scaler's.
        TypeError: a scaler that is not a ``DynamicLossScaler``.
    """
    if scaler is not None or settings.precision == "16-mixed":
        checked = _checked_scaler(settings, scaler, f"`{name}(precision={settings.precision!r}, scaler={scaler!r})`")
        if settings.spike_guard is not None:  # the scaler's engine judges the norms: a scaler replaced takes it over
            checked.engine.spike_guards = SpikeGuards(settings.spike_guard)
        return checked.engine, checked
    engine = StepEngine(
        None,
        check=settings.skip_nonfinite,
        max_consecutive_skips=settings.max_consecutive_skips,
        compensation=settings.compensation,
        seed=settings.rounding_seed,
        spike_guard=settings.spike_guard,
    )
    return engine, None


def _checked_scaler(settings: Settings, scaler: object, where: str) -> DynamicLossScaler:
    """The fp16 scaler: the given one (checked against the skip limit), or a default one for ``None``."""
    if settings.precision != "16-mixed":
        why = (
            "fp8-mixed scales each FP8 cast by its own amax and runs the rest under bf16 autocast, which needs"
            if settings.precision == FP8
            else "bf16 has fp32's range and needs"
        )
        raise ValueError(f"{where}: {why} no loss scaling. Drop `scaler`, or use precision='16-mixed'.")
    limit = settings.max_consecutive_skips
    if scaler is None:
        return DynamicLossScaler(max_consecutive_skips=limit)
    if not isinstance(scaler, DynamicLossScaler):
        raise TypeError(
            f"{where}: fp16 needs a lightning_amp_plus.DynamicLossScaler. To migrate from torch.amp.GradScaler, "
            "load its state: `DynamicLossScaler().load_state_dict(grad_scaler.state_dict())`."
        )
    if limit != DEFAULT_SKIPS and scaler.engine.max_consecutive_skips != limit:
        raise ValueError(
            f"{where}: the scaler's max_consecutive_skips={scaler.engine.max_consecutive_skips!r} differs from "
            f"MixedPrecisionPlugin(max_consecutive_skips={limit!r}): set the limit in one place, e.g. "
            f"DynamicLossScaler(..., max_consecutive_skips={limit!r})."
        )
    return scaler


def check_precision(name: str, precision: object) -> None:
    """Refuse a precision other than the two mixed ones and bf16-true, naming the plugin."""
    if precision not in PRECISIONS:
        raise ValueError(
            f"`{name}(precision={precision!r})` is not supported: use '16-mixed', 'bf16-mixed', 'bf16-true' or "
            "'fp8-mixed'."
        )


def check_fsdp_precision(name: str, precision: object, framework: str) -> None:
    """Refuse a precision other than the two mixed ones for an FSDP plugin, naming the framework's own way to it.

    bf16-true under FSDP1 is FSDP's own bf16 shards: the compensated update is not defined on its flat parameters.
    FP8 training under FSDP is torchao's, on FSDP2 only.
    """
    refuse_fsdp1(name, precision, framework)
    if precision not in ("16-mixed", "bf16-mixed"):
        raise ValueError(
            f"`{name}(precision={precision!r})` is not supported: use '16-mixed' or 'bf16-mixed' (for '32-true', "
            f"'16-true' or 'bf16-true' under FSDP, use {framework}(strategy='fsdp', precision={precision!r}) without "
            "this plugin)."
        )


def check_compensation(name: str, precision: str, compensation: object) -> Method | None:
    """The compensation to use: ``"auto"`` is Kahan for bf16-true and none otherwise; any other for mixed is refused."""
    if compensation not in COMPENSATIONS:
        raise ValueError(
            f"`{name}(compensation={compensation!r})` is not supported: use 'kahan', 'stochastic', None (plain "
            "bf16-true, which loses updates smaller than half a bf16 spacing) or 'auto' (Kahan for bf16-true)."
        )
    if precision != "bf16-true":
        if compensation not in ("auto", None):
            raise ValueError(
                f"`{name}({precision!r}, compensation={compensation!r})`: compensation applies to bf16 weights, "
                f"precision='bf16-true'. {precision!r} keeps FP32 weights, which need none: drop compensation."
            )
        return None
    return "kahan" if compensation == "auto" else compensation  # type: ignore[return-value]


def refuse_for_half_weights(name: str, master_weights: bool, keep_fp32: tuple[type[nn.Module], ...]) -> None:
    """bf16-true keeps bf16 weights: FP32 masters and FP32 regions belong to the mixed precisions."""
    for option, given in (("master_weights", master_weights), ("keep_fp32", keep_fp32)):
        if given:
            raise ValueError(
                f"`{name}('bf16-true', {option}={given!r})`: bf16-true keeps the weights in bf16 (compensated; that "
                f"is its memory saving). For FP32 weights use 'bf16-mixed' with {option}; or drop {option}."
            )


def check_device(name: str, device: object) -> str | None:
    """The autocast device type (``"cuda:1"`` is ``"cuda"``), or ``None`` to take the model's."""
    if device is None:
        return None
    if not isinstance(device, str) or device.split(":")[0] not in ("cuda", "cpu", "mps"):
        raise ValueError(f"`{name}(device={device!r})` is not supported: use 'cuda', 'cpu', 'mps' or None (auto).")
    return device.split(":")[0]


def check_device_supports(name: str, device: str, precision: str, warn: bool = True) -> None:
    """Refuse bf16 on a GPU without it, FP8 where no float8 GEMM runs; warn about fp16 and FP8 on CPU when ``warn``.

    (Correct on CPU, but slow; FP8 is refused below CUDA compute capability 8.9: :func:`~.fp8.check_fp8_device`.)

    A plugin warns once (``warn=False`` after its first check): Python's own once-per-place rule is reset whenever a
    ``warnings.catch_warnings()`` block runs, as a replay's does, so fit's and validate's checks would both warn.
    """
    if device == "cuda" and precision.startswith("bf16") and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"`{name}(precision={precision!r})`: this GPU ({torch.cuda.get_device_name()}) does not support bfloat16. "
            "Use precision='16-mixed'."
        )
    if precision == FP8:
        check_fp8_device(name, device, warn)
    if warn and device == "cpu" and precision == "16-mixed":
        rank_zero_warn(
            f"{name}('16-mixed') on CPU: fp16 autocast is correct there but slow (many times slower than fp32 on most "
            "CPUs). For speed on CPU prefer 'bf16-mixed' or 32-bit.",
            category=UserWarning,
        )


def check_skip_limit(name: str, value: object) -> None:
    """``max_consecutive_skips``: an int >= 1, or ``None``."""
    if value is not None:
        hint = " (skipped steps in a row before training stops with a diagnosis), or None to never stop"
        check_int(name, "max_consecutive_skips", value, minimum=1, hint=hint)


def check_module_types(name: str, option: str, value: object) -> tuple[type[nn.Module], ...]:
    """A sequence of ``nn.Module`` subclasses (``None``: empty), as a tuple."""
    if value is None:
        return ()
    if (
        isinstance(value, (str, bytes))
        or not isinstance(value, Sequence)
        or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in value)
    ):
        raise TypeError(f"`{name}({option}={value!r})` must be a sequence of nn.Module subclasses, e.g. (MyHead,).")
    return tuple(value)


def default_device() -> str:
    """The autocast device when none was given or found."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def refuse_deepspeed(name: str, model: object, framework: str) -> None:
    """Refuse a DeepSpeed engine: it does its own mixed precision, loss scaling and master weights.

    Two loss scalers on one model would corrupt each other silently. Lightning checks the plugin type for FSDP and XLA
    strategies, not for DeepSpeed's, so the plugin checks the model it is handed.
    """
    if type(model).__module__.split(".")[0] == "deepspeed":
        raise TypeError(
            f"{name} cannot run under DeepSpeed: its engine does its own mixed precision and loss scaling. Use "
            f"{framework}(strategy='deepspeed', precision='16-mixed' or 'bf16-mixed') without this plugin."
        )


def plugin_str(plugin: Any) -> str:
    """``str()`` of a Trainer plugin: ``MixedPrecisionPlugin('bf16-mixed')``, with the fix where pytorch_lightning asks.

    ``pytorch_lightning.Trainer`` (Lightning's older package name, a copy of ``lightning.pytorch`` with its own
    classes) checks plugins against its own ``Precision`` and refuses ours with "Found invalid type for plugin
    {plugin}. Expected one of: ...": formatting ``{plugin}`` is the one thing it does with the plugin, so the plugin's
    ``str`` says what to import instead, there only (f-string formatting reaches ``__str__`` from C code: the Python
    frame above is the caller's).
    """
    name = f"{type(plugin).__name__}({plugin.precision!r})"
    caller = sys._getframe(2).f_globals.get("__name__", "")
    if caller.startswith("pytorch_lightning."):
        return (
            f"{name}, a plugin for the `lightning` package: import the Trainer with `from lightning.pytorch import "
            "Trainer` (`pytorch_lightning` is Lightning's older package name, and its Trainer accepts only its own "
            "plugins)"
        )
    return name
