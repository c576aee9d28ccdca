"""Lightning's own known issues that users meet next to this plugin, pinned under Lightning's built-in plugin as well.

Each test shows the behaviour under Lightning's built-in ``MixedPrecision`` and under ``MixedPrecisionPlugin``, so that
the documentation's statement of who is at fault stays true (docs/master-weights.md, docs/plugin.md):

* ``BackboneFinetuning`` resumed after its unfreeze epoch leaves the backbone frozen: its ``setup`` freezes the
  backbone again and only the unfreeze epoch itself unfreezes it. Under both plugins alike, bit for bit.
* Lightning's built-in fp16 under manual optimization clips the *scaled* gradients (``self.clip_gradients`` runs
  before its ``optimizer_step`` unscales them), so a clip at 0.1 is a clip at 0.1 / scale. Ours unscales first, as
  torch's AMP recipe does (``scaler.unscale_(opt)`` before ``clip_grad_norm_``): bit for bit that recipe.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import (
    FP16_ON_CPU_WARNING,
    START_SCALE,
    lightning_plugin,
    loader,
    make_net,
    make_trainer,
    mse,
    our_plugin,
    parameters_of,
)
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import Tensor, nn

pytestmark = [
    pytest.mark.filterwarnings(FP16_ON_CPU_WARNING),
    pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable.*"),
]


class Finetuned(pl.LightningModule):
    """A BatchNorm conv backbone and a linear head on 8 features read as a 2x2 image of 2 channels."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(1))
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(x.view(-1, 2, 2, 2))).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)


def finetuning() -> BackboneFinetuning:
    return BackboneFinetuning(unfreeze_backbone_at_epoch=1, train_bn=False)


def resumed_backbone(plugin: Any, tmp_path: Path) -> tuple[Tensor, Tensor, Tensor]:
    """The backbone's conv weight after 2 epochs (unfrozen at epoch 1), after a third epoch resumed from there, and
    after 3 epochs straight."""
    torch.manual_seed(0)
    first, straight = Finetuned(), Finetuned()
    resumed = copy.deepcopy(first)
    straight.load_state_dict(first.state_dict())
    trainer = make_trainer(plugin(), callbacks=[finetuning()], max_epochs=2)
    trainer.fit(first, loader(n=32))
    trainer.save_checkpoint(tmp_path / "two.ckpt")
    make_trainer(plugin(), callbacks=[finetuning()], max_epochs=3).fit(
        resumed, loader(n=32), ckpt_path=tmp_path / "two.ckpt"
    )
    make_trainer(plugin(), callbacks=[finetuning()], max_epochs=3).fit(straight, loader(n=32))
    weight = [m.backbone[0].weight.detach().clone() for m in (first, resumed, straight)]
    return weight[0], weight[1], weight[2]


def test_backbone_finetuning_resumed_after_its_unfreeze_epoch_leaves_the_backbone_frozen_under_both_plugins(
    tmp_path: Path,
) -> None:
    builtin = resumed_backbone(lambda: lightning_plugin("bf16-mixed"), tmp_path / "builtin")
    ours = resumed_backbone(lambda: our_plugin("bf16-mixed", master_weights=True), tmp_path / "ours")
    for theirs, mine in zip(builtin, ours, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    after_two, resumed, straight = ours
    assert torch.equal(resumed, after_two)  # the resumed epoch did not train the backbone: frozen again by `setup`
    assert not torch.equal(straight, after_two)  # the uninterrupted third epoch did


class ManualClipping(pl.LightningModule):
    """Manual optimization with clipping by norm before the step, as Lightning's docs write it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = make_net()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(mse(self.net, batch))
        self.clip_gradients(opt, gradient_clip_val=0.1, gradient_clip_algorithm="norm")  # type: ignore[arg-type]
        opt.step()  # type: ignore[union-attr]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def torchs_amp_recipe(model: ManualClipping, steps: int) -> list[Tensor]:
    """torch's AMP recipe with clipping: scale, backward, unscale_, clip_grad_norm_, step, update."""
    optimizer = model.configure_optimizers()
    scaler = torch.amp.GradScaler("cpu", init_scale=START_SCALE, growth_interval=10_000)
    for _, batch in zip(range(steps), loader(n=64), strict=False):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
            loss = mse(model.net, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        scaler.step(optimizer)
        scaler.update()
    return parameters_of(model)


def test_fp16_manual_clipping_unscales_first_as_torchs_recipe_where_lightnings_builtin_clips_scaled_gradients() -> None:
    torch.manual_seed(0)
    start = ManualClipping()
    ours, theirs, recipe = copy.deepcopy(start), copy.deepcopy(start), copy.deepcopy(start)
    make_trainer(our_plugin("16-mixed"), max_steps=4, max_epochs=-1).fit(ours, loader(n=64))
    make_trainer(lightning_plugin("16-mixed"), max_steps=4, max_epochs=-1).fit(theirs, loader(n=64))
    expected = torchs_amp_recipe(recipe, steps=4)
    torch.testing.assert_close(parameters_of(ours), expected, rtol=0, atol=0)
    # Lightning's built-in clipped the scaled gradients to 0.1: the first SGD step moved the weights by lr x 0.1 /
    # scale in norm, where torch's recipe moves them by lr x 0.1 (every gradient here is far above 0.1 in norm).
    one_step = copy.deepcopy(start)
    make_trainer(lightning_plugin("16-mixed"), max_steps=1, max_epochs=-1).fit(one_step, loader(n=64))
    moved = torch.linalg.vector_norm(
        torch.cat([(a - b).reshape(-1) for a, b in zip(parameters_of(one_step), parameters_of(start), strict=True)])
    )
    # Within 1e-3: clip_grad_norm_ multiplies by max_norm / (norm + 1e-6) in float32, and SGD rounds each update.
    torch.testing.assert_close(moved, torch.tensor(0.1 * 0.1 / START_SCALE), rtol=1e-3, atol=0)
    assert not torch.equal(parameters_of(theirs)[0], expected[0])
