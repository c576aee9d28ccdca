"""Benchmark DDP on CPU (2 processes, gloo): our ``MixedPrecisionPlugin`` against Lightning's ``MixedPrecision``.

What is measured
    * Step time: the steady-state time of one training step of the small CNN of ``bench_step.py``
      (conv(3->16)-ReLU-pool-conv(16->32)-ReLU-pool-linear(->10), random 32x32 RGB images, batch 32 per rank, SGD with
      momentum) under ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``: forward under autocast, backward with
      DDP's gradient all-reduce, the plugin's unscale / check (and, for ours, the all-reduce of the overflow flag) /
      optimizer step. Compared at ``bf16-mixed`` (with ``--fp16`` also at ``16-mixed``; fp16 autocast is slow on CPU):

      * ``ours``: ``MixedPrecisionPlugin(p, device="cpu")`` against ``MixedPrecision(p, "cpu")`` (Lightning's);
      * ``ours + master weights``: ``MixedPrecisionPlugin(p, device="cpu", master_weights=True)`` against the same
        Lightning run. Under DDP the model stays FP32 and the plugin registers DDP's half-precision compression hook,
        so the gradients travel in the half dtype: this ratio says what that costs or saves on this CPU.

    * The check's collective alone: the one-element MAX all-reduce each rank makes per step so that all take the same
      skip decision (``lightning_amp_plus.step.sharding.max_across_ranks``), timed over ``--collective-calls`` calls
      per round in the same two processes after the fits, beside a bare one-element ``all_reduce``; reported per call
      and as a share of the step-time difference ours - Lightning's. With ``--without-collective``, a fourth
      configuration runs ours with the check's collective left out (each rank decides from its own gradients: not a
      configuration the package offers, since a fault on one rank would then skip that rank alone), so that the step
      time says what the collective costs inside a step, where it is a second point at which the ranks wait for each
      other.

    * Bytes all-reduced per optimizer step: a DDP communication hook adds up the bytes of every gradient bucket (then
      all-reduces it as DDP does by default), in a separate short run per configuration: the hook is not installed
      in the timed runs, where a Python hook would add its own cost to every bucket. Lightning only registers
      ``DDPStrategy(ddp_comm_hook=...)`` on CUDA, so the hook is registered on the DDP module at ``on_train_start``.
      With master weights the plugin's own hook holds DDP's one hook slot: there the half-precision tensors it hands
      to ``torch.distributed.all_reduce`` are counted instead.

How
    Two processes are started torchrun-style (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``MASTER_*`` set, so
    Lightning's ``strategy="ddp"`` runs in them instead of launching its own) and run the same sequence of fresh
    ``Trainer(..., logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    max_steps=N)`` fits with the same seed (same weights, same data). Rank 0 times each step from
    ``on_train_batch_start`` to ``on_train_batch_end`` (after the optimizer step; DDP's all-reduce makes it wait for
    the other rank, so this is the step time of the pair); the first ``--warmup`` steps of every run are dropped. The
    configurations of a precision are interleaved over ``--rounds`` rounds (Lightning, ours, ours+mw, then reversed,
    ...) so machine noise affects all alike; rank 0 decides when ``--budget-s`` is spent (at least two rounds run)
    and tells rank 1, so both always run the same fits. Reported: median step times, the ratio of medians
    ours/Lightning and the median and range of the per-round ratios; bytes per step and their ratio. Nothing is
    asserted.

    Targets (reported): step time ours/Lightning <= 1.05x; bytes per step with master weights / without = 0.5x.

Run
    python benchmarks/bench_ddp.py            # about 2-3 minutes on 2 CPU cores (capped by --budget-s)
    python benchmarks/bench_ddp.py --quick    # about a minute: a smoke test
    python benchmarks/bench_ddp.py --fp16     # also 16-mixed (slow on CPU)
    python benchmarks/bench_ddp.py --without-collective   # also ours without the check's collective (measurement)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _ab import Ratio, Side, load, quiet, verdict  # same directory
from bench_step import SmallCNN, StepTimer  # same directory: the CNN of the step benchmark
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import MixedPrecisionPlugin
from lightning_amp_plus.step.sharding import max_across_ranks

_WORLD = 2
_BATCH = 32
_TIME_TARGET = 1.05
_BYTES_TARGET = 0.5
_BYTES_STEPS = 3


@dataclass
class Config(Side):
    """One configuration: a label, how to build its precision plugin, and the bytes it all-reduced per step."""

    plugin: Callable[[], Precision] = Precision
    bytes_per_step: float = 0.0
    bucket_dtypes: set[str] = field(default_factory=set)


class OursWithoutCollective(MixedPrecisionPlugin):
    """Ours with the ranks never set: each rank decides from its own gradients (for measurement only)."""

    def _learn_ranks(self, params: list[Tensor], names: list[tuple[str, Tensor]], wrapper: object = None) -> None:
        self._ranks_known = True
        self.engine.name_parameters(names)


def _configs(precision: str, without_collective: bool = False) -> list[Config]:
    """Lightning's, ours, ours with master weights, at ``precision`` (and ours without the check's collective)."""
    extra = [
        Config(
            f"ours {precision} without the check's collective",
            plugin=lambda: OursWithoutCollective(precision, device="cpu"),  # type: ignore[arg-type]
        )
    ]
    return [
        Config(f"Lightning {precision}", plugin=lambda: MixedPrecision(precision, "cpu")),  # type: ignore[arg-type]
        Config(f"ours {precision}", plugin=lambda: MixedPrecisionPlugin(precision, device="cpu")),  # type: ignore[arg-type]
        Config(
            f"ours {precision} + master weights",
            plugin=lambda: MixedPrecisionPlugin(precision, device="cpu", master_weights=True),  # type: ignore[arg-type]
        ),
        *(extra if without_collective else []),
    ]


def _counting_allreduce(buckets: list[tuple[str, int]], bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """A DDP communication hook: note the bucket's dtype and bytes, then all-reduce it as DDP does by default."""
    buffer = bucket.buffer()
    buckets.append((str(buffer.dtype), buffer.numel() * buffer.element_size()))
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default process group


# DDP compares a hook's annotations with the real objects; `from __future__ import annotations` made them strings.
_counting_allreduce.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]})


class BucketCounter(pl.Callback):
    """Registers the counting hook on the DDP module before the first backward (or counts the plugin's all-reduces)."""

    def __init__(self) -> None:
        self.buckets: list[tuple[str, int]] = []
        self._all_reduce = dist.all_reduce

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(trainer.strategy.model, DistributedDataParallel)
        settings = getattr(trainer.precision_plugin, "settings", None)  # ours; Lightning's plugin has none
        if settings is not None and settings.master_weights:
            dist.all_reduce = self._counting  # type: ignore[assignment]
        else:
            trainer.strategy.model.register_comm_hook(self.buckets, _counting_allreduce)

    def _counting(self, tensor: Tensor, *args: object, **kwargs: object) -> object:
        if tensor.dtype in (torch.float16, torch.bfloat16):  # the compressed buckets, not the scaler's float32 flag
            self.buckets.append((str(tensor.dtype), tensor.numel() * tensor.element_size()))
        return self._all_reduce(tensor, *args, **kwargs)  # type: ignore[arg-type]

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        dist.all_reduce = self._all_reduce


def _fit(config: Config, steps: int, seed: int, callback: pl.Callback) -> pl.Trainer:
    pl.seed_everything(seed, verbose=False)
    model = SmallCNN()
    gen = torch.Generator().manual_seed(seed)
    n = steps * _BATCH * _WORLD  # the DistributedSampler gives each rank its half
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=gen), torch.randint(0, 10, (n,), generator=gen))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_WORLD,
        strategy="ddp",
        plugins=[config.plugin()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        max_steps=steps,
        callbacks=[callback],
    )
    trainer.fit(model, DataLoader(data, batch_size=_BATCH, shuffle=False))
    return trainer


def _count_bytes(config: Config, seed: int) -> None:
    counter = BucketCounter()
    _fit(config, _BYTES_STEPS, seed, counter)
    config.bytes_per_step = sum(n for _, n in counter.buckets) / _BYTES_STEPS
    config.bucket_dtypes = {dtype for dtype, _ in counter.buckets}


def _time(config: Config, steps: int, warmup: int, seed: int) -> list[float]:
    timer = StepTimer()
    _fit(config, warmup + steps, seed, timer)
    if len(timer.times) != warmup + steps:
        raise RuntimeError(f"{config.label}: expected {warmup + steps} steps, timed {len(timer.times)}")
    return timer.times[warmup:]


def _rounds(table: dict[str, list[Config]], args: argparse.Namespace, steps: dict[str, int]) -> float:
    """Interleave every precision's configurations over rounds; rank 0 decides when to stop, for both ranks."""
    started = time.perf_counter()
    for r in range(args.rounds):
        for precision, configs in table.items():
            for config in configs if r % 2 == 0 else configs[::-1]:
                times = _time(config, steps[precision], args.warmup, args.seed + r)
                config.times.extend(times)
                config.round_medians.append(statistics.median(times))
        elapsed = time.perf_counter() - started
        # Every rank must run the same fits (or the next fit's collectives wait forever): rank 0's clock decides.
        stop = torch.tensor(float(r >= 1 and elapsed > args.budget_s))
        dist.broadcast(stop, src=0)
        if dist.get_rank() == 0:
            print(f"  round {r + 1}/{args.rounds} done ({elapsed:.0f} s, load average {load():.2f})", flush=True)
        if stop.item() and r + 1 < args.rounds:
            if dist.get_rank() == 0:
                print(f"  time budget of {args.budget_s:.0f} s spent: stopping after {r + 1} rounds", flush=True)
            break
    return time.perf_counter() - started


def _collective(calls: int, rounds: int = 20) -> dict[str, float]:
    """Median µs per call of the check's collective (``max_across_ranks``) and of a bare one-element all-reduce."""
    flag = torch.zeros(1)
    ways: dict[str, Callable[[], object]] = {
        "the check's collective (max_across_ranks)": lambda: max_across_ranks(flag, dist.group.WORLD),
        "a bare one-element all_reduce(MAX)": lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX),
    }
    per_call: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name, way in ways.items() if r % 2 == 0 else reversed(ways.items()):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(calls):
                way()
            per_call[name].append((time.perf_counter() - started) / calls * 1e6)
    return {name: statistics.median(times) for name, times in per_call.items()}


def _report(table: dict[str, list[Config]], spent: float, collective: dict[str, float]) -> None:
    print()
    print("## DDP on CPU, 2 processes (gloo): ours against Lightning's MixedPrecision")
    print()
    print("| comparison | A | B | A/B | per-round A/B: median [min, max] | steps timed each | target |")
    print("|---|---:|---:|---:|---|---:|---|")
    for precision, (lightning, *mine_all) in table.items():
        for mine in mine_all:
            ratio = Ratio.of(mine, lightning)
            print(
                f"| step time, {precision}: {mine.label} (A) / {lightning.label} (B) | {ratio.a_ms:.2f} ms "
                f"| {ratio.b_ms:.2f} ms | {ratio.of_medians:.3f}x | {ratio.per_round()} | {len(mine.times)} "
                f"| {verdict(ratio.of_medians, _TIME_TARGET)} |"
            )
    for precision, (lightning, ours, ours_mw, *_) in table.items():
        bytes_ratio = ours_mw.bytes_per_step / ours.bytes_per_step
        met = "met" if bytes_ratio <= _BYTES_TARGET else "NOT met"
        print(
            f"| bytes all-reduced per step, {precision}: master weights ({'/'.join(sorted(ours_mw.bucket_dtypes))}) "
            f"(A) / without ({'/'.join(sorted(ours.bucket_dtypes))}) (B) | {ours_mw.bytes_per_step:,.0f} B "
            f"| {ours.bytes_per_step:,.0f} B | {bytes_ratio:.3f}x | - | {_BYTES_STEPS} "
            f"| {met} (= {_BYTES_TARGET:.2f}x) |"
        )
        print(
            f"| bytes all-reduced per step, {precision}: ours without master weights (A) / Lightning (B) "
            f"| {ours.bytes_per_step:,.0f} B | {lightning.bytes_per_step:,.0f} B "
            f"| {ours.bytes_per_step / lightning.bytes_per_step:.3f}x | - | {_BYTES_STEPS} | n/a (same FP32 model) |"
        )
    print()
    lightning, ours, *_ = table["bf16-mixed"]
    gap_us = (statistics.median(ours.times) - statistics.median(lightning.times)) * 1e6
    for name, us in collective.items():
        print(f"{name}: {us:.0f} µs per call ({us / gap_us:.0%} of ours - Lightning's bf16 step time, {gap_us:.0f} µs)")
    print()
    print(f"total {spent:.0f} s of timed rounds, load average after: {load():.2f}")


def _worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(_WORLD),
        RANK=str(rank),
        LOCAL_RANK=str(rank),  # Lightning then takes the processes as launched externally (torchrun-style)
        NODE_RANK="0",
    )
    quiet(".*fp16 autocast is correct there but slow.*", ".*lr_scheduler.*")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=_WORLD)
    try:
        precisions = ["bf16-mixed", "16-mixed"] if args.fp16 else ["bf16-mixed"]
        steps = {"bf16-mixed": args.steps, "16-mixed": args.steps_fp16}
        table = {precision: _configs(precision, args.without_collective) for precision in precisions}
        for configs in table.values():
            for config in configs:
                _count_bytes(config, args.seed)
        spent = _rounds(table, args, steps)
        collective = _collective(args.collective_calls)
        if rank == 0:
            _report(table, spent, collective)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps (about a minute)")
    parser.add_argument("--fp16", action="store_true", help="also compare at 16-mixed (fp16 autocast: slow on CPU)")
    parser.add_argument("--rounds", type=int, default=None, help="most interleaved rounds (default 6, quick 2)")
    parser.add_argument(
        "--budget-s", type=float, default=None, help="no new round after this many s (default 90, quick 20)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped at the start of each run (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed bf16 steps per run (default 12, quick 6)")
    parser.add_argument("--steps-fp16", type=int, default=None, help="timed fp16 steps per run (default 6, quick 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per process (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--without-collective", action="store_true", help="also time ours without the check's collective (measurement)"
    )
    parser.add_argument(
        "--collective-calls", type=int, default=200, help="calls of the check's collective timed per round (20 rounds)"
    )
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 6)
    args.budget_s = args.budget_s if args.budget_s is not None else (20.0 if args.quick else 90.0)
    args.warmup = args.warmup if args.warmup is not None else 2
    args.steps = args.steps or (6 if args.quick else 12)
    args.steps_fp16 = args.steps_fp16 or (3 if args.quick else 6)

    print(f"torch {torch.__version__}, lightning {pl.__version__}, CPU, {_WORLD} processes x {args.threads} thread(s)")
    print(f"load average before the run: {load():.2f} (other processes share these cores if > ~0.3)")
    print(
        f"small CNN, batch {_BATCH} per rank, up to {args.rounds} interleaved rounds ({args.budget_s:.0f} s budget), "
        f"{args.warmup} warm-up steps dropped per run, timed steps per run: bf16 {args.steps}"
        + (f", fp16 {args.steps_fp16}" if args.fp16 else "")
    )
    started = time.perf_counter()
    mp.start_processes(_worker, args=(_free_port(), args), nprocs=_WORLD, join=True, start_method="spawn")
    print(f"wall time with process start-up and byte counting: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
