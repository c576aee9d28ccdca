"""Benchmark a Lightning training step: our ``MixedPrecisionPlugin`` against Lightning's built-in ``MixedPrecision``.

What is measured
    The steady-state time of one training step (forward under autocast, backward, the plugin's unscale / check /
    optimizer step / scale update) of a small CNN, conv(3->16)-ReLU-pool-conv(16->32)-ReLU-pool-linear(->10), on random
    32x32 RGB images in batches of 32, with SGD (momentum 0.9), on CPU:

    * ``16-mixed``: ``MixedPrecisionPlugin("16-mixed", device="cpu")`` (ours, ``DynamicLossScaler``) against
      ``lightning.pytorch.plugins.precision.MixedPrecision("16-mixed", "cpu")`` (Lightning's, ``torch.amp.GradScaler``);
      given as plugin objects, both really run fp16 autocast on CPU (the *string* ``precision="16-mixed"`` would turn
      into bf16 there).
    * ``bf16-mixed``: the same pair at bf16 (ours still checks gradients for inf/NaN and may skip the step; Lightning's
      does nothing there).
    * ``32-true``: for context, the same ``Trainer(precision="32-true")`` twice (labelled A and B): their ratio shows
      how much two identical configurations differ on this machine, i.e. the noise floor of the other ratios.

How
    Each configuration runs in a fresh ``Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
    enable_model_summary=False, enable_checkpointing=False, max_steps=N)`` with the same seed (same initial weights,
    same data). A callback records ``time.perf_counter()`` in ``on_train_batch_start`` and ``on_train_batch_end``
    (which fires after the optimizer step), so data loading and Trainer start-up are not timed; the first
    ``--warmup`` steps of every run are dropped. The two configurations of a precision are interleaved over
    ``--rounds`` rounds (A B, B A, A B, ...) so machine noise affects both equally; no new round starts once
    ``--budget-s`` seconds have passed (at least two rounds run), which keeps the run short on a busy machine, where
    steps can be many times slower (two OpenMP threads on two shared cores stall; try ``--threads 1`` there).
    Reported per precision: the median
    step time of each, the ratio of medians ours/Lightning, and the median and range of the per-round ratios; and the
    median of each step's tail, from ``on_after_backward`` to ``on_train_batch_end`` (the check, the clip, the
    optimizer step: where the plugins differ, forward and backward being the same code), and the difference of the
    two sides' tails as a share of Lightning's whole step, a steadier figure than the ratio of whole steps.
    Mixed precision on CPU is slow (bf16 and fp16 autocast both about 6-7x fp32 for this CNN on a 2-core EPYC, up
    to 14x for fp16 elsewhere), so the mixed runs take fewer steps. Nothing is asserted.

    Target (reported): ours/Lightning <= 1.02x at each mixed precision.

    With ``--spike-guard``, each mixed precision compares ours with a ``SpikeGuard()`` (A) against ours without (B):
    what the guard costs a step (the global norm, which the check measures only for a guard or a reader, read with the
    flag; the guard's verdict and its statistics). Target (reported): <= 1.01x.

    With ``--check-off``, bf16's "ours" is built with ``skip_nonfinite=False`` (no check, no norm, nothing skipped):
    against Lightning, what the rest of our step costs; beside the plain run, what the check costs.

Run
    python benchmarks/bench_step.py            # about 3-4 minutes on 2 CPU cores (capped by --budget-s)
    python benchmarks/bench_step.py --quick    # under a minute: a smoke test
    python benchmarks/bench_step.py --threads 1   # steadier on a machine shared with other processes
    python benchmarks/bench_step.py --spike-guard --precisions bf16-mixed 16-mixed --threads 1
    python benchmarks/bench_step.py --check-off --precisions 32-true bf16-mixed --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _ab import Defaults, Ratio, Side, add_plan_arguments, load, plan, quiet, run_interleaved, verdict  # same directory
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import MixedPrecisionPlugin, SpikeGuard

_TARGET = 1.02
_GUARD_TARGET = 1.01
_BATCH = 32
_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


class SmallCNN(pl.LightningModule):
    """conv(3->16)-ReLU-pool-conv(16->32)-ReLU-pool-linear(->10), cross-entropy, SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepTimer(pl.Callback):
    """Records the wall time of every training step, from batch start to batch end (after the optimizer step), and of
    its tail, from the end of backward (``on_after_backward``) to batch end: the check, the clip and the step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tails: list[float] = []
        self._start = 0.0
        self._backward_end = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._start = time.perf_counter()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._backward_end = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        now = time.perf_counter()
        self.times.append(now - self._start)
        self.tails.append(now - self._backward_end)


@dataclass
class Config(Side):
    """One side of a comparison: a label and how to build the Trainer's precision arguments."""

    trainer_kwargs: Callable[[], dict[str, Any]] = dict
    tails: list[float] = field(default_factory=list)
    """Each timed step's tail (:class:`StepTimer`), seconds."""


def _pairs(precisions: list[str], guard: bool = False, check_off: bool = False) -> dict[str, tuple[Config, Config]]:
    """For each precision, (ours, Lightning's), or with ``guard`` (ours with a spike guard, ours); for 32-true, the same
    configuration twice (A, B). With ``check_off``, bf16's "ours" is built with ``skip_nonfinite=False``."""
    table: dict[str, tuple[Config, Config]] = {}
    for precision in precisions:
        if check_off and precision == "bf16-mixed":
            table[precision] = (
                Config(
                    "ours bf16-mixed, no check",
                    trainer_kwargs=lambda: {
                        "plugins": [MixedPrecisionPlugin("bf16-mixed", device="cpu", skip_nonfinite=False)]
                    },
                ),
                Config(
                    "Lightning bf16-mixed", trainer_kwargs=lambda: {"plugins": [MixedPrecision("bf16-mixed", "cpu")]}
                ),
            )
        elif guard and precision != "32-true":
            table[precision] = (
                Config(
                    f"ours {precision} + guard",
                    trainer_kwargs=lambda p=precision: {
                        "plugins": [MixedPrecisionPlugin(p, device="cpu", spike_guard=SpikeGuard())]
                    },
                ),
                Config(f"ours {precision}", trainer_kwargs=lambda p=precision: {"plugins": [MixedPrecisionPlugin(p)]}),
            )
        elif precision == "32-true":
            table[precision] = (
                Config("32-true A", trainer_kwargs=lambda: {"precision": "32-true"}),
                Config("32-true B", trainer_kwargs=lambda: {"precision": "32-true"}),
            )
        else:
            table[precision] = (
                Config(
                    f"ours {precision}",
                    trainer_kwargs=lambda p=precision: {"plugins": [MixedPrecisionPlugin(p, device="cpu")]},
                ),
                Config(
                    f"Lightning {precision}", trainer_kwargs=lambda p=precision: {"plugins": [MixedPrecision(p, "cpu")]}
                ),
            )
    return table


def random_images(count: int, classes: int, seed: int) -> TensorDataset:
    """``count`` random 32x32 RGB images with random labels among ``classes``, the same for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(count, 3, 32, 32, generator=gen), torch.randint(0, classes, (count,), generator=gen)
    )


def timed_fit(
    model: pl.LightningModule,
    classes: int,
    seed: int,
    warmup: int,
    steps: int,
    label: str,
    tails: list[float] | None = None,
    **trainer_kwargs: Any,
) -> list[float]:
    """One fresh quiet CPU ``Trainer.fit`` of ``warmup + steps`` steps on :func:`random_images` in batches of
    ``_BATCH``; the timed (post-warm-up) step times in seconds (and their tails appended to ``tails``, if given)."""
    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_steps=warmup + steps,
        callbacks=[timer],
        **trainer_kwargs,
    )
    data = random_images((warmup + steps) * _BATCH, classes, seed)
    trainer.fit(model, DataLoader(data, batch_size=_BATCH, shuffle=False))
    if len(timer.times) != warmup + steps:
        raise RuntimeError(f"{label}: expected {warmup + steps} steps, timed {len(timer.times)}")
    if tails is not None:
        tails.extend(timer.tails[warmup:])
    return timer.times[warmup:]


def run_once(config: Config, steps: int, warmup: int, seed: int) -> list[float]:
    """One fresh Trainer.fit of ``warmup + steps`` steps; returns the timed (post-warm-up) step times in seconds."""
    pl.seed_everything(seed, verbose=False)
    return timed_fit(SmallCNN(), 10, seed, warmup, steps, config.label, config.tails, **config.trainer_kwargs())


DEFAULTS = Defaults(
    rounds=(8, 2), budget_s=(240.0, 45.0), warmup=(5, 3),
    steps={"32-true": (100, 20), "bf16-mixed": (30, 8), "16-mixed": (30, 8)},
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=list(_PRECISIONS), choices=_PRECISIONS)
    parser.add_argument(
        "--spike-guard", action="store_true", help="ours with a SpikeGuard() against ours without, at each precision"
    )
    parser.add_argument(
        "--check-off",
        action="store_true",
        help="at bf16-mixed, ours with skip_nonfinite=False (no check, no norm) against Lightning",
    )
    add_plan_arguments(parser, DEFAULTS)
    args = parser.parse_args()
    if args.check_off and args.spike_guard:
        parser.error("--check-off and --spike-guard: choose one (a guard needs the check)")

    quiet(".*fp16 autocast is correct there but slow.*")
    run_plan = plan(args, DEFAULTS)
    rounds, budget, warmup, steps = run_plan.rounds, run_plan.budget_s, run_plan.warmup, run_plan.steps
    pairs = _pairs(args.precisions, args.spike_guard, args.check_off)
    target_ratio = _GUARD_TARGET if args.spike_guard else _TARGET
    a_name, b_name = ("ours + guard", "ours") if args.spike_guard else ("ours", "Lightning")

    print(f"torch {torch.__version__}, lightning {pl.__version__}, CPU, {torch.get_num_threads()} threads")
    print(f"load average before the run: {load():.2f} (other processes share these cores if > ~0.3)")
    print(
        f"small CNN, batch {_BATCH}, up to {rounds} interleaved rounds ({budget:.0f} s budget), {warmup} warm-up "
        "steps dropped per run, timed steps "
        f"per run: " + ", ".join(f"{p} {steps[p]}" for p in args.precisions)
    )

    def run(precision: str, side: Side, r: int) -> list[float]:
        assert isinstance(side, Config)
        return run_once(side, steps[precision], warmup, args.seed + r)

    spent = run_interleaved(pairs, run, rounds, budget)  # type: ignore[arg-type]

    print()
    print(f"## Training step time (median ms per step over all timed steps; ratios {a_name}/{b_name})")
    print()
    print(
        f"| precision | {a_name} (A) ms | {b_name} (B) ms | ratio of medians | per-round ratios: median [min, max] "
        "| steps timed each | target |"
    )
    print("|---|---:|---:|---:|---|---:|---|")
    for precision, (a, b) in pairs.items():
        ratio = Ratio.of(a, b)
        target = "n/a (A/A noise floor)" if precision == "32-true" else verdict(ratio.of_medians, target_ratio)
        print(
            f"| {precision} | {ratio.a_ms:.2f} | {ratio.b_ms:.2f} | {ratio.of_medians:.3f}x | {ratio.per_round()} "
            f"| {len(a.times)} | {target} |"
        )
    print()
    print("32-true: the same configuration twice (A, B); its ratio is the noise floor of this machine.")
    print()
    print(f"## The step's tail: from the end of backward to the end of the batch (median µs; {a_name} - {b_name})")
    print()
    print(f"| precision | {a_name} (A) µs | {b_name} (B) µs | A - B µs | (A - B) / B's whole step |")
    print("|---|---:|---:|---:|---:|")
    for precision, (a, b) in pairs.items():
        assert isinstance(a, Config) and isinstance(b, Config)
        tail_a, tail_b = statistics.median(a.tails) * 1e6, statistics.median(b.tails) * 1e6
        added = (tail_a - tail_b) / (statistics.median(b.times) * 1e6)
        print(f"| {precision} | {tail_a:.0f} | {tail_b:.0f} | {tail_a - tail_b:+.0f} | {added:+.2%} |")
    print()
    print(
        "Forward and backward run the same code under both plugins; the tail is where they differ (the check, the "
        "clip, the step), and its median is steadier than the whole step's. 32-true: its noise."
    )
    print(f"total {spent:.0f} s, load average after: {load():.2f}")


if __name__ == "__main__":
    main()
