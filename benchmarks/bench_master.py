"""Benchmark FP32 master weights: peak memory and step time of eight precision set-ups, side by side on one model.

What is compared
    In one run, with the same model, data and seed for each set-up:

    * ``32-true``: ``Trainer(precision="32-true")``.
    * Lightning ``16-mixed`` / ``bf16-mixed``: ``lightning.pytorch.plugins.precision.MixedPrecision(precision, device)``
      (FP32 model under autocast; given as plugin objects, so 16-mixed really runs fp16 on CPU).
    * Lightning ``bf16-true``: ``Trainer(precision="bf16-true")`` (model, gradients and AdamW state all bf16).
    * ours ``16-mixed`` / ``bf16-mixed``: ``MixedPrecisionPlugin(precision, device)`` (FP32 model under autocast).
    * ours ``+ master weights`` (fp16 and bf16): ``MixedPrecisionPlugin(precision, device, master_weights=True)``: the
      model's parameters are FP32 masters at all times (a half-built model would be widened first; this one is FP32)
      and autocast computes in half from them, per use, exactly as ``*-mixed`` (see ``weights/master.py``).

    Both fp16 scalers start at 2**10 and never grow, so no step is skipped for overflow (the tables say if one was).
    Two models, both trained with ``AdamW(lr=1e-4, weight_decay=0.01)`` and cross-entropy on random data:

    * ``mlp``: ``depth`` x [Linear(w, w), LayerNorm(w), ReLU] + Linear(w, 10), a small batch: weights, gradients and
      optimizer state dominate (CPU: w=1024, depth 4, batch 8; CUDA: w=4096, depth 8, batch 64).
    * ``cnn``: 3 x [Conv2d 3x3, BatchNorm2d, ReLU, max-pool] (c, 2c, 4c channels), global average pool, Linear(->10),
      on 32x32 RGB images, a larger batch: activations dominate (CPU: c=16, batch 64; CUDA: c=64, batch 256).

Expected bytes per parameter (the model the tables check the measurements against)
    Per parameter of the layers autocast runs in half (Linear, Conv); normalisation parameters are few
    and keep 4-byte weights and gradients (bf16-true aside). Steady state, from the second step (AdamW creates its two
    moments, in the dtype of what it steps, during the first):

    ======================  =========  ====================  =====  ============  ===============
    set-up                  weights    gradients             AdamW  autocast      peak B/param
                                                                    weight copies
    ======================  =========  ====================  =====  ============  ===============
    32-true                 4          4                     8      -             16 + T
    16/bf16-mixed (both)    4          4                     8      2             max(18, 16 + T)
    bf16-true               2          2                     4      -             8 + T/2
    ours + master weights   4          4                     8      2             max(18, 16 + T)
    ======================  =========  ====================  =====  ============  ===============

    Where each set-up peaks; the per-phase tables print measured and expected for each phase:

    * ``fwd`` (batch start to backward; the peak is at the end of forward). Lightning zeroes gradients *after*
      ``training_step``, so the last step's gradients are still alive: 32-true 4+8+4 = 16; mixed adds the half weight
      copies autocast saved for backward: 18 (the first layer's copy is not saved, its input needing no gradient, so
      the measurement is lower by 2 B x its parameters). Master weights are mixed's: the same FP32 parameters, the
      same autocast copies.
    * ``bwd``: gradients are built again: 32-true and mixed 16 (plus one layer's half gradient before its cast to
      FP32).
    * ``unscale`` (after backward, before ``on_before_optimizer_step``): the gradients are unscaled in place.
    * ``step``: AdamW's temporaries T come on top of what is alive. On CPU AdamW runs per tensor:
      ``exp_avg_sq.sqrt() / c`` holds two temporaries the size of the largest parameter (about 2 B/param for the
      MLP's equal layers). On CUDA it runs ``foreach`` over all parameters: one ``sqrt`` list, 4 B/param (2 in
      bf16-true). 4+4+8 = 16 + T for all but bf16-true.

    So master weights need exactly what Lightning's bf16-mixed needs (the target: never more). Activations, the batch
    and small temporaries come on top of the expected values, which count parameters only.

How memory is measured
    CPU: every set-up runs in its own process, forked from this one after its imports and before any tensor work, so
    no allocator state of one set-up can hide another's. The child fixes glibc's mmap threshold at 64 KiB
    (``mallopt``; by default it grows up to 32 MiB after a large free, after which freed tensors can stay in the heap
    and in RSS), trains a tiny model of the same kind for two steps under the same set-up (lazy imports, kernel and
    thread-pool start-up: tens of MiB that belong to no set-up), builds the data, then the model, and measures:

    * peak live tensors (exact): ``torch.profiler.profile(profile_memory=True)`` runs from before the model is built,
      so every free it reports was an allocation it saw; its allocation (+) and free (-) events are summed in time
      order, and the maximum of that running sum is the peak (it includes the model's weights, not the data set).
      ``record_function`` markers at ``on_train_batch_start``, ``on_before_backward``, ``on_after_backward``,
      ``on_before_optimizer_step`` and ``on_train_batch_end`` split it into the phases above. The profiler covers the
      first ``--profiled-steps`` steps (the first creates AdamW's state; the phase tables show the maximum over the
      later ones) and is then stopped, before the timed steps.
    * RSS: the process's peak resident set over the whole run (``resource.getrusage().ru_maxrss``, KiB) minus its
      VmRSS (``/proc/self/status``) right after the model is built. That baseline holds the FP32 model, so its
      expected value is the expected peak minus the model's bytes; the profiler's event buffers and what Lightning
      allocates outside tensors add a few MiB. A peak reached before the baseline is flagged ``<=``.

    CUDA: the set-ups run one after the other in this process (the same warm-up first, then ``gc`` and
    ``empty_cache``); memory = ``torch.cuda.max_memory_allocated()`` over the run, minus what was allocated before
    the model (library workspaces), with the peak reset at each marker to split it into phases.

Step time
    The wall time from ``on_train_batch_start`` to ``on_train_batch_end`` of the steps after the profiled ones and
    ``--warmup`` more (with ``torch.cuda.synchronize()`` at both ends on CUDA); the median, and its ratio to 32-true.
    Half precision is slow on CPU (this 2-core EPYC has no AVX-512: fp16 and bf16 autocast and bf16-true are several
    times slower than fp32, and half convolutions fall back to an im2col kernel), so half-precision set-ups time few
    steps (``--steps``). CPU timing on shared cores is noisy, and not the point there: memory is.

Targets (reported, never asserted)
    Memory (CPU and CUDA): the peak with master weights <= Lightning bf16-mixed's on the same model.

Run
    python benchmarks/bench_master.py                  # CPU, both models: about 2.5 minutes on 2 shared cores
    python benchmarks/bench_master.py --quick          # smaller models, fewer steps: a smoke test (under a minute)
    python benchmarks/bench_master.py --device cuda    # on a GPU (the CUDA sizes above)
    python benchmarks/bench_master.py --models mlp --configs 32-true lightning-bf16-mixed ours-bf16-mixed-master
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing as mp
import os
import re
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _ab import load, quiet, verdict  # same directory
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus.cli._configs import SETUPS, PrecisionSetup
from lightning_amp_plus.plugins.precision import skipped_steps

MIB = 2**20
_INIT_SCALE = 2.0**10
_CLASSES = 10
_PHASES = ("fwd", "bwd", "unscale", "step")
_MARK = "bench_master/"
_MMAP_THRESHOLD = 64 * 1024
_BASE = "32-true"
# Each master-weights set-up is judged against Lightning's own mixed precision of the same dtype.
_REFERENCE = {"ours-16-mixed-master": "lightning-16-mixed", "ours-bf16-mixed-master": "lightning-bf16-mixed"}
_MASTER_KEYS = ("ours-16-mixed-master", "ours-bf16-mixed-master")


# ------------------------------------------------------------------------------------------------------ set-ups
@dataclass(frozen=True)
class Config:
    """One precision set-up: its name, its memory model and how to build the Trainer's precision arguments."""

    key: str
    label: str
    kind: str  # memory model: "fp32" (FP32 model), "autocast" (FP32 model + autocast), "half"
    half_compute: bool  # runs its matmuls in a half dtype: slow on CPU, so fewer timed steps there
    trainer_kwargs: Callable[[str], dict[str, Any]]


def _memory_model(setup: PrecisionSetup) -> str:
    if setup.precision == "32-true":
        return "fp32"
    if setup.precision == "bf16-true":
        return "half"
    return "autocast"  # master weights too: the FP32 parameters are the masters, autocast casts per use


def _config(setup: PrecisionSetup) -> Config:
    # The same scaler settings for Lightning's GradScaler and ours: a fixed start, no growth within the run.
    options = {"init_scale": _INIT_SCALE, "growth_interval": 10_000}
    return Config(
        setup.name,
        setup.label,
        _memory_model(setup),
        setup.precision != "32-true",
        lambda device: setup.trainer_kwargs(device, scaler_options=options),
    )


# The set-ups `amp-plus compare` offers, from the same table.
CONFIGS = tuple(_config(setup) for setup in SETUPS.values())
_BY_KEY = {config.key: config for config in CONFIGS}


# ------------------------------------------------------------------------------------------------------- models
class Classifier(pl.LightningModule):
    """A network trained with cross-entropy (computed in FP32) and AdamW."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)


def mlp(width: int, depth: int) -> nn.Module:
    """``depth`` x [Linear(width, width), LayerNorm, ReLU], then Linear(width, 10)."""
    blocks = [layer for _ in range(depth) for layer in (nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU())]
    return nn.Sequential(*blocks, nn.Linear(width, _CLASSES))


def cnn(channels: int) -> nn.Module:
    """3 x [conv 3x3, BatchNorm, ReLU, max-pool] (channels c, 2c, 4c), global average pool, linear."""

    def stage(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)]

    c = channels
    return nn.Sequential(
        *stage(3, c),
        *stage(c, 2 * c),
        *stage(2 * c, 4 * c),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * c, _CLASSES),
    )


@dataclass(frozen=True)
class ModelSpec:
    """A model to benchmark: how to build it, its batch and the shape of one sample."""

    name: str
    description: str
    batch: int
    sample: tuple[int, ...]
    build: Callable[[], nn.Module]


def model_specs(device: str, quick: bool) -> dict[str, ModelSpec]:
    """The MLP and the CNN, sized for the device (``quick``: a smoke test)."""
    if device == "cuda":
        width, depth, mlp_batch, channels, cnn_batch = 4096, 8, 64, 64, 256
    elif quick:
        width, depth, mlp_batch, channels, cnn_batch = 512, 3, 4, 8, 16
    else:
        width, depth, mlp_batch, channels, cnn_batch = 1024, 4, 8, 16, 64
    return {
        "mlp": ModelSpec(
            "mlp",
            f"MLP: {depth} x [Linear({width}, {width}), LayerNorm, ReLU] + Linear({width}, 10), batch {mlp_batch}",
            mlp_batch,
            (width,),
            lambda: mlp(width, depth),
        ),
        "cnn": ModelSpec(
            "cnn",
            f"CNN: 3 x [conv3x3, BatchNorm, ReLU, max-pool] ({channels}/{2 * channels}/{4 * channels} channels), "
            f"32x32 RGB, batch {cnn_batch}",
            cnn_batch,
            (3, 32, 32),
            lambda: cnn(channels),
        ),
    }


@dataclass(frozen=True)
class Shape:
    """The parameter counts the memory model needs."""

    converted: int  # parameters of the layers autocast runs in half (Linear, Conv)
    norm: int  # the others (normalisation layers: FP32 throughout)
    largest: int  # elements of the largest parameter (CPU AdamW's temporaries are two of it)

    @classmethod
    def of(cls, net: nn.Module) -> Shape:
        half = [m for m in net.modules() if isinstance(m, nn.Linear | nn.Conv2d)]
        converted = sum(p.numel() for m in half for p in m.parameters(recurse=False))
        total = sum(p.numel() for p in net.parameters())
        return cls(converted, total - converted, max(p.numel() for p in net.parameters()))


def expected_phases(kind: str, shape: Shape, foreach: bool) -> dict[str, int]:
    """Expected live bytes of weights, gradients, masters, AdamW state and temporaries at the peak of each phase.

    Steady state, without activations; see the module docstring for the reasoning behind each term.
    """
    n_h, n_n = shape.converted, shape.norm
    n = n_h + n_n
    weight_n = 2 if kind == "half" else 4
    state = 2 if kind == "half" else 4  # AdamW moments take the dtype of the tensor they step
    w = n_h * (2 if kind == "half" else 4) + n_n * weight_n
    s = 2 * state * n
    casts = 2 * n_h if kind == "autocast" else 0  # autocast's half weight copies, saved for backward
    temps = state * n if foreach else 2 * state * shape.largest
    grads = w
    fwd = w + s + grads + casts  # the last step's gradients are alive until Lightning zeroes them before backward
    return {
        "fwd": fwd,
        "bwd": w + s + grads,
        "unscale": w + s + grads,
        "step": w + s + grads + temps,
    }


# ----------------------------------------------------------------------------------------------------- meters
@dataclass
class MemoryReport:
    """Peak live bytes: overall (from model creation on) and per phase (the maximum over steps 2 and later)."""

    peak: int
    phases: dict[str, int]


def _steady(peaks: dict[str, int]) -> dict[str, int]:
    """Per phase name, the maximum over the steps after the first (labels are ``"<step>/<phase>"``)."""
    steady: dict[str, int] = {}
    for label, value in peaks.items():
        step, _, phase = label.partition("/")
        if step.isdigit() and int(step) >= 2 and phase in _PHASES:
            steady[phase] = max(steady.get(phase, value), value)
    return steady


class CpuMeter:
    """Live tensor bytes on CPU from ``torch.profiler`` memory events, split by record-function markers."""

    def __init__(self) -> None:
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._running = False

    def start(self) -> None:
        self._profiler.start()
        self._running = True

    def mark(self, label: str) -> None:
        if self._running:
            with record_function(_MARK + label):
                pass

    def stop(self) -> None:
        if self._running:
            self._profiler.stop()
            self._running = False

    def report(self) -> MemoryReport:
        results = None if self._profiler.profiler is None else self._profiler.profiler.kineto_results
        if results is None:
            raise RuntimeError("the memory profiler recorded nothing: was it started?")
        events = sorted(results.events(), key=lambda e: e.start_ns())
        live, label = 0, "model"  # the profiler starts right before the model is built
        peaks: dict[str, int] = {label: 0}
        for event in events:
            name = event.name()
            if name == "[memory]":  # CPU allocations only: the profiler records no other activity
                live += event.nbytes()  # type: ignore[attr-defined]  # there at run time, not in torch's stubs
                peaks[label] = max(peaks[label], live)
            elif name.startswith(_MARK):
                label = name[len(_MARK) :]
                peaks[label] = max(peaks.get(label, live), live)
        overall = max(peaks.values())
        return MemoryReport(overall, _steady(peaks))


class CudaMeter:
    """Allocated CUDA bytes: the allocator's peak, reset at each marker to split it by phase.

    Counted from what is allocated at ``start`` (before the model; library workspaces from the warm-up), so that, as
    on CPU, the numbers are the tensors of this set-up's model, optimizer and steps.
    """

    def __init__(self) -> None:
        self._label = "setup"
        self._peaks: dict[str, int] = {}
        self._running = False
        self._floor = 0

    def start(self) -> None:
        torch.cuda.synchronize()
        self._floor = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self._running = True

    def _read(self) -> None:
        value = torch.cuda.max_memory_allocated() - self._floor
        self._peaks[self._label] = max(self._peaks.get(self._label, value), value)

    def mark(self, label: str) -> None:
        if self._running:
            self._read()
            self._label = label
            torch.cuda.reset_peak_memory_stats()

    def stop(self) -> None:
        if self._running:
            self._read()
            self._label = "after"  # the allocator's peak keeps counting for the rest of the run
            self._running = False

    def report(self) -> MemoryReport:
        self._read()
        return MemoryReport(max(self._peaks.values()), _steady(self._peaks))


class Phases(pl.Callback):
    """Marks the phases of the first ``profiled`` steps for the meter, then times the steps after ``warmup`` more."""

    def __init__(self, meter: CpuMeter | CudaMeter, profiled: int, warmup: int, total: int, sync: bool) -> None:
        self.meter = meter
        self.profiled, self.warmup, self.total, self.sync = profiled, warmup, total, sync
        self.times: list[float] = []
        self.last_loss = float("nan")
        self._step = 0
        self._start = 0.0

    def _mark(self, phase: str) -> None:
        if self._step <= self.profiled:
            self.meter.mark(f"{self._step}/{phase}")

    def _timed(self) -> bool:
        return self._step > self.profiled + self.warmup

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._step = idx + 1
        self._mark("fwd")
        if self._timed():
            if self.sync:
                torch.cuda.synchronize()
            self._start = time.perf_counter()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._mark("bwd")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark("unscale")  # up to on_before_optimizer_step: FP32 weights and gradients back, unscale, check

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._mark("step")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        if self._timed():
            if self.sync:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._start)
        self._mark("end")
        if self._step == self.profiled:
            self.meter.stop()
        if self._step == self.total:
            self.last_loss = float(outputs["loss"])


# ---------------------------------------------------------------------------------------------------- one run
@dataclass
class Result:
    """What one set-up measured on one model."""

    memory: MemoryReport
    rss_over_baseline: int | None  # bytes (CPU only)
    rss_masked: bool  # the peak RSS is the one reached before the baseline (imports): a lower bound
    times: list[float]
    shape: Shape
    model_bytes: int  # the FP32 model's bytes at creation (the RSS baseline holds them)
    skipped: str
    last_loss: float


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        match = re.search(r"^VmRSS:\s+(\d+) kB", status.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError("no VmRSS line in /proc/self/status: the RSS measurement needs Linux")
    return int(match.group(1))


def _max_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def _fix_mmap_threshold() -> None:
    """Make glibc serve every allocation >= 64 KiB with mmap and unmap it on free, so that RSS follows live tensors."""
    libc = ctypes.CDLL("libc.so.6")
    m_mmap_threshold = -3
    if libc.mallopt(m_mmap_threshold, _MMAP_THRESHOLD) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: the RSS numbers would depend on glibc's heuristics")


def _skipped(trainer: pl.Trainer) -> str:
    counted = skipped_steps(trainer)
    if counted is not None:
        return str(counted)
    scaler = getattr(trainer.precision_plugin, "scaler", None)  # GradScaler counts no skips: read its scale
    if isinstance(scaler, torch.amp.GradScaler):
        scale = scaler.get_scale()
        return "0" if scale == _INIT_SCALE else f"some (scale {_INIT_SCALE:g} -> {scale:g})"
    return "-"


@dataclass(frozen=True)
class Plan:
    """Steps of one run: profiled for memory, then warm-up, then timed."""

    profiled: int
    warmup: int
    timed: int

    @property
    def total(self) -> int:
        return self.profiled + self.warmup + self.timed


def _trainer(config: Config, device: str, steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu" if device == "cpu" else "gpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_steps=steps,
        callbacks=callbacks,
        **config.trainer_kwargs(device),
    )


def _warm_up(spec: ModelSpec, config: Config, device: str) -> None:
    """Two steps of a tiny model of the same kind under the same set-up, before anything is measured.

    Lightning imports modules lazily and torch initialises kernels, thread pools and (on CUDA) library workspaces on
    first use: tens of MiB of RSS that belong to no set-up in particular, and are in the baseline after this.
    """
    tiny, sample = (mlp(8, 1), (8,)) if spec.name == "mlp" else (cnn(2), (3, 8, 8))
    data = TensorDataset(torch.randn(4, *sample), torch.randint(0, _CLASSES, (4,)))
    _trainer(config, device, 2, []).fit(Classifier(tiny), DataLoader(data, batch_size=2))
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure(spec: ModelSpec, config: Config, plan: Plan, device: str, seed: int, threads: int | None) -> Result:
    """Train ``spec``'s model for ``plan.total`` steps under ``config``; measure memory and step time."""
    cpu = device == "cpu"
    if cpu:
        _fix_mmap_threshold()
        if threads is not None:
            torch.set_num_threads(threads)
    _warm_up(spec, config, device)
    pl.seed_everything(seed, verbose=False)
    generator = torch.Generator().manual_seed(seed)
    n = plan.total * spec.batch
    data = TensorDataset(
        torch.randn(n, *spec.sample, generator=generator), torch.randint(0, _CLASSES, (n,), generator=generator)
    )
    # Started after the data (never freed, so not needed) and before the model (so its frees are seen).
    meter: CpuMeter | CudaMeter = CpuMeter() if cpu else CudaMeter()
    meter.start()
    module = Classifier(spec.build())
    shape = Shape.of(module)
    model_bytes = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    meter.mark("baseline")
    rss_baseline, max_rss_baseline = (_rss_kib(), _max_rss_kib()) if cpu else (0, 0)
    phases = Phases(meter, plan.profiled, plan.warmup, plan.total, sync=not cpu)
    trainer = _trainer(config, device, plan.total, [phases])
    trainer.fit(module, DataLoader(data, batch_size=spec.batch, shuffle=False))
    max_rss = _max_rss_kib() if cpu else 0
    meter.stop()
    if len(phases.times) != plan.timed:
        raise RuntimeError(f"{config.label}: expected {plan.timed} timed steps, got {len(phases.times)}")
    return Result(
        memory=meter.report(),
        rss_over_baseline=(max_rss - rss_baseline) * 1024 if cpu else None,
        rss_masked=cpu and max_rss <= max_rss_baseline,
        times=phases.times,
        shape=shape,
        model_bytes=model_bytes,
        skipped=_skipped(trainer),
        last_loss=phases.last_loss,
    )


def _child(conn: Connection, log_path: str, *args: Any) -> None:
    # The profiler and Lightning write to fds 1 and 2 from C++ too: keep that out of the tables (shown on failure).
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        conn.send(("ok", measure(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def measure_in_child(spec: ModelSpec, config: Config, plan: Plan, seed: int, threads: int | None) -> Result:
    """``measure`` on CPU in a forked process: a fresh allocator, and peak RSS of this set-up alone."""
    context = mp.get_context("fork")  # this process has imported everything but run no tensor work: cheap, clean
    receive, send = context.Pipe(duplex=False)
    with tempfile.NamedTemporaryFile(prefix="bench_master_", suffix=".log", delete=False) as log:
        log_path = log.name
    sys.stdout.flush()
    sys.stderr.flush()
    process = context.Process(target=_child, args=(send, log_path, spec, config, plan, "cpu", seed, threads))
    process.start()
    send.close()
    try:
        status, payload = receive.recv()
    except EOFError:
        status, payload = "died", f"exit code {process.exitcode}"
    process.join()
    if status != "ok":
        with open(log_path, errors="replace") as output:
            tail = output.read()[-4000:]
        os.unlink(log_path)
        raise SystemExit(
            f"{spec.name} / {config.label} failed in its child process:\n{payload}\n--- its output:\n{tail}"
        )
    os.unlink(log_path)
    assert isinstance(payload, Result)
    return payload


# ----------------------------------------------------------------------------------------------------- report
def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def _ratio(value: float | None, base: float | None) -> str:
    return "n/a" if value is None or not base else f"{value / base:.3f}x"


def _signed_bytes(value: int) -> str:
    return f"{value:+,} B" if abs(value) < 2**20 else f"{value / MIB:+.2f} MiB"


def print_table(spec: ModelSpec, results: dict[str, Result], device: str) -> None:
    """One row per set-up: peak memory, its expectation, step time; ratios to 32-true."""
    foreach = device == "cuda"
    base = results.get(_BASE)
    base_ms = statistics.median(base.times) * 1e3 if base else None
    base_peak = base.memory.peak if base else None
    base_rss = base.rss_over_baseline if base else None
    mem_name = "peak live tensors" if device == "cpu" else "max_memory_allocated"
    print()
    print(f"## {spec.description}")
    print()
    any_result = next(iter(results.values()))
    shape = any_result.shape
    print(
        f"{shape.converted + shape.norm:,} parameters ({shape.norm:,} in normalisation layers); FP32 model "
        f"{_mib(any_result.model_bytes)} MiB"
    )
    print()
    print(
        f"| set-up | {mem_name} MiB | x 32-true | expected MiB (params, no activations) | RSS peak - baseline MiB "
        "| x 32-true | median step ms | x 32-true | timed steps | skipped steps | last loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for key, result in results.items():
        config = _BY_KEY[key]
        expected = max(expected_phases(config.kind, result.shape, foreach).values())
        ms = statistics.median(result.times) * 1e3
        rss = result.rss_over_baseline
        rss_text = ("<= " if result.rss_masked else "") + _mib(rss)
        print(
            f"| {config.label} | {_mib(result.memory.peak)} | {_ratio(result.memory.peak, base_peak)} "
            f"| {_mib(expected)} | {rss_text} | {_ratio(rss, base_rss)} | {ms:.1f} "
            f"| {_ratio(ms, base_ms)} | {len(result.times)} | {result.skipped} | {result.last_loss:.4f} |"
        )


def print_phases(spec: ModelSpec, results: dict[str, Result], device: str) -> None:
    """Measured against expected bytes at the peak of each steady-state phase (and RSS on CPU)."""
    foreach = device == "cuda"
    print()
    print(f"### {spec.name}: measured / expected MiB per phase (steady state, steps 2+; expected without activations)")
    print()
    rss_head = " RSS peak - baseline: measured / expected |" if device == "cpu" else ""
    print("| set-up | " + " | ".join(_PHASES) + " | expected peak phase (params only) |" + rss_head)
    print("|---|" + "---:|" * len(_PHASES) + "---|" + ("---:|" if rss_head else ""))
    for key, result in results.items():
        config = _BY_KEY[key]
        expected = expected_phases(config.kind, result.shape, foreach)
        cells = [f"{_mib(result.memory.phases.get(phase))} / {_mib(expected[phase])}" for phase in _PHASES]
        top = max(expected, key=lambda phase: expected[phase])
        row = f"| {config.label} | " + " | ".join(cells) + f" | {top} |"
        if rss_head:
            # The RSS baseline holds the FP32 model as created.
            rss_expected = max(expected.values()) - result.model_bytes
            row += f" {_mib(result.rss_over_baseline)} / {_mib(rss_expected)} |"
        print(row)


def print_verdict(spec: ModelSpec, results: dict[str, Result], device: str) -> None:
    """Master weights against Lightning's mixed precision of the same dtype: memory (and, on CUDA, step time)."""
    masters = [key for key in _MASTER_KEYS if key in results]
    print()
    if not masters:
        print(f"verdict ({spec.name}): needs a master-weights set-up in --configs")
        return
    for key in masters:
        reference_key = _REFERENCE[key]
        reference = results.get(reference_key)
        if reference is None:
            print(f"verdict ({spec.name}, {_BY_KEY[key].label}): needs {reference_key} in --configs to compare with")
            continue
        result = results[key]
        ratio = result.memory.peak / reference.memory.peak
        diff = result.memory.peak - reference.memory.peak
        line = f"verdict ({spec.name}, {_BY_KEY[key].label}): peak memory {ratio:.3f}x {_BY_KEY[reference_key].label} "
        # Under a KiB apart (a few FP32 normalisation parameters) is a tie, and a tie meets "<=".
        tie = abs(diff) < 1024
        judged = "met (<= 1.00x, a tie)" if tie else verdict(ratio, 1.0)
        line += f"({_signed_bytes(diff)}): {judged}"
        if result.rss_over_baseline is not None and reference.rss_over_baseline:
            line += f"; RSS over baseline {result.rss_over_baseline / reference.rss_over_baseline:.3f}x"
        if device == "cuda":
            time_ratio = statistics.median(result.times) / statistics.median(reference.times)
            line += f"; step time {time_ratio:.3f}x: {'met' if time_ratio < 1.0 else 'NOT met'} (< 1.00x)"
        print(line)


# ------------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", nargs="+", choices=("mlp", "cnn"), default=["mlp", "cnn"])
    parser.add_argument("--configs", nargs="+", choices=[c.key for c in CONFIGS], default=[c.key for c in CONFIGS])
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer steps (a smoke test)")
    parser.add_argument(
        "--profiled-steps", type=int, default=3, help="steps under the memory profiler (>= 2; default 3)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps after those (CPU 1, CUDA 5)")
    parser.add_argument(
        "--steps",
        type=int,
        nargs=2,
        default=None,
        metavar=("FP32", "HALF"),
        help="timed steps for 32-true and for the half-precision set-ups (CPU 8 3, quick 3 2; CUDA 50 50)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU: torch.set_num_threads in each run (default 1: steadier)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device: str = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_master.py --device cuda: CUDA is not available here (torch.cuda.is_available() is False).")
    if args.profiled_steps < 2:
        parser.error("--profiled-steps must be >= 2: the first step creates AdamW's state, the steady state follows")
    cuda = device == "cuda"
    threads = None if cuda else (args.threads or 1)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    steps_fp32, steps_half = args.steps or ((50, 50) if cuda else ((3, 2) if args.quick else (8, 3)))
    specs = model_specs(device, args.quick)
    configs = [c for c in CONFIGS if c.key in args.configs]
    quiet(
        r".*fp16 autocast is correct there but slow.*",
        r".*isinstance\(treespec, LeafSpec\).*",
        r".*The 'train_dataloader' does not have many workers.*",
    )

    where = f"CUDA ({torch.cuda.get_device_name()})" if cuda else f"CPU, {threads} thread(s) per run"
    version = pl.__version__  # type: ignore[attr-defined]
    print(f"torch {torch.__version__}, lightning {version}, {where}, load average {load():.2f}")
    print(
        f"per run: {args.profiled_steps} profiled steps, {warmup} warm-up, timed {steps_fp32} (32-true) / "
        f"{steps_half} (half-precision set-ups); AdamW; fp16 loss scale 2**10"
    )
    if cuda:
        print("memory: torch.cuda.max_memory_allocated (reset per set-up and per phase); time: synchronised")
    else:
        print(
            "memory: peak live tensor bytes (torch.profiler memory events summed in order, from model creation on, "
            "profiled steps) and peak RSS - RSS after model creation (ru_maxrss - VmRSS, whole run); one forked "
            f"process per set-up, glibc mmap threshold fixed at {_MMAP_THRESHOLD // 1024} KiB"
        )
    started = time.perf_counter()
    for name in args.models:
        spec = specs[name]
        results: dict[str, Result] = {}
        for config in configs:
            plan = Plan(args.profiled_steps, warmup, steps_half if config.half_compute else steps_fp32)
            t0 = time.perf_counter()
            if cuda:
                results[config.key] = measure(spec, config, plan, device, args.seed, threads)
            else:
                results[config.key] = measure_in_child(spec, config, plan, args.seed, threads)
            result = results[config.key]
            print(
                f"  {name} / {config.label}: peak {_mib(result.memory.peak)} MiB, "
                f"{statistics.median(result.times) * 1e3:.1f} ms/step ({time.perf_counter() - t0:.0f} s, "
                f"load {load():.2f})",
                flush=True,
            )
        print_table(spec, results, device)
        print_phases(spec, results, device)
        print_verdict(spec, results, device)
    print()
    print(f"total {time.perf_counter() - started:.0f} s, load average after: {load():.2f}")


if __name__ == "__main__":
    main()
