"""Benchmark the overflow autopsy and the per-layer headroom against the tools users reach for today.

What is measured
    1. Healthy-step overhead. A 6-block MLP (``--width`` 512, Linear-GELU blocks, a Linear head, batch 64, MSE loss,
       AdamW) trained under bf16 autocast on CPU, one step = forward, backward, ``optimizer.step()``,
       ``zero_grad()``. Variants, each training its own deepcopy of the same model on the same batches:

       * ``plain``: the step alone (the reference).
       * ``autopsy``: what the autopsy adds to a healthy step: ``RngState.capture()`` at the start of each batch.
         Nothing else runs until a step is skipped.
       * ``headroom N=1`` / ``headroom N=50``: the capture, plus ``measure_headroom`` after every step / every 50th.
       * ``detect_anomaly``: the step's forward and backward under ``torch.autograd.detect_anomaly()``
         (``Trainer(detect_anomaly=True)``).
       * ``DebugUnderflowOverflow``: transformers' forward hooks attached for the whole run.
       * ``NanDetector``: fairseq's forward and backward hooks attached for the whole run (its trainer attaches them
         only to replay a failing batch; this is their cost when attached). fairseq does not install on Python 3.11
         with torch 2.14 (its 0.12.2 pins and C extensions), so its one module, ``fairseq/nan_detector.py`` (torch and
         logging only), is loaded from the 0.12.2 release: ``pip download fairseq==0.12.2 --no-deps`` and pass the
         file with ``--nan-detector``; without it the row says so.

       Rounds of 50 steps (so a round holds exactly one headroom reading at N=50); in each round every variant runs its
       50 steps, in an order rotated round by round so that machine noise hits all alike; a first round is warm-up and
       dropped. Reported: the median round time of each variant and its ratio to plain's median (the ratio of
       medians), with the range of the per-round ratios. No new round starts once ``--budget-s`` have passed.
       Targets (issue 19, reported, never asserted): autopsy <= 1.01x, headroom at N=50 <= 1.05x.

    2. What each tool says about three injected faults on a 3-block MLP (width 16, batch 8) under fp16 autocast
       (``tests/autopsy_models.py``): A, a forward output beyond 65504 (``blocks.1.fc``); B, gradients inf at scale
       2**24 and finite at 1 (the scaled loss gradient overflows entering the model's half output); C, a custom
       backward returning inf (``blocks.1.extra``). Each anchor watches one plain forward and ``(loss *
       scale).backward()``; ours is ``run_autopsy`` after the fact.

Run
    python benchmarks/bench_autopsy.py --nan-detector /path/to/fairseq/nan_detector.py   # ~4 min on 2 cores
    python benchmarks/bench_autopsy.py --quick      # a smoke test, under a minute
    python benchmarks/bench_autopsy.py --threads 2  # default 1: steadier on a machine shared with other processes
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import logging
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from _ab import load, verdict  # same directory
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from autopsy_models import batch, fault_a, fault_b, fault_c, finite, mse

from lightning_amp_plus.numerics.autopsy import run_autopsy
from lightning_amp_plus.numerics.headroom import measure_headroom
from lightning_amp_plus.numerics.replay import RngState

ROUND = 50
BF16, FP16 = torch.bfloat16, torch.float16
TARGETS = {"autopsy": 1.01, "headroom N=50": 1.05}
FAULTS = {"A": (fault_a, 2.0**16), "B": (fault_b, 2.0**24), "C": (fault_c, 2.0**16)}


def mlp(width: int, depth: int = 6) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def load_nan_detector(path: str | None) -> ModuleType | None:
    """fairseq's ``nan_detector`` module: installed, or loaded from the file given."""
    with contextlib.suppress(ImportError):
        import fairseq.nan_detector as installed  # type: ignore[import-not-found]

        return installed  # type: ignore[no-any-return]
    if path is None or not Path(path).is_file():
        return None
    spec = importlib.util.spec_from_file_location("fairseq_nan_detector", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.logger.setLevel(logging.CRITICAL)  # quiet while timing; the fault table attaches its own handler
    return module


class Variant:
    """One side of the timing: its model, optimizer and what it adds to the step.

    Mutable state: ``model`` and ``opt`` train; ``rounds`` collects the round times.
    """

    def __init__(self, name: str, base: nn.Module, nan_detector: ModuleType | None) -> None:
        self.name = name
        self.model = copy.deepcopy(base)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.rounds: list[float] = []
        self.interval = {"headroom N=1": 1, "headroom N=50": ROUND}.get(name, 0)
        self.capture = name == "autopsy" or self.interval > 0
        self.anomaly = name == "detect_anomaly"
        if name == "DebugUnderflowOverflow":
            from transformers.debug_utils import DebugUnderflowOverflow

            with contextlib.redirect_stdout(io.StringIO()):
                DebugUnderflowOverflow(self.model)
        if name == "NanDetector":
            assert nan_detector is not None
            nan_detector.NanDetector(self.model)  # hooks stay attached (never closed)

    def step(self, i: int, x: Tensor, y: Tensor) -> None:
        rng = RngState.capture() if self.capture else None
        with torch.autograd.detect_anomaly() if self.anomaly else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=BF16):
                loss = F.mse_loss(self.model(x).float(), y)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.interval and i % self.interval == 0:
            measure_headroom(self.model, lambda: F.mse_loss(self.model(x).float(), y), scale=1.0, dtype=BF16, rng=rng)

    def run_round(self, batches: list[tuple[Tensor, Tensor]]) -> float:
        start = time.perf_counter()
        for i in range(ROUND):
            self.step(i, *batches[i % len(batches)])
        return time.perf_counter() - start


def time_variants(args: argparse.Namespace, nan_detector: ModuleType | None) -> list[Variant]:
    names = ["plain", "autopsy", "headroom N=1", "headroom N=50", "detect_anomaly", "DebugUnderflowOverflow"]
    names += ["NanDetector"] if nan_detector is not None else []
    base = mlp(args.width)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, args.width, generator=generator), torch.randn(64, 1, generator=generator))] * 4
    variants = [Variant(name, base, nan_detector) for name in names]
    for variant in variants:  # warm-up round, dropped
        variant.run_round(batches)
    started = time.perf_counter()
    for r in range(args.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for variant in order if r % 2 == 0 else reversed(order):
            variant.rounds.append(variant.run_round(batches))
        if r >= 1 and time.perf_counter() - started > args.budget_s:
            break
    return variants


def timing_table(variants: list[Variant]) -> str:
    plain = variants[0]
    base = statistics.median(plain.rounds)
    lines = [
        "| variant | median step (ms) | vs plain (ratio of medians) | per-round ratios [min, max] | target |",
        "|---|---|---|---|---|",
    ]
    for v in variants:
        median = statistics.median(v.rounds)
        ratios = [a / b for a, b in zip(v.rounds, plain.rounds, strict=True)]
        target = verdict(median / base, TARGETS[v.name]) if v.name in TARGETS else ""
        lines.append(
            f"| {v.name} | {median / ROUND * 1e3:.2f} | {median / base:.3f}x | [{min(ratios):.3f}, {max(ratios):.3f}] "
            f"| {target} |"
        )
    return "\n".join(lines)


# --- what each tool says about the faults ---------------------------------------------------------------------------


def plain_step(model: nn.Module, scale: float) -> None:
    with torch.autocast("cpu", dtype=FP16):
        loss = mse(model, batch())()
    (loss * scale).backward()


def says_detect_anomaly(make: Callable[[], nn.Module], scale: float, nan_detector: Any) -> str:
    model = make()
    try:
        with torch.autograd.detect_anomaly():
            plain_step(model, scale)
    except RuntimeError as error:
        node = re.search(r"Function '(\w+)'", str(error))
        return f"raises, names `{node.group(1) if node else '?'}`"
    return "silent" if not finite([p.grad for p in model.parameters() if p.grad is not None]) else "nothing to see"


def says_debug_underflow_overflow(make: Callable[[], nn.Module], scale: float, nan_detector: Any) -> str:
    from transformers.debug_utils import DebugUnderflowOverflow

    model, out = make(), io.StringIO()
    with contextlib.redirect_stdout(out):
        DebugUnderflowOverflow(model)
        try:
            plain_step(model, scale)
        except ValueError:
            frames = re.findall(r"^ {10,}(\S+) (\w+)$", out.getvalue(), flags=re.MULTILINE)
            return f"names `{frames[-1][0]}` (forward)" if frames else "raises, no layer"
    return "silent"


def says_nan_detector(make: Callable[[], nn.Module], scale: float, nan_detector: Any) -> str:
    if nan_detector is None:
        return "not available"
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    nan_detector.logger.addHandler(handler)
    nan_detector.logger.setLevel(logging.WARNING)
    model = make()
    try:
        with warnings.catch_warnings(), nan_detector.NanDetector(model):
            warnings.simplefilter("ignore")  # register_backward_hook is deprecated
            plain_step(model, scale)
    finally:
        nan_detector.logger.removeHandler(handler)
        nan_detector.logger.setLevel(logging.CRITICAL)
    found = [re.search(r"(NaN|Inf) detected in output of (\S+?),.*(forward|backward)", m) for m in messages]
    hits = [f"{m.group(3)}: `{m.group(2)}`" for m in found if m]
    return "; ".join(hits) or "silent"


def says_ours(make: Callable[[], nn.Module], scale: float, nan_detector: Any) -> str:
    model = make()
    record = run_autopsy(model, mse(model, batch()), rng=RngState.capture(), scale=scale, step=0, dtype=FP16)
    if record is None:
        return "None (did not reproduce)"
    safe = f", safe_scale 2**{int(record.safe_scale).bit_length() - 1}" if record.safe_scale else ""
    return f'"{record.kind}", `{record.module}`{safe}'


TOOLS = {
    "`torch.autograd.detect_anomaly`": says_detect_anomaly,
    "transformers `DebugUnderflowOverflow`": says_debug_underflow_overflow,
    "fairseq `NanDetector`": says_nan_detector,
    "**ours** (`run_autopsy`)": says_ours,
}
HEALTHY = {
    "`torch.autograd.detect_anomaly`": "detect_anomaly",
    "transformers `DebugUnderflowOverflow`": "DebugUnderflowOverflow",
    "fairseq `NanDetector`": "NanDetector",
    "**ours** (`run_autopsy`)": "autopsy",
}


def faults_table(nan_detector: ModuleType | None, variants: list[Variant]) -> str:
    ratios = {v.name: statistics.median(v.rounds) / statistics.median(variants[0].rounds) for v in variants}
    lines = ["| tool | A | B | C | healthy step |", "|---|---|---|---|---|"]
    for tool, says in TOOLS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cells = [says(make, scale, nan_detector) for make, scale in FAULTS.values()]
        healthy = ratios.get(HEALTHY[tool])
        lines.append(f"| {tool} | {' | '.join(cells)} | {'n/a' if healthy is None else f'{healthy:.2f}x'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--nan-detector", default=None, help="path to fairseq 0.12.2's fairseq/nan_detector.py")
    parser.add_argument("--quick", action="store_true", help="width 128, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.width, args.rounds = 128, 3
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*Anomaly Detection has been enabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    nan_detector = load_nan_detector(args.nan_detector)
    print(f"torch {torch.__version__}, {args.threads} thread(s), width {args.width}, load {load():.2f}")
    variants = time_variants(args, nan_detector)
    print(f"\n{len(variants[0].rounds)} rounds of {ROUND} steps (6-block MLP, bf16 autocast, CPU)\n")
    print(timing_table(variants))
    print("\nThe three faults (3-block MLP, fp16 autocast, CPU):\n")
    print(faults_table(nan_detector, variants))
    print(f"\nload after: {load():.2f}")


if __name__ == "__main__":
    main()
