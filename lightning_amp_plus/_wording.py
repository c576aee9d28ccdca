"""How the package words numbers and arguments for people: one wording, for the command line and the Python API.

Pure Python. ``shown`` spells an argument as the user wrote it: ``--report x.png`` on the command line,
``report_path='x.png'`` in Python.
"""

from __future__ import annotations

import os

__all__ = ["number", "plural", "shown", "spans"]


def plural(count: int, word: str, many: str | None = None) -> str:
    """``count`` with ``word`` in the number it needs.

    Examples:
        >>> plural(1, "step"), plural(0, "step"), plural(2, "non-finite event"), plural(3, "process", "processes")
        ('1 step', '0 steps', '2 non-finite events', '3 processes')
    """
    return f"{count:,} {word if count == 1 else many or word + 's'}"


def spans(values: list[int], limit: int = 6) -> str:
    """Sorted integers written as runs (``0-3, 7 and 12``), at most ``limit`` runs, then how many more steps.

    Examples:
        >>> spans([0, 1, 2, 3, 7, 12])
        '0-3, 7 and 12'
        >>> spans([1, 3, 5, 7, 9], limit=2)
        '1, 3 and 3 more'
    """
    runs: list[tuple[int, int]] = []
    for value in sorted(set(values)):
        if runs and value == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], value)
        else:
            runs.append((value, value))
    parts = [f"{first}" if first == last else f"{first}-{last}" for first, last in runs[:limit]]
    hidden = sum(last - first + 1 for first, last in runs[limit:])
    if hidden:
        parts.append(f"{hidden} more")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def number(value: float) -> str:
    """``value`` as a person writes it: whole numbers in full (up to 2**53), others in ``%g`` form.

    Examples:
        >>> number(2.0**24), number(0.5), number(1e308)
        ('16777216', '0.5', '1e+308')
    """
    if value.is_integer() and abs(value) <= 2**53:
        return str(int(value))
    return f"{value:g}"


def shown(argument: str, value: object) -> str:
    """How a user wrote ``argument``: ``--report x.png`` on the command line, ``report_path='x.png'`` in Python.

    Examples:
        >>> from pathlib import Path
        >>> shown("--report", "x.png"), shown("report_path", Path("x.png"))
        ('--report x.png', "report_path='x.png'")
    """
    if argument.startswith("-"):
        return f"{argument} {value}"
    return f"{argument}={str(value) if isinstance(value, os.PathLike) else value!r}"
