"""Checks of what a user asks for, run before anything heavy is imported or any work starts: one wording per rule.

Pure Python (no torch, no Lightning), so that ``amp-plus --help`` and a mistyped flag answer at once. The same rules
serve the Python API (``AmpSettings``, ``MixedPrecisionMonitor(report_path=...)``) and the command line; only the
spelling of the argument differs: ``report_path='x.txt'`` in Python, ``--report x.txt`` on the command line.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from lightning_amp_plus._wording import number

__all__ = ["LR_MAX", "SEED_MAX", "RunFailed", "Terminated", "UsageError", "check_ckpt_dir", "float_in", "int_in"]

SEED_MAX = 2**32 - 1
"""The largest seed ``seed_everything`` accepts (numpy's generator takes 32-bit seeds)."""
LR_MAX = 1000.0
"""The largest ``--lr`` accepted: the shipped models train at 1e-3 to 0.1; rates near float32's 3.4e38 make the
optimizer's float32 update overflow with an error instead of a diagnosis."""


class UsageError(Exception):
    """A request the command cannot carry out (bad combination, missing device or data); the message says why.

    The command prints it as one paragraph on stderr and exits with code 2, before any work starts.

    Examples:
        >>> str(UsageError("--master-weights needs a mixed precision"))
        '--master-weights needs a mixed precision'
    """


class Terminated(KeyboardInterrupt):
    """A run stopped by SIGTERM (``kill``, a scheduler, a container stopping), cleanly, as Ctrl-C stops it.

    A ``KeyboardInterrupt``, so that whatever keeps the results of an interrupted run keeps them here too; the command
    names the signal and exits with code 143 (128 + SIGTERM), as shells report a process that SIGTERM ended.
    """


class RunFailed(Exception):
    """A run that started could not finish (a stop with a diagnosis, a failed worker); the message says why.

    The command prints it on stderr and exits with code 1.
    """


# ------------------------------------------------------------------------------------------- argparse types
def int_in(minimum: int, maximum: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[minimum, maximum]``; ``why`` explains the maximum.

    Examples:
        >>> int_in(0, 9)("3")
        3
        >>> int_in(1)("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: 0 must be >= 1
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is too large: the largest is {maximum:,}{why}")
        return value

    return parse


def float_in(
    low: float, high: float, *, low_open: bool = False, high_open: bool = False, why: str = ""
) -> Callable[[str], float]:
    """An argparse ``type``: a finite number between ``low`` and ``high`` (either end open); ``why`` explains them.

    Examples:
        >>> float_in(0.0, 1.0, high_open=True)("0.5")
        0.5
        >>> float_in(1.0, 2.0**24, why=" (the loss scaler's range)")("0.5")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: 0.5 is outside [1, 16777216] (the loss scaler's range)
    """
    interval = f"{'(' if low_open else '['}{number(low)}, {number(high)}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{value} must be a finite number in {interval}")
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (above and below):
            raise argparse.ArgumentTypeError(f"{number(value)} is outside {interval}{why}")
        return value

    return parse


# ------------------------------------------------------------------------------------------- checkpoint folder
def check_ckpt_dir(ckpt_dir: str | None, resume: bool) -> None:
    """Refuse ``--ckpt-dir``/``--resume`` combinations that would mix two runs' checkpoints or resume nothing.

    A new run needs an empty (or missing) folder: in one that holds files, its checkpoints would sit beside another
    run's, and Lightning would write its ``last.ckpt`` as ``last-v1.ckpt`` while ``last.ckpt`` stays the older run's.
    ``--resume`` needs the folder's ``last.ckpt``.

    Raises:
        ValueError: the message names the flag, the folder and what to do.

    Examples:
        >>> check_ckpt_dir(None, resume=True)
        Traceback (most recent call last):
        ...
        ValueError: --resume continues the run saved in a --ckpt-dir folder: give --ckpt-dir DIR, the folder that holds its last.ckpt.
    """  # noqa: E501
    if ckpt_dir is None:
        if resume:
            raise ValueError(
                "--resume continues the run saved in a --ckpt-dir folder: give --ckpt-dir DIR, the folder that holds "
                "its last.ckpt."
            )
        return
    folder = Path(ckpt_dir)
    last = folder / "last.ckpt"
    try:
        held = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    except OSError as error:
        raise ValueError(f"--ckpt-dir {ckpt_dir}: the folder cannot be read ({error.strerror or error}).") from None
    if resume and not last.is_file():
        what = "does not exist" if not folder.exists() else "holds no last.ckpt" if held else "is empty"
        raise ValueError(
            f"--resume: --ckpt-dir {ckpt_dir} {what}, so there is no run to continue ({last} is missing). Drop "
            "--resume to start a new run there, or give the --ckpt-dir of the run to continue."
        )
    if held and not resume:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        if last.is_file():
            raise ValueError(
                f"--ckpt-dir {ckpt_dir} already holds {shown}: a new run would put its checkpoints beside them and "
                f"write its last.ckpt as last-v1.ckpt. To continue the run saved there, add --resume (it continues "
                f"from {last}); to start a new run, give an empty or new folder."
            )
        raise ValueError(
            f"--ckpt-dir {ckpt_dir} already holds {shown}: a new run would put its checkpoints beside them. There is "
            "no last.ckpt there for --resume to continue from: give an empty or new folder."
        )
