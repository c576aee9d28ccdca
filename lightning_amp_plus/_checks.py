"""The package's one set of argument checks: clear errors naming the argument (or state key), the value and the fix.

Used by the scaler (its arguments and the states it loads), the plugin, the monitor, the shipped models and data
modules, and the command line's checks (which is why torch is imported only where a tensor may be met). One rule each:
an int is any integral number but a bool (NumPy ints included), a real number is finite and not a bool. Numbers are
checked without ever raising a bare ``OverflowError`` (``float(10**400)`` does): a value too large for a float is
reported as out of range, with the argument or key it came from. The ``check_*`` functions of numbers return the value
as a Python int or float, the one to keep (a NumPy number stored in hyperparameters makes a checkpoint that
``torch.load(weights_only=True)`` refuses).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "COUNTER_MAX",
    "TRACKER_MAX",
    "check_bool",
    "check_int",
    "check_nonnegative",
    "check_real",
    "is_int",
    "real",
    "read_count",
    "read_number",
    "require",
    "show",
]

# Counters in a state above this are corrupt, not large: 2**62 optimizer steps would take longer than the universe.
COUNTER_MAX = 2**62
# Growth interval and hysteresis: their trackers are int32 on the device (GradScaler's update kernel's type).
TRACKER_MAX = 2**31 - 1


def show(value: object) -> str:
    """``repr(value)``, with a huge int written as ``~1.000e+400`` (its exact digits would fill the message).

    Examples:
        >>> show(10**400), show(2.5)
        ('~1.000e+400 (an int of 401 digits)', '2.5')
    """
    if is_int(value) and abs(int(value)) >= 10**20:  # type: ignore[call-overload]
        digits = str(abs(int(value)))  # type: ignore[call-overload]
        sign = "-" if int(value) < 0 else ""  # type: ignore[call-overload]
        return f"~{sign}{digits[0]}.{digits[1:4]}e+{len(digits) - 1} (an int of {len(digits)} digits)"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:40]}... ({len(text)} characters)"


def require(condition: bool, argument: str, value: object, rule: str, owner: str = "DynamicLossScaler") -> None:
    """Raise ``ValueError`` naming ``owner(argument=value)`` and the rule, unless ``condition``."""
    if not condition:
        raise ValueError(f"`{owner}({argument}={show(value)})` is invalid: {argument} {rule}.")


def is_int(value: object) -> bool:
    """An integral number that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def real(value: object) -> float | None:
    """``value`` as a finite float, or ``None`` if it is not a finite real number (bools are not numbers here).

    Examples:
        >>> real(3), real(10**400), real(float("inf")), real(True)
        (3.0, None, None, None)
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def read_number(state: Mapping[str, Any], key: str, kind: type[int] | type[float], default: float | None = None) -> Any:
    """Read ``state[key]`` as an int or a float (a one-element tensor is accepted, as some GradScaler states hold).

    Raises:
        ValueError: the key is missing (and has no default), or a float is beyond the float range.
        TypeError: the value is not a number of that kind.
    """
    if key not in state:
        if default is None:
            raise ValueError(f"The scaler state has no {key!r} key.")
        return kind(default)
    value = state[key]
    from torch import Tensor  # here, not at the top: the command line's checks import this module without torch

    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    valid = is_int(value) if kind is int else isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not valid:
        expected = "an int" if kind is int else "a number"
        raise TypeError(f"The scaler state holds {key}={show(value)} ({type(value).__name__}); expected {expected}.")
    if kind is int:
        return int(value)
    try:
        return float(value)
    except OverflowError:
        raise ValueError(
            f"The scaler state holds {key}={show(value)}, beyond the float range: the state is corrupt."
        ) from None


def read_count(state: Mapping[str, Any], key: str, default: int, limit: int = COUNTER_MAX) -> int:
    """Read a tracker or counter: an int in ``[0, limit]`` (a negative or absurd one would move the skip limit)."""
    value: int = read_number(state, key, int, default)
    if not 0 <= value <= limit:
        bound = "2**62" if limit == COUNTER_MAX else "2**31 - 1" if limit == TRACKER_MAX else str(limit)
        raise ValueError(
            f"The scaler state holds {key}={show(value)}; counters and trackers must be ints in [0, {bound}]: the "
            "state is corrupt. Remove it to start with a fresh scaler."
        )
    return value


def check_int(owner: str, name: str, value: object, minimum: int, hint: str = "") -> int:
    """``value`` as a Python int; raise unless it is an int (not a bool) of at least ``minimum``.

    ``owner`` names the class in the message, ``hint`` is appended to the rule (an example, or what the boundary value
    means). The Python int is what to keep: a NumPy int is refused by some of torch (``DataLoader(batch_size=...)``)
    and, saved in hyperparameters, makes a checkpoint that ``torch.load(weights_only=True)`` cannot read.

    Examples:
        >>> import numpy as np
        >>> check_int("CifarCNN", "width", np.int64(8), minimum=1)
        8
        >>> check_int("CifarCNN", "width", 0, minimum=1)
        Traceback (most recent call last):
        ...
        ValueError: `CifarCNN(width=0)` must be an int >= 1.
        >>> check_int("MixedPrecisionMonitor", "check_interval", True, minimum=1, hint=", e.g. 1 (every step)")
        Traceback (most recent call last):
        ...
        ValueError: `MixedPrecisionMonitor(check_interval=True)` must be an int >= 1, e.g. 1 (every step).
    """
    number: int | None = int(value) if is_int(value) else None  # type: ignore[call-overload]
    if number is None or number < minimum:
        raise ValueError(f"`{owner}({name}={show(value)})` must be an int >= {minimum}{hint}.")
    return number


def check_real(owner: str, name: str, value: object, rule: str, within: Callable[[float], bool] | None = None) -> float:
    """``value`` as a Python float; raise ``ValueError`` unless it is a finite real number for which ``within`` holds.

    A real number as :func:`real` reads it (NumPy's included, never a bool); ``rule`` completes "must be ...": the
    range in words, with an example or what the boundary value means.

    Examples:
        >>> import numpy as np
        >>> check_real("CifarCNN", "momentum", np.float32(0.5), "in [0, 1), e.g. 0.9", lambda x: 0 <= x < 1)
        0.5
        >>> check_real("CifarCNN", "momentum", 1.0, "in [0, 1), e.g. 0.9", lambda x: 0 <= x < 1)
        Traceback (most recent call last):
        ...
        ValueError: `CifarCNN(momentum=1.0)` must be in [0, 1), e.g. 0.9.
    """
    number = real(value)
    if number is None or (within is not None and not within(number)):
        raise ValueError(f"`{owner}({name}={show(value)})` must be {rule}.")
    return number


def check_nonnegative(owner: str, name: str, value: object, hint: str = "") -> float:
    """``value`` as a Python float; raise ``ValueError`` unless it is a finite real number >= 0.

    ``hint`` is appended to the rule.

    Examples:
        >>> import numpy as np
        >>> check_nonnegative("SyntheticCIFAR10DataModule", "noise", np.int64(0))
        0.0
        >>> check_nonnegative("SyntheticCIFAR10DataModule", "noise", float("inf"), hint=", e.g. 0.3")
        Traceback (most recent call last):
        ...
        ValueError: `SyntheticCIFAR10DataModule(noise=inf)` must be a finite number >= 0, e.g. 0.3.
    """
    return check_real(owner, name, value, f"a finite number >= 0{hint}", lambda number: number >= 0)


def check_bool(owner: str, name: str, value: object) -> None:
    """Raise ``TypeError`` unless ``value`` is ``True`` or ``False`` (a string such as ``"no"`` would read as true).

    Examples:
        >>> check_bool("MixedPrecisionPlugin", "master_weights", "false")
        Traceback (most recent call last):
        ...
        TypeError: `MixedPrecisionPlugin(master_weights='false')` must be True or False, not a str.
        >>> check_bool("MixedPrecisionPlugin", "master_weights", 1)
        Traceback (most recent call last):
        ...
        TypeError: `MixedPrecisionPlugin(master_weights=1)` must be True or False, not an int.
    """
    if not isinstance(value, bool):
        kind = type(value).__name__
        article = "an" if kind[:1].lower() in "aeiou" else "a"
        raise TypeError(f"`{owner}({name}={show(value)})` must be True or False, not {article} {kind}.")
