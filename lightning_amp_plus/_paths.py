"""Checks that an output or data path can be used, made before any work starts and leaving no trace.

Pure Python. Each check raises ``ValueError`` naming the argument as the user wrote it (``--report x.png`` or
``report_path='x.png'``, see :func:`lightning_amp_plus._wording.shown`), the path and the fix.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lightning_amp_plus._wording import shown

__all__ = ["check_data_dir", "check_output_dir", "check_output_file"]


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

    Examples:
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

    Examples:
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

    Examples:
        >>> check_data_dir(__file__, "--data-dir", download=False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: --data-dir ..._paths.py is a file, not a folder. Give the folder that holds (or will hold) the dataset.
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
