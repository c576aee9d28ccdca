"""The size of what a reader meets: public names per class, and no class too long or holding too much state.

Measured, not promised: the numbers ``docs/design.md`` states are these tests' bounds.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import lightning.fabric.plugins.precision as fabric_precision
import lightning.pytorch.plugins.precision as trainer_precision
import pytest
import torch

import lightning_amp_plus.fabric as amp_fabric
from lightning_amp_plus import DynamicLossScaler, FSDPMixedPrecisionPlugin, MixedPrecisionPlugin

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_amp_plus"
MAX_CLASS_LINES = 400
MAX_INSTANCE_ATTRIBUTES = 15


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_the_scaler_has_at_most_twenty_public_names_grad_scalers_fourteen_among_them() -> None:
    ours, torchs = public(DynamicLossScaler), public(torch.amp.GradScaler)
    assert torchs <= ours
    assert len(ours) <= 20, sorted(ours - torchs)


@pytest.mark.parametrize(
    ("make", "anchors"),
    [
        (lambda: MixedPrecisionPlugin("16-mixed"), lambda: [trainer_precision.MixedPrecision("16-mixed", "cpu")]),
        (
            lambda: FSDPMixedPrecisionPlugin("16-mixed"),
            lambda: [trainer_precision.FSDPPrecision("16-mixed"), trainer_precision.MixedPrecision("16-mixed", "cpu")],
        ),
        (
            lambda: amp_fabric.MixedPrecisionPlugin("16-mixed"),
            lambda: [fabric_precision.MixedPrecision("16-mixed", "cpu")],
        ),
        (
            lambda: amp_fabric.FSDPMixedPrecisionPlugin("16-mixed"),
            lambda: [fabric_precision.FSDPPrecision("16-mixed"), fabric_precision.MixedPrecision("16-mixed", "cpu")],
        ),
    ],
    ids=["trainer", "trainer-fsdp", "fabric", "fabric-fsdp"],
)
@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available:UserWarning")
def test_each_plugin_keeps_its_anchors_names_and_adds_at_most_ten(make: Any, anchors: Any) -> None:
    """The anchors are the framework's plugins at the same precision, as instances (their attributes count too).

    An FSDP plugin is the mixed-precision plugin over FSDP: it keeps both contracts, Lightning's ``FSDPPrecision``'s
    and its ``MixedPrecision``'s (``autocast_context_manager``, ``device``).
    """
    plugin = make()
    theirs = set().union(*(public_of(anchor) for anchor in anchors()))
    assert theirs <= public_of(plugin), sorted(theirs - public_of(plugin))
    added = public_of(plugin) - theirs
    assert len(added) <= 10, sorted(added)


def public_of(instance: object) -> set[str]:
    return {name for name in dir(instance) if not name.startswith("_")}


def classes() -> list[tuple[str, ast.ClassDef]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.append((f"{path.relative_to(PACKAGE)}:{node.name}", node))
    return found


def instance_attributes(node: ast.ClassDef) -> set[str]:
    """The names assigned as ``self.<name>`` anywhere in the class's methods (its instance state)."""
    names = set()
    for child in ast.walk(node):
        targets = []
        if isinstance(child, ast.Assign):
            targets = child.targets
        elif isinstance(child, ast.AnnAssign | ast.AugAssign):
            targets = [child.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    names.add(part.attr)
    return names


@pytest.mark.parametrize(("where", "node"), classes(), ids=[where for where, _ in classes()])
def test_no_class_is_longer_than_400_lines_or_holds_more_than_15_instance_attributes(
    where: str, node: ast.ClassDef
) -> None:
    lines = (node.end_lineno or node.lineno) - node.lineno + 1
    assert lines <= MAX_CLASS_LINES, f"{where}: {lines} lines"
    attributes = instance_attributes(node)
    assert len(attributes) <= MAX_INSTANCE_ATTRIBUTES, f"{where}: {sorted(attributes)}"
