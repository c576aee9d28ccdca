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
    * ``step``: the time of one training step (forward, backward, AdamW), eager and compiled (``torch.compile``,
      inductor), side by side in one process, the sides taking turns step by step: torchao's bare recipe
      (``convert_to_float8_training``, bf16 autocast, AdamW, a plain loop: the reference of every ratio), the same
      loop driven by ``FP8Training`` (``before_forward``/``after_step``), Lightning Fabric with our plugin's
      ``fp8-mixed``, and torchao's recipe under Fabric's own ``bf16-mixed``; every 4th step of ours is a check step,
      timed apart. Then the peak CPU memory a step allocates above what was live before it, an ordinary step against
      a check step, from the profiler's memory events (:func:`peak_bytes`).
    * ``trace``: the functions one ``fp8-mixed`` Trainer step runs beyond a ``bf16-mixed`` step of the same model,
      an ordinary step and a check step, counted with ``sys.setprofile`` as ``trace_step.py`` counts them.

``--device cuda`` runs every part on the GPU (the GEMM-bound throughput rows are ``gpu_check.py``'s). On CPU torch
emulates the float8 GEMMs (``torch._scaled_mm``): the losses are the real FP8 numerics, the times are not GPU times.

Usage
    python benchmarks/bench_fp8.py                     # everything, CPU (about 50 min on 2 shared cores)
    python benchmarks/bench_fp8.py --parts step trace  # the step's cost and what it runs (a few minutes)
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
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from _ab import Ratio, Side, load  # same directory
from bench_compensated import VOCAB, entropy_rate, gpt, markov_batches, transition_matrix, warmup_cosine

from lightning_amp_plus.weights.fp8 import RECIPES, FallbackRule, FP8Training
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


# ------------------------------------------------------------------------------------------------------------- step
@dataclass
class Stepper:
    """One side of the step comparison: a model and its training step, which says whether it was a check step."""

    label: str
    step: Callable[[], tuple[float, bool]]
    fp8: FP8Training | None = None


def bare_side(seed: int, device: str, compiled: bool) -> Stepper:
    """torchao's recipe as its documentation runs it: ``convert_to_float8_training``, bf16 autocast, AdamW."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = gpt(seed).to(device)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return plain_stepper("torchao's recipe", model, None, seed, device, compiled)


def ours_side(seed: int, device: str, compiled: bool, interval: int) -> Stepper:
    """The same loop with ``FP8Training`` driving the check steps (its flags on every step)."""
    model = gpt(seed).to(device)
    fp8 = FP8Training("tensorwise", check_interval=interval, fallback=None)
    fp8.convert(model)
    return plain_stepper("FP8Training", model, fp8, seed, device, compiled)


def plain_stepper(
    label: str, model: nn.Module, fp8: FP8Training | None, seed: int, device: str, compiled: bool
) -> Stepper:
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    batches: Iterator[Tensor] = markov_batches(transition_matrix(), seed)
    done = 0

    def step() -> tuple[float, bool]:
        nonlocal done
        tokens = next(batches).to(device)
        check = fp8 is not None and fp8.is_check_step(done)
        synchronize(device)
        started = time.perf_counter()
        if fp8 is not None:
            fp8.before_forward()
        loss_of(forward, tokens, True, device).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fp8 is not None:
            fp8.after_step()
        synchronize(device)
        done += 1
        return time.perf_counter() - started, check

    return Stepper(label, step, fp8)


def fabric_side(seed: int, device: str, compiled: bool, interval: int | None) -> Stepper:
    """A Fabric loop: our plugin's ``fp8-mixed`` (``interval``), or torchao's conversion under Fabric's bf16-mixed."""
    import lightning as L
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_amp_plus.fabric import MixedPrecisionPlugin

    model = gpt(seed)
    if interval is None:
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"))
        fabric = L.Fabric(accelerator=device, devices=1, precision="bf16-mixed")
        plugin = None
    else:
        plugin = MixedPrecisionPlugin("fp8-mixed", device=device, fp8_check_interval=interval)
        fabric = L.Fabric(accelerator=device, devices=1, plugins=[plugin])
    wrapped = fabric.setup_module(torch.compile(model) if compiled else model)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW(wrapped.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    )
    batches: Iterator[Tensor] = markov_batches(transition_matrix(), seed)
    fp8 = None if plugin is None else plugin.fp8
    done = 0

    def step() -> tuple[float, bool]:
        nonlocal done
        tokens = next(batches).to(device)
        check = fp8 is not None and fp8.is_check_step(done)
        synchronize(device)
        started = time.perf_counter()
        logits = wrapped(tokens[:, :-1])
        fabric.backward(F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        done += 1
        return time.perf_counter() - started, check

    label = "torchao's recipe, Fabric bf16-mixed" if plugin is None else "fp8-mixed, Fabric plugin"
    return Stepper(label, step, fp8)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_bytes(run: Callable[[], object]) -> int:
    """The most bytes ``run`` held allocated on the CPU at once above what was live when it started.

    From the profiler's memory events (``torch.profiler.profile(profile_memory=True)``: each allocation and free of
    the CPU allocator, attributed to the op that made it or recorded on its own), summed in time order. What one op
    allocates and frees inside itself counts at its net: the peak of a composite op's own temporaries is not seen.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        run()
    changes = sorted(
        (event.time_range.start, event.self_cpu_memory_usage)
        for event in profiled.events()
        if event.self_cpu_memory_usage
    )
    live = peak = 0
    for _, change in changes:
        live += change
        peak = max(peak, live)
    return peak


def step_cost(args: argparse.Namespace) -> list[str]:
    """Per-step time of ours against torchao's bare recipe, eager and compiled, ordinary and check steps; the check
    step's peak memory against an ordinary step's."""
    interval = 4  # every 4th step of ours reads its casts: both kinds of step in every round
    # The sides are four instances of one model class: dynamo, which by default does not guard on module hooks, would
    # run them all through the graph it compiled for the first (torchao's, without our hooks). Guarded, each side
    # compiles its own graphs.
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    sides: dict[str, dict[str, Stepper]] = {}
    for mode in ("eager", "compiled"):
        compiled = mode == "compiled"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Fabric's and the plugin's remarks on CPU bf16 and FP8 emulation
            sides[mode] = {
                "bare": bare_side(0, args.device, compiled),
                "ours": ours_side(0, args.device, compiled, interval),
                "fabric ours": fabric_side(0, args.device, compiled, interval),
                "fabric torchao": fabric_side(0, args.device, compiled, None),
            }
            for side in sides[mode].values():  # compilation (both graphs of ours) and warm-up, untimed
                for _ in range(2 * interval):
                    side.step()
        print(f"  step: {mode} sides built and warmed up (load average {load():.2f})", flush=True)
    times: dict[tuple[str, str, bool], Side] = {}
    for r in range(args.rounds):
        for mode, group in sides.items():
            order = list(group.items()) if r % 2 == 0 else list(reversed(group.items()))
            taken: dict[tuple[str, str, bool], list[float]] = {}
            for _ in range(args.timed_steps):
                for key, side in order:  # the sides take turns, step by step
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        seconds, check = side.step()
                    taken.setdefault((mode, key, check), []).append(seconds)
            for found, seconds_taken in taken.items():
                timed = times.setdefault(found, Side(" ".join(map(str, found))))
                timed.times.extend(seconds_taken)
                timed.round_medians.append(statistics.median(seconds_taken))
        print(f"  step round {r + 1}/{args.rounds} (load average {load():.2f})", flush=True)
    lines = [
        f"### step: one tensorwise training step of the tiny GPT on {args.device} ({args.rounds} rounds x "
        f"{args.timed_steps} steps per side; every {interval}th step of ours a check step)",
        "",
        "| step | eager: ours ms | torchao ms | ours / torchao (per round [min, max]) | compiled: ours ms | torchao ms "
        "| ours / torchao (per round [min, max]) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = (
        ("FP8Training in a plain loop, ordinary step", "ours", False, "bare"),
        ("FP8Training in a plain loop, check step", "ours", True, "bare"),
        ("fp8-mixed (Fabric plugin), ordinary step", "fabric ours", False, "bare"),
        ("fp8-mixed (Fabric plugin), check step", "fabric ours", True, "bare"),
        ("torchao's recipe under Fabric's bf16-mixed", "fabric torchao", False, "bare"),
        ("fp8-mixed (Fabric plugin), ordinary step, against the row above", "fabric ours", False, "fabric torchao"),
    )
    for label, key, check, reference in rows:
        cells = []
        for mode in ("eager", "compiled"):
            ours, theirs = times[(mode, key, check)], times[(mode, reference, False)]
            ratio = Ratio.of(ours, theirs)
            cells.append(f"{ratio.a_ms:.1f} | {ratio.b_ms:.1f} | {ratio.of_medians:.3f}x ({ratio.per_round()})")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    lines += [
        "",
        "Peak CPU memory allocated during one step, above what was live before it (profiler memory events):",
        "",
    ]
    lines += ["| step | eager KiB | compiled KiB |", "|---|---:|---:|"]
    peaks: dict[str, list[int]] = {}
    for group in sides.values():
        ours = group["ours"]
        assert ours.fp8 is not None
        while ours.fp8.is_check_step(ours.fp8.state_dict()["steps"]):
            ours.step()  # the next step an ordinary one
        peaks.setdefault("torchao's recipe", []).append(peak_bytes(group["bare"].step))
        peaks.setdefault("FP8Training, ordinary step", []).append(peak_bytes(ours.step))
        while not ours.fp8.is_check_step(ours.fp8.state_dict()["steps"]):
            ours.step()
        peaks.setdefault("FP8Training, check step", []).append(peak_bytes(ours.step))
    for label, (eager, compiled) in peaks.items():
        lines.append(f"| {label} | {eager / 1024:.0f} | {compiled / 1024:.0f} |")
    ordinary, check = peaks["FP8Training, ordinary step"], peaks["FP8Training, check step"]
    lines.append(f"| check step / ordinary step | {check[0] / ordinary[0]:.3f}x | {check[1] / ordinary[1]:.3f}x |")
    return lines


# ------------------------------------------------------------------------------------------------------------ trace
class _Tiny(nn.Module):
    """Two eligible Linear layers (16 -> 32 -> 16)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.net(x)
        return out


def traced_step(precision: str, step: int) -> set[tuple[str, str]]:
    """The functions one Trainer step runs, as ``benchmarks/trace_step.py`` counts them: ``sys.setprofile`` from the
    step's batch start to its end, each Python function once by file and qualified name (comprehensions not
    counted), in this package, Lightning's precision plugins (Trainer and Fabric) and ``torch/amp/grad_scaler.py``."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_amp_plus
    from lightning_amp_plus import MixedPrecisionPlugin

    lightning_root = Path(pl.__file__).resolve().parent
    roots = (
        str(Path(lightning_amp_plus.__file__).resolve().parent),
        str(lightning_root / "plugins" / "precision"),
        str(lightning_root.parent / "fabric" / "plugins" / "precision"),
        str(Path(torch.__file__).resolve().parent / "amp" / "grad_scaler.py"),
    )
    found: set[tuple[str, str]] = set()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        name, path = frame.f_code.co_qualname, frame.f_code.co_filename
        if event == "call" and path.startswith(roots) and not name.endswith(("<listcomp>", "<genexpr>", "<dictcomp>")):
            found.add((path, name))

    class Tracer(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == step:
                sys.setprofile(profile)

        def on_train_batch_end(self, *_: Any) -> None:
            sys.setprofile(None)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _Tiny()

        def training_step(self, batch: tuple[Tensor, Tensor], _index: int) -> Tensor:
            x, y = batch
            return (self.model(x).float() - y).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    options = {"fp8_check_interval": 4} if precision == "fp8-mixed" else {}
    plugin = MixedPrecisionPlugin(precision, device="cpu", **options)  # type: ignore[arg-type]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[plugin],
        max_steps=step + 2,
        callbacks=[Tracer()],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), DataLoader(data, batch_size=8))
    return found


def trace(_args: argparse.Namespace) -> list[str]:
    """What one fp8-mixed Trainer step runs beyond a bf16-mixed step of the same model: an ordinary step and a check
    step (``fp8_check_interval=4``: step 3 is ordinary, step 4 a check step)."""
    import lightning_amp_plus

    ours = str(Path(lightning_amp_plus.__file__).resolve().parent) + "/"
    bf16 = traced_step("bf16-mixed", 3)
    lines = [
        "### trace: one Trainer step of fp8-mixed beyond bf16-mixed (two eligible Linear layers, AdamW)",
        "",
        "| step | fp8-mixed: functions | files | bf16-mixed: functions | files | beyond bf16-mixed: functions "
        "| files |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    listed = []
    for label, step in (("ordinary", 3), ("check", 4)):
        fp8 = traced_step("fp8-mixed", step)
        extra = sorted(fp8 - bf16)
        files = sorted({path for path, _ in extra})
        lines.append(
            f"| {label} | {len(fp8)} | {len({p for p, _ in fp8})} | {len(bf16)} | {len({p for p, _ in bf16})} | "
            f"{len(extra)} | {len(files)} |"
        )
        for path in files:
            names = ", ".join(name for where, name in extra if where == path)
            listed.append(f"* {label}, `{path.replace(ours, '')}`: {names}")
    return [*lines, "", *listed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["quality", "outliers", "readings", "step", "trace"])
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
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of the step part")
    parser.add_argument("--timed-steps", type=int, default=40, help="timed steps of each side per round")
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
    sections = {"quality": quality, "outliers": outliers, "readings": readings, "step": step_cost, "trace": trace}
    tables = [sections[part](args) for part in args.parts]
    print()
    for table in tables:
        print("\n".join(table), end="\n\n")
    print(f"`{command.strip()}` took {time.perf_counter() - started:.0f} s (load average {load():.2f})")


if __name__ == "__main__":
    main()
