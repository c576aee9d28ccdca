"""``amp-plus compare``: one model, one seed, several precision setups, one table.

Each configuration trains the same shipped model from the same seed on the same batches for the same number of
optimizer steps, then validates once:

* ``32-true``: plain fp32.
* ``lightning-16-mixed``, ``lightning-bf16-mixed``: Lightning's built-in ``MixedPrecision`` (``torch.amp.GradScaler``).
* ``ours-16-mixed``, ``ours-bf16-mixed``: :class:`~lightning_amp_plus.MixedPrecisionPlugin`.
* ``ours-16-mixed-master``, ``ours-bf16-mixed-master``: the same with ``master_weights=True``.
* ``lightning-bf16-true`` (only when named in ``--configs``): Lightning's ``precision="bf16-true"``, weights in bf16.
* ``ours-fp8-mixed`` (only when named in ``--configs``; needs torchao): ``MixedPrecisionPlugin("fp8-mixed")``. The
  shipped models have no Linear layer FP8 can take, so it measures bf16-mixed with FP8's bookkeeping (the footer says
  so).

The set-ups are the table in :mod:`lightning_amp_plus.cli._configs`, which ``benchmarks/bench_master.py`` reads too.

Measured per configuration: the median step time after warm-up (a callback times each training batch, from
``on_train_batch_start`` to ``on_train_batch_end``, synchronising CUDA at both ends: forward, backward and optimizer
step, no data loading), the peak memory (CUDA: ``torch.cuda.max_memory_allocated`` after a reset; CPU: the increase of
the peak resident set size, in a fresh process per configuration), the final training loss (mean of the last steps),
the validation accuracy and the skipped steps.

Run a configuration in a fresh process with ``python -m lightning_amp_plus.cli.compare SPEC.json RESULT.json`` (what
``amp-plus compare`` does on CPU).
"""

from __future__ import annotations

import argparse
import csv
import gc
import io
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_amp_plus._paths import write_new, written_as
from lightning_amp_plus._wording import plural
from lightning_amp_plus.cli._checks import RunFailed, Terminated, UsageError
from lightning_amp_plus.cli._configs import SETUPS, PrecisionSetup
from lightning_amp_plus.cli._noise import without_lightning_noise
from lightning_amp_plus.cli._runs import (
    build_datamodule,
    build_model,
    interruptible,
    lightning_output,
    load_datamodule,
    resolve_accelerator,
    resolve_precision,
)
from lightning_amp_plus.cli._settings import model_hparams, task_label, train_settings
from lightning_amp_plus.cli.chart import write_comparison_chart
from lightning_amp_plus.monitor import memory as _memory
from lightning_amp_plus.plugins.precision import skipped_steps
from lightning_amp_plus.weights.compensated import footprint

__all__ = [
    "CONFIGS",
    "Config",
    "ConfigResult",
    "RunSpec",
    "StepTimer",
    "format_table",
    "loss_window",
    "memory_method",
    "run",
    "run_config",
    "run_config_isolated",
    "to_markdown",
    "write_csv",
]


Config = PrecisionSetup
"""One set-up to compare (the table in :mod:`lightning_amp_plus.cli._configs`, shared with ``benchmarks/``)."""
CONFIGS: dict[str, PrecisionSetup] = SETUPS
"""Every set-up ``--configs`` accepts, by name.

Examples:
    >>> CONFIGS["ours-bf16-mixed-master"].master_weights
    True
"""

_MB = 1024.0 * 1024.0
_INTERRUPTED = 130  # a worker's exit code after Ctrl-C (128 + SIGINT)
_LOSS_WINDOW = 5  # the final train loss is the mean over this many last steps: one batch's loss is noisy


@dataclass(frozen=True)
class RunSpec:
    """Everything one configuration's run needs; plain values, so it travels to a worker process as JSON.

    Examples:
        >>> spec = RunSpec("cnn", "32-true", steps=4, warmup=1, data={"num_train": 8}, model={"width": 4})
        >>> RunSpec(**json.loads(json.dumps(asdict(spec)))) == spec
        True
    """

    task: Literal["cnn", "lstm"]
    config: str
    steps: int
    warmup: int
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None
    data: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)


@dataclass
class ConfigResult:
    """What one configuration measured.

    Attributes:
        config: the configuration's name.
        steps: optimizer steps taken (skipped ones included).
        step_ms: median step time after warm-up, in milliseconds.
        peak_memory_mb: see :func:`memory_method`.
        final_train_loss: mean training loss over the last steps.
        val_acc: validation accuracy after training.
        skipped_steps: steps skipped for non-finite gradients.
        seconds: wall time of the run (training and validation).
        ratio: ``step_ms`` over 32-true's (``None`` when 32-true was not run).
        bytes_per_param: the model's weights, compensation buffers and optimizer state after training, in bytes per
            trainable parameter (every parameter of the shipped models trains), counted from the tensors
            (``weights.compensated.footprint``).
    """

    config: str
    steps: int
    step_ms: float
    peak_memory_mb: float | None
    final_train_loss: float | None
    val_acc: float | None
    skipped_steps: int
    seconds: float
    ratio: float | None = None
    bytes_per_param: float | None = None


class StepTimer(Callback):
    """Times each training batch (forward, backward, optimizer step), records its loss, counts skipped steps.

    Skips are read with :func:`~lightning_amp_plus.plugins.precision.skipped_steps` at the end; under
    ``torch.amp.GradScaler``, which counts none, a skipped step is the one after which the scale went down. Scale reads
    and loss reads happen outside the timed span.

    Examples:
        >>> StepTimer("cpu").median_ms(warmup=0)
        nan
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self.scale_drops = 0
        self._scale: float | None = None
        self._start = 0.0

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._scale = None if trainer.scaler is None else float(trainer.scaler.get_scale())
        self._sync()
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._sync()
        self.seconds.append(time.perf_counter() - self._start)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.losses.append(float(loss))
        if self._scale is not None and trainer.scaler is not None and float(trainer.scaler.get_scale()) < self._scale:
            self.scale_drops += 1

    def median_ms(self, warmup: int) -> float:
        """The median step time in ms, leaving out the first ``warmup`` steps (``nan`` if none are left)."""
        kept = self.seconds[warmup:]
        return 1000.0 * statistics.median(kept) if kept else math.nan


# -------------------------------------------------------------------------------------------------------- runs
def memory_method(device: str, isolated: bool) -> str:
    """How the peak-memory column was measured, for the table's footer.

    Examples:
        >>> memory_method("cuda", isolated=False)
        'peak memory: torch.cuda.max_memory_allocated during training and validation, reset before each configuration'
    """
    if device == "cuda":
        return (
            "peak memory: torch.cuda.max_memory_allocated during training and validation, reset before each "
            "configuration"
        )
    where = (
        "in a fresh process per configuration"
        if isolated
        else "all configurations in one process (--in-process): memory freed by an earlier one is reused, so this is "
        "a lower bound"
    )
    return (
        "peak memory: increase of the process's peak resident set size (VmHWM, reset first) over its size before "
        f"the model was built, {where}"
    )


def _start_memory(device: str) -> float:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return 0.0
    _memory.reset_peak_rss()
    return _memory.process_rss_mb()


def _peak_memory(device: str, baseline: float) -> float | None:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / _MB
    peak = _memory.peak_rss_mb()
    return None if peak is None else max(0.0, peak - baseline)


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence what every configuration would repeat: Lightning's info lines and two expected warnings."""
    with lightning_output(info=False), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*no `val_dataloader`.*")  # validation runs after fit
        warnings.filterwarnings("ignore", message=r".*fp16 autocast is correct there but slow.*")  # in the footer
        yield


def run_config(spec: RunSpec) -> ConfigResult:
    """Train and validate one configuration in this process.

    Examples:
        >>> spec = RunSpec("cnn", "ours-bf16-mixed", steps=2, warmup=1, data={"num_train": 8, "num_val": 4,
        ...                "batch_size": 4}, model={"width": 2})
        >>> result = run_config(spec)
        >>> result.steps, result.skipped_steps
        (2, 0)
    """
    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    config = CONFIGS[spec.config]
    datamodule = build_datamodule(spec.task, seed=spec.seed, **spec.data)
    datamodule.setup("fit")
    baseline = _start_memory(spec.device)
    pl.seed_everything(spec.seed, verbose=False)  # the same initial weights for every configuration
    model = build_model(spec.task, datamodule, **spec.model)
    timer = StepTimer(spec.device)
    with _quiet():  # the Trainer's constructor prints Lightning's device banner
        trainer = _trainer(spec, config, timer)
    start = time.perf_counter()
    with _quiet():
        # Training batches only: one validation at the end, outside the timed steps, measures the final weights.
        interruptible(trainer, lambda: trainer.fit(model, train_dataloaders=datamodule.train_dataloader()))
        validated = interruptible(
            trainer, lambda: trainer.validate(model, dataloaders=datamodule.val_dataloader(), verbose=False)
        )
        metrics = validated[0]
    seconds = time.perf_counter() - start
    counted = skipped_steps(trainer)
    skipped = timer.scale_drops if counted is None else counted  # GradScaler counts none: its scale drops are the skips
    losses = timer.losses[-_LOSS_WINDOW:]
    return ConfigResult(
        config=spec.config,
        steps=trainer.global_step,
        step_ms=timer.median_ms(spec.warmup),
        peak_memory_mb=_peak_memory(spec.device, baseline),
        final_train_loss=sum(losses) / len(losses) if losses else None,
        val_acc=float(metrics["val/acc"]) if "val/acc" in metrics else None,
        skipped_steps=skipped,
        seconds=seconds,
        bytes_per_param=_bytes_per_param(trainer),
    )


def _bytes_per_param(trainer: pl.Trainer) -> float | None:
    """Weights + compensation + optimizer state per trainable parameter, counted from the tensors (one optimizer).

    Every parameter of the shipped models trains, so this is also the figure per model parameter.
    """
    compensators = getattr(trainer.precision_plugin, "compensators", None)
    footprints = [] if compensators is None else compensators.footprints()
    if footprints:
        per_parameter: float = footprints[0].per_trainable_parameter
        return per_parameter
    return footprint(trainer.optimizers[0]).per_trainable_parameter if trainer.optimizers else None


def _trainer(spec: RunSpec, config: PrecisionSetup, timer: StepTimer) -> pl.Trainer:
    return pl.Trainer(
        accelerator=spec.device,
        devices=1,
        max_steps=spec.steps,
        max_epochs=-1,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **config.trainer_kwargs(spec.device),
    )


def run_config_isolated(spec: RunSpec) -> ConfigResult:
    """Run one configuration in a fresh process (``python -m lightning_amp_plus.cli.compare``) and read its result.

    A fresh process per configuration makes the CPU peak-memory reading that configuration's alone.
    """
    with tempfile.TemporaryDirectory(prefix="amp-plus-compare-") as folder:
        spec_path, result_path = Path(folder) / "spec.json", Path(folder) / "result.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        command = [sys.executable, "-m", "lightning_amp_plus.cli.compare", str(spec_path), str(result_path)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode in (_INTERRUPTED, -signal.SIGINT):
            raise KeyboardInterrupt  # Ctrl-C reached the worker (as it does from a terminal)
        if done.returncode != 0 or not result_path.exists():
            raise RunFailed(
                f"configuration {spec.config!r} failed in its worker process (exit code {done.returncode}). Its last "
                f"output:\n{done.stderr[-3000:]}"
            )
        return ConfigResult(**json.loads(result_path.read_text()))


# ------------------------------------------------------------------------------------------------------- output
_COLUMNS = (
    ("config", "config"),
    ("step_ms", "step ms (median)"),
    ("ratio", "vs 32-true"),
    ("peak_memory_mb", "peak memory MB"),
    ("bytes_per_param", "bytes/param"),
    ("final_train_loss", "final train loss"),
    ("val_acc", "val acc"),
    ("skipped_steps", "skipped steps"),
)


def _cell(key: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if key == "ratio":
        return f"{value:.2f}x"
    if key in ("step_ms", "peak_memory_mb", "bytes_per_param"):
        return f"{value:,.1f}"
    if key in ("final_train_loss", "val_acc"):
        return f"{value:.3f}"
    return str(value)


def _rows(results: list[ConfigResult]) -> list[list[str]]:
    return [[_cell(key, getattr(result, key)) for key, _ in _COLUMNS] for result in results]


def format_table(results: list[ConfigResult], footer: list[str]) -> str:
    """The results as an aligned text table, then the footer lines.

    Examples:
        >>> print(format_table([ConfigResult("32-true", 4, 10.0, 1.5, 0.7, 0.5, 0, 1.0, 1.0)], ["note"]))
        config   step ms (median)  vs 32-true  peak memory MB  bytes/param  final train loss  val acc  skipped steps
        32-true              10.0       1.00x             1.5            -             0.700    0.500              0
        note
    """
    header = [title for _, title in _COLUMNS]
    rows = _rows(results)
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))])

    return "\n".join([line(header), *(line(row) for row in rows), *footer])


def to_markdown(results: list[ConfigResult], footer: list[str]) -> str:
    """The results as a Markdown table, then the footer as a list.

    Examples:
        >>> print(to_markdown([ConfigResult("32-true", 4, 10.0, None, 0.7, 0.5, 0, 1.0, 1.0)], []).splitlines()[2])
        | 32-true | 10.0 | 1.00x | - | - | 0.700 | 0.500 | 0 |
    """
    header = [title for _, title in _COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(results)]
    if footer:
        lines += ["", *(f"- {note}" for note in footer)]
    return "\n".join(lines) + "\n"


def write_csv(results: list[ConfigResult], path: str | Path) -> Path:
    """The results as CSV, one row per configuration, raw numbers (empty cells for values not measured).

    Written at ``path``, or at the next free numbered name if a file has that name (never over it); missing folders
    are created. Returns where it went.
    """
    names = [f.name for f in fields(ConfigResult)]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=names)
    writer.writeheader()
    for result in results:
        writer.writerow({key: "" if value is None else value for key, value in asdict(result).items()})
    return write_new(path, lambda handle: handle.write(text.getvalue().encode()))


# ---------------------------------------------------------------------------------------------------------- CLI
def _spec_defaults(device: str) -> tuple[int, int]:
    # fp16 and bf16 run many times slower than fp32 on CPUs without native half arithmetic: few steps there.
    return (16, 3) if device == "cpu" else (200, 20)


def _specs(args: argparse.Namespace, device: str) -> list[RunSpec]:
    settings = train_settings(args)  # the same model and data sizes as `amp-plus train`
    default_steps, default_warmup = _spec_defaults(device)
    steps = args.steps or default_steps
    # The default warm-up leaves at least one step to time, however few --steps asks for.
    warmup = min(default_warmup, steps - 1) if args.warmup is None else args.warmup
    if warmup >= steps:
        raise UsageError(
            f"--warmup {warmup} leaves none of {'--steps ' if args.steps else 'the default '}{steps} steps to time: "
            "use fewer warm-up steps or more steps."
        )
    data = {
        "data": args.data,
        "data_dir": args.data_dir,
        "batch_size": settings["batch_size"],
        "num_workers": args.num_workers,
        "num_train": settings["num_train"],
        "num_val": settings["num_val"],
        "max_len": settings.get("max_len"),
        "download": not args.no_download,
    }
    model = model_hparams(args.task, settings)
    threads = args.threads if args.threads is not None else torch.get_num_threads()
    return [RunSpec(args.task, name, steps, warmup, args.seed, device, threads, data, model) for name in args.configs]


def _check_configs(names: list[str], device: str) -> None:
    for precision in dict.fromkeys(CONFIGS[name].precision for name in names):
        try:
            resolve_precision(precision, device)
        except UsageError as error:
            raise UsageError(f"{error} (In compare, leave those configurations out with --configs.)") from None


def run(args: argparse.Namespace) -> list[ConfigResult]:
    """``amp-plus compare``: run each configuration, print one table, write the requested files.

    The flags are those :func:`lightning_amp_plus.cli.check_request` passed; what needs the machine (device,
    precision support, data) is checked here before the first configuration runs. Ctrl-C keeps the configurations
    that finished: their table is printed and the files written, then ``KeyboardInterrupt`` is raised again.
    """
    device = resolve_accelerator(args.accelerator)
    _check_configs(args.configs, device)
    specs = _specs(args, device)
    isolated = device == "cpu" and not args.in_process
    if args.data == "real":  # fetch the data once, before any run, so that a missing dataset stops everything
        load_datamodule(args, train_settings(args))
    where = "one fresh process each" if isolated else "in this process"
    print(
        f"amp-plus compare {task_label(args, 'compare')}: {plural(len(specs), 'configuration')} x "
        f"{plural(specs[0].steps, 'step')} on "
        f"{device} ({where}; the first {plural(specs[0].warmup, 'step')} warm-up)",
        flush=True,
    )
    results: list[ConfigResult] = []
    try:
        for number, spec in enumerate(specs, 1):
            print(f"  [{number}/{len(specs)}] {spec.config}", flush=True)
            results.append(run_config_isolated(spec) if isolated else run_config(spec))
    except KeyboardInterrupt as stop:
        if results:
            _report(args, results, specs[0], device, isolated)
        kind = Terminated if isinstance(stop, Terminated) else KeyboardInterrupt  # the command names the signal
        raise kind(
            f"after {len(results)} of {plural(len(specs), 'configuration')}"
            + ("; the table above holds those that finished" if results else "")
        ) from None
    _report(args, results, specs[0], device, isolated)
    return results


def _report(args: argparse.Namespace, results: list[ConfigResult], spec: RunSpec, device: str, isolated: bool) -> None:
    base = next((r for r in results if r.config == "32-true"), None)
    for result in results:
        result.ratio = None if base is None else result.step_ms / base.step_ms
    footer = _footer(spec, device, isolated, base is not None, any(r.config == "ours-fp8-mixed" for r in results))
    print()
    print(format_table(results, footer))
    title = f"amp-plus compare {args.task} on {device}, {plural(spec.steps, 'step')} per configuration"
    _write_outputs(args, results, footer, title)


def _footer(spec: RunSpec, device: str, isolated: bool, has_base: bool, fp8: bool = False) -> list[str]:
    first = spec.warmup + 1
    timed = f"step {first}" if first == spec.steps else f"steps {first}-{spec.steps}"
    notes = [
        f"step ms: median over {timed} (the first {plural(spec.warmup, 'step')} warm-up), timed from "
        "on_train_batch_start to on_train_batch_end: forward, backward and optimizer step, no data loading"
        + (", CUDA synchronised at both ends" if device == "cuda" else "")
        + "; configurations run one after another, so other work on the machine skews the ratios",
        memory_method(device, isolated),
        f"final train loss: {loss_window(spec.steps)}; val acc: one validation after training; the same seed "
        f"({spec.seed}), initial weights and batches for every configuration",
    ]
    if not has_base:
        notes.append("vs 32-true: not measured (32-true was not among --configs)")
    if fp8:
        notes.append(
            "ours fp8-mixed: no layer trains in FP8 here: the shipped models' only Linear is their classifier (10 "
            "classes, or 1 logit), and FP8 takes Linear layers whose two dimensions are multiples of 16; the row is "
            "bf16-mixed with FP8's bookkeeping (docs/fp8.md is about the models FP8 is for)"
        )
    if device == "cpu":
        notes.append(
            "on CPU: fp16 and bf16 run slower than fp32 on CPUs without native half-precision arithmetic (fp16 the "
            "slowest); the ratios show that, not what a GPU does, and steps are few so that CPU runs stay short"
        )
    return notes


def loss_window(steps: int) -> str:
    """What the final train loss of a run of ``steps`` steps averages, as the footer says it.

    Examples:
        >>> loss_window(16), loss_window(2), loss_window(1)
        ('mean of the last 5 steps', 'mean of both steps', 'the loss of the one step')
    """
    if steps == 1:
        return "the loss of the one step"
    if steps == 2:
        return "mean of both steps"
    return f"mean of {'the last' if steps > _LOSS_WINDOW else 'all'} {min(steps, _LOSS_WINDOW)} steps"


def _write_outputs(args: argparse.Namespace, results: list[ConfigResult], footer: list[str], title: str) -> None:
    # Each at the name asked for or, where a file has that name, the next free numbered one: none is overwritten.
    if args.csv is not None:
        print(f"CSV written to {written_as(args.csv, write_csv(results, args.csv))}")
    if args.markdown is not None:
        markdown = to_markdown(results, footer).encode()
        print(f"Markdown written to {written_as(args.markdown, write_new(args.markdown, lambda f: f.write(markdown)))}")
    if args.png is not None:
        print(f"chart written to {written_as(args.png, write_comparison_chart(results, args.png, title))}")


def _worker(argv: list[str]) -> None:
    """``python -m lightning_amp_plus.cli.compare SPEC.json RESULT.json``: run one configuration, write its result."""
    spec_path, result_path = argv
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C stops it even if its parent inherited it ignored
    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    try:
        with without_lightning_noise():  # as in the command that started this worker
            result = run_config(spec)
    except KeyboardInterrupt:
        raise SystemExit(_INTERRUPTED) from None
    Path(result_path).write_text(json.dumps(asdict(result)))


if __name__ == "__main__":
    _worker(sys.argv[1:])
