"""How long a spike guard stays blind after it has judged one spike: the limit before and after, and the steps for which
the same spike is then not flagged, under ``action="skip"`` and ``action="clip"``.

Norms of ordinary steps are drawn around 1.7 +- 0.5 (a seeded Gaussian, the spread of the Trainer runs in
``docs/spike-guard.md``'s chart); after 200 of them comes a 14x spike, then ordinary steps until a spike of the same
size would be flagged again. Pure Python, under a second.

Run
    python benchmarks/bench_spike_blinding.py
"""

from __future__ import annotations

import random

from lightning_amp_plus import SpikeGuard

ORDINARY = (1.7, 0.5)
SPIKE = 24.0
BEFORE = 200


def blind_steps(action: str, seed: int = 0) -> tuple[float, float, int]:
    """The limit before and after one spike, and the ordinary steps until the same spike is flagged again."""
    rng = random.Random(seed)
    guard = SpikeGuard(action=action)  # type: ignore[arg-type]
    for _ in range(BEFORE):
        guard.observe(guard.judge(rng.gauss(*ORDINARY)))
    before = guard.judge(ORDINARY[0]).threshold_norm
    guard.observe(guard.judge(SPIKE))
    after = guard.judge(ORDINARY[0]).threshold_norm
    missed = 0
    while not guard.judge(SPIKE).spike:
        guard.observe(guard.judge(rng.gauss(*ORDINARY)))
        missed += 1
    return before, after, missed


def main() -> None:
    print(f"{BEFORE} ordinary steps (norms {ORDINARY[0]} +- {ORDINARY[1]}), then a spike of norm {SPIKE}:")
    for action in ("skip", "clip"):
        before, after, missed = blind_steps(action)
        print(f"  {action}: limit {before:.1f} before, {after:.1f} after; the same spike missed for {missed} steps")


if __name__ == "__main__":
    main()
