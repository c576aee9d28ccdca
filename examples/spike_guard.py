"""The spike guard on a Lightning Trainer: two bad batches, skipped (or clipped), shown by the monitor.

Run: python examples/spike_guard.py [--action skip|clip] [--precision bf16-mixed|16-mixed] [--report amp.png]

Trains a small classifier on generated data for 300 steps; batches 150 and 220 have wrong labels (a corrupted batch:
on a model that has learnt the task, a gradient many times the usual). ``SpikeGuard`` judges every step's gradient
norm after a warm-up of 100 steps: the bad batches are skipped (``--action skip``: the run continues as if they had
never been seen) or clipped to the guard's limit (``--action clip``). The monitor's summary names them; ``--report``
writes its chart, where the gradient-norm panel shows the guard's limit and the spikes.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import MixedPrecisionMonitor, MixedPrecisionPlugin, SpikeGuard
from lightning_amp_plus.cli import without_lightning_noise

STEPS = 300
BATCH = 32
BAD_BATCHES = (150, 220)


def data(seed: int = 0) -> TensorDataset:
    """Four Gaussian clusters in 32 dimensions, in batch order, with :data:`BAD_BATCHES` mislabelled."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 32, generator=generator)
    labels = torch.arange(STEPS * BATCH) % 4
    points = centers[labels] + torch.randn(STEPS * BATCH, 32, generator=generator)
    for batch in BAD_BATCHES:
        labels[batch * BATCH : (batch + 1) * BATCH] += 1  # each sample labelled as the next cluster (5 wraps to 1)
    labels %= 4
    return TensorDataset(points, labels)


class Classifier(pl.LightningModule):
    """A two-layer MLP, AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--action", choices=["skip", "clip"], default="skip")
    parser.add_argument("--precision", choices=["bf16-mixed", "16-mixed"], default="bf16-mixed")
    parser.add_argument("--report", default=None, help="write the monitor's chart here (a new .png)")
    args = parser.parse_args(argv)
    with without_lightning_noise():  # Lightning's warnings about itself, silenced in this script only
        pl.seed_everything(0, verbose=False)
        plugin = MixedPrecisionPlugin(args.precision, spike_guard=SpikeGuard(action=args.action))
        monitor = MixedPrecisionMonitor(report_path=args.report)
        trainer = pl.Trainer(
            accelerator="auto",
            devices=1,
            max_steps=STEPS,
            plugins=[plugin],
            callbacks=[monitor],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(Classifier(), DataLoader(data(), batch_size=BATCH, shuffle=False))
    return {"skipped_steps": plugin.skipped_steps, "spikes": [step for step, _ in monitor.history.spikes]}


if __name__ == "__main__":
    main()
