"""`amp-plus train --devices N` on CPU: N processes, checked against what the machine holds, dying with their parent."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import processes
import pytest
from helpers import usage_error

from lightning_amp_plus.cli import _machine

TINY = ["cnn", "--num-train", "32", "--num-val", "16", "--batch-size", "8", "--width", "2", "--accelerator", "cpu",
        "--threads", "1"]  # fmt: skip


def cores() -> int:
    """The cores this process may use, read independently of the code under test."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.fixture
def no_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the run's data fails the test: a refused request must be refused before it."""
    from lightning_amp_plus.cli import train

    def started(*args: object) -> None:
        raise AssertionError("the command started its work before refusing the request")

    monkeypatch.setattr(train, "load_datamodule", started)


def test_more_cpu_processes_than_cores_are_refused_first_with_one_paragraph() -> None:
    asked = cores() + 1
    started = time.monotonic()
    done = processes.amp_plus("train", *TINY, "--devices", str(asked), timeout=180)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(
        f"amp-plus train: error: --devices {asked} asks for {asked} training processes on the CPU, but this machine "
        f"has {cores()} usable core"
    )
    assert f"Use --devices {cores()} or fewer on this machine" in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stdout == ""  # no start line: nothing began
    assert time.monotonic() - started < 170


def test_more_cpu_processes_than_memory_holds_are_refused_naming_what_each_one_holds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_data: None
) -> None:
    # A machine with cores to spare and 1 GB free: four processes of at least 450 MB each do not fit.
    monkeypatch.setattr(_machine, "usable_cores", lambda: 16)
    monkeypatch.setattr(_machine, "available_memory_mb", lambda: 1000.0)
    monkeypatch.setattr(_machine, "private_memory_mb", lambda: 450.0)
    err = usage_error(["train", *TINY, "--devices", "4"], capsys)
    assert "--devices 4 asks for 4 training processes on the CPU, but each process holds at least 450 MB, " in err
    assert "1,800 MB for 4, with 1,000 MB available" in err and "Use --devices 2 or fewer" in err


def test_what_a_process_holds_is_measured_and_is_a_lower_bound_of_a_training_process() -> None:
    # This process has torch and Lightning loaded, as the command has when it checks: a training process holds more.
    import lightning  # noqa: F401

    held = _machine.private_memory_mb()
    if held is None:
        pytest.skip("this OS does not report a process's private memory (/proc/self/smaps_rollup)")
    assert held > 50
    assert (_machine.available_memory_mb() or 0.0) > 0 and _machine.usable_cores() >= 1


def test_as_many_processes_as_cores_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_machine, "usable_cores", lambda: 4)
    monkeypatch.setattr(_machine, "available_memory_mb", lambda: 100_000.0)
    from lightning_amp_plus.cli._runs import check_devices

    check_devices("cpu", 4)  # no error


# ------------------------------------------------------------------------------------------- dying with the parent
def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (Linux ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has died; only its exit status waits to be read


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and relies on Linux's PR_SET_PDEATHSIG")
@pytest.mark.skipif(cores() < 2, reason="two training processes need two cores")
def test_the_second_process_dies_when_the_command_that_started_it_is_killed() -> None:
    # As the kernel's out-of-memory killer or `kill -9` ends it: no teardown runs in the command's process.
    argv = [sys.executable, "-m", "lightning_amp_plus", "train", *TINY, "--devices", "2", "--epochs", "100000"]
    process = processes.start(argv)
    try:
        deadline, workers = time.monotonic() + 150, []
        while not workers and time.monotonic() < deadline and process.poll() is None:
            workers = children(process.pid)
            time.sleep(0.2)
        assert workers, "the second process never started"
        time.sleep(3)  # it is importing torch by now, past its first lines
        assert all(alive(worker) for worker in workers)
        os.kill(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(alive(worker) for worker in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(worker) for worker in workers), "a worker outlived the command that started it"
    finally:
        processes.kill_group(process)
        process.communicate()
