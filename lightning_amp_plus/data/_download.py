"""Find, download, verify and extract a dataset archive, and explain clearly when that is not possible.

Shared by the CIFAR-10 and IMDB modules. The rule throughout: nothing half-made may look valid. Downloads go to a
``.part`` file that is renamed only after its md5 matches; archives are extracted into a temporary folder that is
renamed into place only once complete; anything partial is deleted on failure. Torchvision (its download utilities) is
imported only when a download or extraction actually happens.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ArchiveSpec", "CorruptArchiveError", "DatasetUnavailableError", "ensure_dataset", "file_md5"]


class DatasetUnavailableError(RuntimeError):
    """A real dataset could not be found, downloaded or read; the message says where it looked and what to do instead.

    Examples:
        >>> issubclass(DatasetUnavailableError, RuntimeError)
        True
    """


class CorruptArchiveError(DatasetUnavailableError):
    """A dataset archive or folder exists but fails its checksum or lacks files it must have.

    Examples:
        >>> issubclass(CorruptArchiveError, DatasetUnavailableError)
        True
    """


@dataclass(frozen=True)
class ArchiveSpec:
    """Where a dataset comes from and what it unpacks to.

    Attributes:
        name: the dataset's name in messages, e.g. ``"CIFAR-10"``.
        url: the official archive's address.
        filename: the archive's file name in ``data_dir``.
        md5: the official archive's md5.
        folder: the top folder the archive unpacks to, inside ``data_dir``.
        synthetic: the offline stand-in's class name, for the message when the data is unavailable.
        model: the shipped model trained on it by ``amp-plus train`` (``"cnn"`` or ``"lstm"``), for the same message.
        example_file: a file of the extracted tree, relative to ``folder``, to show where things go when placed by hand.

    Examples:
        >>> spec = ArchiveSpec("Toy", "https://example.org/toy.tar.gz", "toy.tar.gz", "0" * 32, "toy", "ToyDM", "a.txt")
        >>> spec.folder
        'toy'
    """

    name: str
    url: str
    filename: str
    md5: str
    folder: str
    synthetic: str
    example_file: str
    model: str = "cnn"


def file_md5(path: Path) -> str:
    """The md5 hex digest of a file, read in 1 MiB chunks.

    Examples:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = Path(tmp) / "x"
        ...     _ = path.write_bytes(b"abc")
        ...     file_md5(path)
        '900150983cd24fb0d6963f7d28e17f72'
    """
    digest = hashlib.md5(usedforsecurity=False)  # a checksum, not security
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _how_to_fix(spec: ArchiveSpec, data_dir: Path) -> str:
    folder = data_dir / spec.folder
    return (
        f"To place the files by hand, download {spec.url} (md5 {spec.md5}) on a machine with internet access and copy "
        f"it to '{data_dir / spec.filename}', or extract it there so that '{folder / spec.example_file}' exists. "
        f"To train without the real data, use the synthetic stand-in: `amp-plus train {spec.model} --data "
        f"synthetic`, or `{spec.synthetic}` in code."
    )


def _unavailable(spec: ArchiveSpec, data_dir: Path, why: str) -> DatasetUnavailableError:
    looked = f"no folder '{data_dir / spec.folder}' and no archive '{data_dir / spec.filename}'"
    return DatasetUnavailableError(f"{spec.name} is not available: {looked}; {why}. {_how_to_fix(spec, data_dir)}")


def _download(spec: ArchiveSpec, data_dir: Path) -> None:
    """Download the archive to ``<filename>.part``; rename it to ``filename`` only once its md5 matches."""
    from torchvision.datasets import utils as tv_utils  # torchvision only when a download really happens

    partial = data_dir / f"{spec.filename}.part"
    # torchvision's download_url returns at once when the target file already exists: a stale partial from a killed
    # run would be taken for the download, so it goes first.
    partial.unlink(missing_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        tv_utils.download_url(spec.url, str(data_dir), filename=partial.name, md5=None)
    except BaseException as error:
        partial.unlink(missing_ok=True)
        if not isinstance(error, Exception):  # Ctrl-C and friends: clean up, then let them through unchanged
            raise
        raise _unavailable(
            spec, data_dir, f"downloading {spec.url} failed ({type(error).__name__}: {error})"
        ) from error
    actual = file_md5(partial)
    if actual != spec.md5:
        partial.unlink()
        raise CorruptArchiveError(
            f"The download of {spec.name} from {spec.url} is corrupt: its md5 is {actual}, expected {spec.md5}. The "
            f"partial file was deleted; run again to retry. {_how_to_fix(spec, data_dir)}"
        )
    os.replace(partial, data_dir / spec.filename)


def _extract(spec: ArchiveSpec, data_dir: Path, problem_with: Callable[[Path], str | None]) -> None:
    """Extract the archive into a temporary folder; move its top folder into place in one rename once it is complete."""
    from torchvision.datasets import utils as tv_utils

    archive = data_dir / spec.filename
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.folder}-extracting-", dir=data_dir))
    try:
        try:
            tv_utils.extract_archive(str(archive), str(staging))
        except Exception as error:
            raise CorruptArchiveError(
                f"{spec.name} archive '{archive}' could not be extracted ({type(error).__name__}: {error}). Delete it "
                f"and run again to download it afresh. {_how_to_fix(spec, data_dir)}"
            ) from error
        extracted = staging / spec.folder
        if not extracted.is_dir():
            raise CorruptArchiveError(
                f"{spec.name} archive '{archive}' does not contain the folder '{spec.folder}'. Delete it and run again "
                f"to download it afresh. {_how_to_fix(spec, data_dir)}"
            )
        problem = problem_with(extracted)
        if problem is not None:
            raise CorruptArchiveError(
                f"{spec.name} archive '{archive}' does not hold the complete dataset: {problem}. Delete it and run "
                f"again to download it afresh. {_how_to_fix(spec, data_dir)}"
            )
        os.replace(extracted, data_dir / spec.folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_dataset(
    spec: ArchiveSpec, data_dir: Path, download: bool, problem_with: Callable[[Path], str | None]
) -> Path:
    """Make ``data_dir / spec.folder`` hold a complete dataset: use it as is, extract the archive, or download it.

    Args:
        spec: the dataset's archive.
        data_dir: the folder holding the dataset folder and/or its archive.
        download: whether the network may be used when neither the folder nor the archive is there.
        problem_with: returns what is wrong with a dataset folder (missing or corrupt files), or ``None`` when it is
            complete.

    Returns:
        The complete dataset folder.

    Raises:
        DatasetUnavailableError: neither folder nor archive exists, and ``download`` is off or the download failed.
        CorruptArchiveError: the folder is incomplete, or the archive fails its md5 check or cannot be extracted.

    Examples:
        >>> import tempfile
        >>> spec = ArchiveSpec("Toy", "https://example.org/toy.tar.gz", "toy.tar.gz", "0" * 32, "toy", "ToyDM", "a")
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     try:
        ...         ensure_dataset(spec, Path(tmp), download=False, problem_with=lambda folder: None)
        ...     except DatasetUnavailableError as error:
        ...         print("download=False" in str(error))
        True
    """
    folder = data_dir / spec.folder
    archive = data_dir / spec.filename
    if folder.exists():
        problem = problem_with(folder)
        if problem is None:
            return folder
        # Never overwrite a folder the user made: it may be the only copy. Extraction here is atomic, so a broken
        # folder did not come from us.
        raise CorruptArchiveError(
            f"{spec.name} folder '{folder}' is incomplete or corrupt: {problem}. Delete it to have it extracted from "
            f"'{archive}' (or downloaded) again. {_how_to_fix(spec, data_dir)}"
        )
    if archive.is_file():
        actual = file_md5(archive)
        if actual != spec.md5:
            raise CorruptArchiveError(
                f"{spec.name} archive '{archive}' is corrupt or incomplete: its md5 is {actual}, expected {spec.md5}. "
                f"Delete it and run again to download it afresh. {_how_to_fix(spec, data_dir)}"
            )
    elif download:
        _download(spec, data_dir)
    else:
        raise _unavailable(spec, data_dir, f"download=False, so {spec.url} was not tried")
    _extract(spec, data_dir, problem_with)
    return folder
