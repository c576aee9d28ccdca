"""docs/design.md's table of what one step runs is the trace's, so the page cannot drift from the code.

The counts are measured by ``benchmarks/trace_step.py`` (``sys.setprofile`` over one Trainer step, one tracer, the same
roots on both sides); here the same tracer runs each variant of the page's table, ours and the reference, and the page
must state what it measured. The bounds are the core's: a 16-mixed step with clipping at most 1.25x the functions of
Lightning's ``MixedPrecision`` + ``GradScaler`` and at most 2x its files; an ``fp8-mixed`` step at most 2x torchao's
recipe in both.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from helpers import load_script

REPO = Path(__file__).resolve().parents[2]
Counts = tuple[int, int] | None  # (functions, files); None where the reference refuses the set-up


def stated() -> dict[str, tuple[Counts, Counts]]:
    """The page's table: row name -> (ours, reference)."""
    rows = re.findall(
        r"^\| ([^|]+?) \| (\d+) \| (\d+) \| (\d+|refuses) \| (\d+|) \|", (REPO / "docs" / "design.md").read_text(), re.M
    )
    table: dict[str, tuple[Counts, Counts]] = {}
    for name, functions, files, ref_functions, ref_files in rows:
        reference = None if ref_functions == "refuses" else (int(ref_functions), int(ref_files))
        table[name] = ((int(functions), int(files)), reference)
    return table


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[Counts, Counts]]:
    module: Any = load_script(REPO / "benchmarks" / "trace_step.py", "trace_step")
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's remarks on a 4-step fit with no logger are not under test here
        for variant in module.VARIANTS:
            ours, theirs = module.trace(variant, ours=True), module.trace(variant, ours=False)
            found[variant.name] = (module.counts(ours), None if theirs is None else module.counts(theirs))
    return found


def test_the_design_page_states_what_one_step_runs_as_traced(measured: dict[str, tuple[Counts, Counts]]) -> None:
    page = stated()
    assert {name: page.get(name) for name in measured} == measured


@pytest.mark.parametrize(
    ("row", "function_ratio", "file_ratio"),
    [
        ("16-mixed, clip by norm", 1.25, 2.0),
        ("fp8-mixed, no clipping", 2.0, 2.0),
        ("fp8-mixed, no clipping, a check step", 2.0, 2.0),
    ],
)
def test_one_step_runs_within_the_bounds_of_its_reference(
    measured: dict[str, tuple[Counts, Counts]], row: str, function_ratio: float, file_ratio: float
) -> None:
    ours, reference = measured[row]
    assert ours is not None and reference is not None
    assert ours[0] <= function_ratio * reference[0] and ours[1] <= file_ratio * reference[1], (ours, reference)
