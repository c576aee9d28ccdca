"""The installed Python, torch and Lightning, for the tests whose expectation depends on them.

CI runs the unit tests on the oldest and the newest versions ``pyproject.toml`` declares (``.ci/compat``). A test that
needs something newer than the oldest is marked with :func:`needs`, which skips it there and names what it needs and
the release that brought it; a test whose expectation differs by version asks :func:`at_least`.
"""

from __future__ import annotations

import sys

import lightning
import pytest
import torch
from packaging.version import Version

NAMES = {"python": "Python", "torch": "torch", "lightning": "Lightning"}
INSTALLED = {
    "python": Version(".".join(map(str, sys.version_info[:3]))),
    "torch": Version(Version(torch.__version__).base_version),  # 2.6.0+cu124 -> 2.6.0
    "lightning": Version(lightning.__version__),
}


def at_least(package: str, version: str) -> bool:
    """Whether the installed ``package`` (``"python"``, ``"torch"`` or ``"lightning"``) is ``version`` or newer."""
    return INSTALLED[package] >= Version(version)


def needs(package: str, version: str, what: str) -> pytest.MarkDecorator:
    """Skip unless ``package`` is ``version`` or newer; ``what`` is what the test needs from that release."""
    name = NAMES[package]
    return pytest.mark.skipif(
        not at_least(package, version),
        reason=f"{what} needs {name} >= {version} (installed: {name} {INSTALLED[package]})",
    )
