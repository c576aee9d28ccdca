"""`amp-plus compare`: one table over the configurations, its files, and what its numbers mean."""

from __future__ import annotations

import csv
import re
import subprocess
from pathlib import Path

import lightning.pytorch as pl
import processes
import pytest
import torch
from helpers import usage_error
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_amp_plus import cli
from lightning_amp_plus.cli import compare, doctor, main
from lightning_amp_plus.cli._configs import COMPARE_DEFAULT, SETUPS
from lightning_amp_plus.cli._runs import build_datamodule, build_model
from lightning_amp_plus.cli.compare import RunSpec, StepTimer, run_config_isolated

pytestmark = pytest.mark.integration  # starts processes or runs whole commands

TINY = ["--num-train", "24", "--num-val", "16", "--batch-size", "8", "--width", "2", "--accelerator", "cpu"]
CONFIGS = ["32-true", "lightning-bf16-mixed", "ours-bf16-mixed", "lightning-16-mixed", "ours-16-mixed"]


def test_compare_prints_one_table_and_writes_csv_markdown_and_chart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = {kind: tmp_path / "out" / f"table.{kind}" for kind in ("csv", "md", "png")}  # folders created
    argv = ["compare", "cnn", *TINY, "--steps", "3", "--warmup", "1", "--in-process", "--configs", *CONFIGS,
            "--csv", str(paths["csv"]), "--markdown", str(paths["md"]), "--png", str(paths["png"])]  # fmt: skip
    assert main(argv) == 0

    with open(paths["csv"], newline="") as handle:
        rows = {row["config"]: row for row in csv.DictReader(handle)}
    assert list(rows) == CONFIGS
    assert float(rows["32-true"]["ratio"]) == 1.0
    for row in rows.values():
        assert int(row["steps"]) == 3 and int(row["skipped_steps"]) == 0
        assert float(row["step_ms"]) > 0 and float(row["ratio"]) > 0 and float(row["peak_memory_mb"]) >= 0
        assert 0.0 <= float(row["val_acc"]) <= 1.0
    # Same seed, initial weights and batches everywhere; at one precision both plugins do the same arithmetic
    # (ours adds only a check, and unscaling by a power of two is exact), so their losses agree to the bit.
    for precision in ("bf16-mixed", "16-mixed"):
        ours, lightning = rows[f"ours-{precision}"], rows[f"lightning-{precision}"]
        torch.testing.assert_close(
            float(ours["final_train_loss"]), float(lightning["final_train_loss"]), rtol=0, atol=0
        )

    markdown = paths["md"].read_text().splitlines()
    assert markdown[0] == (
        "| config | step ms (median) | vs 32-true | peak memory MB | bytes/param | final train loss | val acc "
        "| skipped steps |"
    )
    assert [line.split(" | ")[0] for line in markdown[2:7]] == [f"| {name}" for name in CONFIGS]
    footer = "\n".join(markdown[7:])
    assert "median over steps 2-3 (the first 1 step warm-up)" in footer and "lower bound" in footer
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    out = capsys.readouterr().out
    assert "amp-plus compare cnn: 5 configurations x 3 steps on cpu (in this process" in out
    assert re.search(r"^ours-bf16-mixed +[\d.,]+ +[\d.]+x ", out, re.MULTILINE)


def test_compare_without_32_true_leaves_the_ratio_blank(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "lstm", "--num-train", "16", "--num-val", "8", "--batch-size", "8", "--hidden-dim", "2",
            "--embed-dim", "2", "--max-len", "9", "--accelerator", "cpu", "--steps", "2", "--warmup", "0",
            "--in-process", "--configs", "ours-bf16-mixed-master"]  # fmt: skip
    results = compare.run(cli.build_parser().parse_args(argv))
    assert [(r.config, r.ratio, r.steps) for r in results] == [("ours-bf16-mixed-master", None, 2)]
    out = capsys.readouterr().out
    assert "vs 32-true: not measured" in out
    # The final train loss averages the steps there were: "mean of the last 5 steps" read wrong for 2.
    assert "final train loss: mean of both steps;" in out and "last 5" not in out


def test_a_configuration_runs_in_its_own_process_and_reports_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker process under this test's deadline: killed (with anything it started) past it, failing the test.
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: processes.run(command, timeout=300))
    spec = RunSpec("cnn", "32-true", steps=2, warmup=1, threads=1,
                   data={"num_train": 16, "num_val": 8, "batch_size": 8}, model={"width": 2})  # fmt: skip
    result = run_config_isolated(spec)
    assert (result.config, result.steps, result.skipped_steps) == ("32-true", 2, 0)
    # A fresh process: building and training the model raised its peak resident memory above where it started.
    assert result.peak_memory_mb is not None and result.peak_memory_mb > 0


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")  # skipped steps
def test_step_timer_counts_each_grad_scaler_backoff_as_a_skipped_step() -> None:
    # A scale of 2**40 overflows fp16 activations' gradients: GradScaler skips each step and halves the scale.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    datamodule = build_datamodule("cnn", num_train=24, num_val=8, batch_size=8)
    timer = StepTimer("cpu")
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
                         callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(build_model("cnn", datamodule, width=2), datamodule=datamodule)
    assert scaler.get_scale() == 2.0**37
    assert timer.scale_drops == 3 and len(timer.seconds) == 3 and len(timer.losses) == 3


def test_compare_refuses_a_precision_this_device_cannot_run_and_says_to_leave_it_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(doctor, "autocast_supported", lambda device, dtype: (dtype != torch.float16, "no fp16 here"))
    err = usage_error(["compare", "--accelerator", "cpu"], capsys)
    assert "torch.autocast cannot run torch.float16 on cpu here (no fp16 here)" in err
    assert "leave those configurations out with --configs" in err


def test_few_steps_shorten_the_default_warm_up_instead_of_failing(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", *TINY, "--steps", "2", "--in-process", "--configs", "32-true"]
    assert main(argv) == 0  # the CPU default warm-up is 3 steps: more than --steps 2 leaves to time
    out = capsys.readouterr().out
    assert "1 configuration x 2 steps on cpu (in this process; the first 1 step warm-up)" in out
    assert "median over step 2 (the first 1 step warm-up)" in out


def test_lightning_bf16_true_runs_on_request_beside_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", *TINY, "--steps", "2", "--in-process", "--configs", "lightning-bf16-true"]
    (result,) = compare.run(cli.build_parser().parse_args(argv))
    assert (result.config, result.steps, result.skipped_steps) == ("lightning-bf16-true", 2, 0)
    assert "lightning-bf16-true" not in COMPARE_DEFAULT


def test_ctrl_c_keeps_the_finished_configurations_prints_their_table_and_writes_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    batches = 0
    original = StepTimer.on_train_batch_end

    def ctrl_c_on_the_second_configuration(self: StepTimer, *args: object) -> None:
        nonlocal batches
        batches += 1
        if batches == 3:  # the first batch of the second configuration (2 steps each)
            raise KeyboardInterrupt  # what Ctrl-C raises in the training loop
        original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(StepTimer, "on_train_batch_end", ctrl_c_on_the_second_configuration)
    table = tmp_path / "table.csv"
    argv = ["compare", *TINY, "--steps", "2", "--in-process", "--configs", "32-true", "ours-bf16-mixed",
            "--csv", str(table)]  # fmt: skip
    assert main(argv) == 130
    out, err = capsys.readouterr()
    assert re.search(r"^32-true +[\d.,]+ +1\.00x", out, re.MULTILINE)
    assert "ours-bf16-mixed  " not in out  # the unfinished one has no row
    with open(table, newline="") as handle:
        assert [row["config"] for row in csv.DictReader(handle)] == ["32-true"]
    assert "amp-plus compare: interrupted (Ctrl-C) after 1 of 2 configurations" in err
    assert "Traceback" not in out + err


def test_a_worker_that_fails_ends_the_command_with_its_output_and_exit_code_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def crash(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 1, "", "RuntimeError: out of memory")

    monkeypatch.setattr(subprocess, "run", crash)
    assert main(["compare", *TINY, "--steps", "2", "--configs", "32-true"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("amp-plus compare: stopped: configuration '32-true' failed in its worker process")
    assert "(exit code 1)" in err
    assert "RuntimeError: out of memory" in err


def test_compare_and_the_master_weight_benchmark_read_one_table_of_set_ups() -> None:
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("bench_master_under_test", bench / "bench_master.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
    assert [config.key for config in module.CONFIGS] == list(SETUPS)
    assert [config.label for config in module.CONFIGS] == [setup.label for setup in SETUPS.values()]
    assert cli.build_parser().parse_args(["compare", "--configs", *SETUPS]).configs == list(SETUPS)
