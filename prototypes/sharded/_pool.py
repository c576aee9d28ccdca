"""Make the tests' launch machinery (``tests/launch.py``) and helpers importable from the prototype scripts."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
