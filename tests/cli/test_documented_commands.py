"""Every command the README, the docs and the examples tell a user to type ends, in a bounded number of steps.

The commands are read from where a user reads them (code blocks of README.md and docs/*.md, the examples' docstrings,
the header comments of examples/configs/*.yaml) and run as written, with only the data and the model made tiny through
flags the command already takes (``--num-train``, ``--data.batch_size``...), never its length: the epochs and steps
are the documented ones. Real datasets, which cannot be downloaded here, are replaced by the synthetic ones of the
same shapes (a run's length does not depend on where its batches come from). A guard callback fails a run that passes
:data:`MOST_STEPS` optimizer steps: a command that would train for Lightning's default 1,000 epochs fails in seconds
instead of running for hours. Benchmarks (``python benchmarks/...``) are left out: each has its own ``--budget-s``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import pytest
from helpers import load_script
from processes import REPO

from lightning_amp_plus.cli import main

EXAMPLES = REPO / "examples"
MOST_STEPS = 250
"""More optimizer steps than any documented command takes on the tiny data (the longest: fabric_loop's 200)."""

TINY_CNN = ["--num-train", "32", "--num-val", "16", "--batch-size", "8", "--width", "2", "--threads", "1"]
TINY_LSTM = ["--num-train", "32", "--num-val", "16", "--batch-size", "8", "--hidden-dim", "4", "--embed-dim", "4",
             "--max-len", "12", "--threads", "1"]  # fmt: skip
TINY_CLI = {
    "cifar_cnn": ["--data=lightning_amp_plus.data.SyntheticCIFAR10DataModule", "--data.num_train=16",
                  "--data.num_val=8", "--data.batch_size=8", "--model.width=2"],
    "imdb_lstm": ["--data=lightning_amp_plus.data.SyntheticIMDBDataModule", "--data.num_train=16", "--data.num_val=8",
                  "--data.batch_size=8", "--data.vocab_size=40", "--data.min_len=3", "--data.max_len=9",
                  "--model.embed_dim=2", "--model.hidden_dim=2"],
}  # fmt: skip
CLI_QUIET = ["--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false"]


# ------------------------------------------------------------------------------------------------- collecting
def _normal(command: str) -> str | None:
    """A command as a user types it, or ``None`` for a line that is no command of ours (an output, a synopsis)."""
    command = re.sub(r"\s+#.*$", "", command.strip()).removeprefix("$ ").strip()
    command = command.split("&& ")[-1].replace(".venv/bin/", "")  # the README's install-and-run line: its last part
    command = re.sub(r"^(time |[A-Z_]+=\S+ )+", "", command)  # `time amp-plus ...`, `ONEDNN_MAX_CPU_ISA=AVX2 amp-plus`
    if not re.match(r"(amp-plus (train|compare|doctor)\b|python3? examples/\w+\.py)", command):
        return None
    if re.match(r"amp-plus \w+( \w+)?:", command):
        return None  # what a command printed: `amp-plus train cnn: bf16-mixed on cpu...`, `amp-plus train: error: ...`
    if re.search(r"\[|\]|\||\bPATH\b|\bDIR\b|\bN\b|\.\.\.|<", command):
        return None  # a synopsis (`[--json]`, `--report PATH.png`, `--headroom N`), not a command
    return command


def _from_markdown(text: str) -> list[tuple[str, int]]:
    """``(command, expected exit code)`` from a page's code blocks and from its inline code that is a whole command."""
    found = []
    for block in re.findall(r"^ *```[a-z]*\n(.*?)^ *```", text, flags=re.MULTILINE | re.DOTALL):
        lines = block.splitlines()
        for index, line in enumerate(lines):
            command = _normal(line)
            if command is not None:
                after = lines[index + 1].strip() if index + 1 < len(lines) else ""
                found.append((command, 2 if re.match(r"amp-plus( \w+)?: error:", after) else 0))
    # In prose, `amp-plus train --resume` names an option; a command to type names its model too.
    prose = re.sub(r"^ *```.*?^ *```", "", text, flags=re.MULTILINE | re.DOTALL)
    spans = [_normal(" ".join(span.split())) for span in re.findall(r"`([^`]+)`", prose)]
    found += [(span, 0) for span in spans if span and re.match(r"amp-plus (train|compare) (cnn|lstm)\b", span)]
    return found


def documented_commands() -> dict[str, list[tuple[str, int]]]:
    """Each source's commands, in the order a reader meets them."""
    sources: dict[str, list[tuple[str, int]]] = {}
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        sources[str(path.relative_to(REPO))] = _from_markdown(path.read_text())
    for path in sorted(EXAMPLES.glob("*.py")):
        docstring = path.read_text().split('"""')[1]
        sources[str(path.relative_to(REPO))] = [(c, 0) for line in docstring.splitlines() if (c := _normal(line))]
    for path in sorted((EXAMPLES / "configs").glob("*.yaml")):
        comments = [line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#")]
        sources[str(path.relative_to(REPO))] = [(c, 0) for line in comments if (c := _normal(line))]
    return {source: list(dict.fromkeys(found)) for source, found in sources.items() if found}


COMMANDS = documented_commands()


def first_seen(commands: dict[str, list[tuple[str, int]]]) -> dict[str, list[tuple[str, int]]]:
    """Each command under the first source that has it, once (``amp-plus train cnn`` is on four pages): a command
    that continues an earlier one (a ``--resume``) comes in the same source after it."""
    seen: set[str] = set()
    kept: dict[str, list[tuple[str, int]]] = {}
    for source, found in commands.items():
        new = [(command, code) for command, code in found if command not in seen]
        seen.update(command for command, _ in new)
        if new:
            kept[source] = new
    return kept


TO_RUN = first_seen(COMMANDS)


# ---------------------------------------------------------------------------------------------------- running
class StepGuard(pl.Callback):
    """Fails a run that passes :data:`MOST_STEPS` optimizer steps: it would not end in a bounded time."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > MOST_STEPS:
            raise AssertionError(f"more than {MOST_STEPS} optimizer steps: the command does not end by itself")


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every Trainer built meanwhile carries the :class:`StepGuard`; yields the steps each fit took."""
    steps: list[int] = []
    init, fit = pl.Trainer.__init__, pl.Trainer.fit

    @functools.wraps(init)  # its signature too: LightningCLI reads the Trainer's arguments from it
    def guarded_init(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        callbacks = kwargs.get("callbacks") or []
        kwargs["callbacks"] = [*(callbacks if isinstance(callbacks, list) else [callbacks]), StepGuard()]
        init(self, *args, **kwargs)

    @functools.wraps(fit)
    def counted_fit(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        try:
            fit(self, *args, **kwargs)
        finally:
            steps.append(self.global_step)

    monkeypatch.setattr(pl.Trainer, "__init__", guarded_init)
    monkeypatch.setattr(pl.Trainer, "fit", counted_fit)
    yield steps


def load(name: str) -> ModuleType:
    return load_script(EXAMPLES / f"{name}.py", f"documented_{name}")


def tiny_amp_plus(words: list[str]) -> list[str]:
    """``amp-plus`` arguments with tiny data and model, the run's length untouched; real data becomes synthetic."""
    command, rest = words[0], words[1:]
    real = "--data" in rest and rest[rest.index("--data") + 1] == "real"
    if real:  # the synthetic data of the same shapes, with the sizes below
        index = rest.index("--data")
        rest = rest[:index] + rest[index + 2 :]
    if command == "doctor":
        return [command, *rest]
    task = "lstm" if "lstm" in rest else "cnn"
    extra = ["--in-process"] if command == "compare" else []  # one process for all: the same steps, less start-up
    return [command, *rest, *(TINY_LSTM if task == "lstm" else TINY_CNN), *extra]


def tiny_cli(script: str, words: list[str]) -> list[str]:
    """LightningCLI arguments with tiny data and model (after the config, so they win), the length untouched."""
    if "--print_config" in words or "fit" not in words:
        return words
    joined: list[str] = []  # every `--key value` as `--key=value`
    for word in words:
        if joined and joined[-1].startswith("--") and "=" not in joined[-1] and not word.startswith("--"):
            joined[-1] += f"={word}"
        else:
            joined.append(word)
    kept = []
    for word in joined:
        key, _, value = word.partition("=")
        if key == "--config":
            kept.append(f"--config={REPO / value}")
        elif key not in ("--data", "--data.data_dir"):  # real datasets: the synthetic ones below instead
            kept.append(word)
    return [*kept, *CLI_QUIET, *TINY_CLI[script]]


def run_command(command: str) -> tuple[int, str]:
    """Run ``command`` in this process; its exit code and what it printed."""
    words = shlex.split(command)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            if words[0] == "amp-plus":
                code = main(tiny_amp_plus(words[1:]))
            else:
                script = Path(words[1]).stem
                argv = words[2:]
                if script in TINY_CLI:
                    load(script).main(tiny_cli(script, argv))
                elif script == "fabric_loop" and "--help" not in argv:
                    load(script).main([*argv, "--micro-batch", "1"])  # its --steps (200) as documented
                else:
                    load(script).main(argv)
                code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 0
    return code, out.getvalue()


# ------------------------------------------------------------------------------------------------------- tests
def test_the_documented_commands_are_found_where_users_read_them() -> None:
    found = {command for commands in COMMANDS.values() for command, _ in commands}
    assert "amp-plus train cnn" in found
    assert "python examples/cifar_cnn.py fit --config examples/configs/cnn_synthetic.yaml" in found
    assert any(command.startswith("python examples/fabric_loop.py") for command in found)
    assert "README.md" in COMMANDS and "docs/cli.md" in COMMANDS and "examples/cifar_cnn.py" in COMMANDS


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")
@pytest.mark.parametrize("source", list(TO_RUN))
def test_every_documented_command_ends_by_itself_in_a_bounded_number_of_steps(
    source: str, guarded: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a fresh folder, as a user's: what a command writes (charts, checkpoints, runs/) stays there, and commands that
    # continue an earlier one (a --resume) find what it left.
    monkeypatch.chdir(tmp_path)
    for command, expected in TO_RUN[source]:
        guarded.clear()
        code, out = run_command(command)
        assert code == expected, f"{source}: `{command}` ended with {code}, not {expected}:\n{out[-2000:]}"
        assert all(steps <= MOST_STEPS for steps in guarded), f"{source}: `{command}` took {guarded} steps"
