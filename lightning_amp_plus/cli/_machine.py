"""What this machine can hold and has free: cores, memory, a training process's share, and idle cores right now.

Pure Python (``/proc`` and ``os``; no torch), read when a command decides how many processes and threads a run gets.
Every reading falls back to ``None`` (unknown) where the OS does not offer it, and the caller then checks nothing.

* :func:`usable_cores`: the cores this process may run on (its CPU affinity, a container's CPU quota).
* :func:`available_memory_mb`: memory that can be taken without swapping (``MemAvailable``, a container's limit).
* :func:`private_memory_mb`: memory this process holds that no other process shares (its anonymous pages): a
  training process started the same way holds at least as much.
* :func:`idle_cores`: how many cores sat idle over a short sample, for the default thread count.
* :func:`cpu_processes_problem`: whether ``--devices N`` CPU processes fit, worded as the error to print.
* :func:`threads_problem`: whether ``--threads N`` fits the usable cores, worded as the error to print.
* :func:`thread_choice`: the CPU threads each training process gets when ``--threads`` is not given: the idle cores.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

from lightning_amp_plus._wording import plural

__all__ = [
    "available_memory_mb",
    "cpu_processes_problem",
    "idle_cores",
    "private_memory_mb",
    "thread_choice",
    "threads_problem",
    "usable_cores",
]

_KIB_PER_MB = 1024.0
_IDLE_ENOUGH = 0.75
"""The idle share that makes a core free for a training thread: torch's threads wait for each other at every
operation, so a thread on a core another process keeps busy a quarter of the time slows the whole step."""
_CGROUP = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a scheduler's cpuset), within a cgroup quota.

    Examples:
        >>> usable_cores() >= 1
        True
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on macOS or Windows
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def _cgroup_cpu_quota() -> float | None:
    """A container's CPU limit in cores (cgroup v2 ``cpu.max``, e.g. ``200000 100000`` is 2), ``None`` if unlimited."""
    try:
        quota, period = (_CGROUP / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def available_memory_mb() -> float | None:
    """Memory that can be taken without swapping, in MB: ``MemAvailable``, or less under a container's memory limit.

    Examples:
        >>> available_memory_mb() is None or available_memory_mb() > 0
        True
    """
    found = _meminfo_kib("MemAvailable")
    available = None if found is None else found / _KIB_PER_MB
    try:
        limit = (_CGROUP / "memory.max").read_text().strip()
        used = int((_CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return available
    if limit == "max":
        return available
    room = max(0.0, (int(limit) - used) / 2**20)
    return room if available is None else min(available, room)


def _meminfo_kib(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None


def private_memory_mb() -> float | None:
    """The memory this process holds that no other shares (its anonymous pages, ``/proc/self/smaps_rollup``), in MB.

    Shared libraries (torch's are hundreds of MB) count once however many processes load them; this is what each more
    process adds.

    Examples:
        >>> private_memory_mb() is None or private_memory_mb() > 0
        True
    """
    try:
        with open("/proc/self/smaps_rollup") as lines:
            for line in lines:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) / _KIB_PER_MB
    except (OSError, ValueError, IndexError):
        return None
    return None


def idle_cores(sample_s: float = 0.1) -> float | None:
    """How many of the usable cores sat idle over the next ``sample_s`` seconds (``/proc/stat``), ``None`` unknown.

    This process sleeps meanwhile, so what is busy is the rest of the machine. A load average would lag a minute
    behind; a sample says what is free now.

    Examples:
        >>> 0 <= (idle_cores(0.01) or 0) <= usable_cores()
        True
    """
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(sample_s)
    second = _cpu_times()
    if second is None:
        return None
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])  # idle and iowait
    if total <= 0:
        return None
    machine = os.cpu_count() or 1  # /proc/stat's first line sums every core of the machine
    return min(float(usable_cores()), machine * idle / total)


def _cpu_times() -> list[int] | None:
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 6:
        return None
    return [int(value) for value in fields[1:9]]


def cpu_processes_problem(
    devices: int, cores: int, available_mb: float | None, per_process_mb: float | None
) -> str | None:
    """Why ``devices`` training processes on the CPU do not fit this machine, as the error to print; ``None`` if they do.

    Each CPU "device" is a process of its own. More processes than cores only share the same cores (every step waits
    for the slowest, so the run is slower, never faster), and each process holds its own copy of torch, Lightning, the
    model and the data: more than memory holds ends with the kernel killing them.

    Args:
        devices: the processes asked for (``--devices``).
        cores: the usable cores (:func:`usable_cores`).
        available_mb: the memory available (:func:`available_memory_mb`; ``None``: unknown, not checked).
        per_process_mb: what one process holds at least (:func:`private_memory_mb` of this one; ``None``: unknown).

    Examples:
        >>> cpu_processes_problem(2, 2, 20000.0, 450.0) is None
        True
        >>> print(cpu_processes_problem(64, 2, 20000.0, 450.0))
        --devices 64 asks for 64 training processes on the CPU, but this machine has 2 usable cores: more processes than cores only share them, each step waiting for the slowest, so the run is slower, not faster (and each process holds at least 450 MB, 28,800 MB for 64, with 20,000 MB available). Use --devices 2 or fewer on this machine (--devices 1 trains in one process on every core).
        >>> print(cpu_processes_problem(8, 16, 3000.0, 450.0))
        --devices 8 asks for 8 training processes on the CPU, but each process holds at least 450 MB, 3,600 MB for 8, with 3,000 MB available (torch, Lightning, the model and the data in each: what this process holds now, with torch and Lightning loaded, is the least a training process holds); more than memory holds ends with the kernel killing the processes. Use --devices 6 or fewer on this machine (--devices 1 trains in one process on every core).
    """  # noqa: E501
    fits_memory = available_mb is None or per_process_mb is None or devices * per_process_mb <= available_mb
    if devices <= cores and fits_memory:
        return None
    most = cores
    if available_mb is not None and per_process_mb is not None:
        most = min(most, max(1, int(available_mb // per_process_mb)))
    memory = (
        ""
        if fits_memory or available_mb is None or per_process_mb is None
        else f"each process holds at least {per_process_mb:,.0f} MB, {devices * per_process_mb:,.0f} MB for "
        f"{devices}, with {available_mb:,.0f} MB available"
    )
    if devices > cores:
        why = (
            f"this machine has {plural(cores, 'usable core')}: more processes than cores only share them, each step "
            "waiting for the slowest, so the run is slower, not faster" + (f" (and {memory})" if memory else "")
        )
    else:
        why = (
            f"{memory} (torch, Lightning, the model and the data in each: what this process holds now, with torch and "
            "Lightning loaded, is the least a training process holds); more than memory holds ends with the kernel "
            "killing the processes"
        )
    return (
        f"--devices {devices} asks for {plural(devices, 'training process', 'training processes')} on the CPU, but "
        f"{why}. Use --devices {most} or fewer on this machine (--devices 1 trains in one process on every core)."
    )


def threads_problem(threads: int, devices: int, cores: int) -> str | None:
    """Why ``--threads threads`` in each of ``devices`` processes does not fit ``cores`` usable cores, or ``None``.

    torch's threads wait for each other at every operation: threads beyond the cores only take turns on them, so the
    run is slower, never faster, and thousands of threads can hang torch's thread pool or crash it. Each process gets
    its share of the cores (``cores // devices``, at least 1: more processes than cores are
    :func:`cpu_processes_problem`'s to refuse).

    Examples:
        >>> threads_problem(2, 1, 2) is None, threads_problem(1, 2, 2) is None
        (True, True)
        >>> print(threads_problem(1000, 1, 2))
        --threads 1000 asks for 1,000 CPU threads, but this machine has 2 usable cores: torch's threads wait for each other at every operation, so threads beyond the cores make training slower, never faster (and thousands of them can hang or crash torch). Use --threads 2 or fewer on this machine, or leave --threads out: the run then takes the cores that are idle.
        >>> print(threads_problem(2, 2, 2))
        --threads 2 with --devices 2 asks for 4 CPU threads (2 in each of 2 processes), but this machine has 2 usable cores: torch's threads wait for each other at every operation, so threads beyond the cores make training slower, never faster (and thousands of them can hang or crash torch). Use --threads 1 with --devices 2 on this machine, or leave --threads out: the run then takes the cores that are idle.
    """  # noqa: E501
    most = max(1, cores // devices)
    if threads <= most:
        return None
    if devices > 1:
        asked = (
            f"--threads {threads} with --devices {devices} asks for {threads * devices:,} CPU threads ({threads:,} in "
            f"each of {devices} processes)"
        )
        use = f"--threads {most} or fewer" if most > 1 else "--threads 1"
        use += f" with --devices {devices}"
    else:
        asked = f"--threads {threads} asks for {plural(threads, 'CPU thread')}"
        use = f"--threads {most} or fewer" if most > 1 else "--threads 1"
    return (
        f"{asked}, but this machine has {plural(cores, 'usable core')}: torch's threads wait for each other at every "
        "operation, so threads beyond the cores make training slower, never faster (and thousands of them can hang or "
        f"crash torch). Use {use} on this machine, or leave --threads out: the run then takes the cores that are idle."
    )


def thread_choice(
    given: int | None, devices: int, environ: Mapping[str, str], idle: float | None, cores: int
) -> tuple[int | None, str]:
    """The CPU threads of each training process, and how the run's first line says why (``None``: torch's default).

    ``--threads`` wins, then ``OMP_NUM_THREADS``; otherwise each of the ``devices`` processes gets its share of the
    cores idle now (a core counts when it is idle three quarters of the time), at least one. On a machine shared with
    other work, as many threads as cores wait on the busy ones at every operation: a small model trains faster on the
    idle cores alone (measured in docs/benchmarks.md, "Threads").

    Args:
        given: ``--threads`` (``None``: not given).
        devices: the training processes (``--devices``).
        environ: the environment (``OMP_NUM_THREADS``).
        idle: the idle cores (:func:`idle_cores`; ``None``: unknown, torch's default stays).
        cores: the usable cores (:func:`usable_cores`).

    Examples:
        >>> thread_choice(None, 1, {}, 1.1, 2)
        (1, '1 thread (1.1 of 2 cores idle; --threads N sets it)')
        >>> thread_choice(None, 1, {}, 1.9, 2)[0], thread_choice(3, 1, {}, 0.2, 2)
        (2, (3, '3 threads (--threads)'))
        >>> thread_choice(None, 2, {}, 2.0, 2)[1], thread_choice(None, 1, {"OMP_NUM_THREADS": "4"}, 0.5, 8)[1]
        ('1 thread each (2.0 of 2 cores idle; --threads N sets it)', '4 threads (OMP_NUM_THREADS)')
    """
    each = " each" if devices > 1 else ""
    if given is not None:
        return given, f"{plural(given, 'thread')}{each} (--threads)"
    try:
        from_env = int(environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        from_env = 0
    if from_env > 0:
        return from_env, f"{plural(from_env, 'thread')}{each} (OMP_NUM_THREADS)"
    if idle is None:
        return None, ""
    free = max(1, math.floor(idle + 1 - _IDLE_ENOUGH))
    threads = max(1, min(free, cores) // devices)
    said = f"{plural(threads, 'thread')}{each} ({idle:.1f} of {plural(cores, 'core')} idle; --threads N sets it)"
    return threads, said
