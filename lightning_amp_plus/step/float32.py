"""float32 arithmetic on Python floats, for host-side numbers that must match torch's float32 tensors bit for bit."""

from __future__ import annotations

import math
import struct

__all__ = ["f32"]


def f32(value: float) -> float:
    """Round a Python float to the nearest float32 (inf beyond its range).

    A float64 holds the exact sum, product or quotient of two float32 values before rounding, so ``f32(a * b)`` for
    float32 ``a`` and ``b`` equals torch's float32 ``a * b``.

    Examples:
        >>> f32(0.1)
        0.10000000149011612
    """
    try:
        rounded: float = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's range: float32 arithmetic would give inf
        return math.copysign(math.inf, value)
    return rounded
