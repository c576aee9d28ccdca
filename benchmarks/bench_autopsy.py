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

       The variants take turns one step at a time (the order rotated every step), so that the noise of a machine shared
       with other processes falls on all of them alike; each step is timed alone, and each headroom reading apart from
       its step. Two measures:

       * timed additions (ours only): the RNG capture is timed inside each step and each reading on its own; what the
         autopsy or the headroom adds to a step on average is the median capture plus the median reading divided by
         N, reported against plain's median step. This is the number the targets are read against: the additions are
         all that differs from plain, and timing them directly keeps them clear of the step-to-step noise.
       * A/B: each variant's median step time (plus median reading / N) against plain's, the ratio of medians, with its
         range over rounds of 50 steps; on a loaded machine this moves by several percent either way.

       A first round of 50 steps warms up and is dropped; no new round starts once ``--budget-s`` have passed.
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

from lightning_amp_plus.diagnostics.autopsy import run_autopsy
from lightning_amp_plus.diagnostics.headroom import measure_headroom
from lightning_amp_plus.diagnostics.replay import RngState

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

    Mutable state: ``model`` and ``opt`` train; ``steps`` (one list of step times per round) and ``readings`` (the
    times of the headroom readings) grow.
    """

    def __init__(self, name: str, base: nn.Module, nan_detector: ModuleType | None) -> None:
        self.name = name
        self.model = copy.deepcopy(base)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.steps: list[list[float]] = []
        self.captures: list[float] = []
        self.readings: list[float] = []
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
        """One training step, timed; every ``interval`` steps a headroom reading after it, timed apart."""
        start = time.perf_counter()
        rng = RngState.capture() if self.capture else None
        if self.capture:
            self.captures.append(time.perf_counter() - start)
        with torch.autograd.detect_anomaly() if self.anomaly else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=BF16):
                loss = F.mse_loss(self.model(x).float(), y)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        middle = time.perf_counter()
        self.steps[-1].append(middle - start)
        if self.interval and i % self.interval == 0:
            measure_headroom(self.model, lambda: F.mse_loss(self.model(x).float(), y), scale=1.0, dtype=BF16, rng=rng)
            self.readings.append(time.perf_counter() - middle)

    def median_step(self, r: int | None = None) -> float:
        """The median step time (of round ``r``, or of all rounds); a headroom reading is not part of its step."""
        return statistics.median(self.steps[r] if r is not None else [t for round_ in self.steps for t in round_])

    def added(self) -> float:
        """What the autopsy or the headroom adds to a step on average, timed directly: the RNG capture, and the
        median reading once per ``interval``."""
        capture = statistics.median(self.captures) if self.captures else 0.0
        return capture + (statistics.median(self.readings) / self.interval if self.interval else 0.0)

    def per_step(self, r: int | None = None) -> float:
        """The step as a run pays it on average: the median step plus the median reading once per ``interval``."""
        return self.median_step(r) + (statistics.median(self.readings) / self.interval if self.interval else 0.0)


def time_variants(args: argparse.Namespace, nan_detector: ModuleType | None) -> list[Variant]:
    """Step the variants in turn, one step each (the order rotated every step), rounds of ``ROUND`` steps."""
    names = ["plain", "autopsy", "headroom N=1", "headroom N=50", "detect_anomaly", "DebugUnderflowOverflow"]
    names += ["NanDetector"] if nan_detector is not None else []
    base = mlp(args.width)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, args.width, generator=generator), torch.randn(64, 1, generator=generator))] * 4
    variants = [Variant(name, base, nan_detector) for name in names]
    started = time.perf_counter()
    for r in range(args.rounds + 1):  # round 0 warms up, dropped
        for variant in variants:
            variant.steps.append([])
        for i in range(ROUND):
            turn = (r * ROUND + i) % len(variants)
            for variant in variants[turn:] + variants[:turn]:
                variant.step(i, *batches[i % len(batches)])
        if r == 0:
            for variant in variants:
                variant.steps, variant.captures, variant.readings = [], [], []
        elif r >= 2 and time.perf_counter() - started > args.budget_s:
            break
    return variants


def timing_table(variants: list[Variant]) -> str:
    plain = variants[0]
    base = plain.median_step()
    lines = [
        "| variant | median step (ms) | headroom reading (ms) | added per step, timed (ms) | overhead from the timed "
        "additions | A/B: per-step cost vs plain (ratio of medians) | A/B per round [min, max] |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in variants:
        reading = f"{statistics.median(v.readings) * 1e3:.2f}, every {v.interval}" if v.interval else ""
        timed = ""
        if v.captures:
            ratio = 1 + v.added() / base
            target = f" {verdict(ratio, TARGETS[v.name])}" if v.name in TARGETS else ""
            timed = f"{v.added() * 1e3:.3f} | {ratio:.4f}x{target}"
        else:
            timed = " | "
        rounds = [v.per_step(r) / plain.per_step(r) for r in range(len(v.steps))]
        lines.append(
            f"| {v.name} | {v.median_step() * 1e3:.2f} | {reading} | {timed} | {v.per_step() / base:.3f}x "
            f"| [{min(rounds):.3f}, {max(rounds):.3f}] |"
        )
    return "\n".join(lines)


def faults_ratio(variants: list[Variant]) -> dict[str, float]:
    """Healthy-step cost per tool: ours from the timed additions, the anchors' A/B."""
    base = variants[0].median_step()
    return {v.name: 1 + v.added() / base if v.captures else v.per_step() / base for v in variants}


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
    ratios = faults_ratio(variants)
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
    print(f"\n{len(variants[0].steps)} rounds of {ROUND} steps (6-block MLP, bf16 autocast, CPU)\n")
    print(timing_table(variants))
    print("\nThe three faults (3-block MLP, fp16 autocast, CPU):\n")
    print(faults_table(nan_detector, variants))
    print(f"\nload after: {load():.2f}")


if __name__ == "__main__":
    main()
