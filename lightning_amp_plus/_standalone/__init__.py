"""The package's Lightning-facing modules over ``pytorch_lightning`` and ``lightning_fabric``, from the same source.

``pytorch_lightning`` and ``lightning_fabric`` are Lightning's standalone packages: the code of ``lightning.pytorch``
and ``lightning.fabric`` published under other names, each with its own copy of every class (Lightning builds one from
the other by renaming the imports). A ``pytorch_lightning.Trainer`` takes only plugins and callbacks built on *its*
classes. So the modules of ``plugins/``, ``monitor/``, ``models/`` and ``data/`` are loaded here a second time, as
``lightning_amp_plus._standalone.<module>``, from their own files with ``lightning.pytorch`` read as
``pytorch_lightning`` and ``lightning.fabric`` as ``lightning_fabric``; the numerics (``step/``, ``weights/``,
``diagnostics/``), which import no Lightning, are shared. Nothing is generated on disk: tracebacks and coverage point
at the package's own files.

Importing this package installs the finder that loads those modules, so a process that unpickles one of their objects
(``ddp_spawn``'s workers) finds them too. Users import :mod:`lightning_amp_plus.pytorch_lightning` (the Trainer's
names) and :mod:`lightning_amp_plus.lightning_fabric` (Fabric's).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["LAYERS", "public_name", "standalone_source"]

_PACKAGE = Path(__file__).resolve().parent.parent
LAYERS = ("plugins", "monitor", "models", "data")
"""The package's folders whose modules import Lightning (``tests/package/test_layout.py`` checks that no other does)."""
_RENAMES = (
    (re.compile(r"\blightning\.pytorch\b"), "pytorch_lightning"),
    (re.compile(r"\blightning\.fabric\b"), "lightning_fabric"),
    (re.compile(rf"\blightning_amp_plus\.({'|'.join(LAYERS)})\b"), rf"{__name__}.\1"),
)


def standalone_source(source: str) -> str:
    r"""``source`` with Lightning's namespaces and this package's Lightning-facing modules renamed.

    Examples:
        >>> standalone_source("import lightning.pytorch as pl\\nfrom lightning_amp_plus.plugins import fp8")
        'import pytorch_lightning as pl\\nfrom lightning_amp_plus._standalone.plugins import fp8'
    """
    for pattern, replacement in _RENAMES:
        source = pattern.sub(replacement, source)
    return source


def public_name(module: str, name: str, homes: Mapping[str, tuple[str, str]]) -> Any:
    """``name`` of the public module ``module`` (``lightning_amp_plus.pytorch_lightning``, ``.lightning_fabric``).

    Loaded on first use from this package's load of its home (``homes[name]``: the module under ``_standalone`` and the
    name there), then kept in ``module``, so later lookups do not come here: the modules' ``__getattr__``.

    Raises:
        AttributeError: ``module`` has no such name.
    """
    if name not in homes:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    home, attribute = homes[name]
    value = getattr(importlib.import_module(f"{__name__}.{home}"), attribute)
    setattr(sys.modules[module], name, value)
    return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lightning_amp_plus._standalone.<folder>.<module>`` at ``lightning_amp_plus/<folder>/<module>.py``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        parts = fullname[len(__name__) + 1 :].split(".")
        if parts[0] not in LAYERS:
            return None
        base = _PACKAGE.joinpath(*parts)
        if (base / "__init__.py").is_file():
            return importlib.util.spec_from_file_location(
                fullname, base / "__init__.py", loader=self, submodule_search_locations=[]
            )
        if base.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(fullname, base.with_suffix(".py"), loader=self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        origin = module.__spec__.origin if module.__spec__ is not None else None
        assert origin is not None
        code = compile(standalone_source(Path(origin).read_text(encoding="utf-8")), origin, "exec", dont_inherit=True)
        exec(code, module.__dict__)


if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
