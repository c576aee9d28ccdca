"""Benchmark the work between ``backward()`` and ``optimizer.step()``: unscale, overflow check, gradient clipping.

What is measured
    About 22M gradients in 60 tensors (``--layout uniform``: 60 equal tensors; ``--layout mixed``: the shapes of five
    transformer blocks, big matrices next to small bias and LayerNorm vectors), once with fp32 gradients and once with
    fp16 gradients, all in one run:

    * ``roofline``: one in-place multiply over the same bytes (``flat.mul_(1.0)`` on the buffer the gradients live in;
      ``torch._foreach_mul_(grads, 1.0)`` is shown beside it). One read and one write of every gradient: nothing that
      must unscale the gradients can be faster.
    * ``ours``: without clipping, the check ``DynamicLossScaler.step`` and the plugins make when nothing clips and
      nothing reads the norm (``scaler.engine.unscale(opt, read=True)``: GradScaler's one-pass check-and-unscale
      kernel, no norm, plus the one host read of the flag for the skip decision); with clipping ``unscale_`` +
      ``DynamicLossScaler.clip_grad_norm_`` (which measures the norm, ``clip_grad_norm_``'s bit for bit: a second read,
      and multiplies only when over the limit). Also shown, without clipping: ``ours, norm measured``, the check of a
      scaler whose engine a reader asked for every step's norm (``engine.read_norms()``, as ``MixedPrecisionMonitor``
      does; a spike guard does the same): the kernel's pass, then the global norm (``grads.global_norm``), a second
      pass that only reads, both read on the host at once.
    * ``torch``: ``torch.amp.GradScaler.unscale_(opt)`` plus the ``found_inf`` read that ``GradScaler.step`` does (the
      host sync), and with clipping also ``torch.nn.utils.clip_grad_norm_(params, max_norm)``. GradScaler's public
      ``unscale_`` refuses fp16 gradients ("Attempting to unscale FP16 gradients"), so for fp16 the torch reference
      runs ``unscale_``'s own steps with its private ``_unscale_grads_(..., allow_fp16=True)``.
    * ``the kernel alone``: GradScaler's fused kernel, ``torch._amp_foreach_non_finite_check_and_unscale_(grads,
      found_inf, inv_scale)``, called with nothing around it, and the flag read: the floor of any check made from
      Python, shown against ours without clipping (not a target).
    * ``drop-in loops`` (fp32 only: GradScaler refuses fp16 gradients): the whole of a training loop's scaler calls,
      the same code for ``DynamicLossScaler`` and ``torch.amp.GradScaler``, over the same SGD optimizer (``lr=0``,
      no momentum: the cheapest step, so the scaler's share of the loop is the largest) and the same gradients:

      - ``unscale_ + step + update``: ``scaler.unscale_(opt); scaler.step(opt); scaler.update()``;
      - ``nanoGPT``: nanoGPT's loop, ``scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, 1.0);
        scaler.step(opt); scaler.update()`` (torch's own clip, called by the user: the scaler measures no norm).

      ``--count-ops`` also counts the aten ops each side's loop runs (torch.profiler, one loop each) and prints them
      side by side: where a ratio is over its target, what ours runs that GradScaler does not.

    Clipping is measured twice: ``max_norm`` far above the gradient norm (nothing to clip: ours does not multiply,
    torch's ``clip_grad_norm_`` always does) and ``max_norm`` well below it (clipping active in both).

How
    Parameters with ``.grad`` set and a ``torch.optim.SGD`` over them (both APIs take an optimizer). The gradient
    values are restored from a saved copy before every timed call (not timed), so no method ever sees values it
    already unscaled: repeated unscaling drives values into denormal numbers, about 10x slower on x86, which would make
    every method look slow (the denormal trap). The loss scale is a power of two (``--scale``, default 2**8) and the
    saved values are ``N(0, 1) * 0.01 * scale``, so the unscaled values are normal numbers around 1e-2. Between
    calls (untimed) ``update()`` resets each scaler's per-step state. The methods are interleaved within each
    repetition (all methods, then all again, ...) so machine noise hits them alike; medians over ``--reps``
    repetitions are reported, with ratios ours/torch and each/roofline, and a Markdown table at the end.

    Targets (reported, never asserted): with clipping ours <= 0.75x torch, without clipping ours <= 1.1x torch, the
    drop-in loops ours <= 1.05x GradScaler.

Run
    python benchmarks/bench_grads.py                  # 22M gradients, CPU (about 1-2 minutes on 2 cores)
    python benchmarks/bench_grads.py --quick          # 2M gradients, about 10 s: a smoke test
    python benchmarks/bench_grads.py --device cuda    # the same on a GPU (torch.cuda.synchronize around each call)
    python benchmarks/bench_grads.py --layout mixed   # transformer-like shapes instead of 60 equal tensors
    python benchmarks/bench_grads.py --threads 1      # steadier on a machine shared with other processes
    python benchmarks/bench_grads.py --dtypes fp32 --count-ops   # also count each drop-in loop's aten ops
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _ab import verdict  # same directory
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from lightning_amp_plus import DynamicLossScaler

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
_TARGET_CLIP = 0.75
_TARGET_NO_CLIP = 1.10
_TARGET_DROP_IN = 1.05
_DROP_IN_MAX_NORM = 1.0  # nanoGPT's grad_clip


# ----------------------------------------------------------------------------------------------------- set-up
def shapes(total: int, count: int, layout: str) -> list[tuple[int, ...]]:
    """Gradient shapes summing to about ``total`` elements in ``count`` tensors."""
    if layout == "uniform":
        return [(total // count,)] * count
    # Transformer blocks: qkv, out-proj, two MLP matrices (12 d^2 in all) plus their biases and two LayerNorms.
    blocks = max(1, count // 12)
    d = max(8, int(math.sqrt(total / (12 * blocks))))
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    return block * blocks


@dataclass
class GradSet:
    """Parameters whose gradients are views into one flat buffer, a saved copy of their values and an optimizer."""

    params: list[nn.Parameter]
    grads: list[Tensor]
    flat: Tensor
    saved: Tensor
    optimizer: torch.optim.Optimizer

    def restore(self) -> None:
        self.flat.copy_(self.saved)

    @property
    def numel(self) -> int:
        return self.flat.numel()

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def make_grad_set(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, scale: float) -> GradSet:
    numel = sum(math.prod(s) for s in shapes)
    gen = torch.Generator().manual_seed(0)
    saved = (torch.randn(numel, generator=gen) * (0.01 * scale)).to(device=device, dtype=dtype)
    flat = saved.clone()
    params: list[nn.Parameter] = []
    grads: list[Tensor] = []
    offset = 0
    for shape in shapes:
        n = math.prod(shape)
        param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        grad = flat[offset : offset + n].view(shape)
        param.grad = grad
        params.append(param)
        grads.append(grad)
        offset += n
    optimizer = torch.optim.SGD(params, lr=0.0)
    return GradSet(params, grads, flat, saved, optimizer)


def _subnormal_fraction(t: Tensor) -> float:
    tiny = torch.finfo(t.dtype).tiny
    a = t.float().abs() if t.dtype == torch.float16 else t.abs()
    # For fp16 storage the threshold is fp16's smallest normal; the arithmetic itself runs in fp32 on CPU.
    return float(((a > 0) & (a < tiny)).float().mean().item())


# ---------------------------------------------------------------------------------------------------- methods
class Methods:
    """The timed calls for one gradient set; ``reset()`` is the untimed work between two calls."""

    def __init__(self, gs: GradSet, device: torch.device, scale: float, max_norm_large: float, max_norm_small: float):
        self.gs = gs
        self.device = device
        self.scale = scale
        self.max_norm_large = max_norm_large
        self.max_norm_small = max_norm_small
        self.ours = DynamicLossScaler(init_scale=scale, growth_interval=10**9)
        # Put the scaler's state on the gradients' device, as scale(loss) would in training.
        self.ours.scale(torch.zeros((), device=device))
        # A scaler whose engine a reader asked for every step's norm, as MixedPrecisionMonitor asks (irreversible).
        self.ours_read = DynamicLossScaler(init_scale=scale, growth_interval=10**9)
        self.ours_read.engine.read_norms()
        self.ours_read.scale(torch.zeros((), device=device))
        self.fp16 = gs.flat.dtype == torch.float16
        self.torch_scaler = torch.amp.GradScaler(device.type, init_scale=scale, growth_interval=10**9)
        self.torch_scaler.scale(torch.zeros((), device=device))  # creates the scale tensor on the device
        self.inv_scale = torch.full((), 1.0 / scale, dtype=torch.float32, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.torch_unscale_name = (
            "GradScaler.unscale_'s steps, _unscale_grads_(allow_fp16=True) (its unscale_ refuses fp16 grads)"
            if self.fp16
            else "torch.amp.GradScaler.unscale_"
        )

    def reset(self) -> None:
        """Untimed: restore the gradient values and the scalers' per-step state (scale unchanged)."""
        self.ours.update(new_scale=self.scale)
        self.ours_read.update(new_scale=self.scale)
        if not self.fp16:
            self.torch_scaler.update(new_scale=self.scale)
        self.gs.restore()

    # roofline
    def roofline_flat(self) -> None:
        self.gs.flat.mul_(1.0)

    def roofline_foreach(self) -> None:
        torch._foreach_mul_(self.gs.grads, 1.0)

    # ours
    def ours_unscale(self) -> None:
        # The check step() makes when nothing clips and nothing reads the norm: GradScaler's one pass, no norm, and the
        # flag read on the host (the skip decision).
        self.ours.engine.unscale(self.gs.optimizer, read=True)

    def ours_unscale_measured(self) -> None:
        # The check when nothing clips but a reader (a monitor) asked for every step's norm: the kernel's pass, then
        # the global norm, read with the flag.
        self.ours_read.engine.unscale(self.gs.optimizer, read=True)

    def ours_clip_large(self) -> None:
        self.ours.unscale_(self.gs.optimizer)
        self.ours.clip_grad_norm_(self.gs.optimizer, self.max_norm_large)

    def ours_clip_small(self) -> None:
        self.ours.unscale_(self.gs.optimizer)
        self.ours.clip_grad_norm_(self.gs.optimizer, self.max_norm_small)

    # torch
    def _torch_unscale_and_sync(self) -> None:
        if self.fp16:
            # GradScaler.unscale_'s own steps, with the fp16 gradients its public unscale_ refuses allowed (its private
            # allow_fp16), then what GradScaler.step does: read the flags on the host (the one sync per step).
            scaler = self.torch_scaler
            assert scaler._scale is not None
            inv_scale = scaler._scale.double().reciprocal().float()
            found_inf = torch.full((), 0.0, dtype=torch.float32, device=scaler._scale.device)
            flags = scaler._unscale_grads_(self.gs.optimizer, inv_scale, found_inf, True)
            if sum(v.item() for v in flags.values()):
                raise FloatingPointError("unexpected non-finite gradients")
        else:
            self.torch_scaler.unscale_(self.gs.optimizer)

    def kernel_alone(self) -> None:
        # GradScaler's check-and-unscale kernel with nothing around it, and the flag read: no library makes this call.
        self.found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(self.gs.grads, self.found_inf, self.inv_scale)
        if self.found_inf.item():
            raise FloatingPointError("unexpected non-finite gradients")

    def _torch_sync(self) -> None:
        # GradScaler.step: `if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values())`.
        if self.fp16:
            return  # already read in _torch_unscale_and_sync
        state = self.torch_scaler._per_optimizer_states[id(self.gs.optimizer)]
        if sum(v.item() for v in state["found_inf_per_device"].values()):
            raise FloatingPointError("unexpected non-finite gradients")

    def torch_unscale(self) -> None:
        self._torch_unscale_and_sync()
        self._torch_sync()

    def torch_clip_large(self) -> None:
        self._torch_unscale_and_sync()
        torch.nn.utils.clip_grad_norm_(self.gs.params, self.max_norm_large)
        self._torch_sync()

    def torch_clip_small(self) -> None:
        self._torch_unscale_and_sync()
        torch.nn.utils.clip_grad_norm_(self.gs.params, self.max_norm_small)
        self._torch_sync()

    # drop-in loops: the same code over either scaler (fp32 only: GradScaler refuses fp16 gradients)
    def _loop(self, scaler: DynamicLossScaler | torch.amp.GradScaler) -> None:
        scaler.unscale_(self.gs.optimizer)
        scaler.step(self.gs.optimizer)
        scaler.update()

    def _nanogpt(self, scaler: DynamicLossScaler | torch.amp.GradScaler) -> None:
        scaler.unscale_(self.gs.optimizer)
        torch.nn.utils.clip_grad_norm_(self.gs.params, _DROP_IN_MAX_NORM)
        scaler.step(self.gs.optimizer)
        scaler.update()

    def ours_loop(self) -> None:
        self._loop(self.ours)

    def torch_loop(self) -> None:
        self._loop(self.torch_scaler)

    def ours_nanogpt(self) -> None:
        self._nanogpt(self.ours)

    def torch_nanogpt(self) -> None:
        self._nanogpt(self.torch_scaler)

    def table(self) -> dict[str, Callable[[], None]]:
        return {
            "roofline (flat mul_)": self.roofline_flat,
            "roofline (_foreach_mul_)": self.roofline_foreach,
            "ours unscale_": self.ours_unscale,
            "torch unscale_": self.torch_unscale,
            "ours unscale_, norm measured": self.ours_unscale_measured,
            "torch unscale_, norm measured": self.torch_unscale,
            "ours unscale_+clip (large max_norm)": self.ours_clip_large,
            "torch unscale_+clip (large max_norm)": self.torch_clip_large,
            "ours unscale_+clip (small max_norm)": self.ours_clip_small,
            "torch unscale_+clip (small max_norm)": self.torch_clip_small,
            "the kernel alone": self.kernel_alone,
            **(
                {}
                if self.fp16
                else {
                    "ours drop-in: unscale_+step+update": self.ours_loop,
                    "torch drop-in: unscale_+step+update": self.torch_loop,
                    "ours drop-in: nanoGPT loop": self.ours_nanogpt,
                    "torch drop-in: nanoGPT loop": self.torch_nanogpt,
                }
            ),
        }


def check_agreement(methods: Methods) -> dict[str, float]:
    """Untimed sanity check: ours and torch produce the same gradients, for each case (max abs difference)."""
    gs = methods.gs
    pairs = {
        "no clip": (methods.ours_unscale, methods.torch_unscale),
        "no clip, norm measured": (methods.ours_unscale_measured, methods.torch_unscale),
        "clip large": (methods.ours_clip_large, methods.torch_clip_large),
        "clip small": (methods.ours_clip_small, methods.torch_clip_small),
    }
    if not methods.fp16:
        pairs["drop-in loop"] = (methods.ours_loop, methods.torch_loop)
        pairs["nanoGPT loop"] = (methods.ours_nanogpt, methods.torch_nanogpt)
    out: dict[str, float] = {}
    for case, (ours, theirs) in pairs.items():
        methods.reset()
        ours()
        mine = gs.flat.float().clone()
        methods.reset()
        theirs()
        out[case] = float((mine - gs.flat.float()).abs().max().item())
    methods.reset()
    return out


def count_ops(methods: Methods, fn: Callable[[], None]) -> Counter[str]:
    """The aten ops one call of ``fn`` runs (nested ones included), counted by name with torch.profiler."""
    methods.reset()
    fn()  # warm: first-call work (caches, lazily built tensors) is not counted
    methods.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    methods.reset()
    return Counter(event.name for event in prof.events() if event.name.startswith("aten::"))


def print_op_counts(methods: Methods) -> None:
    """Each drop-in loop's aten ops, ours against GradScaler's, with the difference."""
    for loop, ours, theirs in (
        ("unscale_+step+update", methods.ours_loop, methods.torch_loop),
        ("nanoGPT loop", methods.ours_nanogpt, methods.torch_nanogpt),
    ):
        mine, its = count_ops(methods, ours), count_ops(methods, theirs)
        print(f"   aten ops per call, {loop}: ours {sum(mine.values())}, GradScaler {sum(its.values())}")
        print(f"     {'op':<48} {'ours':>5} {'torch':>6} {'diff':>5}")
        for name in sorted(set(mine) | set(its), key=lambda n: (-(abs(mine[n] - its[n])), n)):
            print(f"     {name:<48} {mine[name]:>5} {its[name]:>6} {mine[name] - its[name]:>+5}")


# ----------------------------------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_methods(methods: Methods, reps: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call for each method, interleaved: every repetition runs each method once, in turn."""
    table = methods.table()
    times: dict[str, list[float]] = {name: [] for name in table}
    device = methods.device
    for rep in range(warmup + reps):
        for name, fn in table.items():
            methods.reset()
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            elapsed = time.perf_counter() - start
            if rep >= warmup:
                times[name].append(elapsed)
    methods.reset()
    return times


# ---------------------------------------------------------------------------------------------------- reporting
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2M gradients and fewer repetitions (smoke test)")
    parser.add_argument("--numel", type=int, default=None, help="total gradient elements (default 22M, quick 2M)")
    parser.add_argument("--tensors", type=int, default=60, help="number of gradient tensors")
    parser.add_argument("--layout", choices=("uniform", "mixed"), default="uniform")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(_DTYPES), default=list(_DTYPES))
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per method (default 40, quick 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    parser.add_argument("--scale", type=float, default=2.0**8, help="loss scale, a power of two")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--count-ops", action="store_true", help="count each drop-in loop's aten ops, ours vs torch")
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    numel = args.numel or (2_000_000 if args.quick else 22_000_000)
    reps = args.reps or (7 if args.quick else 40)
    layout_shapes = shapes(numel, args.tensors, args.layout)
    warnings.filterwarnings("ignore", category=FutureWarning)

    load_before = os.getloadavg()[0]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__} on {where}")
    print(
        f"{sum(math.prod(s) for s in layout_shapes):,} gradient elements in {len(layout_shapes)} tensors "
        f"({args.layout} layout), "
        f"loss scale {args.scale:g}, {reps} timed repetitions (+{args.warmup} warm-up), medians reported"
    )

    rows: list[tuple[str, str, float, float, float, float]] = []  # dtype, case, ours, torch, roofline, min ratio
    for label in args.dtypes:
        dtype = _DTYPES[label]
        gs = make_grad_set(layout_shapes, dtype, device, args.scale)
        with torch.no_grad():
            norm = float(torch.linalg.vector_norm(gs.saved.float()).item()) / args.scale
        methods = Methods(gs, device, args.scale, max_norm_large=norm * 1e3, max_norm_small=norm / 10)
        print()
        print(f"== {label} gradients: {gs.nbytes / 2**20:.1f} MiB, unscaled global norm {norm:.4g}")
        print(f"   torch reference for unscale: {methods.torch_unscale_name}")
        print(f"   max_norm large = {methods.max_norm_large:.4g} (no clipping), small = {methods.max_norm_small:.4g}")
        methods.ours_unscale()
        sub = _subnormal_fraction(gs.flat)
        methods.reset()
        print(f"   subnormal fraction after one unscale (storage dtype): {sub:.2e}")
        agree = check_agreement(methods)
        print("   max |ours - torch| after each case: " + ", ".join(f"{k} {v:.2e}" for k, v in agree.items()))
        if args.count_ops and not methods.fp16:
            print_op_counts(methods)

        times = time_methods(methods, reps, args.warmup)
        med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        roof = med["roofline (flat mul_)"]
        gbps = 2 * gs.nbytes / (roof / 1e3) / 1e9
        print(f"   {'method':<42} {'median ms':>10} {'min ms':>9} {'x roofline':>11}")
        for name, ts in times.items():
            print(f"   {name:<42} {med[name]:>10.2f} {min(ts) * 1e3:>9.2f} {med[name] / roof:>10.2f}x")
        print(f"   roofline bandwidth (read + write): {gbps:.1f} GB/s")
        for case, key in (
            ("no clip", "unscale_"),
            ("no clip, norm measured (under a monitor)", "unscale_, norm measured"),
            ("clip, large max_norm", "unscale_+clip (large max_norm)"),
            ("clip, small max_norm", "unscale_+clip (small max_norm)"),
        ):
            best = min(times[f"ours {key}"]) / min(times[f"torch {key}"])
            rows.append((label, case, med[f"ours {key}"], med[f"torch {key}"], roof, best))
        best = min(times["ours unscale_"]) / min(times["the kernel alone"])
        rows.append(
            (label, "no clip, against the kernel alone", med["ours unscale_"], med["the kernel alone"], roof, best)
        )
        if not methods.fp16:
            for case, key in (
                ("drop-in: unscale_ + step + update", "drop-in: unscale_+step+update"),
                ("drop-in: nanoGPT loop (unscale_, torch's clip_grad_norm_, step, update)", "drop-in: nanoGPT loop"),
            ):
                best = min(times[f"ours {key}"]) / min(times[f"torch {key}"])
                rows.append((label, case, med[f"ours {key}"], med[f"torch {key}"], roof, best))

    print()
    print("## Results (median ms per call; ratios of medians)")
    print()
    print(
        "| grads | case | ours ms | torch ms | roofline ms | ours/torch | ours/torch (min) | ours/roof | torch/roof "
        "| target (on medians) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, case, ours, theirs, roof, best in rows:
        target = (
            _TARGET_DROP_IN
            if case.startswith("drop-in")
            else _TARGET_NO_CLIP
            if case.startswith("no clip")
            else _TARGET_CLIP
        )
        judged = "not a target" if "alone" in case else verdict(ours / theirs, target)
        print(
            f"| {label} | {case} | {ours:.2f} | {theirs:.2f} | {roof:.2f} | {ours / theirs:.2f}x | {best:.2f}x | "
            f"{ours / roof:.2f}x | {theirs / roof:.2f}x | {judged} |"
        )
    print()
    print(
        "ours/torch (min): ratio of the fastest calls, less sensitive to other processes on the machine. "
        f"Load average before: {load_before:.2f}, after: {os.getloadavg()[0]:.2f} (> ~0.3 means shared cores)."
    )
    print()
    print(
        "'the kernel alone': torch._amp_foreach_non_finite_check_and_unscale_ with nothing around it, and the flag "
        "read (not a target: the floor of any check made from Python)."
    )
    if "fp16" in args.dtypes:
        print(
            "fp16 'torch' = GradScaler.unscale_'s own steps with allow_fp16=True (its public unscale_ raises on fp16 "
            "gradients) + the flags read."
        )


if __name__ == "__main__":
    main()
