"""Benchmark the spike guard: what finite gradient spikes cost, what skipping or clipping them saves, false positives.

What is run
    Plain torch training loops (the guard is numerics; the plugins will call it from their step), fp32, one thread:

    * ``gpt``: a tiny litgpt GPT (2 layers, 64 wide, 2 heads, block 32, vocabulary 64) on a first-order Markov chain
      over 64 tokens (``bench_compensated.py``'s task: loss floor 1.25 nats), fresh batches of 16 x 32 tokens.
      ``adamw``: AdamW(lr 1e-3, betas (0.9, 0.95), weight decay 0.1); ``sgd``: SGD(lr 0.1, momentum 0.9); both under a
      linear warm-up (10% of the steps) then a cosine to 10% of the peak.
    * ``mlp``: a student MLP (32 -> 256 -> 256 -> 1, tanh) regressing a random teacher of the same shape, fresh
      batches of 128, MSE. ``adamw``: AdamW(lr 1e-3) (torch's betas (0.9, 0.999)); ``sgd``: SGD(lr 0.02, momentum 0.9);
      constant lr.

    Scenarios (the data stream is the same for every method of a scenario and seed):

    * ``clean``: nothing injected.
    * ``spikes``: four finite spike batches: at 25% and 60% of the steps the loss is multiplied by 1e3; at 40% and 80%
      the targets are corrupted (gpt: uniformly random tokens; mlp: random values at 10x the batch's target spread).
    * ``shift``: at 50% the data change for good (gpt: another Markov chain; mlp: another teacher). Not a spike: what
      a guard must not block. Run on the first seed only (``--shift-seeds``): what it shows is qualitative.

    Methods: ``none`` (no guard); ``skip`` and ``clip``, the guard at its defaults (``SpikeGuard()``,
    ``SpikeGuard(action="clip")``); ``fixed`` (``spikes`` only), ``clip_grad_norm_(max_norm=1.0)`` on every step
    (litgpt's default ``max_norm``); ``clip-nothing`` (``shift`` only), the clip guard with a clipped step entering
    nothing into the statistics (the alternative to entering its clipped norm, which differs from it only when many
    steps in a row are clipped). Each step: forward, backward, the global L2 norm of the gradients
    (``torch.nn.utils.get_total_norm``, the number the plugins' check measures), then the guard's ``judge``; a skip
    applies nothing (the optimizer, its state and the LR schedule are left as they are); a clip multiplies the
    gradients by the verdict's coefficient; then the optimizer step and ``observe``.

    The result of a run: the mean train loss of its last 50 steps (no spike there); the steps the guard flagged; for
    every injected spike, its norm over the running mean and its z-score ``(norm - mean) / std``.

    False positives: the steps the default guard flags on the ``clean`` runs above and on clean Trainer runs of the
    shipped models on their synthetic data (fp32, 10 epochs of 32 batches, the ``amp-plus train`` sizes): ``cnn``,
    ``CifarCNN(width=16)`` with its SGD (lr 0.05, momentum 0.9) and cosine schedule; ``cnn-onecycle``, AdamW lr 3e-3
    with a one-cycle schedule (an LR warm-up); ``lstm``, ``ImdbLSTM(embed_dim=32, hidden_dim=64)`` with AdamW lr 1e-2;
    ``lstm-onecycle``, the same with a one-cycle schedule. A callback measures the norm in
    ``on_before_optimizer_step`` and counts what the guard would flag (it changes nothing).

    The statistic's choice: every clean run's norms, replayed through ``SpikeGuard`` with other decays and warm-ups,
    give the largest z-score after the warm-up (a threshold above it flags nothing there: exact, since nothing flagged
    means nothing changed); the ``skip`` runs' norms, replayed with the injected steps left out, give each injected
    spike's z-score under the same settings (exact for any setting that flags exactly the injected steps: the run is
    then the same). A spike in the warm-up: on each clean run's norms, a norm of 1000x the running mean entered at
    step 75, and the steps until a spike of 4x, 30x or 1000x is flagged again. The guard's cost: ``judge`` +
    ``observe`` per step, timed, against the median gpt step.

Usage
    python benchmarks/bench_spikes.py --json runs.json       # the full tables: ~30 min on 2 shared CPU cores
    python benchmarks/bench_spikes.py --from-json runs.json  # the tables again from the saved runs, in seconds
    python benchmarks/bench_spikes.py --quick                # a smoke run (a few minutes): 400 steps, adamw, 1 seed
    python benchmarks/bench_spikes.py --tasks mlp --no-trainer --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
import sys
import time
import timeit
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from bench_compensated import VOCAB, gpt, markov_batches, mlp, transition_matrix, warmup_cosine  # same directory

from lightning_amp_plus.step.spikes import DEFAULT_ALPHA, DEFAULT_WARMUP, SpikeGuard, SpikeVerdict

SCENARIOS = {
    "clean": ("none",),
    "spikes": ("none", "skip", "clip", "fixed"),
    "shift": ("none", "skip", "clip", "clip-nothing"),
}
SCALE_AT, CORRUPT_AT, SHIFT_AT = (0.25, 0.60), (0.40, 0.80), 0.50
FIXED_MAX_NORM = 1.0
GUARDED = ("skip", "clip", "clip-nothing")
LOSS_SCALE = 1e3
GPT_BATCH = 16
GRID_ALPHAS = (1.0, 0.99, 0.98, 0.97, 0.95, 0.9)
GRID_WARMUPS = (25, 50, 100, 200)
ZCLIP = {"threshold": 2.5, "warmup": 25, "alpha": 0.97}  # ZClip's published defaults


# ------------------------------------------------------------------------------------------------ data
def teacher(seed: int) -> nn.Module:
    """A random MLP of the student's shape, weights ~ N(0, 1/fan_in)."""
    model = mlp(seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)
    return model


@dataclass
class Stream:
    """The batches of one run: ``loss(step)`` draws the step's batch (clean, injected or shifted) and returns its loss
    and the loss to differentiate (the loss times 1e3 on a scaled spike)."""

    loss: Callable[[int], tuple[Tensor, Tensor]]
    injected: dict[int, str]


def schedule(scenario: str, steps: int) -> tuple[dict[int, str], int | None]:
    """The injected steps (step -> "scale" | "corrupt") and the shift step of ``scenario``."""
    if scenario == "spikes":
        injected = {int(f * steps): "scale" for f in SCALE_AT} | {int(f * steps): "corrupt" for f in CORRUPT_AT}
        return dict(sorted(injected.items())), None
    return {}, int(SHIFT_AT * steps) if scenario == "shift" else None


def gpt_stream(model: nn.Module, scenario: str, seed: int, steps: int) -> Stream:
    injected, shift = schedule(scenario, steps)
    before = markov_batches(transition_matrix(), seed, batch=GPT_BATCH)
    after = markov_batches(transition_matrix(4321), seed, batch=GPT_BATCH)
    corrupt = torch.Generator().manual_seed(seed + 777)

    def loss(step: int) -> tuple[Tensor, Tensor]:
        tokens = next(after if shift is not None and step >= shift else before)
        targets = tokens[:, 1:]
        if injected.get(step) == "corrupt":
            targets = torch.randint(0, VOCAB, targets.shape, generator=corrupt)
        value = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), targets.reshape(-1))
        return value, value * LOSS_SCALE if injected.get(step) == "scale" else value

    return Stream(loss, injected)


def mlp_stream(model: nn.Module, scenario: str, seed: int, steps: int) -> Stream:
    injected, shift = schedule(scenario, steps)
    before, after = teacher(10_000), teacher(20_000)
    inputs, corrupt = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 777)

    def loss(step: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(128, 32, generator=inputs)
        with torch.no_grad():
            y = (after if shift is not None and step >= shift else before)(x)
        if injected.get(step) == "corrupt":
            y = torch.randn(y.shape, generator=corrupt) * 10 * y.std()
        value = F.mse_loss(model(x), y)
        return value, value * LOSS_SCALE if injected.get(step) == "scale" else value

    return Stream(loss, injected)


# ------------------------------------------------------------------------------------------------ one run
@dataclass
class Result:
    task: str
    optimizer: str
    scenario: str
    method: str
    seed: int
    loss: float
    flagged: list[int] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    injected: dict[int, str] = field(default_factory=dict)
    spike_z: dict[int, float] = field(default_factory=dict)
    spike_ratio: dict[int, float] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def workload(self) -> str:
        return f"{self.task}-{self.optimizer}"

    @property
    def label(self) -> str:
        """The workload's name in tables (a Trainer run: the shipped model's)."""
        return f"{self.task} (Trainer)" if self.method == "trainer" else self.workload


def z_of(verdict: SpikeVerdict) -> float:
    """The z-score of the verdict's norm against the statistics it was judged by (inf when they show no spread)."""
    return (verdict.norm - verdict.mean) / verdict.std if verdict.std > 0 else math.inf


def build(task: str, optimizer: str, seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = (gpt if task == "gpt" else mlp)(seed)
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = (
            torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
            if task == "gpt"
            else torch.optim.AdamW(model.parameters(), lr=1e-3)
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1 if task == "gpt" else 0.02, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps)) if task == "gpt" else None
    return model, opt, scheduler


def train(task: str, optimizer: str, scenario: str, method: str, seed: int, steps: int) -> Result:
    started = time.perf_counter()
    model, opt, scheduler = build(task, optimizer, seed, steps)
    stream = (gpt_stream if task == "gpt" else mlp_stream)(model, scenario, seed, steps)
    params = [p for p in model.parameters() if p.requires_grad]
    guard = SpikeGuard(action="clip" if method.startswith("clip") else "skip") if method in GUARDED else None
    result = Result(task, optimizer, scenario, method, seed, math.nan, injected=stream.injected)
    losses = []
    for step in range(steps):
        begun = time.perf_counter()
        value, differentiated = stream.loss(step)
        differentiated.backward()
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads).item()
        result.norms.append(norm)
        losses.append(value.item())
        if guard is not None:
            if not math.isfinite(norm):  # an overflow: skipped before the guard is asked, as the plugins do
                opt.zero_grad(set_to_none=True)
                continue
            verdict = guard.judge(norm)
            if step in stream.injected:
                result.spike_z[step] = z_of(verdict)
                result.spike_ratio[step] = norm / verdict.mean if verdict.mean > 0 else math.inf
            if verdict.spike:
                result.flagged.append(step)
            if verdict.action == "skip":
                opt.zero_grad(set_to_none=True)  # nothing applied, the LR schedule held
                continue
            if verdict.action == "clip":
                torch._foreach_mul_(grads, verdict.coefficient)
            if not (verdict.action == "clip" and method == "clip-nothing"):
                guard.observe(verdict)
        elif method == "fixed":
            torch.nn.utils.clip_grad_norm_(params, FIXED_MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        result.step_s.append(time.perf_counter() - begun)
    result.loss = statistics.fmean(losses[-50:])
    result.seconds = time.perf_counter() - started
    return result


# ------------------------------------------------------------------------------------------------ Trainer runs
TRAINER_WORKLOADS: dict[str, dict[str, Any]] = {
    "cnn": {"model": "cnn", "optimizer": "sgd", "lr": 0.05, "scheduler": "cosine"},
    "cnn-onecycle": {"model": "cnn", "optimizer": "adamw", "lr": 3e-3, "scheduler": "onecycle"},
    "lstm": {"model": "lstm", "optimizer": "adamw", "lr": 1e-2, "scheduler": "none"},
    "lstm-onecycle": {"model": "lstm", "optimizer": "adamw", "lr": 1e-2, "scheduler": "onecycle"},
}


def load_result(saved: dict[str, Any]) -> Result:
    """A run written by ``--json`` (JSON keys are strings: the step numbers become ints again)."""
    by_step = {"injected", "spike_z", "spike_ratio"}
    fields = {k: {int(step): v for step, v in saved[k].items()} if k in by_step else saved[k] for k in saved}
    return Result(**fields)


def trainer_run(name: str, seed: int, epochs: int) -> Result:
    """A clean fit of a shipped model; a callback measures each step's norm and counts what the guard would flag."""
    import lightning.pytorch as pl

    from lightning_amp_plus.data.synthetic import SyntheticCIFAR10DataModule, SyntheticIMDBDataModule
    from lightning_amp_plus.models import CifarCNN, ImdbLSTM

    class WouldFlag(pl.Callback):
        def __init__(self) -> None:
            self.guard = SpikeGuard()
            self.norms: list[float] = []
            self.flagged: list[int] = []

        def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads).item()
            self.norms.append(norm)
            verdict = self.guard.judge(norm)
            if verdict.spike:
                self.flagged.append(len(self.norms) - 1)
            self.guard.observe(verdict)  # a skip verdict enters nothing, as the guard would have it

    started = time.perf_counter()
    spec = TRAINER_WORKLOADS[name]
    pl.seed_everything(seed, verbose=False)
    module: pl.LightningModule
    if spec["model"] == "cnn":
        data: pl.LightningDataModule = SyntheticCIFAR10DataModule(seed=seed)
        module = CifarCNN(width=16, optimizer=spec["optimizer"], lr=spec["lr"], scheduler=spec["scheduler"])
    else:
        imdb = SyntheticIMDBDataModule(seed=seed, max_len=60, min_len=20)
        data = imdb
        module = ImdbLSTM(
            vocab_size=imdb.vocab_size,
            pad_index=imdb.pad_index,
            embed_dim=32,
            hidden_dim=64,
            optimizer=spec["optimizer"],
            lr=spec["lr"],
            scheduler=spec["scheduler"],
        )
    watch = WouldFlag()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[watch],
    )
    trainer.fit(module, data)
    loss = float(trainer.callback_metrics.get("train/loss_epoch", math.nan))
    result = Result(name, spec["optimizer"], "clean", "trainer", seed, loss, watch.flagged, watch.norms)
    result.seconds = time.perf_counter() - started
    return result


# ------------------------------------------------------------------------------------------------ replays
def replay(
    norms: list[float], skip: set[int] | frozenset[int] = frozenset(), **settings: Any
) -> tuple[list[tuple[float, int]], dict[int, float], list[int]]:
    """Judge ``norms`` in order with ``SpikeGuard(**settings)``; the steps in ``skip`` are judged but never entered.

    Returns the (z-score, step) of the judged steps after the warm-up, the z-score of each step in ``skip`` (-inf in the
    warm-up), and the steps flagged (a flagged step enters as the guard's action says: nothing for a skip, its clipped
    norm for a clip).
    """
    guard = SpikeGuard(**settings)
    zs: list[tuple[float, int]] = []
    skipped: dict[int, float] = {}
    flagged: list[int] = []
    for step, norm in enumerate(norms):
        if not math.isfinite(norm):
            continue
        verdict = guard.judge(norm)
        decided = guard.steps >= guard.warmup and verdict.std > 0
        if step in skip:
            skipped[step] = z_of(verdict) if decided else -math.inf  # -inf: in the warm-up, never caught
            continue
        if decided:
            zs.append((z_of(verdict), step))
        if verdict.spike:
            flagged.append(step)
        guard.observe(verdict)
    return zs, skipped, flagged


# ------------------------------------------------------------------------------------------------ tables
def cell(values: list[float], digits: int = 4) -> str:
    if not values:
        return "-"
    if not all(math.isfinite(v) for v in values):
        finite = [v for v in values if math.isfinite(v)]
        bad = len(values) - len(finite)
        return f"diverged in {bad}/{len(values)}" + (f"; {statistics.fmean(finite):.{digits}f}" if finite else "")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def loss_table(results: list[Result]) -> str:
    columns = [(s, m) for s, methods in SCENARIOS.items() for m in methods]
    workloads = sorted({r.workload for r in results if r.method != "trainer"})
    names = {"none": "no guard", "fixed": f"clip_grad_norm_({FIXED_MAX_NORM:g})"}
    lines = [
        "| workload | " + " | ".join(f"{s}: {names.get(m, m)}" for s, m in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for workload in workloads:
        cells = []
        for scenario, method in columns:
            runs = [r for r in results if (r.workload, r.scenario, r.method) == (workload, scenario, method)]
            text = cell([r.loss for r in runs], digits=3)
            flags = [len(r.flagged) for r in runs]
            if method in GUARDED and runs:
                text += (
                    f" ({min(flags)}-{max(flags)} flagged)" if min(flags) != max(flags) else f" ({flags[0]} flagged)"
                )
            cells.append(text)
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spike_table(results: list[Result]) -> str:
    lines = [
        "| workload | kind | norm / running mean | z-score | flagged by skip | flagged by clip |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for workload in sorted({r.workload for r in results if r.scenario == "spikes"}):
        for kind in ("scale", "corrupt"):
            ratios, zs, caught = [], [], {"skip": [0, 0], "clip": [0, 0]}
            for r in results:
                if r.workload != workload or r.scenario != "spikes" or r.method not in caught:
                    continue
                for step, what in r.injected.items():
                    if what != kind:
                        continue
                    caught[r.method][0] += step in r.flagged
                    caught[r.method][1] += 1
                    if r.method == "skip":
                        ratios.append(r.spike_ratio[step])
                        zs.append(r.spike_z[step])
            label = f"loss x{LOSS_SCALE:g}" if kind == "scale" else "corrupted targets"
            lines.append(
                f"| {workload} | {label} | {min(ratios, default=math.nan):.3g} - {max(ratios, default=math.nan):.3g} "
                f"| {min(zs, default=math.nan):.3g} - {max(zs, default=math.nan):.3g} "
                f"| {caught['skip'][0]}/{caught['skip'][1]} | {caught['clip'][0]}/{caught['clip'][1]} |"
            )
    return "\n".join(lines)


def false_positive_table(clean: list[Result]) -> str:
    lines = [
        "| clean run | seeds | steps | flagged (defaults) | largest z after warm-up (where) "
        "| flagged, ZClip's settings |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for workload in dict.fromkeys(r.label for r in clean):
        runs = [r for r in clean if r.label == workload]
        z, where = largest_z(runs)
        zclip = [len(replay(r.norms, action="clip", **ZCLIP)[2]) for r in runs]
        lines.append(
            f"| {workload} | {len(runs)} | {len(runs[0].norms)} | {sum(len(r.flagged) for r in runs)} "
            f"| {z:.2f} ({where}) | {min(zclip)}-{max(zclip)} per run |"
        )
    return "\n".join(lines)


def largest_z(runs: list[Result], **settings: Any) -> tuple[float, str]:
    """The largest z-score after the warm-up over ``runs`` replayed under ``settings``, and where (run, seed, step)."""
    found = [(z, f"{r.label} seed {r.seed} step {step}") for r in runs for z, step in replay(r.norms, **settings)[0]]
    return max(found, default=(math.nan, "-"))


def injected_z(run: Result, **settings: Any) -> dict[int, float]:
    """The z-score of each injected spike of a ``skip`` run, replayed under ``settings`` (the run's skipped steps left
    out of the statistics, as they were)."""
    _, skipped, _ = replay(run.norms, set(run.flagged) | set(run.injected), **settings)
    return {step: z for step, z in skipped.items() if step in run.injected}


def grid_table(clean: list[Result], skipped: list[Result]) -> str:
    lines = [
        "| alpha | warm-up | largest clean z (where) | smallest injected-spike z (where) | ratio |",
        "|---:|---:|---:|---:|---:|",
    ]
    for alpha in GRID_ALPHAS:
        for warmup in GRID_WARMUPS:
            largest, where = largest_z(clean, alpha=alpha, warmup=warmup)
            spikes = [
                (z, f"{r.label} seed {r.seed} step {step}")
                for r in skipped
                for step, z in injected_z(r, alpha=alpha, warmup=warmup).items()
            ]
            smallest, at = min(spikes, default=(math.nan, "-"))
            mark = " (defaults)" if (alpha, warmup) == (DEFAULT_ALPHA, DEFAULT_WARMUP) else ""
            lines.append(
                f"| {alpha:g}{mark} | {warmup} | {largest:.2f} ({where}) | {smallest:.3g} ({at}) "
                f"| {smallest / largest:.2f} |"
            )
    return "\n".join(lines)


def blind_steps(norms: list[float], at: int, ratio: float) -> list[int]:
    """Steps after a spike of ``1000x`` the running mean taken at step ``at`` (in the warm-up: it enters the
    statistics) until a spike of ``ratio`` x the step's norm is flagged again, on each clean run's own norms (what the
    taken spike does to the model itself is not included); ``-1``: not within the run."""
    guard = SpikeGuard()
    for step, norm in enumerate(norms):
        if step == at:
            guard.observe(guard.judge(1000.0 * guard.mean))
        if step > at and guard.judge(ratio * norm).spike:
            return [step - at]
        guard.observe(guard.judge(norm))
    return [-1]


def warmup_spike_table(clean: list[Result]) -> str:
    at = DEFAULT_WARMUP - 25
    lines = [
        f"| clean run | a 4x spike flagged again after | a 30x spike | a 1000x spike (steps after step {at}) |",
        "|---|---:|---:|---:|",
    ]
    for workload in dict.fromkeys(r.label for r in clean):
        runs = [r for r in clean if r.label == workload]
        cells = []
        for ratio in (4.0, 30.0, 1000.0):
            found = [n for r in runs for n in blind_steps(r.norms, at, ratio)]
            text = "not within the run" if max(found) < 0 else f"{min(found)}-{max(found)}"
            if max(found) >= 0 and min(found) < 0:
                text = f"{min(n for n in found if n >= 0)}-{max(found)}, or not within the run"
            cells.append(text)
        lines.append(f"| {workload} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def guard_cost(step_seconds: list[float]) -> str:
    guard = SpikeGuard()
    norms = [1.0 + 0.01 * (i % 7) for i in range(2000)]
    for norm in norms[:200]:
        guard.observe(guard.judge(norm))
    calls = 20_000
    seconds = min(timeit.repeat(lambda: guard.observe(guard.judge(norms[guard.steps % 2000])), number=calls, repeat=5))
    per_call = seconds / calls
    step = statistics.median(step_seconds)
    return (
        f"judge + observe: {per_call * 1e6:.2f} us per step (best of 5 x {calls:,}); the median gpt step "
        f"{step * 1e3:.2f} ms; ratio {1 + per_call / step:.5f}x (the norm itself is measured by the step's check)"
    )


# ------------------------------------------------------------------------------------------------ main
def quiet() -> None:
    import lightning.pytorch  # noqa: F401  (its import sets its loggers to INFO: quiet them after it)

    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 400 steps, adamw, one seed, 1 Trainer epoch")
    parser.add_argument("--tasks", nargs="*", default=["gpt", "mlp"], choices=["gpt", "mlp"])
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "sgd"], choices=["adamw", "sgd"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--shift-seeds", nargs="+", type=int, default=[0], help="the seeds of the shift scenario")
    parser.add_argument("--steps", type=int, default=1000, help="steps of every plain run")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of every Trainer run")
    parser.add_argument("--no-trainer", action="store_true", help="leave out the Trainer runs of the shipped models")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared cores)")
    parser.add_argument("--json", metavar="PATH", help="also write every run (its norms included) to this new file")
    parser.add_argument("--from-json", metavar="PATH", help="print the tables of the runs saved there; run nothing")
    args = parser.parse_args()
    if args.json is not None and Path(args.json).exists():
        parser.error(f"--json {args.json}: the file exists; name a new one (it is never overwritten).")
    if args.quick:
        args.seeds, args.steps, args.epochs, args.optimizers = args.seeds[:1], 400, 1, ["adamw"]
        args.shift_seeds = args.seeds
    torch.set_num_threads(args.threads)
    quiet()
    print("command: python " + " ".join(sys.argv), flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); guard defaults: {SpikeGuard()!r}")
    started = time.perf_counter()
    results: list[Result] = []
    if args.from_json is not None:
        results = [load_result(run) for run in json.loads(Path(args.from_json).read_text())]
        args.tasks, args.no_trainer = [], True
        args.seeds = sorted({r.seed for r in results})
        args.steps = max((len(r.norms) for r in results if r.method != "trainer"), default=0)
    for task in args.tasks:
        for optimizer in args.optimizers:
            for seed in args.seeds:
                for scenario, methods in SCENARIOS.items():
                    if scenario == "shift" and seed not in args.shift_seeds:
                        continue
                    for method in methods:
                        r = train(task, optimizer, scenario, method, seed, args.steps)
                        results.append(r)
                        print(
                            f"  {r.workload} seed {seed} {scenario}/{method}: loss {r.loss:.4f}, flagged "
                            f"{r.flagged[:8]}{'...' if len(r.flagged) > 8 else ''} ({len(r.flagged)}), "
                            f"{r.seconds:.1f} s",
                            flush=True,
                        )
    if not args.no_trainer:
        for name in TRAINER_WORKLOADS:
            for seed in args.seeds:
                r = trainer_run(name, seed, args.epochs)
                results.append(r)
                print(f"  {name} (Trainer) seed {seed}: flagged {r.flagged} of {len(r.norms)}, {r.seconds:.1f} s")

    clean = [r for r in results if r.scenario == "clean"]
    skipped = [r for r in results if r.scenario == "spikes" and r.method == "skip"]
    steps = f"{args.steps} steps, seeds {args.seeds}"
    print(f"\n### Final loss (mean of the last 50 steps; mean [min, max] over seeds), {steps}\n")
    print(loss_table(results))
    print(f"\n### Injected spikes (over seeds), judged by the default guard: {SpikeGuard()!r}\n")
    print(spike_table(results))
    print("\n### False positives: steps the default guard flags on clean runs\n")
    print(false_positive_table(clean))
    print(
        "\n### The statistic: decay and warm-up. A threshold between the two z columns flags every injected spike and"
        " no clean step;\nratio: how wide that gap is\n"
    )
    print(grid_table(clean, skipped))
    print(
        f"\n### A spike in the warm-up: a norm of 1000x the running mean taken at step {DEFAULT_WARMUP - 25} enters the"
        " statistics;\nsteps until a spike of 4x, 30x or 1000x the step's norm is flagged again (on the clean norms)\n"
    )
    print(warmup_spike_table(clean))
    gpt_steps = [s for r in results if r.task == "gpt" and r.scenario == "clean" for s in r.step_s[10:]]
    if gpt_steps:
        print("\n### The guard's cost\n")
        print(guard_cost(gpt_steps))
    if args.json is not None:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in results]))
        print(f"\nevery run written to {args.json}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
