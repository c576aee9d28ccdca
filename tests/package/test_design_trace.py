"""docs/design.md's table of what one step runs is the trace's, so the page cannot drift from the code.

The counts are measured by ``benchmarks/trace_step.py`` (``sys.setprofile`` over one Trainer step); here the same
tracer runs each variant of the page's table for this package and the page must state what it measured, within the
issue's bounds for the reference case (16-mixed, clipping by norm: at most 30 functions in 6 files).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from helpers import load_script
from versions import needs

REPO = Path(__file__).resolve().parents[2]
# The page's row names for the script's variants (the page says "clipping" where the script's table says "clip").
ROWS = {
    "16-mixed, clip by norm": "16-mixed, clipping by norm, foreach AdamW",
    "16-mixed, clip by norm, fused AdamW": "16-mixed, clipping by norm, fused AdamW",
    "16-mixed, no clipping": "16-mixed, no clipping",
    "16-mixed, no clipping, fused AdamW": "16-mixed, no clipping, fused AdamW",
    "bf16-mixed, clip by norm": "bf16-mixed, clipping by norm",
}


def stated() -> dict[str, tuple[int, int]]:
    """The page's "ours" columns: row name -> (functions, files)."""
    table = re.findall(r"^\| ([^|]+?) \| (\d+) \| (\d+) \|", (REPO / "docs" / "design.md").read_text(), re.MULTILINE)
    return {name: (int(functions), int(files)) for name, functions, files in table}


@needs("python", "3.11", "benchmarks/trace_step.py's tracer (it reads code objects' co_qualname)")
def test_the_design_page_states_what_one_step_runs_as_traced() -> None:
    module = load_script(REPO / "benchmarks" / "trace_step.py", "trace_step")
    page = stated()
    measured = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's remarks on a 4-step fit with no logger are not under test here
        for variant in module.VARIANTS:
            found = module.trace(variant, ours=True)
            measured[ROWS[variant.name]] = (sum(map(len, found.values())), len(found))
    assert {name: page.get(name) for name in measured} == measured
    functions, files = measured["16-mixed, clipping by norm, foreach AdamW"]
    assert functions <= 30 and files <= 6
