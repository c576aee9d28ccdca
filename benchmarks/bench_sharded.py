"""Benchmark sharded training on CPU (2 processes, gloo): our plugins against the closest of Lightning's.

What is compared, per step of the same model on the same batches (8 x Linear(512, 512) + ReLU, then Linear(512, 1):
2.1M parameters, batch 64 per rank, Adam), each Linear and the root sharded:

* ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` in ``configure_model``): ``MixedPrecisionPlugin("bf16-mixed")``
  against Lightning's ``precision="bf16-mixed"`` (both autocast over FP32 shards: the same arithmetic); ours with
  master weights is the model sharded with ``plugin.mp_policy`` (bf16 compute, FP32 shards and reduction).
* ``FSDPStrategy`` (FSDP1 flat shards, on CPU through the tests' ``CPUFSDPStrategy``): Lightning's
  ``FSDPPrecision("bf16-mixed")`` (bf16 parameters, bf16 gradient reduction) against
  ``FSDPMixedPrecisionPlugin("bf16-mixed", master_weights=True)`` (bf16 parameters, FP32 reduction: the closest; the
  reduction dtype differs) and without master weights (FP32 shards under autocast).

Step time: the wall time of rank 0 from ``on_train_batch_start`` to ``on_train_batch_end`` (the ranks wait for each
other in the collectives, so it is the pair's), the median over the steps after a warm-up, the configurations of a
strategy interleaved over rounds (``A B``, ``B A``, ...) under a time budget, as ``bench_ddp.py`` does; rank 0 decides
when to stop and tells rank 1. Memory per rank (one profiled step of a separate short run): the bytes of parameters,
gradients and optimizer state alive after the step, and the peak of live tensors during the step, read from the
profiler's allocation events in time order. Nothing is asserted; the target is a ratio: ours / Lightning <= 1.05x.

Run
    python benchmarks/bench_sharded.py            # about 2 minutes on 2 CPU cores (capped by --budget-s)
    python benchmarks/bench_sharded.py --quick    # a smoke test
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _ab import Ratio, Side, load, quiet, verdict  # same directory
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from cpu_fsdp import CPUFSDPStrategy
from launch import WORLD, run_pool

from lightning_amp_plus import FSDPMixedPrecisionPlugin, MixedPrecisionPlugin
from lightning_amp_plus.step.sharding import local_view

WIDTH, DEPTH, BATCH = 512, 8, 64
_TARGET = 1.05
MB = 1e6


class Sharded(pl.LightningModule):
    """The benchmark model; under FSDP2 it shards itself (each Linear, then the root), with ``policy`` if given."""

    def __init__(self, fsdp2: bool, policy: MixedPrecisionPolicy | None = None) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
        self.fsdp2, self.policy = fsdp2, policy

    def configure_model(self) -> None:
        if not self.fsdp2:
            return
        mesh = self.device_mesh["data_parallel"]
        kwargs: dict[str, Any] = {"mesh": mesh} if self.policy is None else {"mesh": mesh, "mp_policy": self.policy}
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, **kwargs)
        fully_shard(self, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        generator = torch.Generator().manual_seed(batch_idx * WORLD + self.global_rank)
        # FSDP1 with bf16 parameters casts only the root forward's inputs: a batch made here meets the weights' dtype.
        x = torch.randn(BATCH, WIDTH, generator=generator).to(local_view(self.net[0].weight).dtype)
        y = torch.randn(BATCH, 1, generator=generator)
        return F.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@dataclass
class Config(Side):
    """One configuration: how to build its strategy, precision plugin (or string) and model."""

    strategy: Callable[[], Any] = lambda: None
    plugin: Callable[[], Precision | str] = lambda: "32-true"
    model: Callable[[], Sharded] = lambda: Sharded(False)
    memory: dict[str, float] = field(default_factory=dict)


def _configs() -> dict[str, list[Config]]:
    policy = MixedPrecisionPlugin("bf16-mixed").mp_policy
    fsdp2 = lambda: ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)  # noqa: E731
    return {
        "ModelParallelStrategy (FSDP2)": [
            Config("Lightning bf16-mixed", strategy=fsdp2, plugin=lambda: "bf16-mixed", model=lambda: Sharded(True)),
            Config(
                "ours bf16-mixed",
                strategy=fsdp2,
                plugin=lambda: MixedPrecisionPlugin("bf16-mixed", "cpu"),
                model=lambda: Sharded(True),
            ),
            Config(
                "ours bf16-mixed + master weights (mp_policy)",
                strategy=fsdp2,
                plugin=lambda: MixedPrecisionPlugin("bf16-mixed", "cpu"),
                model=lambda: Sharded(True, policy),
            ),
        ],
        "FSDPStrategy (FSDP1)": [
            Config(
                "Lightning FSDPPrecision bf16-mixed",
                strategy=CPUFSDPStrategy,
                plugin=lambda: FSDPPrecision("bf16-mixed"),
            ),
            Config(
                "ours bf16-mixed + master weights",
                strategy=CPUFSDPStrategy,
                plugin=lambda: FSDPMixedPrecisionPlugin("bf16-mixed", "cpu", master_weights=True),
            ),
            Config(
                "ours bf16-mixed",
                strategy=CPUFSDPStrategy,
                plugin=lambda: FSDPMixedPrecisionPlugin("bf16-mixed", "cpu"),
            ),
        ],
    }


class Meter(pl.Callback):
    """Step times; with ``profiled``, the memory of that step instead."""

    def __init__(self, profiled: int | None = None) -> None:
        self.times: list[float] = []
        self.profiled = profiled
        self.memory: dict[str, float] = {}
        self._started = 0.0
        self._profiler: profile | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.profiled:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.start()
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._started)
        if self._profiler is not None:
            self._profiler.stop()
            self.memory = {"peak": _peak_allocated(self._profiler) / MB, **_state_mb(trainer, pl_module)}
            self._profiler = None


def _state_mb(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, float]:
    """MB of this rank's parameters, gradients and optimizer state (each storage once)."""
    seen: set[int] = set()

    def size(tensors: list[Tensor]) -> float:
        total = 0
        for tensor in tensors:
            local = local_view(tensor)
            key = local.untyped_storage().data_ptr()
            if local.numel() and key not in seen:
                seen.add(key)
                total += local.untyped_storage().nbytes()
        return total / MB

    optimizer = trainer.optimizers[0]
    params = [p for group in optimizer.param_groups for p in group["params"]] + list(module.parameters())
    return {
        "params": size([p.detach() for p in params]),
        "grads": size([p.grad for p in params if p.grad is not None]),
        "optimizer": size([v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]),
    }


def _peak_allocated(prof: profile) -> int:
    """The highest running sum of allocated minus freed bytes, from the profiler's allocation events in time order."""
    from torch._C._profiler import _EventType
    from torch.profiler._memory_profiler import OpTree

    events = sorted(
        (event.start_time_ns, event.typed[1].alloc_size)
        for event in OpTree(prof.profiler.kineto_results).dfs()
        if event.typed[0] == _EventType.Allocation
    )
    current = peak = 0
    for _, size in events:
        current += size
        peak = max(peak, current)
    return peak


def _fit(config: Config, steps: int, meter: Meter, seed: int) -> None:
    pl.seed_everything(seed, verbose=False)
    plugin = config.plugin()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=config.strategy(),
        **({"precision": plugin} if isinstance(plugin, str) else {"plugins": [plugin]}),
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[meter],
    )
    data = TensorDataset(torch.zeros(steps * WORLD, 1))  # the batches come from training_step
    trainer.fit(config.model(), DataLoader(data, batch_size=1))


def _measure(out: Path, args: argparse.Namespace) -> dict[str, Any]:
    quiet(".*lr_scheduler.*", ".*FSDP.*", ".*fully_shard.*")
    torch.set_num_threads(1)
    table = _configs()
    for configs in table.values():
        for config in configs:
            meter = Meter(profiled=2)
            _fit(config, 3, meter, args.seed)
            config.memory = meter.memory
    started = time.perf_counter()
    for r in range(args.rounds):
        for configs in table.values():
            for config in configs if r % 2 == 0 else configs[::-1]:
                meter = Meter()
                _fit(config, args.warmup + args.steps, meter, args.seed + r)
                times = meter.times[args.warmup :]
                config.times.extend(times)
                config.round_medians.append(statistics.median(times))
        stop = torch.tensor(float(r >= 1 and time.perf_counter() - started > args.budget_s))
        dist.broadcast(stop, src=0)  # rank 0's clock decides for both: the ranks must run the same fits
        if stop.item():
            break
    return {
        strategy: [(c.label, c.times, c.round_medians, c.memory) for c in configs]
        for strategy, configs in table.items()
    }


def _report(result: dict[str, Any], spent: float) -> None:
    print("\n## Sharded training on CPU, 2 processes (gloo): ours against Lightning's closest\n")
    print("| strategy | configuration | step ms (median) | vs Lightning | per-round [min, max] | target |")
    print("|---|---|---:|---:|---|---|")
    for strategy, rows in result.items():
        sides = []
        for label, times, medians, _ in rows:
            side = Side(label)
            side.times, side.round_medians = times, medians
            sides.append(side)
        lightning = sides[0]
        for side in sides:
            ratio = Ratio.of(side, lightning)
            target = "-" if side is lightning else verdict(ratio.of_medians, _TARGET)
            print(
                f"| {strategy} | {side.label} | {ratio.a_ms:.1f} | {ratio.of_medians:.3f}x | {ratio.per_round()} "
                f"| {target} |"
            )
    print("\n| strategy | configuration | params MB | grads MB | optimizer MB | peak live tensors in a step MB |")
    print("|---|---|---:|---:|---:|---:|")
    for strategy, rows in result.items():
        for label, _, _, memory in rows:
            print(
                f"| {strategy} | {label} | {memory['params']:.2f} | {memory['grads']:.2f} | {memory['optimizer']:.2f} "
                f"| {memory['peak']:.1f} |"
            )
    print(f"\nrank 0, per rank; {spent:.0f} s in all, load average after: {load():.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--budget-s", type=float, default=90.0, help="no new round after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 steps: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds, args.budget_s = 3, 1, 2, 0.0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        # A partial of a module-level function: the pool pickles its scenarios by reference into fresh processes.
        ranks = run_pool({"measure": functools.partial(_measure, args=args)}, Path(out))
    if "measure" not in ranks[0]:
        print(ranks[0].get("error", "the workers failed"), file=sys.stderr)
        return 1
    _report(ranks[0]["measure"], time.perf_counter() - started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
