"""Benchmark the master-weight check: what refusing a half tensor in an FP32 master costs a Trainer step.

What is measured
    With ``master_weights=True`` the plugins look, before every optimizer step, for a parameter someone turned back
    into fp16/bf16 (``weights/master.py``, ``refuse_half_masters``): a dtype look-up per parameter the optimizer steps,
    on the host, no device work. The Trainer's plugin looks twice per step (before the closure, for writes made
    between steps, and after it, for writes made during the step); Fabric's once per ``optimizer.step()`` and once per
    ``fabric.clip_gradients``.

    1. The check alone: ``refuse_half_masters`` on an SGD optimizer over ``N`` FP32 parameters (N = 10, 100, 1000),
       timed with ``timeit`` (median of repeats): microseconds per call and nanoseconds per parameter.
    2. The whole Trainer step, side by side: ``MixedPrecisionPlugin("bf16-mixed", device="cpu", master_weights=True)``
       against the same plugin with ``master_weights=False`` on an FP32 torchvision ``mobilenet_v3_small`` (a quarter
       wide, 4 classes; 32x32 images, batch 8; AdamW), single device, where ``master_weights=True`` changes nothing
       but the check (nothing to widen, no DDP hook). Interleaved rounds (A B, B A, ...) as ``bench_step.py`` runs
       them; the step is timed from ``on_train_batch_start`` to ``on_train_batch_end``. The ratio of medians is noisy
       at the 1-2% level on a shared machine, far above the check's cost, so the expected ratio is also computed from
       part 1: 1 + 2 x (check time for this model's parameter count) / (median step time).

    Nothing is asserted.

Run
    python benchmarks/bench_master_check.py            # about 2 minutes on 2 CPU cores
    python benchmarks/bench_master_check.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchvision
from _ab import Defaults, Ratio, Side, add_plan_arguments, load, plan, quiet, run_interleaved  # same directory
from bench_step import timed_fit  # same directory
from torch import Tensor, nn

from lightning_amp_plus import MixedPrecisionPlugin
from lightning_amp_plus.weights.master import refuse_half_masters

_BATCH = 8


def check_time_us(n_params: int, repeats: int = 7, number: int = 2000) -> float:
    """Median microseconds of one ``refuse_half_masters`` call over ``n_params`` FP32 parameters (none half)."""
    params = [nn.Parameter(torch.zeros(4)) for _ in range(n_params)]
    optimizer = torch.optim.SGD(params, lr=0.1)
    times = timeit.repeat(lambda: refuse_half_masters("bench", optimizer, list), repeat=repeats, number=number)
    return statistics.median(times) / number * 1e6


class MobileNet(pl.LightningModule):
    """torchvision's mobilenet_v3_small, a quarter wide, 4 classes, cross-entropy, AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torchvision.models.mobilenet_v3_small(weights=None, num_classes=4, width_mult=0.25)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def run_once(master_weights: bool, steps: int, warmup: int, seed: int) -> list[float]:
    """One fresh Trainer.fit of ``warmup + steps`` steps; the timed step times in seconds."""
    pl.seed_everything(seed, verbose=False)
    model = MobileNet()
    plugin = MixedPrecisionPlugin("bf16-mixed", device="cpu", master_weights=master_weights)
    return timed_fit(model, 4, seed, warmup, steps, f"master_weights={master_weights}", plugins=[plugin])


DEFAULTS = Defaults(rounds=(8, 2), budget_s=(120.0, 30.0), warmup=(5, 3), steps={"bf16-mixed": (40, 10)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(parser, DEFAULTS)
    args = parser.parse_args()
    quiet()
    run_plan = plan(args, DEFAULTS)
    print(f"torch {torch.__version__}, lightning {pl.__version__}, CPU, {torch.get_num_threads()} threads")
    print(f"load average before the run: {load():.2f}")
    print()
    print("## 1. The check alone (refuse_half_masters, no half parameter found)")
    print()
    print("| parameters | us per call | ns per parameter |")
    print("|---:|---:|---:|")
    for n in (10, 100, 1000):
        us = check_time_us(n)
        print(f"| {n} | {us:.2f} | {us * 1e3 / n:.1f} |")

    n_params = len(list(MobileNet().parameters()))
    check_us = check_time_us(n_params)
    sides: dict[str, tuple[Side, Side]] = {"bf16-mixed": (Side("master_weights=True"), Side("master_weights=False"))}

    def run(precision: str, side: Side, r: int) -> list[float]:
        return run_once(side.label.endswith("True"), run_plan.steps[precision], run_plan.warmup, args.seed + r)

    print()
    print(f"## 2. The Trainer step, mobilenet_v3_small ({n_params} parameters), batch {_BATCH}, bf16-mixed")
    print()
    spent = run_interleaved(sides, run, run_plan.rounds, run_plan.budget_s)
    with_check, without = sides["bf16-mixed"]
    ratio = Ratio.of(with_check, without)
    expected = 1 + 2 * check_us * 1e-3 / ratio.b_ms
    print()
    print("| check | master_weights=True ms | master_weights=False ms | ratio of medians | per-round ratios "
          "| expected from part 1 |")  # fmt: skip
    print("|---|---:|---:|---:|---|---:|")
    print(
        f"| 2 x {check_us:.2f} us per step | {ratio.a_ms:.2f} | {ratio.b_ms:.2f} | {ratio.of_medians:.3f}x "
        f"| {ratio.per_round()} | {expected:.5f}x |"
    )
    print(f"\ntotal {spent:.0f} s, {len(with_check.times)} steps timed each, load average after: {load():.2f}")


if __name__ == "__main__":
    main()
