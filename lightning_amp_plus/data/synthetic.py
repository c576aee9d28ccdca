"""Learnable stand-ins for CIFAR-10 and IMDB, generated offline from a seed: for tests, examples and CPU-only machines.

Both tasks are learnable, not trivial: a class is a pattern that each sample shows only partly, under random shifts and
noise (images), or diluted among neutral words (token sequences), so an untrained model scores about chance and a small
one learns the task in a few epochs. ``seed`` fixes the task (the class patterns) and the samples; the train,
validation and test sets are disjoint draws of the same task.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset
from typing_extensions import override

from lightning_amp_plus._checks import check_int, check_nonnegative

# Synthetic images are normalised with the real CIFAR-10 statistics (re-exported here, see __all__).
from lightning_amp_plus.data._cifar_stats import CIFAR10_MEAN, CIFAR10_STD
from lightning_amp_plus.data._collate import pad_collate
from lightning_amp_plus.data._loaders import SplitDataModule
from lightning_amp_plus.data._text import PAD_INDEX, UNK_INDEX

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "SyntheticCIFAR10DataModule",
    "SyntheticIMDBDataModule",
    "synthetic_images",
    "synthetic_reviews",
]

# Splits are independent draws of one task: each gets its own generator stream.
_SPLITS = {"train": 1, "val": 2, "test": 3}
_RESERVED = 2  # ids 0 (padding, PAD_INDEX) and 1 (<unk>, UNK_INDEX) are never drawn as words


_Set = TypeVar("_Set", bound=Dataset[Any])


class _SyntheticDataModule(SplitDataModule, Generic[_Set]):
    """What both synthetic modules share: the sets generated on first use, the training order fixed by ``seed``."""

    datasets: dict[str, _Set]

    def _generate(self, size: int, split: int) -> _Set:
        """``size`` samples of the draw ``split`` of the task (see :data:`_SPLITS`)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _generate(size, split).")

    @override
    def setup(self, stage: str | None = None) -> None:
        """Generate the three sets (once: later calls keep them)."""
        hp = self.hparams
        sizes = {"train": hp["num_train"], "val": hp["num_val"], "test": hp["num_val"]}
        for split, size in sizes.items():
            if split not in self.datasets:
                self.datasets[split] = self._generate(size, _SPLITS[split])

    @override
    def _dataset(self, split: str) -> Dataset[Any]:
        self.setup()
        return self.datasets[split]

    @override
    def _shuffle_generator(self) -> torch.Generator:
        # A generator of our own: the shuffled order follows `seed`, not whatever the global RNG holds.
        return torch.Generator().manual_seed(self.hparams["seed"])


# ----------------------------------------------------------------------------------------------------------- images
def synthetic_images(
    n: int, image_size: int = 32, num_classes: int = 10, noise: float = 0.3, seed: int = 0, split: int = 0
) -> tuple[Tensor, Tensor]:
    """``n`` normalised RGB images of ``num_classes`` classes, and their labels; classes balanced and shuffled.

    Class ``c`` is a tinted sinusoidal grating with its own orientation, spatial frequency and colour (drawn from
    ``seed``); each image shows it with a random phase (a shift), a random contrast and brightness, and Gaussian pixel
    noise of std ``noise`` (in [0, 1] pixel units), clipped to [0, 1] and normalised with the CIFAR-10 statistics.
    ``split`` draws a different sample of the same task.

    Examples:
        >>> images, labels = synthetic_images(4, image_size=8, num_classes=2)
        >>> tuple(images.shape), images.dtype, sorted(labels.tolist())
        ((4, 3, 8, 8), torch.float32, [0, 0, 1, 1])
    """
    n = check_int("synthetic_images", "n", n, 1)
    image_size = check_int("synthetic_images", "image_size", image_size, 1)
    num_classes = check_int("synthetic_images", "num_classes", num_classes, 2)
    task = torch.Generator().manual_seed(seed)
    # Orientations spread evenly over half a turn, in a seeded order; frequencies 1.5-3 cycles per image.
    angles = torch.randperm(num_classes, generator=task).double() * math.pi / num_classes
    frequencies = 1.5 + 1.5 * torch.rand(num_classes, generator=task, dtype=torch.float64)
    tints = 0.5 + 0.5 * torch.rand(num_classes, 3, generator=task, dtype=torch.float64)
    base_colours = 0.35 + 0.3 * torch.rand(num_classes, 3, generator=task, dtype=torch.float64)

    sample = torch.Generator().manual_seed(_sample_seed(seed, split))
    labels = (torch.arange(n) % num_classes)[torch.randperm(n, generator=sample)]
    coords = torch.arange(image_size, dtype=torch.float64) / image_size
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    angle, frequency = angles[labels].view(n, 1, 1), frequencies[labels].view(n, 1, 1)
    phase = 2 * math.pi * torch.rand(n, 1, 1, generator=sample, dtype=torch.float64)
    wave = torch.sin(2 * math.pi * frequency * (x * torch.cos(angle) + y * torch.sin(angle)) + phase)
    contrast = 0.15 + 0.15 * torch.rand(n, 1, 1, 1, generator=sample, dtype=torch.float64)
    brightness = 0.1 * torch.randn(n, 1, 1, 1, generator=sample, dtype=torch.float64)
    pixels = (
        base_colours[labels].view(n, 3, 1, 1)
        + brightness
        + contrast * tints[labels].view(n, 3, 1, 1) * wave.unsqueeze(1)
        + noise * torch.randn(n, 3, image_size, image_size, generator=sample, dtype=torch.float64)
    )
    mean = torch.tensor(CIFAR10_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, dtype=torch.float64).view(1, 3, 1, 1)
    return ((pixels.clamp(0, 1) - mean) / std).float(), labels


class SyntheticCIFAR10DataModule(_SyntheticDataModule[TensorDataset]):
    """CIFAR-10-shaped images of learnable classes (see :func:`synthetic_images`), generated in memory.

    Batches are ``(images float[B, 3, S, S], labels long[B])`` like the real CIFAR-10 module's. The test set is a
    third draw, disjoint from train and validation, of ``num_val`` images. The training order is shuffled from
    ``seed`` too, so two runs with the same seed see the same batches.

    Args:
        num_train: training images.
        num_val: validation images (and test images).
        image_size: side ``S`` of the square images.
        num_classes: classes (CIFAR-10 has 10).
        batch_size: images per batch.
        seed: fixes the task, the samples and the training order.
        noise: std of the Gaussian pixel noise, in [0, 1] pixel units; higher makes the task harder.
        num_workers: DataLoader worker processes (0 loads in the main process; the data are in memory already).

    Examples:
        >>> data = SyntheticCIFAR10DataModule(num_train=8, num_val=4, image_size=8, batch_size=4)
        >>> data.setup("fit")
        >>> images, labels = next(iter(data.train_dataloader()))
        >>> tuple(images.shape), labels.dtype
        ((4, 3, 8, 8), torch.int64)
    """

    def __init__(
        self,
        num_train: int = 2048,
        num_val: int = 512,
        image_size: int = 32,
        num_classes: int = 10,
        batch_size: int = 64,
        seed: int = 0,
        noise: float = 0.3,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        # Plain Python numbers from the checks: save_hyperparameters reads these locals.
        num_train = check_int(name, "num_train", num_train, 1)
        num_val = check_int(name, "num_val", num_val, 1)
        image_size = check_int(name, "image_size", image_size, 4)
        num_classes = check_int(name, "num_classes", num_classes, 2)
        batch_size = check_int(name, "batch_size", batch_size, 1)
        seed = check_int(name, "seed", seed, 0)
        num_workers = check_int(name, "num_workers", num_workers, 0)
        noise = check_nonnegative(name, "noise", noise, hint=", e.g. 0.3 (0: no pixel noise)")
        self.save_hyperparameters()
        self.num_classes = num_classes
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.datasets = {}

    @override
    def _generate(self, size: int, split: int) -> TensorDataset:
        hp = self.hparams
        images, labels = synthetic_images(size, hp["image_size"], hp["num_classes"], hp["noise"], hp["seed"], split)
        return TensorDataset(images, labels)


# ----------------------------------------------------------------------------------------------------------- reviews
class TokenSequences(Dataset[tuple[Tensor, int]]):
    """Variable-length token sequences and their labels: ``dataset[i]`` is ``(tokens long[L_i], label)``.

    Examples:
        >>> data = TokenSequences([torch.tensor([2, 3]), torch.tensor([4])], [1, 0])
        >>> len(data), data[1]
        (2, (tensor([4]), 0))
    """

    def __init__(self, sequences: list[Tensor], labels: list[int]) -> None:
        if len(sequences) != len(labels):
            raise ValueError(f"TokenSequences: {len(sequences)} sequences but {len(labels)} labels; give one each.")
        self.sequences = sequences
        self.labels = labels

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.sequences[index], self.labels[index]


def synthetic_reviews(
    n: int,
    vocab_size: int = 1000,
    min_len: int = 20,
    max_len: int = 120,
    seed: int = 0,
    split: int = 0,
    sentiment_words: int | None = None,
) -> TokenSequences:
    """``n`` "reviews" of a binary sentiment task: token sequences whose word mix depends on the label.

    Words are the ids ``2 .. vocab_size - 1`` (0 is padding, 1 is ``<unk>``). ``seed`` picks two disjoint sets of
    ``sentiment_words`` ids (default: a tenth of the vocabulary, at least 1), "positive" and "negative"; the rest are
    neutral. Each token of a review of label 1 is, independently, a positive word with probability 0.12, a negative
    one with 0.04, ``<unk>`` with 0.02 and otherwise a neutral word; label 0 swaps the two sets. Lengths are uniform in
    ``[min_len, max_len]``, so a short review holds only a couple of telling words and a review is classified from
    the balance of the whole sequence, not from any single token. Labels are balanced and shuffled.

    Examples:
        >>> reviews = synthetic_reviews(4, vocab_size=50, min_len=3, max_len=6)
        >>> tokens, label = reviews[0]
        >>> tokens.dtype, 3 <= len(tokens) <= 6, sorted(reviews.labels)
        (torch.int64, True, [0, 0, 1, 1])
    """
    n = check_int("synthetic_reviews", "n", n, 1)
    vocab_size = check_int("synthetic_reviews", "vocab_size", vocab_size, 5)
    min_len = check_int("synthetic_reviews", "min_len", min_len, 1)
    max_len = check_int("synthetic_reviews", "max_len", max_len, min_len)
    words = vocab_size - _RESERVED
    per_class = max(1, words // 10) if sentiment_words is None else sentiment_words
    if per_class < 1 or 2 * per_class >= words:
        raise ValueError(
            f"synthetic_reviews(vocab_size={vocab_size}, sentiment_words={sentiment_words}): two sets of {per_class} "
            f"sentiment words leave no neutral word among {words}; use a larger vocab_size or fewer sentiment words."
        )
    ids = torch.randperm(words, generator=torch.Generator().manual_seed(seed)) + _RESERVED
    positive, negative, neutral = ids[:per_class], ids[per_class : 2 * per_class], ids[2 * per_class :]

    sample = torch.Generator().manual_seed(_sample_seed(seed, split))
    labels = (torch.arange(n) % 2)[torch.randperm(n, generator=sample)]
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=sample)
    # Draw a full [n, max_len] grid in one go, then cut each row to its length.
    kind = torch.rand(n, max_len, generator=sample)
    is_positive = labels.view(n, 1) == 1
    pick = torch.randint(0, 2**31 - 1, (n, max_len), generator=sample)
    own_words = torch.where(is_positive, positive[pick % per_class], negative[pick % per_class])
    other_words = torch.where(is_positive, negative[pick % per_class], positive[pick % per_class])
    tokens = neutral[pick % len(neutral)]
    tokens = torch.where(kind < 0.2, own_words, tokens)
    tokens = torch.where((kind >= 0.2) & (kind < 0.25), other_words, tokens)
    tokens = torch.where((kind >= 0.25) & (kind < 0.27), torch.full_like(tokens, UNK_INDEX), tokens)
    sequences = [tokens[row, :length].clone() for row, length in enumerate(lengths.tolist())]
    return TokenSequences(sequences, labels.tolist())


class SyntheticIMDBDataModule(_SyntheticDataModule[TokenSequences]):
    """IMDB-shaped token sequences of a learnable binary sentiment task (see :func:`synthetic_reviews`).

    Batches are ``(tokens long[B, T], lengths long[B], labels float[B])`` from
    :func:`~lightning_amp_plus.data._collate.pad_collate`, like the real IMDB module's. ``vocab_size`` and
    ``pad_index`` (0; ``<unk>`` is 1) are set at construction, so a model can be built from them before ``setup``.
    The test set is a third draw, disjoint from train and validation, of ``num_val`` reviews.

    Args:
        num_train: training reviews.
        num_val: validation reviews (and test reviews).
        vocab_size: token ids are ``0 .. vocab_size - 1``; at least 5 (two reserved ids, one positive, one negative
            and one neutral word).
        min_len: shortest review, in tokens.
        max_len: longest review, in tokens.
        batch_size: reviews per batch.
        seed: fixes the task, the samples and the training order.
        num_workers: DataLoader worker processes.

    Examples:
        >>> data = SyntheticIMDBDataModule(num_train=8, num_val=4, vocab_size=50, min_len=3, max_len=6, batch_size=4)
        >>> data.vocab_size, data.pad_index
        (50, 0)
        >>> data.setup("fit")
        >>> tokens, lengths, labels = next(iter(data.train_dataloader()))
        >>> tokens.shape[0], tokens.shape[1] == int(lengths.max()), labels.dtype
        (4, True, torch.float32)
    """

    def __init__(
        self,
        num_train: int = 2048,
        num_val: int = 512,
        vocab_size: int = 1000,
        min_len: int = 20,
        max_len: int = 120,
        batch_size: int = 64,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        # Plain Python numbers from the checks: save_hyperparameters reads these locals.
        num_train = check_int(name, "num_train", num_train, 1)
        num_val = check_int(name, "num_val", num_val, 1)
        vocab_size = check_int(name, "vocab_size", vocab_size, 5)
        min_len = check_int(name, "min_len", min_len, 1)
        max_len = check_int(name, "max_len", max_len, 1)
        if max_len < min_len:
            raise ValueError(f"`{name}(min_len={min_len}, max_len={max_len})`: max_len must be >= min_len.")
        batch_size = check_int(name, "batch_size", batch_size, 1)
        seed = check_int(name, "seed", seed, 0)
        num_workers = check_int(name, "num_workers", num_workers, 0)
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.pad_index = PAD_INDEX
        self.unk_index = UNK_INDEX
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.datasets = {}

    @override
    def _generate(self, size: int, split: int) -> TokenSequences:
        hp = self.hparams
        return synthetic_reviews(size, hp["vocab_size"], hp["min_len"], hp["max_len"], hp["seed"], split)

    @override
    def _collate(self) -> Callable[[list[Any]], Any]:
        return pad_collate


def _sample_seed(seed: int, split: int) -> int:
    # Distinct streams per (seed, split), far from the small seeds the tasks themselves use.
    return 2**40 + seed * len(_SPLITS) * 2 + split
