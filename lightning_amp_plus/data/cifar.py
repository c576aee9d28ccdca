"""``CIFAR10DataModule``: the real CIFAR-10 (torchvision's reader), with a seeded train/validation split.

The 50,000 training images are split by index into train and validation with a seeded generator, so the validation
images get the evaluation transforms (no augmentation) while the training images are augmented; the official 10,000
test images are the test set. The data is used from an existing ``cifar-10-batches-py`` folder, or extracted from
``cifar-10-python.tar.gz`` in ``data_dir``, or downloaded (when allowed): see :mod:`lightning_amp_plus.data._download`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from torchvision.datasets import CIFAR10
from typing_extensions import override

from lightning_amp_plus._checks import check_bool, check_int
from lightning_amp_plus.data._cifar_stats import CIFAR10_MEAN, CIFAR10_STD
from lightning_amp_plus.data._download import ArchiveSpec, DatasetUnavailableError, ensure_dataset, file_md5
from lightning_amp_plus.data._loaders import SplitDataModule

__all__ = ["CIFAR10_MEAN", "CIFAR10_STD", "CIFAR10DataModule", "DatasetUnavailableError"]

_Item = tuple[Tensor, int]


def _spec() -> ArchiveSpec:
    # Read from torchvision's class at call time: one source for the URL and checksums.
    return ArchiveSpec(
        name="CIFAR-10",
        url=CIFAR10.url,
        filename=CIFAR10.filename,
        md5=CIFAR10.tgz_md5,
        folder=CIFAR10.base_folder,
        synthetic="SyntheticCIFAR10DataModule",
        example_file="data_batch_1",
    )


def _problem_with(folder: Path) -> str | None:
    """What is missing or corrupt in a ``cifar-10-batches-py`` folder: the checks torchvision's reader makes."""
    expected = [*CIFAR10.train_list, *CIFAR10.test_list, [CIFAR10.meta["filename"], CIFAR10.meta["md5"]]]
    for name, md5 in expected:
        path = folder / name
        if not path.is_file():
            return f"'{name}' is missing"
        if file_md5(path) != md5:
            return f"'{name}' fails its md5 check"
    return None


class _Subset(Dataset[_Item]):
    """The images of ``base`` at ``indices``, each passed through ``transform``.

    The train and validation subsets share one loaded copy of the images but apply different transforms, which
    ``random_split`` over a single transformed dataset cannot do.
    """

    def __init__(self, base: CIFAR10, indices: Sequence[int], transform: Callable[[Any], Tensor]) -> None:
        self.base = base
        self.indices = list(indices)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> _Item:
        image, label = self.base[self.indices[index]]
        return self.transform(image), int(label)


class CIFAR10DataModule(SplitDataModule):
    """CIFAR-10 with standard normalisation, train-only augmentation and a seeded train/validation split.

    Batches are ``(images, labels)``: float32 ``[B, 3, 32, 32]`` normalised with :data:`CIFAR10_MEAN` /
    :data:`CIFAR10_STD`, and int64 ``[B]`` class ids. Training images are randomly cropped (32 px after 4 px zero
    padding) and flipped horizontally when ``augment`` is on; validation and test images are only normalised. The test
    (and predict) batches are the official 10,000 test images.

    Args:
        data_dir: the folder holding ``cifar-10-batches-py`` or ``cifar-10-python.tar.gz`` (or where to download it).
        batch_size: images per batch.
        num_workers: DataLoader worker processes.
        val_size: training images held out for validation (taken with a generator seeded by ``seed``).
        seed: the seed of the train/validation split.
        augment: random crop and flip on the training images.
        download: whether :meth:`prepare_data` may download the archive when no local copy exists. Without a local copy
            and with ``download=False`` (or no network) it raises :class:`DatasetUnavailableError`, naming the
            offline alternative ``SyntheticCIFAR10DataModule``.

    Examples:
        >>> dm = CIFAR10DataModule(data_dir="data", batch_size=32, val_size=1000)
        >>> dm.num_classes, dm.batch_size
        (10, 32)
    """

    num_classes = 10

    def __init__(
        self,
        data_dir: str | Path = "data",
        batch_size: int = 128,
        num_workers: int = 0,
        val_size: int = 5000,
        seed: int = 0,
        augment: bool = True,
        download: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(data_dir, str | Path) or str(data_dir) == "":
            raise ValueError(f"`CIFAR10DataModule(data_dir={data_dir!r})` is invalid: give a folder path.")
        # Plain Python ints from the checks: save_hyperparameters reads these locals.
        batch_size = check_int("CIFAR10DataModule", "batch_size", batch_size, 1)
        num_workers = check_int("CIFAR10DataModule", "num_workers", num_workers, 0)
        val_size = check_int("CIFAR10DataModule", "val_size", val_size, 1)
        seed = check_int("CIFAR10DataModule", "seed", seed, 0)
        check_bool("CIFAR10DataModule", "augment", augment)
        check_bool("CIFAR10DataModule", "download", download)
        self.save_hyperparameters()
        self.data_dir = Path(data_dir).expanduser()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_size = val_size
        self.seed = seed
        self.augment = augment
        self.download = download
        self.train_set: Dataset[_Item] | None = None
        self.val_set: Dataset[_Item] | None = None
        self.test_set: Dataset[_Item] | None = None
        self._prepared = False

    def eval_transform(self) -> Callable[[Any], Tensor]:
        """PIL image -> normalised float tensor ``[3, 32, 32]``, for validation and test images.

        Examples:
            >>> from PIL import Image
            >>> image = Image.new("RGB", (32, 32), color=(255, 0, 0))
            >>> CIFAR10DataModule().eval_transform()(image)[:, 0, 0]
            tensor([ 2.0591, -1.9803, -1.7068])
        """
        transform: Callable[[Any], Tensor] = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
        )
        return transform

    def train_transform(self) -> Callable[[Any], Tensor]:
        """The training transform: random crop (pad 4) and horizontal flip before :meth:`eval_transform`'s steps.

        With ``augment=False`` it is :meth:`eval_transform`.

        Examples:
            >>> from PIL import Image
            >>> CIFAR10DataModule().train_transform()(Image.new("RGB", (32, 32))).shape
            torch.Size([3, 32, 32])
        """
        if not self.augment:
            return self.eval_transform()
        augmented: Callable[[Any], Tensor] = transforms.Compose(
            [
                transforms.RandomCrop(32, padding=4),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD),
            ]
        )
        return augmented

    @override
    def prepare_data(self) -> None:
        """Make sure ``data_dir / "cifar-10-batches-py"`` is complete: use it, extract the archive, or download it."""
        ensure_dataset(_spec(), self.data_dir, self.download, _problem_with)
        self._prepared = True

    @override
    def setup(self, stage: str) -> None:
        """Load the images a stage needs: the training images for ``fit``/``validate``, the test images otherwise."""
        # Not every caller of setup ran prepare_data in this process (a notebook, DDP ranks other than 0); checking the
        # folder here turns a missing or corrupt dataset into the clear error rather than torchvision's terse one.
        if not self._prepared:
            self.prepare_data()
        root = str(self.data_dir)
        if stage in ("fit", "validate") and self.train_set is None:
            train = CIFAR10(root, train=True, download=False)
            if self.val_size >= len(train):
                raise ValueError(
                    f"`CIFAR10DataModule(val_size={self.val_size})` is invalid: it must be smaller than the "
                    f"{len(train)} training images, to leave some for training."
                )
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.seed)).tolist()
            self.val_set = _Subset(train, order[: self.val_size], self.eval_transform())
            self.train_set = _Subset(train, order[self.val_size :], self.train_transform())
        if stage in ("test", "predict") and self.test_set is None:
            test = CIFAR10(root, train=False, download=False)
            self.test_set = _Subset(test, range(len(test)), self.eval_transform())

    @override
    def _dataset(self, split: str) -> Dataset[_Item]:
        dataset = {"train": self.train_set, "val": self.val_set, "test": self.test_set}[split]
        if dataset is None:
            stage = "test" if split == "test" else "fit"
            raise RuntimeError(f"CIFAR10DataModule.{split}_dataloader() needs setup('{stage}') first.")
        return dataset

    @override
    def _pin_memory(self) -> bool:
        return torch.cuda.is_available()

    @override
    def predict_dataloader(self) -> DataLoader[_Item]:
        """The official test set, in a fixed order."""
        return self._loader("test", shuffle=False)
