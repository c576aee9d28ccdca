"""`amp-plus` through its real entry point: errors first, on one line, with "did you mean"; plain warnings; quiet runs.

Each case starts `python -m lightning_amp_plus` in a fresh process, as a user's shell does. A refused flag costs no
torch import there (a few hundred ms a case).
"""

from __future__ import annotations

import re

import pytest
from processes import amp_plus

TINY = ["--num-train", "16", "--num-val", "8", "--batch-size", "8", "--width", "2", "--accelerator", "cpu",
        "--threads", "1"]  # fmt: skip
SOURCE_LINE = re.compile(r"\.py:\d+")  # how Python words a warning's origin: /path/to/precision.py:419


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["train", "--precision", "fp16"], "amp-plus train: error: argument --precision: invalid choice: 'fp16'; did "
         "you mean '16-mixed'? (choose from 'auto', '32-true', '16-mixed', 'bf16-mixed', 'bf16-true', 'fp8-mixed')"),
        (["train", "--precision", "bf16"], "invalid choice: 'bf16'; did you mean 'bf16-mixed'?"),
        (["train", "--precision", "FP32"], "invalid choice: 'FP32'; did you mean '32-true'?"),
        (["train", "--precision=float16"], "invalid choice: 'float16'; did you mean '16-mixed'?"),
        (["train", "--precison", "16-mixed"], "amp-plus train: error: unrecognized argument --precison; did you mean "
         "--precision? `amp-plus train --help` lists the options."),
        (["train", "--steps", "4"], "unrecognized argument --steps; did you mean --max-steps?"),
        (["train", "cnns"], "amp-plus train: error: argument model: invalid choice: 'cnns'; did you mean 'cnn'? "
         "(choose from 'cnn', 'lstm')"),
        (["trian", "cnn"], "amp-plus: error: argument COMMAND: invalid choice: 'trian'; did you mean 'train'?"),
        (["compare", "--configs", "ours-fp16"], "invalid choice: 'ours-fp16'; did you mean 'ours-16-mixed'?"),
        (["train", "--accelerator", "gpu"], "invalid choice: 'gpu'; did you mean 'cuda'?"),
        (["train", "--bogus"], "amp-plus train: error: unrecognized argument --bogus. `amp-plus train --help` lists"),
    ],
)  # fmt: skip
def test_a_flag_error_comes_first_on_one_line_with_the_near_miss_it_meant(argv: list[str], error: str) -> None:
    done = amp_plus(*argv, timeout=60)
    assert done.returncode == 2, done.stderr
    assert re.match(r"amp-plus( train| compare)?: error: ", done.stderr)  # the error first, naming the command
    assert error in done.stderr
    assert done.stderr.count("\n") == 1 and "usage:" not in done.stderr  # one paragraph: no usage block before it
    assert done.stdout == "" and "Traceback" not in done.stderr


def test_the_help_and_the_error_call_the_positional_argument_the_model() -> None:
    helped = amp_plus("train", "--help", timeout=60)
    assert "usage: amp-plus train [-h] [--data" in helped.stdout and "[model]" in helped.stdout
    assert "model                 the model: cnn" in helped.stdout and "task" not in helped.stdout


def test_the_help_says_which_skipped_steps_stop_training() -> None:
    # A run that skips more steps in a row than --max-consecutive-skips while the scale comes down goes on: the help
    # must not promise that any such run stops.
    helped = " ".join(amp_plus("train", "--help", timeout=60).stdout.split())
    flag = "--max-consecutive-skips MAX_CONSECUTIVE_SKIPS"
    assert f"{flag} skipped steps in a row that backing off could not help" in helped
    assert "Skips while the loss scale comes down from its initial value do not count" in helped


def test_version_prints_the_packages_version_and_exits_0() -> None:
    from lightning_amp_plus import __version__

    done = amp_plus("--version", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"amp-plus {__version__}\n" and done.stderr == ""


def test_a_flag_far_from_any_other_gets_no_guess() -> None:
    done = amp_plus("train", "--precision", "int4", timeout=60)  # (fp8 is near fp8-mixed now)
    assert done.returncode == 2
    assert "invalid choice: 'int4' (choose from" in done.stderr and "did you mean" not in done.stderr


def test_train_without_a_model_says_it_chose_cnn_and_words_warnings_as_sentences_without_lightnings_noise() -> None:
    # fp16 on CPU: the plugin warns that it is slow (a Python warning, printed from precision.py).
    done = amp_plus("train", *TINY, "--precision", "16-mixed", "--max-steps", "2", timeout=180)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("amp-plus train cnn (no model named, so the default; `amp-plus train lstm` trains the ")
    assert "warning: MixedPrecisionPlugin('16-mixed') on CPU: fp16 autocast is correct there but slow" in done.stderr
    assert not SOURCE_LINE.search(done.stderr), done.stderr  # no /path/to/file.py:419 in front of it
    everything = done.stdout + done.stderr
    for noise in ("UserWarning", "does not have many workers", "Total Flops", "LeafSpec", "GPU available", "litlogger",
                  "sync_dist", "`Trainer.fit` stopped"):  # fmt: skip
        assert noise not in everything, noise


def test_with_lightnings_summary_and_info_lines_shown_none_of_its_noise_comes_with_them() -> None:
    done = amp_plus("train", *TINY, "--max-steps", "2", "--model-summary", "--lightning-info", timeout=180)
    assert done.returncode == 0, done.stderr
    everything = done.stdout + done.stderr
    assert "Total params" in everything and "GPU available" in everything  # what was asked for is there
    for noise in ("Trainer already configured with model summary", "is not supported by the model summary",
                  "LeafSpec"):  # fmt: skip
        assert noise not in everything, noise


def test_a_named_model_is_not_said_to_be_a_default() -> None:
    done = amp_plus("train", "lstm", "--num-train", "16", "--num-val", "8", "--batch-size", "8", "--hidden-dim", "2",
                    "--embed-dim", "2", "--max-len", "9", "--accelerator", "cpu", "--threads", "1", "--max-steps", "1",
                    "--precision", "32-true", timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("amp-plus train lstm: 32-true on cpu")
