"""Benchmark the fused-optimizer path: scaler + fused AdamW per step, and the host syncs the scaler makes.

What is measured
    About 22M parameters in 60 tensors (``--layout uniform``; ``mixed``: transformer-block shapes), fp32, with
    ``torch.optim.AdamW(fused=True)`` (``--optimizer`` picks another fused one). One step is ``scaler.step(opt)`` +
    ``scaler.update()`` (what a training loop pays between backward and the next forward), for:

    * ``ours``: ``DynamicLossScaler`` (the fused path: GradScaler's check kernel by 1.0, no norm since nothing reads
      one, ``grad_scale``/``found_inf`` handed to the optimizer, the policy advanced on the device; each step's values
      are copied into a host buffer and counted once per ``max_consecutive_skips`` steps, 50 by default, read from
      that buffer's memory: no host read of a tensor in the step, and the mean per step includes the counting);
    * ``torch``: ``torch.amp.GradScaler`` with the same optimizer (its fused path: the same check kernel by 1.0, no
      host sync);
    * ``optimizer alone``: ``opt.step()`` on gradients that need no unscaling, no scaler: the cost of the optimizer
      itself, the floor for both;
    * with clipping (``--clip``, on by default): ``unscale_`` + ``clip_grad_norm_`` + ``step`` + ``update`` for ours
      (its unscale path: GradScaler's check pass, then the norm ``clip_grad_norm_`` measures and the clip's multiply,
      one host sync that reads the flag and the clip coefficient together; the fused optimizer then steps unscaled
      gradients) against GradScaler's ``unscale_`` + ``torch.nn.utils.clip_grad_norm_`` + ``step`` + ``update`` (the
      same passes, no host sync: the flag goes to the fused kernel).

    Host syncs per step are counted for each side over ``--count-steps`` steps, two ways: torch.profiler's
    ``aten::_local_scalar_dense`` events outside the optimizer's own step (on CPU the fused kernels read their scalars
    themselves, in C++, which is no sync there), and every Python-level read of a tensor value (``item``, ``tolist``,
    ``__bool__``, ...), patched. On CUDA also the runtime's synchronising calls (``cudaStreamSynchronize``,
    ``cudaEventSynchronize``, ``cudaDeviceSynchronize``, blocking ``cudaMemcpy``).

    ``--count-ops`` also counts the aten ops of one step of each side (torch.profiler, nested ones included; on the
    optimizer alone, what the optimizer's own step runs) and prints ours against GradScaler's, op by op: the fixed
    cost each side adds around the optimizer.

How
    Gradients are restored from a saved copy before every timed step (not timed): repeated unscaling would drive them
    into denormal numbers, about 10x slower on x86 (the denormal trap). Saved values are ``N(0, 1) * 0.01 * scale``
    with a power-of-two scale (``--scale``), so unscaled gradients are normal numbers around 1e-2; the learning rate
    is 1e-6 so parameters and moments stay normal too. ``--overflow-every K`` poisons one gradient every K steps (the
    skipped steps are timed as well). Sides are interleaved step by step (each side steps once, then the next, in an
    order reversed at every step; ``--reps`` x ``--steps`` steps per side) so machine noise hits them alike; each side
    has its own copy of the parameters and optimizer state, and the sides take turns on every copy (where a copy lies
    in memory made the side using it up to 4% slower or faster here). A second GradScaler side, timed like the others,
    is the control: its ratio to the first is how far two identical sides differ on this machine, the resolution of
    every ratio. Reported: median and mean ms per step, ratios ours/torch of medians and of means, the syncs per
    step, and a Markdown table. Nothing is asserted.

    Targets (reported): no clipping, ours <= 1.0x torch per step with 0 host syncs per step caused by the scaler; with
    clipping ours <= 1.0x torch (both make the same passes; ours reads the flag and the coefficient once on the host).

Run
    python benchmarks/bench_fused.py                    # 22M parameters on CPU, about 1-2 minutes on 2 cores
    python benchmarks/bench_fused.py --quick            # 2M parameters: a smoke test, seconds
    python benchmarks/bench_fused.py --device cuda      # the same on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _ab import verdict  # same directory
from bench_grads import shapes, sync  # same directory: the gradient layouts of the gradient-pass benchmark
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import host_reads  # the tests' spy on every Python-level read of a tensor value

from lightning_amp_plus import DynamicLossScaler

_TARGET = 1.0
_OPTIMIZERS = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
}
_CUDA_SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


# ----------------------------------------------------------------------------------------------------- set-up
@dataclass
class Side:
    """One side of the comparison: its parameters, optimizer, scaler and the step it times."""

    name: str
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scaler: Any
    step: Callable[[Side], None]
    saved: list[Tensor]
    scaled: bool
    times: list[float] = field(default_factory=list)

    def restore(self, step: int, overflow_every: int | None) -> None:
        """Untimed: put the (scaled, or unscaled for the optimizer alone) gradients back, poisoned if it is time."""
        for param, saved in zip(self.params, self.saved, strict=True):
            assert param.grad is not None
            param.grad.copy_(saved)
        if overflow_every and step % overflow_every == overflow_every - 1 and self.scaled:
            with torch.no_grad():
                self.params[-1].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]


def make_side(
    name: str, grads: list[Tensor], opt_cls: type[torch.optim.Optimizer], scaler: Any, step: Callable[[Side], None],
    scale: float,
) -> Side:  # fmt: skip
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    scaled = scaler is not None
    saved = [g.clone() if scaled else g / scale for g in grads]
    for param, value in zip(params, saved, strict=True):
        param.grad = value.clone()
    kwargs: dict[str, Any] = {"lr": 1e-6, "fused": True}
    if opt_cls is torch.optim.SGD:
        kwargs["momentum"] = 0.9
    optimizer = opt_cls(params, **kwargs)
    if scaler is not None:
        scaler.scale(torch.zeros((), device=grads[0].device))  # the scale tensor on the device, as a loss would
    return Side(name, params, optimizer, scaler, step, saved, scaled)


def fused_step(side: Side) -> None:
    side.scaler.step(side.optimizer)
    side.scaler.update()


def alone_step(side: Side) -> None:
    side.optimizer.step()


def ours_clip_step(side: Side, max_norm: float) -> None:
    side.scaler.unscale_(side.optimizer)
    side.scaler.clip_grad_norm_(side.optimizer, max_norm)
    side.scaler.step(side.optimizer)
    side.scaler.update()


def torch_clip_step(side: Side, max_norm: float) -> None:
    side.scaler.unscale_(side.optimizer)
    torch.nn.utils.clip_grad_norm_(side.params, max_norm)
    side.scaler.step(side.optimizer)
    side.scaler.update()


# ---------------------------------------------------------------------------------------------------- counting
def count_syncs(side: Side, steps: int, overflow_every: int | None, device: torch.device) -> dict[str, float]:
    """Host syncs per step of ``side``: profiler scalar reads outside the optimizer, Python reads, CUDA syncs."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    calls: list[str] = []
    with profile(activities=activities) as prof:
        for step in range(steps):
            side.restore(step, overflow_every)
            with host_reads(calls):
                side.step(side)
    scalar_reads = 0
    cuda_syncs = 0
    for event in prof.events():
        if event.name == "aten::_local_scalar_dense":
            parent, inside = event.cpu_parent, False
            while parent is not None:
                inside = inside or parent.name.startswith("Optimizer.step#")
                parent = parent.cpu_parent
            scalar_reads += not inside
        elif any(event.name.startswith(name) for name in _CUDA_SYNCS) and "Async" not in event.name:
            cuda_syncs += 1
    return {"scalar reads": scalar_reads / steps, "python reads": len(calls) / steps, "cuda syncs": cuda_syncs / steps}


def count_ops(side: Side, overflow_every: int | None) -> Counter[str]:
    """The aten ops one step of ``side`` runs (nested ones included), counted by name with torch.profiler."""
    side.restore(0, overflow_every)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        side.step(side)
    return Counter(event.name for event in prof.events() if event.name.startswith("aten::"))


def print_op_counts(pairs: list[tuple[str, Side, Side]], overflow_every: int | None) -> None:
    """Each pair's aten ops per step, ours against GradScaler's, with the difference."""
    for label, ours, theirs in pairs:
        mine, its = count_ops(ours, overflow_every), count_ops(theirs, overflow_every)
        print(f"   aten ops per step, {label}: ours {sum(mine.values())}, GradScaler {sum(its.values())}")
        print(f"     {'op':<48} {'ours':>5} {'torch':>6} {'diff':>5}")
        for name in sorted(set(mine) | set(its), key=lambda n: (-(abs(mine[n] - its[n])), n)):
            if mine[name] != its[name]:
                print(f"     {name:<48} {mine[name]:>5} {its[name]:>6} {mine[name] - its[name]:>+5}")
        same = sum(min(mine[n], its[n]) for n in set(mine) & set(its) if mine[n] == its[n])
        print(f"     (ops run as often on both sides: {same}, not listed)")


# ------------------------------------------------------------------------------------------------------ timing
def rotate(sides: list[Side], memories: list[tuple[list[nn.Parameter], torch.optim.Optimizer]], step: int) -> None:
    """Give side ``k`` the parameters and optimizer made for side ``k + step`` (modulo): each side uses every copy."""
    for k, side in enumerate(sides):
        side.params, side.optimizer = memories[(k + step) % len(memories)]


def time_sides(sides: list[Side], steps: int, overflow_every: int | None, device: torch.device) -> None:
    """Each step, every side steps once, in an order reversed from one step to the next: drift hits all alike.

    The sides take turns on every copy of the parameters and optimizer state (:func:`rotate`): where each copy lies in
    memory made a side up to 4% slower or faster here, the same for all of them this way.
    """
    memories = [(side.params, side.optimizer) for side in sides]
    for step in range(len(sides)):  # warm-up, untimed: every side meets every copy once
        rotate(sides, memories, step)
        for side in sides:
            side.restore(step, None)
            side.step(side)
    for step in range(steps):
        rotate(sides, memories, step)
        for side in sides if step % 2 == 0 else reversed(sides):
            side.restore(step, overflow_every)
            sync(device)
            start = time.perf_counter()
            side.step(side)
            sync(device)
            side.times.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2M parameters and fewer repetitions (smoke test)")
    parser.add_argument("--numel", type=int, default=None, help="total parameters (default 22M, quick 2M)")
    parser.add_argument("--tensors", type=int, default=60)
    parser.add_argument("--layout", choices=("uniform", "mixed"), default="uniform")
    parser.add_argument("--optimizer", choices=tuple(_OPTIMIZERS), default="adamw")
    parser.add_argument("--reps", type=int, default=None, help="rounds (default 8, quick 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per side per round (default 25, quick 10)")
    parser.add_argument("--count-steps", type=int, default=100, help="steps over which host syncs are counted")
    parser.add_argument("--overflow-every", type=int, default=None, help="poison a gradient every K steps")
    parser.add_argument("--scale", type=float, default=2.0**8)
    parser.add_argument("--no-clip", dest="clip", action="store_false", help="skip the clipping comparison")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--count-ops", action="store_true", help="count each side's aten ops per step, ours vs torch")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)
    numel = args.numel or (2_000_000 if args.quick else 22_000_000)
    reps = args.reps or (3 if args.quick else 8)
    steps = args.steps or (10 if args.quick else 25)
    opt_cls = _OPTIMIZERS[args.optimizer]
    layout = shapes(numel, args.tensors, args.layout)
    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(s, generator=gen) * (0.01 * args.scale)).to(device) for s in layout]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    load_before = os.getloadavg()[0]
    print(f"torch {torch.__version__} on {where}")
    print(
        f"{sum(g.numel() for g in grads):,} fp32 parameters in {len(grads)} tensors ({args.layout}), "
        f"{opt_cls.__name__}(fused=True), loss scale {args.scale:g}, {reps} rounds x {steps} steps per side"
        + (f", an overflow every {args.overflow_every} steps" if args.overflow_every else "")
    )

    def scaler_pair() -> tuple[DynamicLossScaler, torch.amp.GradScaler]:
        return (
            DynamicLossScaler(device.type, init_scale=args.scale, growth_interval=10**9),
            torch.amp.GradScaler(device.type, init_scale=args.scale, growth_interval=10**9),
        )

    ours_s, torch_s = scaler_pair()
    sides = [
        make_side("ours", grads, opt_cls, ours_s, fused_step, args.scale),
        make_side("torch", grads, opt_cls, torch_s, fused_step, args.scale),
        make_side("optimizer alone", grads, opt_cls, None, alone_step, args.scale),
        # The same as "torch": how far two identical sides differ here, the resolution of the ratios.
        make_side("torch again", grads, opt_cls, scaler_pair()[1], fused_step, args.scale),
    ]
    if args.clip:
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) / args.scale
        max_norm = norm / 10  # clipping active
        ours_c, torch_c = scaler_pair()
        sides += [
            make_side("ours + clip", grads, opt_cls, ours_c, lambda s: ours_clip_step(s, max_norm), args.scale),
            make_side("torch + clip", grads, opt_cls, torch_c, lambda s: torch_clip_step(s, max_norm), args.scale),
        ]
    for side in sides:  # warm-up, untimed
        for step in range(3):
            side.restore(step, None)
            side.step(side)
    if args.count_ops:
        named = {side.name: side for side in sides}
        pairs = [("no clipping", named["ours"], named["torch"])]
        if args.clip:
            pairs.append(("clipping", named["ours + clip"], named["torch + clip"]))
        print_op_counts(pairs, None)
    syncs = {side.name: count_syncs(side, args.count_steps, args.overflow_every, device) for side in sides}
    time_sides(sides, reps * steps, args.overflow_every, device)

    print()
    print(f"   {'side':<18} {'median ms':>10} {'mean ms':>9} {'min ms':>8}   host syncs per step")
    stats = {}
    for side in sides:
        ms = [t * 1e3 for t in side.times]
        stats[side.name] = (statistics.median(ms), statistics.fmean(ms), min(ms))
        s = syncs[side.name]
        cuda = f", cuda {s['cuda syncs']:.2f}" if device.type == "cuda" else ""
        print(
            f"   {side.name:<18} {stats[side.name][0]:>10.2f} {stats[side.name][1]:>9.2f} {stats[side.name][2]:>8.2f}"
            f"   profiler {s['scalar reads']:.2f}, python {s['python reads']:.2f}{cuda}"
        )
    print()
    print("## Results (ms per step; ratios ours/torch)")
    print()
    print(
        "| case | ours ms (median) | torch ms (median) | optimizer alone ms | ours/torch (medians) "
        "| ours/torch (means) | host reads per step, ours / torch: Python (profiler) | target |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|")
    cases = [("no clipping (fused path)", "ours", "torch")]
    if args.clip:
        cases.append(("clipping (unscale path)", "ours + clip", "torch + clip"))
    cases.append(("control: GradScaler against itself", "torch again", "torch"))
    resolution = abs(stats["torch again"][0] / stats["torch"][0] - 1)
    for label, a, b in cases:
        ratio, mean_ratio = stats[a][0] / stats[b][0], stats[a][1] / stats[b][1]
        s_a, s_b = syncs[a], syncs[b]
        count = " / ".join(f"{s['python reads']:.2f} ({s['scalar reads']:.2f})" for s in (s_a, s_b))
        target = verdict(ratio, _TARGET)
        if a == "torch again":
            target = "(the resolution)"
        elif ratio > _TARGET and ratio - _TARGET <= resolution:
            target = f"within the resolution (<= {_TARGET:.2f}x; the control differs by {resolution:.1%})"
        print(
            f"| {label} | {stats[a][0]:.2f} | {stats[b][0]:.2f} | {stats['optimizer alone'][0]:.2f} | {ratio:.3f}x "
            f"| {mean_ratio:.3f}x | {count} | {target} |"
        )
    print()
    print(
        "Host reads: Python-level reads of a tensor value (item, tolist, numpy, ...) made during the step, and in "
        "brackets the profiler's count of aten::_local_scalar_dense outside the optimizer (tolist reads without "
        "one, so the two can differ). "
        f"Load average before: {load_before:.2f}, after: {os.getloadavg()[0]:.2f} (> ~0.3 means shared cores)."
    )


if __name__ == "__main__":
    main()
