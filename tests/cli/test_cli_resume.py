"""`amp-plus train --ckpt-dir DIR [--resume]` through the real entry point: continue a run, never mix two runs."""

from __future__ import annotations

import argparse
import io
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import usage_error
from processes import REPO, amp_plus

from lightning_amp_plus.cli import train

pytestmark = pytest.mark.integration  # starts processes or runs whole commands

# 32 images in batches of 8: 4 steps an epoch.
TINY = ["cnn", "--num-train", "32", "--num-val", "16", "--batch-size", "8", "--width", "2", "--accelerator", "cpu",
        "--threads", "1", "--precision", "16-mixed"]  # fmt: skip


def snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def saved_step(checkpoint: Path) -> int:
    return int(torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"])


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder of a 6-step run: stopped by --max-steps in the middle of its second epoch."""
    folder = tmp_path_factory.mktemp("base") / "ckpt"
    done = amp_plus("train", *TINY, "--max-steps", "6", "--ckpt-dir", str(folder), timeout=180)
    assert done.returncode == 0, done.stderr
    assert saved_step(folder / "last.ckpt") == 6
    return folder


@pytest.fixture
def ckpt(six_steps: Path, tmp_path: Path) -> Path:
    """A copy of the 6-step run's folder, for a test to change (a moved folder, as Lightning's checkpoint sees it)."""
    return Path(shutil.copytree(six_steps, tmp_path / "ckpt"))


def test_resume_continues_from_last_ckpt_to_the_new_target_says_so_and_overwrites_only_last_ckpt(ckpt: Path) -> None:
    before = snapshot(ckpt)
    done = amp_plus("train", *TINY, "--max-steps", "12", "--ckpt-dir", str(ckpt), "--resume", timeout=180)
    assert done.returncode == 0, done.stderr
    assert f"resuming from {ckpt / 'last.ckpt'} at step 6: 6 steps more, to step 12" in done.stdout
    assert "12 steps (3.0 epochs; 6 in this run, resumed at step 6)" in done.stdout
    assert "MixedPrecisionMonitor: 6 optimizer steps" in done.stdout  # this run's steps, not a restart from 0
    after = snapshot(ckpt)
    assert saved_step(ckpt / "last.ckpt") == 12  # last.ckpt is the continued run's, not a last-v1.ckpt beside it
    assert "last-v1.ckpt" not in after and "epoch=2-step=12.ckpt" in after
    # Nothing else was rewritten: a file of the first run is either as it was or rotated out (the latest epoch's
    # checkpoint is kept, as in an uninterrupted run).
    changed = [name for name in before if name in after and after[name] != before[name]]
    assert changed == ["last.ckpt"]
    # On again, by epochs this time: to the end of epoch 5 (step 20), not steps short.
    done = amp_plus("train", *TINY, "--epochs", "5", "--ckpt-dir", str(ckpt), "--resume", timeout=180)
    assert done.returncode == 0, done.stderr
    assert "resuming from" in done.stdout and "to step 20" in done.stdout
    assert "20 steps (5.0 epochs; 8 in this run, resumed at step 12)" in done.stdout
    assert saved_step(ckpt / "last.ckpt") == 20


def test_a_ckpt_dir_holding_a_run_is_refused_before_any_training_naming_resume(ckpt: Path) -> None:
    before = {path: path.stat().st_mtime_ns for path in ckpt.iterdir()}
    done = amp_plus("train", *TINY, "--max-steps", "12", "--ckpt-dir", str(ckpt), timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"amp-plus train: error: --ckpt-dir {ckpt} already holds epoch=1-step=6.ckpt, ")
    assert f"add --resume (it continues from {ckpt / 'last.ckpt'})" in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert {path: path.stat().st_mtime_ns for path in ckpt.iterdir()} == before  # nothing touched


@pytest.mark.parametrize(
    ("make", "argv", "fragment"),
    [
        ("nothing", ["--ckpt-dir", "{folder}", "--resume"], "--resume: --ckpt-dir {folder} does not exist, so there is "
         "no run to continue ({folder}/last.ckpt is missing). Drop --resume to start a new run there"),
        ("empty", ["--ckpt-dir", "{folder}", "--resume"], "--ckpt-dir {folder} is empty, so there is no run"),
        ("other", ["--ckpt-dir", "{folder}", "--resume"], "--ckpt-dir {folder} holds no last.ckpt, so there is no run"),
        # No last.ckpt there, so no last-v1.ckpt either: only what is true of this folder is said.
        ("other", ["--ckpt-dir", "{folder}"], "--ckpt-dir {folder} already holds notes.txt: a new run would put its "
         "checkpoints beside them. There is no last.ckpt there for --resume to continue from: give an empty or new "
         "folder."),
        ("nothing", ["--resume"], "--resume continues the run saved in a --ckpt-dir folder: give --ckpt-dir DIR"),
    ],
)  # fmt: skip
def test_resume_without_a_run_to_continue_is_a_clear_error(
    make: str, argv: list[str], fragment: str, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpt"
    if make != "nothing":
        folder.mkdir()
    if make == "other":
        (folder / "notes.txt").write_text("mine")
    done = amp_plus("train", *TINY, *(part.format(folder=folder) for part in argv), timeout=60)
    assert done.returncode == 2, done.stderr
    assert fragment.format(folder=folder) in done.stderr and done.stderr.count("\n") == 1
    assert "last-v1.ckpt" not in done.stderr
    assert not folder.exists() if make == "nothing" else (folder / "last.ckpt").exists() is False


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--max-steps", "12", "--width", "3"], "was saved by a run set up differently: --width 2 there, 3 here. A "
         "resumed run continues the same model, data and precision"),
        (["--max-steps", "12", "--batch-size", "4"], "--batch-size 8 there, 4 here"),
        (["--max-steps", "12", "--precision", "bf16-mixed"], "--precision '16-mixed' there, 'bf16-mixed' here"),
        (["--max-steps", "6"], "is at step 6 already, and this run ends at step 6, so there is nothing left to train. "
         "Ask for more: --max-steps above 6"),
        (["--epochs", "1"], "and this run ends at step 4, so there is nothing left to train"),
    ],
)  # fmt: skip
def test_resume_that_cannot_continue_the_saved_run_is_refused_before_training(
    argv: list[str], fragment: str, ckpt: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning.pytorch as pl

    def fit(*args: object, **kwargs: object) -> None:
        raise AssertionError("training started before the checkpoint was checked")

    monkeypatch.setattr(pl.Trainer, "fit", fit)
    before = snapshot(ckpt)
    tiny = [arg for arg in TINY if arg not in ("--precision", "16-mixed")] if "--precision" in argv else TINY
    err = usage_error(["train", *tiny, *argv, "--ckpt-dir", str(ckpt), "--resume"], capsys)
    assert fragment in err, err
    assert snapshot(ckpt) == before


def test_a_bf16_true_run_resumes_with_its_compensation_named_or_not_and_refuses_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Without --compensation a bf16-true run is Kahan-compensated: the checkpoint records that, so naming it on resume
    # is the same run, and another compensation is refused naming the flag and both values.
    folder = tmp_path / "ckpt"
    bf16_true = [arg for arg in TINY if arg != "16-mixed"] + ["bf16-true"]
    done = amp_plus("train", *bf16_true, "--max-steps", "2", "--ckpt-dir", str(folder), timeout=180)
    assert done.returncode == 0, done.stderr
    before = snapshot(folder)
    err = usage_error(
        [
            "train",
            *bf16_true,
            "--compensation",
            "stochastic",
            "--max-steps",
            "4",
            "--ckpt-dir",
            str(folder),
            "--resume",
        ],
        capsys,
    )
    assert "--compensation 'kahan' there, 'stochastic' here" in err, err
    assert snapshot(folder) == before
    done = amp_plus(
        "train", *bf16_true, "--compensation", "kahan", "--max-steps", "4", "--ckpt-dir", str(folder), "--resume",
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "resuming from" in done.stdout and saved_step(folder / "last.ckpt") == 4


def test_the_resume_refusal_lists_what_may_change_as_the_docs_do(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", *TINY, "--max-steps", "12", "--width", "3", "--ckpt-dir", str(ckpt), "--resume"]
    err = usage_error(argv, capsys)
    said = re.search(r"\(only (.*) may change\)", err)
    documented = re.search(r"What may change on resume: (.*?)\. What may not", (REPO / "docs/resuming.md").read_text(),
                           re.DOTALL)  # fmt: skip
    assert said is not None and documented is not None, err
    assert "the console flags" in said.group(1) and "the console flags" in documented.group(1)
    flags = set(re.findall(r"--[a-z-]+", said.group(1)))
    assert flags == set(re.findall(r"--[a-z-]+", documented.group(1)))
    assert {"--threads", "--devices", "--num-workers", "--data-dir"} <= flags


def broken_checkpoint(kind: str) -> bytes:
    """A last.ckpt that is no checkpoint: one holding a Python object besides tensors, garbage, or a cut-off file."""
    whole = io.BytesIO()
    torch.save({"state_dict": {}, "global_step": 2}, whole)
    if kind == "object":
        holding = io.BytesIO()
        torch.save({"state_dict": {}, "made_by": Path("somewhere")}, holding)  # a class weights_only refuses
        return holding.getvalue()
    return b"not a checkpoint at all " * 8 if kind == "garbage" else whole.getvalue()[:200]


@pytest.mark.parametrize("kind", ["object", "garbage", "cut-off"])
def test_an_unreadable_last_ckpt_is_refused_without_advice_to_unpickle_it(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "last.ckpt").write_bytes(broken_checkpoint(kind))
    err = usage_error(["train", *TINY, "--max-steps", "4", "--ckpt-dir", str(folder), "--resume"], capsys)
    assert f"--resume: {folder / 'last.ckpt'} could not be read as a checkpoint (" in err
    assert "Remove it to start a new run in that folder, or choose another --ckpt-dir." in err
    # torch's own message advises re-running with weights_only=False: that would run whatever code the file holds.
    for advice in ("weights_only` set to `False`", "weights_only=False", "Re-running", "trust"):
        assert advice not in err, err
    if kind == "object":
        assert "it holds Python objects besides tensors and plain values" in err


def test_after_ctrl_c_the_message_gives_the_step_the_checkpoint_file_holds(tmp_path: Path) -> None:
    # A Ctrl-C between the start of a save and its write leaves the previous checkpoint in the file: the message reads
    # the step from the file, never from the save the run began (which said step 200 where the file held 100).
    last = tmp_path / "last.ckpt"
    torch.save({"global_step": 100, "state_dict": {}}, last)
    said = train._saved(argparse.Namespace(ckpt_dir=str(tmp_path)))
    assert said == f". {last} holds the last checkpoint (step 100): the same command with --resume continues from it"
    last.write_bytes(b"cut short")
    said = train._saved(argparse.Namespace(ckpt_dir=str(tmp_path)))
    assert said == f". {last} could not be read as a checkpoint: remove it to start over in {tmp_path}"


def test_resumes_help_says_what_the_checkpoint_restores_and_that_the_flags_are_not_among_it() -> None:
    # It read "(the other flags as in that run)", as if --resume restored them: it restores the run's state and checks
    # the flags given again against the checkpoint's record.
    from lightning_amp_plus.cli import build_parser

    (resume,) = [a for a in build_parser().commands["train"]._actions if "--resume" in a.option_strings]
    assert resume.help is not None
    assert "Restored from the checkpoint: the weights, the optimizer and LR scheduler, the step count" in resume.help
    assert "Not restored: the flags (give that run's again" in resume.help
