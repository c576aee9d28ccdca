"""Benchmark compensated bf16 weights: final loss, bytes per parameter and step time of pure-bf16 training.

What is compared
    Plain torch training loops (no Lightning: the Compensator is the numerics the plugins will wrap), one per variant,
    with the same model initialisation, data and seed:

    * ``32-true``: FP32 model, torch ``AdamW``.
    * ``bf16-mixed``: FP32 model, forward under ``torch.autocast("cpu", dtype=torch.bfloat16)``, torch ``AdamW``.
    * ``bf16-true``: the model cast to bf16 (what Lightning's ``bf16-true`` does), torch ``AdamW`` (bf16 states).
    * ``kahan`` / ``stochastic``: the model in bf16, ``Compensator(AdamW, method)`` with the default states (first
      moment bf16, second moment FP32).
    * ``kahan v-bf16`` / ``stochastic v-bf16``: the same with the second moment in bf16 too (the alternative default).

    The loss is computed from FP32 logits/outputs in every variant. Two tasks:

    * ``gpt``: a tiny litgpt GPT (2 layers, 64 wide, 2 heads, block 32, vocabulary 64) on a first-order Markov chain
      over 64 tokens (random transition rows tuned to an entropy rate of 1.25 nats: the loss floor; sequences start in
      the stationary distribution, so every target has the same conditional entropy). Batch 32 x 32 tokens, fresh
      batches each step. AdamW(betas=(0.9, 0.95), weight_decay=0.1), linear warmup (10% of the steps) then cosine to
      10% of the peak lr, gradient clipping at norm 1.0.
    * ``mlp``: a student MLP (32 -> 256 -> 256 -> 1, tanh) regressing a random teacher of the same shape; batch 128,
      fresh inputs each step, MSE; AdamW with torch's defaults (betas (0.9, 0.999), weight decay 0.01), constant lr.
      Run longer (3,000 steps), where a bf16 second moment was seen to drift.
    * ``cnn``: torchvision's ``mobilenet_v3_small`` (a quarter wide, BatchNorm; bf16-true holds its normalisation in
      bf16 too, as Lightning's does) from its random initialisation, classifying 512 fixed random 32x32 images
      labelled by a random convolutional teacher (4 classes); batch 32, AdamW with torch's defaults, a constant lr,
      ``--cnn-steps`` steps.
    * ``finetune`` / ``finetune-cnn``: the gpt (cnn) task's model pretrained in FP32 (``--pretrain-steps`` steps of
      that task at lr 3e-4 / 1e-3, one model per seed), then fine-tuned by each variant on a shifted task (the
      chain's rows, or the teacher, mixed half and half with another random one's), from the same pretrained weights
      (cast to bf16 for the bf16-true variants, as loading a checkpoint in bf16 does). AdamW (the gpt task's betas,
      weight decay and clipping; torch's defaults for the cnn) at a constant lr (``--finetune-lrs``). The result is
      the loss on 8 fixed held-out batches of the shifted task, computed by the variant's own forward (bf16 weights,
      autocast or FP32; BatchNorm in eval mode), before the fine-tune and after each of ``--finetune-marks`` steps: a
      short fine-tune is the first mark, and few updates per weight are what a small lr and few steps give. The cnn
      fine-tune adds ``kahan, BatchNorm FP32``: Kahan with the BatchNorm layers (weights and running statistics) kept
      in FP32, to tell the updates compensation keeps from the normalisation bf16-true computes in bf16.

    The result of a gpt, mlp or cnn run is the mean train loss of its last 50 steps (of its last quarter if
    shorter); the tables give the mean over seeds and, against ``32-true`` of the same seed, the mean and worst
    relative difference. Bytes per trainable parameter are counted from the tensors after training (weights + Kahan
    buffers + optimizer states; gradients not counted) by ``weights.compensated.footprint``.

Step time
    On the gpt task, each compensated variant against ``bf16-true``, in interleaved rounds (A B, B A, ...; a fresh
    model each run, a few warm-up steps untimed): the median time of a whole training step (forward, backward,
    clipping, optimizer step) and of the optimizer step alone, as ratios to ``bf16-true``. CPU only: the ratios say
    what the extra FP32 arithmetic costs here, not on a GPU.

Usage
    python benchmarks/bench_compensated.py                 # the full table (about 20-30 min on 2 CPU cores)
    python benchmarks/bench_compensated.py --quick         # a smoke run (about a minute): few steps, one seed
    python benchmarks/bench_compensated.py --tasks mlp --mlp-steps 3000 --seeds 0 1 2
    python benchmarks/bench_compensated.py --tasks --timing-rounds 10   # the step-time table alone
    python benchmarks/bench_compensated.py --tasks finetune --timing-rounds 0 --finetune-marks 40 100 300  # ~50 min
    python benchmarks/bench_compensated.py --tasks finetune-cnn --timing-rounds 0 --pretrain-steps 300 \
        --finetune-lrs 1e-3 1e-4 --finetune-marks 40 100                                                # ~20 min
    python benchmarks/bench_compensated.py --tasks cnn --lrs 1e-3 1e-4 --timing-rounds 0   # a short CNN run
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from _ab import Ratio, Side, load, run_interleaved  # same directory

from lightning_amp_plus.weights.compensated import Compensator, footprint

BF16 = torch.bfloat16
VOCAB = 64
BLOCK = 32
ENTROPY_RATE = 1.25


@dataclass(frozen=True)
class Variant:
    """How a run keeps its weights and steps its optimizer."""

    name: str
    weights: torch.dtype = BF16
    autocast: bool = False
    method: str | None = None
    exp_avg_sq_dtype: torch.dtype = torch.float32
    norm_fp32: bool = False
    """BatchNorm layers (weights and running statistics) kept in FP32 next to the bf16 weights (the cnn fine-tune)."""

    def compensator(self, optimizer: torch.optim.Optimizer, seed: int) -> Compensator | None:
        if self.method is None:
            return None
        method = "kahan" if self.method == "kahan" else "stochastic"
        return Compensator(optimizer, method, seed=seed, exp_avg_sq_dtype=self.exp_avg_sq_dtype)


VARIANTS = [
    Variant("32-true", weights=torch.float32),
    Variant("bf16-mixed", weights=torch.float32, autocast=True),
    Variant("bf16-true"),
    Variant("kahan", method="kahan"),
    Variant("stochastic", method="stochastic"),
    Variant("kahan v-bf16", method="kahan", exp_avg_sq_dtype=BF16),
    Variant("stochastic v-bf16", method="stochastic", exp_avg_sq_dtype=BF16),
]
# For the cnn fine-tune: whether what compensation leaves behind is BatchNorm held in bf16 (its statistics are buffers
# the forward updates, not parameters the optimizer steps).
NORM_FP32 = Variant("kahan, BatchNorm FP32", method="kahan", norm_fp32=True)
BY_NAME = {v.name: v for v in [*VARIANTS, NORM_FP32]}


# ------------------------------------------------------------------------------------------------ the gpt task
@functools.cache
def transition_matrix(seed: int = 1234) -> Tensor:
    """Random transition rows (softmax of Gaussian logits), sharpened until the entropy rate is ``ENTROPY_RATE``."""
    logits = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    low, high = 0.0, 50.0  # inverse temperature: the entropy rate falls as it grows
    for _ in range(100):
        middle = (low + high) / 2
        if entropy_rate(torch.softmax(logits * middle, dim=1)) > ENTROPY_RATE:
            low = middle
        else:
            high = middle
    return torch.softmax(logits * high, dim=1)


def stationary(matrix: Tensor) -> Tensor:
    """The stationary distribution: any row of ``matrix ** (2 ** 40)`` (repeated squaring)."""
    power = matrix
    for _ in range(40):
        power = power @ power
    return power[0] / power[0].sum()


def entropy_rate(matrix: Tensor) -> float:
    """The loss floor: the stationary average of each row's entropy (nats)."""
    rows = -(matrix * matrix.clamp_min(1e-300).log()).sum(1)
    return float(stationary(matrix) @ rows)


def markov_batches(matrix: Tensor, seed: int, batch: int = 32) -> Iterator[Tensor]:
    """Endless batches of ``BLOCK + 1`` tokens, each sequence starting in the stationary distribution."""
    generator = torch.Generator().manual_seed(seed)
    pi = stationary(matrix).float()
    rows = matrix.float()
    while True:
        tokens = [torch.multinomial(pi.expand(batch, VOCAB), 1, generator=generator).squeeze(1)]
        for _ in range(BLOCK):
            tokens.append(torch.multinomial(rows[tokens[-1]], 1, generator=generator).squeeze(1))
        yield torch.stack(tokens, dim=1)


def gpt(seed: int) -> nn.Module:
    import litgpt  # only this task needs it

    torch.manual_seed(seed)
    config = litgpt.Config(n_layer=2, n_embd=64, n_head=2, block_size=BLOCK, vocab_size=VOCAB, padded_vocab_size=VOCAB)
    model: nn.Module = litgpt.GPT(config)
    return model


def warmup_cosine(steps: int) -> Callable[[int], float]:
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


# ------------------------------------------------------------------------------------------------ the mlp task
def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))


def teacher() -> nn.Module:
    model = mlp(seed=10_000)
    generator = torch.Generator().manual_seed(10_001)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)
    return model


def regression_batches(seed: int, batch: int = 128) -> Iterator[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    target = teacher()
    while True:
        x = torch.randn(batch, 32, generator=generator)
        with torch.no_grad():  # not around the yield: the caller's forward would run without grad
            y = target(x)
        yield x, y


# ------------------------------------------------------------------------------------------------ the cnn task
def cnn(seed: int) -> nn.Module:
    import torchvision  # only this task needs it

    torch.manual_seed(seed)
    model: nn.Module = torchvision.models.mobilenet_v3_small(weights=None, num_classes=4, width_mult=0.25)
    return model


def conv_teacher(seed: int) -> Tensor:
    """A random 5x5 convolution to 4 channels: a teacher whose labels a CNN can learn (translation invariant)."""
    return torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(seed))


def teach(images: Tensor, weight: Tensor) -> Tensor:
    """The class of each image: the channel of ``weight``'s ReLU response with the largest spatial mean."""
    return F.conv2d(images, weight).relu().mean((2, 3)).argmax(1)


@functools.cache
def image_task() -> tuple[Tensor, Tensor]:
    """512 fixed 32x32 RGB images, each labelled by a fixed random convolutional teacher (4 classes)."""
    images = torch.randn(512, 3, 32, 32, generator=torch.Generator().manual_seed(77))
    return images, teach(images, conv_teacher(77))


def image_batches(seed: int, batch: int = 32) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless batches of the image task, reshuffled every epoch."""
    images, labels = image_task()
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images), batch):
            index = order[start : start + batch]
            yield images[index], labels[index]


# ------------------------------------------------------------------------------------------------ the finetune tasks
FINETUNE_VARIANTS = {
    "finetune": ("32-true", "bf16-mixed", "bf16-true", "kahan", "stochastic"),
    "finetune-cnn": ("32-true", "bf16-mixed", "bf16-true", "kahan", "stochastic", NORM_FP32.name),
}
PRETRAIN_LR = {"finetune": 3e-4, "finetune-cnn": 1e-3}  # the gpt task's lr; a CNN from scratch takes a larger one


@functools.cache
def finetune_matrix() -> Tensor:
    """The fine-tuning chain: the pretraining chain's rows mixed half and half with another random chain's rows."""
    return 0.5 * transition_matrix() + 0.5 * transition_matrix(seed=4321)


@functools.cache
def shifted_images(seed: int, n: int) -> tuple[Tensor, Tensor]:
    """``n`` images of the image task's kind, labelled by its teacher mixed half and half with another one."""
    images = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    return images, teach(images, 0.5 * conv_teacher(77) + 0.5 * conv_teacher(78))


@functools.cache
def pretrained(task: str, seed: int, steps: int) -> dict[str, Tensor]:
    """The gpt (or cnn) task's model trained in FP32 for ``steps`` steps (its state, one model per seed)."""
    run = set_up("gpt" if task == "finetune" else "cnn", BY_NAME["32-true"], PRETRAIN_LR[task], seed, steps)
    for _ in range(steps):
        run.step()
    return {name: tensor.detach().clone() for name, tensor in run.model.state_dict().items()}


def finetune_batches(task: str, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless (input, target) batches of the shifted task; for the gpt, tokens and the next tokens."""
    if task == "finetune":
        for tokens in markov_batches(finetune_matrix(), seed=1000 + seed):
            yield tokens[:, :-1], tokens[:, 1:]
    images, labels = shifted_images(1000 + seed, 512)
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(images), generator=generator)
        for start in range(0, len(images), 32):
            yield images[order[start : start + 32]], labels[order[start : start + 32]]


@functools.cache
def held_out(task: str) -> tuple[tuple[Tensor, Tensor], ...]:
    """8 fixed batches of the shifted task, the same for every variant and seed."""
    if task == "finetune":
        tokens = markov_batches(finetune_matrix(), seed=99)
        return tuple((t[:, :-1], t[:, 1:]) for t in (next(tokens) for _ in range(8)))
    images, labels = shifted_images(99, 256)
    return tuple((images[k : k + 32], labels[k : k + 32]) for k in range(0, 256, 32))


def cross_entropy(model: nn.Module, variant: Variant, batch: tuple[Tensor, Tensor]) -> Tensor:
    """The loss by the variant's own forward (bf16 weights, autocast or FP32), logits widened to FP32."""
    x, y = batch
    with torch.autocast("cpu", dtype=BF16, enabled=variant.autocast):
        logits = model(x if x.dtype == torch.long else x.to(variant.weights))
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def held_out_loss(task: str, model: nn.Module, variant: Variant) -> float:
    """The loss on the held-out batches, in eval mode (BatchNorm normalises with its running statistics)."""
    model.eval()
    with torch.no_grad():
        loss = statistics.fmean(float(cross_entropy(model, variant, batch)) for batch in held_out(task))
    model.train()
    return loss


def finetune(
    task: str, variant: Variant, lr: float, seed: int, pretrain_steps: int, marks: list[int]
) -> dict[str, object]:
    """Fine-tune the seed's pretrained model with ``variant`` for ``max(marks)`` steps at a constant ``lr``."""
    model = (gpt if task == "finetune" else cnn)(seed)
    model.load_state_dict(pretrained(task, seed, pretrain_steps))
    model = model.to(variant.weights)
    if variant.norm_fp32:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.float()
    torch.manual_seed(seed)  # every variant draws the same dropout masks (the first also pretrained the model)
    if task == "finetune":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batches = finetune_batches(task, seed)

    def loss() -> Tensor:
        return cross_entropy(model, variant, next(batches))

    run = Run(model, optimizer, variant.compensator(optimizer, seed), None, loss, 1.0 if task == "finetune" else None)
    at = {"0": held_out_loss(task, model, variant)}
    for step in range(1, max(marks) + 1):
        run.step()
        if step in marks:
            at[str(step)] = held_out_loss(task, model, variant)
    return {"task": task, "variant": variant.name, "lr": lr, "seed": seed, "loss_at": at}


def finetune_table(results: list[dict[str, object]], task: str, lr: float, marks: list[int]) -> str:
    """Held-out loss per variant at each mark (mean over seeds), and its difference to 32-true's (mean, worst)."""
    columns = [0, *marks]
    lines = [
        "| variant | " + " | ".join(f"after {m} steps" for m in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    mine = [r for r in results if r["task"] == task and r["lr"] == lr]
    for name in FINETUNE_VARIANTS[task]:
        runs = [r for r in mine if r["variant"] == name]
        if not runs:
            continue
        cells = []
        for m in columns:
            values, ratios = [], []
            for r in runs:
                reference = next(q for q in mine if q["variant"] == "32-true" and q["seed"] == r["seed"])
                value = r["loss_at"][str(m)]  # type: ignore[index]
                values.append(value)
                ratios.append(value / reference["loss_at"][str(m)] - 1)  # type: ignore[index]
            worst = max(ratios, key=abs)
            cells.append(f"{statistics.fmean(values):.4f} ({statistics.fmean(ratios):+.2%}, {worst:+.2%})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ one run
@dataclass
class Run:
    """A training set-up ready to step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    compensator: Compensator | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    loss: Callable[[], Tensor]
    clip: float | None

    def step(self) -> tuple[float, float, float]:
        """One training step; returns (loss, whole step seconds, optimizer step seconds)."""
        started = time.perf_counter()
        loss = self.loss()
        loss.backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        stepping = time.perf_counter()
        self.compensator.step() if self.compensator is not None else self.optimizer.step()
        stepped = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return loss.item(), time.perf_counter() - started, stepped - stepping


def set_up(task: str, variant: Variant, lr: float, seed: int, steps: int) -> Run:
    model = {"gpt": gpt, "mlp": mlp, "cnn": cnn}[task](seed).to(variant.weights)
    if task == "gpt":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = torch.optim.lr_scheduler.LambdaLR(
            optimizer, warmup_cosine(steps)
        )
        batches = markov_batches(transition_matrix(), seed)

        def loss() -> Tensor:
            tokens = next(batches)
            with torch.autocast("cpu", dtype=BF16, enabled=variant.autocast):
                logits = model(tokens[:, :-1])
            return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

        clip: float | None = 1.0
    elif task == "cnn":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        scheduler, clip = None, None
        images = image_batches(seed)

        def loss() -> Tensor:
            x, y = next(images)
            with torch.autocast("cpu", dtype=BF16, enabled=variant.autocast):
                logits = model(x.to(variant.weights))
            return F.cross_entropy(logits.float(), y)

    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        scheduler, clip = None, None
        pairs = regression_batches(seed)

        def loss() -> Tensor:
            x, y = next(pairs)
            with torch.autocast("cpu", dtype=BF16, enabled=variant.autocast):
                out = model(x.to(variant.weights))
            return F.mse_loss(out.float(), y)

    return Run(model, optimizer, variant.compensator(optimizer, seed), scheduler, loss, clip)


def train(task: str, variant: Variant, lr: float, seed: int, steps: int, marks: list[int]) -> dict[str, object]:
    """Train; returns the mean loss of the last 50 steps (a quarter of a shorter run) before each mark (and at the
    end) and the bytes per trainable parameter."""
    run = set_up(task, variant, lr, seed, steps)
    losses = [run.step()[0] for _ in range(steps)]
    last = min(50, max(1, steps // 4))
    window = {str(m): statistics.fmean(losses[max(0, m - last) : m]) for m in marks if m <= steps}
    window[str(steps)] = statistics.fmean(losses[-last:])
    return {
        "task": task,
        "variant": variant.name,
        "lr": lr,
        "seed": seed,
        "steps": steps,
        "loss": window[str(steps)],
        "loss_at": window,
        "finite": all(math.isfinite(x) for x in losses),
        "bytes_per_param": footprint(run.optimizer, run.compensator).per_trainable_parameter,
        "parameters": sum(p.numel() for p in run.model.parameters()),
    }


# ------------------------------------------------------------------------------------------------ step time
def time_steps(variants: list[Variant], rounds: int, steps: int, budget_s: float) -> dict[str, tuple[Ratio, Ratio]]:
    """Each variant against bf16-true on the gpt task, interleaved: ratios of the whole step and the optimizer step."""
    pairs = {v.name: (Side(v.name), Side("bf16-true")) for v in variants}
    optimizer_sides: dict[int, Side] = {}

    def run(name: str, side: Side, r: int) -> list[float]:
        variant = BY_NAME[side.label]
        training = set_up("gpt", variant, 3e-4, seed=r, steps=1000)
        for _ in range(3):  # warm-up: first-step allocations, lazy state creation
            training.step()
        timed = [training.step() for _ in range(steps)]
        optimizer_side = optimizer_sides.setdefault(id(side), Side(side.label))
        optimizer_side.times.extend(t[2] for t in timed)
        optimizer_side.round_medians.append(statistics.median(t[2] for t in timed))
        return [t[1] for t in timed]

    run_interleaved(pairs, run, rounds, budget_s)
    return {
        name: (Ratio.of(a, b), Ratio.of(optimizer_sides[id(a)], optimizer_sides[id(b)]))
        for name, (a, b) in pairs.items()
    }


# ------------------------------------------------------------------------------------------------ tables
def loss_table(results: list[dict[str, object]], task: str, lrs: list[float]) -> str:
    header = (
        "| variant | bytes/param | " + " | ".join(f"lr {lr:g}: loss (vs 32-true: mean, worst)" for lr in lrs) + " |"
    )
    lines = [header, "|---|---:|" + "---:|" * len(lrs)]
    for variant in VARIANTS:
        mine = [r for r in results if r["task"] == task and r["variant"] == variant.name]
        if not mine:
            continue
        cells = []
        for lr in lrs:
            runs = [r for r in mine if r["lr"] == lr]
            if not runs:
                cells.append("-")
                continue
            ratios = [float(r["loss"]) / reference_loss(results, r) - 1 for r in runs]  # type: ignore[arg-type]
            worst = max(ratios, key=abs)
            mean_loss = statistics.fmean(float(r["loss"]) for r in runs)  # type: ignore[arg-type]
            cells.append(f"{mean_loss:.4f} ({statistics.fmean(ratios):+.2%}, {worst:+.2%})")
        bytes_per_param = statistics.fmean(float(r["bytes_per_param"]) for r in mine)  # type: ignore[arg-type]
        lines.append(f"| {variant.name} | {bytes_per_param:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reference_loss(results: list[dict[str, object]], run: dict[str, object]) -> float:
    for r in results:
        if r["variant"] == "32-true" and all(r[k] == run[k] for k in ("task", "lr", "seed", "steps")):
            return float(r["loss"])  # type: ignore[arg-type]
    return math.nan


def drift_table(results: list[dict[str, object]], marks: list[int], lrs: list[float]) -> str:
    """mlp: each variant's loss relative to 32-true's at several points of the run (mean over seeds)."""
    lines = ["| variant | lr | " + " | ".join(f"step {m}" for m in marks) + " |", "|---|---:|" + "---:|" * len(marks)]
    for variant in VARIANTS[1:]:
        for lr in lrs:
            runs = [r for r in results if r["task"] == "mlp" and r["variant"] == variant.name and r["lr"] == lr]
            if not runs:
                continue
            cells = []
            for m in marks:
                ratios = []
                for r in runs:
                    ref = next(
                        q
                        for q in results
                        if q["task"] == "mlp" and q["variant"] == "32-true" and q["lr"] == lr and q["seed"] == r["seed"]
                    )
                    at, ref_at = r["loss_at"], ref["loss_at"]
                    if str(m) in at and str(m) in ref_at:  # type: ignore[operator]
                        ratios.append(at[str(m)] / ref_at[str(m)] - 1)  # type: ignore[index]
                cells.append(f"{statistics.fmean(ratios):+.2%}" if ratios else "-")
            lines.append(f"| {variant.name} | {lr:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 60 gpt / 200 mlp steps, one seed")
    parser.add_argument(
        "--tasks",
        nargs="*",
        default=["gpt", "mlp"],
        choices=["gpt", "mlp", "cnn", "finetune", "finetune-cnn"],
        help="none: timing only",
    )
    parser.add_argument("--cnn-steps", type=int, default=40)
    parser.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS], choices=[v.name for v in VARIANTS])
    parser.add_argument("--lrs", nargs="+", type=float, default=[3e-4, 3e-5])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--gpt-steps", type=int, default=1000)
    parser.add_argument("--mlp-steps", type=int, default=3000)
    parser.add_argument("--pretrain-steps", type=int, default=1000, help="finetune: FP32 pretraining steps")
    parser.add_argument("--finetune-lrs", nargs="+", type=float, default=[1e-3, 1e-4, 1e-5])
    parser.add_argument("--finetune-marks", nargs="+", type=int, default=[40, 100, 500], help="steps to evaluate at")
    parser.add_argument("--timing-rounds", type=int, default=6, help="interleaved rounds of the step-time comparison")
    parser.add_argument("--timing-steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--timing-budget", type=float, default=300.0, help="seconds after which no new round starts")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared cores)")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.gpt_steps, args.mlp_steps = args.seeds[:1], 60, 200
        args.pretrain_steps, args.finetune_marks = 60, [10, 20]
        args.timing_rounds, args.timing_steps = 2, 5
    torch.set_num_threads(args.threads)
    if "32-true" not in args.variants:
        args.variants.insert(0, "32-true")  # the reference of every ratio
    variants = [BY_NAME[name] for name in args.variants]
    marks = [m for m in (400, 800, 1500, 2000, 3000) if m < args.mlp_steps]

    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average {load():.2f}", flush=True)
    if "gpt" in args.tasks:
        matrix = transition_matrix()
        print(
            f"gpt task: entropy rate (loss floor) {entropy_rate(matrix):.4f} nats; "
            f"unigram entropy {float(-(stationary(matrix) * stationary(matrix).log()).sum()):.4f}",
            flush=True,
        )
    if "finetune" in args.tasks:
        print(
            f"finetune task: loss floor of the fine-tuning chain {entropy_rate(finetune_matrix().double()):.4f} nats",
            flush=True,
        )
    results: list[dict[str, object]] = []
    for task in [t for t in args.tasks if t.startswith("finetune")]:
        for seed in args.seeds:
            for lr in args.finetune_lrs:
                for name in FINETUNE_VARIANTS[task]:
                    started = time.perf_counter()
                    result = finetune(task, BY_NAME[name], lr, seed, args.pretrain_steps, sorted(args.finetune_marks))
                    result["seconds"] = round(time.perf_counter() - started, 1)
                    results.append(result)
                    print("RESULT " + json.dumps(result), flush=True)
    for task in [t for t in args.tasks if not t.startswith("finetune")]:
        steps = {"gpt": args.gpt_steps, "mlp": args.mlp_steps, "cnn": args.cnn_steps}[task]
        for seed in args.seeds:
            for lr in args.lrs:
                for variant in variants:
                    started = time.perf_counter()
                    result = train(task, variant, lr, seed, steps, marks if task == "mlp" else [])
                    result["seconds"] = round(time.perf_counter() - started, 1)
                    results.append(result)
                    print("RESULT " + json.dumps(result), flush=True)

    for task in [t for t in args.tasks if t.startswith("finetune")]:
        print(
            f"\n### {task}: pretrained {args.pretrain_steps} steps in FP32, fine-tuned at a constant lr, seeds "
            f"{args.seeds}"
        )
        print("Held-out loss of the shifted task (mean over seeds); in brackets its relative difference to 32-true")
        print("of the same seed and step, mean and worst over seeds. Step 0: the pretrained model as each variant")
        print("holds and computes it, before any update.")
        for lr in args.finetune_lrs:
            print(f"\nlr {lr:g}\n")
            print(finetune_table(results, task, lr, sorted(args.finetune_marks)))
    for task in [t for t in args.tasks if not t.startswith("finetune")]:
        steps = {"gpt": args.gpt_steps, "mlp": args.mlp_steps, "cnn": args.cnn_steps}[task]
        count = len({r["parameters"] for r in results if r["task"] == task})
        params = next(r["parameters"] for r in results if r["task"] == task)
        print(
            f"\n### {task}: {params} parameters{'' if count == 1 else ' (varies)'}, {steps} steps, seeds {args.seeds}"
        )
        print("Mean train loss of the last 50 steps (mean over seeds); in brackets its relative difference to 32-true")
        print(
            "of the same seed, mean and worst over seeds. Bytes per trainable parameter: weights + buffers + states.\n"
        )
        print(loss_table(results, task, args.lrs))
    if "mlp" in args.tasks and marks:
        print("\n### mlp: loss relative to 32-true along the run (mean over seeds; 50-step windows ending there)\n")
        print(drift_table(results, [*marks, args.mlp_steps], args.lrs))

    compensated = [v for v in variants if v.method is not None]
    if compensated and args.timing_rounds > 0:
        print(
            f"\n### step time on the gpt task against bf16-true (CPU, {torch.get_num_threads()} thread(s))", flush=True
        )
        ratios = time_steps(compensated, args.timing_rounds, args.timing_steps, args.timing_budget)
        print("\n| variant | whole step (ms, ratio) | per-round ratio [min, max] | optimizer step (ms, ratio) |")
        print("|---|---:|---:|---:|")
        for name, (whole, opt) in ratios.items():
            print(
                f"| {name} | {whole.a_ms:.2f} vs {whole.b_ms:.2f} = {whole.of_medians:.2f}x | {whole.per_round()} | "
                f"{opt.a_ms:.3f} vs {opt.b_ms:.3f} = {opt.of_medians:.2f}x |"
            )


if __name__ == "__main__":
    main()
