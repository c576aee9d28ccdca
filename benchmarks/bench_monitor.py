"""Benchmark the step-time overhead of ``MixedPrecisionMonitor`` at its default settings.

What is measured
    The steady-state time of one training step of the small CNN of ``bench_step.py``
    (conv(3->16)-ReLU-pool-conv(16->32)-ReLU-pool-linear(->10), random 32x32 RGB images, batch 32, SGD with momentum)
    on CPU, with ``MixedPrecisionMonitor()`` (defaults: parameters checked every step, gradients too where nothing else
    checks them, memory logged, loss scale on the progress bar) against the same training without it, for:

    * ``32-true``: ``Trainer(precision="32-true")``. The monitor checks the gradients (unguarded there) and the
      parameters every step, and logs skipped steps and process memory.
    * ``bf16-mixed``: ``MixedPrecisionPlugin("bf16-mixed", device="cpu")``. The plugin checks the gradients; the
      monitor checks the parameters and logs skipped steps, the gradient norm and memory (the plugin's check measures
      that norm, a second pass over the gradients, only because the monitor asks for it: ``engine.read_norms()``).

    each with three loggers:

    * ``csv-default``: a ``CSVLogger`` with the Trainer's default ``log_every_n_steps`` (50): the default settings.

    * ``csv``: a ``CSVLogger`` in a temporary directory with ``log_every_n_steps=1``, so every metric the monitor
      logs is really handed to a logger and written (the cost of logging is part of the overhead).
    * ``none``: ``logger=False`` (``self.log`` still runs; nothing is written).

How
    Each configuration runs in a fresh ``Trainer(accelerator="cpu", devices=1, enable_progress_bar=False,
    enable_model_summary=False, enable_checkpointing=False)`` with the same seed (same weights, same data). A timing
    callback placed first records ``time.perf_counter()`` at every ``on_train_batch_start``; a step's time is the
    interval to the next batch's start, so it covers everything the monitor adds: its hooks before and after the
    optimizer step, and Lightning's handing of the logged metrics to the logger, which runs after the
    ``on_train_batch_end`` hooks. The first ``--warmup`` steps of every run are dropped. With and without the monitor
    are interleaved over rounds (A B, B A, ...) so that machine noise affects both alike; no new round starts once
    ``--budget-s`` seconds have passed (at least two rounds run). Reported per configuration: the median step time of
    each, their difference (what the monitor adds per step, a cost that does not grow with the model), the ratio of
    medians with/without, and the median and range of the per-round ratios. Nothing is asserted.

    Target (reported): with/without <= 1.05x.

Run
    python benchmarks/bench_monitor.py            # about 3-4 minutes on 2 CPU cores (capped by --budget-s)
    python benchmarks/bench_monitor.py --quick    # under a minute: a smoke test
    python benchmarks/bench_monitor.py --threads 1   # steadier on a machine shared with other processes
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from _ab import Defaults, Ratio, Side, add_plan_arguments, load, plan, quiet, run_interleaved, verdict  # same directory
from bench_step import SmallCNN, random_images  # same directory: the CNN and data of the step benchmark
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_amp_plus import MixedPrecisionMonitor, MixedPrecisionPlugin

_TARGET = 1.05
_BATCH = 32
_PRECISIONS = ("32-true", "bf16-mixed")
_LOGGERS = ("csv-default", "csv", "none")


class BatchStartClock(pl.Callback):
    """Records ``time.perf_counter()`` at every batch start; placed first, so it runs before any other callback."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.starts.append(time.perf_counter())


@dataclass
class Monitored(Side):
    """One side of a comparison: with or without the monitor."""

    monitored: bool = False


def run_once(precision: str, logger: str, monitored: bool, steps: int, warmup: int, seed: int) -> list[float]:
    """One fresh ``Trainer.fit``; returns the times of the steps after the warm-up, in seconds."""
    pl.seed_everything(seed, verbose=False)
    model = SmallCNN()
    batches = warmup + steps + 1  # the last batch only closes the interval of the one before
    data = random_images(batches * _BATCH, 10, seed)
    clock = BatchStartClock()
    callbacks: list[pl.Callback] = [clock]
    if monitored:
        callbacks.append(MixedPrecisionMonitor())
    kwargs: dict[str, Any] = {"precision": "32-true"}
    if precision == "bf16-mixed":
        kwargs = {"plugins": [MixedPrecisionPlugin("bf16-mixed", device="cpu")]}
    with tempfile.TemporaryDirectory() as log_dir:
        if logger == "csv":
            kwargs.update(logger=CSVLogger(log_dir), log_every_n_steps=1)
        elif logger == "csv-default":
            kwargs.update(logger=CSVLogger(log_dir))
        else:
            kwargs.update(logger=False)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            max_steps=batches,
            callbacks=callbacks,
            **kwargs,
        )
        with contextlib.redirect_stdout(io.StringIO()):  # the monitor's end-of-fit summary
            trainer.fit(model, DataLoader(data, batch_size=_BATCH, shuffle=False))
    if len(clock.starts) != batches:
        raise RuntimeError(f"{precision}/{logger}: expected {batches} batches, clocked {len(clock.starts)}")
    intervals = [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)]
    return intervals[warmup:]


DEFAULTS = Defaults(
    rounds=(8, 2), budget_s=(200.0, 40.0), warmup=(5, 3), steps={"32-true": (80, 15), "bf16-mixed": (20, 5)}
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=list(_PRECISIONS), choices=_PRECISIONS)
    parser.add_argument("--loggers", nargs="+", default=list(_LOGGERS), choices=_LOGGERS)
    add_plan_arguments(parser, DEFAULTS)
    args = parser.parse_args()

    quiet(".*smaller than the logging interval.*")
    run_plan = plan(args, DEFAULTS)
    rounds, budget, warmup, steps = run_plan.rounds, run_plan.budget_s, run_plan.warmup, run_plan.steps
    pairs = {
        (precision, logger): (Monitored("without", monitored=False), Monitored("with", monitored=True))
        for precision in args.precisions
        for logger in args.loggers
    }

    print(f"torch {torch.__version__}, lightning {pl.__version__}, CPU, {torch.get_num_threads()} threads")
    print(f"load average before the run: {load():.2f} (other processes share these cores if > ~0.3)")
    print(
        f"small CNN, batch {_BATCH}, up to {rounds} interleaved rounds ({budget:.0f} s budget), {warmup} warm-up "
        "steps dropped per run, timed steps per run: " + ", ".join(f"{p} {steps[p]}" for p in args.precisions)
    )

    def run(key: tuple[str, str], side: Side, r: int) -> list[float]:
        assert isinstance(side, Monitored)
        precision, logger = key
        return run_once(precision, logger, side.monitored, steps[precision], warmup, args.seed + r)

    spent = run_interleaved(pairs, run, rounds, budget)  # type: ignore[arg-type]

    print()
    print("## Step time with MixedPrecisionMonitor() vs without (median ms per step; ratios with/without)")
    print()
    print(
        "| precision | logger | without ms | with ms | added ms | ratio of medians "
        "| per-round ratios: median [min, max] | steps timed each | target |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|---|")
    for (precision, logger), (without, with_) in pairs.items():
        ratio = Ratio.of(with_, without)
        label = {"csv": "CSVLogger, every step", "csv-default": "CSVLogger, default (every 50 steps)"}.get(
            logger, "none"
        )
        print(
            f"| {precision} | {label} | {ratio.b_ms:.2f} | {ratio.a_ms:.2f} | {ratio.a_ms - ratio.b_ms:+.2f} "
            f"| {ratio.of_medians:.3f}x | {ratio.per_round()} | {len(with_.times)} "
            f"| {verdict(ratio.of_medians, _TARGET)} |"
        )
    print()
    print(f"total {spent:.0f} s, load average after: {load():.2f}")


if __name__ == "__main__":
    main()
