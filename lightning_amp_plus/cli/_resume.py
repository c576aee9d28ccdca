"""``amp-plus train --ckpt-dir DIR --resume``: whether ``DIR/last.ckpt`` can be continued as asked, checked before fit.

A resumed run continues the run that saved the checkpoint: same model, data and precision, further along. Everything
else is refused here, before any training, with the flag to change: a different model size or data would fail inside
``fit`` with a size mismatch (or, worse, run on silently), and a target the checkpoint has already reached would train
nothing.

The command's own settings travel in the checkpoint as the state of :class:`RunRecord`, a callback of the run.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_amp_plus._wording import plural
from lightning_amp_plus.cli._checks import UsageError

__all__ = ["MAY_CHANGE", "ResumePoint", "RunRecord", "read_resume_point"]

# Settings that may change between a run and its continuation: where the data is read from and how fast.
_FREE = frozenset({"num_workers", "data_dir", "download"})
MAY_CHANGE = (
    "--max-steps, --epochs, the outputs (--report, --headroom), the console flags, --threads, --devices, "
    "--num-workers, --data-dir and --spike-guard"
)
"""What a resumed run may change, as the refusal and docs/resuming.md say it: how long, what it writes and shows, where
and how fast it runs, and whether a spike guard watches it (one may be added after a spike); nothing of the model, the
data or the precision."""
# The settings a flag of `amp-plus train` sets, named as the flag in messages.
_FLAGS = frozenset(
    {
        "precision",
        "master_weights",
        "compensation",
        "width",
        "dropout",
        "lr",
        "hidden_dim",
        "embed_dim",
        "max_len",
        "batch_size",
        "num_train",
        "num_val",
        "seed",
        "fp8_recipe",
        "fp8_check_interval",
        "fp8_fallback",
    }
)


class RunRecord(Callback):
    """Saves what ``amp-plus train`` was asked for (task, precision, master weights) in the run's checkpoints.

    Examples:
        >>> RunRecord({"task": "cnn", "precision": "bf16-mixed", "master_weights": False}).state_dict()["task"]
        'cnn'
    """

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = dict(settings)

    @property
    @override
    def state_key(self) -> str:
        return "amp-plus train"

    @override
    def state_dict(self) -> dict[str, Any]:
        return dict(self.settings)


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts.

    Attributes:
        path: the checkpoint (``DIR/last.ckpt``).
        step: the optimizer steps it had taken (``global_step``).
        target: the step the resumed run ends at (``--max-steps``, or the end of ``--epochs``).
    """

    path: Path
    step: int
    target: int

    def line(self) -> str:
        """What the command says before training.

        Examples:
            >>> ResumePoint(Path("ckpt/last.ckpt"), 6, 12).line()
            'resuming from ckpt/last.ckpt at step 6: 6 steps more, to step 12'
        """
        more = plural(self.target - self.step, "step")
        return f"resuming from {self.path} at step {self.step}: {more} more, to step {self.target}"


def read_resume_point(
    path: Path, model: pl.LightningModule, datamodule: pl.LightningDataModule, record: RunRecord, target: int
) -> ResumePoint:
    """Read ``path`` and check that this run can continue it: same model, data and settings, a target beyond it.

    Args:
        path: ``DIR/last.ckpt``.
        model: this run's model, built from the flags.
        datamodule: this run's data module, built from the flags.
        record: this run's settings (task, precision, master weights).
        target: the step this run ends at.

    Raises:
        UsageError: the checkpoint cannot be read, was saved by a different set-up, or is at or past ``target``.
    """
    checkpoint = _load(path)
    saved_record = checkpoint.get("callbacks", {}).get(record.state_key)
    differences = [
        *_differences(saved_record or {}, record.settings),
        *_differences(checkpoint.get("hyper_parameters", {}), dict(model.hparams)),
        *_differences(checkpoint.get("datamodule_hyper_parameters", {}), dict(datamodule.hparams)),
    ] or _shape_differences(checkpoint["state_dict"], model.state_dict())
    if differences:
        raise UsageError(
            f"--resume: {path} was saved by a run set up differently: {'; '.join(differences)}. A resumed run "
            f"continues the same model, data and precision: give the flags of that run (only {MAY_CHANGE} may change), "
            "or start a new run in another --ckpt-dir."
        )
    step = int(checkpoint.get("global_step", 0))
    if step >= target:
        raise UsageError(
            f"--resume: {path} is at step {step} already, and this run ends at step {target}, so there is nothing "
            f"left to train. Ask for more: --max-steps above {step} (or more --epochs)."
        )
    return ResumePoint(path, step, target)


def saved_step(checkpoint: Path) -> int | None:
    """The optimizer steps ``checkpoint`` holds, read from the file as ``--resume`` reads it (``None`` if it cannot be).

    Not what the run last began to save: a Ctrl-C between the start of a save and its write leaves the previous one.
    """
    try:
        step = _load(checkpoint).get("global_step")
    except UsageError:
        return None
    return step if isinstance(step, int) else None


def _load(path: Path) -> dict[str, Any]:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated file, another format, a pickle weights_only refuses...
        raise UsageError(
            f"--resume: {path} could not be read as a checkpoint ({_unreadable(error)}). Remove it to start a new run "
            "in that folder, or choose another --ckpt-dir."
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise UsageError(f"--resume: {path} is not a Lightning checkpoint (no state_dict). Choose another --ckpt-dir.")
    return checkpoint


def _unreadable(error: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in this command's words.

    Never torch's own advice for a file that holds more than tensors and plain values ("re-run with weights_only set to
    False"): that unpickles whatever the file holds, code included, and this command's checkpoints never need it.

    Examples:
        >>> _unreadable(pickle.UnpicklingError("Weights only load failed. Re-running with `weights_only=False`..."))
        'it holds Python objects besides tensors and plain values, which no checkpoint of this command does; they are not loaded, as loading them could run code from the file'
        >>> _unreadable(RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory. This is..."))
        'not a file torch can read: RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory'
    """  # noqa: E501
    text = str(error)
    if isinstance(error, pickle.UnpicklingError) or "weights_only" in text:
        return (
            "it holds Python objects besides tensors and plain values, which no checkpoint of this command does; they "
            "are not loaded, as loading them could run code from the file"
        )
    first = text.split(". ", 1)[0].split("\n", 1)[0].strip().rstrip(".")[:200]
    return f"not a file torch can read: {type(error).__name__}" + (f": {first}" if first else "")


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``"--width 2 there, 16 here"`` for each setting both know and that differs (free settings aside).

    Examples:
        >>> _differences({"width": 2, "num_workers": 0, "task": "cnn"}, {"width": 16, "num_workers": 4, "task": "lstm"})
        ["the model 'cnn' there, 'lstm' here", '--width 2 there, 16 here']
    """
    out = []
    for key in sorted(set(saved) & set(now) - _FREE):
        if saved[key] != now[key]:
            name = "the model" if key == "task" else f"--{key.replace('_', '-')}" if key in _FLAGS else key
            there, here = (repr(saved[key]), repr(now[key])) if isinstance(saved[key], str) else (saved[key], now[key])
            out.append(f"{name} {there} there, {here} here")
    return out


def _shape_differences(saved: dict[str, Any], now: dict[str, torch.Tensor]) -> list[str]:
    """For a checkpoint without the command's record: the weights whose names or shapes differ, the first few."""
    names = sorted(set(saved) ^ set(now))
    shapes = [
        f"{name} {list(saved[name].shape)} there, {list(now[name].shape)} here"
        for name in sorted(set(saved) & set(now))
        if isinstance(saved[name], torch.Tensor) and saved[name].shape != now[name].shape
    ]
    if not names and not shapes:
        return []
    return [f"weights of another shape ({', '.join((shapes or names)[:3])})"]
