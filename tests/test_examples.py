"""The example scripts run as documented (tiny settings)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_plain_loop_skips_the_injected_overflow_and_learns(capsys: pytest.CaptureFixture[str]) -> None:
    result = load("plain_loop").main(["--steps", "120", "--device", "cpu"])
    assert result["skipped_steps"] >= 1
    assert (
        "step 50: skipped, non-finite gradients in ['0.weight', '0.bias', '2.weight', '2.bias']"
        in capsys.readouterr().out
    )
    assert result["loss"] < 0.5


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_lightning_example_resumes_from_its_halfway_checkpoint(tmp_path: Path, precision: str) -> None:
    result = load("lightning_trainer").main(["--precision", precision, "--epochs", "2", "--root", str(tmp_path)])
    assert result["global_step"] == 64  # two epochs of 32 batches, the second after the resume
    assert (tmp_path / "half.ckpt").exists()
