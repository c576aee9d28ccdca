"""Text to token ids: a simple regex tokeniser and a frequency-ranked vocabulary (``<pad>`` = 0, ``<unk>`` = 1)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["PAD", "PAD_INDEX", "UNK", "UNK_INDEX", "Vocabulary", "tokenize"]

PAD, UNK = "<pad>", "<unk>"
PAD_INDEX, UNK_INDEX = 0, 1

# IMDB reviews carry HTML line breaks written as "<br />" (sometimes "<br/>" or "<br>"): they are layout, not words.
_LINE_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)
# A word (letters/digits, with an inner apostrophe kept: "don't", "it's") or a single punctuation mark.
_TOKEN = re.compile(r"\w+(?:'\w+)*|[^\w\s]")


def tokenize(text: str) -> list[str]:
    """Split ``text`` into lowercase words and punctuation marks, dropping ``<br />`` line breaks.

    Examples:
        >>> tokenize("Great film!<br /><br />I didn't expect THAT.")
        ['great', 'film', '!', 'i', "didn't", 'expect', 'that', '.']
    """
    return _TOKEN.findall(_LINE_BREAK.sub(" ", text.lower()))


class Vocabulary:
    """Token <-> id mapping: ``<pad>`` = 0, ``<unk>`` = 1, then the most frequent tokens (ties broken alphabetically).

    Args:
        tokens: the tokens, ids 0, 1, ... in order; the first two must be ``<pad>`` and ``<unk>``.

    Examples:
        >>> vocab = Vocabulary.build([["a", "b", "a"], ["a", "c", "c"]], max_size=4, min_freq=2)
        >>> vocab.tokens
        ['<pad>', '<unk>', 'a', 'c']
        >>> vocab.encode(["c", "a", "b"])
        [3, 2, 1]
    """

    def __init__(self, tokens: Sequence[str]) -> None:
        if list(tokens[:2]) != [PAD, UNK]:
            raise ValueError(
                f"`Vocabulary(tokens=[{', '.join(map(repr, tokens[:2]))}, ...])`: must start {PAD!r}, {UNK!r}."
            )
        self.tokens = list(tokens)
        self._ids = {token: index for index, token in enumerate(self.tokens)}

    @classmethod
    def build(cls, documents: Iterable[Sequence[str]], max_size: int, min_freq: int) -> Vocabulary:
        """The ``max_size`` entries (specials included) of tokens seen at least ``min_freq`` times, most frequent first.

        Examples:
            >>> len(Vocabulary.build([["x", "y", "x"]], max_size=10, min_freq=1))
            4
        """
        counts: Counter[str] = Counter()
        for document in documents:
            counts.update(document)
        return cls.from_counts(counts, max_size, min_freq)

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], max_size: int, min_freq: int) -> Vocabulary:
        """Like :meth:`build`, from token counts already made.

        Examples:
            >>> Vocabulary.from_counts({"b": 2, "a": 2, "c": 1}, max_size=3, min_freq=1).tokens
            ['<pad>', '<unk>', 'a']
        """
        if max_size < 3:
            raise ValueError(f"`Vocabulary(max_size={max_size!r})` is too small: it needs >= 3 (<pad>, <unk>, a word).")
        if min_freq < 1:
            raise ValueError(f"`Vocabulary(min_freq={min_freq!r})` is invalid: it must be >= 1.")
        # The tokeniser never yields the specials ("<" and ">" are separate marks), but a caller's counts might.
        kept = [(token, n) for token, n in counts.items() if n >= min_freq and token not in (PAD, UNK)]
        # Sorting by (-count, token) makes the vocabulary independent of the order the documents were read in.
        kept.sort(key=lambda item: (-item[1], item[0]))
        return cls([PAD, UNK, *(token for token, _ in kept[: max_size - 2])])

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, tokens: Iterable[str]) -> list[int]:
        """The ids of ``tokens``; tokens not in the vocabulary become ``<unk>`` (1).

        Examples:
            >>> Vocabulary(["<pad>", "<unk>", "hi"]).encode(["hi", "there"])
            [2, 1]
        """
        ids = self._ids
        return [ids.get(token, UNK_INDEX) for token in tokens]
