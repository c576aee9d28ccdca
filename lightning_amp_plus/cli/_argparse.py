"""The command line's parser and console wording: errors first, in one paragraph, with "did you mean"; plain warnings.

Pure Python (no torch, no Lightning): a mistyped flag is answered at once.

* :class:`Parser`: argparse's parser, whose errors print as ``amp-plus train: error: ...`` on one paragraph (exit code
  2), without the usage block argparse prints first, and suggest the closest flag, subcommand or choice.
* :func:`plain_warnings`: Python warnings printed as ``warning: ...`` sentences, without a source path and line.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

__all__ = ["ALIASES", "Parser", "did_you_mean", "plain_warnings"]

ALIASES = {
    "fp16": "16-mixed",
    "float16": "16-mixed",
    "half": "16-mixed",
    "16": "16-mixed",
    "amp": "16-mixed",
    "bf16": "bf16-mixed",
    "bfloat16": "bf16-mixed",
    "fp32": "32-true",
    "float32": "32-true",
    "float": "32-true",
    "32": "32-true",
    "full": "32-true",
    "fp8": "fp8-mixed",
    "float8": "fp8-mixed",
    "gpu": "cuda",
}
"""Common names for a choice under another spelling (PyTorch's dtype names, other tools' precision names)."""


def did_you_mean(value: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The choice ``value`` most likely meant: an alias, the same word in other case, or the closest spelling.

    Examples:
        >>> did_you_mean("fp16", ["auto", "32-true", "16-mixed", "bf16-mixed"])
        '16-mixed'
        >>> did_you_mean("cnns", ["cnn", "lstm"]), did_you_mean("--precison", ["--precision", "--seed"])
        ('cnn', '--precision')
        >>> did_you_mean("ours-fp16", ["ours-16-mixed", "ours-bf16-mixed"])
        'ours-16-mixed'
        >>> did_you_mean("fp8", ["32-true", "16-mixed", "bf16-mixed"]) is None
        True
    """
    options = [str(choice) for choice in choices]
    lowered = value.lower()
    # Aliases whole or as a part: "fp16" -> "16-mixed", "ours-fp16" -> "ours-16-mixed".
    for spelling in (ALIASES.get(lowered, lowered), "-".join(ALIASES.get(part, part) for part in lowered.split("-"))):
        same = [option for option in options if option.lower() == spelling]
        if same:
            return same[0]
    close = difflib.get_close_matches(lowered, options, n=1, cutoff=cutoff)
    return close[0] if close else None


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors say what is wrong first, on one paragraph, and suggest a near miss.

    argparse prints the whole usage (some twenty lines for ``amp-plus train``) before the one line that matters;
    here that line comes alone, with "did you mean" when a flag, subcommand or choice is a near miss.

    Examples:
        >>> parser = Parser(prog="amp-plus")
        >>> _ = parser.add_argument("--precision", choices=["32-true", "16-mixed"])
        >>> parser.parse_args(["--precision", "fp16"])  # doctest: +SKIP
        amp-plus: error: argument --precision: invalid choice: 'fp16'; did you mean '16-mixed'? (choose from ...)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: dict[str, Parser] = {}
        """The subcommands' parsers, by name (filled by whoever adds them)."""

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one paragraph on stderr, without argparse's usage block, and exit with code 2."""
        print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own check, with a suggestion: "invalid choice: 'fp16'; did you mean '16-mixed'? (choose from...)"
        if action.choices is None or value in action.choices:
            return
        choices = [str(choice) for choice in action.choices]
        guess = did_you_mean(str(value), choices)
        hint = "" if guess is None else f"; did you mean {guess!r}?"
        raise argparse.ArgumentError(
            action, f"invalid choice: {value!r}{hint} (choose from {', '.join(map(repr, choices))})"
        )

    def parse_command(self, argv: Sequence[str]) -> argparse.Namespace:
        """``parse_args``, with arguments nobody knows refused by the subcommand they were given to, near misses named.

        Examples:
            >>> parser = Parser(prog="amp-plus")
            >>> _ = parser.add_argument("--seed", type=int)
            >>> parser.parse_command(["--seed", "3"]).seed
            3
        """
        tokens = list(argv)
        named = next((token for token in tokens if not token.startswith("-")), None)
        if named in self.commands:
            # Before parsing: an unknown flag's value would otherwise be taken for a positional ("--precison
            # 16-mixed" read as the model "16-mixed") and reported as that.
            command = self.commands[named]
            unknown = command.unknown_flags(tokens[tokens.index(named) + 1 :])
            if unknown:
                command.error(command.unrecognized(unknown))
        args, extras = self.parse_known_args(tokens)
        if extras:
            command = self.commands.get(getattr(args, "command", None) or "", self)
            command.error(command.unrecognized(extras))
        return args

    def unknown_flags(self, tokens: Sequence[str]) -> list[str]:
        """The ``--flags`` among ``tokens`` this parser does not know, neither whole nor as an unambiguous prefix.

        Examples:
            >>> parser = Parser(prog="amp-plus train")
            >>> _ = parser.add_argument("--precision")
            >>> parser.unknown_flags(["--prec", "16-mixed", "--precison", "--", "--anything"])
            ['--precison']
        """
        flags = [option for action in self._actions for option in action.option_strings if option.startswith("--")]
        unknown = []
        for token in tokens:
            if token == "--":
                break  # what follows is positional by request
            name = token.split("=", 1)[0]
            if token.startswith("--") and sum(flag.startswith(name) for flag in flags) != 1 and name not in flags:
                unknown.append(name)
        return unknown

    def unrecognized(self, extras: Sequence[str]) -> str:
        """The error for arguments this parser does not know: each named, the closest flag suggested.

        Examples:
            >>> parser = Parser(prog="amp-plus train")
            >>> _ = parser.add_argument("--precision")
            >>> print(parser.unrecognized(["--precison", "16-mixed"]))
            unrecognized argument --precison; did you mean --precision? `amp-plus train --help` lists the options.
        """
        flags = [option for action in self._actions for option in action.option_strings if option.startswith("--")]
        unknown = [extra for extra in extras if extra.startswith("-")] or list(extras)
        parts = []
        for extra in unknown:
            name = extra.split("=", 1)[0]
            guess = did_you_mean(name, flags, cutoff=0.7) if name.startswith("-") else None
            parts.append(name + ("" if guess is None else f"; did you mean {guess}?"))
        noun = "argument" if len(unknown) == 1 else "arguments"
        listed = ", ".join(parts)
        end = "" if listed.endswith("?") else "."
        return f"unrecognized {noun} {listed}{end} `{self.prog} --help` lists the options."


def _sentence(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    return f"warning: {message}\n"


@contextmanager
def plain_warnings() -> Iterator[None]:
    """Print warnings as ``warning: <message>`` sentences while inside: no source path, line number or category.

    Only the wording changes (``warnings.formatwarning``): which warnings show, and how often, is left to the filters;
    a test that records warnings still records them.
    """
    original = warnings.formatwarning
    warnings.formatwarning = _sentence
    try:
        yield
    finally:
        warnings.formatwarning = original
