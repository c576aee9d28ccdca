"""`amp-plus` and FP8: `train --precision fp8-mixed` with its flags, their refusals (first, one paragraph, exit code
2), the resume record, `compare --configs ours-fp8-mixed` and what `doctor` says of FP8."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest
from helpers import native_bf16_cpu, usage_error
from processes import amp_plus

from lightning_amp_plus.cli import AmpSettings, build_parser, main, without_lightning_noise
from lightning_amp_plus.cli._settings import FP8_RECIPES
from lightning_amp_plus.cli.doctor import fp8_support
from lightning_amp_plus.cli.train import fp8_note, train
from lightning_amp_plus.models import CifarCNN, ImdbLSTM

TINY_CNN = ["cnn", "--num-train", "32", "--num-val", "16", "--batch-size", "8", "--width", "2", "--accelerator", "cpu",
            "--threads", "1"]  # fmt: skip
FP8 = ["--precision", "fp8-mixed"]
NOTHING_CONVERTED = r"ignore:No layer of the model trains in FP8:UserWarning"
EMULATED = r"ignore:.*\('fp8-mixed'\) on CPU. torch emulates:UserWarning"


def needs_torchao() -> None:
    pytest.importorskip("torchao.float8", reason="fp8-mixed needs torchao (the fp8 extra)")


def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any training started fails the test: a refusal must come first."""
    import lightning.pytorch as pl

    from lightning_amp_plus.cli import train as train_module

    monkeypatch.setattr(pl.Trainer, "fit", lambda *a, **k: pytest.fail("training started before the refusal"))
    monkeypatch.setattr(train_module, "train", lambda *a: pytest.fail("the run started before the refusal"))


def test_the_command_lines_recipes_are_torchaos() -> None:
    needs_torchao()
    from lightning_amp_plus.weights.fp8.convert import RECIPES

    assert FP8_RECIPES == RECIPES


@pytest.mark.filterwarnings(EMULATED)
def test_the_settings_give_the_plugin_the_fp8_options_and_0_means_never_fall_back() -> None:
    needs_torchao()
    settings = AmpSettings("fp8-mixed", fp8_recipe="rowwise", fp8_check_interval=5, fp8_fallback=0)
    (plugin,) = settings.plugins("cpu")
    fp8: Any = plugin.fp8  # type: ignore[attr-defined]
    assert (fp8.recipe, fp8.check_interval, fp8.rule.threshold_pct) == ("rowwise", 5, None)
    (default,) = AmpSettings("fp8-mixed").plugins("cpu")
    fp8 = default.fp8  # type: ignore[attr-defined]
    assert (fp8.recipe, fp8.check_interval, fp8.rule.threshold_pct) == ("tensorwise", 50, 1.0)


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--precision", "bf16-mixed", "--fp8-recipe", "rowwise"],
         "--fp8-recipe configures FP8 training, which --precision bf16-mixed does not do. Use --precision fp8-mixed, "
         "or drop --fp8-recipe."),
        ([*FP8, "--fp8-recipe", "delayed"], "argument --fp8-recipe: invalid choice: 'delayed'"),
        ([*FP8, "--fp8-fallback", "100"], "argument --fp8-fallback: 100 is outside [0, 100): a percent"),
        ([*FP8, "--fp8-check-interval", "0"], "argument --fp8-check-interval: 0 must be >= 1"),
        (["--fp8-fallback", "2"], "--fp8-fallback configures FP8 training, which --precision auto (bf16-mixed here)"),
    ],
    ids=["other-precision", "recipe", "fallback", "interval", "auto"],
)  # fmt: skip
def test_fp8_flags_that_cannot_apply_are_refused_first(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if "--precision" in argv:
        no_work(monkeypatch)
    else:  # auto is resolved on the machine, in train, still before any work
        import lightning.pytorch as pl

        native_bf16_cpu(monkeypatch)  # auto: bf16-mixed there

        monkeypatch.setattr(pl.Trainer, "fit", lambda *a, **k: pytest.fail("training started before the refusal"))
    assert error in usage_error(["train", *TINY_CNN, *argv], capsys)


@pytest.mark.parametrize("argv", [["train", *TINY_CNN, *FP8], ["compare", *TINY_CNN, "--configs", "ours-fp8-mixed"]])
def test_without_torchao_fp8_is_refused_first_naming_the_install(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    no_work(monkeypatch)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    err = usage_error(argv, capsys)
    assert 'not installed. Install it with `pip install "lightning-amp-plus[fp8]"`' in err
    assert err.count("\n") == 1  # one paragraph


def test_an_fp8_gpu_check_refuses_below_sm89_naming_the_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from lightning_amp_plus.cli._checks import UsageError
    from lightning_amp_plus.cli._runs import check_fp8_gpu

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100")
    with pytest.raises(UsageError, match=r"this GPU \(NVIDIA A100, compute capability 8\.0\) has no float8"):
        check_fp8_gpu(0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    check_fp8_gpu(0)  # Hopper: nothing to say


@pytest.mark.parametrize("model", [CifarCNN(width=16), ImdbLSTM(vocab_size=100)], ids=["cnn", "lstm"])
def test_the_shipped_models_have_no_linear_fp8_can_take_and_the_note_says_the_run_is_bf16(model: Any) -> None:
    needs_torchao()
    from lightning_amp_plus.weights.fp8 import FP8Training

    with pytest.warns(UserWarning, match="No layer of the model trains in FP8"):
        assert FP8Training().convert(model) == []  # torchao's own eligibility agrees with the note
    note = fp8_note(model)
    assert note.startswith("no layer in FP8: its only Linear, `classifier`")
    assert note.endswith("is not a multiple of 16 in both dimensions, so this run computes as bf16-mixed")


@pytest.mark.filterwarnings(NOTHING_CONVERTED, EMULATED)
def test_train_fp8_mixed_says_on_its_first_line_what_it_converts(capsys: pytest.CaptureFixture[str]) -> None:
    needs_torchao()
    args = build_parser().parse_args(["train", *TINY_CNN, *FP8, "--fp8-recipe", "rowwise", "--max-steps", "2"])
    args.progress_bar = args.model_summary = args.lightning_info = False
    result = train(args)
    assert result["precision"] == "fp8-mixed" and result["steps"] == 2
    first = capsys.readouterr().out.splitlines()[0]
    assert "fp8-mixed (rowwise; no layer in FP8: its only Linear, `classifier`" in first, first


def test_doctor_says_how_each_device_runs_fp8(capsys: pytest.CaptureFixture[str]) -> None:
    assert [fp8_support("cuda", c) for c in ("7.5", "8.0", "8.6", "8.9", "9.0", "10.0")] == [
        "no", "no", "no", "native", "native", "native"
    ]  # fmt: skip
    assert main(["doctor", "--no-benchmark"]) == 0
    out = capsys.readouterr().out
    assert "fp8-mixed: emulated (torch._scaled_mm on CPU" in out
    assert ("fp8-mixed needs torchao" in out) == (importlib.util.find_spec("torchao") is None)


def test_the_commands_silence_torchs_log_line_on_importing_torchao_only_while_they_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # torch 2.14 logs it when torchao 0.18 is imported, as a line of its own past the command's wording.
    logger = logging.getLogger("torch.utils._pytree")
    line = (
        "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. Calling "
        "register_constant() on Enum subclasses is deprecated and will be an error in a future release."
    )
    with without_lightning_noise():
        logger.warning(line, "<enum 'KernelPreference'>")
    assert "register_constant" not in caplog.text
    logger.warning(line, "<enum 'KernelPreference'>")  # a program's own use of torch keeps its logging
    assert "register_constant" in caplog.text


@pytest.mark.integration
def test_an_fp8_run_prints_no_torch_log_line_from_importing_torchao() -> None:
    needs_torchao()
    done = amp_plus("train", *TINY_CNN, *FP8, "--max-steps", "1", timeout=180)
    assert done.returncode == 0, done.stderr
    assert "register_constant" not in done.stderr and "_pytree.py" not in done.stderr, done.stderr


@pytest.mark.integration
def test_a_whole_fp8_run_resumes_with_its_fp8_flags_and_refuses_a_changed_recipe(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    needs_torchao()
    folder = tmp_path / "ckpt"
    done = amp_plus("train", *TINY_CNN, *FP8, "--max-steps", "2", "--ckpt-dir", str(folder), timeout=180)
    assert done.returncode == 0, done.stderr
    assert "fp8-mixed (tensorwise; no layer in FP8" in done.stdout.splitlines()[0]
    err = usage_error(
        ["train", *TINY_CNN, *FP8, "--fp8-recipe", "rowwise", "--max-steps", "4", "--ckpt-dir", str(folder),
         "--resume"],
        capsys,
    )  # fmt: skip
    assert "--fp8-recipe 'tensorwise' there, 'rowwise' here" in err, err
    done = amp_plus(
        "train", *TINY_CNN, *FP8, "--fp8-recipe", "tensorwise", "--max-steps", "4", "--ckpt-dir", str(folder),
        "--resume", timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "resuming from" in done.stdout


@pytest.mark.integration
def test_compare_runs_fp8_mixed_beside_bf16_mixed_on_request_and_says_what_it_measures() -> None:
    needs_torchao()
    done = amp_plus(
        "compare", *TINY_CNN, "--configs", "ours-bf16-mixed", "ours-fp8-mixed", "--steps", "4", "--warmup", "1",
        "--in-process", timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [line.split()[0] for line in done.stdout.splitlines() if line.startswith("ours-")]
    assert rows == ["ours-bf16-mixed", "ours-fp8-mixed"], done.stdout
    assert "ours fp8-mixed: no layer trains in FP8 here" in done.stdout
