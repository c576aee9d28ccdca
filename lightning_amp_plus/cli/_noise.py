"""Warnings and third-party log lines that nobody running the commands and examples can act on, silenced there only.

Pure Python. Never installed at import: :func:`without_lightning_noise` is a context manager that the ``amp-plus``
command and the example scripts enter around their own work, so that a user's program that imports the package keeps
every warning filter it had (a test checks that importing any module of the package changes none), and every logger.

Examples:
    >>> import warnings
    >>> with without_lightning_noise(), warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("default")  # a later filter wins: the noise passes here
    ...     warnings.warn("Precision bf16-mixed is not supported by the model summary.")
    >>> len(caught)
    1
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LIGHTNING_NOISE", "LOG_NOISE", "without_lightning_noise"]

LIGHTNING_NOISE: tuple[tuple[str, str], ...] = (
    # Lightning's model summary sizes this package's plugins' weights at 32 bits: they are FP32 (the masters).
    (r".*is not supported by the model summary.*", "the model summary and our plugins"),
    # Lightning 2.6.6 calls a pytree API that torch 2.14 deprecates.
    (r".*isinstance\(treespec, LeafSpec\).*", "Lightning 2.6.6 on torch 2.14"),
    # Lightning 2.6.6's LightningCLI calls jsonargparse APIs that jsonargparse 4.49+ deprecates.
    (r"(?s).*was deprecated in v4\.\d+\.\d+ and will be removed in v5.*", "LightningCLI on jsonargparse 4.49+"),
    (r"(?s).*only one JsonargparseDeprecationWarning per type is shown.*", "LightningCLI on jsonargparse 4.49+"),
)
"""The warnings silenced (a message pattern, and whose the warning is): none of them is about the user's code."""

LOG_NOISE: tuple[tuple[str, str, str], ...] = (
    # Importing torchao 0.18 (fp8-mixed) registers an Enum with a pytree API that torch 2.14 deprecates for Enums; torch
    # logs it as a line of its own ("W1206 07:46:51 ... _pytree.py:630] ..."), past the command's own wording.
    ("torch.utils._pytree", r".*register_constant\(\) on Enum subclasses is deprecated", "torchao 0.18 on torch 2.14"),
)
"""The log records silenced (a logger, a message pattern, and whose the line is): torch's, about another library."""


class _Drop(logging.Filter):
    """Drops the records whose message matches ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


@contextmanager
def without_lightning_noise() -> Iterator[None]:
    """Silence :data:`LIGHTNING_NOISE` and :data:`LOG_NOISE` while inside; filters and loggers are restored after."""
    dropped = [(logging.getLogger(name), _Drop(pattern)) for name, pattern, _ in LOG_NOISE]
    for logger, drop in dropped:
        logger.addFilter(drop)
    try:
        with warnings.catch_warnings():
            for pattern, _ in LIGHTNING_NOISE:
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        for logger, drop in dropped:
            logger.removeFilter(drop)
