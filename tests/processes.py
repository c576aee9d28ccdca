"""Child processes with deadlines that hold: a test that starts a process never waits on it past its deadline.

``subprocess.run(timeout=...)`` kills only the child it started: the processes that child started (the ranks of a
``--devices 2`` run) live on, and a loop that checks a deadline between blocking reads never checks it while a read
blocks. Here every child leads a process group of its own, the whole group is killed at the deadline, and reads wait
with ``select`` for at most the time left.

Pure Python (no torch), so that any test may use it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def repo_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment with the repository first on ``PYTHONPATH`` (the code under test, not an installed copy)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def start(
    argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new process group, its output piped (bytes)."""
    return subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else repo_env(),
        cwd=cwd,
        start_new_session=True,
    )


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process`` and every process it started (its process group)."""
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(process.pid, signal.SIGKILL)


def finish(process: subprocess.Popen[bytes], timeout: float, what: str = "the command") -> tuple[str, str]:
    """Wait for ``process`` at most ``timeout`` seconds; return its output. Past the deadline its group is killed.

    Raises:
        AssertionError: the deadline passed; the message holds the end of what it printed.
    """
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        out, err = process.communicate()  # the pipes close once the whole group is dead
        tail = (out + err).decode(errors="replace")[-3000:]
        raise AssertionError(
            f"{what} did not finish within {timeout} s and was killed; its output ended:\n{tail}"
        ) from None
    finally:
        kill_group(process)  # a rank left behind by a child that exited must not outlive the test
    return out.decode(errors="replace"), err.decode(errors="replace")


def run(
    argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` to its end within ``timeout`` seconds (killed with its children past it, failing the test)."""
    process = start(argv, env, cwd)
    out, err = finish(process, timeout, what=" ".join(argv[:6]))
    return subprocess.CompletedProcess(list(argv), process.returncode, out, err)


def amp_plus(*argv: str, timeout: float = 120, env: Mapping[str, str] | None = None, cwd: Path | None = None
             ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``amp-plus argv`` through the real entry point (``python -m lightning_amp_plus``), in a fresh process."""
    return run([sys.executable, "-m", "lightning_amp_plus", *argv], timeout, env, cwd)


def read_until(process: subprocess.Popen[bytes], marker: bytes, timeout: float) -> bytes:
    """Read ``process``'s stdout until ``marker`` shows, it exits, or ``timeout`` seconds pass; return what was read.

    Each read waits (``select``) only for the time left, so the deadline holds even when the process prints nothing.
    """
    assert process.stdout is not None
    fd, seen = process.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 4096)
        if not chunk:  # end of file: the process closed its output
            break
        seen += chunk
    return seen
