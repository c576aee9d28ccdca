"""Where the fixed cost of the check without a norm goes: GradScaler's kernel alone, then what wraps it, piece by piece.

What is measured
    ``bench_grads.py`` finds the check that measures no norm (``StepEngine.unscale``, which runs
    ``GradientCheck.unscale``) a fixed 0.1-0.3 ms slower than a bare call of the kernel it runs,
    ``torch._amp_foreach_non_finite_check_and_unscale_``. This script times, on the same gradients (``bench_grads``'s
    60 equal tensors), each step from the bare call to the engine's check, each with the flag read on the host:

    * ``kernel``: the bare call, with a 0-d flag made once and zeroed before each call, and a 0-d inverse scale;
    * ``+ a new flag``: a fresh one-element flag per call (what the check does: nothing is kept between steps);
    * ``+ no_grad``: the same inside ``torch.no_grad()`` (as GradScaler's unscale runs);
    * ``+ inverse from the scale``: the inverse scale computed from the scale tensor at each call, in float64 and
      rounded once to float32, as GradScaler and the check compute it;
    * ``engine.gradients.unscale``: ``GradientCheck.unscale(opt, by_one=False)``, the check's pass itself (adds the
      optimizer's parameter and gradient lists, the grouping by device and dtype and the pass record), and the flag
      read;
    * ``engine.unscale(read=True)``: ``DynamicLossScaler.engine.unscale(opt, read=True)``, the whole check (adds the
      optimizer's slot and its stage) and its one host read (the flag, the scale and the hysteresis tracker at once).

How
    Before every timed call the gradients are restored from a saved copy and the scaler's step is ended (untimed), as
    in ``bench_grads.py``: each
    call starts after tens of MB went through the caches, as a check after backward does. The variants run in a new
    random order in every repetition; the median and the trimmed mean (the middle 80%) of each are reported, and
    each one's difference from the bare kernel. Nothing is asserted.

Run
    python benchmarks/bench_check_overhead.py --threads 1          # fp16, 22M gradients, about 20 s
    python benchmarks/bench_check_overhead.py --threads 1 --dtype fp32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from bench_grads import make_grad_set, shapes  # same directory

from lightning_amp_plus import DynamicLossScaler

_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
_SCALE = 256.0


def variants(
    gradient_set: object, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Callable[[], object]], Callable[[], None]]:
    """The timed calls, from the bare kernel to the engine's whole check, in that order; and the untimed reset."""
    grads: list[torch.Tensor] = list(gradient_set.grads)  # type: ignore[attr-defined]
    kernel = torch._amp_foreach_non_finite_check_and_unscale_
    flag, inverse = torch.zeros(()), torch.full((), 1.0 / _SCALE)
    scale = torch.full((1,), _SCALE)
    scaler = DynamicLossScaler(init_scale=_SCALE, growth_interval=10**9)
    scaler.scale(torch.zeros(()))

    def bare() -> object:
        flag.zero_()
        kernel(grads, flag, inverse)
        return flag.item()

    def new_flag() -> object:
        found = torch.zeros(1)
        kernel(grads, found, inverse)
        return found.item()

    @torch.no_grad()
    def no_grad() -> object:
        found = torch.zeros(1)
        kernel(grads, found, inverse)
        return found.item()

    @torch.no_grad()
    def inverse_from_scale() -> object:
        found = torch.zeros(1)
        kernel(grads, found, scale.double().reciprocal().float())
        return found.item()

    def gradient_check() -> object:
        return scaler.engine.gradients.unscale(optimizer, by_one=False).found.item()

    def engine_check() -> object:
        scaler.engine.unscale(optimizer, read=True)
        return None

    def reset() -> None:
        gradient_set.restore()  # type: ignore[attr-defined]
        scaler.update(new_scale=_SCALE)  # ends the step, so the next call checks again (as the next step would)

    calls: dict[str, Callable[[], object]] = {
        "kernel": bare,
        "+ a new flag": new_flag,
        "+ no_grad": no_grad,
        "+ inverse from the scale": inverse_from_scale,
        "engine.gradients.unscale": gradient_check,
        "engine.unscale(read=True)": engine_check,
    }
    return calls, reset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="fp16")
    parser.add_argument("--numel", type=int, default=22_000_000, help="total gradient elements")
    parser.add_argument("--reps", type=int, default=150, help="timed repetitions of each variant")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    gradient_set = make_grad_set(shapes(args.numel, 60, "uniform"), _DTYPES[args.dtype], torch.device("cpu"), _SCALE)
    calls, reset = variants(gradient_set, gradient_set.optimizer)
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    rng = random.Random(0)
    for _ in range(args.reps):
        rng.shuffle(order)
        for name in order:
            reset()
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)

    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, CPU, {threads} threads, {args.dtype} gradients, {args.reps} repetitions")
    print()
    print("| variant | median ms | trimmed mean ms | minus the bare kernel (median) |")
    print("|---|---:|---:|---:|")
    base = statistics.median(times["kernel"])
    for name, taken in times.items():
        ordered = sorted(taken)
        cut = len(ordered) // 10
        trimmed = statistics.mean(ordered[cut : len(ordered) - cut])
        median = statistics.median(ordered)
        print(f"| {name} | {median * 1e3:.3f} | {trimmed * 1e3:.3f} | {(median - base) * 1e3:+.3f} |")


if __name__ == "__main__":
    main()
