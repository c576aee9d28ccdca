"""Benchmark ``amp-plus train cnn``'s CPU thread count: one thread, one per core, and the default (the idle cores).

What is measured
    The time ``amp-plus train cnn`` (the shipped CNN on synthetic data, bf16-mixed, 2 epochs of 32 steps) reports for
    its training and validation ("in X s"), and the command's wall time, each run a fresh process, for:

    * ``--threads 1``;
    * ``--threads N``, N the usable cores (torch's own default on this machine);
    * no ``--threads``: the default, as many threads as cores were idle when the run started (its first line says
      how many it took, recorded here).

    under two conditions:

    * ``as found``: the machine as it is (other work on it included; the idle cores are printed);
    * ``one core busy``: this script keeps one core busy with a spinning process during the runs, as another user's
      job on a shared machine does.

How
    The variants run interleaved over ``--rounds`` rounds (the order rotates each round), each condition in turn, so
    that drifting machine load touches every variant alike. Reported per condition and variant: the median of the
    reported time and of the wall time over the rounds, and the ratio of medians against ``--threads 1``. Nothing is
    asserted.

Run
    python benchmarks/bench_threads.py              # 3 rounds: about 3-6 minutes on 2 CPU cores
    python benchmarks/bench_threads.py --rounds 1   # a smoke test
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMED = re.compile(r" in ([\d.]+) s \(")
CHOSEN = re.compile(r", (\d+) threads? \(")


def spin() -> None:
    """Keep one core busy until killed."""
    while True:
        pass


def run_once(threads: int | None) -> tuple[float, float, str]:
    """One ``amp-plus train cnn``: its reported seconds, its wall seconds, and the threads its first line names."""
    argv = [sys.executable, "-m", "lightning_amp_plus", "train", "cnn"]
    if threads is not None:
        argv += ["--threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, check=True)
    wall = time.perf_counter() - start
    timed = TIMED.search(done.stdout)
    chosen = CHOSEN.search(done.stdout.splitlines()[0])
    assert timed is not None, done.stdout
    return float(timed.group(1)), wall, chosen.group(1) if chosen else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    variants: dict[str, int | None] = {"--threads 1": 1, f"--threads {cores}": cores, "default": None}
    print(f"amp-plus train cnn, {args.rounds} rounds, {cores} usable cores, load average {os.getloadavg()}")
    for condition in ("as found", "one core busy"):
        spinner = multiprocessing.Process(target=spin, daemon=True) if condition == "one core busy" else None
        if spinner is not None:
            spinner.start()
        times: dict[str, list[tuple[float, float, str]]] = {name: [] for name in variants}
        try:
            names = list(variants)
            for round_index in range(args.rounds):
                order = names[round_index % len(names) :] + names[: round_index % len(names)]
                for name in order:
                    times[name].append(run_once(variants[name]))
        finally:
            if spinner is not None:
                spinner.kill()
        base = statistics.median(t[0] for t in times["--threads 1"])
        print(f"\n{condition}:")
        print(f"  {'variant':14} {'train+val s':>12} {'wall s':>8} {'vs 1 thread':>12}  threads taken")
        for name, runs in times.items():
            timed = statistics.median(t[0] for t in runs)
            wall = statistics.median(t[1] for t in runs)
            taken = ", ".join(t[2] for t in runs)
            print(f"  {name:14} {timed:12.1f} {wall:8.1f} {timed / base:11.2f}x  {taken}")


if __name__ == "__main__":
    main()
