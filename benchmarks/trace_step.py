"""Trace one training step: which functions of which files run, for this package and for Lightning's own plugin.

What is measured
    One Trainer step (the third of a 4-step fit: the scale has moved, the optimizer state exists) of an
    ``nn.Linear(4, 1)`` trained with AdamW, traced with ``sys.setprofile`` from ``on_train_batch_start`` to
    ``on_train_batch_end``. Every Python function that runs in that span is counted once, by file and qualified name
    (comprehensions are not counted: they are not functions a reader follows, and Python 3.12 inlines them):

    * **ours**: the functions of ``lightning_amp_plus`` (the plugin, the engine, the guard, the scaler, ...);
    * **lightning**: for ``MixedPrecision`` + ``torch.amp.GradScaler``, the functions of Lightning's precision plugins
      (``plugins/precision/amp.py``, ``precision.py``) and of ``torch/amp/grad_scaler.py``: what a reader of that
      stack follows.

    Variants: ``16-mixed`` with clipping by norm (``gradient_clip_val=1.0``; the issue's reference case), the same with
    a fused AdamW, without clipping, and ``bf16-mixed``. The Trainer's own loop and torch's optimizer are not counted:
    both stacks run them alike. Nothing is timed.

Run
    python benchmarks/trace_step.py            # the table, a few seconds
    python benchmarks/trace_step.py --list     # also every function, file by file (what docs/design.md shows)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_amp_plus
from lightning_amp_plus import MixedPrecisionPlugin

_OURS = str(Path(lightning_amp_plus.__file__).resolve().parent) + os.sep
_LIGHTNING_PRECISION = str(Path(pl.__file__).resolve().parent / "plugins" / "precision") + os.sep
_GRAD_SCALER = str(Path(torch.__file__).resolve().parent / "amp" / "grad_scaler.py")
_TRACED_STEP = 2
_COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<setcomp>", "<dictcomp>")


@dataclass(frozen=True)
class Variant:
    """One traced configuration."""

    name: str
    precision: str
    clip: float | None
    fused: bool


VARIANTS = (
    Variant("16-mixed, clip by norm", "16-mixed", 1.0, fused=False),
    Variant("16-mixed, clip by norm, fused AdamW", "16-mixed", 1.0, fused=True),
    Variant("16-mixed, no clipping", "16-mixed", None, fused=False),
    Variant("16-mixed, no clipping, fused AdamW", "16-mixed", None, fused=True),
    Variant("bf16-mixed, clip by norm", "bf16-mixed", 1.0, fused=False),
)


class Tiny(pl.LightningModule):
    """``nn.Linear(4, 1)`` on a squared loss, AdamW."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.fused = fused

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return (self.net(x) - y).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused)


class Tracer(pl.Callback):
    """Counts the functions run between the traced step's batch start and end, by file."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots
        self.functions: dict[str, set[str]] = defaultdict(set)

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        path, name = frame.f_code.co_filename, frame.f_code.co_qualname
        # Comprehensions are not functions a reader follows (Python 3.12 inlines them): not counted.
        if path.startswith(self.roots) and not name.endswith(_COMPREHENSIONS):
            self.functions[path].add(name)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == _TRACED_STEP:
            sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        sys.setprofile(None)


def trace(variant: Variant, ours: bool) -> dict[str, set[str]] | None:
    """The functions (by file) one step of ``variant`` runs, for our plugin or for Lightning's (``None``: it refuses).

    Lightning's fp16 plugin refuses to clip the gradients of a fused optimizer (``MisconfigurationException``).
    """
    torch.manual_seed(0)
    plugin = MixedPrecisionPlugin(variant.precision, device="cpu") if ours else MixedPrecision(variant.precision, "cpu")
    tracer = Tracer((_OURS,) if ours else (_LIGHTNING_PRECISION, _GRAD_SCALER))
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[plugin],
        max_steps=4,
        gradient_clip_val=variant.clip,
        callbacks=[tracer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    try:
        trainer.fit(Tiny(variant.fused), DataLoader(data, batch_size=8))
    except Exception:
        sys.setprofile(None)
        if ours:
            raise
        return None
    return dict(tracer.functions)


def _short(path: str) -> str:
    for root, label in ((_OURS, "lightning_amp_plus/"), (_LIGHTNING_PRECISION, "lightning/.../precision/")):
        if path.startswith(root):
            return label + path[len(root) :]
    return "torch/amp/grad_scaler.py" if path == _GRAD_SCALER else path


def main() -> None:
    """Print, per variant, the distinct functions and files one step runs, ours against Lightning's."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="also list every function, file by file")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = []
    for variant in VARIANTS:
        ours, theirs = trace(variant, ours=True), trace(variant, ours=False)
        rows.append((variant, ours, theirs))
    print(f"{'one Trainer step':38} {'ours: functions':>16} {'files':>6} {'Lightning+GradScaler':>21} {'files':>6}")
    for variant, ours, theirs in rows:
        assert ours is not None
        count = sum(map(len, ours.values()))
        if theirs is None:
            print(f"{variant.name:38} {count:>16} {len(ours):>6} {'refuses':>21} {'':>6}")
            continue
        print(f"{variant.name:38} {count:>16} {len(ours):>6} {sum(map(len, theirs.values())):>21} {len(theirs):>6}")
    if args.list:
        for variant, ours, theirs in rows:
            for label, found in (("ours", ours), ("Lightning + GradScaler", theirs)):
                if found is None:
                    continue
                print(f"\n## {variant.name}: {label}")
                for path in sorted(found, key=_short):
                    print(f"{_short(path)}: {', '.join(sorted(found[path]))}")


if __name__ == "__main__":
    main()
