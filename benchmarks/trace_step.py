"""Trace one training step: which functions of which files run, for this package and for Lightning's own plugin.

What is measured
    One Trainer step (the third of a 4-step fit: the scale has moved, the optimizer state exists) of a small model
    trained with AdamW, traced with ``sys.setprofile`` from ``on_train_batch_start`` to ``on_train_batch_end``. One
    tracer, the same roots on both sides: every Python function that runs in that span is counted once, by file and
    qualified name, if its file is

    * this package's (``lightning_amp_plus``: the plugin, the engine, the scale, FP8...);
    * one of Lightning's precision plugin files (``lightning/pytorch/plugins/precision/``,
      ``lightning/fabric/plugins/precision/``): the ``Precision`` hooks the plugin runs (its own or Lightning's
      ``pre_backward``, ``_after_closure``, clipping...);
    * ``torch/amp/grad_scaler.py``.

    Code a module generates (a dataclass's ``__init__``) is counted with that module, under its class's name (each
    dataclass's ``__init__`` is a function of its own, though Python names them all alike). Comprehensions are not
    counted (they are not functions a reader follows, and Python 3.12 inlines them). The Trainer's own loop, torch's
    optimizer and torchao's float8 code are not counted: both sides run them alike.

    Variants: ``16-mixed`` with clipping by norm (``gradient_clip_val=1.0``) against Lightning's ``MixedPrecision`` +
    ``GradScaler``, the same with a fused AdamW, without clipping, ``bf16-mixed``; and ``fp8-mixed`` against torchao's
    recipe (``convert_to_float8_training`` on the same model, Lightning's ``bf16-mixed``), on an ordinary step and on a
    check step (``fp8_check_interval=2``: the traced step reads the casts). Nothing is timed.

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

import lightning.fabric as lf
import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_amp_plus
from lightning_amp_plus import MixedPrecisionPlugin

_OURS = str(Path(lightning_amp_plus.__file__).resolve().parent) + os.sep
_ROOTS = (
    _OURS,
    str(Path(pl.__file__).resolve().parent / "plugins" / "precision") + os.sep,
    str(Path(lf.__file__).resolve().parent / "plugins" / "precision") + os.sep,
    str(Path(torch.__file__).resolve().parent / "amp" / "grad_scaler.py"),
)
_TRACED_STEP = 2
_COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<setcomp>", "<dictcomp>")


@dataclass(frozen=True)
class Variant:
    """One traced configuration."""

    name: str
    precision: str
    clip: float | None
    fused: bool
    check_step: bool = False  # fp8-mixed: the traced step reads the FP8 casts


VARIANTS = (
    Variant("16-mixed, clip by norm", "16-mixed", 1.0, fused=False),
    Variant("16-mixed, clip by norm, fused AdamW", "16-mixed", 1.0, fused=True),
    Variant("16-mixed, no clipping", "16-mixed", None, fused=False),
    Variant("16-mixed, no clipping, fused AdamW", "16-mixed", None, fused=True),
    Variant("bf16-mixed, clip by norm", "bf16-mixed", 1.0, fused=False),
    Variant("bf16-mixed, no clipping", "bf16-mixed", None, fused=False),
    Variant("fp8-mixed, no clipping", "fp8-mixed", None, fused=False),
    Variant("fp8-mixed, no clipping, a check step", "fp8-mixed", None, fused=False, check_step=True),
)


class Tiny(pl.LightningModule):
    """Two Linear layers FP8 can take (dimensions divisible by 16) on a squared loss, AdamW."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
        self.fused = fused

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return (self.net(x).float() - y).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused)


class Tracer(pl.Callback):
    """Counts the functions of the roots' files run between the traced step's batch start and end, by file."""

    def __init__(self) -> None:
        self.functions: dict[str, set[str]] = defaultdict(set)

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        name, path = code.co_qualname, code.co_filename
        if path.startswith("<"):
            # Generated code (a dataclass's __init__, compiled from a string) is its module's, named by its class:
            # every dataclass's __init__ is `__create_fn__.<locals>.__init__`, and two of them are two functions.
            path = frame.f_globals.get("__file__", "")
            if code.co_argcount:
                name = f"{type(frame.f_locals[code.co_varnames[0]]).__qualname__}.{code.co_name}"
        if path and path.startswith(_ROOTS) and not name.endswith(_COMPREHENSIONS):
            self.functions[path].add(name)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == _TRACED_STEP:
            sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        sys.setprofile(None)


def _plugin(variant: Variant, ours: bool) -> Any:
    if ours:
        options: dict[str, Any] = {}
        if variant.precision == "fp8-mixed":
            options["fp8_check_interval"] = _TRACED_STEP if variant.check_step else 1000
        return MixedPrecisionPlugin(variant.precision, device="cpu", **options)  # type: ignore[arg-type]
    return MixedPrecision("bf16-mixed" if variant.precision == "fp8-mixed" else variant.precision, "cpu")


def trace(variant: Variant, ours: bool) -> dict[str, set[str]] | None:
    """The functions (by file) one step of ``variant`` runs, for our plugin or for Lightning's (``None``: it refuses).

    Lightning's fp16 plugin refuses to clip the gradients of a fused optimizer (``MisconfigurationException``). The
    reference for ``fp8-mixed`` is torchao's recipe: the model converted by ``convert_to_float8_training``, trained
    under Lightning's ``bf16-mixed``.
    """
    torch.manual_seed(0)
    model = Tiny(variant.fused)
    if not ours and variant.precision == "fp8-mixed":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)
    tracer = Tracer()
    data = TensorDataset(torch.randn(32, 32), torch.randn(32, 16))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[_plugin(variant, ours)],
        max_steps=4,
        gradient_clip_val=variant.clip,
        callbacks=[tracer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    try:
        trainer.fit(model, DataLoader(data, batch_size=8))
    except Exception:
        sys.setprofile(None)
        if ours:
            raise
        return None
    return dict(tracer.functions)


def counts(found: dict[str, set[str]]) -> tuple[int, int]:
    """(functions, files) of a trace."""
    return sum(map(len, found.values())), len(found)


def _short(path: str) -> str:
    for root in _ROOTS:
        if path.startswith(root):
            site = os.sep + "site-packages" + os.sep
            label = root.split(site)[-1] if site in root else "lightning_amp_plus/"
            return label + path[len(root) :] if root.endswith(os.sep) else label
    return path


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
        rows.append((variant, trace(variant, ours=True), trace(variant, ours=False)))
    print(f"{'one Trainer step':40} {'ours: functions':>16} {'files':>6} {'reference: functions':>21} {'files':>6}")
    for variant, ours, theirs in rows:
        assert ours is not None
        functions, files = counts(ours)
        reference = ("refuses", "") if theirs is None else counts(theirs)
        print(f"{variant.name:40} {functions:>16} {files:>6} {reference[0]:>21} {reference[1]:>6}")
    if args.list:
        for variant, ours, theirs in rows:
            for label, found in (("ours", ours), ("reference", theirs)):
                if found is None:
                    continue
                print(f"\n## {variant.name}: {label}")
                for path in sorted(found, key=_short):
                    print(f"{_short(path)}: {', '.join(sorted(found[path]))}")


if __name__ == "__main__":
    main()
