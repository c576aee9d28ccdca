"""``pad_collate``: batch variable-length token sequences for :class:`~lightning_amp_plus.models.ImdbLSTM`."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_amp_plus._checks import is_int, show

__all__ = ["pad_collate"]


def pad_collate(
    batch: Sequence[tuple[Tensor, int | float | Tensor]], pad_index: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Pad 1-D token tensors to the longest in the batch.

    An empty sequence is allowed: its length is 0 and its row is all ``pad_index`` (the batch is at least one token
    wide). :class:`~lightning_amp_plus.models.ImdbLSTM` reads such a row as one padding token.

    Args:
        batch: ``(tokens, label)`` pairs; ``tokens`` a 1-D integer tensor, ``label`` a number or a one-element tensor.
        pad_index: the token id written after each sequence's end.

    Returns:
        ``(tokens, lengths, labels)``: ``long[B, T]``, ``long[B]`` and ``float[B]``, with ``T`` the longest length.

    Examples:
        >>> tokens, lengths, labels = pad_collate([(torch.tensor([5, 6, 7]), 1), (torch.tensor([8]), 0)])
        >>> tokens.tolist(), lengths.tolist(), labels.tolist()
        ([[5, 6, 7], [8, 0, 0]], [3, 1], [1.0, 0.0])
    """
    if len(batch) == 0:
        raise ValueError("pad_collate(batch=[]): the batch is empty; a DataLoader never passes one, check the caller.")
    if not is_int(pad_index):
        raise TypeError(f"pad_collate(pad_index={show(pad_index)}) must be an int, the id of the padding token.")
    sequences = [_tokens(sample, index) for index, sample in enumerate(batch)]
    lengths = torch.tensor([len(sequence) for sequence in sequences], dtype=torch.long)
    # At least one column, so that a batch of empty sequences is still a valid [B, T] input.
    tokens = torch.full((len(sequences), max(1, int(lengths.max()))), pad_index, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        tokens[row, : len(sequence)] = sequence
    labels = torch.tensor([_label(label, index) for index, (_, label) in enumerate(batch)], dtype=torch.float32)
    return tokens, lengths, labels


def _tokens(sample: tuple[Tensor, int | float | Tensor], index: int) -> Tensor:
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise TypeError(f"pad_collate: batch[{index}] is {type(sample).__name__}; expected a (tokens, label) pair.")
    tokens = sample[0]
    if not isinstance(tokens, Tensor) or tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex():
        described = f"a {tokens.dim()}-D {tokens.dtype} tensor" if isinstance(tokens, Tensor) else type(tokens).__name__
        raise TypeError(
            f"pad_collate: the tokens of batch[{index}] are {described}; expected a 1-D integer tensor of token ids."
        )
    return tokens.long()


def _label(label: int | float | Tensor, index: int) -> float:
    if isinstance(label, Tensor):
        if label.numel() != 1:
            raise ValueError(
                f"pad_collate: the label of batch[{index}] has shape {tuple(label.shape)}; expected one number."
            )
        return float(label.item())
    # Any real number, NumPy's included (a dataset built from arrays yields np.int64 labels); a bool is 1.0 or 0.0.
    if isinstance(label, numbers.Real):
        return float(label)
    raise TypeError(f"pad_collate: the label of batch[{index}] is {type(label).__name__}; expected a number.")
