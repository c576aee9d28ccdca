"""``amp-plus train``: fit a shipped model under ``MixedPrecisionPlugin`` with ``MixedPrecisionMonitor`` attached.

The flags were checked by :mod:`lightning_amp_plus.cli` before this module (and with it torch and Lightning) was
imported; what needs the machine (device, precision support, data) is checked here, still before any training.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ModelSummary, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_amp_plus._wording import plural
from lightning_amp_plus.cli import _machine
from lightning_amp_plus.cli._checks import RunFailed, Terminated, UsageError
from lightning_amp_plus.cli._resume import ResumePoint, RunRecord, read_resume_point, saved_step
from lightning_amp_plus.cli._runs import (
    build_model,
    check_devices,
    example_input,
    interruptible,
    lightning_output,
    load_datamodule,
    resolve_accelerator,
    resolve_precision,
)
from lightning_amp_plus.cli._settings import (
    AmpSettings,
    PrecisionName,
    cli_amp_problem,
    model_hparams,
    task_label,
    train_settings,
)
from lightning_amp_plus.cli._workers import launching_workers
from lightning_amp_plus.plugins.precision import skipped_steps

__all__ = ["batches_per_rank", "train"]

_CHANCE = {"cnn": 0.1, "lstm": 0.5}


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Fit the model the flags describe; print the result (rank zero only) and return it.

    Ctrl-C stops cleanly: the monitor's summary so far is printed, the chart written, and ``KeyboardInterrupt``
    raised again (saying where it stopped, and with ``--ckpt-dir`` which checkpoint ``--resume`` continues from) for
    the command to exit with code 130. SIGTERM stops it the same way at the next step, as
    :class:`~._checks.Terminated` (exit code 143). A stop with a diagnosis (``FloatingPointError``: steps that keep
    overflowing) reports the same way and raises ``RunFailed``. With ``--resume``, training continues from
    ``--ckpt-dir``'s ``last.ckpt``, checked first (:mod:`._resume`). The CPU threads it chooses are torch's again on
    return.
    """
    threads_before = torch.get_num_threads()
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads_before)  # a program that calls this keeps its own thread count


def _train(args: argparse.Namespace) -> dict[str, Any]:
    settings = train_settings(args)
    device, precision, amp, threads = _set_up(args)
    pl.seed_everything(args.seed, workers=True, verbose=False)
    datamodule = load_datamodule(args, settings)
    model = build_model(args.task, datamodule, **model_hparams(args.task, settings))
    if args.model_summary:
        model.example_input_array = example_input(args.task, datamodule)  # measured sizes and FLOPs, not zeros
    batches = batches_per_rank(datamodule.train_dataloader(), args.devices)
    record = RunRecord(
        {
            "task": str(args.task),
            "precision": precision,
            "master_weights": amp.master_weights,
            "compensation": compensation_in_effect(precision, amp.compensation),
            **_fp8_in_effect(amp),
        }
    )
    resume = None
    if args.resume:
        target = _target_step(args, settings, batches)
        resume = read_resume_point(Path(args.ckpt_dir) / "last.ckpt", model, datamodule, record, target)
    # Under DDP on CPU every process runs this command; one speaks. (The Trainer knows its rank only inside fit.)
    if getattr(rank_zero_only, "rank", 0) == 0:
        fp8 = fp8_note(model) if precision == "fp8-mixed" else ""
        print(_start_line(args, settings, precision, device, amp, batches, threads, fp8), flush=True)
        if resume is not None:
            print(resume.line(), flush=True)
    trainer, seconds = _fit(args, settings, device, amp, model, datamodule, record, resume)
    result = _result(args, trainer, precision, device, amp, seconds)
    result["resumed_at"] = None if resume is None else resume.step
    if trainer.is_global_zero:
        _print_result(result, _epoch_length(trainer, batches))
    return result


def _set_up(args: argparse.Namespace) -> tuple[str, PrecisionName, AmpSettings, str]:
    """The device, the precision, the mixed-precision settings and the threads said, checked against this machine."""
    device = resolve_accelerator(args.accelerator)
    check_devices(device, args.devices)
    precision = resolve_precision(args.precision, device)
    problem = cli_amp_problem(args, precision, auto=args.precision == "auto")
    if problem is not None:
        raise UsageError(problem)
    threads, said = _threads(args, device)
    if threads is not None:
        torch.set_num_threads(threads)
        # Lightning's launcher gives each of N processes cores // N threads unless OMP_NUM_THREADS is set: the other
        # processes inherit this choice instead (and torch reads it when they import it).
        args.worker_threads = threads if args.devices > 1 else None
    return device, precision, _amp_settings(args, precision), said


def _threads(args: argparse.Namespace, device: str) -> tuple[int | None, str]:
    """The CPU threads of each process and the words for the first line (:func:`~._machine.thread_choice`)."""
    if device != "cpu":
        return args.threads, ""  # the GPU computes; the CPU threads only feed it
    known = args.threads is not None or os.environ.get("OMP_NUM_THREADS")
    idle = None if known else _machine.idle_cores()
    return _machine.thread_choice(args.threads, args.devices, os.environ, idle, _machine.usable_cores())


def _fit(
    args: argparse.Namespace,
    settings: dict[str, Any],
    device: str,
    amp: AmpSettings,
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule,
    record: RunRecord,
    resume: ResumePoint | None,
) -> tuple[pl.Trainer, float]:
    """Fit (from ``resume`` when given), then validate the final weights if fit did not; the trainer and seconds."""
    monitors = amp.callbacks()
    last_val = _LastValidation()
    start = time.perf_counter()
    ckpt_path = None if resume is None else str(resume.path)
    # The Trainer's constructor prints too.
    with lightning_output(args.lightning_info, args.model_summary), warnings.catch_warnings():
        # The folder was checked before: empty for a new run, the run's own for --resume.
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        trainer = _trainer(args, settings, device, amp, [*monitors, last_val, record], resume)
        try:
            # With --devices N, the other processes die with this one and take its thread count.
            with launching_workers(getattr(args, "worker_threads", None)):
                interruptible(trainer, lambda: trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path))
        except (KeyboardInterrupt, FloatingPointError) as stop:
            raise _stopped(stop, trainer, during="training", saved=_saved(args)) from None
        if last_val.step != trainer.global_step:  # the numbers must describe the final weights
            try:
                interruptible(trainer, lambda: trainer.validate(model, datamodule=datamodule, verbose=False))
            except KeyboardInterrupt as stop:
                raise _stopped(stop, trainer, during="the final validation") from None
    return trainer, time.perf_counter() - start


def _result(
    args: argparse.Namespace, trainer: pl.Trainer, precision: str, device: str, amp: AmpSettings, seconds: float
) -> dict[str, Any]:
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    return {
        "task": args.task,
        "data": args.data,
        "precision": precision,
        "master_weights": amp.master_weights,
        "compensation": amp.compensation,
        "spike_guard": amp.spike_guard,
        "accelerator": device,
        "devices": args.devices,
        "steps": trainer.global_step,
        "seconds": seconds,
        "val_acc": metrics.get("val/acc"),
        "val_loss": metrics.get("val/loss"),
        "train_loss": metrics.get("train/loss_epoch", metrics.get("train/loss")),
        "skipped_steps": skipped_steps(trainer),
    }


def batches_per_rank(loader: DataLoader[Any], devices: int) -> int:
    """The optimizer steps of one epoch on each process: with ``devices`` processes, each takes its share of samples.

    Lightning gives each process a ``DistributedSampler`` (``drop_last=False``): ``ceil(samples / devices)`` samples
    each, the last batch short unless the loader drops it.

    Examples:
        >>> from torch.utils.data import TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.zeros(2048, 1)), batch_size=64)
        >>> batches_per_rank(loader, 1), batches_per_rank(loader, 2), batches_per_rank(loader, 3)
        (32, 16, 11)
    """
    if devices == 1:
        return len(loader)
    batch_size = loader.batch_size or 1
    samples: int = math.ceil(len(loader.dataset) / devices)  # type: ignore[arg-type]
    return samples // batch_size if loader.drop_last else math.ceil(samples / batch_size)


def _target_step(args: argparse.Namespace, settings: dict[str, Any], batches: int) -> int:
    """The global step this run ends at: ``--max-steps``, or the end of the last epoch, whichever comes first."""
    ends = [int(settings["epochs"]) * batches if settings["epochs"] != -1 else None]
    ends.append(int(args.max_steps) if args.max_steps != -1 else None)
    return min(step for step in ends if step is not None)


def _epoch_length(trainer: pl.Trainer, batches: int) -> int:
    """The steps of one epoch as the Trainer counted them on each process (``batches`` if it counted none)."""
    counted = trainer.num_training_batches
    return int(counted) if isinstance(counted, int) and counted > 0 else batches


def _trainer(
    args: argparse.Namespace,
    settings: dict[str, Any],
    device: str,
    amp: AmpSettings,
    callbacks: list[Callback],
    resume: ResumePoint | None = None,
) -> pl.Trainer:
    if args.ckpt_dir is not None:
        # No last-v1.ckpt: the folder was checked to be empty or, with --resume, this run's own, whose last.ckpt is
        # this run's to replace (also when the folder has moved since, which Lightning's counter takes for another).
        checkpoints = ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, enable_version_counter=False)
        callbacks = [*callbacks, checkpoints]
    # A resumed run ends at its target step. Lightning's epoch count cannot be trusted to end it: after a resume from a
    # mid-epoch checkpoint (--max-steps inside an epoch), a later resume by max_epochs ends steps short (2.6.6).
    max_epochs, max_steps = (settings["epochs"], args.max_steps) if resume is None else (-1, resume.target)
    return pl.Trainer(
        callbacks=[*callbacks, *_console_callbacks(args)],
        accelerator=device,
        devices=args.devices,
        max_epochs=max_epochs,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=args.ckpt_dir is not None,
        enable_progress_bar=args.progress_bar,
        # The summary is ours to add (_console_callbacks): Lightning's own switch would only say it skipped adding one.
        enable_model_summary=False,
        default_root_dir=args.ckpt_dir,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        **amp.trainer_kwargs(device),
    )


def _console_callbacks(args: argparse.Namespace) -> list[Callback]:
    """The plain progress bar and model summary, asked for by name.

    Left to itself, Lightning picks their ``rich`` versions whenever ``rich`` happens to be installed: the command's
    output would then depend on what else is in the environment.
    """
    return [
        *([TQDMProgressBar()] if args.progress_bar else []),
        *([ModelSummary()] if args.model_summary else []),
    ]


def _stopped(stop: BaseException, trainer: pl.Trainer, during: str, saved: str = "") -> BaseException:
    """The exception the command ends with after ``stop``, saying where the run stopped and what was saved.

    The monitor printed its summary of the steps taken and wrote its chart already (in ``on_exception``).
    """
    sys.stdout.flush()
    if isinstance(stop, FloatingPointError):  # the scaler's diagnosis: the run cannot make progress
        flag = (
            " (on this command line: --max-consecutive-skips N; 0 never stops)"
            if "max_consecutive_skips" in str(stop)
            else ""
        )
        return RunFailed(f"{stop}{flag}")
    kind = Terminated if isinstance(stop, Terminated) else KeyboardInterrupt  # the command names the signal
    if during == "training":
        return kind(f"after {plural(trainer.global_step, 'optimizer step')}; no final validation{saved}")
    return kind("during the final validation (training had finished; its summary is above)")


def _saved(args: argparse.Namespace) -> str:
    """What ``--ckpt-dir`` holds to continue from, said after an interrupt (empty without ``--ckpt-dir``)."""
    if args.ckpt_dir is None:
        return ""
    last = Path(args.ckpt_dir) / "last.ckpt"
    if not last.is_file():
        return f". No checkpoint was saved yet in {args.ckpt_dir} (the first comes at the end of the first epoch)"
    step = saved_step(last)
    if step is None:
        return f". {last} could not be read as a checkpoint: remove it to start over in {args.ckpt_dir}"
    return f". {last} holds the last checkpoint (step {step}): the same command with --resume continues from it"


def _amp_settings(args: argparse.Namespace, precision: PrecisionName) -> AmpSettings:
    try:
        return AmpSettings(
            precision,
            master_weights=args.master_weights,
            init_scale=args.init_scale,
            growth_interval=args.growth_interval,
            hysteresis=args.hysteresis,
            max_consecutive_skips=args.max_consecutive_skips,
            compensation=args.compensation,
            spike_guard=args.spike_guard,
            fp8_recipe=args.fp8_recipe,
            fp8_check_interval=args.fp8_check_interval,
            fp8_fallback=args.fp8_fallback,
            report_path=args.report,
            headroom_interval=args.headroom,
        )
    except (ValueError, ImportError) as error:  # the flags were checked as flags: this is a last line of defence
        raise UsageError(str(error)) from None


def _start_line(
    args: argparse.Namespace,
    settings: dict[str, Any],
    precision: str,
    device: str,
    amp: AmpSettings,
    batches: int,
    threads: str = "",
    fp8: str = "",
) -> str:
    master = _weights_note(precision, amp.master_weights, amp.compensation) + _auto_note(args, precision, device)
    if precision == "fp8-mixed":
        master += f" ({amp.fp8_recipe or 'tensorwise'}{'; ' + fp8 if fp8 else ''})"
    if amp.spike_guard is not None:
        master += f", spike guard ({amp.spike_guard})"
    devices = f" x {args.devices}" if args.devices > 1 else ""
    length = (
        plural(args.max_steps, "step")
        if settings["epochs"] == -1
        else plural(settings["epochs"], "epoch")
        + f" of {plural(batches, 'step')}"
        + (f", at most {plural(args.max_steps, 'step')}" if args.max_steps != -1 else "")
    )
    return (
        f"amp-plus train {task_label(args, 'train')}: {precision}{master} on {device}{devices}, {args.data} data, "
        f"{length}{', ' + threads if threads else ''} (Ctrl-C stops cleanly with the summary so far)"
    )


def _auto_note(args: argparse.Namespace, precision: str, device: str) -> str:
    """Why ``--precision auto`` runs no plugin, for the first line: the command is there to show the plugin at work."""
    if args.precision != "auto" or precision != "32-true":
        return ""
    if device == "cpu":
        return (
            " (auto, as `amp-plus doctor` recommends here: this CPU shows no native bf16 arithmetic, avx512_bf16 or "
            "amx_bf16, and bf16 autocast would make training several times slower; --precision bf16-mixed runs "
            "MixedPrecisionPlugin anyway)"
        )
    return " (auto, as `amp-plus doctor` recommends here: autocast runs neither fp16 nor bf16 on this GPU)"


def fp8_note(model: nn.Module) -> str:
    """What ``fp8-mixed`` converts in ``model``, for the first line: how many Linear layers, and why not the others.

    The shipped models' only Linear is their classifier (10 classes, or 1 logit), which FP8's GEMMs cannot take (both
    weight dimensions must be multiples of 16): the line says the run then computes as bf16-mixed.

    Examples:
        >>> fp8_note(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
        '1 of 2 Linear layers in FP8 (not `2`: 64 -> 10, FP8 needs both dimensions multiples of 16)'
        >>> fp8_note(nn.Sequential(nn.Conv2d(3, 16, 3), nn.Flatten(), nn.Linear(16, 10)))
        'no layer in FP8: its only Linear, `2` (16 -> 10), is not a multiple of 16 in both dimensions, so this run computes as bf16-mixed'
    """  # noqa: E501
    from lightning_amp_plus.weights.fp8.convert import eligible

    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    left = [(name, module) for name, module in linears if not eligible(module, name)]
    shapes = ", ".join(f"`{name}`: {m.in_features} -> {m.out_features}" for name, m in left[:3])
    if len(left) < len(linears):
        return f"{len(linears) - len(left)} of {plural(len(linears), 'Linear layer')} in FP8" + (
            f" (not {shapes}, FP8 needs both dimensions multiples of 16)" if left else ""
        )
    if len(linears) == 1:
        name, module = linears[0]
        what = f"its only Linear, `{name}` ({module.in_features} -> {module.out_features}), is not"
    else:
        what = f"none of its {len(linears)} Linear layers ({shapes}) is" if linears else "it has no Linear layer, and"
    return (
        f"no layer in FP8: {what} a multiple of 16 in both dimensions, so this run computes as bf16-mixed"
        if linears
        else f"no layer in FP8: {what} FP8 converts Linear layers only, so this run computes as bf16-mixed"
    )


def _fp8_in_effect(amp: AmpSettings) -> dict[str, Any]:
    """The FP8 settings a run uses, for its checkpoint record (none outside fp8-mixed): a resume must keep them."""
    if amp.precision != "fp8-mixed":
        return {}
    return {
        "fp8_recipe": amp.fp8_recipe or "tensorwise",
        "fp8_check_interval": amp.fp8_check_interval or 50,
        "fp8_fallback": 1.0 if amp.fp8_fallback is None else amp.fp8_fallback,
    }


def compensation_in_effect(precision: str, compensation: str | None) -> str | None:
    """The compensation a run uses, as ``--compensation`` spells it: ``--compensation`` not given is ``"kahan"``.

    Examples:
        >>> compensation_in_effect("bf16-true", None), compensation_in_effect("bf16-mixed", None)
        ('kahan', None)
    """
    return (compensation or "kahan") if precision == "bf16-true" else None


def _weights_note(precision: str, master_weights: bool, compensation: str | None) -> str:
    method = compensation_in_effect(precision, compensation)
    if method is not None:
        return ", plain bf16 weights" if method == "none" else f", bf16 weights compensated ({method})"
    return ", master weights" if master_weights else ""


def _print_result(result: dict[str, Any], batches_per_epoch: int) -> None:
    steps, resumed_at = result["steps"], result["resumed_at"]
    this_run = steps - (resumed_at or 0)
    per_step = 1000 * result["seconds"] / max(this_run, 1)
    master = _weights_note(result["precision"], result["master_weights"], result["compensation"])
    devices = f" x {result['devices']}" if result["devices"] > 1 else ""
    epochs = f"{steps / max(batches_per_epoch, 1):.1f} epochs"
    if resumed_at is not None:
        epochs += f"; {this_run} in this run, resumed at step {resumed_at}"
    print(
        f"\namp-plus train {result['task']}: {result['precision']}{master} on {result['accelerator']}{devices}, "
        f"{result['data']} data, {plural(steps, 'step')} ({epochs}) in {result['seconds']:.1f} s ({per_step:.0f} "
        "ms/step, validation included)"
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
