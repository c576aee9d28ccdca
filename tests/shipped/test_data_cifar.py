"""CIFAR10DataModule on a tiny CIFAR-10 written in the real on-disk format; the network is never used."""

from __future__ import annotations

import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FakeNetwork, fake_network
from torchvision.datasets import CIFAR10

from lightning_amp_plus.data._download import CorruptArchiveError, DatasetUnavailableError, file_md5
from lightning_amp_plus.data.cifar import CIFAR10_MEAN, CIFAR10_STD, CIFAR10DataModule

PER_BATCH = 4  # 5 batches: 20 training images
TRAIN_IMAGES = 5 * PER_BATCH
TEST_IMAGES = 6
MEAN = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
STD = torch.tensor(CIFAR10_STD).view(3, 1, 1)


@pytest.fixture(autouse=True)
def network(monkeypatch: pytest.MonkeyPatch) -> FakeNetwork:
    return fake_network(monkeypatch)


def image_ids(count: int, first: int) -> np.ndarray:
    """``count`` random images as CIFAR rows (uint8 [N, 3072]: all red, then green, then blue, each row-major 32x32).

    The red pixel at (0, 0) holds the image's id, so an un-augmented tensor says which image it came from.
    """
    rows = np.random.default_rng(first).integers(0, 256, size=(count, 3072), dtype=np.uint8)
    rows[:, 0] = np.arange(first, first + count)
    return rows


def write_cifar(root: Path) -> Path:
    """A ``cifar-10-batches-py`` folder in the real format, with 20 training and 6 test images.

    The real files are Python 2 pickles whose ``str`` keys torchvision reads as ``str`` (``encoding="latin1"``);
    Python 3 ``str`` keys read back the same way. Labels are ``id % 10``.
    """
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = [(f"data_batch_{i + 1}", image_ids(PER_BATCH, i * PER_BATCH)) for i in range(5)]
    batches.append(("test_batch", image_ids(TEST_IMAGES, 100)))
    for name, rows in batches:
        entry = {
            "batch_label": name,
            "labels": [int(row[0]) % 10 for row in rows],
            "data": rows,
            "filenames": [f"img_{row[0]}.png" for row in rows],
        }
        (folder / name).write_bytes(pickle.dumps(entry, protocol=2))
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    meta = {"label_names": names, "num_cases_per_batch": PER_BATCH, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return folder


def trust_tiny_files(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Point torchvision's md5 lists at the tiny files.

    torchvision (and the module, which makes the same checks) compares every batch file with the official md5s; tiny
    files cannot match them. Swapping the expected values, not the check, keeps the integrity check itself running.
    """
    monkeypatch.setattr(
        CIFAR10, "train_list", [[f"data_batch_{i}", file_md5(folder / f"data_batch_{i}")] for i in (1, 2, 3, 4, 5)]
    )
    monkeypatch.setattr(CIFAR10, "test_list", [["test_batch", file_md5(folder / "test_batch")]])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": file_md5(folder / "batches.meta")})


@pytest.fixture
def cifar_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    trust_tiny_files(monkeypatch, write_cifar(tmp_path / "data"))
    return tmp_path / "data"


def ready(data_dir: Path, **kwargs: object) -> CIFAR10DataModule:
    settings: dict[str, object] = {"batch_size": 8, "val_size": 5, "download": False, **kwargs}
    dm = CIFAR10DataModule(data_dir=data_dir, **settings)
    dm.prepare_data()
    dm.setup("fit")
    dm.setup("test")
    return dm


def ids_of(images: torch.Tensor) -> list[int]:
    """The ids written by :func:`image_ids`, read back from un-augmented normalised images."""
    red = images[:, 0, 0, 0] * STD[0, 0, 0] + MEAN[0, 0, 0]
    return torch.round(red * 255).long().tolist()


def all_batches(loader: torch.utils.data.DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*loader, strict=True)
    return torch.cat(images), torch.cat(labels)


def test_a_real_format_folder_loads_with_the_split_and_batch_shapes(cifar_dir: Path) -> None:
    dm = ready(cifar_dir)
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
    assert labels.shape == (8,) and labels.dtype == torch.int64
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (TRAIN_IMAGES - 5, 5, TEST_IMAGES)


def test_test_images_are_the_official_ones_normalised_with_cifar_statistics(cifar_dir: Path) -> None:
    images, labels = all_batches(ready(cifar_dir).test_dataloader())
    raw = torch.from_numpy(image_ids(TEST_IMAGES, 100)).view(-1, 3, 32, 32).float() / 255
    # ToTensor and Normalize do these same float32 operations; the default float32 tolerance covers op order.
    torch.testing.assert_close(images, (raw - MEAN) / STD)
    assert labels.tolist() == [i % 10 for i in range(100, 100 + TEST_IMAGES)]


def test_the_split_is_fixed_by_the_seed_and_covers_the_training_images_once(cifar_dir: Path) -> None:
    first = ready(cifar_dir, augment=False, seed=3)
    val_ids = ids_of(all_batches(first.val_dataloader())[0])
    train_ids = ids_of(all_batches(first.train_dataloader())[0])
    assert sorted(val_ids + train_ids) == list(range(TRAIN_IMAGES))
    assert ids_of(all_batches(ready(cifar_dir, augment=False, seed=3).val_dataloader())[0]) == val_ids
    assert ids_of(all_batches(ready(cifar_dir, augment=False, seed=4).val_dataloader())[0]) != val_ids


def test_labels_follow_their_images_through_the_split(cifar_dir: Path) -> None:
    images, labels = all_batches(ready(cifar_dir, augment=False).train_dataloader())
    assert labels.tolist() == [i % 10 for i in ids_of(images)]


def test_augmentation_changes_training_images_only(cifar_dir: Path) -> None:
    dm = ready(cifar_dir, augment=True)
    assert dm.train_set is not None and dm.val_set is not None
    train_views = [dm.train_set[0][0] for _ in range(6)]
    assert any(not torch.equal(train_views[0], view) for view in train_views[1:])
    val_views = [dm.val_set[0][0] for _ in range(6)]
    assert all(torch.equal(val_views[0], view) for view in val_views[1:])
    plain = ready(cifar_dir, augment=False)
    assert plain.train_set is not None
    assert torch.equal(plain.train_set[0][0], plain.train_set[0][0])


def test_the_archive_is_extracted_when_there_is_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, network: FakeNetwork
) -> None:
    folder = write_cifar(tmp_path / "made")
    trust_tiny_files(monkeypatch, folder)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with tarfile.open(data_dir / "cifar-10-python.tar.gz", "w:gz") as archive:
        archive.add(folder, arcname="cifar-10-batches-py")
    monkeypatch.setattr(CIFAR10, "tgz_md5", file_md5(data_dir / "cifar-10-python.tar.gz"))
    dm = ready(data_dir, augment=False)
    assert (data_dir / "cifar-10-batches-py" / "data_batch_5").is_file()
    assert len(dm.test_set) == TEST_IMAGES
    assert network.urls == []


def test_an_archive_with_a_bad_checksum_is_reported_and_not_extracted(tmp_path: Path) -> None:
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"not the archive")
    with pytest.raises(CorruptArchiveError, match=r"md5 is [0-9a-f]{32}, expected c58f30108f718f92721af3b95e74349a"):
        CIFAR10DataModule(data_dir=tmp_path).prepare_data()
    assert not (tmp_path / "cifar-10-batches-py").exists()


def test_a_corrupt_batch_file_in_the_folder_is_named(cifar_dir: Path) -> None:
    (cifar_dir / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"truncated")
    with pytest.raises(CorruptArchiveError, match="'data_batch_3' fails its md5 check"):
        CIFAR10DataModule(data_dir=cifar_dir, download=False).prepare_data()


def test_without_files_and_download_false_the_error_says_where_and_what_instead(
    tmp_path: Path, network: FakeNetwork
) -> None:
    with pytest.raises(DatasetUnavailableError) as caught:
        CIFAR10DataModule(data_dir=tmp_path, download=False).setup("fit")
    message = str(caught.value)
    for expected in (
        str(tmp_path / "cifar-10-batches-py"),
        str(tmp_path / "cifar-10-python.tar.gz"),
        CIFAR10.url,
        "download=False",
        "--data synthetic",
        "SyntheticCIFAR10DataModule",
    ):
        assert expected in message
    assert network.urls == []


def test_offline_download_failure_names_the_url_and_leaves_nothing(tmp_path: Path, network: FakeNetwork) -> None:
    with pytest.raises(DatasetUnavailableError, match=r"downloading .*cifar-10-python\.tar\.gz failed") as caught:
        CIFAR10DataModule(data_dir=tmp_path).prepare_data()
    assert "SyntheticCIFAR10DataModule" in str(caught.value)
    assert network.urls == [CIFAR10.url]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("batch_size", 0),
        ("num_workers", -1),
        ("val_size", 0),
        ("seed", -1),
        ("batch_size", 2.5),
        ("batch_size", True),
        ("seed", "0"),
        ("data_dir", ""),
    ],
)
def test_bad_arguments_are_refused_by_name(argument: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"CIFAR10DataModule\({argument}={value!r}\)"):
        CIFAR10DataModule(**{argument: value})


# A flag that is not a bool is a wrong type: TypeError, as the plugin's and the models' flags raise.
@pytest.mark.parametrize(("argument", "value"), [("augment", "yes"), ("download", 1)])
def test_a_flag_that_is_not_a_bool_is_refused_by_name(argument: str, value: object) -> None:
    with pytest.raises(TypeError, match=rf"CIFAR10DataModule\({argument}={value!r}\)` must be True or False"):
        CIFAR10DataModule(**{argument: value})


def test_numpy_ints_give_the_same_batches_and_plain_ints_in_the_hyperparameters(cifar_dir: Path) -> None:
    plain = ready(cifar_dir, augment=False, seed=3)
    numpy = ready(cifar_dir, augment=False, seed=np.int64(3), batch_size=np.int64(8), val_size=np.int32(5))
    assert dict(numpy.hparams) == dict(plain.hparams)
    assert all(type(numpy.hparams[key]) is type(plain.hparams[key]) for key in plain.hparams)
    torch.testing.assert_close(all_batches(numpy.val_dataloader()), all_batches(plain.val_dataloader()))


def test_a_validation_split_as_large_as_the_training_set_is_refused(cifar_dir: Path) -> None:
    with pytest.raises(ValueError, match=rf"val_size={TRAIN_IMAGES}\).*smaller than the {TRAIN_IMAGES} training"):
        ready(cifar_dir, val_size=TRAIN_IMAGES)
