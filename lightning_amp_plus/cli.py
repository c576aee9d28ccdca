"""``amp-plus``: the package's console command (``python -m lightning_amp_plus`` runs it too).

Subcommands:

* ``train cnn|lstm``: train a shipped model under ``MixedPrecisionPlugin`` with ``MixedPrecisionMonitor`` attached:
  offline on synthetic data by default, on real CIFAR-10 / IMDB with ``--data real``.
* ``compare cnn|lstm``: the same model from the same seed under 32-true, Lightning's ``MixedPrecision`` and ours
  (see :mod:`lightning_amp_plus.compare`).
* ``doctor``: what this machine supports and how fast, and the recommended settings (see
  :mod:`lightning_amp_plus.doctor`).
* ``demo``: the original demo (:mod:`lightning_amp_plus.demo`).

Every function that can fail on a user's request raises :class:`UsageError`; :func:`main` turns it (and an unavailable
dataset) into one paragraph on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from lightning_amp_plus import data as datasets
from lightning_amp_plus import demo, doctor
from lightning_amp_plus.data._download import DatasetUnavailableError
from lightning_amp_plus.models import CifarCNN, ImdbLSTM
from lightning_amp_plus.monitor import MixedPrecisionMonitor
from lightning_amp_plus.precision import MixedPrecisionPlugin
from lightning_amp_plus.scaler import DynamicLossScaler

__all__ = [
    "AmpSettings",
    "UsageError",
    "build_datamodule",
    "build_model",
    "build_parser",
    "load_datamodule",
    "model_hparams",
    "main",
    "resolve_accelerator",
    "resolve_precision",
    "train",
    "train_settings",
]

PROG = "amp-plus"
TASKS = ("cnn", "lstm")
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
Task = Literal["cnn", "lstm"]
PrecisionName = Literal["32-true", "16-mixed", "bf16-mixed"]

# The defaults of `amp-plus train` with no flags: sized so that a 2-core CPU finishes in about a minute under bf16
# autocast and the validation accuracy climbs well above chance (measured numbers in the README). Each flag
# overrides its entry.
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
COMPARE_CONFIGS = (
    "32-true",
    "lightning-16-mixed",
    "lightning-bf16-mixed",
    "ours-16-mixed",
    "ours-bf16-mixed",
    "ours-16-mixed-master",
    "ours-bf16-mixed-master",
)
"""``amp-plus compare``'s configurations: Lightning's ``MixedPrecision``, ours, ours with FP32 master weights."""
_MODEL_FLAGS = {"cnn": ("width", "dropout"), "lstm": ("hidden_dim", "embed_dim", "dropout", "max_len")}
_CHANCE = {"cnn": 0.1, "lstm": 0.5}
_SCALER_FIELDS = ("init_scale", "growth_interval", "hysteresis")


class UsageError(Exception):
    """A request the command cannot carry out (bad combination, missing device or data); the message says why.

    Example:
        >>> str(UsageError("--master-weights needs a mixed precision"))
        '--master-weights needs a mixed precision'
    """


# ---------------------------------------------------------------------------------------------- amp settings
@dataclass(frozen=True)
class AmpSettings:
    """How a run uses mixed precision: ``MixedPrecisionPlugin``'s settings and ``MixedPrecisionMonitor``'s.

    The command line's ``train`` builds one from its flags; the LightningCLI examples expose it as ``--amp.*``.
    ``None`` leaves a setting at the plugin's or scaler's default.

    Args:
        precision: ``"32-true"`` (no plugin), ``"16-mixed"`` or ``"bf16-mixed"``.
        master_weights: hold the model in fp16/bf16 with FP32 master copies in the optimizer (mixed precisions only).
        init_scale: the loss scaler's initial scale (``16-mixed`` only).
        growth_interval: clean steps before the scale grows (``16-mixed`` only).
        hysteresis: overflows tolerated before the scale backs off (``16-mixed`` only).
        max_consecutive_skips: skipped steps in a row (at the scale's floor, for fp16) that stop training with a
            diagnosis; ``0`` never stops (mixed precisions only).
        monitor: attach a ``MixedPrecisionMonitor``.
        report_path: where the monitor writes its PNG chart at the end of ``fit`` (needs matplotlib).

    Example:
        >>> settings = AmpSettings("16-mixed", init_scale=1024.0)
        >>> [type(p).__name__ for p in settings.plugins()], settings.plugins()[0].scaler.get_scale()
        (['MixedPrecisionPlugin'], 1024.0)
        >>> AmpSettings("32-true").plugins()
        []
    """

    precision: PrecisionName = "bf16-mixed"
    master_weights: bool = False
    init_scale: float | None = None
    growth_interval: int | None = None
    hysteresis: int | None = None
    max_consecutive_skips: int | None = None
    monitor: bool = True
    report_path: str | None = None

    def __post_init__(self) -> None:
        # Messages name the settings as AmpSettings fields; amp-plus spells them --master-weights, --init-scale...
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {PRECISIONS}.")
        if self.master_weights and self.precision == "32-true":
            raise ValueError(
                "master_weights=True needs precision '16-mixed' or 'bf16-mixed', not '32-true': it holds the model "
                "in fp16/bf16 with FP32 master copies. Choose a mixed precision or drop master_weights."
            )
        scaler_set = [name for name in _SCALER_FIELDS if getattr(self, name) is not None]
        if scaler_set and self.precision != "16-mixed":
            raise ValueError(
                f"{' and '.join(scaler_set)} configure the fp16 loss scaler, which precision {self.precision!r} does "
                "not use (bf16 has fp32's range and needs no scaling; 32-true none). Use precision '16-mixed' or "
                "drop them."
            )
        if self.max_consecutive_skips is not None and self.precision == "32-true":
            raise ValueError(
                "max_consecutive_skips limits the steps skipped under mixed precision; '32-true' skips none. Choose "
                "a mixed precision or drop max_consecutive_skips."
            )
        _check_positive("init_scale", self.init_scale, float)
        _check_positive("growth_interval", self.growth_interval, int)
        _check_positive("hysteresis", self.hysteresis, int)
        _check_positive("max_consecutive_skips", self.max_consecutive_skips, int, allow_zero=True)
        if self.report_path is not None and importlib.util.find_spec("matplotlib") is None:
            raise ValueError(
                f"report_path={self.report_path!r} draws the monitor's chart with matplotlib, which is not "
                "installed: `pip install 'lightning-amp-plus[report]'` (or `pip install matplotlib`), or drop it."
            )

    def plugins(self, device: str | None = None) -> list[Precision]:
        """The Trainer's ``plugins``: ``[MixedPrecisionPlugin(...)]``, or ``[]`` for ``32-true``."""
        if self.precision == "32-true":
            return []
        # 0 means "never stop" on the command line, where None cannot be typed.
        limit = 50 if self.max_consecutive_skips is None else (self.max_consecutive_skips or None)
        scaler = None
        if self.precision == "16-mixed":
            options = {name: getattr(self, name) for name in _SCALER_FIELDS if getattr(self, name) is not None}
            scaler = DynamicLossScaler(**options, max_consecutive_skips=limit)
        plugin = MixedPrecisionPlugin(
            self.precision, device, scaler, max_consecutive_skips=limit, master_weights=self.master_weights
        )
        return [plugin]

    def trainer_kwargs(self, device: str | None = None) -> dict[str, Any]:
        """``precision="32-true"``, or the plugin: what to pass to ``Trainer`` (besides the callbacks).

        Example:
            >>> AmpSettings("32-true").trainer_kwargs()
            {'precision': '32-true'}
        """
        if self.precision == "32-true":
            return {"precision": "32-true"}
        return {"plugins": self.plugins(device)}

    def callbacks(self) -> list[Callback]:
        """``[MixedPrecisionMonitor(report_path=...)]``, or ``[]`` without the monitor."""
        return [MixedPrecisionMonitor(report_path=self.report_path)] if self.monitor else []


def _check_positive(name: str, value: float | None, kind: type, allow_zero: bool = False) -> None:
    if value is None:
        return
    ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
    if isinstance(value, bool) or not ok or value < 0 or (value == 0 and not allow_zero) or value != value:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r} must be a {kind.__name__} {bound}.")


# --------------------------------------------------------------------------------------------------- devices
def resolve_accelerator(accelerator: str) -> str:
    """``"cpu"`` or ``"cuda"``: ``"auto"`` picks CUDA when there is one; CUDA requested without one is an error.

    Example:
        >>> resolve_accelerator("cpu")
        'cpu'
    """
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            "--accelerator cuda was requested, but PyTorch sees no CUDA device here (torch.cuda.is_available() is "
            f"False; torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}). Use --accelerator cpu "
            "(or auto), or install a CUDA build of PyTorch on a machine with an NVIDIA GPU."
        )
    return accelerator


def resolve_precision(precision: str, device: str) -> PrecisionName:
    """The precision to run: ``"auto"`` picks bf16 where it is native or on CPU, fp16 on older GPUs; checks support.

    A requested half dtype must really run under autocast on ``device`` (tested with a tiny matmul), and bf16 on a GPU
    must be native: emulated bf16 on pre-Ampere GPUs is far slower than fp16.

    Example:
        >>> resolve_precision("auto", "cpu")
        'bf16-mixed'
    """
    if precision == "auto":
        native = device != "cuda" or doctor.cuda_bf16_native(torch.cuda.current_device())
        precision = "bf16-mixed" if native else "16-mixed"
    if precision == "bf16-mixed" and device == "cuda" and not doctor.cuda_bf16_native(torch.cuda.current_device()):
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        raise UsageError(
            f"--precision bf16-mixed was requested, but this GPU ({torch.cuda.get_device_name(index)}, compute "
            f"capability {major}.{minor}) has no native bfloat16 (that needs 8.0, Ampere, or newer). Use --precision "
            "16-mixed (fp16 with dynamic loss scaling), or auto."
        )
    if precision in ("16-mixed", "bf16-mixed"):
        dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
        works, why = doctor.autocast_supported(device, dtype)
        if not works:
            other = "bf16-mixed" if precision == "16-mixed" else "16-mixed"
            raise UsageError(
                f"--precision {precision} was requested, but torch.autocast cannot run {dtype} on {device} here "
                f"({why}). Use --precision {other} or 32-true; `amp-plus doctor` lists what this machine supports."
            )
    return cast(PrecisionName, precision)


# ------------------------------------------------------------------------------------------------ model, data
def build_datamodule(
    task: Task,
    data: Literal["synthetic", "real"] = "synthetic",
    *,
    data_dir: str = "data",
    batch_size: int = 64,
    seed: int = 0,
    num_workers: int = 0,
    num_train: int = 2048,
    num_val: int = 512,
    max_len: int | None = None,
    download: bool = True,
) -> pl.LightningDataModule:
    """The data module of ``task``: synthetic (generated offline) or real (CIFAR-10 / IMDB, downloaded if missing).

    A real data module has its data prepared and set up here, so that a missing dataset is reported before any
    training starts (``DatasetUnavailableError``) and the IMDB vocabulary size is known.

    Example:
        >>> build_datamodule("lstm", num_train=8, num_val=4, max_len=6).vocab_size
        1000
    """
    lengths = {} if max_len is None else {"max_len": max_len}
    module: pl.LightningDataModule
    if data == "synthetic":
        common = {"num_train": num_train, "num_val": num_val, "batch_size": batch_size, "seed": seed}
        if task == "cnn":
            module = datasets.SyntheticCIFAR10DataModule(**common, num_workers=num_workers)
        else:
            # A minimum under max_len, and well under it: if every review in a batch had the same length, CPU
            # autocast would hand the LSTM to a oneDNN kernel that fails in fp16 and bf16 (torch 2.14).
            min_len = {} if max_len is None else {"min_len": min(20, max(1, max_len // 3))}
            module = datasets.SyntheticIMDBDataModule(**common, **lengths, **min_len, num_workers=num_workers)
        return module
    if task == "cnn":
        module = datasets.CIFAR10DataModule(data_dir, batch_size, num_workers, seed=seed, download=download)
    else:
        module = datasets.IMDBDataModule(
            data_dir, batch_size, seed=seed, num_workers=num_workers, download=download, **lengths
        )
    module.prepare_data()
    module.setup("fit")
    return module


def build_model(task: Task, datamodule: pl.LightningDataModule, **hparams: Any) -> pl.LightningModule:
    """The shipped model of ``task`` (``CifarCNN`` or ``ImdbLSTM``, sized to ``datamodule``), with ``hparams``.

    Example:
        >>> dm = build_datamodule("cnn", num_train=8, num_val=4)
        >>> build_model("cnn", dm, width=4).hparams["width"]
        4
    """
    if task == "cnn":
        return CifarCNN(num_classes=getattr(datamodule, "num_classes", 10), **hparams)
    return ImdbLSTM(vocab_size=datamodule.vocab_size, pad_index=datamodule.pad_index, **hparams)  # type: ignore[attr-defined]


# -------------------------------------------------------------------------------------------------- train
def train(args: argparse.Namespace) -> dict[str, Any]:
    """``amp-plus train``: fit a shipped model under the plugin and the monitor; print the result and return it."""
    settings = train_settings(args)
    device = resolve_accelerator(args.accelerator)
    precision = resolve_precision(args.precision, device)
    try:
        amp = AmpSettings(
            precision,
            master_weights=args.master_weights,
            init_scale=args.init_scale,
            growth_interval=args.growth_interval,
            hysteresis=args.hysteresis,
            max_consecutive_skips=args.max_consecutive_skips,
            report_path=args.report,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pl.seed_everything(args.seed, workers=True, verbose=False)
    datamodule = load_datamodule(args, settings)
    model = build_model(args.task, datamodule, **model_hparams(args.task, settings))
    last_val = _LastValidation()
    callbacks: list[Any] = [*amp.callbacks(), last_val]
    if args.ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True))
    trainer = pl.Trainer(
        accelerator=device,
        devices=args.devices,
        max_epochs=settings["epochs"],
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=args.ckpt_dir is not None,
        default_root_dir=args.ckpt_dir,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        **amp.trainer_kwargs(device),
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        # Lightning's model summary knows only its own precision plugins and then sizes the weights at 32 bits.
        warnings.filterwarnings("ignore", message=r".*is not supported by the model summary.*")
        # Lightning 2.6.6 calls a pytree API that torch 2.14 deprecates: nothing a user of this command can act on.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        trainer.fit(model, datamodule=datamodule)
    seconds = time.perf_counter() - start
    if last_val.step != trainer.global_step:
        trainer.validate(model, datamodule=datamodule, verbose=False)  # the numbers must describe the final weights
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    plugin = trainer.precision_plugin
    result = {
        "task": args.task,
        "data": args.data,
        "precision": precision,
        "master_weights": amp.master_weights,
        "accelerator": device,
        "steps": trainer.global_step,
        "seconds": seconds,
        "val_acc": metrics.get("val/acc"),
        "val_loss": metrics.get("val/loss"),
        "train_loss": metrics.get("train/loss_epoch", metrics.get("train/loss")),
        "skipped_steps": plugin.skipped_steps if isinstance(plugin, MixedPrecisionPlugin) else 0,
    }
    _print_train_result(result, len(datamodule.train_dataloader()))
    return result


def train_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The task's defaults (:data:`TRAIN_DEFAULTS`) with the given flags on top; another task's model flag is an error.

    Example:
        >>> train_settings(build_parser().parse_args(["train", "lstm", "--hidden-dim", "8"]))["hidden_dim"]
        8
    """
    settings = dict(TRAIN_DEFAULTS[args.task])
    other = next(t for t in TASKS if t != args.task)
    for flag in _MODEL_FLAGS[other]:
        if flag not in _MODEL_FLAGS[args.task] and getattr(args, flag, None) is not None:
            raise UsageError(
                f"--{flag.replace('_', '-')} configures the {other} model, not {args.task}. The {args.task} model's "
                f"flags are {', '.join('--' + f.replace('_', '-') for f in _MODEL_FLAGS[args.task])}."
            )
    sized = [flag for flag in ("num_train", "num_val") if getattr(args, flag, None) is not None]
    if sized and getattr(args, "data", "synthetic") == "real":
        raise UsageError(
            f"--{sized[0].replace('_', '-')} sizes the synthetic data; the real datasets come whole (CIFAR-10: 45,000 "
            "training images after the validation split; IMDB: 22,500 reviews). Drop it, or use --data synthetic."
        )
    for key in ("epochs", "batch_size", "num_train", "num_val", "lr", *_MODEL_FLAGS[args.task]):
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    if getattr(args, "max_steps", -1) != -1 and getattr(args, "epochs", None) is None:
        settings["epochs"] = -1  # --max-steps alone: the steps decide, however many epochs they take
    return settings


def load_datamodule(args: argparse.Namespace, settings: dict[str, Any]) -> pl.LightningDataModule:
    """:func:`build_datamodule` from the flags and :func:`train_settings`; an unavailable dataset is a usage error."""
    try:
        return build_datamodule(
            args.task,
            args.data,
            data_dir=args.data_dir,
            batch_size=settings["batch_size"],
            seed=args.seed,
            num_workers=args.num_workers,
            num_train=settings["num_train"],
            num_val=settings["num_val"],
            max_len=settings.get("max_len"),
            download=not args.no_download,
        )
    except DatasetUnavailableError as error:
        raise UsageError(str(error)) from None


def model_hparams(task: Task, settings: dict[str, Any]) -> dict[str, Any]:
    """The model's keyword arguments among ``settings`` (the data's ``max_len`` is not one).

    Example:
        >>> model_hparams("cnn", {"lr": 0.1, "width": 8, "epochs": 2})
        {'lr': 0.1, 'width': 8}
    """
    keys = ("lr", *(flag for flag in _MODEL_FLAGS[task] if flag != "max_len"))
    return {key: settings[key] for key in keys if key in settings}


def _print_train_result(result: dict[str, Any], batches_per_epoch: int) -> None:
    steps = result["steps"]
    per_step = 1000 * result["seconds"] / max(steps, 1)
    master = ", master weights" if result["master_weights"] else ""
    print(
        f"\namp-plus train {result['task']}: {result['precision']}{master} on {result['accelerator']}, "
        f"{result['data']} data, {steps} steps ({steps / max(batches_per_epoch, 1):.1f} epochs) in "
        f"{result['seconds']:.1f} s ({per_step:.0f} ms/step, validation included)"
    )
    accuracy = result["val_acc"]
    shown = "not measured" if accuracy is None else f"{accuracy:.3f} (chance {_CHANCE[result['task']]:.2f})"
    loss = "" if result["val_loss"] is None else f", val/loss {result['val_loss']:.3f}"
    print(f"val/acc {shown}{loss}; skipped steps {result['skipped_steps']}")


class _LastValidation(Callback):
    """Records the global step of the last validation run during ``fit`` (sanity checks excluded)."""

    def __init__(self) -> None:
        self.step = -1

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.step = trainer.global_step


# ---------------------------------------------------------------------------------------------------- parser
def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number > 0")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 1)")
    return value


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by train and compare: task, data, model size, device, seed."""
    parser.add_argument(
        "task", nargs="?", choices=TASKS, default="cnn", help="the model: cnn (CIFAR-10) or lstm (IMDB)"
    )
    data = parser.add_argument_group("data")
    data.add_argument(
        "--data",
        choices=("synthetic", "real"),
        default="synthetic",
        help="synthetic: generated offline from the seed (default); real: CIFAR-10 / IMDB",
    )
    data.add_argument("--data-dir", default="data", help="where real datasets are found or downloaded (default data)")
    data.add_argument("--no-download", action="store_true", help="real data: never download; fail if it is missing")
    data.add_argument("--batch-size", type=_int_at_least(1), help="samples per batch (default 64)")
    data.add_argument("--num-train", type=_int_at_least(1), help="synthetic training samples (default 2048)")
    data.add_argument("--num-val", type=_int_at_least(1), help="synthetic validation samples (default 512)")
    data.add_argument("--num-workers", type=_int_at_least(0), default=0, help="DataLoader workers (default 0)")
    model = parser.add_argument_group("model")
    model.add_argument("--lr", type=_positive_float, help="peak learning rate (cnn: 0.05 SGD; lstm: 1e-2 AdamW)")
    model.add_argument("--width", type=_int_at_least(1), help="cnn: channels of the first convolution (default 16)")
    model.add_argument("--hidden-dim", type=_int_at_least(1), help="lstm: hidden units per direction (default 64)")
    model.add_argument("--embed-dim", type=_int_at_least(1), help="lstm: embedding size (default 32)")
    model.add_argument("--max-len", type=_int_at_least(1), help="lstm: longest review in tokens (default 60)")
    model.add_argument("--dropout", type=_fraction, help="dropout before the classifier, in [0, 1) (default 0)")
    run = parser.add_argument_group("device")
    run.add_argument(
        "--accelerator", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available, else CPU"
    )
    run.add_argument("--threads", type=_int_at_least(1), help="CPU threads for torch (default: torch's choice)")
    run.add_argument("--seed", type=_int_at_least(0), default=0, help="seeds everything (default 0)")


def _add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("comparison")
    group.add_argument(
        "--steps", type=_int_at_least(2), help="optimizer steps per configuration (default 16 on CPU, 200 on CUDA)"
    )
    group.add_argument(
        "--warmup", type=_int_at_least(0), help="first steps left out of the step time (default 3 on CPU, 20 on CUDA)"
    )
    group.add_argument(
        "--configs",
        nargs="+",
        choices=COMPARE_CONFIGS,
        default=list(COMPARE_CONFIGS),
        metavar="CONFIG",
        help=f"which to run, in order (default: all of {', '.join(COMPARE_CONFIGS)})",
    )
    group.add_argument(
        "--in-process",
        action="store_true",
        help="CPU: run every configuration in this process (faster; the memory column is then a lower "
        "bound) instead of one process each",
    )
    group.add_argument("--csv", metavar="PATH", help="write the table as CSV")
    group.add_argument("--markdown", metavar="PATH", help="write the table and its footer as Markdown")
    group.add_argument("--png", metavar="PATH", help="write a bar chart of step time and memory (needs matplotlib)")


def build_parser() -> argparse.ArgumentParser:
    """The ``amp-plus`` argument parser with its four subcommands.

    Example:
        >>> build_parser().parse_args(["train", "lstm", "--precision", "16-mixed"]).precision
        '16-mixed'
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Mixed-precision training with lightning-amp-plus: train, compare, doctor, demo.",
        epilog="Run `amp-plus <command> --help` for a command's options.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{train,compare,doctor,demo}")

    train_parser = commands.add_parser(
        "train",
        help="train a shipped model (cnn or lstm) with MixedPrecisionPlugin and MixedPrecisionMonitor",
        description="Train CifarCNN (cnn) or ImdbLSTM (lstm) under MixedPrecisionPlugin with MixedPrecisionMonitor. "
        "With no flags: synthetic data generated offline, bf16-mixed on CPU (bf16 on GPUs that have it, else fp16), "
        "2 epochs: about 30 s on an idle 2-core CPU.",
    )
    _add_run_arguments(train_parser)
    amp = train_parser.add_argument_group("mixed precision")
    amp.add_argument(
        "--precision",
        choices=("auto", *PRECISIONS),
        default="auto",
        help="auto (default): bf16-mixed on CPU and on GPUs with native bf16, 16-mixed on older GPUs",
    )
    amp.add_argument("--master-weights", action="store_true", help="fp16/bf16 model with FP32 master weights")
    amp.add_argument("--init-scale", type=_positive_float, help="16-mixed: initial loss scale (default 2**16)")
    amp.add_argument("--growth-interval", type=_int_at_least(1), help="16-mixed: clean steps before the scale grows")
    amp.add_argument("--hysteresis", type=_int_at_least(1), help="16-mixed: overflows before the scale backs off")
    amp.add_argument(
        "--max-consecutive-skips",
        type=_int_at_least(0),
        help="skipped steps in a row that stop training with a diagnosis (default 50; 0 never)",
    )
    loop = train_parser.add_argument_group("loop and outputs")
    loop.add_argument("--epochs", type=_int_at_least(1), help="epochs (default 2)")
    loop.add_argument("--max-steps", type=_int_at_least(1), default=-1, help="stop after this many optimizer steps")
    loop.add_argument("--devices", type=_int_at_least(1), default=1, help="devices to train on (default 1)")
    loop.add_argument("--report", metavar="PATH.png", help="write the monitor's chart here (needs matplotlib)")
    loop.add_argument("--ckpt-dir", help="save checkpoints here (the latest epoch's, and last.ckpt); none by default")

    compare_parser = commands.add_parser(
        "compare",
        help="the same model under 32-true, Lightning's MixedPrecision and ours: speed, memory, accuracy",
        description="Train the same model from the same seed under each configuration and print one table. Defaults "
        "are short enough for a CPU; fp16 on CPU is slow (no fp16 arithmetic in common CPUs), so keep --steps small "
        "there.",
    )
    _add_run_arguments(compare_parser)
    _add_compare_arguments(compare_parser)

    doctor_parser = commands.add_parser(
        "doctor", help="devices, supported dtypes, measured matmul speed, and the recommended plugin settings"
    )
    doctor_parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    doctor_parser.add_argument("--no-benchmark", action="store_true", help="skip the matmul benchmark")

    commands.add_parser(
        "demo", help="the original demo (fp16 on Gaussian blobs); `amp-plus demo --help`", add_help=False
    )
    return parser


# ------------------------------------------------------------------------------------------------------ main
def _fail(command: str, message: str) -> NoReturn:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``amp-plus`` with ``argv`` (``sys.argv[1:]`` if ``None``); return 0, or exit with code 2 on a usage error.

    Example:
        >>> main(["doctor", "--no-benchmark", "--json"])  # doctest: +ELLIPSIS
        {...
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        demo.main(argv[1:])
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "train":
            train(args)
        elif args.command == "compare":
            from lightning_amp_plus import compare

            compare.run(args)
        else:
            _doctor(args)
    except UsageError as error:
        _fail(args.command, str(error))
    return 0


def _doctor(args: argparse.Namespace) -> None:
    data = doctor.report_dict(doctor.collect(benchmark=not args.no_benchmark))
    print(json.dumps(data, indent=2) if args.json else doctor.format_report(data))
