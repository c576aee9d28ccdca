"""Architecture rules that keep the numerics usable without Lightning."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_amp_plus"
NUMERICS = [
    "scaler.py",
    "_grads.py",
    "_policy.py",
    "_device_policy.py",
    "_outcome.py",
    "_scaler_args.py",
    "_schedulers.py",
    "_master.py",
    "_float32.py",
]
ALL_MODULES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", NUMERICS)
def test_numerics_modules_import_no_lightning(module: str) -> None:
    offending = {
        name for name in imported_modules(PACKAGE / module) if name.split(".")[0] in ("lightning", "pytorch_lightning")
    }
    assert not offending, f"{module} imports {offending}"


@pytest.mark.parametrize("module", ALL_MODULES)
def test_library_calls_none_of_torchs_private_amp_kernels(module: str) -> None:
    tree = ast.parse((PACKAGE / module).read_text())
    calls = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr.startswith("_amp_")]
    assert not calls, f"{module} uses {calls}"


def test_the_scaler_works_in_a_process_where_lightning_cannot_be_imported(tmp_path: Path) -> None:
    # A module finder that refuses lightning proves the scaler's import chain never needs it.
    code = f"""
import importlib.abc, sys, types
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('lightning', 'pytorch_lightning'):
            raise ImportError('lightning refused: ' + name)
sys.meta_path.insert(0, Refuse())
# Load the numerics without running the package __init__ (which exposes the Lightning plugin).
pkg = types.ModuleType('lightning_amp_plus'); pkg.__path__ = [{str(PACKAGE)!r}]
sys.modules['lightning_amp_plus'] = pkg
import torch
from lightning_amp_plus.scaler import DynamicLossScaler
w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.5)
s = DynamicLossScaler(init_scale=4.0)
s.scale(w.sum()).backward(); s.step(opt); s.update()
print(w.tolist())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0.5, 0.5]"
