"""The package leaves a user's warning filters alone: only its own commands and examples silence Lightning's noise."""

from __future__ import annotations

import sys

import processes

# Imported first: the filters these install at import are theirs, not the package's.
DEPENDENCIES = ("torch", "torchvision", "torchmetrics", "lightning", "lightning.pytorch", "lightning.fabric",
                "matplotlib", "matplotlib.figure", "jsonargparse")  # fmt: skip


def test_importing_any_module_of_the_package_changes_no_warning_filter() -> None:
    code = (
        "import importlib, pkgutil, warnings\n"
        f"for name in {DEPENDENCIES!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError:\n"
        "        pass\n"
        "before = list(warnings.filters)\n"
        "import lightning_amp_plus\n"
        "names = [m.name for m in pkgutil.walk_packages(lightning_amp_plus.__path__, 'lightning_amp_plus.')]\n"
        "for name in names:\n"
        "    if not name.endswith('__main__'):\n"
        "        importlib.import_module(name)\n"
        "print('MODULES', len(names))\n"
        "print('ADDED', [f for f in warnings.filters if f not in before])\n"
        "print('REMOVED', [f for f in before if f not in warnings.filters])\n"
    )
    done = processes.run([sys.executable, "-c", code], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ADDED []" in done.stdout and "REMOVED []" in done.stdout, done.stdout
    assert int(done.stdout.split("MODULES ")[1].split()[0]) > 50  # every module was imported, not only the package
