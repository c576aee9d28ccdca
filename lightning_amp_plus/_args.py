"""Argument checks shared by the shipped models and data modules: one wording for one rule."""

from __future__ import annotations

__all__ = ["check_int"]


def check_int(owner: str, name: str, value: object, minimum: int) -> None:
    """Raise unless ``value`` is an int (not a bool) of at least ``minimum``; ``owner`` names the class in the message.

    Example:
        >>> check_int("CifarCNN", "width", 0, minimum=1)
        Traceback (most recent call last):
        ...
        ValueError: `CifarCNN(width=0)` must be an int >= 1.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{owner}({name}={value!r})` must be an int >= {minimum}.")
