"""Benchmark a Lightning Fabric training step: ``lightning_amp_plus.fabric.MixedPrecisionPlugin`` against Fabric's own.

What is measured
    The steady-state time of one optimizer step of a plain Fabric loop written as litgpt writes it: forward under the
    plugin's autocast, ``fabric.backward(loss / accumulate)`` per micro-batch (the first under
    ``fabric.no_backward_sync``), ``fabric.clip_gradients(model, optimizer, max_norm=1.0)``, ``optimizer.step()``,
    ``optimizer.zero_grad()``. The model is a small decoder-style transformer (token embedding, 2
    ``nn.TransformerEncoderLayer`` of width 128 with 4 heads and a causal mask, a linear head over 256 tokens; 462k
    parameters in 27 tensors) on random tokens, 8 sequences of 64 per micro-batch, 2 micro-batches per step, AdamW
    (foreach, torch's default: Fabric's built-in refuses clipping with a fused optimizer), on CPU:

    * ``16-mixed``: ours (``DynamicLossScaler``) against ``lightning.fabric.plugins.precision.MixedPrecision(
      "16-mixed", "cpu")`` (``torch.amp.GradScaler``); given as plugin objects, both really run fp16 autocast on CPU.
    * ``bf16-mixed``: the same pair at bf16 (ours checks the gradients for inf/NaN and may skip the step; Fabric's
      checks nothing).
    * ``32-true``: for context, Fabric's ``32-true`` twice (A and B): their ratio is the noise floor of the machine.

    Where ours does more: at bf16 it checks the gradients once per step (GradScaler's one-pass check-and-unscale
    kernel, by 1.0, and one host read; no norm), which Fabric's bf16 plugin does not do. At fp16 it makes GradScaler's
    pass and read. Fabric's ``clip_gradients`` then measures the norm with torch's ``clip_grad_norm_`` on both sides.
    ``--no-clip`` times the loop without clipping.

How
    Each configuration runs in a fresh ``Fabric(accelerator="cpu", devices=1, plugins=[...])`` with the same seed
    (same weights, same tokens); every optimizer step is timed with ``time.perf_counter()`` and the first ``--warmup``
    steps of each run are dropped. The two sides of a precision alternate round by round (A B, B A, ...) so that the
    machine's noise hits both alike; no new round starts once ``--budget-s`` seconds have passed (two rounds at
    least). Reported per precision: the median step time of each side over all timed steps, the ratio of those medians
    (ours/Fabric's) and the median, min and max of the per-round ratios (the spread). Nothing is asserted.

    fp16 autocast on a CPU without native fp16 arithmetic is slow (about 20x bf16 for this model on a 2-core EPYC), so
    its runs take fewer steps. Target (reported): ours/Fabric's <= 1.02x at each mixed precision.

Run
    python benchmarks/bench_fabric.py                 # about 4 minutes on 2 CPU cores (capped by --budget-s)
    python benchmarks/bench_fabric.py --quick         # under a minute: a smoke test
    python benchmarks/bench_fabric.py --rounds 20 --threads 1   # steadier on a machine shared with other processes
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from _ab import Defaults, Ratio, Side, add_plan_arguments, load, plan, quiet, run_interleaved, verdict  # same directory
from lightning.fabric.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn

from lightning_amp_plus.fabric import MixedPrecisionPlugin

_TARGET = 1.02
_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_VOCAB, _WIDTH, _HEADS, _LAYERS, _SEQ, _BATCH, _ACCUMULATE = 256, 128, 4, 2, 64, 8, 2


class TinyDecoder(nn.Module):
    """Token embedding, causal self-attention layers, a linear head: the shape of a small GPT."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, _WIDTH)
        layer = nn.TransformerEncoderLayer(_WIDTH, _HEADS, 4 * _WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, _LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(_WIDTH, _VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(_SEQ), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.blocks(self.embed(tokens), mask=self.mask, is_causal=True))


@dataclass
class Config(Side):
    """One side of a comparison: a label and how to build its plugin."""

    plugin: Callable[[], Precision] = Precision


def _pairs(precisions: list[str]) -> dict[str, tuple[Config, Config]]:
    table: dict[str, tuple[Config, Config]] = {}
    for precision in precisions:
        if precision == "32-true":
            table[precision] = (Config("32-true A", plugin=Precision), Config("32-true B", plugin=Precision))
        else:
            table[precision] = (
                Config(f"ours {precision}", plugin=lambda p=precision: MixedPrecisionPlugin(p, "cpu")),  # type: ignore[misc]
                Config(f"Fabric {precision}", plugin=lambda p=precision: MixedPrecision(p, "cpu")),  # type: ignore[misc]
            )
    return table


def run_once(config: Config, steps: int, warmup: int, seed: int, clip: bool) -> list[float]:
    """A fresh Fabric loop of ``warmup + steps`` optimizer steps; the timed (post-warm-up) step times in seconds."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[config.plugin()])
    torch.manual_seed(seed)
    model = fabric.setup(TinyDecoder())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1))
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, _VOCAB, (warmup + steps, _ACCUMULATE, _BATCH, _SEQ + 1), generator=generator)
    times = []
    for step in range(warmup + steps):
        started = time.perf_counter()
        for micro in range(_ACCUMULATE):
            tokens = data[step, micro]
            with fabric.no_backward_sync(model, enabled=micro < _ACCUMULATE - 1):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, _VOCAB), tokens[:, 1:].reshape(-1))
                fabric.backward(loss / _ACCUMULATE)
        if clip:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
        if not math.isfinite(float(loss.detach())):
            raise RuntimeError(f"{config.label}: the loss became {float(loss.detach())} at step {step}")
    return times[warmup:]


DEFAULTS = Defaults(
    rounds=(10, 2), budget_s=(240.0, 45.0), warmup=(3, 2),
    steps={"32-true": (20, 6), "bf16-mixed": (20, 6), "16-mixed": (5, 2)},
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=list(_PRECISIONS), choices=_PRECISIONS)
    parser.add_argument("--no-clip", action="store_true", help="time the loop without fabric.clip_gradients")
    add_plan_arguments(parser, DEFAULTS)
    args = parser.parse_args()

    quiet(".*fp16 autocast is correct there but slow.*")
    run_plan = plan(args, DEFAULTS)
    rounds, budget, warmup, steps = run_plan.rounds, run_plan.budget_s, run_plan.warmup, run_plan.steps
    pairs = _pairs(args.precisions)
    clip = not args.no_clip

    print(f"torch {torch.__version__}, lightning {L.__version__}, CPU, {torch.get_num_threads()} threads")
    print(f"load average before the run: {load():.2f} (other processes share these cores if > ~0.3)")
    parameters = sum(p.numel() for p in TinyDecoder().parameters())
    print(
        f"tiny decoder ({parameters / 1e3:.0f}k parameters), {_ACCUMULATE} micro-batches of {_BATCH}x{_SEQ} tokens per "
        f"step, AdamW, {'clip_gradients(max_norm=1.0)' if clip else 'no clipping'}; up to {rounds} interleaved rounds "
        f"({budget:.0f} s budget), {warmup} warm-up steps dropped per run, timed steps per run: "
        + ", ".join(f"{p} {steps[p]}" for p in args.precisions)
    )

    def run(precision: str, side: Side, r: int) -> list[float]:
        assert isinstance(side, Config)
        return run_once(side, steps[precision], warmup, args.seed + r, clip)

    spent = run_interleaved(pairs, run, rounds, budget)  # type: ignore[arg-type]

    print()
    print("## Fabric training step time (median ms per optimizer step over all timed steps; ratios ours/Fabric's)")
    print()
    print(
        "| precision | ours (A) ms | Fabric's (B) ms | ratio of medians | per-round ratios: median [min, max] "
        "| rounds | target |"
    )
    print("|---|---:|---:|---:|---|---:|---|")
    for precision, (a, b) in pairs.items():
        ratio = Ratio.of(a, b)
        target = "n/a (A/A noise floor)" if precision == "32-true" else verdict(ratio.of_medians, _TARGET)
        print(
            f"| {precision} | {ratio.a_ms:.2f} | {ratio.b_ms:.2f} | {ratio.of_medians:.3f}x | {ratio.per_round()} "
            f"| {len(a.round_medians)} | {target} |"
        )
    print()
    print("32-true: Fabric's 32-true twice (A, B); its ratio is the noise floor of this machine.")
    print(f"total {spent:.0f} s, load average after: {load():.2f}")


if __name__ == "__main__":
    main()
