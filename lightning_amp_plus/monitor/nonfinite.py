"""What a non-finite finding of the monitor does (``on_nonfinite``), and the debug file its ``"stop"`` policy saves."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_amp_plus.monitor.history import AmpHistory
from lightning_amp_plus.plugins.wrappers import user_names
from lightning_amp_plus.step.grads import nonfinite_names
from lightning_amp_plus.step.sharding import local_view

__all__ = ["Finding", "NonfiniteCheck", "handle_finding", "save_debug_file"]


@dataclass(frozen=True)
class Finding:
    """Parameters (or unguarded gradients) the monitor found holding inf/NaN.

    Attributes:
        kind: ``"parameters"`` or ``"gradients"``.
        names: the parameters' names (empty: nothing found).
        step: the global step it is reported at.
        named: the model's parameters by name (the debug file's gradients; dropped for ``"gradients"`` under stop).
        history: the run's history (the event is appended to it).
    """

    kind: str
    names: list[str]
    step: int
    named: list[tuple[str, Tensor]]
    history: AmpHistory


class NonfiniteCheck:
    """The monitor's check for inf/NaN, and what a finding does (``policy``: ``"warn"``, ``"raise"``, ``"stop"``).

    Parameters are checked every ``interval`` steps, gradients too where nothing else guards the step.

    State: the interval and the policy, the model checked and its parameters by name (read once per model: walking the
    module tree costs more than the check), the debug file the ``"stop"`` policy saved, and whether the run should
    stop.
    """

    def __init__(self, interval: int, policy: str) -> None:
        self.interval = interval
        self.policy = policy
        self.debug_path: Path | None = None
        self.should_stop = False
        self._named_of: tuple[nn.Module | None, list[tuple[str, Tensor]]] = (None, [])

    def due(self, count: int) -> bool:
        """Whether ``count`` is a check's (inside a step, the step's index; after it, the steps finished)."""
        return count % self.interval == 0

    def named(self, model: nn.Module | None = None) -> list[tuple[str, Tensor]]:
        """The parameters by name of ``model`` (read now if it is another model than the last), or of the last one."""
        if model is not None and self._named_of[0] is not model:
            self._named_of = (model, user_names(model))
        return self._named_of[1]

    def check(
        self,
        kind: str,
        step: int,
        history: AmpHistory,
        trainer: pl.Trainer | None,
        module: nn.Module,
        warn: Callable[[str], None],
    ) -> None:
        """Look for inf/NaN in the model's ``kind`` (``"parameters"`` or ``"gradients"``) and act on a finding."""
        named = self.named()
        values = named if kind == "parameters" else [(n, p.grad) for n, p in named if p.grad is not None]
        found = Finding(kind, nonfinite_names(values), step, named, history)
        path = handle_finding(self.policy, found, trainer, module, warn)
        if path is not None:  # "stop": the debug file saved, the run ends
            self.debug_path, self.should_stop = path, True


def handle_finding(
    policy: str, found: Finding, trainer: pl.Trainer | None, module: nn.Module, warn: Callable[[str], None]
) -> Path | None:
    """Record ``found`` and act on it by ``policy``; return the debug file's path under ``"stop"``, else ``None``.

    ``"warn"`` names the parameters, ``"raise"`` raises ``FloatingPointError`` with the same sentence, ``"stop"``
    saves the debug file, asks the Trainer (if any) to stop and, for gradients nothing else guards, drops them so
    that the optimizer leaves the parameters alone.
    """
    kind, names, step = found.kind, found.names, found.step
    if not names:
        return None
    found.history.nonfinite_events.append((step, kind, names))
    shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    message = f"MixedPrecisionMonitor: non-finite {kind} at step {step}: {shown}."
    if policy == "raise":
        raise FloatingPointError(message + " (on_nonfinite='raise')")
    if policy == "warn":
        warn(message)
        return None
    path = save_debug_file(trainer, module, kind, names, step, found.named, found.history)
    if trainer is not None:
        trainer.should_stop = True
    if kind == "gradients":
        # Nothing else guards this step: drop its gradients so the optimizer leaves the parameters alone.
        for _, param in found.named:
            param.grad = None
    warn(f"{message} Training stops; what you need to debug it is in {path}.")
    return path


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
