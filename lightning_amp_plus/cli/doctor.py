"""``amp-plus doctor``: what this machine can do in mixed precision, measured, and which plugin settings fit it.

It lists the devices (CPU model, threads and bf16 features; each CUDA device's name, compute capability and memory),
finds out which dtypes autocast supports on each by running a tiny autocast matmul, measures matmul throughput in fp32,
fp16 and bf16 (a short benchmark sized to the device), and recommends ``MixedPrecisionPlugin`` settings with the
reasons.

Whether a CPU computes bf16 natively is read from one place, the feature flags the OS lists (:func:`cpu_flags`:
``avx512_bf16``, ``amx_bf16`` in ``/proc/cpuinfo``), with or without the benchmark: the recommendation is the same
either way, and the measurement, when made, is reported beside it. Only where the flags cannot be read does the
measured speed decide.

Gathering (:func:`collect`) and judging (:func:`recommend`) are separate, so the judgement can be checked against any
device, real or made up.
"""

from __future__ import annotations

import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

__all__ = [
    "BF16_FLAGS",
    "DTYPES",
    "DeviceReport",
    "Recommendation",
    "autocast_supported",
    "collect",
    "cpu_bf16_native",
    "cpu_flags",
    "cpu_name",
    "cuda_bf16_native",
    "format_report",
    "fp8_support",
    "matmul_tflops",
    "probe",
    "recommend",
    "report_dict",
]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The dtypes measured, by the names the report uses."""

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""The CPU feature flags (as ``/proc/cpuinfo`` names them) of native bf16 arithmetic: AVX512-BF16 and AMX-BF16."""
CPUINFO = "/proc/cpuinfo"

# Where the flags cannot be read: on CPU a bf16 matmul must beat fp32 by this much before mixed precision is worth its
# conversions (activations, casts of every weight each forward): below it, the end-to-end step is slower, as measured
# on the dev machine.
_CPU_SPEEDUP_NEEDED = 1.2
# Benchmark budgets per dtype (seconds) and the largest square size tried: the whole doctor stays under ~5 s on CPU.
_BUDGET_S = {"cpu": 0.5, "cuda": 0.3}
_MAX_SIZE = {"cpu": 1024, "cuda": 8192}


@dataclass(frozen=True)
class DeviceReport:
    """What was found about one device.

    Attributes:
        kind: ``"cpu"`` or ``"cuda"``.
        index: the CUDA device index (``None`` for the CPU).
        name: the CPU model or the GPU name.
        details: CPU: ``logical_cores``, ``torch_threads``, ``vector_isa``, ``bf16_native`` (from the feature flags;
            ``None`` where they cannot be read) and ``bf16_flags`` (the native-bf16 flags found); CUDA: ``capability``
            (``"8.0"``), ``memory_gib``, ``bf16_native``.
        autocast: dtype name -> whether ``torch.autocast`` ran a matmul in that dtype here.
        autocast_errors: dtype name -> why it did not (only for the unsupported ones).
        tflops: dtype name -> measured matmul throughput in TFLOP/s (``None`` when not measured).
        matmul_size: dtype name -> the square matrix size the throughput was measured at.

    Examples:
        >>> cpu = DeviceReport("cpu", None, "a CPU", {}, {"float16": True, "bfloat16": True}, {}, {"float32": 0.1})
        >>> cpu.label
        'cpu'
    """

    kind: Literal["cpu", "cuda"]
    index: int | None
    name: str
    details: dict[str, Any]
    autocast: dict[str, bool]
    autocast_errors: dict[str, str]
    tflops: dict[str, float | None]
    matmul_size: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``cpu`` or ``cuda:N``."""
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    def speedup(self, dtype: str) -> float | None:
        """Measured ``dtype`` matmul throughput over fp32 (``None`` if either was not measured).

        Examples:
            >>> DeviceReport("cpu", None, "x", {}, {}, {}, {"float32": 2.0, "bfloat16": 1.0}).speedup("bfloat16")
            0.5
        """
        base, other = self.tflops.get("float32"), self.tflops.get(dtype)
        return None if not base or other is None else other / base


@dataclass(frozen=True)
class Recommendation:
    """The plugin settings recommended for one device, and why.

    Attributes:
        device: the device label (``cpu``, ``cuda:0``).
        precision: ``"bf16-mixed"``, ``"16-mixed"`` or ``"32-true"``.
        master_weights: whether ``MixedPrecisionPlugin(master_weights=True)`` is recommended (never on its own
            judgement: it matters for a model built or loaded in half, which the doctor cannot see; the reasons say).
        code: the Trainer argument that applies it.
        reasons: one sentence per decision.

    Examples:
        >>> Recommendation("cpu", "32-true", False, 'Trainer(precision="32-true")', ["why"]).precision
        '32-true'
    """

    device: str
    precision: Literal["bf16-mixed", "16-mixed", "32-true"]
    master_weights: bool
    code: str
    reasons: list[str]


# ------------------------------------------------------------------------------------------------------- probing
def cpu_name() -> str:
    """The CPU model as the OS names it (``platform.processor()`` where ``/proc/cpuinfo`` is missing).

    Examples:
        >>> isinstance(cpu_name(), str) and cpu_name() != ""
        True
    """
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags(cpuinfo: str | os.PathLike[str] = CPUINFO) -> frozenset[str] | None:
    r"""The CPU's feature flags as the OS lists them (``flags`` in ``/proc/cpuinfo``), or ``None`` where it does not.

    The one source of what the CPU can do: :func:`collect` reads it with or without the benchmark.

    Examples:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix="cpuinfo") as fake:
        ...     _ = fake.write("processor : 0\nflags : fpu avx2 avx512f avx512_bf16\n")
        ...     fake.flush()
        ...     sorted(cpu_flags(fake.name))
        ['avx2', 'avx512_bf16', 'avx512f', 'fpu']
        >>> cpu_flags("/no/such/file") is None
        True
    """
    try:
        with open(cpuinfo) as lines:
            for line in lines:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):  # x86; ARM calls them Features
                    return frozenset(value.split())
    except OSError:
        return None
    return None


def cpu_bf16_native(flags: frozenset[str] | None) -> bool | None:
    """Whether flags from :func:`cpu_flags` include native bf16 arithmetic (:data:`BF16_FLAGS`); ``None``: unknown.

    Examples:
        >>> cpu_bf16_native(frozenset({"avx2", "avx512f", "avx512_bf16"})), cpu_bf16_native(frozenset({"avx2"}))
        (True, False)
    """
    if flags is None:
        return None
    return any(flag in flags for flag in BF16_FLAGS)


def cuda_bf16_native(index: int) -> bool:
    """Whether CUDA device ``index`` computes bf16 natively (compute capability 8.0, Ampere, or newer).

    ``torch.cuda.is_bf16_supported()`` also says yes where bf16 is only emulated (slowly) on older GPUs, and only for
    the current device: the capability is the honest test.
    """
    return torch.cuda.get_device_capability(index) >= (8, 0)


def fp8_support(kind: str, capability: str | None = None) -> str:
    """How a device runs ``fp8-mixed``: ``"native"``, ``"emulated"`` or ``"no"``.

    Native on CUDA from compute capability 8.9 (Ada, Hopper, Blackwell, whose tensor cores multiply float8); emulated
    on CPU (``torch._scaled_mm`` computes FP8's numerics, slowly); not at all on older GPUs (the plugin refuses them).

    Examples:
        >>> fp8_support("cuda", "9.0"), fp8_support("cuda", "8.0"), fp8_support("cpu")
        ('native', 'no', 'emulated')
    """
    if kind != "cuda":
        return "emulated"
    major, minor = (int(part) for part in (capability or "0.0").split(".")[:2])
    return "native" if (major, minor) >= (8, 9) else "no"


_FP8_WORDS = {
    "native": "native (float8 tensor cores, compute capability 8.9+)",
    "emulated": "emulated (torch._scaled_mm on CPU: FP8's numerics, not its speed)",
    "no": "no (needs compute capability 8.9: Ada, Hopper, Blackwell)",
}


def _torchao_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


def autocast_supported(device: str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether ``torch.autocast(device, dtype)`` really runs a matmul in ``dtype`` here, and if not, why.

    Autocast falls back to fp32 with a warning for a dtype it does not support on a device, so the result's dtype is
    checked, not just the absence of an error.

    Examples:
        >>> autocast_supported("cpu", torch.bfloat16)
        (True, '')
    """
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = torch.ones(8, 8, device=device)
            with torch.autocast(device, dtype=dtype):
                out = a @ a
            ok = out.dtype == dtype and bool(torch.isfinite(out).all())
    except Exception as error:  # any failure means "not usable here"; the message is reported
        return False, f"{type(error).__name__}: {error}"
    if ok:
        return True, ""
    said = "; ".join(str(w.message) for w in caught)
    return False, said or f"autocast produced {out.dtype}, not {dtype}"


def matmul_tflops(device: str, dtype: torch.dtype, budget_s: float = 0.3, max_size: int = 1024) -> tuple[float, int]:
    """Measured square-matmul throughput in TFLOP/s, and the size it was measured at.

    The size doubles from 128 while one product takes under 1/8 of ``budget_s`` (so a device where this dtype is slow,
    such as fp16 on most CPUs, is measured on smaller matrices instead of taking seconds), then products are repeated
    until ``budget_s`` has passed.

    Examples:
        >>> tflops, size = matmul_tflops("cpu", torch.float32, budget_s=0.05, max_size=128)
        >>> tflops > 0, size
        (True, 128)
    """
    size, seconds = 128, _time_matmul(device, dtype, 128, repeats=1)
    while size < max_size and seconds < budget_s / 8:
        size *= 2
        seconds = _time_matmul(device, dtype, size, repeats=1)
    repeats = max(1, int(budget_s / max(seconds, 1e-6)))
    seconds = _time_matmul(device, dtype, size, repeats=repeats)
    return 2.0 * size**3 * repeats / seconds / 1e12, size


def _time_matmul(device: str, dtype: torch.dtype, size: int, repeats: int) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b  # warm-up: kernel selection and allocation are not what is measured
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return time.perf_counter() - start


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _probe(
    kind: Literal["cpu", "cuda"], index: int | None, name: str, details: dict[str, Any], benchmark: bool
) -> DeviceReport:
    device = kind if index is None else f"{kind}:{index}"
    autocast: dict[str, bool] = {}
    errors: dict[str, str] = {}
    for dtype_name in ("float16", "bfloat16"):
        autocast[dtype_name], why = autocast_supported(device, DTYPES[dtype_name])
        if why:
            errors[dtype_name] = why
    tflops: dict[str, float | None] = dict.fromkeys(DTYPES)
    sizes: dict[str, int] = {}
    for dtype_name, dtype in DTYPES.items():
        # A dtype autocast cannot use here is not worth timing.
        if benchmark and (dtype_name == "float32" or autocast[dtype_name]):
            tflops[dtype_name], sizes[dtype_name] = matmul_tflops(device, dtype, _BUDGET_S[kind], _MAX_SIZE[kind])
    return DeviceReport(kind, index, name, details, autocast, errors, tflops, sizes)


def probe(device: str, benchmark: bool = False, cpuinfo: str | os.PathLike[str] = CPUINFO) -> DeviceReport:
    """Probe one device (``"cpu"``, ``"cuda"`` for the current one, ``"cuda:N"``): what :func:`recommend` judges.

    Without ``benchmark`` it takes two tiny autocast matmuls and no measurement: ``amp-plus train --precision auto``
    asks :func:`recommend` about its device this way before it trains, and so runs what ``amp-plus doctor`` recommends
    there (the flags decide on CPU, with or without the measurement).

    Args:
        device: the device to probe.
        benchmark: measure matmul throughput (a few seconds on CPU).
        cpuinfo: where the CPU's feature flags are read (:func:`cpu_flags`).

    Examples:
        >>> report = probe("cpu")
        >>> report.label, report.autocast["bfloat16"], report.tflops["float32"]
        ('cpu', True, None)
    """
    if device == "cpu":
        flags = cpu_flags(cpuinfo)
        cpu_details = {
            "logical_cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "vector_isa": torch.backends.cpu.get_cpu_capability(),
            "bf16_native": cpu_bf16_native(flags),
            "bf16_flags": [flag for flag in BF16_FLAGS if flags is not None and flag in flags],
            "fp8": fp8_support("cpu"),
        }
        return _probe("cpu", None, cpu_name(), cpu_details, benchmark)
    index = int(device.partition(":")[2] or torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(index)
    details = {
        "capability": f"{major}.{minor}",
        "memory_gib": round(torch.cuda.get_device_properties(index).total_memory / 2**30, 1),
        "bf16_native": cuda_bf16_native(index),
        "fp8": fp8_support("cuda", f"{major}.{minor}"),
    }
    return _probe("cuda", index, torch.cuda.get_device_name(index), details, benchmark)


def collect(benchmark: bool = True, cpuinfo: str | os.PathLike[str] = CPUINFO) -> list[DeviceReport]:
    """Probe the CPU and every CUDA device: names, features, autocast support, and (``benchmark``) matmul throughput.

    Args:
        benchmark: measure matmul throughput (a few seconds on CPU).
        cpuinfo: where the CPU's feature flags are read (:func:`cpu_flags`).

    Examples:
        >>> [report.kind for report in collect(benchmark=False)][:1]
        ['cpu']
    """
    reports = [probe("cpu", benchmark, cpuinfo)]
    if torch.cuda.is_available():
        reports += [probe(f"cuda:{index}", benchmark) for index in range(torch.cuda.device_count())]
    return reports


# ------------------------------------------------------------------------------------------------------ judging
def recommend(report: DeviceReport) -> Recommendation:
    """The ``MixedPrecisionPlugin`` settings for one device, with a reason for each decision.

    * CUDA with native bf16 (Ampere or newer): ``bf16-mixed``: fp32's exponent range, so no loss scaling and no
      skipped steps, at fp16's speed.
    * CUDA without it (pre-Ampere): ``16-mixed`` with dynamic loss scaling.
    * CPU: ``bf16-mixed`` if its feature flags list native bf16 arithmetic (AMX-BF16 or AVX512-BF16), else
      ``32-true``: mixed precision on such a CPU checks correctness but slows training down. Where the flags cannot
      be read, a bf16 matmul measured at least 1.2x faster than fp32 decides. fp16 is never recommended on CPU (it has
      no fast fp16 path on any common CPU).
    * ``master_weights`` is not recommended by itself: an FP32 model under ``*-mixed`` already steps FP32 weights; it
      is for a model built or loaded in half (the reasons say so, and what saves memory: ``bf16-true`` compensated).

    Examples:
        >>> old_gpu = DeviceReport("cuda", 0, "Tesla V100", {"capability": "7.0", "bf16_native": False},
        ...                        {"float16": True, "bfloat16": True}, {}, {"float32": 14.0, "float16": 100.0})
        >>> recommend(old_gpu).precision
        '16-mixed'
    """
    if report.kind == "cuda":
        return _recommend_cuda(report)
    return _recommend_cpu(report)


def _ratio_text(report: DeviceReport, dtype: str) -> str:
    ratio = report.speedup(dtype)
    return "" if ratio is None else f" (measured {dtype} matmul {ratio:.2f}x fp32's throughput)"


def _recommend_cuda(report: DeviceReport) -> Recommendation:
    capability = report.details.get("capability", "?")
    native = bool(report.details.get("bf16_native")) and report.autocast.get("bfloat16", False)
    memory = (
        "master_weights: not needed for an FP32 model (under *-mixed its FP32 weights are the masters); set "
        "master_weights=True when the model is built or loaded in fp16/bf16, so it trains on FP32 masters. To hold "
        'less memory per parameter, MixedPrecisionPlugin("bf16-true") keeps bf16 weights with Kahan-compensated '
        "updates: 12 bytes per parameter of weights, compensation buffer, AdamW state and gradients, against 16 with "
        "FP32 weights."
    )
    if native:
        return Recommendation(
            report.label,
            "bf16-mixed",
            False,
            'Trainer(plugins=[MixedPrecisionPlugin("bf16-mixed")])',
            [
                f"compute capability {capability} (Ampere or newer) computes bf16 natively"
                f"{_ratio_text(report, 'bfloat16')}; bf16 has fp32's exponent range, so it needs no loss scaling and "
                "steps are not skipped for overflow (the plugin still skips a step with inf/NaN gradients).",
                memory,
            ],
        )
    if report.autocast.get("float16", False):
        return Recommendation(
            report.label,
            "16-mixed",
            False,
            'Trainer(plugins=[MixedPrecisionPlugin("16-mixed")])',
            [
                f"compute capability {capability} predates Ampere: no native bf16 (emulated bf16 is slow), so fp16 "
                f"with dynamic loss scaling{_ratio_text(report, 'float16')}; DynamicLossScaler's defaults find the "
                "scale within the first steps and skip only the steps whose gradients overflow.",
                memory,
            ],
        )
    return Recommendation(
        report.label,
        "32-true",
        False,
        'Trainer(precision="32-true")',
        [f"autocast could not run fp16 or bf16 on this GPU ({report.autocast_errors}): train in fp32."],
    )


def _recommend_cpu(report: DeviceReport) -> Recommendation:
    ratio = report.speedup("bfloat16")
    native = report.details.get("bf16_native")
    no_master = "master_weights: only for a model built or loaded in fp16/bf16 (it trains it on FP32 masters)."
    isa = report.details.get("vector_isa")
    if ratio is None:
        measured = "bf16 was not measured (autocast cannot run it here, or --no-benchmark)"
    else:
        faster = f"{ratio:.1f}x faster than" if ratio >= 1 else f"{1 / ratio:.1f}x slower than"
        measured = f"a bf16 matmul ran {faster} fp32 here"
    if native is None:  # the flags could not be read: the measurement decides
        native = report.autocast.get("bfloat16", False) and ratio is not None and ratio >= _CPU_SPEEDUP_NEEDED
        source = f"{measured} (the CPU's feature flags could not be read)"
    else:
        flags = ", ".join(report.details.get("bf16_flags") or []) or "neither avx512_bf16 nor amx_bf16"
        source = f"its feature flags list {flags}; {measured}"
    if native and report.autocast.get("bfloat16", False):
        return Recommendation(
            report.label,
            "bf16-mixed",
            False,
            'Trainer(plugins=[MixedPrecisionPlugin("bf16-mixed")])',
            [
                f"this CPU ({isa}) has native bf16 arithmetic (AMX or AVX512-BF16: {source}), so bf16 autocast "
                "can speed training up; a model too small to keep the cores busy may not gain.",
                no_master,
            ],
        )
    return Recommendation(
        report.label,
        "32-true",
        False,
        'Trainer(precision="32-true")',
        [
            f"this CPU ({isa}) has no native bf16 arithmetic ({source}): mixed precision here checks correctness "
            "but makes training slower (`amp-plus train` runs 32-true here too; `--precision bf16-mixed` shows the "
            "plugin at work); speed-ups are a GPU matter. fp16 on CPU is slower still.",
            no_master,
        ],
    )


# ------------------------------------------------------------------------------------------------------ output
def report_dict(reports: list[DeviceReport]) -> dict[str, Any]:
    """The doctor's findings as JSON-ready data: versions, devices, a recommendation per device, and the one to use.

    Examples:
        >>> cpu = DeviceReport("cpu", None, "x", {}, {"float16": True, "bfloat16": True}, {}, {"float32": 1.0})
        >>> report_dict([cpu])["recommended"]["precision"]
        '32-true'
    """
    import lightning

    recommendations = [recommend(report) for report in reports]
    # The fastest device wins: the first CUDA device if there is one, as Lightning's accelerator="auto" picks it.
    chosen = next((r for r in recommendations if r.device.startswith("cuda")), recommendations[0])
    return {
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "devices": [asdict(report) | {"label": report.label} for report in reports],
        "recommendations": [asdict(r) for r in recommendations],
        "recommended": asdict(chosen),
        "torchao": _torchao_installed(),
    }


def _tflops_text(report: DeviceReport) -> str:
    parts = []
    for dtype_name, tflops in report.tflops.items():
        if tflops is None:
            parts.append(f"{dtype_name} -")
            continue
        ratio = report.speedup(dtype_name)
        relative = "" if dtype_name == "float32" or ratio is None else f", {ratio:.2g}x fp32"
        parts.append(f"{dtype_name} {tflops:.3g} TFLOP/s (n={report.matmul_size.get(dtype_name, '?')}{relative})")
    return "; ".join(parts)


def format_report(data: dict[str, Any]) -> str:
    """The human-readable report made from :func:`report_dict`'s data."""
    lines = [f"amp-plus doctor (torch {data['torch']}, lightning {data['lightning']})", ""]
    devices = data["devices"]
    for device in devices:
        details = device["details"]
        if device["kind"] == "cpu":
            native = {True: "yes", False: "no", None: "unknown (no feature flags)"}[details.get("bf16_native")]
            flags = ", ".join(details.get("bf16_flags") or [])
            head = (
                f"cpu: {device['name']}, {details.get('logical_cores')} logical cores, torch uses "
                f"{details.get('torch_threads')} threads, vector ISA {details.get('vector_isa')}, native bf16: "
                f"{native}{f' ({flags})' if flags else ''}"
            )
        else:
            head = (
                f"{device['label']}: {device['name']}, compute capability {details.get('capability')}, "
                f"{details.get('memory_gib')} GiB, native bf16: {'yes' if details.get('bf16_native') else 'no'}"
            )
        lines.append(head)
        autocast = ", ".join(
            f"{name} {'yes' if ok else 'no (' + device['autocast_errors'].get(name, '') + ')'}"
            for name, ok in device["autocast"].items()
        )
        lines.append(f"  autocast: {autocast}")
        if "fp8" in details:
            lines.append(f"  fp8-mixed: {_FP8_WORDS.get(details['fp8'], details['fp8'])}")
        report = DeviceReport(**{k: v for k, v in device.items() if k != "label"})
        if any(value is not None for value in report.tflops.values()):
            lines.append(f"  matmul: {_tflops_text(report)}")
    if not any(device["kind"] == "cuda" for device in devices):
        lines.append("cuda: none (torch.cuda.is_available() is False)")
    if not data.get("torchao", True):
        lines.append('fp8-mixed needs torchao, which is not installed: pip install "lightning-amp-plus[fp8]"')
    chosen = data["recommended"]
    lines += ["", f"recommended on {chosen['device']}: {chosen['code']}"]
    lines += [f"  - {reason}" for reason in chosen["reasons"]]
    for other in data["recommendations"]:
        if other["device"] != chosen["device"]:
            lines.append(f"on {other['device']}: {other['code']}")
    return "\n".join(lines)
