"""``amp-plus``: the package's console command (``python -m lightning_amp_plus`` runs it too).

Subcommands:

* ``train cnn|lstm``: train a shipped model under ``MixedPrecisionPlugin`` with ``MixedPrecisionMonitor`` attached:
  offline on synthetic data by default, on real CIFAR-10 / IMDB with ``--data real``
  (:mod:`lightning_amp_plus.cli.train`).
* ``compare cnn|lstm``: the same model from the same seed under 32-true, Lightning's ``MixedPrecision`` and ours
  (:mod:`lightning_amp_plus.cli.compare`).
* ``doctor``: what this machine supports and how fast, and the recommended settings
  (:mod:`lightning_amp_plus.cli.doctor`).

Everything a request can get wrong is checked before any work starts, most of it before torch and Lightning are even
imported (so ``--help`` and a mistyped flag answer at once): :func:`main` prints one paragraph on stderr and exits with
code 2, never a traceback. Ctrl-C stops cleanly with what was measured so far (exit code 130), and so does a SIGTERM
during training (named as such, exit code 143); a run that stops with a diagnosis exits with code 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from lightning_amp_plus import __version__
from lightning_amp_plus._paths import check_data_dir, check_output_dir, check_output_file
from lightning_amp_plus.cli import _machine
from lightning_amp_plus.cli._argparse import Parser, plain_warnings
from lightning_amp_plus.cli._checks import (
    LR_MAX,
    SEED_MAX,
    RunFailed,
    Terminated,
    UsageError,
    check_ckpt_dir,
    float_in,
    int_in,
)
from lightning_amp_plus.cli._configs import COMPARE_DEFAULT, FP8, SETUPS
from lightning_amp_plus.cli._noise import without_lightning_noise
from lightning_amp_plus.cli._settings import (
    COMPENSATIONS,
    DEFAULT_TASK,
    FP8_RECIPES,
    PRECISIONS,
    SCALER_MAX_SCALE,
    SCALER_MIN_SCALE,
    SPIKE_ACTIONS,
    TASKS,
    AmpSettings,
    cli_amp_problem,
    fp8_install_problem,
    train_settings,
)
from lightning_amp_plus.cli._workers import die_with_launcher

__all__ = ["AmpSettings", "UsageError", "build_parser", "check_request", "console", "main"]

PROG = "amp-plus"
INTERRUPTED = 130
"""The exit code after Ctrl-C: 128 + SIGINT, as shells report it."""
TERMINATED = 143
"""The exit code after a SIGTERM that stopped a run cleanly: 128 + SIGTERM, as shells report it."""
_LR_WHY = ": the shipped models train at 1e-3 to 0.1, and far larger rates overflow the optimizer's float32 update"
_SCALE_WHY = ": the loss scaler keeps its scale between its min_scale 1 and max_scale 2**24"


# ---------------------------------------------------------------------------------------------------- parser
def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by train and compare: task, data, model size, device, seed."""
    parser.add_argument(
        "task",
        nargs="?",
        choices=TASKS,
        default=DEFAULT_TASK,
        metavar="model",  # what the help and the errors call it ("argument model: invalid choice: 'cnnn'")
        help="the model: cnn (CIFAR-10, the default) or lstm (IMDB)",
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
    data.add_argument("--batch-size", type=int_in(1), help="samples per batch (default 64)")
    data.add_argument("--num-train", type=int_in(1), help="synthetic training samples (default 2048)")
    data.add_argument("--num-val", type=int_in(1), help="synthetic validation samples (default 512)")
    data.add_argument("--num-workers", type=int_in(0), default=0, help="DataLoader workers (default 0)")
    model = parser.add_argument_group("model")
    model.add_argument(
        "--lr",
        type=float_in(0.0, LR_MAX, low_open=True, why=_LR_WHY),
        help="peak learning rate, in (0, 1000] (cnn: 0.05 SGD; lstm: 1e-2 AdamW)",
    )
    model.add_argument("--width", type=int_in(1), help="cnn: channels of the first convolution (default 16)")
    model.add_argument("--hidden-dim", type=int_in(1), help="lstm: hidden units per direction (default 64)")
    model.add_argument("--embed-dim", type=int_in(1), help="lstm: embedding size (default 32)")
    model.add_argument("--max-len", type=int_in(1), help="lstm: longest review in tokens (default 60)")
    model.add_argument(
        "--dropout", type=float_in(0.0, 1.0, high_open=True), help="dropout before the classifier, in [0, 1)"
    )
    run = parser.add_argument_group("device")
    run.add_argument(
        "--accelerator", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA if available, else CPU"
    )
    run.add_argument(
        "--threads",
        type=int_in(1),
        help="CPU threads for torch, at most the usable cores (shared among --devices processes; train's default: "
        "as many as cores are idle when it starts, said on its first line; compare's: torch's choice)",
    )
    run.add_argument(
        "--seed",
        type=int_in(0, SEED_MAX, why=" (seeds are 32-bit: numpy's generator takes no larger)"),
        default=0,
        help=f"seeds everything, 0 to {SEED_MAX} (default 0)",
    )


def _add_console_arguments(parser: argparse.ArgumentParser) -> None:
    console = parser.add_argument_group(
        "console output (default: shown in a terminal, hidden when the output goes to a file, a pipe or a CI log)"
    )
    toggle = argparse.BooleanOptionalAction
    console.add_argument("--progress-bar", action=toggle, help="Lightning's progress bar")
    console.add_argument(
        "--model-summary", action=toggle, help="Lightning's model summary (sizes and FLOPs measured on one sample)"
    )
    console.add_argument(
        "--lightning-info", action=toggle, help="Lightning's info lines: devices available, tips, why fit stopped"
    )


def _add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("comparison")
    group.add_argument(
        "--steps", type=int_in(1), help="optimizer steps per configuration (default 16 on CPU, 200 on CUDA)"
    )
    group.add_argument(
        "--warmup",
        type=int_in(0),
        help="first steps left out of the step time (default 3 on CPU, 20 on CUDA, fewer when --steps is smaller)",
    )
    group.add_argument(
        "--configs",
        nargs="+",
        choices=tuple(SETUPS),
        default=list(COMPARE_DEFAULT),
        metavar="CONFIG",
        help=f"which to run, in order (default: {', '.join(COMPARE_DEFAULT)}; also lightning-bf16-true, "
        "ours-bf16-true-kahan, ours-bf16-true-sr, and ours-fp8-mixed, which needs torchao)",
    )
    group.add_argument(
        "--in-process",
        action="store_true",
        help="CPU: run every configuration in this process (faster; the memory column is then a lower "
        "bound) instead of one process each",
    )
    group.add_argument("--csv", metavar="PATH", help="write the table as CSV (never over a file: see --png)")
    group.add_argument("--markdown", metavar="PATH", help="write the table and its footer as Markdown (see --png)")
    group.add_argument(
        "--png",
        metavar="PATH.png",
        help="write a chart of step time, memory, loss and accuracy (needs matplotlib); where a file has one of these "
        "names, each output goes to the next free one (cmp-1.png...): no file is overwritten",
    )


def build_parser() -> Parser:
    """The ``amp-plus`` argument parser with its three subcommands (pure Python: nothing heavy is imported).

    Its errors come first, on one paragraph, with "did you mean" for near misses (:class:`~._argparse.Parser`).

    Examples:
        >>> build_parser().parse_args(["train", "lstm", "--precision", "16-mixed"]).precision
        '16-mixed'
    """
    parser = Parser(
        prog=PROG,
        description="Mixed-precision training with lightning-amp-plus: train, compare, doctor.",
        epilog="Run `amp-plus <command> --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    train_parser = commands.add_parser(
        "train",
        help="train a shipped model (cnn or lstm) with MixedPrecisionPlugin and MixedPrecisionMonitor",
        description="Train CifarCNN (cnn) or ImdbLSTM (lstm) under MixedPrecisionPlugin with MixedPrecisionMonitor. "
        "With no flags: synthetic data generated offline, the precision `amp-plus doctor` recommends (bf16-mixed on "
        "a CPU with native bf16 and on GPUs that have it, fp16 on older GPUs, 32-true on other CPUs), 2 epochs; the "
        "run prints its time (measured ones: docs/benchmarks.md). Ctrl-C stops cleanly with the monitor's summary so "
        "far.",
    )
    _add_run_arguments(train_parser)
    amp = train_parser.add_argument_group("mixed precision")
    amp.add_argument(
        "--precision",
        choices=("auto", *PRECISIONS),
        default="auto",
        help="auto (default): what `amp-plus doctor` recommends here: bf16-mixed on GPUs with native bf16 and on "
        "CPUs with native bf16 arithmetic (avx512_bf16, amx_bf16), 16-mixed on older GPUs, 32-true on other CPUs "
        "(bf16 autocast is several times slower there; the first line says so); bf16-true: "
        "bf16 weights, compensated (--compensation); fp8-mixed: bf16-mixed with the eligible Linear layers in FP8 "
        "(torchao; CUDA sm89+, or CPU emulated; docs/fp8.md)",
    )
    amp.add_argument(
        "--master-weights", action="store_true", help="FP32 master weights (a mixed precision; see the docs)"
    )
    amp.add_argument(
        "--compensation",
        choices=COMPENSATIONS,
        help="bf16-true: how bf16 weights keep updates smaller than their spacing (default kahan; none: plain "
        "bf16-true, which loses them)",
    )
    amp.add_argument(
        "--init-scale",
        type=float_in(SCALER_MIN_SCALE, SCALER_MAX_SCALE, why=_SCALE_WHY),
        help="16-mixed: initial loss scale, 1 to 2**24 = 16777216 (default 2**16)",
    )
    amp.add_argument("--growth-interval", type=int_in(1), help="16-mixed: clean steps before the scale grows")
    amp.add_argument("--hysteresis", type=int_in(1), help="16-mixed: overflows before the scale backs off")
    amp.add_argument(
        "--max-consecutive-skips",
        type=int_in(0),
        help="skipped steps in a row that backing off could not help (16-mixed: at the scale's floor; bf16: every "
        "skip) that stop training with a diagnosis (default 50; 0 never). Skips while the loss scale comes down "
        "from its initial value do not count: a run may skip more steps than this in a row and go on",
    )
    amp.add_argument(
        "--spike-guard",
        choices=SPIKE_ACTIONS,
        help="skip or clip a step whose gradient norm is a spike: 25 standard deviations above the running mean of "
        "the steps taken, after 100 steps (SpikeGuard's defaults; docs/spike-guard.md); none by default",
    )
    fp8 = train_parser.add_argument_group("FP8 (--precision fp8-mixed)")
    fp8.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        help="torchao's scaling recipe (default tensorwise: one scale per tensor; rowwise: one per row; "
        "rowwise_with_gw_hp: rowwise, the weight gradient in bf16)",
    )
    fp8.add_argument(
        "--fp8-check-interval",
        type=int_in(1),
        metavar="N",
        help="read every FP8 cast's flushed share every N optimizer steps (default 50)",
    )
    fp8.add_argument(
        "--fp8-fallback",
        type=float_in(0.0, 100.0, high_open=True, why=": a percent of a cast's values (0: never fall back)"),
        metavar="PCT",
        help="a layer flushing more than PCT%% of a cast's values at two readings in a row goes back to bf16 "
        "(default 1.0; 0: never, only read and warn)",
    )
    loop = train_parser.add_argument_group("loop and outputs")
    loop.add_argument("--epochs", type=int_in(1), help="epochs (default 2)")
    loop.add_argument("--max-steps", type=int_in(1), default=-1, help="stop after this many optimizer steps")
    loop.add_argument(
        "--devices",
        type=int_in(1),
        default=1,
        help="devices to train on (default 1; on CPU, one process each, at most one per core and as many as memory "
        "holds; a process left behind dies with the command)",
    )
    loop.add_argument(
        "--report",
        metavar="PATH.png",
        help="write the monitor's chart here (a .png; needs matplotlib); where a file has that name, at the next free "
        "one (amp-1.png...): no file is overwritten",
    )
    loop.add_argument(
        "--headroom",
        type=int_in(0),
        default=0,
        metavar="N",
        help="the monitor reads per-layer headroom every N optimizer steps (default 0: never)",
    )
    loop.add_argument(
        "--ckpt-dir",
        help="save checkpoints here (the latest epoch's, and last.ckpt): an empty or new folder, or with --resume the "
        "folder of the run to continue; none by default",
    )
    loop.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in --ckpt-dir from its last.ckpt, up to the new --max-steps or --epochs. "
        "Restored from the checkpoint: the weights, the optimizer and LR scheduler, the step count and the plugin's "
        "state (loss scale, skip counters, compensation). Not restored: the flags (give that run's again: a different "
        "model, data or precision flag is refused, naming it; docs/resuming.md lists what may change) and the "
        "monitor's history (its summary and chart cover this run's steps)",
    )
    _add_console_arguments(train_parser)

    compare_parser = commands.add_parser(
        "compare",
        help="the same model under 32-true, Lightning's MixedPrecision and ours: speed, memory, accuracy",
        description="Train the same model from the same seed under each configuration and print one table. Defaults "
        "are short enough for a CPU; fp16 on CPU is slow (no fp16 arithmetic in common CPUs), so keep --steps small "
        "there. Ctrl-C stops cleanly with the table of the configurations that finished.",
    )
    _add_run_arguments(compare_parser)
    _add_compare_arguments(compare_parser)

    doctor_parser = commands.add_parser(
        "doctor", help="devices, supported dtypes, measured matmul speed, and the recommended plugin settings"
    )
    doctor_parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    doctor_parser.add_argument("--no-benchmark", action="store_true", help="skip the matmul benchmark")
    parser.commands = {"train": train_parser, "compare": compare_parser, "doctor": doctor_parser}
    return parser


# ------------------------------------------------------------------------------------------- checks up front
def check_request(args: argparse.Namespace) -> None:
    """Everything about ``args`` that can be checked without torch or Lightning, before any work starts.

    Raises:
        UsageError: with the message to print.

    Examples:
        >>> check_request(build_parser().parse_args(["train", "--report", "amp.txt"]))
        Traceback (most recent call last):
        ...
        lightning_amp_plus.cli._checks.UsageError: --report amp.txt: the chart is written as .png, so the path must end in .png, e.g. amp.png.
    """  # noqa: E501
    try:
        _check_request(args)
    except (ValueError, ImportError) as error:
        raise UsageError(str(error)) from None


def _check_request(args: argparse.Namespace) -> None:
    if args.command not in ("train", "compare"):
        return
    train_settings(args)
    if args.threads is not None:
        problem = _machine.threads_problem(args.threads, getattr(args, "devices", 1), _machine.usable_cores())
        if problem is not None:
            raise ValueError(problem)
    if args.data == "real":
        check_data_dir(args.data_dir, "--data-dir", download=not args.no_download)
    if args.command == "train":
        if args.precision != "auto":
            problem = cli_amp_problem(args, args.precision)
            if problem is not None:
                raise ValueError(problem)
        if args.precision == "fp8-mixed":
            missing = fp8_install_problem()
            if missing is not None:
                raise ValueError(missing)
        if args.report is not None:
            from lightning_amp_plus.monitor.chart import check_chart_path

            check_chart_path(args.report, "--report")
        if args.ckpt_dir is not None:
            check_output_dir(args.ckpt_dir, "--ckpt-dir")
        check_ckpt_dir(args.ckpt_dir, args.resume)
        return
    if FP8[0] in args.configs:
        missing = fp8_install_problem(f"--configs {FP8[0]}")
        if missing is not None:
            raise ValueError(missing)
    if args.steps is not None and args.warmup is not None and args.warmup >= args.steps:
        raise ValueError(
            f"--warmup {args.warmup} leaves none of --steps {args.steps} to time: use fewer warm-up steps or more "
            "steps."
        )
    outputs = {flag: getattr(args, flag) for flag in ("csv", "markdown", "png") if getattr(args, flag) is not None}
    if len(set(outputs.values())) < len(outputs):
        raise ValueError(f"{' and '.join('--' + flag for flag in outputs)} name the same file: give each its own.")
    if args.csv is not None:
        check_output_file(args.csv, "--csv")
    if args.markdown is not None:
        check_output_file(args.markdown, "--markdown")
    if args.png is not None:
        from lightning_amp_plus.monitor.chart import check_chart_path

        check_chart_path(args.png, "--png")


def _console_defaults(args: argparse.Namespace) -> None:
    """Lightning's console output where nobody reads it live is noise (and progress bars are kilobytes of escapes)."""
    terminal = sys.stdout.isatty()
    for name in ("progress_bar", "model_summary", "lightning_info"):
        if getattr(args, name, False) is None:
            setattr(args, name, terminal)


# ------------------------------------------------------------------------------------------------------ main
def _fail(command: str, message: str) -> NoReturn:
    print(f"{PROG} {command}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``amp-plus`` with ``argv`` (``sys.argv[1:]`` if ``None``) and return the exit code.

    0 on success; 2 (as ``SystemExit``) for a usage error, before any work; 130 after Ctrl-C; 143 after a SIGTERM
    that stopped a run (named as such, not as Ctrl-C); 1 when a run stopped with a diagnosis.

    Examples:
        >>> main(["doctor", "--no-benchmark", "--json"])  # doctest: +ELLIPSIS
        {...
        0
    """
    die_with_launcher()  # in a worker of `--devices N`: never outlive the command that started it
    parser = build_parser()
    args = parser.parse_command(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 0
    _console_defaults(args)
    try:
        check_request(args)
        run = _command(args.command)
        with plain_warnings(), without_lightning_noise():  # "warning: ..." sentences; none that is not the user's
            run(args)
    except UsageError as error:
        _fail(args.command, str(error))
    except KeyboardInterrupt as interrupt:
        detail = f" {interrupt}" if str(interrupt) else ""
        how = "terminated (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted (Ctrl-C)"
        print(f"{PROG} {args.command}: {how}{detail}", file=sys.stderr, flush=True)
        return TERMINATED if isinstance(interrupt, Terminated) else INTERRUPTED
    except (RunFailed, FloatingPointError) as error:
        print(f"{PROG} {args.command}: stopped: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


def console() -> int:
    """The ``amp-plus`` console script (and ``python -m lightning_amp_plus``): :func:`main` on ``sys.argv``.

    Ctrl-C (SIGINT) stops the command even when it was started with SIGINT ignored, as a shell starts a background job
    (``amp-plus train ... &``, ``nohup ... &``) and as it passes on to what it starts: Python keeps an ignored SIGINT
    ignored, and nothing, neither Ctrl-C nor ``kill -INT``, would stop the run cleanly. Once the command is done,
    Ctrl-C is ignored: the interpreter still takes a moment to exit (torch's and Lightning's exit handlers), and a
    Ctrl-C then would end a run that finished, its result printed, with SIGINT's exit status 130 (and a traceback from
    whatever exit handler it hit). Only here, not in :func:`main`, which a program may call: its signals are its own.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


def _command(name: str) -> Callable[[argparse.Namespace], object]:
    """The function that runs command ``name``, its module (and with it torch and Lightning) imported now.

    Imported here, not at the top: torch and Lightning take seconds to import, which --help should not wait for.
    Lightning sets its own warning format when imported: :func:`main` words warnings plainly only after this.
    """
    if name == "train":
        from lightning_amp_plus.cli import train as _train

        return _train.train
    if name == "compare":
        from lightning_amp_plus.cli import compare

        return compare.run
    import lightning  # noqa: F401  (the doctor reports its version; imported before the warning format is set)

    return _doctor


def _doctor(args: argparse.Namespace) -> None:
    from lightning_amp_plus.cli import doctor

    data = doctor.report_dict(doctor.collect(benchmark=not args.no_benchmark))
    print(json.dumps(data, indent=2) if args.json else doctor.format_report(data))
