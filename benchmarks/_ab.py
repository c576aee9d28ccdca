"""Shared plumbing of the A/B step-time benchmarks (``bench_step.py``, ``bench_monitor.py``).

Quiet Lightning, run two sides of each comparison interleaved (A B, B A, ...) under a time budget so machine noise
hits both alike, and summarise a pair as medians and per-round ratios.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

_Key = TypeVar("_Key", bound=Hashable)


@dataclass
class Side:
    """One side of a comparison: its step times, and the median of each round."""

    label: str
    times: list[float] = field(default_factory=list)
    round_medians: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Ratio:
    """``a`` over ``b``: the ratio of the medians of all steps, and the median, min and max of per-round ratios."""

    a_ms: float
    b_ms: float
    of_medians: float
    per_round_median: float
    per_round_min: float
    per_round_max: float

    @classmethod
    def of(cls, a: Side, b: Side) -> Ratio:
        ma, mb = statistics.median(a.times), statistics.median(b.times)
        rounds = [x / y for x, y in zip(a.round_medians, b.round_medians, strict=True)]
        return cls(ma * 1e3, mb * 1e3, ma / mb, statistics.median(rounds), min(rounds), max(rounds))

    def per_round(self) -> str:
        return f"{self.per_round_median:.3f}x [{self.per_round_min:.3f}, {self.per_round_max:.3f}]"


def quiet(*messages: str) -> None:
    """Silence Lightning's info logs and the warnings every run would repeat (plus ``messages``, as regexes)."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in (".*does not have many workers.*", *messages):
        warnings.filterwarnings("ignore", message=message)
    warnings.filterwarnings("ignore", category=FutureWarning)


def load() -> float:
    """The 1-minute load average (other processes share the cores when it is above ~0.3 before a run)."""
    return os.getloadavg()[0]


def run_interleaved(
    pairs: dict[_Key, tuple[Side, Side]], run: Callable[[_Key, Side, int], list[float]], rounds: int, budget_s: float
) -> float:
    """Run every pair's two sides in alternating order for up to ``rounds`` rounds; return the seconds spent.

    ``run(key, side, round)`` returns one run's step times. No new round starts once ``budget_s`` is spent (at least
    two rounds always run, so each side goes first once).
    """
    started = time.perf_counter()
    for r in range(rounds):
        for key, (a, b) in pairs.items():
            for side in (a, b) if r % 2 == 0 else (b, a):
                times = run(key, side, r)
                side.times.extend(times)
                side.round_medians.append(statistics.median(times))
        elapsed = time.perf_counter() - started
        print(f"  round {r + 1}/{rounds} done ({elapsed:.0f} s, load average {load():.2f})", flush=True)
        if r >= 1 and r + 1 < rounds and elapsed > budget_s:
            print(f"  time budget of {budget_s:.0f} s spent: stopping after {r + 1} rounds", flush=True)
            break
    return time.perf_counter() - started


def verdict(ratio: float, target: float) -> str:
    """``met`` or ``NOT met`` against ``target`` (a ratio; lower is better)."""
    return f"{'met' if ratio <= target else 'NOT met'} (<= {target:.2f}x)"


_METAVARS = {"32-true": "FP32", "bf16-mixed": "BF16", "16-mixed": "FP16"}


@dataclass(frozen=True)
class Defaults:
    """A script's defaults: rounds, time budget (s) and warm-up steps, full and ``--quick``, and timed steps."""

    rounds: tuple[int, int]
    budget_s: tuple[float, float]
    warmup: tuple[int, int]
    steps: dict[str, tuple[int, int]]
    """precision -> (full, quick) timed steps per run."""


@dataclass(frozen=True)
class Plan:
    """What one run of a script does: at most ``rounds`` rounds within ``budget_s``, ``warmup`` + ``steps`` steps."""

    rounds: int
    budget_s: float
    warmup: int
    steps: dict[str, int]


def add_plan_arguments(parser: argparse.ArgumentParser, defaults: Defaults) -> None:
    """The arguments every A/B script takes: ``--quick``, ``--rounds``, ``--budget-s``, ``--warmup``, ``--steps``
    (one count per precision), ``--threads``, ``--seed``."""
    (rounds, quick_rounds), (budget, quick_budget) = defaults.rounds, defaults.budget_s
    full_steps = " ".join(str(full) for full, _ in defaults.steps.values())
    quick_steps = " ".join(str(quick) for _, quick in defaults.steps.values())
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (under a minute)")
    parser.add_argument(
        "--rounds", type=int, default=None, help=f"most interleaved rounds (default {rounds}, quick {quick_rounds})"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"no new round after this many s (default {budget:g}, quick {quick_budget:g})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"steps dropped at the start of each run (default {defaults.warmup[0]})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        nargs=len(defaults.steps),
        default=None,
        metavar=tuple(_METAVARS.get(name, name.upper()) for name in defaults.steps),
        help=f"timed steps per run for {', '.join(defaults.steps)} (default {full_steps}; quick {quick_steps})",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)


def plan(args: Any, defaults: Defaults) -> Plan:
    """The run's plan from the parsed arguments (their defaults, full or ``--quick``); sets the thread count."""
    import torch  # here: the rest of this module imports no torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pick = 1 if args.quick else 0
    steps = args.steps or [both[pick] for both in defaults.steps.values()]
    return Plan(
        rounds=args.rounds or defaults.rounds[pick],
        budget_s=args.budget_s if args.budget_s is not None else defaults.budget_s[pick],
        warmup=args.warmup if args.warmup is not None else defaults.warmup[pick],
        steps=dict(zip(defaults.steps, steps, strict=True)),
    )
