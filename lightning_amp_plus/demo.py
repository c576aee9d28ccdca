"""The main job until the shipped models land: train a small model with the plugin on generated data.

Run ``python -m lightning_amp_plus`` (or ``amp-plus-demo``). It trains a small MLP classifier on Gaussian blobs made
offline from a seed, under ``MixedPrecisionPlugin`` with ``MixedPrecisionMonitor`` attached, shows Lightning's progress
bar (with the loss scale), the monitor's summary, then the loss-scale history (as runs of equal scale), every skipped
step, and the accuracy reached.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_amp_plus.monitor import MixedPrecisionMonitor
from lightning_amp_plus.precision import MixedPrecisionPlugin
from lightning_amp_plus.scaler import DynamicLossScaler

__all__ = ["BlobClassifier", "ScaleHistory", "blobs", "main"]


def blobs(n: int, features: int = 32, classes: int = 4, seed: int = 0, split: int = 0) -> TensorDataset:
    """A learnable classification set: ``classes`` Gaussian clusters in ``features`` dimensions.

    ``seed`` fixes the clusters (the task); ``split`` draws a different sample of the same task (train vs held-out).

    Example:
        >>> x, y = blobs(8, features=3, classes=2)[:]
        >>> tuple(x.shape), y.unique().tolist()
        ((8, 3), [0, 1])
    """
    centers = torch.randn(classes, features, generator=torch.Generator().manual_seed(seed)) * 0.5
    gen = torch.Generator().manual_seed(seed * 1000 + split + 1)
    labels = torch.arange(n) % classes
    points = centers[labels] + torch.randn(n, features, generator=gen)
    return TensorDataset(points, labels)


class BlobClassifier(pl.LightningModule):
    """A two-layer MLP for :func:`blobs`."""

    def __init__(self, features: int = 32, hidden: int = 128, classes: int = 4, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    @override
    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.net(x)
        return logits

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)


class ScaleHistory(Callback):
    """Records the loss scale each training batch was scaled with, and whether its step was skipped."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.skipped: list[int] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        plugin = trainer.precision_plugin
        scaler = trainer.scaler
        scale = scaler.last_step_scale if scaler is not None else None
        self.scales.append(scale if scale is not None else 1.0)
        if isinstance(plugin, MixedPrecisionPlugin) and plugin.last_step_skipped:
            self.skipped.append(len(self.scales) - 1)


def runs(values: Sequence[float]) -> list[tuple[int, int, float]]:
    """Compress a series into ``(first, last, value)`` runs of equal values.

    Example:
        >>> runs([4.0, 4.0, 2.0, 2.0, 2.0, 4.0])
        [(0, 1, 4.0), (2, 4, 2.0), (5, 5, 4.0)]
    """
    out: list[tuple[int, int, float]] = []
    for index, value in enumerate(values):
        if out and out[-1][2] == value:
            out[-1] = (out[-1][0], index, value)
        else:
            out.append((index, index, value))
    return out


def _power_of_two(value: float) -> str:
    exponent = math.log2(value) if value > 0 else math.nan
    return f"2**{exponent:.0f} = {value:,.0f}" if exponent.is_integer() and value >= 1 else f"{value:g}"


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    """Fraction of ``data`` that ``model`` classifies right, in fp32."""
    x, y = data[:]
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lightning_amp_plus", description=__doc__)
    parser.add_argument("--precision", choices=["16-mixed", "bf16-mixed"], default="16-mixed")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--init-scale", type=float, default=2.0**24, help="initial loss scale (default 2**24)")
    parser.add_argument("--growth-interval", type=int, default=50, help="clean steps before the scale grows")
    parser.add_argument("--hysteresis", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu", help="Lightning accelerator (default cpu)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, print the report, and return its numbers."""
    args = parse_args(argv)
    pl.seed_everything(args.seed, verbose=False)
    train, held_out = blobs(4096, seed=args.seed), blobs(1024, seed=args.seed, split=1)
    scaler = None
    if args.precision == "16-mixed":
        scaler = DynamicLossScaler(
            init_scale=args.init_scale, growth_interval=args.growth_interval, hysteresis=args.hysteresis
        )
    plugin = MixedPrecisionPlugin(args.precision, scaler=scaler)
    history = ScaleHistory()
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        plugins=[plugin],
        callbacks=[history, MixedPrecisionMonitor()],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    model = BlobClassifier()
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    start = time.perf_counter()
    trainer.fit(model, loader)
    seconds = time.perf_counter() - start
    report = {
        "precision": args.precision,
        "steps": len(history.scales),
        "skipped_steps": plugin.skipped_steps,
        "skipped_at": history.skipped,
        "scale_runs": runs(history.scales),
        "held_scheduler_steps": plugin.held_scheduler_steps,
        "accuracy": accuracy(model.float().cpu(), held_out),
        "seconds": seconds,
    }
    print_report(report)
    return report


def print_report(report: dict[str, Any]) -> None:
    """Print the loss-scale history, the skipped steps and the accuracy."""
    print(f"\nlightning-amp-plus demo: {report['precision']}, {report['steps']} steps in {report['seconds']:.1f} s")
    print("loss scale history (steps: scale):")
    for first, last, value in report["scale_runs"]:
        span = f"{first}" if first == last else f"{first}-{last}"
        print(f"  {span:>9}: {_power_of_two(value)}")
    skipped = report["skipped_at"]
    print(
        f"skipped steps: {report['skipped_steps']}" + (f" (at steps {', '.join(map(str, skipped))})" if skipped else "")
    )
    print(f"held-out accuracy: {report['accuracy']:.3f}")


if __name__ == "__main__":
    main()
