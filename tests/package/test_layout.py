"""Architecture rules: the folders say the layering, and the imports follow it.

Layers, bottom up: the pure-Python helpers (``_checks``, ``_wording``, ``_paths``); the torch-only numerics (``step/``,
``weights/``, ``diagnostics/``: a training loop without Lightning can use them); the Lightning layer (``plugins/``,
``monitor/``, ``models/``, ``data/``, the public ``fabric`` names); the applications (``cli/``). A module imports only
from its own layer or below, the step core imports neither the diagnostics nor the monitor, and the package's imports
have no cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import processes
import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_amp_plus"
ALL_MODULES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
TORCH_ONLY = ("step/", "weights/", "diagnostics/")
NUMERICS = [m for m in ALL_MODULES if m.startswith(TORCH_ONLY)]
LAYERS = {"_checks": 0, "_wording": 0, "_paths": 0, "step": 1, "weights": 1, "diagnostics": 1, "lightning": 2, "cli": 3}


def _is_module_file(dotted: str) -> bool:
    return (PACKAGE.parent / dotted.replace(".", "/")).with_suffix(".py").exists()


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from lightning_amp_plus.cli import doctor` imports the submodule, not (only) the package's names.
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            found = {
                name for name in submodules if (PACKAGE.parent / name.replace(".", "/")).with_suffix(".py").exists()
            }
            names.update(found or {node.module})
    return names


def module_name(relative: str) -> str:
    parts = ["lightning_amp_plus", *Path(relative).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(m): m for m in ALL_MODULES}


def layer(name: str) -> int | None:
    """The layer of a package module (``None`` for the package itself, whose ``__init__`` only names the API)."""
    parts = name.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return None
    return LAYERS.get(parts[1], LAYERS["lightning"])


def package_imports(name: str) -> set[str]:
    """The package modules ``name`` imports (the package's ``__init__`` imports its public names lazily, on first use:
    an edge to it is none)."""
    imported = imported_modules(PACKAGE / MODULES[name]) - {"lightning_amp_plus"}
    return {m for m in imported if m in MODULES and m != name}


def test_the_folders_hold_the_step_core_the_weights_the_diagnostics_and_the_front_ends() -> None:
    assert {"step/engine.py", "step/scaler.py", "step/policy.py", "step/grads.py"} <= set(ALL_MODULES)
    assert {"weights/master.py", "weights/compensated.py", "diagnostics/autopsy.py", "diagnostics/headroom.py"} <= set(
        ALL_MODULES
    )
    assert {"plugins/precision.py", "plugins/fsdp.py", "plugins/options.py", "monitor/callback.py"} <= set(ALL_MODULES)


@pytest.mark.parametrize("module", sorted(m for m in ALL_MODULES if m.startswith("step/")))
def test_the_step_core_imports_neither_the_diagnostics_nor_the_monitor(module: str) -> None:
    name = module_name(module)
    above = {m for m in package_imports(name) if m.split(".")[1] in ("diagnostics", "monitor", "plugins", "cli")}
    assert not above, f"{name} imports {above}"


@pytest.mark.parametrize("module", NUMERICS)
def test_numerics_modules_import_no_lightning(module: str) -> None:
    offending = {
        name
        for name in imported_modules(PACKAGE / module)
        if name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
    }
    assert not offending, f"{module} imports {offending}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_only_downward(name: str) -> None:
    own = layer(name)
    if own is None:
        return
    upward = {m for m in package_imports(name) if (layer(m) or 0) > own}
    assert not upward, f"{name} (layer {own}) imports {upward} from a layer above"


def test_the_package_imports_have_no_cycle() -> None:
    graph = {name: package_imports(name) for name in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                pytest.fail(f"import cycle: {' -> '.join([*path[path.index(child) :], child])}")
            if child not in state:
                visit(child, [*path, child])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


# The two private amp kernels the library calls, and where: GradScaler's own check-and-unscale, the engine's check
# (GradientCheck.unscale), and GradScaler's own update, the loss scale's (LossScale.advance), so that the check and the
# scale's moves are GradScaler's, numbers and cost alike.
ALLOWED_AMP_KERNELS = {
    "step/engine.py": ["_amp_foreach_non_finite_check_and_unscale_"],
    "step/policy.py": ["_amp_update_scale_"],
}


@pytest.mark.parametrize("module", ALL_MODULES)
def test_library_calls_no_private_amp_kernel_but_gradscalers_check_and_update(module: str) -> None:
    tree = ast.parse((PACKAGE / module).read_text())
    calls = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr.startswith("_amp_")]
    assert calls == ALLOWED_AMP_KERNELS.get(module, []), f"{module} uses {calls}"


@pytest.mark.integration
def test_the_scaler_works_in_a_process_where_lightning_cannot_be_imported(tmp_path: Path) -> None:
    # A module finder that refuses lightning proves the scaler's import chain never needs it.
    code = f"""
import importlib.abc, sys, types
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('lightning', 'pytorch_lightning', 'lightning_fabric'):
            raise ImportError('lightning refused: ' + name)
sys.meta_path.insert(0, Refuse())
# Load the numerics without running the package __init__ (which exposes the Lightning plugin).
pkg = types.ModuleType('lightning_amp_plus'); pkg.__path__ = [{str(PACKAGE)!r}]
sys.modules['lightning_amp_plus'] = pkg
import torch
from lightning_amp_plus.step.scaler import DynamicLossScaler
w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.5)
s = DynamicLossScaler(init_scale=4.0)
s.scale(w.sum()).backward(); s.step(opt); s.update()
print(w.tolist())
"""
    out = processes.run([sys.executable, "-c", code], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0.5, 0.5]"
