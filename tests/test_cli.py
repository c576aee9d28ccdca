"""`amp-plus`: the train and demo commands, the settings they build, and clear usage errors (exit code 2)."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from lightning_amp_plus import MixedPrecisionMonitor, MixedPrecisionPlugin, cli, doctor
from lightning_amp_plus.cli import AmpSettings, build_parser, main, resolve_precision, train

# 32 images in batches of 8: 4 steps an epoch, on a CNN of a few hundred parameters.
TINY_CNN = ["cnn", "--num-train", "32", "--num-val", "16", "--batch-size", "8", "--width", "2", "--accelerator", "cpu"]
TINY_LSTM = ["lstm", "--num-train", "32", "--num-val", "16", "--batch-size", "8", "--hidden-dim", "4",
             "--embed-dim", "4", "--max-len", "12", "--accelerator", "cpu"]  # fmt: skip


def run_train(*argv: str) -> dict[str, object]:
    return train(build_parser().parse_args(["train", *argv]))


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run `amp-plus argv`, expect exit code 2, and return stderr (which must hold no traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# ------------------------------------------------------------------------------------------------------ train
def test_train_defaults_to_bf16_on_cpu_with_the_monitor_and_reports_validation_accuracy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", *TINY_CNN, "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "MixedPrecisionMonitor: 4 optimizer steps, 0 skipped" in out
    assert "amp-plus train cnn: bf16-mixed on cpu, synthetic data, 4 steps (1.0 epochs)" in out
    assert re.search(r"val/acc 0\.\d{3} \(chance 0\.10\), val/loss \d+\.\d{3}; skipped steps 0", out)


def test_train_validates_the_final_weights_when_max_steps_ends_mid_epoch() -> None:
    # 3 steps of a 4-step epoch: fit itself never validates, so the numbers come from a validation after it.
    result = run_train(*TINY_LSTM, "--max-steps", "3", "--precision", "32-true")
    assert result["steps"] == 3
    assert result["precision"] == "32-true" and result["skipped_steps"] == 0
    assert isinstance(result["val_acc"], float) and 0.0 <= result["val_acc"] <= 1.0


def test_train_passes_the_loss_scaler_flags_to_the_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    result = run_train(*TINY_CNN, "--precision", "16-mixed", "--init-scale", "256", "--growth-interval", "1000",
                       "--max-steps", "2")  # fmt: skip
    assert result["precision"] == "16-mixed"
    # The monitor saw every step scaled by 2**8: the flag reached the plugin's scaler.
    assert "loss scale 2**8 to 2**8, last 2**8" in capsys.readouterr().out


def test_train_with_master_weights_writes_the_chart_and_checkpoints(tmp_path: Path) -> None:
    report, ckpt = tmp_path / "amp.png", tmp_path / "ckpt"
    result = run_train(*TINY_CNN, "--master-weights", "--max-steps", "2", "--report", str(report),
                       "--ckpt-dir", str(ckpt))  # fmt: skip
    assert result["master_weights"] is True and result["steps"] == 2
    assert report.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ckpt / "last.ckpt").exists()


def test_train_seeds_everything_so_two_runs_agree() -> None:
    first = run_train(*TINY_CNN, "--max-steps", "2", "--precision", "32-true", "--seed", "3")
    second = run_train(*TINY_CNN, "--max-steps", "2", "--precision", "32-true", "--seed", "3")
    # Same seed: same weights, same batches, same arithmetic on one thread, so bit-identical (tolerance 0).
    torch.testing.assert_close(first["val_loss"], second["val_loss"], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ settings
def test_amp_settings_build_the_plugin_and_monitor_they_describe() -> None:
    fp16 = AmpSettings("16-mixed", init_scale=512.0, growth_interval=7, hysteresis=2, max_consecutive_skips=0)
    (plugin,) = fp16.plugins("cpu")
    assert isinstance(plugin, MixedPrecisionPlugin) and plugin.scaler is not None
    assert plugin.scaler.get_scale() == 512.0
    assert (plugin.scaler.growth_interval, plugin.scaler.hysteresis) == (7, 2)
    assert plugin.scaler.max_consecutive_skips is None  # 0 on the command line: never stop
    (bf16,) = AmpSettings("bf16-mixed", master_weights=True).plugins()
    assert isinstance(bf16, MixedPrecisionPlugin) and bf16.master_weights and bf16.scaler is None
    assert AmpSettings("32-true").trainer_kwargs() == {"precision": "32-true"}
    (monitor,) = AmpSettings(report_path="chart.png").callbacks()
    assert isinstance(monitor, MixedPrecisionMonitor) and monitor.report_path == Path("chart.png")
    assert AmpSettings(monitor=False).callbacks() == []


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"precision": "32-true", "master_weights": True}, "master_weights=True needs precision '16-mixed'"),
        ({"precision": "bf16-mixed", "hysteresis": 2}, "hysteresis configure the fp16 loss scaler"),
        ({"precision": "32-true", "max_consecutive_skips": 3}, "'32-true' skips none"),
        ({"precision": "16-mixed", "init_scale": -1.0}, "init_scale=-1.0 must be a float > 0"),
        ({"precision": "fp8"}, "precision='fp8' is not one of"),
    ],
)
def test_amp_settings_refuse_impossible_combinations(settings: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        AmpSettings(**settings)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["train", "--master-weights", "--precision", "32-true"], "master_weights=True needs precision"),
        (["train", "--init-scale", "1024", "--precision", "bf16-mixed"], "init_scale configure the fp16 loss scaler"),
        (["train", "--max-consecutive-skips", "3", "--precision", "32-true"], "'32-true' skips none"),
        (["train", "lstm", "--width", "8"], "--width configures the cnn model, not lstm"),
        (["train", "--data", "real", "--num-train", "100"], "--num-train sizes the synthetic data"),
        (["train", "--epochs", "0"], "argument --epochs: 0 must be >= 1"),
        (["train", "--init-scale", "inf"], "argument --init-scale: inf must be a finite number > 0"),
        (["train", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
        (["train", "--bogus"], "unrecognized arguments: --bogus"),
        (["compare", "--steps", "3", "--warmup", "5"], "--warmup 5 leaves none of --steps 3 to time"),
    ],
)
def test_bad_flags_and_impossible_combinations_exit_2_with_one_clear_message(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(argv, capsys)
    assert fragment in err
    assert re.search(r"^amp-plus( train| compare)?: error: ", err, re.MULTILINE)  # argparse's usage line comes first


@pytest.mark.parametrize(("task", "name"), [("cnn", "CIFAR-10"), ("lstm", "IMDB")])
def test_real_data_missing_offline_is_a_usage_error_that_says_what_to_do(
    task: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(["train", task, "--data", "real", "--no-download", "--data-dir", str(tmp_path)], capsys)
    assert f"{name} is not available" in err and str(tmp_path) in err
    assert "--data synthetic" in err


def test_cuda_requested_without_cuda_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = usage_error(["train", "--accelerator", "cuda"], capsys)
    assert "--accelerator cuda was requested, but PyTorch sees no CUDA device" in err
    assert "Use --accelerator cpu" in err


def _fake_pre_ampere_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(doctor, "autocast_supported", lambda device, dtype: (True, ""))


def test_bf16_on_a_gpu_without_bf16_is_a_usage_error_that_suggests_fp16(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_pre_ampere_gpu(monkeypatch)
    err = usage_error(["train", "--accelerator", "cuda", "--precision", "bf16-mixed"], capsys)
    assert "this GPU (Tesla V100-SXM2-16GB, compute capability 7.0) has no native bfloat16" in err
    assert "Use --precision 16-mixed" in err


def test_auto_precision_picks_fp16_on_a_pre_ampere_gpu_and_bf16_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_precision("auto", "cpu") == "bf16-mixed"
    _fake_pre_ampere_gpu(monkeypatch)
    assert resolve_precision("auto", "cuda") == "16-mixed"


def test_a_half_dtype_autocast_cannot_run_here_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(doctor, "autocast_supported", lambda device, dtype: (False, "no fp16 kernels on this device"))
    err = usage_error(["train", "--precision", "16-mixed", "--accelerator", "cpu"], capsys)
    assert "--precision 16-mixed was requested, but torch.autocast cannot run torch.float16 on cpu" in err
    assert "no fp16 kernels on this device" in err and "amp-plus doctor" in err


def test_a_chart_without_matplotlib_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_find_spec = cli.importlib.util.find_spec
    monkeypatch.setattr(
        cli.importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    err = usage_error(["train", "--report", "amp.png"], capsys)
    assert "report_path='amp.png' draws the monitor's chart with matplotlib, which is not installed" in err


# ------------------------------------------------------------------------------------------- entry points
def test_no_command_prints_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: amp-plus" in out and all(command in out for command in ("train", "compare", "doctor", "demo"))


def test_python_m_lightning_amp_plus_runs_amp_plus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["python -m lightning_amp_plus", "doctor", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("lightning_amp_plus", run_name="__main__")
    assert exit_info.value.code == 0
    assert "usage: amp-plus doctor" in capsys.readouterr().out


def test_demo_subcommand_runs_the_original_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "5", "--precision", "bf16-mixed"]) == 0
    assert "lightning-amp-plus demo: bf16-mixed, 5 steps" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- found in another module
