"""What an installed package carries: its license, its type marker, its URLs, a clean namespace, a lean main job."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import sys

import processes
import pytest
from processes import REPO, repo_env

import lightning_amp_plus

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_namespace_lists_only_the_public_names_and_dunder_attributes() -> None:
    names = dir(lightning_amp_plus)
    assert set(lightning_amp_plus.__all__) <= set(names) and "__version__" in names
    helpers = [name for name in names if not (name in lightning_amp_plus.__all__ or name.startswith("__"))]
    assert helpers == []  # not Any, TYPE_CHECKING, annotations, importlib, _HOMES
    _ = lightning_amp_plus.MixedPrecisionPlugin  # loading a name adds nothing else
    assert dir(lightning_amp_plus) == names


def test_every_public_name_has_a_home_to_load_from() -> None:
    homes = lightning_amp_plus._HOMES
    assert sorted(homes) == sorted(lightning_amp_plus.__all__)
    for name in homes:
        assert getattr(lightning_amp_plus, name).__name__ == name


def _distribution(requirement: str) -> str:
    """The normalised distribution name a requirement names: ``typing_extensions>=4.4`` -> ``typing-extensions``."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement).group()).lower()  # type: ignore[union-attr]


def test_every_third_party_package_the_code_imports_is_declared_as_a_dependency_or_an_extra() -> None:
    # `typing_extensions` (for `override`) and `lightning_utilities` were imported at load time but not declared: they
    # came only as torch's and Lightning's own dependencies, which may drop them.
    declared = {_distribution(dep) for dep in PYPROJECT["project"]["dependencies"]}
    extras = {_distribution(dep) for deps in PYPROJECT["project"]["optional-dependencies"].values() for dep in deps}
    owners = importlib.metadata.packages_distributions()
    at_load, lazily = set(), set()
    for path in (REPO / "lightning_amp_plus").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top in sys.stdlib_module_names or top == "lightning_amp_plus":
                    continue
                distribution = _distribution(owners.get(top, [top])[0])
                (at_load if node in tree.body else lazily).add(distribution)
    assert at_load - declared == set()  # what `import lightning_amp_plus...` needs
    assert lazily - declared - extras == set()  # what a feature needs on first use: an extra names it


def test_the_wheel_ships_the_pep_561_marker() -> None:
    assert (REPO / "lightning_amp_plus" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["lightning_amp_plus"]


def test_the_license_file_is_the_apache_2_text_the_metadata_names() -> None:
    text = (REPO / "LICENSE").read_text()
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 202  # the whole text, not a notice


def test_the_project_urls_point_home_docs_source_and_changelog() -> None:
    urls = PYPROJECT["project"]["urls"]
    assert {"Homepage", "Documentation", "Source", "Changelog"} <= set(urls)
    assert all(url.startswith("https://") for url in urls.values())


@pytest.mark.integration
def test_the_main_job_runs_without_the_optional_packages() -> None:
    # `pip install lightning-amp-plus` has none of the extras: `amp-plus train` must not need them.
    hidden = "matplotlib,jsonargparse,rich,tensorboard,hypothesis"
    code = (
        "import hide_packages\n"  # hides AMP_PLUS_HIDE's packages, metadata included, before anything imports them
        "from lightning_amp_plus.cli import main\n"
        "raise SystemExit(main(['train', 'cnn', '--max-steps', '2', '--num-train', '16', '--num-val', '8',\n"
        "                       '--batch-size', '8', '--width', '2', '--accelerator', 'cpu', '--threads', '1']))\n"
    )
    env = repo_env({"AMP_PLUS_HIDE": hidden})
    env["PYTHONPATH"] += os.pathsep + str(REPO / "tests")
    done = processes.run([sys.executable, "-c", code], timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MixedPrecisionMonitor: 2 optimizer steps" in done.stdout
