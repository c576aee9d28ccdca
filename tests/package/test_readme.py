"""The README as a newcomer meets it: its snippets run as written, its commands are the ones to type, its links work
wherever it is shown (on PyPI too), and what the examples write stays out of git."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from processes import REPO

README = (REPO / "README.md").read_text()
BLOB = "https://github.com/lightning-amp-plus/lightning-amp-plus/blob/main/"
RAW = "https://raw.githubusercontent.com/lightning-amp-plus/lightning-amp-plus/main/"
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def fenced_blocks(text: str, language: str) -> list[str]:
    """The bodies of the ```language code blocks of a Markdown text, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def commands(block: str) -> list[str]:
    """The commands of a bash block: its lines that are neither empty nor comments."""
    return [line.strip() for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


# ----------------------------------------------------------------------------------------------------- snippets
SNIPPETS = fenced_blocks(README, "python")


def test_the_readme_has_its_three_usage_snippets() -> None:
    assert len(SNIPPETS) == 3  # the Trainer, Fabric and a plain loop


@pytest.mark.parametrize("snippet", SNIPPETS, ids=["trainer", "fabric", "plain-loop"])
def test_every_python_snippet_of_the_readme_runs_as_written(
    snippet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # where a snippet writes its files (the chart)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    exec(compile(snippet, "README.md", "exec"), namespace)  # as written: no name is supplied from outside


def test_the_trainer_snippet_reads_only_the_readings_that_stay_public() -> None:
    trainer = SNIPPETS[0]
    assert "recent_steps[-1]" in trainer and "skipped_steps" in trainer
    for gone in ("last_step_skipped", "last_grad_norm", "last_overflow_params", "consecutive_skips", "steps_taken"):
        assert gone not in README, gone


# ----------------------------------------------------------------------------------------------------- commands
def test_the_readme_gives_two_commands_and_a_one_line_cpu_only_variant_of_each() -> None:
    blocks = [commands(block) for block in fenced_blocks(README, "bash")]
    main, cpu_only = blocks[0], blocks[1]
    assert len(main) == 2 and len(cpu_only) == 2  # install and run; install and test
    assert main[0].endswith(".venv/bin/amp-plus train cnn") and main[1].endswith(".venv/bin/python -m pytest -n auto")
    for plain, cpu in zip(main, cpu_only, strict=True):
        # One line each: the CPU build of torch first, then the same command as the plain one.
        torch_first, rest = cpu.split(" && .venv/bin/pip install -e ", 1)
        assert CPU_INDEX in torch_first and plain.endswith(rest), (plain, cpu)


def test_the_cpu_only_command_asks_for_the_torch_the_package_accepts() -> None:
    # Without the package's own bounds, the CPU index could give a newer torch that the next `pip install -e .`
    # replaces with the CUDA build from PyPI: the 5.5 GB download the variant exists to avoid.
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    bounds = {
        name: spec
        for dep in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
        for name, spec in [re.match(r"([a-z]+)(.*)", dep).groups()]  # type: ignore[union-attr]
    }
    for command in commands(fenced_blocks(README, "bash")[1]):
        words = shlex.split(command)
        for package in ("torch", "torchvision"):
            asked = next(word for word in words if re.match(rf"{package}[<>=]", word))
            upper = re.search(r"<[\d.]+", bounds[package])
            assert upper is not None and upper.group() in asked, (package, asked, bounds[package])


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md", "docs/design.md"])
def test_the_tools_in_the_documented_commands_run_from_the_project_venv(page: str) -> None:
    text = (REPO / page).read_text()
    code = "\n".join(fenced_blocks(text, "bash") + re.findall(r"`([^`\n]+)`", text))
    # A tool named at the start of a command (line start, after `&&` or `|`) must be the venv's, like the rest.
    tools = r"pip install -e|mkdocs (?:serve|build)|ruff (?:check|format)|mypy\b|python -m pytest"
    bare = re.findall(rf"(?:^|&&|\|)\s*({tools})", code, flags=re.MULTILINE)
    assert bare == [], f"{page}: {bare}"


# -------------------------------------------------------------------------------------------------------- links
def test_every_link_and_image_of_the_readme_is_absolute_so_the_wheels_description_keeps_them() -> None:
    # The README is the wheel's long description (pyproject's `readme`): on PyPI a relative link or image breaks.
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)", README)
    assert targets
    relative = [target for target in targets if not target.startswith(("https://", "#"))]
    assert relative == []


@pytest.mark.parametrize(
    "target", sorted(set(re.findall(r"\]\((https://(?:github\.com|raw\.githubusercontent\.com)/[^)\s#]+)", README)))
)
def test_every_repository_link_of_the_readme_names_a_file_in_the_repository(target: str) -> None:
    path = target.removeprefix(BLOB).removeprefix(RAW)
    assert path != target, f"{target} is neither {BLOB}... nor {RAW}..."
    assert (REPO / path).is_file(), path


# ----------------------------------------------------------------------------------------------------- git
@pytest.mark.parametrize("folder", ["runs", "data"])
def test_the_folders_the_examples_write_by_default_are_ignored_by_git(folder: str) -> None:
    # runs/: examples/fabric_loop.py's --out; data/: the real datasets' --data-dir / --data.data_dir.
    ignored = [line.strip() for line in (REPO / ".gitignore").read_text().splitlines()]
    assert f"{folder}/" in ignored or f"/{folder}/" in ignored


# ------------------------------------------------------------------------------------------------ numbers
def test_the_readme_and_the_docs_home_give_compensated_bf16s_bytes_per_parameter_on_one_basis() -> None:
    table = {
        row.split("|")[1].strip(): int(row.split("|")[2])
        for row in README.splitlines()
        if row.startswith("| `") and re.match(r"\|[^|]+\| *\d+ *\|", row)
    }
    assert "gradients not counted" in README
    readme = (table["`bf16-true` + Kahan (default)"], table["`bf16-true` + stochastic rounding"], table["`32-true`"])
    home = (REPO / "docs" / "index.md").read_text()
    said = re.search(r"(\d+) bytes per parameter of weights, compensation and optimizer\s+state \(Kahan\) or (\d+)"
                     r" \(stochastic rounding\), against (\d+) for FP32 weights; gradients add", home)  # fmt: skip
    assert said is not None
    assert tuple(int(n) for n in said.groups()) == readme == (10, 8, 12)


def test_the_readme_says_what_gradscaler_does_when_gradients_keep_overflowing() -> None:
    # Measured here with torch's own GradScaler. From its default 2**16, halved per overflow, the scale reaches the
    # smallest float32 (2**-149) at the 165th overflow in a row and 0 at the 166th. While the gradients stay inf, every
    # step is skipped and the weights stay finite; the first finite gradient after that is multiplied by 1/0 = inf
    # after GradScaler's check (which looks at the scaled gradient, 0): that step is taken, and the weights are NaN.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    zero_after, finite_while_inf = None, True
    for step in range(1, 202):
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step <= 200:  # a gradient that is always inf, then a finite one
            model.weight.grad.fill_(float("inf"))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if zero_after is None and scaler.get_scale() == 0.0:
            zero_after = step
        if step <= 200:
            finite_while_inf &= bool(torch.isfinite(model.weight).all())
    assert zero_after == 166 and finite_while_inf
    assert torch.isnan(model.weight).all()  # step 201, the first finite gradient, was taken
    row = next(line for line in README.splitlines() if line.startswith("| Scale bounds |"))
    assert "166 overflows in a row reach scale 0" in row and "NaN weights" in row, row
