"""The example scripts run as documented (tiny settings)."""

from __future__ import annotations

import importlib.util
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import processes
import pytest
from helpers import load_script

pytestmark = pytest.mark.integration  # starts processes or runs whole commands

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> ModuleType:
    return load_script(EXAMPLES / f"{name}.py", f"example_{name}")


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


def test_fabric_example_skips_its_injected_nan_learns_and_resumes_from_its_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    example = load("fabric_loop")
    straight = example.main(["--steps", "80", "--fault-at", "20", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert straight["steps"] == 80 and straight["skipped_steps"] == 1
    assert (
        "step 20: skipped, non-finite gradients in 28 tensors: ['tokens.weight', 'positions.weight'] and 26 more" in out
    )
    assert "80 optimizer steps, 1 skipped (1.2%) at step 20" in out  # the monitor's summary
    assert straight["loss"] < 2.0  # from ln 64 = 4.16 towards the data's floor, ln 4 = 1.39
    assert straight["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "checkpoint.ckpt").exists()  # saved at step 40
    resumed = example.main(["--steps", "80", "--fault-at", "20", "--out", str(tmp_path / "again"), "--resume",
                            str(tmp_path / "checkpoint.ckpt")])  # fmt: skip
    assert resumed["skipped_steps"] == 1  # restored with the plugin's state
    for p, q in zip(straight["parameters"], resumed["parameters"], strict=True):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------------------------ LightningCLI examples
CONFIGS = EXAMPLES / "configs"
# The LightningCLI examples need jsonargparse (the `cli` extra); without it they are not run.
needs_jsonargparse = pytest.mark.skipif(
    importlib.util.find_spec("jsonargparse") is None, reason="the LightningCLI examples need jsonargparse"
)
# LightningCLI warns when given args while sys.argv holds pytest's: that is how tests call it.
_args_warning = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")


def cli_args(test: Callable[..., None]) -> Callable[..., None]:
    """A test of a LightningCLI example, called in this process with ``args``: needs jsonargparse."""
    return needs_jsonargparse(_args_warning(test))


TINY_TRAINER = [
    "--trainer.max_steps=2",
    "--trainer.accelerator=cpu",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


@cli_args
def test_cifar_cnn_example_builds_the_plugin_and_monitor_from_amp_flags(tmp_path: Path) -> None:
    from lightning_amp_plus import MixedPrecisionMonitor, MixedPrecisionPlugin
    from lightning_amp_plus.data import SyntheticCIFAR10DataModule

    cli = load("cifar_cnn").main(
        [
            "fit",
            *TINY_TRAINER,
            f"--trainer.default_root_dir={tmp_path}",
            "--model.width=2",
            "--data.num_train=16",
            "--data.num_val=8",
            "--data.batch_size=8",
            "--amp.precision=16-mixed",
            "--amp.init_scale=1024",
        ]
    )
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, MixedPrecisionPlugin) and plugin.scaler is not None
    assert plugin.scaler.get_scale() == 1024.0  # two clean steps, far from the growth interval: the flag's value
    assert any(isinstance(callback, MixedPrecisionMonitor) for callback in cli.trainer.callbacks)
    assert isinstance(cli.datamodule, SyntheticCIFAR10DataModule)  # the default data module
    assert cli.trainer.global_step == 2


@cli_args
def test_imdb_lstm_example_runs_from_its_yaml_config_with_the_vocabulary_linked(tmp_path: Path) -> None:
    cli = load("imdb_lstm").main(
        [
            "fit",
            f"--config={CONFIGS / 'lstm_synthetic.yaml'}",
            *TINY_TRAINER,
            f"--trainer.default_root_dir={tmp_path}",
            "--model.hidden_dim=2",
            "--model.embed_dim=2",
            "--data.num_train=16",
            "--data.num_val=8",
            "--data.batch_size=8",
            "--data.vocab_size=40",
            "--data.min_len=3",
            "--data.max_len=9",
        ]
    )
    assert cli.trainer.precision == "bf16-mixed"
    assert cli.model.hparams["vocab_size"] == cli.datamodule.vocab_size == 40
    assert cli.trainer.global_step == 2


@cli_args
@pytest.mark.parametrize(
    ("script", "config", "precision", "master_weights"),
    [
        ("cifar_cnn", "cnn_synthetic.yaml", "bf16-mixed", False),
        ("cifar_cnn", "cnn_cifar10_fp16.yaml", "16-mixed", True),
        ("imdb_lstm", "lstm_synthetic.yaml", "bf16-mixed", False),
        ("imdb_lstm", "lstm_imdb.yaml", "bf16-mixed", False),
    ],
)
def test_every_example_config_builds_its_trainer(
    script: str, config: str, precision: str, master_weights: bool, tmp_path: Path
) -> None:
    # Nothing runs or downloads: the classes are only instantiated (real data modules fetch data in prepare_data).
    cli = load(script).main([f"--config={CONFIGS / config}", f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert cli.trainer.precision == precision
    settings = getattr(cli.trainer.precision_plugin, "settings", None)  # ours; Lightning's own plugin has none
    assert (settings is not None and settings.master_weights) is master_weights


@cli_args
def test_cnn_example_runs_32_true_without_a_plugin_but_with_the_monitor(tmp_path: Path) -> None:
    from lightning_amp_plus import MixedPrecisionMonitor, MixedPrecisionPlugin

    cli = load("cifar_cnn").main(
        [
            f"--config={CONFIGS / 'cnn_synthetic.yaml'}",
            "--amp.precision=32-true",
            "--trainer.accelerator=cpu",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        run=False,
    )
    assert cli.trainer.precision == "32-true"
    assert not isinstance(cli.trainer.precision_plugin, MixedPrecisionPlugin)
    assert any(isinstance(callback, MixedPrecisionMonitor) for callback in cli.trainer.callbacks)


@cli_args
def test_the_trainers_own_precision_flag_wins_over_amp_left_at_its_defaults(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_amp_plus import MixedPrecisionMonitor, MixedPrecisionPlugin

    cli = load("cifar_cnn").main(
        [*TINY_TRAINER, f"--trainer.default_root_dir={tmp_path}", "--trainer.precision=bf16-mixed", "--model.width=2"],
        run=False,
    )
    plugin = cli.trainer.precision_plugin
    assert type(plugin) is MixedPrecision and cli.trainer.precision == "bf16-mixed"  # Lightning's built-in, as asked
    assert not isinstance(plugin, MixedPrecisionPlugin)
    assert any(isinstance(callback, MixedPrecisionMonitor) for callback in cli.trainer.callbacks)


@cli_args
def test_a_precision_plugin_in_trainer_plugins_is_the_one_used(tmp_path: Path) -> None:
    from lightning_amp_plus import MixedPrecisionPlugin

    cli = load("imdb_lstm").main(
        [
            f"--config={CONFIGS / 'lstm_synthetic.yaml'}",
            *TINY_TRAINER,
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.plugins=lightning_amp_plus.MixedPrecisionPlugin",
            "--trainer.plugins.precision=16-mixed",
        ],
        run=False,
    )
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, MixedPrecisionPlugin) and cli.trainer.precision == "16-mixed"  # theirs, not --amp's bf16


@cli_args
def test_trainer_precision_and_changed_amp_settings_together_stop_with_the_flag_to_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    both = [f"--trainer.default_root_dir={tmp_path}", "--trainer.precision=16-mixed", "--amp.master_weights=true"]
    with pytest.raises(SystemExit) as exit_info:
        load("cifar_cnn").main([*TINY_TRAINER, *both], run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--trainer.precision 16-mixed and --amp.* (master_weights=True) both set the precision. Use one" in err
    assert "Traceback" not in err


TINY_CNN = ["--model.width=2", "--data.num_train=16", "--data.num_val=8", "--data.batch_size=8"]


@needs_jsonargparse
def test_with_the_logger_off_the_example_saves_no_config_and_leaves_the_users_config_yaml_alone(tmp_path: Path) -> None:
    # As a user runs it: the script as a program, from a folder that holds a config.yaml of their own. The synthetic
    # config turns the logger off, so the run has no folder; Lightning would have written config.yaml here.
    mine = tmp_path / "config.yaml"
    mine.write_text("# my own notes\nmine: true\n")
    argv = [sys.executable, str(EXAMPLES / "cifar_cnn.py"), "fit", f"--config={CONFIGS / 'cnn_synthetic.yaml'}",
            *TINY_TRAINER, *TINY_CNN]  # fmt: skip
    done = processes.run(argv, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert mine.read_text() == "# my own notes\nmine: true\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # nothing else written in the folder
    assert "Config not saved: no logger, so the run has no folder of its own" in done.stderr


@cli_args
def test_with_a_logger_each_run_saves_its_config_in_its_own_version_folder(tmp_path: Path) -> None:
    mine = tmp_path / "config.yaml"
    mine.write_text("mine: true\n")
    argv = ["fit", f"--config={CONFIGS / 'cnn_synthetic.yaml'}", *TINY_TRAINER, *TINY_CNN, "--trainer.logger=true",
            "--trainer.log_every_n_steps=1", f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    for _ in range(2):
        load("cifar_cnn").main(argv)
    saved = sorted(tmp_path.glob("lightning_logs/version_*/config.yaml"))
    assert [p.parent.name for p in saved] == ["version_0", "version_1"]  # a fresh folder each, nothing replaced
    assert "amp:" in saved[0].read_text() and mine.read_text() == "mine: true\n"


@needs_jsonargparse
@pytest.mark.integration
def test_ctrl_c_on_a_lightningcli_example_prints_the_monitors_summary_and_writes_its_chart(tmp_path: Path) -> None:
    # Lightning's own graceful shutdown (it catches KeyboardInterrupt and exits with code 1): the monitor reports from
    # on_exception, as it does under `amp-plus train`.
    chart = tmp_path / "amp.png"
    argv = [sys.executable, str(EXAMPLES / "cifar_cnn.py"), "fit", f"--config={CONFIGS / 'cnn_synthetic.yaml'}",
            *TINY_TRAINER[1:], *TINY_CNN, "--trainer.max_epochs=100000", "--trainer.enable_checkpointing=true",
            f"--trainer.default_root_dir={tmp_path}", f"--amp.report_path={chart}"]  # fmt: skip
    process = processes.start(argv, cwd=tmp_path)
    try:
        # A checkpoint at the end of each epoch (2 steps): once one is there, training is under way.
        deadline = time.monotonic() + 180
        while not list(tmp_path.rglob("*.ckpt")) and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert list(tmp_path.rglob("*.ckpt")), "training never started"
        process.send_signal(signal.SIGINT)
        out, err = processes.finish(process, timeout=90, what="the example after Ctrl-C")
    finally:
        processes.kill_group(process)
    assert "Detected KeyboardInterrupt, attempting graceful shutdown" in err and "Traceback" not in err + out
    assert re.search(r"MixedPrecisionMonitor: \d+ optimizer steps, 0 skipped", out), out + err
    assert f"MixedPrecisionMonitor: chart written to {chart}" in out
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


LIGHTNING_NOISE = ("is not supported by the model summary", "LeafSpec", "Trainer already configured with model summary",
                   "`weights_only` was not set", "JsonargparseDeprecationWarning", "will be removed in v5")  # fmt: skip


@needs_jsonargparse
@pytest.mark.integration
def test_the_lightningcli_example_shows_none_of_lightnings_noise(tmp_path: Path) -> None:
    # The model summary on (Lightning's default), as a user runs it.
    argv = [sys.executable, str(EXAMPLES / "cifar_cnn.py"), "fit", f"--config={CONFIGS / 'cnn_synthetic.yaml'}",
            "--trainer.max_steps=2", "--trainer.accelerator=cpu", *TINY_CNN]  # fmt: skip
    done = processes.run(argv, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Total params" in done.stdout + done.stderr  # the summary was printed
    for noise in LIGHTNING_NOISE:
        assert noise not in done.stdout + done.stderr, noise


def test_the_trainer_example_shows_none_of_lightnings_noise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load("lightning_trainer").main(["--precision", "bf16-mixed", "--epochs", "2", "--root", str(tmp_path)])
    said = caplog.text + "\n".join(str(w.message) for w in caught)
    for noise in LIGHTNING_NOISE:
        assert noise not in said, noise


@pytest.mark.parametrize(("action", "skipped"), [("skip", 2), ("clip", 0)])
def test_the_spike_guard_example_catches_its_two_mislabelled_batches(
    action: str, skipped: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = load("spike_guard").main(["--action", action, "--report", str(tmp_path / "amp.png")])
    assert result == {"skipped_steps": skipped, "spikes": [150, 220]}
    assert "the spike guard judged 2 gradient-norm spikes: step 150 " in capsys.readouterr().out
    assert (tmp_path / "amp.png").is_file()
