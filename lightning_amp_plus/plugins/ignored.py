"""The options a precision would ignore: the rules every surface refuses by, worded for each.

The plugins (``plugins/options.py``), ``AmpSettings`` and ``amp-plus train`` (``cli/_settings.py``) refuse an option
given for a precision that would ignore it by the same rules, here; each words the refusal its own way
(:class:`Spelling`: a plugin's arguments or the command's flags). Imports nothing: the command line checks its flags
with it before torch is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Spelling", "ignored_problem"]

_FP8 = "fp8-mixed"


class Spelling:
    """How a message names an option and a precision: as a plugin's arguments, or as ``amp-plus`` flags.

    Examples:
        >>> Spelling().setting("fp8_recipe"), Spelling(flags=True).setting("fp8_recipe")
        ('fp8_recipe', '--fp8-recipe')
        >>> Spelling(flags=True, auto="32-true").precision("32-true")
        '--precision auto (32-true here)'
    """

    def __init__(self, flags: bool = False, auto: str | None = None) -> None:
        self.flags = flags
        self.auto = auto  # what --precision auto resolved to, when it did

    def setting(self, name: str) -> str:
        """An option's name: ``fp8_recipe``, or the flag ``--fp8-recipe``."""
        return "--" + name.replace("_", "-") if self.flags else name

    def precision(self, value: str) -> str:
        """A precision asked for: ``precision='bf16-mixed'``, or ``--precision bf16-mixed``."""
        if not self.flags:
            return f"precision={value!r}"
        return f"--precision auto ({value} here)" if self.auto is not None else f"--precision {value}"

    def plain(self) -> Spelling:
        """The same spelling for a precision to use instead (never "auto")."""
        return Spelling(self.flags)


def ignored_problem(precision: str, given: Sequence[str], spell: Spelling) -> str | None:
    """Why an option ``given`` would be ignored at ``precision``, worded by ``spell``; ``None`` when none would be.

    The rules every surface refuses by (the plugins, ``AmpSettings``, ``amp-plus train``): the fp8_* options outside
    ``fp8-mixed``, a compensation outside ``bf16-true``, FP32 master weights where the weights are not half.

    Examples:
        >>> print(ignored_problem("bf16-mixed", ["fp8_recipe"], Spelling(flags=True)))
        --fp8-recipe configures FP8 training, which --precision bf16-mixed does not do. Use --precision fp8-mixed, or drop --fp8-recipe.
    """  # noqa: E501
    fp8 = [name for name in given if name.startswith("fp8_")]
    other = spell.plain()
    if fp8 and precision != _FP8:
        names = " and ".join(spell.setting(name) for name in fp8)
        verb = "configures" if len(fp8) == 1 else "configure"
        return (
            f"{names} {verb} FP8 training, which {spell.precision(precision)} does not do. Use "
            f"{other.precision(_FP8)}, or drop {names}."
        )
    if "compensation" in given and precision != "bf16-true":
        name = spell.setting("compensation")
        return (
            f"{name} compensates bf16 weights, which {spell.precision(precision)} does not hold (its weights are "
            f"FP32). Use {other.precision('bf16-true')}, or drop {name}."
        )
    for option in ("master_weights", "keep_fp32"):
        if option in given and precision in ("32-true", "bf16-true"):
            name = spell.setting(option)
            kept = "bf16 (compensated: that is its memory saving)" if precision == "bf16-true" else "FP32"
            return (
                f"{name} is for half-precision compute over FP32 weights; {spell.precision(precision)} keeps the "
                f"weights in {kept}. Use {other.precision('bf16-mixed')} with {name}, or drop {name}."
            )
    return None
