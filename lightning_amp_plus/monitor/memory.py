"""Memory readings: CUDA allocator statistics, or the process's resident memory (now, and its peak) on CPU.

Read by the monitor and by ``amp-plus compare``.

None of these reads synchronises with a device: the CUDA numbers are the caching allocator's host-side counters.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

__all__ = ["MemoryReader", "cuda_memory_mb", "peak_rss_mb", "process_rss_mb", "reset_cuda_peak", "reset_peak_rss"]

_MB = 1024.0 * 1024.0


def reset_cuda_peak(device: torch.device) -> None:
    """Start a new peak-memory window on ``device``."""
    torch.cuda.reset_peak_memory_stats(device)


def cuda_memory_mb(device: torch.device) -> dict[str, float]:
    """Allocated, reserved, and peak-allocated-since-the-last-reset memory on ``device``, in MB."""
    return {
        "cuda_allocated_mb": torch.cuda.memory_allocated(device) / _MB,
        "cuda_reserved_mb": torch.cuda.memory_reserved(device) / _MB,
        "cuda_peak_mb": torch.cuda.max_memory_allocated(device) / _MB,
    }


def process_rss_mb() -> float:
    """The process's resident memory now (Linux), or its peak where the current value cannot be read, in MB.

    Examples:
        >>> process_rss_mb() > 0
        True
    """
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE") / _MB
    except (OSError, ValueError, IndexError):
        import resource  # not on Windows; only needed where /proc is missing

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / _MB if sys.platform == "darwin" else peak / 1024.0  # bytes on macOS, KiB elsewhere


def peak_rss_mb() -> float | None:
    """The process's peak resident memory (Linux ``VmHWM``) since it started or since :func:`reset_peak_rss`, in MB.

    ``None`` where ``/proc/self/status`` cannot be read.

    Examples:
        >>> peak_rss_mb() >= process_rss_mb() * 0.99
        True
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Start a new peak-resident-memory window (Linux: write 5 to ``/proc/self/clear_refs``); ``False`` if it cannot.

    Where it cannot, :func:`peak_rss_mb` keeps including what came before (imports, data).
    """
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


class MemoryReader:
    """The memory a monitor reports: CUDA's allocator statistics, or the process's resident memory on the CPU.

    State: whether it has said once that it reports the process's resident memory (not on CUDA).
    """

    def __init__(self) -> None:
        self._cpu_said = False

    def of_trainer(self, trainer: Any) -> dict[str, float]:
        """The memory of the Trainer's device (its root device)."""
        device = trainer.strategy.root_device
        return cuda_memory_mb(device) if device.type == "cuda" else self._cpu()

    def of_model(self, model: torch.nn.Module | None) -> dict[str, float]:
        """The memory of the device ``model`` is on (the CPU's without a model)."""
        param = None if model is None else next(model.parameters(), None)
        return cuda_memory_mb(param.device) if param is not None and param.device.type == "cuda" else self._cpu()

    def _cpu(self) -> dict[str, float]:
        if not self._cpu_said:
            self._cpu_said = True
            from lightning.fabric.utilities import rank_zero_info  # here: amp-plus compare reads memory alone

            rank_zero_info(
                "MixedPrecisionMonitor: not on CUDA, so it reports the process's resident memory (amp/cpu_rss_mb) "
                "instead of CUDA memory."
            )
        return {"cpu_rss_mb": process_rss_mb()}
