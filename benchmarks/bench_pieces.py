"""The compensated update of one large bf16 tensor, in pieces against whole: peak memory and time of a step.

Run: python benchmarks/bench_pieces.py [--elements 16777216] [--rounds 3]

``Compensator`` runs its FP32 math on pieces of at most ``weights.compensated.PIECE`` elements. This measures what
that saves on a tensor larger than a piece (an LLM's embedding is one): one AdamW step with Kahan compensation on a
single bf16 parameter, each mode in a fresh process (Linux: the rise of ``VmHWM`` during the step, after
``/proc/self/clear_refs`` resets it), and the time of a step, both modes interleaved in one process (best of the
rounds), one thread.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from lightning_amp_plus.weights import compensated

WHOLE = 1 << 62  # a piece larger than any tensor: the update runs on the whole tensor at once


def _status(key: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not found in /proc/self/status (Linux only)")


def _setup(elements: int) -> compensated.Compensator:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(elements).bfloat16())
    compensator = compensated.Compensator(torch.optim.AdamW([weight], lr=1e-3), "kahan")
    weight.grad = torch.randn_like(weight)
    compensator.step()  # the states and the buffer exist from here on
    return compensator


def peak_rise(mode: str, elements: int) -> float:
    """MiB the process's peak resident memory rises during one step (run in a fresh process)."""
    compensated.PIECE = WHOLE if mode == "whole" else compensated.PIECE
    compensator = _setup(elements)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS
    before = _status("VmRSS")
    compensator.step()
    return _status("VmHWM") - before


def step_times(elements: int, rounds: int) -> dict[str, float]:
    """Best time of a step per mode, in ms, the modes interleaved."""
    compensator, piece = _setup(elements), compensated.PIECE
    best = {"whole": float("inf"), "pieces": float("inf")}
    for _ in range(rounds):
        for mode in best:
            compensated.PIECE = WHOLE if mode == "whole" else piece
            start = time.perf_counter()
            compensator.step()
            best[mode] = min(best[mode], 1000 * (time.perf_counter() - start))
    compensated.PIECE = piece
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=["whole", "pieces"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(peak_rise(args.child, args.elements)))
        return
    rises = {}
    for mode in ("whole", "pieces"):
        command = [sys.executable, __file__, "--child", mode, "--elements", str(args.elements)]
        rises[mode] = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    times = step_times(args.elements, args.rounds)
    print(f"one bf16 tensor of {args.elements:,} elements, AdamW + Kahan, piece {compensated.PIECE:,} elements")
    print("| mode | peak rise during a step, MiB | bytes per element | step ms (best) |")
    print("|---|---:|---:|---:|")
    for mode in ("whole", "pieces"):
        per_element = rises[mode] * 2**20 / args.elements
        print(f"| {mode} | {rises[mode]:.0f} | {per_element:.1f} | {times[mode]:.0f} |")


if __name__ == "__main__":
    main()
