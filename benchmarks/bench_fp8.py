"""Benchmark FP8 training on torchao (``weights/fp8``): quality against bf16-mixed, the fallback under outliers, the
cost of the readings.

What is compared
    Plain torch loops (no Lightning: ``FP8Training`` is the numerics the plugins will drive), one per variant, with
    the same model initialisation, data and seed. The task is ``bench_compensated.py``'s ``gpt`` task: a tiny litgpt
    GPT (2 layers, 64 wide, 9 Linear layers, all eligible) on a first-order Markov chain over 64 tokens (loss floor
    1.25 nats), batch 32 x 32 tokens, fresh batches each step, AdamW(lr 3e-3, betas (0.9, 0.95), weight decay 0.1),
    linear warm-up then cosine, clipping at norm 1.0, the loss from FP32 logits. A run's result is the mean train loss
    of its last 50 steps (fresh batches: held-out data).

    * ``quality``: ``32-true``, ``bf16-mixed`` (the FP32 model under ``torch.autocast(dtype=torch.bfloat16)``) and FP8
      with each recipe (bf16 autocast, every Linear converted), 3 seeds. Target: each recipe within 1% of bf16-mixed.
      The FP8 runs read their casts every ``--check-interval`` steps without falling back, and count how often the
      fallback rule at ``--threshold`` percent would have fired on this clean task (false alarms) and the largest
      share flushed by any cast.
    * ``outliers``: a channel outlier in the final hidden state, where this task's accuracy lives (the lm_head's
      input; the MLP and attention barely matter for a first-order chain, so an outlier there moves the loss by less
      than the seeds do): channel 7 of the lm_head's input multiplied by ``--factor`` (1e5), the weight column that
      reads it divided by the same factor and frozen, so the function is unchanged and bf16 does not notice it, while
      FP8's scale is set by the outlier and the other channels are flushed (a "massive activation" with the small
      weights a model learns for it). ``channel``: from the first step; ``mid-run``: from the middle of the run.
      ``--outlier-layer`` puts it at another layer's input (e.g. ``transformer.h.1.mlp.fc``).
      Runs: bf16-mixed, all FP8 (tensorwise, no fallback), and FP8 with the fallback rule driven in this loop (readings
      every N steps for each ``--intervals``, ``--threshold``). Recovered = (all FP8 - fallback) / (all FP8 - bf16).
      Target: >= 75%.
    * ``readings``: what the readings say when one token of one MLP layer's input is multiplied by 1e4 or 1e5, for
      each recipe, after ``--warm-steps`` clean steps: the outlier layer's casts, and the largest share flushed by any
      cast of the other layers.
    * ``cost``: models in one process, ``FP8Training``'s conversion and torchao's own
      ``convert_to_float8_training`` (same numerics), their steps alternated so that the machine's other load hits
      both alike; every 4th step of ours is a check step. The readings' cost is the extra time of a check step over a
      plain step spread over ``--check-interval`` steps (target <= 3%); the always-on part (the non-finite flags and
      the hooks) is ours' plain step against torchao's, and a third model with the hooks but not the flags tells the
      two apart.

``--device cuda`` runs every part on the GPU (the GEMM-bound throughput rows are ``gpu_check.py``'s). On CPU torch
emulates the float8 GEMMs (``torch._scaled_mm``): the losses are the real FP8 numerics, the times are not GPU times.

Usage
    python benchmarks/bench_fp8.py                     # everything, CPU (about 50 min on 2 shared cores)
    python benchmarks/bench_fp8.py --quick             # a smoke run (a few minutes): 40 steps, one seed
    python benchmarks/bench_fp8.py --parts outliers --intervals 10 25 50 --seeds 0 1 2
    python benchmarks/bench_fp8.py --parts outliers --intervals 50 --outlier-layer transformer.h.1.mlp.fc
    python benchmarks/bench_fp8.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from _ab import Ratio, Side, load  # same directory
from bench_compensated import VOCAB, entropy_rate, gpt, markov_batches, transition_matrix, warmup_cosine

from lightning_amp_plus.weights.fp8 import RECIPES, FallbackRule, FP8Training
from lightning_amp_plus.weights.fp8.convert import guard_of
from lightning_amp_plus.weights.fp8.readings import worst_flush

LR = 3e-3
OUTLIER_CHANNEL = 7


@dataclass(frozen=True)
class Variant:
    """How a run computes: FP32, bf16 autocast, or FP8 with a recipe (and a fallback rule driven by the loop)."""

    name: str
    autocast: bool = True
    recipe: str | None = None
    interval: int = 0
    """Read the casts every this many steps (0: never)."""
    threshold: float | None = None
    """Fall back above this percent flushed at two readings in a row (None: read only)."""


@dataclass
class Outcome:
    """What one run gave."""

    loss: float
    seconds: float
    fell_back: list[str] = field(default_factory=list)
    would_fall_back: int = 0
    max_flushed_pct: float = 0.0
    max_in_a_row_pct: float = 0.0
    """The largest share flushed by a layer at two readings in a row (the smaller of the two): the rule fires on this
    run at any threshold below it."""


class ChannelOutlier:
    """A function-preserving outlier: channel ``channel`` of ``layer``'s input times ``factor`` from step ``start``,
    the weight column reading it divided by ``factor`` then and frozen (its gradient and AdamW's first moment for it
    zeroed: AdamW then leaves it alone but for weight decay, which shrinks it alike in every run)."""

    def __init__(self, model: nn.Module, layer: str, channel: int, factor: float, start: int) -> None:
        self.linear = model.get_submodule(layer)
        self.channel, self.factor, self.start = channel, factor, start
        self.on = False
        self.linear.register_forward_pre_hook(self._scale_input)
        self.linear.weight.register_hook(self._freeze_column)

    def at_step(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if step == self.start:
            self.on = True
            with torch.no_grad():
                self.linear.weight[:, self.channel] /= self.factor
                state = optimizer.state.get(self.linear.weight, {})
                if "exp_avg" in state:
                    state["exp_avg"][:, self.channel] = 0

    def _scale_input(self, _module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...] | None:
        if not self.on:
            return None
        x = args[0].clone()
        x[..., self.channel] *= self.factor
        return (x, *args[1:])

    def _freeze_column(self, grad: Tensor) -> Tensor | None:
        if not self.on:
            return None
        grad = grad.clone()
        grad[:, self.channel] = 0
        return grad


def train(
    variant: Variant,
    seed: int,
    steps: int,
    device: str,
    outlier: tuple[str, float, int] | None = None,
    dry: float = 1.0,
) -> Outcome:
    """One run; ``outlier`` = (layer, factor, start step) adds a :class:`ChannelOutlier`; ``dry``: the threshold of the
    would-be fallbacks counted on read-only runs."""
    model = gpt(seed).to(device)
    injected = None
    if outlier is not None:
        layer, factor, start = outlier
        injected = ChannelOutlier(model, layer, OUTLIER_CHANNEL, factor, start)
    fp8 = None
    if variant.recipe is not None:
        fp8 = FP8Training(variant.recipe, check_interval=variant.interval or 1, fallback=variant.threshold)  # type: ignore[arg-type]
        fp8.convert(model)
    dry_rule = FallbackRule(dry)
    last_worst: dict[str, float] = {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps))
    batches = markov_batches(transition_matrix(), seed)
    losses: list[float] = []
    outcome = Outcome(0.0, 0.0)
    started = time.perf_counter()
    for step in range(steps):
        if injected is not None:
            injected.at_step(step, optimizer)
        checking = fp8 is not None and variant.interval > 0 and fp8.is_check_step(step)
        if checking:
            fp8.start_check()  # type: ignore[union-attr]
        loss = loss_of(model, next(batches).to(device), variant.autocast, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if fp8 is not None:
            if checking:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the fallback's warning: recorded below instead
                    check = fp8.finish_check()
                outcome.fell_back += [f"{name}@{step}" for name in check.fell_back]
                outcome.would_fall_back += len(dry_rule.update(check.readings))
                outcome.max_flushed_pct = max([outcome.max_flushed_pct, *(r.flushed_pct for r in check.readings)])
                worst = {layer: r.flushed_pct for layer, r in worst_flush(check.readings).items()}
                in_a_row = [min(pct, last_worst[layer]) for layer, pct in worst.items() if layer in last_worst]
                outcome.max_in_a_row_pct = max([outcome.max_in_a_row_pct, *in_a_row])
                last_worst = worst
            fp8.end_step()
        losses.append(loss.item())
    outcome.seconds = time.perf_counter() - started
    outcome.loss = statistics.fmean(losses[-50:])
    return outcome


def loss_of(model: nn.Module, tokens: Tensor, autocast: bool, device: str) -> Tensor:
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------------------------------- quality
def quality(args: argparse.Namespace) -> list[str]:
    variants = [Variant("32-true", autocast=False), Variant("bf16-mixed")]
    variants += [Variant(f"fp8 {r}", recipe=r, interval=args.check_interval) for r in RECIPES]
    runs: dict[str, list[Outcome]] = {v.name: [] for v in variants}
    for seed in args.seeds:
        for variant in variants:
            runs[variant.name].append(train(variant, seed, args.steps, args.device, dry=args.threshold))
            print(f"  quality seed {seed} {variant.name}: {runs[variant.name][-1]}", flush=True)
    bf16 = statistics.fmean(o.loss for o in runs["bf16-mixed"])
    spread = max(o.loss for o in runs["bf16-mixed"]) - min(o.loss for o in runs["bf16-mixed"])
    lines = [
        f"### quality: {args.steps} steps, seeds {args.seeds} (bf16-mixed seed spread {spread:.4f})",
        "",
        "| precision | loss (mean) | vs bf16-mixed | target (within 1%) | s per run | "
        f"fallbacks at {args.threshold:g}% (false alarms) | largest flushed % | largest at two readings in a row % |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for variant in variants:
        outcomes = runs[variant.name]
        loss = statistics.fmean(o.loss for o in outcomes)
        fp8 = variant.recipe is not None
        lines.append(
            f"| {variant.name} | {loss:.4f} | {loss / bf16 - 1:+.2%} | "
            f"{('met' if abs(loss / bf16 - 1) <= 0.01 else 'NOT met') if fp8 else '-'} | "
            f"{statistics.fmean(o.seconds for o in outcomes):.0f} | "
            f"{sum(o.would_fall_back for o in outcomes) if fp8 else '-'} | "
            f"{max(o.max_flushed_pct for o in outcomes):.3f} | {max(o.max_in_a_row_pct for o in outcomes):.3f} |"
            if fp8
            else f"| {variant.name} | {loss:.4f} | {loss / bf16 - 1:+.2%} | - | "
            f"{statistics.fmean(o.seconds for o in outcomes):.0f} | - | - | - |"
        )
    return lines


# --------------------------------------------------------------------------------------------------------- outliers
def outliers(args: argparse.Namespace) -> list[str]:
    tasks = {
        "channel": (args.outlier_layer, args.factor, 0),
        "mid-run": (args.outlier_layer, args.factor, args.steps // 2),
    }
    variants = [Variant("bf16-mixed"), Variant("all FP8", recipe="tensorwise")]
    variants += [
        Variant(f"fallback every {n}", recipe="tensorwise", interval=n, threshold=args.threshold)
        for n in args.intervals
    ]
    lines = [
        f"### outliers: channel {OUTLIER_CHANNEL} of `{args.outlier_layer}`'s input x{args.factor:g} "
        f"(function-preserving), tensorwise, fallback above {args.threshold:g}% at two readings in a row; "
        f"{args.steps} steps, seeds {args.seeds}",
        "",
        "| task | run | loss (mean) | recovered (mean of seeds) | per seed | fell back |",
        "|---|---|---:|---:|---|---|",
    ]
    for task, outlier in tasks.items():
        runs: dict[str, list[Outcome]] = {v.name: [] for v in variants}
        for seed in args.seeds:
            for variant in variants:
                runs[variant.name].append(train(variant, seed, args.steps, args.device, outlier))
                print(f"  {task} seed {seed} {variant.name}: {runs[variant.name][-1]}", flush=True)
        for variant in variants:
            outcomes = runs[variant.name]
            loss = statistics.fmean(o.loss for o in outcomes)
            per_seed = [
                (fp8.loss - o.loss) / (fp8.loss - bf16.loss) if fp8.loss != bf16.loss else float("nan")
                for o, fp8, bf16 in zip(outcomes, runs["all FP8"], runs["bf16-mixed"], strict=True)
            ]
            shown = variant.threshold is not None
            recovered = (
                f"{statistics.fmean(per_seed):.0%} ({'met' if statistics.fmean(per_seed) >= 0.75 else 'NOT met'})"
            )
            lines.append(
                f"| {task} (from step {outlier[2]}) | {variant.name} | {loss:.4f} | {recovered if shown else '-'} | "
                f"{', '.join(f'{x:.0%}' for x in per_seed) if shown else '-'} | "
                f"{'; '.join(', '.join(o.fell_back) or 'none' for o in outcomes) if shown else '-'} |"
            )
    return lines


# --------------------------------------------------------------------------------------------------------- readings
def readings(args: argparse.Namespace) -> list[str]:
    """Each recipe's readings when one token of one MLP layer's input is multiplied by 1e4 and 1e5, after 100 clean
    training steps: the outlier layer's casts, and the largest share any other layer's casts flushed."""
    layer = "transformer.h.0.mlp.proj"
    lines = [
        f"### readings: token 3 of every sequence x factor at `{layer}`'s input, one check step after "
        f"{args.warm_steps} clean steps (seed {args.seeds[0]})",
        "",
        "| recipe | factor | cast of the outlier layer | flushed % | subnormal % | other layers: largest flushed % |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for recipe in RECIPES:
        for factor in (1e4, 1e5):
            model = gpt(args.seeds[0]).to(args.device)
            fp8 = FP8Training(recipe, fallback=None)  # type: ignore[arg-type]
            fp8.convert(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
            batches = markov_batches(transition_matrix(), args.seeds[0])
            for _ in range(args.warm_steps):
                loss_of(model, next(batches).to(args.device), True, args.device).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                fp8.end_step()

            def one_token(_module: nn.Module, inputs: tuple[Tensor, ...], factor: float = factor) -> tuple[Tensor]:
                x = inputs[0].clone()
                x[:, 3] *= factor
                return (x,)

            model.get_submodule(layer).register_forward_pre_hook(one_token)
            fp8.start_check()
            loss_of(model, next(batches).to(args.device), True, args.device).backward()
            found = fp8.finish_check().readings
            others = max(r.flushed_pct for r in found if r.layer != layer)
            for r in (r for r in found if r.layer == layer):
                cells = f"`{r.cast}` | {r.flushed_pct:.2f} | {r.subnormal_pct:.1f} | {others:.3f}"
                lines.append(f"| {recipe} | {factor:g} | {cells} |")
        print(f"  readings {recipe} done", flush=True)
    return lines


# ------------------------------------------------------------------------------------------------------------- cost
def fp8_run(kind: str, seed: int, device: str) -> tuple[nn.Module, Callable[[bool], float], FP8Training | None]:
    """A model converted by ``FP8Training`` (``kind="ours"``) or by torchao alone, and its timed training step."""
    model = gpt(seed).to(device)
    fp8 = None
    if kind == "ours":
        fp8 = FP8Training("tensorwise", fallback=None)
        fp8.convert(model)
    else:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    batches: Iterator[Tensor] = markov_batches(transition_matrix(), seed)

    def step(check: bool) -> float:
        tokens = next(batches).to(device)
        synchronize(device)
        started = time.perf_counter()
        if check and fp8 is not None:
            fp8.start_check()
        loss = loss_of(model, tokens, True, device)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fp8 is not None:
            if check:
                fp8.finish_check()
            fp8.end_step()
        synchronize(device)
        return time.perf_counter() - started

    return model, step, fp8


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cost(args: argparse.Namespace) -> list[str]:
    # One process holds both models (FP8Training's and torchao's own conversion, same seed) and alternates their steps
    # (A B, B A, ...), so that what else runs on the machine slows both alike; every 4th step of ours is a check step.
    # A third model has the hooks without the non-finite flags: what the flags' arithmetic costs apart from the hooks.
    plain, checked, theirs, bare = Side("plain FP8 step"), Side("check step"), Side("torchao alone"), Side("hooks")
    for r in range(args.rounds):
        _, ours_step, _ = fp8_run("ours", r, args.device)
        _, their_step, _ = fp8_run("torchao", r, args.device)
        _, bare_step, bare_fp8 = fp8_run("ours", r, args.device)
        for layer in bare_fp8.layers.values():  # type: ignore[union-attr]
            guard_of(layer).log = None  # type: ignore[union-attr]
        for _ in range(3):
            ours_step(False)
            their_step(False)
            bare_step(False)
        times: dict[str, list[float]] = {"plain": [], "check": [], "theirs": [], "bare": []}
        for i in range(args.timed_steps):
            check = i % 4 == 0
            for who in ("ours", "theirs", "bare") if i % 2 == 0 else ("bare", "theirs", "ours"):
                if who == "ours":
                    times["check" if check else "plain"].append(ours_step(check))
                elif who == "theirs":
                    times["theirs"].append(their_step(False))
                else:
                    times["bare"].append(bare_step(False))
        for side, key in ((plain, "plain"), (checked, "check"), (theirs, "theirs"), (bare, "bare")):
            side.times.extend(times[key])
            side.round_medians.append(statistics.median(times[key]))
        print(f"  cost round {r + 1}/{args.rounds} (load average {load():.2f})", flush=True)
    each = Ratio.of(checked, plain)
    amortized = (each.of_medians - 1) / args.check_interval
    always = Ratio.of(plain, theirs)
    hooks = Ratio.of(bare, theirs)
    return [
        f"### cost: FP8 tensorwise steps on {args.device} ({args.rounds} rounds x {args.timed_steps} steps per model)",
        "",
        "| what | ours ms | reference ms | ratio (medians) | per round [min, max] | target |",
        "|---|---:|---:|---:|---|---|",
        f"| a check step against a plain step | {each.a_ms:.1f} | {each.b_ms:.1f} | {each.of_medians:.3f}x | "
        f"{each.per_round()} | - |",
        f"| readings every {args.check_interval} steps, per step | - | - | {1 + amortized:.4f}x | - | "
        f"{'met' if amortized <= 0.03 else 'NOT met'} (<= 1.03x) |",
        f"| every step (non-finite flags, hooks): FP8Training against torchao alone | {always.a_ms:.1f} | "
        f"{always.b_ms:.1f} | {always.of_medians:.3f}x | {always.per_round()} | - |",
        f"| every step, the hooks without the flags, against torchao alone | {hooks.a_ms:.1f} | {hooks.b_ms:.1f} | "
        f"{hooks.of_medians:.3f}x | {hooks.per_round()} | - |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["quality", "outliers", "readings", "cost"])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40 steps, one seed, one round")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--check-interval", type=int, default=50, help="quality runs and the cost's amortisation")
    parser.add_argument("--intervals", nargs="+", type=int, default=[10, 50], help="fallback runs' check intervals")
    parser.add_argument("--threshold", type=float, default=1.0, help="fallback above this percent flushed")
    parser.add_argument("--factor", type=float, default=1e5, help="the channel outlier's factor")
    parser.add_argument("--outlier-layer", default="lm_head", help="the layer whose input holds the outlier")
    parser.add_argument("--warm-steps", type=int, default=100, help="clean steps before the readings part's check")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of the cost part")
    parser.add_argument("--timed-steps", type=int, default=40, help="timed steps of each model per round")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on shared cores)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.quick:
        args.steps, args.seeds, args.rounds, args.timed_steps, args.warm_steps = 40, args.seeds[:1], 1, 8, 5
        args.intervals = [min(args.intervals)]
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    command = "python benchmarks/bench_fp8.py " + " ".join(sys.argv[1:])
    print(
        f"{command.strip()}\ntorch {torch.__version__}, {args.device}, {torch.get_num_threads()} thread(s), load "
        f"average {load():.2f}; loss floor {entropy_rate(transition_matrix()):.4f} nats",
        flush=True,
    )
    sections = {"quality": quality, "outliers": outliers, "readings": readings, "cost": cost}
    tables = [sections[part](args) for part in args.parts]
    print()
    for table in tables:
        print("\n".join(table), end="\n\n")
    print(f"`{command.strip()}` took {time.perf_counter() - started:.0f} s (load average {load():.2f})")


if __name__ == "__main__":
    main()
