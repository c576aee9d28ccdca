"""`amp-plus train --spike-guard`: the flag reaches the plugin, the run says it is on, a request it cannot serve is
refused first (exit code 2, one paragraph)."""

from __future__ import annotations

import pytest
from helpers import usage_error

from lightning_amp_plus.cli import AmpSettings, build_parser
from lightning_amp_plus.cli.train import train

TINY_CNN = ["cnn", "--num-train", "32", "--num-val", "16", "--batch-size", "8", "--width", "2", "--accelerator", "cpu",
            "--threads", "1"]  # fmt: skip


@pytest.mark.parametrize("action", ["skip", "clip"])
def test_the_settings_give_the_plugin_a_guard_with_that_action_and_the_defaults(action: str) -> None:
    (plugin,) = AmpSettings("bf16-mixed", spike_guard=action).plugins("cpu")  # type: ignore[arg-type]
    guards = plugin.engine.spike_guards  # type: ignore[attr-defined]
    assert guards is not None and guards.of(0).action == action
    assert (guards.of(0).threshold, guards.of(0).warmup) == (25.0, 100)


def test_train_with_the_guard_says_so_on_its_first_line_and_in_its_result(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["train", *TINY_CNN, "--precision", "bf16-mixed", "--spike-guard", "clip",
                                      "--max-steps", "2"])  # fmt: skip
    args.progress_bar = args.model_summary = args.lightning_info = False
    result = train(args)
    assert result["spike_guard"] == "clip"
    assert "bf16-mixed, spike guard (clip) on cpu" in capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--precision", "32-true", "--spike-guard", "skip"],
         "--spike-guard judges the gradient norm that the mixed-precision plugin's check measures; --precision "
         "32-true runs no plugin. Choose a mixed precision, or drop --spike-guard."),
        (["--spike-guard", "zscore"], "invalid choice: 'zscore'"),
    ],
)  # fmt: skip
def test_a_guard_that_cannot_apply_is_refused_first(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_amp_plus.cli import train as train_module

    monkeypatch.setattr(train_module, "train", lambda *a: pytest.fail("the run started before the refusal"))
    assert error in usage_error(["train", *TINY_CNN, *argv], capsys)


def test_amp_settings_refuse_an_unknown_action_naming_the_argument() -> None:
    with pytest.raises(ValueError, match=r"`AmpSettings\(spike_guard='always'\)` must be 'skip', 'clip' or None"):
        AmpSettings("bf16-mixed", spike_guard="always")  # type: ignore[arg-type]
