"""Checks of what a user asks for, run before anything heavy is imported or any work starts: one wording per rule.

Pure Python (no torch, no Lightning), so that ``amp-plus --help`` and a mistyped flag answer at once. The same rules
serve the Python API (``AmpSettings``, ``MixedPrecisionMonitor(report_path=...)``) and the command line; only the
spelling of the argument differs: ``report_path='x.txt'`` in Python, ``--report x.txt`` on the command line.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "LR_MAX",
    "SEED_MAX",
    "RunFailed",
    "UsageError",
    "check_data_dir",
    "check_output_dir",
    "check_output_file",
    "float_in",
    "int_in",
    "number",
    "plural",
    "shown",
    "spans",
]

SEED_MAX = 2**32 - 1
"""The largest seed ``seed_everything`` accepts (numpy's generator takes 32-bit seeds)."""
LR_MAX = 1000.0
"""The largest ``--lr`` accepted: the shipped models train at 1e-3 to 0.1; rates near float32's 3.4e38 make the
optimizer's float32 update overflow with an error instead of a diagnosis."""


class UsageError(Exception):
    """A request the command cannot carry out (bad combination, missing device or data); the message says why.

    The command prints it as one paragraph on stderr and exits with code 2, before any work starts.

    Example:
        >>> str(UsageError("--master-weights needs a mixed precision"))
        '--master-weights needs a mixed precision'
    """


class RunFailed(Exception):
    """A run that started could not finish (a stop with a diagnosis, a failed worker); the message says why.

    The command prints it on stderr and exits with code 1.
    """


# -------------------------------------------------------------------------------------------------- wording
def plural(count: int, word: str, many: str | None = None) -> str:
    """``count`` with ``word`` in the number it needs.

    Example:
        >>> plural(1, "step"), plural(0, "step"), plural(2, "non-finite event"), plural(3, "process", "processes")
        ('1 step', '0 steps', '2 non-finite events', '3 processes')
    """
    return f"{count:,} {word if count == 1 else many or word + 's'}"


def spans(values: list[int], limit: int = 6) -> str:
    """Sorted integers written as runs (``0-3, 7 and 12``), at most ``limit`` runs, then how many more steps.

    Example:
        >>> spans([0, 1, 2, 3, 7, 12])
        '0-3, 7 and 12'
        >>> spans([1, 3, 5, 7, 9], limit=2)
        '1, 3 and 3 more'
    """
    runs: list[tuple[int, int]] = []
    for value in sorted(set(values)):
        if runs and value == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], value)
        else:
            runs.append((value, value))
    parts = [f"{first}" if first == last else f"{first}-{last}" for first, last in runs[:limit]]
    hidden = sum(last - first + 1 for first, last in runs[limit:])
    if hidden:
        parts.append(f"{hidden} more")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def number(value: float) -> str:
    """``value`` as a person writes it: whole numbers in full (up to 2**53), others in ``%g`` form.

    Example:
        >>> number(2.0**24), number(0.5), number(1e308)
        ('16777216', '0.5', '1e+308')
    """
    if value.is_integer() and abs(value) <= 2**53:
        return str(int(value))
    return f"{value:g}"


def shown(argument: str, value: object) -> str:
    """How a user wrote ``argument``: ``--report x.png`` on the command line, ``report_path='x.png'`` in Python.

    Example:
        >>> shown("--report", "x.png"), shown("report_path", Path("x.png"))
        ('--report x.png', "report_path='x.png'")
    """
    if argument.startswith("-"):
        return f"{argument} {value}"
    return f"{argument}={str(value) if isinstance(value, os.PathLike) else value!r}"


# ------------------------------------------------------------------------------------------- argparse types
def int_in(minimum: int, maximum: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[minimum, maximum]``; ``why`` explains the maximum.

    Example:
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

    Example:
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


# ---------------------------------------------------------------------------------------------------- paths
def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path(".")


def _cannot_create_in(folder: Path) -> str | None:
    """Why no file can be created in ``folder`` (``None`` if one can), found by creating and removing one."""
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        handle, name = tempfile.mkstemp(dir=folder, prefix=".amp-plus-check-")
    except OSError as error:
        return f"no file can be created in {folder} ({error.strerror or error})"
    os.close(handle)
    os.unlink(name)
    return None


def check_output_file(
    path: str | os.PathLike[str], argument: str, suffixes: tuple[str, ...] = (), kind: str = ""
) -> Path:
    """Raise ``ValueError`` unless a file can be written at ``path`` (missing folders may be created); return it.

    Checked without leaving a trace: an existing file is opened for appending (not changed), otherwise a temporary
    file is created and removed in the nearest existing folder. ``suffixes`` (lower case, with the dot) are the
    endings the writer's format needs, ``kind`` names that format in the message.

    Example:
        >>> check_output_file("/proc/x.png", "--report")
        Traceback (most recent call last):
        ...
        ValueError: --report /proc/x.png: no file can be created in /proc (No such file or directory). Choose a path in a folder you can write to.
    """  # noqa: E501
    target = Path(path)
    said = shown(argument, path)
    if str(path) == "":
        raise ValueError(f"{said}: the path is empty. Give a file path{_example(suffixes)}.")
    if target.is_dir():
        raise ValueError(f"{said} is a folder: give a file path in it{_example(suffixes, target)}.")
    if suffixes and target.suffix.lower() not in suffixes:
        example = target.with_suffix(suffixes[0]) if target.suffix else Path(f"{target}{suffixes[0]}")
        raise ValueError(
            f"{said}: {kind or 'this file'} is written as {suffixes[0]}, so the path must end in "
            f"{' or '.join(suffixes)}, e.g. {example}."
        )
    if target.exists():
        try:
            with open(target, "ab"):
                pass
        except OSError as error:
            raise ValueError(f"{said}: the file cannot be written ({error.strerror or error}).") from None
        return target
    why = _cannot_create_in(_nearest_existing(target.parent))
    if why is not None:
        raise ValueError(f"{said}: {why}. Choose a path in a folder you can write to.")
    return target


def _example(suffixes: tuple[str, ...], folder: Path | None = None) -> str:
    if not suffixes:
        return ""
    name = f"output{suffixes[0]}"
    return f", e.g. {folder / name if folder else name}"


def check_output_dir(path: str | os.PathLike[str], argument: str) -> Path:
    """Raise ``ValueError`` unless ``path`` is a folder files can be written to, or one that can be created; return it.

    Example:
        >>> check_output_dir("/proc/ckpt", "--ckpt-dir")
        Traceback (most recent call last):
        ...
        ValueError: --ckpt-dir /proc/ckpt: no file can be created in /proc (No such file or directory). Choose a folder you can write to.
    """  # noqa: E501
    target = Path(path)
    said = shown(argument, path)
    if str(path) == "":
        raise ValueError(f"{said}: the path is empty. Give a folder.")
    if target.exists() and not target.is_dir():
        raise ValueError(f"{said} is a file, not a folder. Give a folder (it is created if missing).")
    why = _cannot_create_in(_nearest_existing(target))
    if why is not None:
        raise ValueError(f"{said}: {why}. Choose a folder you can write to.")
    return target


def check_data_dir(path: str | os.PathLike[str], argument: str, download: bool) -> Path:
    """Raise ``ValueError`` unless ``path`` can hold a dataset: an existing folder, or (to download) a creatable one.

    Example:
        >>> check_data_dir(__file__, "--data-dir", download=False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: --data-dir ..._checks.py is a file, not a folder. Give the folder that holds (or will hold) the dataset.
    """  # noqa: E501
    target = Path(path)
    said = shown(argument, path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{said} is a file, not a folder. Give the folder that holds (or will hold) the dataset.")
    if not target.exists() and download:
        why = _cannot_create_in(_nearest_existing(target))
        if why is not None:
            raise ValueError(
                f"{said}: {why}, so the dataset cannot be downloaded there. Choose a folder you can write to."
            )
    return target
