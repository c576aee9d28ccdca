"""The debug file the monitor's ``on_nonfinite="stop"`` policy saves: what is needed to debug a non-finite finding."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_amp_plus.monitor.history import AmpHistory
from lightning_amp_plus.plugins.wrappers import user_names
from lightning_amp_plus.step.sharding import local_view

__all__ = ["save_debug_file"]


def save_debug_file(
    trainer: pl.Trainer | None,
    module: nn.Module,
    kind: str,
    names: list[str],
    step: int,
    named: list[tuple[str, Tensor]],
    history: AmpHistory,
) -> Path:
    """Save the names, the step, the scale, the model's state, the gradients and the last 100 steps; return the path.

    Under the Trainer into ``trainer.default_root_dir`` (by rank zero; every rank reads the state, a collective under
    FSDP), otherwise into the working folder, as ``amp_nonfinite_step<step>.pt``.
    """
    folder = Path(trainer.default_root_dir) if trainer is not None else Path.cwd()
    path = folder / f"amp_nonfinite_step{step if trainer is None else trainer.global_step}.pt"
    # On every rank: under FSDP the module's state_dict() is a collective; rank zero alone would wait forever.
    state = {key: local_view(value).detach().cpu() for key, value in module.state_dict().items()}
    if trainer is None or trainer.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        named = named or user_names(module)
        grads = {n: local_view(p.grad).detach().cpu() for n, p in named if p.grad is not None}
        scale = history.steps[-1].scale if history.steps else None
        torch.save(
            {
                "global_step": step if trainer is None else trainer.global_step,
                "kind": kind,
                "names": names,
                "loss_scale": scale,
                "state_dict": state,
                "grads": grads,
                "history": [asdict(record) for record in history.steps[-100:]],
            },
            path,
        )
    return path
