"""``SplitDataModule``: the dataloader hooks the shipped data modules share, one DataLoader recipe for every split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

__all__ = ["SplitDataModule"]


class SplitDataModule(pl.LightningDataModule):
    """Training, validation and test DataLoaders over the datasets a subclass holds.

    Training batches are shuffled, the others come in a fixed order; worker processes persist between epochs. A
    subclass sets ``batch_size`` and ``num_workers`` and implements :meth:`_dataset`; it may override :meth:`_collate`
    (variable-length samples), :meth:`_shuffle_generator` (an order of its own rather than the global RNG's) and
    :meth:`_pin_memory`.

    Examples:
        >>> from torch.utils.data import TensorDataset
        >>> class Ones(SplitDataModule):
        ...     batch_size, num_workers = 2, 0
        ...
        ...     def _dataset(self, split):
        ...         return TensorDataset(torch.ones(4, 1))
        >>> [batch[0].shape for batch in Ones().val_dataloader()]
        [torch.Size([2, 1]), torch.Size([2, 1])]
    """

    batch_size: int
    num_workers: int

    def _dataset(self, split: str) -> Dataset[Any]:
        """The dataset of ``split`` (``"train"``, ``"val"`` or ``"test"``), or an error naming the setup it needs."""
        raise NotImplementedError(f"{type(self).__name__} must implement _dataset(split).")

    def _collate(self) -> Callable[[list[Any]], Any] | None:
        """How samples become a batch; ``None``: PyTorch's default (stacking)."""
        return None

    def _shuffle_generator(self) -> torch.Generator | None:
        """The generator that orders the training batches; ``None``: the global RNG."""
        return None

    def _pin_memory(self) -> bool:
        """Whether batches are put in page-locked memory (faster copies to a GPU)."""
        return False

    def _loader(self, split: str, shuffle: bool) -> DataLoader[Any]:
        return DataLoader(
            self._dataset(split),
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=self._shuffle_generator() if shuffle else None,
            collate_fn=self._collate(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self._pin_memory(),
        )

    @override
    def train_dataloader(self) -> DataLoader[Any]:
        """Shuffled training batches."""
        return self._loader("train", shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader[Any]:
        """Validation batches, in a fixed order."""
        return self._loader("val", shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader[Any]:
        """Test batches, in a fixed order."""
        return self._loader("test", shuffle=False)
