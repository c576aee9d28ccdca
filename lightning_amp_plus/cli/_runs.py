"""What ``amp-plus train`` and ``amp-plus compare`` share once a command runs.

Device and precision, data and model, Lightning's console output, and Ctrl-C.

This module imports torch and Lightning; the command line imports it only after the request passed its checks.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_amp_plus import data as datasets
from lightning_amp_plus.cli import _machine, doctor
from lightning_amp_plus.cli._checks import Terminated, UsageError
from lightning_amp_plus.cli._settings import PrecisionName, Task
from lightning_amp_plus.data._download import DatasetUnavailableError
from lightning_amp_plus.models import CifarCNN, ImdbLSTM

__all__ = [
    "build_datamodule",
    "build_model",
    "check_devices",
    "check_fp8_gpu",
    "example_input",
    "interruptible",
    "lightning_output",
    "load_datamodule",
    "resolve_accelerator",
    "resolve_precision",
]

_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------------- devices
def resolve_accelerator(accelerator: str) -> str:
    """``"cpu"`` or ``"cuda"``: ``"auto"`` picks CUDA when there is one; CUDA requested without one is an error.

    Examples:
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


def check_devices(device: str, devices: int) -> None:
    """Refuse more CUDA devices than there are, and more CPU processes than this machine's cores or memory hold.

    On CPU each device is a process of its own (:func:`~._machine.cpu_processes_problem` says why cores and memory
    bound them). What one process holds is measured on this one, torch and Lightning loaded: a lower bound.

    Examples:
        >>> check_devices("cpu", 1)
    """
    if device == "cpu" and devices > 1:
        problem = _machine.cpu_processes_problem(
            devices, _machine.usable_cores(), _machine.available_memory_mb(), _machine.private_memory_mb()
        )
        if problem is not None:
            raise UsageError(problem)
    if device == "cuda" and devices > torch.cuda.device_count():
        raise UsageError(
            f"--devices {devices} was requested, but PyTorch sees {torch.cuda.device_count()} CUDA device(s) here. "
            f"Use --devices {torch.cuda.device_count()} or fewer."
        )


def check_fp8_gpu(index: int) -> None:
    """Refuse ``--precision fp8-mixed`` on a GPU without float8 matrix multiplies (below compute capability 8.9)."""
    from lightning_amp_plus.plugins.fp8 import NATIVE_CAPABILITY

    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < NATIVE_CAPABILITY:
        raise UsageError(
            f"--precision fp8-mixed was requested, but this GPU ({torch.cuda.get_device_name(index)}, compute "
            f"capability {major}.{minor}) has no float8 matrix multiply (that needs 8.9: Ada, Hopper, Blackwell). Use "
            "--precision bf16-mixed (or auto)."
        )


def resolve_precision(precision: str, device: str) -> PrecisionName:
    """The precision to run: ``"auto"`` is what ``amp-plus doctor`` recommends on ``device``; checks support.

    ``"auto"`` asks :func:`~.doctor.recommend` about ``device`` (probed without the benchmark): bf16-mixed on a GPU
    with native bf16 and on a CPU whose feature flags list native bf16 arithmetic, 16-mixed on older GPUs, 32-true on
    any other CPU, where bf16 autocast makes training several times slower. A requested half dtype must really run
    under autocast on ``device`` (tested with a tiny matmul), and bf16 on a GPU must be native: emulated bf16 on
    pre-Ampere GPUs is far slower than fp16. ``"bf16-true"`` is checked as bf16.

    Examples:
        >>> resolve_precision("auto", "cpu") in ("bf16-mixed", "32-true")
        True
    """
    if precision == "auto":
        precision = doctor.recommend(doctor.probe(device)).precision
    checked = "bf16-mixed" if precision in ("bf16-true", "fp8-mixed") else precision  # fp8-mixed: bf16 autocast
    if precision == "fp8-mixed" and device == "cuda":
        check_fp8_gpu(torch.cuda.current_device())
    if checked == "bf16-mixed" and device == "cuda" and not doctor.cuda_bf16_native(torch.cuda.current_device()):
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        raise UsageError(
            f"--precision {precision} was requested, but this GPU ({torch.cuda.get_device_name(index)}, compute "
            f"capability {major}.{minor}) has no native bfloat16 (that needs 8.0, Ampere, or newer). Use --precision "
            "16-mixed (fp16 with dynamic loss scaling), or auto."
        )
    if checked in ("16-mixed", "bf16-mixed"):
        dtype = torch.float16 if checked == "16-mixed" else torch.bfloat16
        works, why = doctor.autocast_supported(device, dtype)
        if not works:
            other = "bf16-mixed" if checked == "16-mixed" else "16-mixed"
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

    Examples:
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

    Examples:
        >>> dm = build_datamodule("cnn", num_train=8, num_val=4)
        >>> build_model("cnn", dm, width=4).hparams["width"]
        4
    """
    if task == "cnn":
        return CifarCNN(num_classes=getattr(datamodule, "num_classes", 10), **hparams)
    return ImdbLSTM(vocab_size=datamodule.vocab_size, pad_index=datamodule.pad_index, **hparams)  # type: ignore[attr-defined]


def load_datamodule(args: Any, settings: dict[str, Any]) -> pl.LightningDataModule:
    """:func:`build_datamodule` from the flags and the run's settings; an unavailable dataset is a usage error."""
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
    except OSError as error:  # a folder that cannot be written, a disk that is full...
        raise UsageError(
            f"--data-dir {args.data_dir}: the {args.task} dataset could not be prepared there ({error}). Choose "
            "another --data-dir, or use --data synthetic."
        ) from None


def example_input(task: Task, datamodule: pl.LightningDataModule) -> Any:
    """One validation sample shaped as the model's ``forward`` takes it: what Lightning's model summary measures."""
    batch = next(iter(datamodule.val_dataloader()))
    if task == "cnn":
        return batch[0][:1]
    return (batch[0][:1], batch[1][:1])


# --------------------------------------------------------------------------------------------------- console
@contextmanager
def lightning_output(info: bool, summary: bool = False) -> Iterator[None]:
    """Lightning's info lines and tips (devices, why ``fit`` stopped, "does not have many workers") shown or not.

    ``summary``: the model summary shows either way. Lightning logs it as one more info line, through its
    ``ModelSummary`` module's logger: that logger is set to show info lines on its own, so ``--model-summary`` works
    with or without ``--lightning-info``, as each console flag chooses its own output.

    Warnings stay visible: they may be the user's business. Not Lightning's ``PossibleUserWarning`` tips while its info
    lines are off (about data-loader workers, logging intervals, samplers: advice for code the user of this command
    did not write); the ones nobody running this command can act on are silenced around the whole command
    (:mod:`._noise`).
    """
    loggers = _lightning_loggers()
    summary_logger = logging.getLogger(ModelSummary.__module__)
    loggers.append(summary_logger)
    levels = [logger.level for logger in loggers]
    if not info:
        for logger in loggers:
            logger.setLevel(logging.WARNING)
    if summary:
        summary_logger.setLevel(logging.INFO)  # its own level wins over its parents' WARNING
    try:
        with warnings.catch_warnings():
            if not info:
                warnings.filterwarnings("ignore", category=PossibleUserWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _lightning_loggers() -> list[logging.Logger]:
    """The loggers Lightning's info lines go to: its packages' own, and the one its ``rank_zero_info`` uses now.

    ``rank_zero_info`` writes to one logger shared by every Lightning package, the last imported naming it: after an
    ``import pytorch_lightning`` (the older package name, installed beside ``lightning``) that is
    ``pytorch_lightning.utilities.rank_zero``, even for ``lightning.pytorch``'s Trainer.
    """
    from lightning_utilities.core import rank_zero

    names = {"lightning.pytorch", "lightning.fabric", rank_zero.log.name}
    return [logging.getLogger(name) for name in sorted(names)]


def interruptible(trainer: pl.Trainer, call: Callable[[], _T]) -> _T:
    """Run ``call`` (``trainer.fit``, ``trainer.validate``...) and let Ctrl-C arrive as ``KeyboardInterrupt``.

    Lightning catches ``KeyboardInterrupt`` inside ``fit``/``validate``, tears down, ignores further Ctrl-C and calls
    ``sys.exit(1)``; a command then cannot tell an interrupt from a failure, nor print what was measured so far.
    Here that exit becomes a ``KeyboardInterrupt`` again, with the default Ctrl-C handler restored. A SIGTERM, which
    Lightning turns into its ``SIGTERMException`` at the next step, arrives as :class:`~._checks.Terminated`.
    """
    try:
        return call()
    except SystemExit as stop:
        if not trainer.interrupted:
            raise
        _restore_ctrl_c()
        if isinstance(stop, SIGTERMException):
            raise Terminated from None
        raise KeyboardInterrupt from None


def _restore_ctrl_c() -> None:
    with contextlib.suppress(ValueError):  # not the main thread: nothing was changed there
        signal.signal(signal.SIGINT, signal.default_int_handler)
