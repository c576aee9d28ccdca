"""Run scenarios on several local CPU processes joined over gloo, launched as ``torchrun`` would launch them.

Starting processes costs seconds (each one imports torch and Lightning), so a test module starts ONE set of workers
(:func:`run_pool`, usually from a module-scoped fixture) and each worker runs every scenario in turn, then saves what
the scenarios returned to a file per rank; the tests compare the ranks' records (:func:`scenario`).

Each worker gets ``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment and
joins the default process group itself, so a ``Trainer(accelerator="cpu", devices=world, strategy=...)`` inside it
takes the processes as launched externally (no launcher of its own) and reuses that group, for every strategy
(``"ddp"``, ``FSDPStrategy``, ``ModelParallelStrategy``); a scenario may also use ``torch.distributed`` directly.

Nothing hangs: a collective that waits longer than ``collective_timeout`` raises on the rank that waits (the other
rank failed), a failed scenario stops its worker (the ranks may be out of step in their collectives afterwards), and
the pool is killed after ``timeout_s``.

A worker never leaves gloo work in flight when its interpreter exits: see :func:`destroy_process_group`.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

WORLD = 2
# A pool takes about a minute on 2 busy cores, nearly all of it the processes importing torch and Lightning; this only
# bounds a hang.
POOL_TIMEOUT_S = 600
# A collective that waits longer than this on one rank means the other rank failed: error out instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)

Scenario = Callable[[Path], Any]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables ``torchrun`` sets; with ``LOCAL_RANK`` present Lightning takes the processes as launched."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "NODE_RANK": "0",
    }


def quiet_worker() -> None:
    # Warnings and logs of worker processes do not reach pytest; silence them to keep the output readable.
    warnings.simplefilter("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)  # two processes on two cores: a second intra-op thread each only stalls


def destroy_process_group() -> None:
    """Destroy the default process group, so that gloo's worker threads are joined before the interpreter exits.

    A gloo collective is run by a worker thread of ``ProcessGroupGloo``, which drops its reference to the finished
    work (and to the tensors it holds) only after the rank that waited on it has moved on. Dropping the last reference
    to a tensor that Python also knew needs the GIL. If the interpreter is already finalizing by then, taking the GIL
    ends the thread (``pthread_exit``) from inside a ``noexcept`` C++ destructor: ``std::terminate``, "terminate called
    without an active exception", SIGABRT. A rank that exits right after its last collective (Lightning's
    ``ddp_spawn`` workers do: nothing of theirs destroys the group) loses that race now and then. Destroying the group
    first makes ``~ProcessGroupGloo`` join those threads, with the GIL released, while the interpreter is whole.
    (Lightning registers this at exit for NCCL only, ``lightning.fabric.utilities.distributed._init_dist_connection``.)
    ``gc.collect()`` first, because a DDP or FSDP module left in a reference cycle holds the group too.
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _worker(
    rank: int,
    world: int,
    scenarios: Mapping[str, Scenario],
    out_dir: str,
    port: int,
    collective_timeout: timedelta,
) -> None:
    """One rank: run every scenario in order, then save ``{name: result}`` to ``out_dir/rank{rank}.pt``.

    A scenario that raises records its traceback under ``"error"`` and ends the worker. ``"seconds"`` holds each
    scenario's wall time.
    """
    os.environ.update(torchrun_environment(rank, world, port))
    quiet_worker()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=collective_timeout)
    out = Path(out_dir)
    results: dict[str, Any] = {"seconds": {}}
    try:
        for name, scenario in scenarios.items():
            started = time.perf_counter()
            try:
                results[name] = scenario(out)
            except Exception:
                results["error"] = f"scenario {name!r} failed on rank {rank}:\n{traceback.format_exc()}"
                break  # the ranks may be out of step in their collectives now: run nothing more
            results["seconds"][name] = time.perf_counter() - started
    finally:
        torch.save(results, out / f"rank{rank}.pt")
        destroy_process_group()


def run_pool(
    scenarios: Mapping[str, Scenario],
    out: Path,
    world: int = WORLD,
    timeout_s: float = POOL_TIMEOUT_S,
    collective_timeout: timedelta = COLLECTIVE_TIMEOUT,
) -> list[dict[str, Any]]:
    """Start ``world`` workers (spawned, fresh interpreters), run ``scenarios`` on each, return each rank's record.

    Args:
        scenarios: name -> function of the output folder; every rank runs them in this order. They are pickled by
            reference: define them at module level in an importable module.
        out: a folder for the records (and for whatever the scenarios write).
        world: the number of processes.
        timeout_s: the pool is killed, and ``TimeoutError`` raised, after this long.
        collective_timeout: the process group's timeout.

    Raises:
        TimeoutError: the pool did not finish in time.
        RuntimeError: a worker process died (a signal or an error outside the scenarios).
    """
    context = mp.start_processes(
        _worker,
        args=(world, dict(scenarios), str(out), free_port(), collective_timeout),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    try:
        join_within(context, timeout_s)
    except ProcessException as error:
        saved = [out / f"rank{rank}.pt" for rank in range(world)]
        errors = [torch.load(path, weights_only=False).get("error", "") for path in saved if path.exists()]
        raise RuntimeError(f"a worker process died: {error}\n" + "\n".join(e for e in errors if e)) from error
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def join_within(context: mp.ProcessContext, timeout_s: float) -> None:
    """Wait for the processes of ``context`` (``start_processes(..., join=False)``) at most ``timeout_s`` seconds.

    Raises:
        TimeoutError: they did not finish in time; they have been killed.
        ProcessException: one of them failed (``torch.multiprocessing``'s own report).
    """
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
                process.join()
            raise TimeoutError(f"the {len(context.processes)} workers did not finish within {timeout_s} s")


def scenario(ranks: list[dict[str, Any]], name: str) -> tuple[Any, ...]:
    """Each rank's result of one scenario; fails with the worker's traceback if it did not run."""
    for record in ranks:
        if name not in record:
            raise AssertionError(record.get("error", f"scenario {name!r} did not run"))
    return tuple(record[name] for record in ranks)
