"""The versions pyproject.toml declares are the ones CI tests: its compatibility stage (``.ci/compat``) runs the oldest
of each and the highest Python, and the README says which."""

from __future__ import annotations

import re

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from processes import REPO

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
COMPAT = (REPO / ".ci" / "compat").read_text()
PACKAGES = ("torch", "torchvision", "lightning", "torchmetrics")


def combinations() -> dict[str, tuple[Version, dict[str, Version]]]:
    """Each combination of ``.ci/compat``: its name -> (its Python, its pinned packages)."""
    declared = re.search(r"PYTHON=\((.*)\)", COMPAT)
    assert declared is not None
    pythons = dict(re.findall(r"\[([\w-]+)\]=(3\.\d+)", declared.group(1)))
    pins = {
        name: {package: Version(version) for package, version in re.findall(r"([\w-]+)==([\d.]+)", words)}
        for name, words in re.findall(r'\[([\w-]+)\]="([^"]+)"', COMPAT)
    }
    assert pythons and pythons.keys() == pins.keys()
    return {name: (Version(pythons[name]), pins[name]) for name in pins}


def bounds(specifier: SpecifierSet) -> tuple[Version, Version]:
    """The ``>=`` and ``<`` versions of a range."""
    (lower,) = (Version(s.version) for s in specifier if s.operator == ">=")
    (upper,) = (Version(s.version) for s in specifier if s.operator == "<")
    return lower, upper


def next_minor(version: Version) -> Version:
    return Version(f"{version.major}.{version.minor + 1}")


def test_each_declared_range_runs_from_the_oldest_combination_to_just_past_the_newest() -> None:
    tested = combinations()
    declared = {Requirement(line).name: Requirement(line).specifier for line in PROJECT["dependencies"]}
    for package in PACKAGES:
        lower, upper = bounds(declared[package])
        versions = [pins[package] for _, pins in tested.values()]
        assert lower == min(versions), package  # the floor is the oldest tested
        assert upper == next_minor(max(versions)), package  # nothing past the newest tested minor release
    lower, upper = bounds(SpecifierSet(PROJECT["requires-python"]))
    pythons = [python for python, _ in tested.values()]
    assert (lower, upper) == (min(pythons), next_minor(max(pythons)))


def test_the_readme_names_every_tested_combination_and_the_command_that_runs_them() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Tested versions") :]
    assert ".ci/compat" in section
    for name, (python, pins) in combinations().items():
        assert f"`{name}`" in section and f"Python {python}" in section, name
        for package, version in pins.items():
            assert f"{package} {version}" in section, (name, package)
