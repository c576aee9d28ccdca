"""`amp-plus`: the train command, the settings it builds, and requests refused with one paragraph (exit code 2)."""

from __future__ import annotations

import inspect
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import processes
import pytest
import torch
from helpers import PNG_SIGNATURE, native_bf16_cpu, usage_error
from versions import at_least

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionMonitor, MixedPrecisionPlugin
from lightning_amp_plus.cli import AmpSettings, _settings, build_parser, doctor, main
from lightning_amp_plus.cli import train as _train_module
from lightning_amp_plus.cli._runs import resolve_precision
from lightning_amp_plus.cli.train import train

# 32 images in batches of 8: 4 steps an epoch, on a CNN of a few hundred parameters.
TINY_CNN = ["cnn", "--num-train", "32", "--num-val", "16", "--batch-size", "8", "--width", "2", "--accelerator", "cpu"]
TINY_LSTM = ["lstm", "--num-train", "32", "--num-val", "16", "--batch-size", "8", "--hidden-dim", "4",
             "--embed-dim", "4", "--max-len", "12", "--accelerator", "cpu"]  # fmt: skip


def run_train(*argv: str) -> dict[str, object]:
    args = build_parser().parse_args(["train", *argv])
    args.progress_bar = args.model_summary = args.lightning_info = False
    return train(args)


def run_command(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m lightning_amp_plus argv` in a fresh process (for what needs one: several ranks, import costs).

    Past ``timeout`` the process and every process it started are killed and the test fails.
    """
    return processes.amp_plus(*argv, timeout=timeout)


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make starting a command's work fail the test: what is refused must be refused before it."""
    from lightning_amp_plus.cli import compare
    from lightning_amp_plus.cli import train as _train

    def started(*args: object) -> None:
        raise AssertionError("the command started its work before refusing the request")

    monkeypatch.setattr(_train, "train", started)
    monkeypatch.setattr(compare, "run", started)


# ------------------------------------------------------------------------------------------------------ train
def test_train_defaults_to_bf16_on_a_cpu_with_native_bf16_with_the_monitor_and_reports_validation_accuracy(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    native_bf16_cpu(monkeypatch)
    assert main(["train", *TINY_CNN, "--epochs", "1"]) == 0
    out = capsys.readouterr().out
    assert "amp-plus train cnn: bf16-mixed on cpu, synthetic data, 1 epoch of 4 steps" in out
    assert "MixedPrecisionMonitor: 4 optimizer steps, 0 skipped" in out
    assert "amp-plus train cnn: bf16-mixed on cpu, synthetic data, 4 steps (1.0 epochs)" in out
    assert re.search(r"val/acc 0\.\d{3} \(chance 0\.10\), val/loss \d+\.\d{3}; skipped steps 0", out)


@pytest.mark.parametrize(
    ("idle", "environ", "said", "threads"),
    [
        (0.4, {}, "1 thread (0.4 of 2 cores idle; --threads N sets it)", 1),
        (1.9, {}, "2 threads (1.9 of 2 cores idle; --threads N sets it)", 2),
        (2.0, {"OMP_NUM_THREADS": "1"}, "1 thread (OMP_NUM_THREADS)", 1),
    ],
)
def test_without_threads_train_takes_the_idle_cores_and_says_so_on_its_first_line(
    idle: float, environ: dict[str, str], said: str, threads: int, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from lightning_amp_plus.cli import _machine

    monkeypatch.setattr(_machine, "idle_cores", lambda sample_s=0.1: idle)
    monkeypatch.setattr(_machine, "usable_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the cases without it must not take the shell's
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    seen: list[int] = []
    monkeypatch.setattr(_train_module, "interruptible", lambda trainer, call: (seen.append(torch.get_num_threads()),
                                                                               call())[1])  # fmt: skip
    before = torch.get_num_threads()
    run_train(*TINY_CNN, "--max-steps", "1", "--precision", "32-true")
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(f", 1 step, {said} (Ctrl-C stops cleanly with the summary so far)"), first
    assert seen[0] == threads  # what the line says is what training ran with
    assert torch.get_num_threads() == before  # and the caller's own count is back


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
    assert "loss scale 2**8 throughout" in capsys.readouterr().out


def test_one_step_is_worded_in_the_singular(capsys: pytest.CaptureFixture[str]) -> None:
    run_train(*TINY_CNN, "--max-steps", "1", "--precision", "32-true")
    out = capsys.readouterr().out
    assert "MixedPrecisionMonitor: 1 optimizer step, 0 skipped" in out and ", 1 step (0.2 epochs)" in out
    assert "1 steps" not in out


def test_train_with_master_weights_writes_the_chart_exactly_where_asked_and_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, ckpt = tmp_path / "charts" / "amp.png", tmp_path / "ckpt"
    result = run_train(*TINY_CNN, "--precision", "bf16-mixed", "--master-weights", "--max-steps", "2", "--report",
                       str(report), "--ckpt-dir", str(ckpt))  # fmt: skip
    assert result["master_weights"] is True and result["steps"] == 2
    assert report.read_bytes()[:8] == PNG_SIGNATURE
    assert f"chart written to {report}" in capsys.readouterr().out
    assert [p.name for p in report.parent.iterdir()] == ["amp.png"]  # that file, no other name
    assert (ckpt / "last.ckpt").exists()


def test_train_seeds_everything_so_two_runs_agree() -> None:
    first = run_train(*TINY_CNN, "--max-steps", "2", "--precision", "32-true", "--seed", "3")
    second = run_train(*TINY_CNN, "--max-steps", "2", "--precision", "32-true", "--seed", "3")
    # Same seed: same weights, same batches, same arithmetic on one thread, so bit-identical (tolerance 0).
    torch.testing.assert_close(first["val_loss"], second["val_loss"], rtol=0, atol=0)


def test_a_stop_with_a_diagnosis_prints_the_summary_so_far_and_exits_1_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --lr 1000 sends the weights to inf at once; every fp16 step then overflows at the scaler's floor of 1, and the
    # scaler stops after 2 of them in a row (its diagnosis is a FloatingPointError).
    argv = ["train", *TINY_CNN, "--precision", "16-mixed", "--init-scale", "1", "--lr", "1000",
            "--max-consecutive-skips", "2", "--max-steps", "20", "--report", str(tmp_path / "amp.png")]  # fmt: skip
    with pytest.warns(RuntimeWarning):  # the monitor's floor warning, as the run goes
        assert main(argv) == 1
    out, err = capsys.readouterr()
    assert "MixedPrecisionMonitor: " in out and "skipped" in out and "chart written to" in out
    assert (tmp_path / "amp.png").read_bytes()[:8] == PNG_SIGNATURE
    assert err.startswith("amp-plus train: stopped: ") and "Traceback" not in err


# ------------------------------------------------------------------------------------------ console output
# Lightning's info lines are log records (pytest's log capture holds them); the progress bar writes to the streams.
@pytest.mark.parametrize("older_package_imported", [False, True])
def test_in_a_non_terminal_train_prints_no_progress_bar_device_banner_tip_or_model_summary(
    older_package_imported: bool, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    if older_package_imported:
        # Importing pytorch_lightning (installed beside lightning) sends Lightning's info lines to its own logger.
        pytest.importorskip("pytorch_lightning")
    assert main(["train", *TINY_CNN, "--max-steps", "2"]) == 0
    out, err = capfd.readouterr()
    everything = out + err + caplog.text
    for noise in ("GPU available", "TPU available", "litlogger", "Total Flops", "\r", "it/s]"):
        assert noise not in everything, noise
    assert "MixedPrecisionMonitor: 2 optimizer steps" in out


def test_each_console_flag_brings_its_output_back_and_the_summary_measures_flops(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    assert main(["train", *TINY_CNN, "--max-steps", "2", "--progress-bar", "--model-summary", "--lightning-info"]) == 0
    assert "it/s]" in "".join(capfd.readouterr())
    assert "GPU available" in caplog.text
    assert re.search(r"^(.+?) +Total params", caplog.text, re.MULTILINE) is not None
    if at_least("lightning", "2.6"):  # the summary's FLOPs line is Lightning 2.6's
        flops = re.search(r"^(.+?) +Total Flops", caplog.text, re.MULTILINE)
        assert flops is not None and flops.group(1).strip() != "0"  # measured on one sample, not the all-zero column


@pytest.mark.parametrize("flag", ["--model-summary", "--progress-bar", "--lightning-info"])
def test_each_console_flag_alone_brings_back_its_own_output_and_only_that(
    flag: str, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # --model-summary printed nothing without --lightning-info: the summary is one of Lightning's info lines.
    others = [f"--no-{name}" for name in ("model-summary", "progress-bar", "lightning-info") if f"--{name}" != flag]
    assert main(["train", *TINY_CNN, "--max-steps", "2", "--precision", "32-true", flag, *others]) == 0
    everything = "".join(capfd.readouterr()) + caplog.text
    shown = {"--model-summary": "Total params", "--progress-bar": "it/s]", "--lightning-info": "GPU available"}
    for name, output in shown.items():
        assert (output in everything) == (name == flag), (name, everything[-3000:])


# ------------------------------------------------------------------------------------------------ settings
def test_amp_settings_build_the_plugin_and_monitor_they_describe(tmp_path: Path) -> None:
    fp16 = AmpSettings("16-mixed", init_scale=512.0, growth_interval=7, hysteresis=2, max_consecutive_skips=0)
    (plugin,) = fp16.plugins("cpu")
    assert isinstance(plugin, MixedPrecisionPlugin) and plugin.scaler is not None
    assert plugin.scaler.get_scale() == 512.0
    state = plugin.scaler.state_dict()
    assert (state["growth_interval"], state["hysteresis"]) == (7, 2)
    assert state["max_consecutive_skips"] is None  # 0 on the command line: never stop
    (bf16,) = AmpSettings("bf16-mixed", master_weights=True).plugins()
    assert isinstance(bf16, MixedPrecisionPlugin) and bf16.settings.master_weights and bf16.scaler is None
    assert AmpSettings("32-true").trainer_kwargs() == {"precision": "32-true"}
    chart = str(tmp_path / "chart.png")
    (monitor,) = AmpSettings(report_path=chart).callbacks()
    assert isinstance(monitor, MixedPrecisionMonitor) and monitor.report_path == Path(chart)
    assert AmpSettings(monitor=False).callbacks() == []


def test_the_init_scale_range_the_parser_checks_is_the_scalers_default_range() -> None:
    defaults = inspect.signature(DynamicLossScaler).parameters
    scaler_range = (defaults["min_scale"].default, defaults["max_scale"].default)
    assert scaler_range == (_settings.SCALER_MIN_SCALE, _settings.SCALER_MAX_SCALE)


@pytest.mark.parametrize(
    ("settings", "fragment"),
    [
        ({"precision": "32-true", "master_weights": True}, "master_weights is for half-precision compute over FP32"),
        ({"precision": "bf16-mixed", "hysteresis": 2}, "hysteresis configures the fp16 loss scaler"),
        ({"precision": "32-true", "max_consecutive_skips": 3}, "precision='32-true' skips none"),
        (
            {"precision": "16-mixed", "init_scale": 0.5},
            "`AmpSettings(init_scale=0.5)` must be a number in [1, 16777216]:",
        ),
        ({"precision": "16-mixed", "init_scale": 1e40}, "`AmpSettings(init_scale=1e+40)` must be a number in"),
        ({"precision": "16-mixed", "hysteresis": 0}, "`AmpSettings(hysteresis=0)` must be an int >= 1"),
        ({"precision": "fp8"}, "precision='fp8' is not one of"),
        ({"report_path": "chart.txt"}, "report_path='chart.txt': the chart is written as .png"),
    ],
)
def test_amp_settings_refuse_impossible_combinations(settings: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        AmpSettings(**settings)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["train", "--master-weights", "--precision", "32-true"],
         "--master-weights is for half-precision compute over FP32 weights; --precision 32-true keeps the weights in "
         "FP32. Use --precision bf16-mixed with --master-weights, or drop --master-weights."),
        (["train", "--init-scale", "1024", "--precision", "bf16-mixed"],
         "--init-scale configures the fp16 loss scaler, which --precision bf16-mixed does not use"),
        (["train", "--precision", "bf16-mixed", "--init-scale", "4", "--hysteresis", "2"],
         "--init-scale and --hysteresis configure the fp16 loss scaler"),
        (["train", "--max-consecutive-skips", "3", "--precision", "32-true"], "--precision 32-true skips none"),
        (["train", "--precision", "16-mixed", "--init-scale", "0.5"], "argument --init-scale: 0.5 is outside [1, "
         "16777216]: the loss scaler keeps its scale between its min_scale 1 and max_scale 2**24"),
        (["train", "--precision", "16-mixed", "--init-scale", "1e40"], "argument --init-scale: 1e+40 is outside"),
        (["train", "--seed", "99999999999"], "argument --seed: 99999999999 is too large: the largest is 4,294,967,295"),
        (["train", "--lr", "1e308"], "argument --lr: 1e+308 is outside (0, 1000]"),
        (["train", "lstm", "--width", "8"], "--width configures the cnn model, not lstm"),
        (["train", "--data", "real", "--num-train", "100"], "--num-train sizes the synthetic data"),
        (["train", "--epochs", "0"], "argument --epochs: 0 must be >= 1"),
        (["train", "--init-scale", "inf"], "argument --init-scale: inf must be a finite number"),
        (["train", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
        (["train", "--bogus"], "unrecognized argument --bogus."),
        (["train", "--report", "/proc/x.png"], "--report /proc/x.png: no file can be created in /proc"),
        (["train", "--report", "x.txt"], "--report x.txt: the chart is written as .png, so the path must end in .png, "
         "e.g. x.png"),
        (["train", "--report", "x"], "--report x: the chart is written as .png, so the path must end in .png, e.g. "
         "x.png"),
        (["train", "--ckpt-dir", "/proc/ckpt"], "--ckpt-dir /proc/ckpt: no file can be created in /proc"),
        (["train", "--data", "real", "--data-dir", "/proc/data"], "--data-dir /proc/data: no file can be created"),
        (["compare", "--steps", "3", "--warmup", "5"], "--warmup 5 leaves none of --steps 3 to time"),
        (["compare", "--png", "/proc/x.png"], "--png /proc/x.png: no file can be created in /proc"),
        (["compare", "--png", "chart.svg"], "--png chart.svg: the chart is written as .png"),
        (["compare", "--csv", "/proc/table.csv"], "--csv /proc/table.csv: no file can be created in /proc"),
        (["compare", "--csv", "t.csv", "--markdown", "t.csv"], "--csv and --markdown name the same file"),
        (["demo"], "invalid choice: 'demo' (choose from 'train', 'compare', 'doctor')"),
    ],
)  # fmt: skip
@pytest.mark.usefixtures("no_work")
def test_impossible_requests_exit_2_with_one_message_naming_the_option_before_any_work(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(argv, capsys)
    assert fragment in err
    assert re.search(r"^amp-plus( train| compare)?: error: ", err, re.MULTILINE)


@pytest.mark.parametrize(
    ("make", "argv", "fragment"),
    [
        ("file", ["train", "--ckpt-dir", "{path}"], "--ckpt-dir {path} is a file, not a folder"),
        ("file", ["train", "--data", "real", "--data-dir", "{path}"], "--data-dir {path} is a file, not a folder"),
        ("file", ["train", "--report", "{path}/amp.png"], "--report {path}/amp.png: {path} is a file, not a folder"),
        ("folder", ["train", "--report", "{path}"], "--report {path} is a folder: give a file path in it, e.g. "),
        ("folder", ["compare", "--markdown", "{path}"], "--markdown {path} is a folder"),
    ],
)
@pytest.mark.usefixtures("no_work")
def test_paths_that_are_the_wrong_kind_are_refused_before_any_work(
    make: str, argv: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "existing"
    if make == "file":
        path.write_text("not a folder")
    else:
        path.mkdir()
    err = usage_error([part.format(path=path) for part in argv], capsys)
    assert fragment.format(path=path) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]  # checking left nothing behind


def test_scaler_flags_with_auto_precision_say_what_auto_chose_here(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    native_bf16_cpu(monkeypatch)
    err = usage_error(["train", "--init-scale", "1024", "--accelerator", "cpu"], capsys)
    assert "--init-scale configures the fp16 loss scaler, which --precision auto (bf16-mixed here) does not use" in err
    assert "Use --precision 16-mixed, or drop --init-scale." in err


@pytest.mark.parametrize(("task", "name"), [("cnn", "CIFAR-10"), ("lstm", "IMDB")])
def test_real_data_missing_offline_is_a_usage_error_that_says_what_to_do(
    task: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(["train", task, "--data", "real", "--no-download", "--data-dir", str(tmp_path)], capsys)
    assert f"{name} is not available" in err and str(tmp_path) in err
    assert "--data synthetic" in err


@pytest.mark.parametrize(
    ("flag", "name"),
    [("--report", "x.png"), ("--png", "x.png"), ("--csv", "x.csv"), ("--ckpt-dir", "ckpt"), ("--data-dir", "data")],
)
@pytest.mark.usefixtures("no_work")
def test_a_path_through_a_missing_folder_and_back_up_is_checked_where_it_leads_and_nothing_is_created(
    flag: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `~/nonexist/../../proc/sys/x.png` passed the check (nothing after `nonexist` can be looked at before it exists),
    # trained the whole run, then failed to write the chart and left `~/nonexist` behind.
    path = f"{tmp_path}/nonexist/{'../' * len(tmp_path.parts)}proc/sys/{name}"
    command = "compare" if flag in ("--png", "--csv") else "train"
    extra = ["--data", "real"] if flag == "--data-dir" else []
    err = usage_error([command, flag, path, *extra], capsys)
    assert err.startswith(f"amp-plus {command}: error: {flag} {path}: no file can be created in /proc/sys"), err
    assert list(tmp_path.iterdir()) == []  # the check created nothing, `nonexist` included


def test_a_path_through_a_missing_folder_writes_where_it_leads_without_creating_that_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "nonexist" / ".." / "charts" / "amp.png"
    run_train(*TINY_CNN, "--max-steps", "1", "--precision", "32-true", "--report", str(report))
    assert f"chart written to {tmp_path / 'charts' / 'amp.png'}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["charts"]
    assert (tmp_path / "charts" / "amp.png").read_bytes()[:8] == PNG_SIGNATURE


def test_cuda_requested_without_cuda_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = usage_error(["train", "--accelerator", "cuda"], capsys)
    assert "--accelerator cuda was requested, but PyTorch sees no CUDA device" in err
    assert "Use --accelerator cpu" in err


def _fake_pre_ampere_gpu(monkeypatch: pytest.MonkeyPatch, count: int = 1) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Tesla V100-SXM2-16GB")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: SimpleNamespace(total_memory=16 * 2**30))
    monkeypatch.setattr(doctor, "autocast_supported", lambda device, dtype: (True, ""))


def test_bf16_on_a_gpu_without_bf16_is_a_usage_error_that_suggests_fp16(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_pre_ampere_gpu(monkeypatch)
    err = usage_error(["train", "--accelerator", "cuda", "--precision", "bf16-mixed"], capsys)
    assert "this GPU (Tesla V100-SXM2-16GB, compute capability 7.0) has no native bfloat16" in err
    assert "Use --precision 16-mixed" in err


def test_more_gpus_than_there_are_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_pre_ampere_gpu(monkeypatch, count=1)
    err = usage_error(["train", "--accelerator", "cuda", "--devices", "3"], capsys)
    assert "--devices 3 was requested, but PyTorch sees 1 CUDA device(s) here. Use --devices 1 or fewer." in err


def test_auto_precision_picks_fp16_on_a_pre_ampere_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_pre_ampere_gpu(monkeypatch)
    assert resolve_precision("auto", "cuda") == "16-mixed"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [("fpu sse2 avx avx2 fma", "32-true"), ("fpu sse2 avx2 avx512f avx512_bf16", "bf16-mixed")],
    ids=["avx2-only", "native-bf16"],
)
def test_auto_precision_is_what_the_doctor_recommends_for_this_kind_of_cpu_and_the_first_line_says_why(
    flags: str, expected: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # On a CPU without native bf16, bf16 autocast made `amp-plus train cnn` 8x slower than 32-true (29.7 s against
    # 3.6 s of training on an AVX2 CPU) while the doctor recommended 32-true there: one judgement decides both.
    monkeypatch.setattr(doctor, "cpu_flags", lambda cpuinfo=doctor.CPUINFO: frozenset(flags.split()))
    assert doctor.recommend(doctor.collect(benchmark=False)[0]).precision == expected
    assert resolve_precision("auto", "cpu") == expected
    run_train(*TINY_CNN, "--max-steps", "1")
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"amp-plus train cnn: {expected}"), first
    said = "(auto, as `amp-plus doctor` recommends here: this CPU shows no native bf16 arithmetic"
    assert (said in first) == (expected == "32-true"), first
    if expected == "32-true":
        assert "--precision bf16-mixed runs MixedPrecisionPlugin anyway)" in first


def test_a_half_dtype_autocast_cannot_run_here_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(doctor, "autocast_supported", lambda device, dtype: (False, "no fp16 kernels on this device"))
    err = usage_error(["train", "--precision", "16-mixed", "--accelerator", "cpu"], capsys)
    assert "--precision 16-mixed was requested, but torch.autocast cannot run torch.float16 on cpu" in err
    assert "no fp16 kernels on this device" in err and "amp-plus doctor" in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["train", "--threads", "3"], "--threads 3 asks for 3 CPU threads, but this machine has 2 usable cores"),
        (["train", "--threads", "100000"], "--threads 100000 asks for 100,000 CPU threads, but this machine has 2 "),
        (["train", "--threads", "2", "--devices", "2"], "--threads 2 with --devices 2 asks for 4 CPU threads (2 in "
         "each of 2 processes), but this machine has 2 usable cores"),
        (["compare", "--threads", "1000"], "--threads 1000 asks for 1,000 CPU threads, but this machine has 2 usable"),
    ],
)  # fmt: skip
@pytest.mark.usefixtures("no_work")
def test_more_threads_than_usable_cores_are_refused_before_any_work_with_the_most_this_machine_takes(
    argv: list[str], fragment: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Unbounded, --threads 1000 ran 6x slower than 2 on a 2-core machine, 10000 hung and 100000 crashed torch (exit
    # 139, no message). Bounded as --devices is: by the cores this process may use.
    from lightning_amp_plus.cli import _machine

    monkeypatch.setattr(_machine, "usable_cores", lambda: 2)
    err = usage_error(argv, capsys)
    assert err.startswith(f"amp-plus {argv[0]}: error: {fragment}"), err
    most = "--threads 1 with --devices 2" if "--devices" in argv else "--threads 2 or fewer"
    assert f"Use {most} on this machine, or leave --threads out" in err


def test_as_many_threads_as_usable_cores_pass_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_amp_plus.cli import _machine, check_request

    monkeypatch.setattr(_machine, "usable_cores", lambda: 2)
    check_request(build_parser().parse_args(["train", "--threads", "2"]))
    check_request(build_parser().parse_args(["train", "--threads", "1", "--devices", "2"]))
    check_request(build_parser().parse_args(["compare", "--threads", "2"]))


@pytest.mark.parametrize("flag", ["--report", "--png"])
@pytest.mark.usefixtures("no_work")
def test_a_chart_without_matplotlib_is_a_usage_error(
    flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    err = usage_error(["train" if flag == "--report" else "compare", flag, "amp.png"], capsys)
    assert f"{flag} draws a chart with matplotlib, which is not installed" in err
    assert "pip install 'lightning-amp-plus[report]'" in err and f"or drop {flag}" in err


# ---------------------------------------------------------------------------------------- processes, Ctrl-C
# A shell starts a background job (`amp-plus train ... &`, `nohup ... &`) with SIGINT ignored, and the job's children
# inherit that: `trap "" INT` does the same here, whatever the disposition of the process running these tests.
SIGINT_IGNORED = ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]


@pytest.mark.integration
@pytest.mark.parametrize("sigint", ["inherited-default", "inherited-ignored"])
def test_ctrl_c_stops_training_cleanly_with_the_summary_so_far_and_the_chart(sigint: str, tmp_path: Path) -> None:
    chart = tmp_path / "amp.png"
    # The progress bar shows when training has started (its "Epoch 0" comes from inside fit).
    argv = [sys.executable, "-m", "lightning_amp_plus", "train", *TINY_CNN, "--epochs", "100000", "--threads", "1",
            "--report", str(chart), "--progress-bar"]  # fmt: skip
    process = processes.start([*SIGINT_IGNORED, *argv] if sigint == "inherited-ignored" else argv)
    try:
        seen = processes.read_until(process, b"Epoch 0:", timeout=120)  # each read waits only for the time left
        assert b"Epoch 0:" in seen, seen
        time.sleep(0.5)  # some steps (a few ms each)
        process.send_signal(signal.SIGINT)
        rest, err = processes.finish(process, timeout=60, what="amp-plus train after Ctrl-C")
    finally:
        processes.kill_group(process)
    out = seen.decode() + rest
    assert process.returncode == 130, err
    assert "Traceback" not in out + err
    assert re.search(r"MixedPrecisionMonitor: \d+ optimizer steps?, 0 skipped", out), out[-2000:]
    assert f"chart written to {chart}" in out and chart.read_bytes()[:8] == PNG_SIGNATURE
    assert re.search(r"amp-plus train: interrupted \(Ctrl-C\) after \d+ optimizer steps?; no final validation", err)


@pytest.mark.integration
def test_sigterm_stops_training_cleanly_and_is_named_sigterm_not_ctrl_c(tmp_path: Path) -> None:
    chart = tmp_path / "amp.png"
    argv = [sys.executable, "-m", "lightning_amp_plus", "train", *TINY_CNN, "--epochs", "100000", "--threads", "1",
            "--report", str(chart), "--progress-bar"]  # fmt: skip
    process = processes.start(argv)
    try:
        seen = processes.read_until(process, b"Epoch 0:", timeout=120)
        assert b"Epoch 0:" in seen, seen
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        rest, err = processes.finish(process, timeout=60, what="amp-plus train after SIGTERM")
    finally:
        processes.kill_group(process)
    out = seen.decode() + rest
    assert process.returncode == 143, err  # 128 + SIGTERM, as a shell reports it
    assert "Traceback" not in out + err and "Ctrl-C)" not in err
    assert re.search(r"MixedPrecisionMonitor: \d+ optimizer steps?, 0 skipped", out), out[-2000:]
    assert f"chart written to {chart}" in out and chart.read_bytes()[:8] == PNG_SIGNATURE
    assert re.search(r"amp-plus train: terminated \(SIGTERM\) after \d+ optimizer steps?; no final validation", err)


@pytest.mark.integration
def test_ctrl_c_with_a_ckpt_dir_says_which_checkpoint_resume_continues_from(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    # 100 steps an epoch: a checkpoint at each epoch's end, and Ctrl-C inside the next epoch. Should it come during a
    # save, the message still gives the step the file holds (test_cli_resume.py pins that case).
    long_epochs = [*TINY_CNN, "--num-train", "800", "--epochs", "100000", "--threads", "1", "--ckpt-dir", str(ckpt)]
    process = processes.start([sys.executable, "-m", "lightning_amp_plus", "train", *long_epochs])
    try:
        deadline = time.monotonic() + 150
        while not (ckpt / "last.ckpt").exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert (ckpt / "last.ckpt").exists(), "no checkpoint was saved"
        time.sleep(0.3)
        process.send_signal(signal.SIGINT)
        _, err = processes.finish(process, timeout=60, what="amp-plus train after Ctrl-C")
    finally:
        processes.kill_group(process)
    assert process.returncode == 130, err
    saved = torch.load(ckpt / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    assert (
        f"; no final validation. {ckpt / 'last.ckpt'} holds the last checkpoint (step {saved}): the same command with "
        "--resume continues from it"
    ) in err, err


@pytest.mark.integration
def test_ctrl_c_after_the_run_has_finished_does_not_turn_its_success_into_an_interrupt() -> None:
    # The result is printed; the interpreter then takes a moment to exit (torch's and Lightning's exit handlers).
    argv = [sys.executable, "-m", "lightning_amp_plus", "train", *TINY_CNN, "--max-steps", "2", "--threads", "1"]
    process = processes.start(argv)
    try:
        seen = processes.read_until(process, b"val/acc", timeout=180)
        assert b"val/acc" in seen, seen
        time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        _, err = processes.finish(process, timeout=60, what="amp-plus train after a late Ctrl-C")
    finally:
        processes.kill_group(process)
    assert process.returncode == 0 and "Traceback" not in err and "interrupted" not in err, err


@pytest.mark.integration
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two processes on the CPU need two cores")
def test_several_cpu_processes_print_the_result_once_with_the_steps_each_process_takes() -> None:
    # 32 samples in batches of 8 over 2 processes: each takes 16 samples an epoch, 2 steps. --lightning-info shows
    # Lightning's tips too, among them its advice to log epoch-level metrics with sync_dist=True under DDP.
    done = run_command("train", *TINY_CNN, "--devices", "2", "--epochs", "2", "--threads", "1", "--lightning-info",
                       "--precision", "bf16-mixed", timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    start = (
        "amp-plus train cnn: bf16-mixed on cpu x 2, synthetic data, 2 epochs of 2 steps, 1 thread each (--threads) "
        "(Ctrl-C stops cleanly"
    )
    assert done.stdout.count(start) == 1  # the line before fit, from one process
    assert done.stdout.count("MixedPrecisionMonitor: 4 optimizer steps") == 1
    assert "amp-plus train cnn: bf16-mixed on cpu x 2, synthetic data, 4 steps (2.0 epochs) in " in done.stdout
    assert done.stdout.count("val/acc ") == 1
    assert "sync_dist" not in done.stderr  # the shipped model logs its epoch loss across processes


# ------------------------------------------------------------------------------------------- entry points
@pytest.mark.integration
def test_the_command_line_imports_neither_torch_nor_lightning_to_answer_help_or_refuse_a_flag() -> None:
    code = (
        "import sys\n"
        "from lightning_amp_plus.cli import main\n"
        "for argv in (['--help'], ['train', '--seed', '-1'], ['train', '--report', 'x.txt'], "
        "['compare', '--steps', '2', '--warmup', '2']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'lightning', 'matplotlib') if m in sys.modules))\n"
    )
    done = processes.run([sys.executable, "-c", code], timeout=60)
    assert "HEAVY []" in done.stdout, done.stdout + done.stderr


def test_the_package_exposes_its_public_names_on_first_use() -> None:
    import lightning_amp_plus

    assert lightning_amp_plus.__all__ == [
        "DynamicLossScaler",
        "FSDPMixedPrecisionPlugin",
        "MixedPrecisionMonitor",
        "MixedPrecisionPlugin",
        "SpikeGuard",
    ]
    assert set(lightning_amp_plus.__all__) <= set(dir(lightning_amp_plus))
    assert lightning_amp_plus.MixedPrecisionPlugin is MixedPrecisionPlugin
    with pytest.raises(AttributeError, match="has no attribute 'Missing'"):
        _ = lightning_amp_plus.Missing


def test_no_command_prints_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: amp-plus" in out and all(command in out for command in ("train", "compare", "doctor"))


def test_python_m_lightning_amp_plus_runs_amp_plus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["python -m lightning_amp_plus", "doctor", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("lightning_amp_plus", run_name="__main__")
    assert exit_info.value.code == 0
    assert "usage: amp-plus doctor" in capsys.readouterr().out
