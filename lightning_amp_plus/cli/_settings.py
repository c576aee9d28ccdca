"""What a run asks for: mixed-precision settings (:class:`AmpSettings`) and the shipped models' training defaults.

Pure Python at import (torch and Lightning load only when a plugin or the monitor is built), so the command line
checks a request before importing them. The rules are written once and spelled two ways: as Python arguments
(``master_weights=True``) for ``AmpSettings``, as flags (``--master-weights``) for ``amp-plus``.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from lightning_amp_plus._checks import check_int
from lightning_amp_plus._wording import number
from lightning_amp_plus.plugins.ignored import Spelling, ignored_problem

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import Precision

__all__ = [
    "COMPENSATIONS",
    "DEFAULT_TASK",
    "FP8_RECIPES",
    "MODEL_FLAGS",
    "PRECISIONS",
    "SCALER_MAX_SCALE",
    "SCALER_MIN_SCALE",
    "SPIKE_ACTIONS",
    "TASKS",
    "TRAIN_DEFAULTS",
    "AmpSettings",
    "amp_problem",
    "cli_amp_problem",
    "fp8_install_problem",
    "model_hparams",
    "task_label",
    "train_settings",
]

TASKS = ("cnn", "lstm")


class DefaultTask(str):
    """The model a command runs when none is named: equal to ``"cnn"``, but marked, so that the command can say so."""

    __slots__ = ()


DEFAULT_TASK = DefaultTask(TASKS[0])
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "bf16-true", "fp8-mixed")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
"""torchao's recipes (``weights/fp8/convert.RECIPES``, which needs torch to import; a test keeps the two equal)."""
COMPENSATIONS = ("kahan", "stochastic", "none")
SPIKE_ACTIONS = ("skip", "clip")
Task = Literal["cnn", "lstm"]
PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed", "bf16-true", "fp8-mixed"]

SCALER_MIN_SCALE = 1.0
"""``DynamicLossScaler``'s default ``min_scale`` (a test keeps the two equal): the lowest ``init_scale``."""
SCALER_MAX_SCALE = 2.0**24
"""``DynamicLossScaler``'s default ``max_scale``: the highest ``init_scale``."""

# The defaults of `amp-plus train` with no flags: sized so that a 2-core CPU finishes in seconds under bf16 autocast
# and the validation accuracy climbs well above chance (measured times: docs/benchmarks.md). Each flag overrides its
# entry.
TRAIN_DEFAULTS: dict[str, dict[str, Any]] = {
    "cnn": {"epochs": 2, "batch_size": 64, "num_train": 2048, "num_val": 512, "width": 16, "lr": 0.05},
    "lstm": {
        "epochs": 2,
        "batch_size": 64,
        "num_train": 2048,
        "num_val": 512,
        "hidden_dim": 64,
        "embed_dim": 32,
        "max_len": 60,
        "lr": 1e-2,
    },
}
MODEL_FLAGS = {"cnn": ("width", "dropout"), "lstm": ("hidden_dim", "embed_dim", "dropout", "max_len")}
"""Each task's model (and, for ``max_len``, data) flags; another task's flag is refused."""
_SCALER_FIELDS = ("init_scale", "growth_interval", "hysteresis")
_FP8_FIELDS = ("fp8_recipe", "fp8_check_interval", "fp8_fallback")
FP8_INSTALL = 'pip install "lightning-amp-plus[fp8]"'


def amp_problem(
    precision: str,
    *,
    master_weights: bool = False,
    scaler_settings: tuple[str, ...] = (),
    max_consecutive_skips: bool = False,
    compensation: bool = False,
    spike_guard: bool = False,
    fp8_settings: tuple[str, ...] = (),
    flags: bool = False,
    auto: bool = False,
) -> str | None:
    """What is impossible in a mixed-precision request, or ``None``; worded for ``AmpSettings`` or (``flags``) the CLI.

    Args:
        precision: the precision asked for (resolved, when ``auto``).
        master_weights: FP32 master weights were asked for.
        scaler_settings: which of ``init_scale``, ``growth_interval``, ``hysteresis`` were given.
        max_consecutive_skips: a skip limit was given.
        compensation: a compensation of bf16 weights was given.
        spike_guard: a spike guard was asked for.
        fp8_settings: which of ``fp8_recipe``, ``fp8_check_interval``, ``fp8_fallback`` were given.
        flags: word it for the command line (``--master-weights``) instead of Python (``master_weights=True``).
        auto: ``precision`` is what ``--precision auto`` chose on this machine.

    Examples:
        >>> print(amp_problem("bf16-mixed", scaler_settings=("init_scale",), flags=True))
        --init-scale configures the fp16 loss scaler, which --precision bf16-mixed does not use (bf16 has fp32's range and needs no loss scaling). Use --precision 16-mixed, or drop --init-scale.
    """  # noqa: E501
    spell = Spelling(flags, precision if auto else None)
    if precision not in PRECISIONS:
        return f"{spell.precision(precision)} is not one of {', '.join(PRECISIONS)}."
    given = [name for name, asked in (("master_weights", master_weights), ("compensation", compensation)) if asked]
    problem = ignored_problem(precision, [*fp8_settings, *given], spell)  # the plugins' own rules
    if problem is not None:
        return problem
    if scaler_settings and precision != "16-mixed":
        names = " and ".join(spell.setting(name) for name in scaler_settings)
        verb, them = ("configures", "it") if len(scaler_settings) == 1 else ("configure", "them")
        why = "bf16 has fp32's range and needs no loss scaling" if "bf16" in precision else "fp32 needs none"
        return (
            f"{names} {verb} the fp16 loss scaler, which {spell.precision(precision)} does not use ({why}). Use "
            f"{spell.plain().precision('16-mixed')}, or drop {names if len(scaler_settings) == 1 else them}."
        )
    if spike_guard and precision == "32-true":
        return (
            f"{spell.setting('spike_guard')} judges the gradient norm that the mixed-precision plugin's check "
            f"measures; {spell.precision(precision)} runs no plugin. Choose a mixed precision, or drop "
            f"{spell.setting('spike_guard')}."
        )
    if max_consecutive_skips and precision == "32-true":
        return (
            f"{spell.setting('max_consecutive_skips')} limits the steps skipped under mixed precision; "
            f"{spell.precision(precision)} skips none. Choose a mixed precision, or drop "
            f"{spell.setting('max_consecutive_skips')}."
        )
    return None


@dataclass(frozen=True)
class AmpSettings:
    """How a run uses mixed precision: ``MixedPrecisionPlugin``'s settings and ``MixedPrecisionMonitor``'s.

    The command line's ``train`` builds one from its flags; the LightningCLI examples expose it as ``--amp.*``.
    ``None`` leaves a setting at the plugin's or scaler's default. Impossible combinations and a chart path that
    cannot be written are refused here, at construction, before any training.

    Args:
        precision: ``"32-true"`` (no plugin), ``"16-mixed"``, ``"bf16-mixed"`` or ``"bf16-true"`` (bf16 weights).
        master_weights: FP32 master weights (mixed precisions only; see ``MixedPrecisionPlugin``).
        compensation: with ``"bf16-true"``: ``"kahan"`` (the default), ``"stochastic"`` or ``"none"`` (Lightning's
            plain bf16-true, which loses updates smaller than half a bf16 spacing).
        init_scale: the loss scaler's initial scale, in ``[1, 2**24]`` (the scaler's ``min_scale`` and
            ``max_scale``; ``16-mixed`` only).
        growth_interval: clean steps before the scale grows (``16-mixed`` only).
        hysteresis: overflows tolerated before the scale backs off (``16-mixed`` only).
        max_consecutive_skips: skipped steps in a row (at the scale's floor, for fp16) that stop training with a
            diagnosis; ``0`` never stops (mixed precisions only).
        spike_guard: ``"skip"`` or ``"clip"``: a ``SpikeGuard`` with its default threshold and warm-up and this
            action (mixed precisions only; see the spike guard's page).
        fp8_recipe: with ``"fp8-mixed"``: ``"tensorwise"`` (the plugin's default), ``"rowwise"`` or
            ``"rowwise_with_gw_hp"``.
        fp8_check_interval: with ``"fp8-mixed"``: read the FP8 casts every this many optimizer steps (default 50).
        fp8_fallback: with ``"fp8-mixed"``: the percent flushed at two readings in a row above which a layer goes
            back to bf16 (default 1.0); ``0`` never falls back (the command line cannot type ``None``).
        monitor: attach a ``MixedPrecisionMonitor``.
        headroom_interval: the monitor reads per-layer headroom every this many optimizer steps (0: never).
        report_path: where the monitor writes its PNG chart at the end of ``fit`` (a ``.png`` path; needs
            matplotlib).

    Examples:
        >>> settings = AmpSettings("16-mixed", init_scale=1024.0)
        >>> [type(p).__name__ for p in settings.plugins()], settings.plugins()[0].scaler.get_scale()
        (['MixedPrecisionPlugin'], 1024.0)
        >>> AmpSettings("32-true").plugins()
        []
    """

    precision: PrecisionName = "bf16-mixed"
    master_weights: bool = False
    compensation: Literal["kahan", "stochastic", "none"] | None = None
    init_scale: float | None = None
    growth_interval: int | None = None
    hysteresis: int | None = None
    max_consecutive_skips: int | None = None
    spike_guard: Literal["skip", "clip"] | None = None
    fp8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    fp8_check_interval: int | None = None
    fp8_fallback: float | None = None
    monitor: bool = True
    report_path: str | None = None
    headroom_interval: int = 0

    def __post_init__(self) -> None:
        if self.compensation is not None and self.compensation not in COMPENSATIONS:
            raise ValueError(
                f"`AmpSettings(compensation={self.compensation!r})` must be one of {', '.join(COMPENSATIONS)}."
            )
        if self.spike_guard not in (None, *SPIKE_ACTIONS):
            raise ValueError(
                f"`AmpSettings(spike_guard={self.spike_guard!r})` must be 'skip', 'clip' or None (no guard)."
            )
        if self.fp8_recipe not in (None, *FP8_RECIPES):
            raise ValueError(
                f"`AmpSettings(fp8_recipe={self.fp8_recipe!r})` must be one of {', '.join(FP8_RECIPES)} (or None: "
                "tensorwise)."
            )
        problem = amp_problem(
            self.precision,
            master_weights=self.master_weights,
            scaler_settings=tuple(name for name in _SCALER_FIELDS if getattr(self, name) is not None),
            max_consecutive_skips=self.max_consecutive_skips is not None,
            compensation=self.compensation is not None,
            spike_guard=self.spike_guard is not None,
            fp8_settings=tuple(name for name in _FP8_FIELDS if getattr(self, name) is not None),
        )
        if problem is not None:
            raise ValueError(f"`AmpSettings`: {problem}")
        if self.init_scale is not None:
            value = self.init_scale
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (SCALER_MIN_SCALE <= value <= SCALER_MAX_SCALE)
            ):
                raise ValueError(
                    f"`AmpSettings(init_scale={value!r})` must be a number in [{number(SCALER_MIN_SCALE)}, "
                    f"{number(SCALER_MAX_SCALE)}]: the loss scaler keeps its scale between its min_scale and "
                    "max_scale (defaults 1 and 2**24)."
                )
        for name, minimum in (
            ("growth_interval", 1),
            ("hysteresis", 1),
            ("max_consecutive_skips", 0),
            ("headroom_interval", 0),
            ("fp8_check_interval", 1),
        ):
            if getattr(self, name) is not None:
                check_int("AmpSettings", name, getattr(self, name), minimum)
        fallback = self.fp8_fallback
        if fallback is not None and (
            isinstance(fallback, bool) or not isinstance(fallback, int | float) or not 0 <= fallback < 100
        ):
            raise ValueError(
                f"`AmpSettings(fp8_fallback={fallback!r})` must be a percent in [0, 100), e.g. 1.0; 0 never falls back."
            )
        if self.report_path is not None:
            from lightning_amp_plus.monitor.chart import check_chart_path

            check_chart_path(self.report_path, "report_path")

    def plugins(self, device: str | None = None) -> list[Precision]:
        """The Trainer's ``plugins``: ``[MixedPrecisionPlugin(...)]``, or ``[]`` for ``32-true``."""
        if self.precision == "32-true":
            return []
        from lightning_amp_plus.plugins.precision import MixedPrecisionPlugin
        from lightning_amp_plus.step.scaler import DynamicLossScaler
        from lightning_amp_plus.step.spikes import SpikeGuard

        # 0 means "never stop" on the command line, where None cannot be typed.
        limit = 50 if self.max_consecutive_skips is None else (self.max_consecutive_skips or None)
        scaler = None
        if self.precision == "16-mixed":
            options = {name: getattr(self, name) for name in _SCALER_FIELDS if getattr(self, name) is not None}
            scaler = DynamicLossScaler(**options, max_consecutive_skips=limit)
        compensation = {"none": None, None: "auto"}.get(self.compensation, self.compensation)
        fp8: dict[str, Any] = {}
        if self.precision == "fp8-mixed":  # only what was given: the plugin's defaults for the rest
            fp8 = {name: getattr(self, name) for name in _FP8_FIELDS if getattr(self, name) is not None}
            if fp8.get("fp8_fallback") == 0:
                fp8["fp8_fallback"] = None  # 0 on the command line: read and warn, never fall back
        plugin = MixedPrecisionPlugin(
            self.precision,
            device,
            scaler,
            max_consecutive_skips=limit,
            master_weights=self.master_weights,
            compensation=compensation,
            spike_guard=None if self.spike_guard is None else SpikeGuard(action=self.spike_guard),
            **fp8,
        )
        return [plugin]

    def trainer_kwargs(self, device: str | None = None) -> dict[str, Any]:
        """``precision="32-true"``, or the plugin: what to pass to ``Trainer`` (besides the callbacks).

        Examples:
            >>> AmpSettings("32-true").trainer_kwargs()
            {'precision': '32-true'}
        """
        if self.precision == "32-true":
            return {"precision": "32-true"}
        return {"plugins": self.plugins(device)}

    def configures_the_plugin(self) -> bool:
        """Whether any plugin setting differs from its default (the precision ``bf16-mixed``, everything else unset).

        Examples:
            >>> AmpSettings().configures_the_plugin(), AmpSettings("16-mixed").configures_the_plugin()
            (False, True)
        """
        return (
            self.precision != "bf16-mixed"
            or self.master_weights
            or self.compensation is not None
            or self.spike_guard is not None
            or any(getattr(self, name) is not None for name in (*_SCALER_FIELDS, *_FP8_FIELDS, "max_consecutive_skips"))
        )

    def trainer_arguments(self, trainer: Any) -> dict[str, Any]:
        """``plugins`` and ``callbacks`` for a Trainer whose own settings are ``trainer`` (LightningCLI's group).

        The monitor joins the Trainer's callbacks. The plugin joins its plugins unless the Trainer's own precision
        settings (``--trainer.precision``, a precision plugin in ``--trainer.plugins``) are given: those win, with
        the monitor still attached. Both at once, with a plugin setting changed here too, is refused.

        Raises:
            ValueError: ``trainer`` sets the precision and so do these settings; the message says which flag to use.

        Examples:
            >>> kwargs = AmpSettings().trainer_arguments({"precision": "16-mixed"})
            >>> kwargs["plugins"], [type(c).__name__ for c in kwargs["callbacks"]]
            (None, ['MixedPrecisionMonitor'])
        """
        from lightning.pytorch.plugins.precision import Precision

        plugins = _as_list(trainer.get("plugins"))
        callbacks = _as_list(trainer.get("callbacks")) + self.callbacks()
        theirs = [p for p in plugins if isinstance(p, Precision | str)]
        if trainer.get("precision") is None and not theirs:
            return {"plugins": [*plugins, *self.plugins()] or None, "callbacks": callbacks}
        if self.configures_the_plugin():
            given = (
                f"--trainer.precision {trainer.get('precision')}"
                if trainer.get("precision") is not None
                else f"--trainer.plugins {type(theirs[0]).__name__ if not isinstance(theirs[0], str) else theirs[0]}"
            )
            raise ValueError(
                f"{given} and --amp.* ({self._changed()}) both set the precision. Use one: --amp.* for "
                "MixedPrecisionPlugin (with --amp.precision 32-true for no plugin), or the Trainer's own flag with "
                "--amp.* left at its defaults (the monitor is attached either way)."
            )
        return {"plugins": plugins or None, "callbacks": callbacks}

    def _changed(self) -> str:
        defaults = AmpSettings()
        names = (
            "precision",
            "master_weights",
            "compensation",
            *_SCALER_FIELDS,
            "max_consecutive_skips",
            "spike_guard",
            *_FP8_FIELDS,
        )
        return ", ".join(
            f"{name}={getattr(self, name)!r}" for name in names if getattr(self, name) != getattr(defaults, name)
        )

    def callbacks(self) -> list[Callback]:
        """``[MixedPrecisionMonitor(report_path=...)]``, or ``[]`` without the monitor."""
        if not self.monitor:
            return []
        from lightning_amp_plus.monitor.callback import MixedPrecisionMonitor

        return [MixedPrecisionMonitor(report_path=self.report_path, headroom_interval=self.headroom_interval)]


def _as_list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def cli_amp_problem(args: argparse.Namespace, precision: str, auto: bool = False) -> str | None:
    """:func:`amp_problem` for ``amp-plus train``'s flags, worded as flags.

    Examples:
        >>> from lightning_amp_plus.cli import build_parser
        >>> print(cli_amp_problem(build_parser().parse_args(["train", "--master-weights"]), "32-true", auto=True))
        --master-weights is for half-precision compute over FP32 weights; --precision auto (32-true here) keeps the weights in FP32. Use --precision bf16-mixed with --master-weights, or drop --master-weights.
    """  # noqa: E501
    return amp_problem(
        precision,
        master_weights=args.master_weights,
        scaler_settings=tuple(name for name in _SCALER_FIELDS if getattr(args, name) is not None),
        max_consecutive_skips=args.max_consecutive_skips is not None,
        compensation=getattr(args, "compensation", None) is not None,
        spike_guard=getattr(args, "spike_guard", None) is not None,
        fp8_settings=tuple(name for name in _FP8_FIELDS if getattr(args, name, None) is not None),
        flags=True,
        auto=auto,
    )


def fp8_install_problem(asked: str = "--precision fp8-mixed") -> str | None:
    """Why ``fp8-mixed`` cannot run in this environment (torchao is missing), or ``None``; imports nothing.

    Examples:
        >>> fp8_install_problem() is None or "pip install" in fp8_install_problem()
        True
    """
    if importlib.util.find_spec("torchao") is not None:
        return None
    return (
        f"{asked} trains the model's Linear layers in FP8 with torchao, which is not installed. Install it with "
        f"`{FP8_INSTALL}` (torchao 0.18.0, built for torch 2.14), or choose another precision."
    )


def train_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The task's defaults (:data:`TRAIN_DEFAULTS`) with the given flags on top; another task's model flag is an error.

    Raises:
        ValueError: a flag of the other model, or a synthetic-data size with ``--data real``.

    Examples:
        >>> from lightning_amp_plus.cli import build_parser
        >>> train_settings(build_parser().parse_args(["train", "lstm", "--hidden-dim", "8"]))["hidden_dim"]
        8
    """
    settings = dict(TRAIN_DEFAULTS[args.task])
    other = next(t for t in TASKS if t != args.task)
    for flag in MODEL_FLAGS[other]:
        if flag not in MODEL_FLAGS[args.task] and getattr(args, flag, None) is not None:
            raise ValueError(
                f"--{flag.replace('_', '-')} configures the {other} model, not {args.task}. The {args.task} model's "
                f"flags are {', '.join('--' + f.replace('_', '-') for f in MODEL_FLAGS[args.task])}."
            )
    sized = [flag for flag in ("num_train", "num_val") if getattr(args, flag, None) is not None]
    if sized and getattr(args, "data", "synthetic") == "real":
        raise ValueError(
            f"--{sized[0].replace('_', '-')} sizes the synthetic data; the real datasets come whole (CIFAR-10: 45,000 "
            "training images after the validation split; IMDB: 22,500 reviews). Drop it, or use --data synthetic."
        )
    for key in ("epochs", "batch_size", "num_train", "num_val", "lr", *MODEL_FLAGS[args.task]):
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    if getattr(args, "max_steps", -1) != -1 and getattr(args, "epochs", None) is None:
        settings["epochs"] = -1  # --max-steps alone: the steps decide, however many epochs they take
    return settings


def task_label(args: argparse.Namespace, command: str) -> str:
    """How a command's first line names its model: ``cnn``, or, when none was named, ``cnn`` and that it was chosen.

    Examples:
        >>> task_label(argparse.Namespace(task=DEFAULT_TASK), "train")
        'cnn (no model named, so the default; `amp-plus train lstm` trains the other)'
        >>> task_label(argparse.Namespace(task="cnn"), "train")
        'cnn'
    """
    if not isinstance(args.task, DefaultTask):
        return str(args.task)
    other = next(task for task in TASKS if task != args.task)
    return f"{args.task} (no model named, so the default; `amp-plus {command} {other}` trains the other)"


def model_hparams(task: Task, settings: dict[str, Any]) -> dict[str, Any]:
    """The model's keyword arguments among ``settings`` (the data's ``max_len`` is not one).

    Examples:
        >>> model_hparams("cnn", {"lr": 0.1, "width": 8, "epochs": 2})
        {'lr': 0.1, 'width': 8}
    """
    keys = ("lr", *(flag for flag in MODEL_FLAGS[task] if flag != "max_len"))
    return {key: settings[key] for key in keys if key in settings}
