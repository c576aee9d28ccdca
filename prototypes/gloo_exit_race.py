"""Reproduce the SIGABRT of spawned gloo ranks that exit right after a collective, and its cure.

Each run spawns 2 fresh interpreters (``torch.multiprocessing.start_processes``, start method "spawn", as Lightning's
``ddp_spawn`` does), joins them over gloo, runs one ``all_reduce`` and returns. Variants:

* ``plain``: return at once. Now and then a rank dies with "terminate called without an active exception" (SIGABRT):
  gloo's worker thread drops its last reference to the finished work (which holds the tensors) after the rank has
  moved on; dropping a tensor Python knew needs the GIL; during interpreter finalization taking the GIL ends the
  thread (``pthread_exit``) inside a ``noexcept`` destructor, so ``std::terminate`` (core dump: the thread is in
  ``c10d::ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` ->
  ``PyThread_exit_thread``; the main thread in ``Py_FinalizeEx``).
* ``atexit``: register ``gc.collect(); dist.destroy_process_group()`` at exit (before finalization starts), which
  joins gloo's threads with the GIL released: what ``tests/launch.py`` does in its workers and what
  ``tests/test_ddp.py`` registers in ``ddp_spawn`` workers. Lightning registers that only for NCCL.

Measured on the 2-core dev machine (torch 2.14.1): ``plain`` aborted in 27 of 200 runs (0 to 40% per batch of runs,
depending on the load), ``atexit`` in 0 of 170.

Run: ``python prototypes/gloo_exit_race.py plain 30`` then ``python prototypes/gloo_exit_race.py atexit 30``.
"""

from __future__ import annotations

import atexit
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def destroy_at_exit() -> None:
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def worker(rank: int, port: int, variant: str) -> None:
    if variant == "atexit":
        atexit.register(destroy_at_exit)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    variant, runs = sys.argv[1], int(sys.argv[2])
    if variant not in ("plain", "atexit"):
        print(f"variant must be 'plain' or 'atexit', got {variant!r}", file=sys.stderr)
        return 2
    aborted = 0
    for _ in range(runs):
        try:
            mp.start_processes(worker, args=(free_port(), variant), nprocs=2, start_method="spawn")
        except mp.ProcessExitedException as error:
            aborted += 1
            print(error, flush=True)
    print(f"{variant}: {aborted} of {runs} runs aborted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
