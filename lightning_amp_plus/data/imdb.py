"""``IMDBDataModule``: the Stanford Large Movie Review Dataset (aclImdb) as padded token-id batches.

The reviews are read from ``aclImdb/{train,test}/{pos,neg}/*.txt`` (``unsup`` is ignored), tokenised
(:func:`~lightning_amp_plus.data._text.tokenize`), and mapped to ids with a vocabulary built from the training reviews
only (validation and test words it lacks become ``<unk>``). The encoded splits are cached in
``data_dir/aclImdb_processed/`` under a name derived from every setting that changes them, so the next run with the same
settings loads them instead of tokenising 50,000 reviews again.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lightning_amp_plus._checks import check_bool, check_int
from lightning_amp_plus.data._collate import pad_collate
from lightning_amp_plus.data._download import ArchiveSpec, DatasetUnavailableError, ensure_dataset
from lightning_amp_plus.data._loaders import SplitDataModule
from lightning_amp_plus.data._text import PAD_INDEX, Vocabulary, tokenize

__all__ = ["IMDB_MD5", "IMDB_URL", "DatasetUnavailableError", "IMDBDataModule"]

IMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
# The official archive's md5 (the value torchtext and torchdata checked against).
IMDB_MD5 = "7c2ac02c03563afcf9b574c7e56c153a"
_SPLITS = ("train", "test")
_LABELS = (("neg", 0), ("pos", 1))
# Bump when tokenising or encoding changes, so caches made by older code are not reused.
_CACHE_FORMAT = 1

_Item = tuple[Tensor, int]


def _spec() -> ArchiveSpec:
    # Read the module constants at call time, so one place (or a test) sets them.
    return ArchiveSpec(
        name="IMDB",
        url=IMDB_URL,
        filename="aclImdb_v1.tar.gz",
        md5=IMDB_MD5,
        folder="aclImdb",
        synthetic="SyntheticIMDBDataModule",
        example_file="train/pos/0_9.txt",
        model="lstm",
    )


def _review_files(folder: Path, split: str) -> list[tuple[Path, int]]:
    """``(file, label)`` of every review of a split, negatives then positives, each in file-name order."""
    return [
        (path, label)
        for name, label in _LABELS
        for path in sorted((folder / split / name).glob("*.txt"), key=lambda path: path.name)
    ]


def _problem_with(folder: Path) -> str | None:
    """What is missing from an ``aclImdb`` folder, or ``None`` when every split has reviews of both labels."""
    for split in _SPLITS:
        for name, _ in _LABELS:
            sub = folder / split / name
            if not sub.is_dir():
                return f"the folder '{split}/{name}' is missing"
            if next(sub.glob("*.txt"), None) is None:
                return f"the folder '{split}/{name}' holds no .txt reviews"
    return None


class _Reviews(Dataset[_Item]):
    """Encoded reviews stored flat: review ``i`` is ``ids[offsets[i]:offsets[i + 1]]`` (one tensor, not 25,000)."""

    def __init__(self, ids: Tensor, offsets: Tensor, labels: Tensor) -> None:
        self.ids, self.offsets, self.labels = ids, offsets, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> _Item:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.ids[start:end].long(), int(self.labels[index])


def _pack(reviews: list[list[int]], labels: list[int], lookup: Tensor, max_len: int) -> dict[str, Tensor]:
    """Truncate each review (provisional ids) to ``max_len``, map it through ``lookup`` to vocabulary ids, flatten."""
    kept = [review[:max_len] for review in reviews]
    lengths = torch.tensor([len(review) for review in kept], dtype=torch.long)
    offsets = torch.zeros(len(kept) + 1, dtype=torch.long)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    flat = torch.tensor([token for review in kept for token in review], dtype=torch.long)
    # int32 halves the cache; vocabulary ids are far below 2**31.
    return {"ids": lookup[flat].to(torch.int32), "offsets": offsets, "labels": torch.tensor(labels, dtype=torch.long)}


class IMDBDataModule(SplitDataModule):
    """IMDB movie reviews as ``(tokens, lengths, labels)`` batches for binary sentiment classification.

    Batches come from :func:`~lightning_amp_plus.data._collate.pad_collate`: ``tokens`` int64 ``[B, T]`` padded with
    :attr:`pad_index` (0) up to the longest review in the batch (at most ``max_len``), ``lengths`` int64 ``[B]``, and
    ``labels`` float32 ``[B]`` (1.0 positive, 0.0 negative). Unknown words are id 1 (``<unk>``).

    The data is used from ``data_dir/aclImdb``, or extracted from ``data_dir/aclImdb_v1.tar.gz``, or downloaded from
    :data:`IMDB_URL` (when ``download`` is on) and checked against :data:`IMDB_MD5`. Without any of them it raises
    :class:`DatasetUnavailableError` naming the offline alternative ``SyntheticIMDBDataModule``.

    Args:
        data_dir: the folder holding ``aclImdb`` or its archive (or where to download it), and the token cache.
        batch_size: reviews per batch.
        max_len: tokens kept per review (the first ``max_len``).
        vocab_size: the most vocabulary entries, ``<pad>`` and ``<unk>`` included.
        min_freq: how many times a word must occur in the training reviews to get its own id.
        val_size: training reviews held out for validation (chosen with a generator seeded by ``seed``); the vocabulary
            is built from the remaining training reviews only.
        seed: the seed of the train/validation split.
        num_workers: DataLoader worker processes.
        download: whether :meth:`prepare_data` may download the archive when no local copy exists.

    Attributes:
        vocab_size: the requested maximum until :meth:`setup`, the actual vocabulary size after it (never larger, so
            an embedding sized before setup is still large enough).
        max_vocab_size: the requested maximum, the ``vocab_size`` argument.
        pad_index: the id of ``<pad>``, 0.
        vocab: the :class:`~lightning_amp_plus.data._text.Vocabulary`, after :meth:`setup`.

    Examples:
        >>> dm = IMDBDataModule(data_dir="data", max_len=128, vocab_size=5000)
        >>> dm.vocab_size, dm.pad_index
        (5000, 0)
    """

    def __init__(
        self,
        data_dir: str | Path = "data",
        batch_size: int = 64,
        max_len: int = 256,
        vocab_size: int = 20000,
        min_freq: int = 2,
        val_size: int = 2500,
        seed: int = 0,
        num_workers: int = 0,
        download: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(data_dir, str | Path) or str(data_dir) == "":
            raise ValueError(f"`IMDBDataModule(data_dir={data_dir!r})` is invalid: give a folder path.")
        # Plain Python ints from the checks: save_hyperparameters reads these locals.
        batch_size = check_int("IMDBDataModule", "batch_size", batch_size, 1)
        max_len = check_int("IMDBDataModule", "max_len", max_len, 1)
        vocab_size = check_int("IMDBDataModule", "vocab_size", vocab_size, 3)  # <pad>, <unk> and at least one word
        min_freq = check_int("IMDBDataModule", "min_freq", min_freq, 1)
        val_size = check_int("IMDBDataModule", "val_size", val_size, 1)
        seed = check_int("IMDBDataModule", "seed", seed, 0)
        num_workers = check_int("IMDBDataModule", "num_workers", num_workers, 0)
        check_bool("IMDBDataModule", "download", download)
        self.save_hyperparameters()
        self.data_dir = Path(data_dir).expanduser()
        self.batch_size = batch_size
        self.max_len = max_len
        self.max_vocab_size = vocab_size
        self.vocab_size = vocab_size
        self.min_freq = min_freq
        self.val_size = val_size
        self.seed = seed
        self.num_workers = num_workers
        self.download = download
        self.pad_index = PAD_INDEX
        self.vocab: Vocabulary | None = None
        self.train_set: _Reviews | None = None
        self.val_set: _Reviews | None = None
        self.test_set: _Reviews | None = None

    def _settings(self, folder: Path) -> dict[str, Any]:
        # Everything that changes the cached tensors. The file counts catch a dataset folder that changed since.
        files = {
            f"{split}/{name}": len(list((folder / split / name).glob("*.txt")))
            for split in _SPLITS
            for name, _ in _LABELS
        }
        return {
            "format": _CACHE_FORMAT,
            "max_len": self.max_len,
            "vocab_size": self.max_vocab_size,
            "min_freq": self.min_freq,
            "val_size": self.val_size,
            "seed": self.seed,
            "files": files,
        }

    def _locate(self) -> tuple[Path, dict[str, Any]]:
        """Make sure the reviews are there; return the cache file of the current settings, and those settings."""
        folder = ensure_dataset(_spec(), self.data_dir, self.download, _problem_with)
        settings = self._settings(folder)
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
        return self.data_dir / "aclImdb_processed" / f"imdb-{digest}.pt", settings

    @override
    def prepare_data(self) -> None:
        """Make sure the reviews are there (extracting or downloading them) and their encoded cache is written."""
        path, settings = self._locate()
        # Existence is enough here; setup checks that the file loads and matches the settings (rebuilding it if not).
        if not path.is_file():
            self._write_cache(path, self._encode(self.data_dir / "aclImdb", settings))

    def _encode(self, folder: Path, settings: dict[str, Any]) -> dict[str, Any]:
        files = {split: _review_files(folder, split) for split in _SPLITS}
        if self.val_size >= len(files["train"]):
            raise ValueError(
                f"`IMDBDataModule(val_size={self.val_size})` is invalid: it must be smaller than the "
                f"{len(files['train'])} training reviews, to leave some for training."
            )
        # Tokens become provisional ids (first-seen order) as they are read: 50,000 reviews as int lists are far
        # smaller than as lists of strings. One lookup table maps them to vocabulary ids at the end.
        provisional: dict[str, int] = {}
        reviews = {split: [self._read(path, provisional) for path, _ in files[split]] for split in _SPLITS}
        labels = {split: [label for _, label in files[split]] for split in _SPLITS}
        order = torch.randperm(len(files["train"]), generator=torch.Generator().manual_seed(self.seed)).tolist()
        val_rows, train_rows = order[: self.val_size], order[self.val_size :]
        vocab = self._vocabulary([reviews["train"][row] for row in train_rows], provisional)
        lookup = torch.tensor(vocab.encode(provisional), dtype=torch.long)

        def pack(split: str, rows: list[int]) -> dict[str, Tensor]:
            return _pack([reviews[split][r] for r in rows], [labels[split][r] for r in rows], lookup, self.max_len)

        return {
            "settings": settings,
            "vocab": vocab.tokens,
            "train": pack("train", train_rows),
            "val": pack("train", val_rows),
            "test": pack("test", list(range(len(files["test"])))),
        }

    @staticmethod
    def _read(path: Path, provisional: dict[str, int]) -> list[int]:
        # errors="replace": one stray byte in one of 50,000 files should not stop training.
        tokens = tokenize(path.read_text(encoding="utf-8", errors="replace"))
        return [provisional.setdefault(token, len(provisional)) for token in tokens]

    def _vocabulary(self, train_reviews: list[list[int]], provisional: dict[str, int]) -> Vocabulary:
        # Counted over the whole review, not just the first max_len tokens: word statistics of the training text.
        flat = torch.tensor([token for review in train_reviews for token in review], dtype=torch.long)
        counts = torch.bincount(flat, minlength=len(provisional)).tolist()
        names = list(provisional)  # dicts keep insertion order: names[i] has provisional id i
        return Vocabulary.from_counts(
            {names[i]: n for i, n in enumerate(counts) if n > 0}, self.max_vocab_size, self.min_freq
        )

    @staticmethod
    def _write_cache(path: Path, encoded: dict[str, Any]) -> None:
        # Written under a temporary name and renamed: a run killed mid-write leaves no cache that looks valid.
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.part")
        try:
            torch.save(encoded, partial)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)

    @staticmethod
    def _load_cache(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
        """The cache at ``path`` if it exists, loads, and was made with ``settings``; else ``None`` (to rebuild it)."""
        if not path.is_file():
            return None
        try:
            loaded: dict[str, Any] = torch.load(path, weights_only=True)
        except Exception as error:  # unreadable: rebuild rather than fail, the raw data is still there
            # torch's message runs to many lines; its first says enough.
            reason = str(error).splitlines()[0] if str(error) else ""
            warnings.warn(
                f"IMDB cache '{path}' is unreadable ({type(error).__name__}: {reason}); rebuilding it.", stacklevel=2
            )
            return None
        return loaded if loaded.get("settings") == settings else None

    @override
    def setup(self, stage: str) -> None:
        """Load the encoded splits from the cache (building it first when :meth:`prepare_data` did not run here)."""
        if self.vocab is not None:
            return
        # Not every caller of setup ran prepare_data in this process (a notebook, DDP ranks other than 0).
        path, settings = self._locate()
        encoded = self._load_cache(path, settings)
        if encoded is None:
            encoded = self._encode(self.data_dir / "aclImdb", settings)
            self._write_cache(path, encoded)
        self.vocab = Vocabulary(encoded["vocab"])
        self.vocab_size = len(self.vocab)
        self.train_set, self.val_set, self.test_set = (_Reviews(**encoded[split]) for split in ("train", "val", "test"))

    @override
    def _dataset(self, split: str) -> Dataset[_Item]:
        dataset = {"train": self.train_set, "val": self.val_set, "test": self.test_set}[split]
        if dataset is None:
            raise RuntimeError(f"IMDBDataModule.{split}_dataloader() needs setup() first.")
        return dataset

    @override
    def _collate(self) -> Callable[[list[Any]], Any]:
        return partial(pad_collate, pad_index=self.pad_index)

    @override
    def _pin_memory(self) -> bool:
        return torch.cuda.is_available()

    @override
    def predict_dataloader(self) -> DataLoader[_Item]:
        """The official test reviews, in a fixed order."""
        return self._loader("test", shuffle=False)
