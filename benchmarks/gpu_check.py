"""One script for a machine with one CUDA GPU: the CUDA tests, the scaler benchmarks and a full training step.

What it runs (in this order, each in a fresh process where it is a script of its own; estimated at 5-7 minutes on one
datacenter GPU before the FP8 rows, which build eight models, five of them compiled, and add minutes of their own: not
timed yet, no GPU has run it; ``--skip fp8`` or ``--fp8-eager`` to save them; every part capped by a time limit):

1. ``pytest -m cuda``: the CUDA-marked tests (parity with GradScaler on CUDA, no sync in the fused step, ...).
2. ``benchmarks/bench_grads.py --device cuda``: unscale / check / clip against GradScaler and the memory roofline.
3. ``benchmarks/bench_fused.py --device cuda``: the fused-optimizer path against GradScaler + the same fused AdamW.
4. A training step that fills the device: ResNet-50 on synthetic 224x224 images, batch 256, fused AdamW:

   * under Lightning: ``MixedPrecisionPlugin`` against Lightning's built-in ``MixedPrecision``, at 16-mixed and
     bf16-mixed, the same model, data and seed;
   * in a plain loop: ``DynamicLossScaler`` against ``torch.amp.GradScaler`` at fp16 (our fused path against theirs).

   Timed as a throughput: the device is synchronised once before and once after the timed steps (a sync per step
   would hide what a sync-free step gains); warm-up steps first; the sides interleaved over ``--rounds`` rounds.

5. FP8 on torchao (``weights/fp8``): a Llama-shaped model that is GEMM-bound (litgpt's ``Llama-3-8B`` config cut to
   ``--fp8-layers`` blocks: 4096 wide, 14336 MLP, grouped-query attention, 128k vocabulary; batch ``--fp8-batch`` x
   ``--fp8-seq`` tokens), fused AdamW, in a plain loop, every eligible Linear but the lm_head in FP8 (as torchtitan
   leaves its output layer): ``FP8Training`` (what ``fp8-mixed`` runs) in tokens/s against bf16-mixed and against
   torchao's own recipe (``convert_to_float8_training``, same filter), eager and compiled, tensorwise (and rowwise,
   compiled; target: compiled fp8 >= 1.2x bf16-mixed); and the readings' cost, a check step against an ordinary one
   spread over 50 steps (target: <= 1%), with the peak memory of each (CUDA's allocator statistics). Each round
   builds eight models (``--fp8-rounds``, default 1); ``--fp8-eager`` leaves out the compiled ones; ``--small`` on
   CPU compiles with ``aot_eager``.

Then one table: each check, its result, and the ratio where there is one. ``--device cpu --small`` runs every piece on
CPU with tiny sizes (a small CNN, quick benchmark settings), to try the script end to end without a GPU; its numbers
mean nothing.

Run
    python benchmarks/gpu_check.py                       # on the GPU machine
    python benchmarks/gpu_check.py --device cpu --small  # the whole script on CPU, tiny sizes, ~4-5 minutes
    python benchmarks/gpu_check.py --skip tests grads fused train   # the FP8 rows alone
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionPlugin

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


@dataclass
class Row:
    """One line of the final table."""

    check: str
    result: str
    detail: str = ""
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------- child processes
def run_child(argv: list[str], timeout_s: float) -> tuple[int, str, float]:
    """Run ``argv`` from the repository root; return its exit code, output and duration (124 on timeout)."""
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        code = 124
    return code, output, time.perf_counter() - started


def pytest_row(device: str, timeout_s: float) -> Row:
    code, output, seconds = run_child([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                                       "tests"], timeout_s)  # fmt: skip
    summary = next((line for line in reversed(output.splitlines()) if re.search(r"passed|failed|skipped|error", line)),
                   output.strip().splitlines()[-1] if output.strip() else "no output")  # fmt: skip
    failed = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    result = "ok" if code == 0 else ("timed out" if code == 124 else "FAILED")
    if device == "cpu" and code == 0:
        result = "ok (CPU: the CUDA tests skip)"
    return Row("pytest -m cuda", result, summary.strip("= ") + ("; " + "; ".join(failed[:5]) if failed else ""),
               seconds)  # fmt: skip


def table_lines(output: str) -> list[str]:
    """The Markdown table rows (without header and separator) of a benchmark's output."""
    rows = [line for line in output.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return rows[1:] if rows else []


def bench_rows(name: str, argv: list[str], timeout_s: float, pick: Callable[[list[str]], str]) -> Row:
    code, output, seconds = run_child([sys.executable, str(BENCHMARKS / name), *argv], timeout_s)
    if code != 0:
        tail = " | ".join(output.strip().splitlines()[-3:])
        return Row(name, "timed out" if code == 124 else "FAILED", tail, seconds)
    print(output, flush=True)  # the whole benchmark report, above the summary table
    return Row(name, "ok", pick(table_lines(output)), seconds)


def grads_summary(rows: list[str]) -> str:
    # | grads | case | ours ms | torch ms | roofline ms | ours/torch | ...
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    return "; ".join(f"{c[0]} {c[1]}: {c[5]}" for c in cells if len(c) > 5)


def fused_summary(rows: list[str]) -> str:
    # | case | ours ms | torch ms | alone ms | ours/torch (medians) | ours/torch (means) | host reads | target |
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    return "; ".join(f"{c[0]}: {c[4]}, syncs/step {c[6]}" for c in cells if len(c) > 6)


# ------------------------------------------------------------------------------------------ the training step
class SyntheticImages(Dataset[int]):
    """Indices only: the model keeps one synthetic batch on the device (no host-to-device copy is timed)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> int:
        return index


def make_network(small: bool) -> nn.Module:
    if small:
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        )  # fmt: skip
    from torchvision.models import resnet50

    return resnet50(weights=None)


class Classifier(pl.LightningModule):
    def __init__(self, small: bool, batch: int, image: int) -> None:
        super().__init__()
        self.net = make_network(small)
        self.batch, self.image = batch, image
        self.classes = 10 if small else 1000
        self.inputs: Tensor | None = None
        self.targets: Tensor | None = None

    def setup(self, stage: str) -> None:
        gen = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(self.batch, 3, self.image, self.image, generator=gen)
        self.targets = torch.randint(0, self.classes, (self.batch,), generator=gen)

    def on_fit_start(self) -> None:
        assert self.inputs is not None and self.targets is not None
        self.inputs, self.targets = self.inputs.to(self.device), self.targets.to(self.device)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        assert self.inputs is not None and self.targets is not None
        return F.cross_entropy(self.net(self.inputs), self.targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


class Throughput(pl.Callback):
    """Seconds per step over the steps after ``warmup``: one device sync before them and one after."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.seconds_per_step = math.nan
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.warmup:
            synchronize(pl_module.device)
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if idx == self.warmup + self.steps - 1:
            synchronize(pl_module.device)
            self.seconds_per_step = (time.perf_counter() - self._start) / self.steps


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def lightning_step(plugin: Any, device: str, small: bool, batch: int, image: int, warmup: int, steps: int) -> float:
    pl.seed_everything(0, verbose=False)
    timer = Throughput(warmup, steps)
    trainer = pl.Trainer(
        accelerator=device, devices=1, plugins=[plugin], max_steps=warmup + steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[timer],
    )  # fmt: skip
    # Pinned: Lightning then moves each (one-index) batch without blocking; from pageable memory a host-to-device copy
    # waits for the device, which would hide what a step without syncs gains.
    loader = DataLoader(SyntheticImages(warmup + steps), batch_size=1, pin_memory=device == "cuda")
    trainer.fit(Classifier(small, batch, image), loader)
    return timer.seconds_per_step


def plain_loop_step(scaler: Any, device: str, small: bool, batch: int, image: int, warmup: int, steps: int) -> float:
    torch.manual_seed(0)
    net = make_network(small).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, image, image, generator=gen).to(device)
    y = torch.randint(0, 10 if small else 1000, (batch,), generator=gen).to(device)
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            synchronize(torch.device(device))
            start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.float16):
            loss = F.cross_entropy(net(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    synchronize(torch.device(device))
    return (time.perf_counter() - start) / steps


def training_rows(args: argparse.Namespace) -> list[Row]:
    device, small = args.device, args.small
    batch, image = (8, 32) if small else (args.batch, 224)
    warmup, steps = (2, 4) if small else (args.warmup, args.steps)
    sizes = (small, batch, image, warmup, steps)
    sides: dict[str, tuple[Callable[[], float], Callable[[], float]]] = {
        "16-mixed": (
            lambda: lightning_step(MixedPrecisionPlugin("16-mixed", device=device), device, *sizes),
            lambda: lightning_step(MixedPrecision("16-mixed", device), device, *sizes),
        ),
        "bf16-mixed": (
            lambda: lightning_step(MixedPrecisionPlugin("bf16-mixed", device=device), device, *sizes),
            lambda: lightning_step(MixedPrecision("bf16-mixed", device), device, *sizes),
        ),
        "plain loop fp16": (
            lambda: plain_loop_step(DynamicLossScaler(device), device, *sizes),
            lambda: plain_loop_step(torch.amp.GradScaler(device), device, *sizes),
        ),
    }
    rows = []
    model = "small CNN" if small else "ResNet-50"
    for name, (ours, theirs) in sides.items():
        started = time.perf_counter()
        mine: list[float] = []
        reference: list[float] = []
        for r in range(args.rounds):
            for fn, out in ((ours, mine), (theirs, reference)) if r % 2 == 0 else ((theirs, reference), (ours, mine)):
                out.append(fn())
        a, b = statistics.median(mine), statistics.median(reference)
        against = "GradScaler" if name.startswith("plain") else "Lightning MixedPrecision"
        rows.append(Row(
            f"train step {name}", "ok",
            f"{model} batch {batch}, fused AdamW: ours {a * 1e3:.1f} ms, {against} {b * 1e3:.1f} ms, "
            f"ratio {a / b:.3f}x ({args.rounds} rounds x {steps} steps)",
            time.perf_counter() - started,
        ))  # fmt: skip
        print(f"{rows[-1].check}: {rows[-1].detail}", flush=True)
    return rows


# --------------------------------------------------------------------------------------------------------- FP8
def llama(small: bool, layers: int, seq: int) -> nn.Module:
    """litgpt's GPT with Llama-3-8B's shapes (``layers`` blocks), or a tiny one of the same kind for ``--small``."""
    import litgpt

    if small:
        config = litgpt.Config.from_name(
            "Llama-3-8B", n_layer=1, n_embd=64, n_head=4, n_query_groups=1, intermediate_size=128, vocab_size=256,
            padded_vocab_size=256, block_size=seq,
        )  # fmt: skip
    else:
        config = litgpt.Config.from_name("Llama-3-8B", n_layer=layers, block_size=seq)
    model: nn.Module = litgpt.GPT(config)
    return model


@dataclass
class FP8Side:
    """One side of the FP8 comparison: bf16-mixed (``recipe=None``), torchao's recipe alone, or ``FP8Training``."""

    name: str
    recipe: str | None
    ours: bool
    compiled: bool
    times: list[float]


def step_peak(device: str, step: Callable[[], float]) -> int:
    """The most bytes one step held allocated at once above what was live before it (CUDA's allocator statistics;
    on CPU the profiler's memory events, as ``bench_fp8.py`` measures them)."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return int(torch.cuda.max_memory_allocated() - before)
    from bench_fp8 import peak_bytes  # same directory

    return peak_bytes(step)


def fp8_train_steps(side: FP8Side, args: argparse.Namespace, small: bool, checks: bool = False) -> dict[str, float]:
    """Build (and compile) one model and train it; the median seconds of plain steps (and of check steps, with the
    peak memory of each kind)."""
    from lightning_amp_plus.weights.fp8 import FP8Training

    device, seq = args.device, (64 if small else args.fp8_seq)
    batch = 2 if small else args.fp8_batch
    torch.manual_seed(0)
    model = llama(small, args.fp8_layers, seq).to(device)
    fp8 = None
    every_but_the_head = lambda _m, name: name != "lm_head"  # noqa: E731  # as torchtitan leaves its output layer
    if side.recipe is not None and side.ours:
        fp8 = FP8Training(side.recipe, modules=every_but_the_head, fallback=None)  # type: ignore[arg-type]
        fp8.convert(model)
    elif side.recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        from lightning_amp_plus.weights.fp8 import eligible

        config = Float8LinearConfig.from_recipe_name(side.recipe)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: eligible(m) and n != "lm_head")
    # --small on CPU compiles with aot_eager: inductor's C++ compile of the compiled sides takes many minutes there.
    backend = "aot_eager" if small and device == "cpu" else "inductor"
    compiled = torch.compile(model, backend=backend) if side.compiled else model
    vocab = model.config.padded_vocab_size  # type: ignore[union-attr]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)

    def step(check: bool) -> float:
        synchronize(torch.device(device))
        started = time.perf_counter()
        if check and fp8 is not None:
            fp8.start_check()
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = compiled(tokens[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fp8 is not None:
            fp8.after_step()
        synchronize(torch.device(device))
        return time.perf_counter() - started

    warmup, steps = (2, 4) if small else (args.warmup, args.steps)
    for i in range(warmup):
        step(checks and i == warmup - 1)  # a check step in the warm-up too: its graph compiles there
    plain = [step(False) for _ in range(steps)]
    result = {"plain": statistics.median(plain)}
    if checks:
        result["check"] = statistics.median(step(True) for _ in range(max(2, steps // 4)))
        result["plain peak"] = step_peak(device, lambda: step(False))
        result["check peak"] = step_peak(device, lambda: step(True))
    return result


def fp8_sides(args: argparse.Namespace) -> list[FP8Side]:
    """bf16-mixed, torchao's tensorwise recipe and ours, eager and compiled; rowwise (torchao's and ours) compiled."""
    modes = (False, True) if args.fp8_compile else (False,)
    sides = []
    for compiled in modes:
        sides += [
            FP8Side("bf16-mixed", None, ours=False, compiled=compiled, times=[]),
            FP8Side("torchao tensorwise", "tensorwise", ours=False, compiled=compiled, times=[]),
            FP8Side("fp8-mixed tensorwise", "tensorwise", ours=True, compiled=compiled, times=[]),
        ]
    if args.fp8_compile:
        sides += [
            FP8Side("torchao rowwise", "rowwise", ours=False, compiled=True, times=[]),
            FP8Side("fp8-mixed rowwise", "rowwise", ours=True, compiled=True, times=[]),
        ]
    return sides


def fp8_rows(args: argparse.Namespace) -> list[Row]:
    small = args.small
    sides = fp8_sides(args)
    started = time.perf_counter()
    checks: dict[bool, list[dict[str, float]]] = {}
    for r in range(args.fp8_rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            timed = fp8_train_steps(side, args, small, checks=side.ours and side.recipe == "tensorwise")
            torch._dynamo.reset()  # the next model compiles afresh (its graphs are not the last one's)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()  # the last model's memory, freed on return, back to the device
            side.times.append(timed["plain"])
            if "check" in timed:
                checks.setdefault(side.compiled, []).append(timed)
    seconds = time.perf_counter() - started
    shape = "tiny Llama (1 block, 64 wide)" if small else f"Llama-3-8B shapes, {args.fp8_layers} blocks"
    tokens = (2 * 64) if small else args.fp8_batch * args.fp8_seq
    median = {(side.name, side.compiled): statistics.median(side.times) for side in sides}
    rows = []
    for side in sides:
        if not side.ours:
            continue
        mode = "compiled" if side.compiled else "eager"
        ms = median[(side.name, side.compiled)]
        bf16, torchao = median[("bf16-mixed", side.compiled)], median[(f"torchao {side.recipe}", side.compiled)]
        speed, ours_vs_torchao = bf16 / ms, (1 / ms) / (1 / torchao)
        target = not side.compiled or small or speed >= 1.2  # torchao's speed-ups are published compiled
        rows.append(
            Row(
                f"{side.name} {mode} vs bf16-mixed and torchao",
                "ok" if target else "below target",
                f"{shape}, {tokens} tokens/step, {mode}: {tokens / ms:,.0f} tokens/s; bf16-mixed "
                f"{tokens / bf16:,.0f} ({speed:.2f}x{', target >= 1.2x' if side.compiled else ''}); torchao's recipe "
                f"{tokens / torchao:,.0f} ({ours_vs_torchao:.3f}x); {args.fp8_rounds} round(s)",
                seconds / len(sides),
            )
        )
    for compiled, found in checks.items():
        mode = "compiled" if compiled else "eager"
        check, plain = statistics.median(t["check"] for t in found), statistics.median(t["plain"] for t in found)
        overhead = (check / plain - 1) / 50
        peak, check_peak = (
            statistics.median(t["plain peak"] for t in found),
            statistics.median(t["check peak"] for t in found),
        )
        rows.append(
            Row(
                f"fp8-mixed readings every 50 steps, {mode}",
                "ok" if small or overhead <= 0.01 else "above target",
                f"check step {check * 1e3:.1f} ms vs ordinary {plain * 1e3:.1f} ms ({check / plain:.2f}x): "
                f"{overhead:+.2%} per step at 50 (target <= 1%); peak memory of a step {check_peak / 2**20:,.1f} MiB "
                f"vs {peak / 2**20:,.1f} MiB ({check_peak / max(peak, 1):.3f}x)",
                0.0,
            )
        )
    for row in rows:
        print(f"{row.check}: {row.detail}", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="tiny sizes everywhere (for trying the script on CPU)")
    parser.add_argument("--batch", type=int, default=256, help="ResNet-50 batch (default 256)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per comparison")
    parser.add_argument("--skip", nargs="*", default=[], choices=("tests", "grads", "fused", "train", "fp8"))
    parser.add_argument("--fp8-layers", type=int, default=4, help="Llama-3-8B blocks of the FP8 model (default 4)")
    parser.add_argument("--fp8-batch", type=int, default=2, help="sequences per FP8 step (default 2)")
    parser.add_argument("--fp8-seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    parser.add_argument("--fp8-eager", dest="fp8_compile", action="store_false", help="FP8 rows eager only")
    parser.add_argument("--fp8-rounds", type=int, default=1, help="rounds of the FP8 rows (each builds 8 models)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; try --device cpu --small")
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    started = time.perf_counter()
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (sizes shrunk: numbers mean nothing)"
    print(f"gpu_check: torch {torch.__version__}, lightning {pl.__version__}, {where}", flush=True)

    quick = ["--quick"] if args.small else []
    rows: list[Row] = []
    if "tests" not in args.skip:
        rows.append(pytest_row(args.device, timeout_s=150))
    if "grads" not in args.skip:
        rows.append(bench_rows("bench_grads.py", ["--device", args.device, *quick], 150, grads_summary))
    if "fused" not in args.skip:
        # --small: host reads counted over 20 steps, not 100, so that the part fits its time limit on a shared CPU.
        counted = ["--count-steps", "20"] if args.small else []
        rows.append(bench_rows("bench_fused.py", ["--device", args.device, *quick, *counted], 150, fused_summary))
    if "train" not in args.skip:
        try:
            rows.extend(training_rows(args))
        except Exception as error:  # report, and still print the table
            rows.append(Row("train step", "FAILED", f"{type(error).__name__}: {error}"))
    if "fp8" not in args.skip:
        try:
            rows.extend(fp8_rows(args))
        except Exception as error:  # report, and still print the table
            rows.append(Row("fp8", "FAILED", f"{type(error).__name__}: {error}"))

    print()
    print(f"## gpu_check on {where} ({time.perf_counter() - started:.0f} s)")
    print()
    print("| check | result | numbers | s |")
    print("|---|---|---|---:|")
    for row in rows:
        print(f"| {row.check} | {row.result} | {row.detail} | {row.seconds:.0f} |")
    sys.exit(0 if all(row.result.startswith("ok") for row in rows) else 1)


if __name__ == "__main__":
    main()
