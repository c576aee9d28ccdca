"""IMDBDataModule on a tiny aclImdb tree (and its .tar.gz) in the real layout; the network is never used."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FakeNetwork, fake_network

from lightning_amp_plus.data import imdb
from lightning_amp_plus.data._download import CorruptArchiveError, DatasetUnavailableError, file_md5
from lightning_amp_plus.data._text import tokenize
from lightning_amp_plus.data.imdb import IMDB_URL, IMDBDataModule

OFFICIAL_MD5 = imdb.IMDB_MD5
# The label words ("great" / "terrible") occur 2-3 times in every training review, so they are the two most frequent
# words whichever review is held out; "uniq<k>" is appended twice to training review k (write_imdb) and nowhere else.
TRAIN = {
    "pos": ["A great movie.<br /><br />Great acting! great", "great fun, great cast great", "simply great great great"],
    "neg": [
        "A terrible movie. Terrible acting! terrible",
        "boring and terrible terrible terrible",
        "terrible terrible x",
    ],
}
TEST = {"neg": ["terrible terrible terrible terrible testonlyword"], "pos": ["great testonlyword"]}
UNIQUE = [f"uniq{k}" for k in range(6)]


@pytest.fixture(autouse=True)
def network(monkeypatch: pytest.MonkeyPatch) -> FakeNetwork:
    return fake_network(monkeypatch)


def write_imdb(root: Path) -> Path:
    """An ``aclImdb`` tree in the Stanford layout (``<id>_<rating>.txt`` files), with an ``unsup`` folder to ignore."""
    folder = root / "aclImdb"
    k = 0
    for name, texts in TRAIN.items():
        (folder / "train" / name).mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / "train" / name / f"{i}_{8 if name == 'pos' else 2}.txt").write_text(
                f"{text} {UNIQUE[k]} {UNIQUE[k]}"
            )
            k += 1
    for name, texts in TEST.items():
        (folder / "test" / name).mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / "test" / name / f"{i}_{9 if name == 'pos' else 1}.txt").write_text(text)
    (folder / "train" / "unsup").mkdir()
    (folder / "train" / "unsup" / "0_0.txt").write_text("unsupword " * 10)
    return folder


def write_archive(folder: Path, archive: Path) -> Path:
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="aclImdb")
    return archive


@pytest.fixture
def imdb_dir(tmp_path: Path) -> Path:
    write_imdb(tmp_path / "data")
    return tmp_path / "data"


@pytest.fixture
def tokenize_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def counting(text: str) -> list[str]:
        calls.append(text)
        return tokenize(text)

    monkeypatch.setattr(imdb, "tokenize", counting)
    return calls


def ready(data_dir: Path, **kwargs: object) -> IMDBDataModule:
    settings: dict[str, object] = {"batch_size": 2, "val_size": 1, "min_freq": 2, "download": False, **kwargs}
    dm = IMDBDataModule(data_dir=data_dir, **settings)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_batches_are_padded_token_ids_with_lengths_and_float_labels(imdb_dir: Path) -> None:
    dm = ready(imdb_dir, max_len=256)
    assert dm.vocab is not None
    tokens, lengths, labels = next(iter(dm.test_dataloader()))
    great, terrible = dm.vocab.encode(["great", "terrible"])
    # The test reviews in file order: negatives first. "testonlyword" is not in the vocabulary: <unk> (1).
    assert tokens.tolist() == [[terrible] * 4 + [1], [great, 1, 0, 0, 0]]
    assert lengths.tolist() == [5, 2]
    assert labels.dtype == torch.float32 and labels.tolist() == [0.0, 1.0]
    assert dm.pad_index == 0


def test_reviews_are_cut_to_max_len(imdb_dir: Path) -> None:
    dm = ready(imdb_dir, max_len=3)
    tokens, lengths, _ = next(iter(dm.test_dataloader()))
    assert lengths.tolist() == [3, 2] and tokens.shape == (2, 3)
    for split in (dm.train_set, dm.val_set):
        assert split is not None and all(len(split[i][0]) <= 3 for i in range(len(split)))


def test_splits_and_labels_come_from_the_folders_and_unsup_is_ignored(imdb_dir: Path) -> None:
    dm = ready(imdb_dir)
    assert dm.train_set is not None and dm.val_set is not None and dm.test_set is not None
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (5, 1, 2)
    train_labels = [dm.train_set[i][1] for i in range(5)] + [dm.val_set[0][1]]
    assert sorted(train_labels) == [0, 0, 0, 1, 1, 1]
    assert dm.vocab is not None and "unsupword" not in dm.vocab.tokens


def test_the_vocabulary_comes_from_the_training_reviews_only(imdb_dir: Path) -> None:
    dm = ready(imdb_dir, min_freq=2)
    assert dm.vocab is not None and dm.val_set is not None
    vocab = dm.vocab.tokens
    assert vocab[:2] == ["<pad>", "<unk>"] and set(vocab[2:4]) == {"great", "terrible"}
    assert "testonlyword" not in vocab
    # Each review has its own word, twice: the training reviews' words are in, the validation review's is not.
    missing = [word for word in UNIQUE if word not in vocab]
    assert len(missing) == 1
    val_tokens = dm.val_set[0][0].tolist()
    assert 1 in val_tokens and dm.vocab.encode(missing) == [1]
    assert dm.vocab_size == len(vocab)


def test_min_freq_drops_rarer_training_words(imdb_dir: Path) -> None:
    # Each "uniq<k>" occurs exactly twice, in one review: the 5 kept for training pass min_freq=2, none passes 3.
    twice = ready(imdb_dir, min_freq=2).vocab
    thrice = ready(imdb_dir, min_freq=3).vocab
    assert twice is not None and thrice is not None
    assert sum(word in twice.tokens for word in UNIQUE) == 5
    assert not any(word in thrice.tokens for word in UNIQUE)
    assert "x" not in twice.tokens  # once, in one review


def test_vocab_size_keeps_the_most_frequent_words(imdb_dir: Path) -> None:
    dm = ready(imdb_dir, vocab_size=4)
    assert dm.vocab is not None and sorted(dm.vocab.tokens[2:]) == ["great", "terrible"]
    assert dm.vocab_size == 4
    for split in (dm.train_set, dm.val_set, dm.test_set):
        assert split is not None and all(int(split[i][0].max()) < 4 for i in range(len(split)))


def test_vocab_size_is_the_requested_bound_before_setup_and_the_real_size_after(imdb_dir: Path) -> None:
    dm = IMDBDataModule(data_dir=imdb_dir, val_size=1, download=False)
    assert dm.vocab_size == 20000
    dm.prepare_data()
    dm.setup("fit")
    assert dm.vocab is not None and dm.vocab_size == len(dm.vocab) < 20000


def test_the_encoded_reviews_are_cached_and_reused(imdb_dir: Path, tokenize_calls: list[str]) -> None:
    first = ready(imdb_dir, max_len=8)
    assert len(tokenize_calls) == 8  # 6 training and 2 test reviews, once each; unsup not read
    caches = list((imdb_dir / "aclImdb_processed").glob("*.pt"))
    assert len(caches) == 1
    assert set(torch.load(caches[0], weights_only=True)) >= {"vocab", "train", "val", "test"}

    tokenize_calls.clear()
    second = ready(imdb_dir, max_len=8)
    assert tokenize_calls == []
    assert second.vocab is not None and first.vocab is not None and second.vocab.tokens == first.vocab.tokens
    assert second.val_set is not None and first.val_set is not None
    assert torch.equal(second.val_set[0][0], first.val_set[0][0])

    ready(imdb_dir, max_len=4)  # another setting that changes the tensors: another cache
    assert len(tokenize_calls) == 8
    assert len(list((imdb_dir / "aclImdb_processed").glob("*.pt"))) == 2


def test_a_cache_from_a_changed_dataset_folder_is_not_reused(imdb_dir: Path, tokenize_calls: list[str]) -> None:
    ready(imdb_dir)
    (imdb_dir / "aclImdb" / "test" / "pos" / "1_10.txt").write_text("great great")
    tokenize_calls.clear()
    dm = ready(imdb_dir)
    assert len(tokenize_calls) == 9 and len(dm.test_set) == 3


def test_an_unreadable_cache_is_rebuilt_with_a_warning(imdb_dir: Path, tokenize_calls: list[str]) -> None:
    first = ready(imdb_dir)
    (cache,) = (imdb_dir / "aclImdb_processed").glob("*.pt")
    cache.write_bytes(b"cut short")
    tokenize_calls.clear()
    with pytest.warns(UserWarning, match="unreadable.*rebuilding it"):
        second = ready(imdb_dir)
    assert len(tokenize_calls) == 8
    assert second.vocab is not None and first.vocab is not None and second.vocab.tokens == first.vocab.tokens
    torch.load(cache, weights_only=True)  # rewritten whole


def test_the_split_is_fixed_by_the_seed(imdb_dir: Path) -> None:
    def held_out(seed: int) -> list[int]:
        dm = ready(imdb_dir, seed=seed, val_size=3, min_freq=1)
        assert dm.val_set is not None and dm.vocab is not None
        return sorted(int(word[4:]) for word in UNIQUE if dm.vocab.encode([word]) == [1])

    assert held_out(0) == held_out(0)
    assert len(held_out(0)) == 3
    assert {tuple(held_out(seed)) for seed in range(4)} != {tuple(held_out(0))}


def test_the_archive_is_extracted_and_gives_the_same_data_as_the_folder(
    tmp_path: Path, imdb_dir: Path, monkeypatch: pytest.MonkeyPatch, network: FakeNetwork
) -> None:
    archive = write_archive(imdb_dir / "aclImdb", tmp_path / "other" / "aclImdb_v1.tar.gz")
    # The tiny archive cannot have the official md5: expect its own, so the checksum check still runs.
    monkeypatch.setattr(imdb, "IMDB_MD5", file_md5(archive))
    from_archive = ready(archive.parent)
    from_folder = ready(imdb_dir)
    assert (archive.parent / "aclImdb" / "train" / "pos" / "0_8.txt").is_file()
    assert from_archive.vocab is not None and from_folder.vocab is not None
    assert from_archive.vocab.tokens == from_folder.vocab.tokens
    assert [x.tolist() for x, _ in from_archive.test_set] == [x.tolist() for x, _ in from_folder.test_set]
    assert network.urls == []
    assert [p.name for p in archive.parent.iterdir() if p.name.startswith(".")] == []  # no staging folder left


def serve_an_archive_of(imdb_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, network: FakeNetwork) -> bytes:
    """Make the fake network serve an archive of ``imdb_dir`` (the expected md5 set to its own); return its bytes."""
    payload = write_archive(imdb_dir / "aclImdb", tmp_path / "payload.tar.gz").read_bytes()
    monkeypatch.setattr(imdb, "IMDB_MD5", file_md5(tmp_path / "payload.tar.gz"))
    network.behaviour = lambda url, path: path.write_bytes(payload)
    return payload


def test_a_download_is_checked_and_renamed_into_place(
    tmp_path: Path, imdb_dir: Path, monkeypatch: pytest.MonkeyPatch, network: FakeNetwork
) -> None:
    payload = serve_an_archive_of(imdb_dir, tmp_path, monkeypatch, network)
    data_dir = tmp_path / "fresh"
    dm = ready(data_dir, download=True)
    assert network.urls == [IMDB_URL]
    assert (data_dir / "aclImdb_v1.tar.gz").read_bytes() == payload
    assert not (data_dir / "aclImdb_v1.tar.gz.part").exists()
    assert len(dm.test_set) == 2


def test_a_failed_download_leaves_no_partial_file(tmp_path: Path, network: FakeNetwork) -> None:
    def half_then_fail(url: str, path: Path) -> None:
        path.write_bytes(b"\x1f\x8b half an archive")
        raise ConnectionResetError("connection reset by peer")

    network.behaviour = half_then_fail
    with pytest.raises(DatasetUnavailableError, match="ConnectionResetError: connection reset by peer") as caught:
        IMDBDataModule(data_dir=tmp_path).prepare_data()
    assert IMDB_URL in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_download_is_reported_and_deleted(tmp_path: Path, network: FakeNetwork) -> None:
    network.behaviour = lambda url, path: path.write_bytes(b"an error page, not an archive")
    with pytest.raises(CorruptArchiveError, match=f"is corrupt: its md5 is [0-9a-f]{{32}}, expected {OFFICIAL_MD5}"):
        IMDBDataModule(data_dir=tmp_path).prepare_data()
    assert list(tmp_path.iterdir()) == []


def test_a_stale_partial_file_is_not_taken_for_a_download(
    tmp_path: Path, imdb_dir: Path, monkeypatch: pytest.MonkeyPatch, network: FakeNetwork
) -> None:
    payload = serve_an_archive_of(imdb_dir, tmp_path, monkeypatch, network)
    data_dir = tmp_path / "fresh"
    data_dir.mkdir()
    (data_dir / "aclImdb_v1.tar.gz.part").write_bytes(b"left by a killed run")
    ready(data_dir, download=True)
    assert network.urls == [IMDB_URL]
    assert (data_dir / "aclImdb_v1.tar.gz").read_bytes() == payload


def test_an_existing_archive_with_a_bad_checksum_is_reported_and_not_extracted(tmp_path: Path) -> None:
    (tmp_path / "aclImdb_v1.tar.gz").write_bytes(b"truncated copy")
    with pytest.raises(
        CorruptArchiveError, match=re.escape(f"'{tmp_path / 'aclImdb_v1.tar.gz'}' is corrupt or incomplete")
    ):
        IMDBDataModule(data_dir=tmp_path, download=False).prepare_data()
    assert not (tmp_path / "aclImdb").exists()


def test_an_incomplete_folder_is_named_and_left_alone(imdb_dir: Path) -> None:
    for review in (imdb_dir / "aclImdb" / "test" / "pos").iterdir():
        review.unlink()
    with pytest.raises(CorruptArchiveError, match=r"'test/pos' holds no \.txt reviews"):
        ready(imdb_dir)
    assert (imdb_dir / "aclImdb" / "train" / "pos").is_dir()


@pytest.mark.parametrize("download", [False, True])
def test_offline_the_error_names_the_path_the_url_and_the_alternatives(
    tmp_path: Path, network: FakeNetwork, download: bool
) -> None:
    with pytest.raises(DatasetUnavailableError) as caught:
        IMDBDataModule(data_dir=tmp_path, download=download).setup("fit")
    message = str(caught.value)
    for expected in (
        str(tmp_path / "aclImdb"),
        str(tmp_path / "aclImdb_v1.tar.gz"),
        IMDB_URL,
        OFFICIAL_MD5,
        "--data synthetic",
        "SyntheticIMDBDataModule",
    ):
        assert expected in message
    assert network.urls == ([IMDB_URL] if download else [])
    assert ("download=False" in message) is not download


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("batch_size", 0),
        ("max_len", 0),
        ("vocab_size", 2),
        ("min_freq", 0),
        ("val_size", 0),
        ("seed", -1),
        ("num_workers", -1),
        ("max_len", 1.5),
        ("max_len", True),
        ("vocab_size", "100"),
        ("data_dir", ""),
    ],
)
def test_bad_arguments_are_refused_by_name(argument: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"IMDBDataModule\({argument}={value!r}\)"):
        IMDBDataModule(**{argument: value})


# A flag that is not a bool is a wrong type: TypeError, as the plugin's and the models' flags raise.
def test_a_download_flag_that_is_not_a_bool_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"IMDBDataModule\(download='no'\)` must be True or False"):
        IMDBDataModule(download="no")  # type: ignore[arg-type]


def test_numpy_ints_give_the_same_batches_and_plain_ints_in_the_hyperparameters(imdb_dir: Path) -> None:
    plain = ready(imdb_dir, max_len=4)
    numpy = ready(imdb_dir, max_len=np.int64(4), batch_size=np.int64(2), val_size=np.int32(1), min_freq=np.int64(2))
    assert dict(numpy.hparams) == dict(plain.hparams)
    assert all(type(numpy.hparams[key]) is type(plain.hparams[key]) for key in plain.hparams)
    for numpy_batch, plain_batch in zip(numpy.test_dataloader(), plain.test_dataloader(), strict=True):
        torch.testing.assert_close(numpy_batch, plain_batch)


def test_a_validation_split_as_large_as_the_training_set_is_refused(imdb_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"val_size=6\).*smaller than the 6 training reviews"):
        ready(imdb_dir, val_size=6)
