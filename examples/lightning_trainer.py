"""MixedPrecisionPlugin on a Lightning Trainer, with gradient clipping, an LR schedule and a checkpoint resume.

Run: python examples/lightning_trainer.py [--precision 16-mixed|bf16-mixed] [--epochs 6] [--root DIR]

Trains a small classifier on generated data, saves a checkpoint after half the epochs, resumes from it, and prints the
loss scale, the skipped steps and the held scheduler steps the plugin reports.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import MixedPrecisionPlugin
from lightning_amp_plus.cli import without_lightning_noise


def blobs(n: int, features: int = 32, classes: int = 4, seed: int = 0) -> TensorDataset:
    """A learnable classification set: ``classes`` Gaussian clusters in ``features`` dimensions."""
    centers = torch.randn(classes, features, generator=torch.Generator().manual_seed(seed)) * 0.5
    labels = torch.arange(n) % classes
    points = centers[labels] + torch.randn(n, features, generator=torch.Generator().manual_seed(seed + 1))
    return TensorDataset(points, labels)


class ScheduledClassifier(pl.LightningModule):
    """A two-layer MLP for :func:`blobs`, SGD with a step schedule stepped every optimizer step."""

    def __init__(self, features: int = 32, hidden: int = 128, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def trainer(precision: str, epochs: int, root: Path) -> tuple[pl.Trainer, MixedPrecisionPlugin]:
    plugin = MixedPrecisionPlugin(precision)  # type: ignore[arg-type]
    return (
        pl.Trainer(
            accelerator="auto",
            devices=1,
            max_epochs=epochs,
            plugins=[plugin],
            gradient_clip_val=1.0,
            default_root_dir=root,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,  # the example saves its own checkpoint
        ),
        plugin,
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--precision", choices=["16-mixed", "bf16-mixed"], default="16-mixed")
    parser.add_argument("--epochs", type=int, default=6, help="epochs of 32 steps; resumes after half of them")
    parser.add_argument("--root", type=Path, default=None, help="where checkpoints go (a temporary folder if unset)")
    args = parser.parse_args(argv)
    with without_lightning_noise():  # Lightning's warnings about itself, silenced in this script only
        return run(args)


def run(args: argparse.Namespace) -> dict[str, float]:
    root = args.root or Path(tempfile.mkdtemp(prefix="amp-plus-"))
    pl.seed_everything(0, verbose=False)
    data = DataLoader(blobs(2048), batch_size=64, shuffle=False)

    first, _ = trainer(args.precision, args.epochs // 2, root)
    first.fit(ScheduledClassifier(), data)
    checkpoint = root / "half.ckpt"
    first.save_checkpoint(checkpoint, weights_only=False)  # the whole state (optimizer, plugin), to resume from

    second, plugin = trainer(args.precision, args.epochs, root)
    model = ScheduledClassifier()
    second.fit(model, data, ckpt_path=checkpoint)
    scale = second.scaler.get_scale() if second.scaler is not None else 1.0
    print(
        f"{args.precision}: resumed at step {first.global_step}, finished at step {second.global_step}; "
        f"loss scale {scale:g}, skipped steps {plugin.skipped_steps}, held scheduler steps "
        f"{plugin.engine.log.held_schedulers.held_steps}, lr {second.optimizers[0].param_groups[0]['lr']:g}"
    )
    return {"scale": scale, "skipped_steps": plugin.skipped_steps, "global_step": second.global_step}


if __name__ == "__main__":
    main()
