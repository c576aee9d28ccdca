"""Tiny models, data and Trainer settings shared by the Lightning tests (CPU only, a few hundred steps at most)."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus.cli import main

# The plugin warns once per fit that fp16 autocast on CPU is slow; these tests use it on CPU on purpose.
FP16_ON_CPU_WARNING = r"ignore:MixedPrecisionPlugin\('16-mixed'\) on CPU:UserWarning"
PRECISIONS = ("16-mixed", "bf16-mixed")
INF = float("inf")


def regression_data(n: int = 64, seed: int = 0) -> TensorDataset:
    """``n`` random samples of 8 features and 1 target, the same for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=generator), torch.randn(n, 1, generator=generator))


def loader(n: int = 64, batch_size: int = 8) -> DataLoader[tuple[Tensor, ...]]:
    """A DataLoader in a fixed order (``shuffle=False``): two runs see the same batches."""
    return DataLoader(regression_data(n), batch_size=batch_size, shuffle=False)


def step_batch(step: int, batch_size: int = 8) -> tuple[Tensor, Tensor]:
    """A batch that depends only on the optimizer step, not on where a sampler is (for resumed runs)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch_size, 8, generator=generator), torch.randn(batch_size, 1, generator=generator)


def make_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def mse(net: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.mse_loss(net(x).float(), y)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it is handed at each ``step``: what the optimizer really sees."""

    def __init__(self, params: Iterable[Any], lr: float) -> None:
        super().__init__(params, lr=lr)
        self.seen: list[list[Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append(
            [p.grad.detach().clone() for g in self.param_groups for p in g["params"] if p.grad is not None]
        )
        return super().step(closure)


class TinyRegressor(pl.LightningModule):
    """Linear(8,16)-ReLU-Linear(16,1) on an MSE loss, with overflows injected at chosen optimizer steps.

    Args:
        overflow_steps: global steps (optimizer steps) whose loss is multiplied by inf, so every gradient is non-finite.
        optimizer: "sgd", "recording_sgd", "adam", "fused_adam" or "lbfgs".
        scheduler: "step" for a StepLR(step_size=1, gamma=0.5) stepped every optimizer step, or None.
        data_from_step: ignore the loader's batch and use ``step_batch(global_step)`` instead.
    """

    def __init__(
        self,
        overflow_steps: Iterable[int] = (),
        optimizer: str = "sgd",
        lr: float = 0.05,
        weight_decay: float = 0.0,
        scheduler: str | None = None,
        data_from_step: bool = False,
    ) -> None:
        super().__init__()
        self.net = make_net()
        self.overflow_steps = set(overflow_steps)
        self.optimizer_name = optimizer
        self.lr = lr
        self.weight_decay = weight_decay
        self.scheduler_name = scheduler
        self.data_from_step = data_from_step
        self.last_batch: tuple[Tensor, Tensor] | None = None
        self.forward_dtypes: list[torch.dtype] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.data_from_step:
            batch = step_batch(self.trainer.global_step, batch_size=len(batch[0]))
        self.last_batch = batch
        self.forward_dtypes.append(self.net[0](batch[0]).dtype)
        loss = mse(self.net, batch)
        if self.trainer.global_step in self.overflow_steps:
            loss = loss * INF
        return loss

    def configure_optimizers(self) -> Any:
        params = self.parameters()
        if self.optimizer_name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=self.lr)
        elif self.optimizer_name == "recording_sgd":
            optimizer = RecordingSGD(params, lr=self.lr)
        elif self.optimizer_name in ("adam", "fused_adam", "foreach_adam"):
            fused = self.optimizer_name == "fused_adam"
            optimizer = torch.optim.Adam(
                params, lr=self.lr, weight_decay=self.weight_decay, fused=fused, foreach=None if fused else True
            )
        elif self.optimizer_name == "lbfgs":
            optimizer = torch.optim.LBFGS(params, lr=self.lr)
        else:
            raise ValueError(self.optimizer_name)
        if self.scheduler_name is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ScaleRecorder(pl.Callback):
    """Records ``trainer.scaler.get_scale()`` after every training batch, and our plugin's ``last_grad_norm``."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.grad_norms: list[float | None] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.scales.append(trainer.scaler.get_scale())
        self.grad_norms.append(getattr(trainer.precision_plugin, "last_grad_norm", None))


def make_trainer(plugin: Precision | None = None, **kwargs: Any) -> pl.Trainer:
    """A quiet single-process CPU Trainer; keyword arguments override the defaults."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "max_epochs": 1,
    }
    if plugin is not None:
        settings["plugins"] = [plugin]
    settings.update(kwargs)
    return pl.Trainer(**settings)


def parameters_of(module: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def global_norm(tensors: Iterable[Tensor]) -> Tensor:
    """The L2 norm of all tensors together, computed in float64 as an independent reference."""
    return torch.linalg.vector_norm(torch.cat([t.detach().double().reshape(-1) for t in tensors]))


def unscaled_reference_grads(module: pl.LightningModule, batch: tuple[Tensor, Tensor]) -> list[Tensor]:
    """The gradients of ``module``'s loss on ``batch`` under the plugin's autocast, without any loss scaling.

    Computed on a copy, so the module's own gradients are left alone. The forward runs in the trainer's
    ``forward_context`` (same autocast as training) and the backward outside it, as Lightning does.
    """
    twin = copy.deepcopy(module.net)
    twin.zero_grad(set_to_none=True)
    with module.trainer.precision_plugin.forward_context():
        loss = mse(twin, batch)
    loss.backward()
    return [p.grad.detach().clone() for p in twin.parameters() if p.grad is not None]


# ------------------------------------------------------------------------------------------- the command line
def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``amp-plus argv`` in this process, expect exit code 2, and return stderr (which must hold no traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err: str = capsys.readouterr().err
    assert "Traceback" not in err
    return err
