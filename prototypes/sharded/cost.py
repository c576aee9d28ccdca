"""Step time and memory per rank of the sharded configurations, 2 CPU processes over gloo (measured, not asserted).

Model: 8 x (Linear(512, 512) + ReLU) + Linear(512, 1), 2.1M parameters, Adam, batch 64 per rank; FSDP1 wraps each
``Linear`` (``auto_wrap_policy={nn.Linear}``), FSDP2 shards each ``Linear`` then the root. Configurations:

* ``ddp/*``: ``strategy="ddp"`` with Lightning's ``bf16-mixed`` and the package's ``MixedPrecisionPlugin`` (with and
  without master weights);
* ``fsdp/*``: ``CPUFSDPStrategy`` with Lightning's ``FSDPPrecision`` (``32-true``; ``bf16-mixed``, which on CPU means
  ``MixedPrecision(bf16, bf16, bf16)`` and no autocast) and ``ProtoFSDPPrecision`` (autocast over FP32 shards; with
  ``master_weights=True``: ``MixedPrecision(param_dtype=bf16, reduce_dtype=float32)``);
* ``model_parallel/*``: ``ModelParallelStrategy`` with Lightning's ``32-true`` and ``bf16-mixed`` (autocast over FP32
  DTensor parameters) and ``ProtoModelParallelPrecision`` (alone; and with ``MixedPrecisionPolicy(bf16, float32)``).

Step time: rank 0 times each training batch (``on_train_batch_start`` to ``on_train_batch_end``; the collectives make
it the pair's time); ``--rounds`` rounds, the configurations interleaved (reversed every other round), the first
``--warmup`` steps of every fit dropped; reported: the median, and ratios of medians side by side.

Memory per rank: after a step, the bytes of the state that stays (the rank's parameters, gradients, optimizer state and
master copies, counted tensor by tensor, shared storage once); and the peak of one profiled step: that state as the
step began plus the most the step allocated on top of it (``torch.profiler`` with ``profile_memory=True``: allocations
and frees in time order; activations, FSDP's unsharded parameters and gradients, the optimizer's temporaries). Not
counted: DDP's gradient buckets (one more gradient-sized buffer per DDP rank, allocated when the model is wrapped).

Run: ``python prototypes/sharded/cost.py`` (about 5 minutes on 2 busy cores; ``--rounds 1`` for a quick look).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _pool  # noqa: F401  (puts tests/ on the path)
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from cpu_fsdp import CPUFSDPStrategy
from launch import WORLD, run_pool, scenario
from lightning.pytorch.strategies import ModelParallelStrategy
from proto_plugins import ProtoFSDPPrecision, ProtoModelParallelPrecision, local_view
from torch import Tensor, nn
from torch._C._profiler import _EventType
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import OpTree

from lightning_amp_plus import MixedPrecisionPlugin

WIDTH, DEPTH, BATCH = 512, 8, 64
PROFILED_STEP = 3


class CostModel(pl.LightningModule):
    def __init__(
        self, shard: bool = False, policy: MixedPrecisionPolicy | None = None, input_dtype: torch.dtype | None = None
    ) -> None:
        """``input_dtype``: the batch's dtype; by default the first weight's (bf16 when the model is bf16)."""
        super().__init__()
        self.input_dtype = input_dtype
        layers: list[nn.Module] = []
        for _ in range(DEPTH):
            layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(WIDTH, 1))
        self.shard = shard
        self.policy = policy

    def configure_model(self) -> None:
        if not self.shard:
            return
        mesh = self.device_mesh["data_parallel"]
        kwargs: dict[str, Any] = {"mesh": mesh} if self.policy is None else {"mesh": mesh, "mp_policy": self.policy}
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, **kwargs)
        fully_shard(self, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        generator = torch.Generator().manual_seed(batch_idx * WORLD + self.global_rank)
        x = torch.randn(BATCH, WIDTH, generator=generator).to(self.input_dtype or self.net[0].weight.dtype)
        y = torch.randn(BATCH, 1, generator=generator)
        return F.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def state_bytes(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, int]:
    """Bytes of the rank's parameters, gradients, optimizer state and masters (each storage counted once)."""
    seen: set[int] = set()

    def nbytes(tensors: list[Tensor]) -> int:
        total = 0
        for tensor in tensors:
            local = local_view(tensor)
            key = local.untyped_storage().data_ptr()
            if local.numel() and key not in seen:
                seen.add(key)
                total += local.untyped_storage().nbytes()
        return total

    optimizer = trainer.optimizers[0]
    optimizer_params = [p for group in optimizer.param_groups for p in group["params"]]
    params = list(module.parameters())
    return {
        "params": nbytes([p.detach() for p in params]),
        "masters": nbytes([p.detach() for p in optimizer_params]),  # 0 unless the optimizer holds other tensors
        "grads": nbytes([p.grad for p in params + optimizer_params if p.grad is not None]),
        "optimizer": nbytes([v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]),
    }


class Meter(pl.Callback):
    def __init__(self, profile_step: bool) -> None:
        self.times: list[float] = []
        self.profile_step = profile_step
        self.peak = 0
        self.state: dict[str, int] = {}
        self.at_start = 0
        self._started = 0.0
        self._profiler: profile | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.profile_step and idx == PROFILED_STEP:
            self.at_start = sum(state_bytes(trainer, pl_module).values())
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.start()
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        elapsed = time.perf_counter() - self._started
        if self._profiler is not None:
            self._profiler.stop()
            self.peak = peak_allocated(self._profiler)
            self._profiler = None
            self.state = state_bytes(trainer, pl_module)
        else:
            self.times.append(elapsed)


def peak_allocated(prof: profile) -> int:
    """The highest sum of bytes allocated minus freed since the profiler started, in time order.

    Read from the profiler's allocation events themselves (a private but stable reader, the one torch's memory
    timeline uses): the ``self_cpu_memory_usage`` of ops is no good here, because an op that encloses others (Lightning
    runs the whole closure inside ``Adam.step``) carries the frees of its children's tensors at its own start time.
    """
    allocations = sorted(
        (event.start_time_ns, event.typed[1].alloc_size)
        for event in OpTree(prof.profiler.kineto_results).dfs()
        if event.typed[0] == _EventType.Allocation
    )
    current = peak = 0
    for _, size in allocations:
        current += size
        peak = max(peak, current)
    return peak


def ours(**kwargs: Any) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("bf16-mixed", device="cpu", **kwargs)


BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
Config = Callable[[], tuple[Any, dict[str, Any], CostModel]]
CONFIGS: dict[str, Config] = {
    "ddp/lightning-bf16": lambda: ("ddp", {"precision": "bf16-mixed"}, CostModel()),
    "ddp/ours-bf16": lambda: ("ddp", {"plugins": [ours()]}, CostModel()),
    "ddp/ours-bf16+master": lambda: ("ddp", {"plugins": [ours(master_weights=True)]}, CostModel()),
    "fsdp/lightning-32": lambda: (CPUFSDPStrategy(auto_wrap_policy={nn.Linear}), {"precision": "32-true"}, CostModel()),
    "fsdp/lightning-bf16": lambda: (
        CPUFSDPStrategy(auto_wrap_policy={nn.Linear}),
        {"precision": "bf16-mixed"},
        # Each Linear is an FSDP unit computing in bf16 that casts no inputs (only the root does), and
        # FSDPPrecision's autocast is CUDA's: the batch must be bf16 already.
        CostModel(input_dtype=torch.bfloat16),
    ),
    "fsdp/proto-bf16": lambda: (
        CPUFSDPStrategy(auto_wrap_policy={nn.Linear}),
        {"plugins": [ProtoFSDPPrecision("bf16-mixed")]},
        CostModel(),
    ),
    "fsdp/proto-bf16+master": lambda: (
        CPUFSDPStrategy(auto_wrap_policy={nn.Linear}),
        {"plugins": [ProtoFSDPPrecision("bf16-mixed", master_weights=True)]},
        CostModel(),
    ),
    "model_parallel/lightning-32": lambda: (
        ModelParallelStrategy(WORLD, 1),
        {"precision": "32-true"},
        CostModel(shard=True),
    ),
    "model_parallel/lightning-bf16": lambda: (
        ModelParallelStrategy(WORLD, 1),
        {"precision": "bf16-mixed"},
        CostModel(shard=True),
    ),
    "model_parallel/proto-bf16": lambda: (
        ModelParallelStrategy(WORLD, 1),
        {"plugins": [ProtoModelParallelPrecision("bf16-mixed")]},
        CostModel(shard=True),
    ),
    "model_parallel/proto-bf16+policy": lambda: (
        ModelParallelStrategy(WORLD, 1),
        {"plugins": [ProtoModelParallelPrecision("bf16-mixed")]},
        CostModel(shard=True, policy=BF16_POLICY),
    ),
}
ROUNDS = 3
STEPS = 12
WARMUP = 2


def run_config(name: str, profile_step: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    strategy, kwargs, model = CONFIGS[name]()
    meter = Meter(profile_step)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=STEPS,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[meter],
        **kwargs,
    )
    trainer.fit(model, torch.utils.data.DataLoader(range(WORLD * STEPS * 4), batch_size=1))
    # The peak of the step: what its state held when it began, plus the most it allocated on top.
    return {"times": meter.times[WARMUP:], "peak": meter.at_start + meter.peak, "state": meter.state}


def measure(out: Path, rounds: int = ROUNDS) -> dict[str, Any]:
    results: dict[str, Any] = {name: {"times": []} for name in CONFIGS}
    names = list(CONFIGS)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            record = run_config(name, profile_step=round_ == 0)
            results[name]["times"] += record["times"]
            if round_ == 0:
                results[name]["peak"], results[name]["state"] = record["peak"], record["state"]
    return results


def mb(n: int) -> str:
    return f"{n / 2**20:6.2f}"


def report(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = scenario(ranks, "measure")
    medians = {name: statistics.median(rank0[name]["times"]) for name in CONFIGS}
    print(f"{'configuration':<34} {'step ms':>8}  per rank MB: {'params':>6} {'grads':>6} {'optim':>6} {'peak':>6}")
    print(f"{'':<34} {'':>8}  {'':12} {'+master':>6}")
    for name in CONFIGS:
        for rank, record in enumerate((rank0[name], rank1[name])):
            state = record["state"]
            params = state["params"] + state["masters"]
            step = f"{medians[name] * 1e3:8.2f}" if rank == 0 else " " * 8
            label = name if rank == 0 else "  (rank 1)"
            print(
                f"{label:<34} {step}  {'':12} {mb(params)} {mb(state['grads'])} {mb(state['optimizer'])} "
                f"{mb(record['peak'])}"
            )
    pairs = [
        ("model_parallel/lightning-bf16", "fsdp/lightning-bf16"),
        ("model_parallel/lightning-bf16", "ddp/lightning-bf16"),
        ("fsdp/lightning-bf16", "ddp/lightning-bf16"),
        ("model_parallel/proto-bf16", "model_parallel/lightning-bf16"),
        ("model_parallel/proto-bf16+policy", "model_parallel/lightning-bf16"),
        ("fsdp/proto-bf16", "fsdp/lightning-bf16"),
        ("fsdp/proto-bf16+master", "fsdp/lightning-bf16"),
        ("ddp/ours-bf16", "ddp/lightning-bf16"),
    ]
    print("\nstep-time ratios (medians):")
    for a, b in pairs:
        print(f"  {a} / {b}: {medians[a] / medians[b]:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    rounds = parser.parse_args().rounds
    out = Path(tempfile.mkdtemp(prefix="sharded_cost_"))
    started = time.perf_counter()
    report(run_pool({"measure": functools.partial(measure, rounds=rounds)}, out, timeout_s=1800))
    print(f"\n{rounds} rounds x {len(CONFIGS)} configurations, {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
