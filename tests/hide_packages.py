"""Make installed packages look absent, to test what a user without them gets (a pytest plugin, or called directly).

``import rich`` fails as for a package that is not installed, and so do the metadata look-ups that Lightning and
torchmetrics make before importing an optional package (``RequirementCache("rich>=10.2.2")`` reads
``importlib.metadata.version``; setting ``sys.modules["rich"] = None`` alone would make them import it and fail).

As a plugin: ``AMP_PLUS_HIDE=rich python -m pytest -p tests.hide_packages ...`` (``PYTHONPATH`` holding the
repository) hides the comma-separated names for the whole run, before anything imports them.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from types import ModuleType
from typing import Any

ENV = "AMP_PLUS_HIDE"


class _Blind(importlib.abc.MetaPathFinder):
    """A finder that finds what ``finder`` finds, except the hidden packages: for them it finds nothing, as when
    nothing is installed (``importlib.util.find_spec`` answers ``None``, ``import`` raises ``ModuleNotFoundError``,
    ``importlib.metadata`` finds no distribution)."""

    def __init__(self, finder: Any, names: frozenset[str]) -> None:
        self.finder, self.names = finder, names

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname.split(".")[0] in self.names or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(fullname, path, target)

    def find_distributions(self, context: Any = None) -> Iterator[Any]:
        if not hasattr(self.finder, "find_distributions"):
            return iter(())
        context = context or importlib.metadata.DistributionFinder.Context()
        if context.name is not None and _normal(context.name) in self.names:
            return iter(())
        found = self.finder.find_distributions(context)
        return (dist for dist in found if _normal(dist.metadata["Name"] or "") not in self.names)

    def invalidate_caches(self) -> None:
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()


def _normal(name: str) -> str:
    return name.lower().replace("-", "_")


def hide(names: Iterable[str]) -> None:
    """Make the top-level packages ``names`` unimportable and their distributions unknown from now on."""
    hidden = frozenset(_normal(name) for name in names if name)
    if not hidden:
        return
    for loaded in [m for m in sys.modules if m.split(".")[0] in hidden]:
        del sys.modules[loaded]
    sys.meta_path[:] = [_Blind(finder, hidden) for finder in sys.meta_path]


hide(os.environ.get(ENV, "").split(","))
