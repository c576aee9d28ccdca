"""The synthetic data modules and the padding collate: deterministic, learnable but not trivial, validated."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_trainer

from lightning_amp_plus.data._collate import pad_collate
from lightning_amp_plus.data.synthetic import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    SyntheticCIFAR10DataModule,
    SyntheticIMDBDataModule,
    synthetic_reviews,
)
from lightning_amp_plus.models import CifarCNN, ImdbLSTM


def cifar(**kwargs: object) -> SyntheticCIFAR10DataModule:
    return SyntheticCIFAR10DataModule(**{"num_train": 40, "num_val": 20, "image_size": 8, "batch_size": 8, **kwargs})


def imdb(**kwargs: object) -> SyntheticIMDBDataModule:
    settings = {"num_train": 40, "num_val": 20, "vocab_size": 60, "min_len": 4, "max_len": 12, "batch_size": 8}
    return SyntheticIMDBDataModule(**{**settings, **kwargs})


def first_batches(data: object, count: int = 3) -> list[tuple[torch.Tensor, ...]]:
    loader = data.train_dataloader()  # type: ignore[attr-defined]
    return [batch for _, batch in zip(range(count), loader, strict=False)]


# ------------------------------------------------------------------------------------------------------- images
def test_cifar_batches_are_normalised_images_and_class_labels():
    data = cifar(num_classes=4)
    data.setup("fit")
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (8, 3, 8, 8) and images.dtype == torch.float32
    assert labels.dtype == torch.long and labels.min() >= 0 and labels.max() < 4
    # Pixels were clipped to [0, 1] before the CIFAR-10 normalisation: the normalised range follows.
    mean, std = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    pixels = data.datasets["train"].tensors[0] * std + mean
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5  # fp32 round trip of the normalisation


def test_cifar_classes_are_balanced():
    data = cifar(num_train=40, num_classes=10)
    data.setup()
    assert torch.bincount(data.datasets["train"].tensors[1], minlength=10).tolist() == [4] * 10


def test_cifar_is_deterministic_given_the_seed_and_differs_across_seeds():
    a, b, c = cifar(seed=3), cifar(seed=3), cifar(seed=4)
    for data in (a, b, c):
        data.setup()
    for split in ("train", "val", "test"):
        torch.testing.assert_close(a.datasets[split].tensors, b.datasets[split].tensors, rtol=0, atol=0)
    assert not torch.equal(a.datasets["train"].tensors[0], c.datasets["train"].tensors[0])
    for (x_a, y_a), (x_b, y_b) in zip(first_batches(a), first_batches(b), strict=True):
        assert torch.equal(x_a, x_b) and torch.equal(y_a, y_b), "the shuffled order must follow the seed"


def test_cifar_train_val_and_test_are_different_draws():
    data = cifar()
    data.setup()
    train, val, test = (data.datasets[split].tensors[0] for split in ("train", "val", "test"))
    assert not torch.equal(train[:20], val) and not torch.equal(val, test)


def test_setup_is_idempotent():
    for data in (cifar(), imdb()):
        data.setup("fit")
        before = dict(data.datasets)
        data.setup("validate")
        data.setup("test")
        assert all(data.datasets[split] is before[split] for split in before), type(data).__name__


def test_cifar_is_not_learnable_by_an_untrained_model():
    # Chance is 1/10; an untrained CNN must not find the classes before it learns them (measured: 0.10).
    data = cifar(num_val=200)
    result = make_trainer().validate(CifarCNN(width=8), data, verbose=False)
    assert result[0]["val/acc"] < 0.2


# ------------------------------------------------------------------------------------------------------ reviews
def test_imdb_exposes_vocab_size_and_pad_index_before_setup():
    data = imdb(vocab_size=77)
    assert (data.vocab_size, data.pad_index, data.unk_index) == (77, 0, 1)
    assert data.datasets == {}


def test_imdb_batches_are_padded_tokens_lengths_and_float_labels():
    data = imdb()
    tokens, lengths, labels = next(iter(data.train_dataloader()))
    assert tokens.dtype == torch.long and lengths.dtype == torch.long and labels.dtype == torch.float32
    assert tokens.shape == (8, int(lengths.max()))
    assert set(labels.tolist()) <= {0.0, 1.0}
    for row, length in zip(tokens, lengths.tolist(), strict=True):
        assert 4 <= length <= 12
        assert (row[:length] != 0).all(), "padding id inside a review"
        assert (row[length:] == 0).all(), "non-padding id after a review's end"
        assert row.max() < 60


def test_imdb_is_deterministic_given_the_seed_and_differs_across_seeds():
    a, b, c = imdb(seed=5), imdb(seed=5), imdb(seed=6)
    for data in (a, b, c):
        data.setup()
    for split in ("train", "val", "test"):
        assert a.datasets[split].labels == b.datasets[split].labels
        for x, y in zip(a.datasets[split].sequences, b.datasets[split].sequences, strict=True):
            assert torch.equal(x, y)
    assert any(
        not torch.equal(x, y)
        for x, y in zip(a.datasets["train"].sequences, c.datasets["train"].sequences, strict=False)
    )
    for batch_a, batch_b in zip(first_batches(a), first_batches(b), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(batch_a, batch_b, strict=True))


def test_reviews_use_label_dependent_words():
    reviews = synthetic_reviews(400, vocab_size=100, min_len=20, max_len=40, seed=0)
    counts = torch.zeros(2, 100)
    for tokens, label in zip(reviews.sequences, reviews.labels, strict=True):
        counts[label] += torch.bincount(tokens, minlength=100)
    frequency = counts / counts.sum(dim=1, keepdim=True)
    # Some words are several times more frequent in one class than in the other; pad never appears.
    ratio = (frequency[1] + 1e-6) / (frequency[0] + 1e-6)
    assert (ratio > 3).sum() >= 5 and (ratio < 1 / 3).sum() >= 5
    assert counts[:, 0].sum() == 0 and counts[:, 1].sum() > 0  # <unk> appears, padding does not


def test_imdb_is_not_learnable_by_an_untrained_model():
    # Chance is 1/2 (balanced labels); an untrained LSTM must be near it (measured: 0.42 on these 200 reviews, seed 0).
    data = imdb(num_val=200)
    result = make_trainer().validate(ImdbLSTM(data.vocab_size, embed_dim=8, hidden_dim=8), data, verbose=False)
    assert 0.35 < result[0]["val/acc"] < 0.65


# ------------------------------------------------------------------------------------------------------ collate
def test_pad_collate_pads_to_the_longest_and_reports_true_lengths():
    tokens, lengths, labels = pad_collate(
        [(torch.tensor([4, 5]), 1), (torch.tensor([6, 7, 8, 9]), 0.0), (torch.tensor([3]), torch.tensor(1))],
        pad_index=2,
    )
    assert tokens.tolist() == [[4, 5, 2, 2], [6, 7, 8, 9], [3, 2, 2, 2]]
    assert lengths.tolist() == [2, 4, 1] and lengths.dtype == torch.long
    assert labels.tolist() == [1.0, 0.0, 1.0] and labels.dtype == torch.float32


def test_pad_collate_casts_integer_tokens_to_long_and_keeps_empty_sequences_at_length_zero():
    tokens, lengths, _ = pad_collate(
        [(torch.tensor([], dtype=torch.int32), 0), (torch.tensor([], dtype=torch.int32), 1)]
    )
    assert tokens.dtype == torch.long and tokens.tolist() == [[0], [0]]
    assert lengths.tolist() == [0, 0]


@pytest.mark.parametrize(
    ("batch", "error", "message"),
    [
        ([], ValueError, r"pad_collate\(batch=\[\]\): the batch is empty"),
        ([(torch.tensor([1.0, 2.0]), 1)], TypeError, r"tokens of batch\[0\] are a 1-D torch.float32 tensor"),
        ([(torch.ones(2, 2, dtype=torch.long), 1)], TypeError, r"batch\[0\] are a 2-D torch.int64 tensor"),
        ([([1, 2], 1)], TypeError, r"tokens of batch\[0\] are list; expected a 1-D integer tensor"),
        ([(torch.tensor([1]), torch.tensor([1, 0]))], ValueError, r"label of batch\[0\] has shape \(2,\)"),
        ([(torch.tensor([1]), "pos")], TypeError, r"label of batch\[0\] is str; expected a number"),
        ([torch.tensor([1])], TypeError, r"batch\[0\] is Tensor; expected a \(tokens, label\) pair"),
    ],
)
def test_pad_collate_refuses_bad_samples_naming_them(batch, error, message):
    with pytest.raises(error, match=message):
        pad_collate(batch)


# ------------------------------------------------------------------------------------------------ bad arguments
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_train": 0}, r"SyntheticCIFAR10DataModule\(num_train=0\)` must be an int >= 1"),
        ({"image_size": 2}, r"SyntheticCIFAR10DataModule\(image_size=2\)` must be an int >= 4"),
        ({"num_classes": 1}, r"\(num_classes=1\)` must be an int >= 2"),
        ({"batch_size": 1.5}, r"\(batch_size=1.5\)` must be an int >= 1"),
        ({"seed": -1}, r"\(seed=-1\)` must be an int >= 0"),
        ({"noise": -0.1}, r"\(noise=-0.1\)` must be a finite number >= 0"),
        ({"noise": float("inf")}, r"\(noise=inf\)` must be a finite number >= 0"),
        ({"num_workers": -1}, r"\(num_workers=-1\)` must be an int >= 0"),
    ],
)
def test_cifar_module_refuses_bad_arguments_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticCIFAR10DataModule(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 4}, r"SyntheticIMDBDataModule\(vocab_size=4\)` must be an int >= 5"),
        ({"min_len": 0}, r"\(min_len=0\)` must be an int >= 1"),
        ({"min_len": 10, "max_len": 5}, r"\(min_len=10, max_len=5\)`: max_len must be >= min_len"),
        ({"num_val": True}, r"\(num_val=True\)` must be an int >= 1"),
    ],
)
def test_imdb_module_refuses_bad_arguments_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticIMDBDataModule(**kwargs)


# ------------------------------------------------------------------------------------------------ NumPy numbers
# NumPy numbers are accepted and kept as Python ones: the DataLoader refuses a NumPy batch_size, and hyperparameters
# holding NumPy scalars make checkpoints that torch.load(weights_only=True) refuses.
@pytest.mark.parametrize(
    ("make", "numpy_kwargs"),
    [
        (cifar, {"num_train": np.int64(40), "batch_size": np.int64(8), "seed": np.int32(0), "noise": np.float32(0.25)}),
        (
            imdb,
            {
                "vocab_size": np.int64(60),
                "max_len": np.int64(12),
                "batch_size": np.int64(8),
                "num_workers": np.int64(0),
            },
        ),
    ],
    ids=["cifar", "imdb"],
)
def test_numpy_numbers_give_the_same_data_as_python_numbers_and_are_kept_as_python_numbers(make, numpy_kwargs):
    plain = make(**{key: value.item() for key, value in numpy_kwargs.items()})
    numpy = make(**numpy_kwargs)
    assert dict(numpy.hparams) == dict(plain.hparams)
    assert all(type(numpy.hparams[key]) is type(plain.hparams[key]) for key in plain.hparams)
    for numpy_batch, plain_batch in zip(first_batches(numpy), first_batches(plain), strict=True):
        torch.testing.assert_close(numpy_batch, plain_batch)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"noise": True}, r"SyntheticCIFAR10DataModule\(noise=True\)` must be a finite number >= 0"),
        ({"noise": "0.3"}, r"SyntheticCIFAR10DataModule\(noise='0.3'\)` must be a finite number >= 0"),
        ({"image_size": "8"}, r"SyntheticCIFAR10DataModule\(image_size='8'\)` must be an int >= 4"),
        ({"batch_size": True}, r"SyntheticCIFAR10DataModule\(batch_size=True\)` must be an int >= 1"),
    ],
)
def test_a_bool_or_a_string_for_a_number_is_refused_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cifar(**kwargs)


def test_pad_collate_takes_numpy_labels_and_pad_index_as_python_ones():
    samples = [(torch.tensor([4, 5]), 1), (torch.tensor([6, 7, 8]), 0)]
    numpy_samples = [(tokens, np.int64(label)) for tokens, label in samples]
    torch.testing.assert_close(pad_collate(numpy_samples, pad_index=np.int64(2)), pad_collate(samples, pad_index=2))


@pytest.mark.parametrize("pad_index", [True, "0", 1.0])
def test_pad_collate_refuses_a_pad_index_that_is_not_an_int_naming_it(pad_index):
    with pytest.raises(TypeError, match=rf"pad_collate\(pad_index={pad_index!r}\) must be an int"):
        pad_collate([(torch.tensor([1]), 1)], pad_index=pad_index)


def test_the_smallest_vocabulary_still_has_a_neutral_word():
    reviews = synthetic_reviews(20, vocab_size=5, min_len=5, max_len=5)
    assert {token for tokens in reviews.sequences for token in tokens.tolist()} <= {1, 2, 3, 4}


def test_synthetic_images_are_normalised_with_the_real_cifar_modules_statistics():
    # Both modules export the one definition in data/_cifar_stats.py (apart from cifar.py: no torchvision import).
    from lightning_amp_plus.data import cifar

    assert (CIFAR10_MEAN, CIFAR10_STD) == (cifar.CIFAR10_MEAN, cifar.CIFAR10_STD)
