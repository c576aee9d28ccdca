"""Training processes that die with the command that started them.

``amp-plus train --devices N`` on CPU (or on N GPUs) runs as N processes: Lightning's launcher starts the same command
N - 1 more times. If the first one dies without tearing them down (the kernel's out-of-memory killer, ``kill -9``, a
closed terminal's SIGKILL), the others would live on, waiting for it in a collective and holding their memory, until
killed by hand. Here each of them asks the kernel (Linux ``prctl(PR_SET_PDEATHSIG)``) to be killed when its parent
dies.

Pure Python (``ctypes``): :func:`die_with_launcher` runs first thing in every ``amp-plus`` process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LAUNCHER_PID", "die_with_launcher", "launching_workers"]

LAUNCHER_PID = "AMP_PLUS_LAUNCHER_PID"
"""The environment variable that tells a worker the process id of the command that launched it."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@contextmanager
def launching_workers(threads: int | None = None) -> Iterator[None]:
    """While inside, processes started from this one (Lightning's launcher copies the environment) know its id.

    Args:
        threads: the CPU threads each of them takes (``OMP_NUM_THREADS``, which torch reads at import and which
            keeps Lightning's launcher from choosing its own); ``None`` leaves it alone.

    Examples:
        >>> with launching_workers(threads=1):
        ...     os.environ[LAUNCHER_PID] == str(os.getpid()), os.environ["OMP_NUM_THREADS"]
        (True, '1')
        >>> LAUNCHER_PID in os.environ
        False
    """
    inherited = {LAUNCHER_PID: str(os.getpid())}
    if threads is not None:
        inherited["OMP_NUM_THREADS"] = str(threads)
    before = {name: os.environ.get(name) for name in inherited}
    os.environ.update(inherited)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def die_with_launcher() -> None:
    """In a worker that an ``amp-plus`` command launched: be killed (SIGKILL) when that command's process dies.

    Does nothing in any other process. SIGKILL, not SIGTERM: Lightning handles SIGTERM (for cluster schedulers) and a
    worker waiting in a collective would not act on it. If the launcher died before the request took effect, the
    worker exits at once.
    """
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or str(os.getpid()) == launcher or os.environ.get("LOCAL_RANK", "0") == "0":
        return
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(launcher):  # orphaned already: nobody would ever wait for this worker
        os._exit(1)
