"""The low-precision floating-point formats, from ``torch.finfo``: the numbers an overflow or underflow is judged by.

Shared by the autopsy (does a value exceed the format's largest?) and the headroom (how many bits below it, and what
the format flushes to zero at a loss scale). ``float16`` and ``bfloat16`` are the half dtypes of mixed precision;
the two FP8 formats are there so that a headroom reading also says how far a layer is from fitting FP8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = ["FORMATS", "HALF_DTYPES", "Format", "format_of", "headroom_bits"]


@dataclass(frozen=True)
class Format:
    """One floating-point format's range.

    Attributes:
        name: the dtype's name without ``torch.``, e.g. ``"float16"``.
        dtype: the torch dtype.
        max: the largest finite value (``finfo.max``).
        smallest_normal: the smallest positive normal value (``finfo.smallest_normal``).
        smallest_subnormal: the smallest positive value, ``finfo.eps * finfo.smallest_normal``; a magnitude at or
            below half of it rounds to zero.

    Examples:
        >>> fp16 = Format.of(torch.float16)
        >>> fp16.max, fp16.smallest_normal == 2.0**-14, fp16.smallest_subnormal == 2.0**-24
        (65504.0, True, True)
    """

    name: str
    dtype: torch.dtype
    max: float
    smallest_normal: float
    smallest_subnormal: float

    @classmethod
    def of(cls, dtype: torch.dtype) -> Format:
        """The range of a floating-point ``dtype``, from ``torch.finfo``."""
        info = torch.finfo(dtype)
        return cls(str(dtype).removeprefix("torch."), dtype, info.max, info.smallest_normal, info.eps * info.tiny)


FORMATS = MappingProxyType(
    {f.name: f for f in map(Format.of, (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2))}
)
"""The formats a headroom reading covers, by name: ``float16``, ``bfloat16``, ``float8_e4m3fn``, ``float8_e5m2``."""

HALF_DTYPES = (torch.float16, torch.bfloat16)
"""The half dtypes of mixed precision: the ``dtype`` the autopsy and the headroom take."""


def format_of(dtype: object, owner: str = "format_of", argument: str = "dtype") -> Format:
    """The :class:`Format` of a mixed-precision half dtype; ``ValueError`` naming ``owner(argument=...)`` otherwise.

    Examples:
        >>> format_of(torch.bfloat16).max == torch.finfo(torch.bfloat16).max
        True
        >>> format_of(torch.float32, owner="run_autopsy")
        Traceback (most recent call last):
        ...
        ValueError: `run_autopsy(dtype=torch.float32)` must be torch.float16 or torch.bfloat16: the half dtype of the mixed precision.
    """  # noqa: E501 (the doctest's expected line)
    if dtype not in HALF_DTYPES:
        raise ValueError(
            f"`{owner}({argument}={dtype!r})` must be torch.float16 or torch.bfloat16: the half dtype of the mixed "
            "precision."
        )
    return FORMATS[str(dtype).removeprefix("torch.")]


def headroom_bits(absmax: float) -> dict[str, float]:
    """How many powers of two lie between ``absmax`` and each format's largest value: ``log2(format max / absmax)``.

    Positive: the values fit with that many bits to spare; negative: they overflow the format by that many. ``inf``
    when ``absmax`` is 0 (nothing to overflow), ``-inf`` when it is inf, ``nan`` when it is nan.

    Examples:
        >>> bits = headroom_bits(1024.0)
        >>> round(bits["float16"], 3), round(bits["float8_e4m3fn"], 3)
        (5.999, -1.193)
    """
    if absmax == 0:
        return dict.fromkeys(FORMATS, math.inf)
    if math.isnan(absmax):
        return dict.fromkeys(FORMATS, math.nan)
    return {name: math.log2(f.max) - math.log2(absmax) for name, f in FORMATS.items()}
