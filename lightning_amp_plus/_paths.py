"""Output and data paths: checks made before any work starts, leaving no trace, and writes that replace no file.

Pure Python. Each check raises ``ValueError`` naming the argument as the user wrote it (``--report x.png`` or
``report_path='x.png'``, see :func:`lightning_amp_plus._wording.shown`), the path and the fix. :func:`write_new`
writes an output file under the name asked for or, when a file has that name already, the next free numbered one
(``amp.png``, then ``amp-1.png``...): no file a user had is ever overwritten.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from lightning_amp_plus._wording import shown

__all__ = [
    "as_created",
    "check_data_dir",
    "check_output_dir",
    "check_output_file",
    "numbered",
    "written_as",
    "write_new",
]


def as_created(path: str | os.PathLike[str]) -> Path:
    """Where ``path`` leads once its missing folders are created: what a check must look at, and where to write.

    The OS follows a ``..`` only out of a folder that exists: in ``new/../../proc/x.png``, with ``new`` missing,
    nothing after ``new`` can be looked at, yet once ``mkdir -p`` has created ``new`` the path leads into ``/proc``.
    So the part that exists is taken as the OS resolves it (symbolic links followed) and the rest as written, its
    ``..`` undoing the folders that would be created. A path whose missing part has no ``..`` is returned unchanged.

    Examples:
        >>> str(as_created("/no-such-folder/../proc/sys/x.png"))
        '/proc/sys/x.png'
        >>> str(as_created("no-such-folder/amp.png"))
        'no-such-folder/amp.png'
    """
    parts = Path(path).parts
    cut = len(parts)
    while cut > 0 and not Path(*parts[:cut]).exists():
        cut -= 1
    head, rest = (Path(*parts[:cut]) if cut else Path(".")), parts[cut:]
    if ".." not in rest or not head.is_dir():  # under a file, nothing can be created: the checks say so
        return Path(path)
    return Path(os.path.normpath(os.path.join(os.path.realpath(head), *rest)))


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
    file is created and removed in the nearest existing folder of where the path leads once its folders are created
    (:func:`as_created`: ``new/../../proc/x.png`` is checked in ``/proc``). ``suffixes`` (lower case, with the dot)
    are the endings the writer's format needs, ``kind`` names that format in the message.

    Examples:
        >>> check_output_file("/proc/x.png", "--report")
        Traceback (most recent call last):
        ...
        ValueError: --report /proc/x.png: no file can be created in /proc (No such file or directory). Choose a path in a folder you can write to.
    """  # noqa: E501
    said = shown(argument, path)
    if str(path) == "":
        raise ValueError(f"{said}: the path is empty. Give a file path{_example(suffixes)}.")
    target = as_created(path)
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
    said = shown(argument, path)
    if str(path) == "":
        raise ValueError(f"{said}: the path is empty. Give a folder.")
    target = as_created(path)
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
    target = as_created(path)
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


def numbered(path: str | os.PathLike[str]) -> Iterator[Path]:
    """``path``, then the same name numbered: ``amp.png``, ``amp-1.png``, ``amp-2.png``...

    Examples:
        >>> import itertools
        >>> [str(p) for p in itertools.islice(numbered("runs/amp.png"), 3)]
        ['runs/amp.png', 'runs/amp-1.png', 'runs/amp-2.png']
    """
    target = Path(path)
    yield target
    for number in itertools.count(1):
        yield target.with_name(f"{target.stem}-{number}{target.suffix}")


def write_new(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> Path:
    """Write a new file with ``write(handle)`` at ``path`` or, if a file has that name, at the next free numbered name.

    Each name is taken with an exclusive create (``open(..., "xb")``): a file that appears meanwhile is not
    overwritten either. Missing folders are created; a write that fails leaves no partial file. Returns where the file
    went (say it: :func:`written_as`). A ``..`` after a missing folder is followed as :func:`as_created` does, without
    creating that folder.

    Examples:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> [write_new(folder / "table.csv", lambda f: f.write(b"x")).name for _ in range(2)]
        ['table.csv', 'table-1.csv']
    """
    target = as_created(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    for candidate in numbered(target):
        try:
            handle = open(candidate, "xb")  # noqa: SIM115  (closed below, removed if the write fails)
        except FileExistsError:
            continue
        try:
            with handle:
                write(handle)
        except BaseException:
            with contextlib.suppress(OSError):
                candidate.unlink()
            raise
        return candidate
    raise AssertionError("unreachable: numbered() never ends")  # pragma: no cover


def written_as(asked: str | os.PathLike[str], written: Path) -> str:
    """Where an output went, said in full when it is not the name asked for.

    Examples:
        >>> written_as("amp.png", Path("amp.png")), written_as("amp.png", Path("amp-1.png"))
        ('amp.png', 'amp-1.png (amp.png exists: it was left as it was)')
    """
    if as_created(asked) == written:
        return str(written)
    return f"{written} ({asked} exists: it was left as it was)"
