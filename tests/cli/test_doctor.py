"""`amp-plus doctor`: probing, measuring, and recommendations that follow from what was found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_amp_plus.cli import doctor, main
from lightning_amp_plus.cli.doctor import DeviceReport, autocast_supported, matmul_tflops, recommend, report_dict

BOTH = {"float16": True, "bfloat16": True}


def cuda(name: str, capability: str, tflops: dict[str, float | None], autocast: dict[str, bool] = BOTH) -> DeviceReport:
    native = tuple(int(part) for part in capability.split(".")) >= (8, 0)
    details = {"capability": capability, "memory_gib": 16.0, "bf16_native": native}
    return DeviceReport("cuda", 0, name, details, autocast, {}, dict(tflops))


def cpu(tflops: dict[str, float | None], native: bool | None = None) -> DeviceReport:
    """A CPU report; ``native``: what its feature flags say of bf16 (``None``: no flags could be read)."""
    flags = ["avx512_bf16"] if native else []
    details = {"vector_isa": "AVX512", "bf16_native": native, "bf16_flags": flags}
    return DeviceReport("cpu", None, "a CPU", details, BOTH, {}, dict(tflops))


def fake_cpuinfo(folder: Path, flags: str) -> Path:
    """A /proc/cpuinfo of two processors with these flags, as Linux writes it."""
    block = "processor\t: {n}\nmodel name\t: A CPU\nflags\t\t: {flags}\n\n"
    path = folder / "cpuinfo"
    path.write_text("".join(block.format(n=n, flags=flags) for n in range(2)))
    return path


AVX512 = "fpu sse2 avx2 avx512f avx512dq avx512bw avx512vl avx512_vnni"


def test_autocast_support_is_found_by_running_a_matmul() -> None:
    assert autocast_supported("cpu", torch.bfloat16) == (True, "")
    works, why = autocast_supported("not-a-device", torch.float16)
    assert not works and "RuntimeError" in why


@pytest.mark.parametrize(("tflops", "size"), [(1.0, 256), (1e-6, 128)], ids=["fast", "slow"])
def test_matmul_throughput_is_measured_at_a_size_that_fits_the_budget(
    monkeypatch: pytest.MonkeyPatch, tflops: float, size: int
) -> None:
    # The sizes follow from the times, here a device of `tflops` (a real timing would depend on the machine's load: a
    # busy one took over 1/8 of 0.05 s for one 256 x 256 fp32 product, and the test failed).
    timed: list[tuple[int, int]] = []

    def time_matmul(device: str, dtype: torch.dtype, n: int, repeats: int) -> float:
        timed.append((n, repeats))
        return 2.0 * n**3 * repeats / (tflops * 1e12)

    monkeypatch.setattr(doctor, "_time_matmul", time_matmul)
    measured, at = matmul_tflops("cpu", torch.float32, budget_s=0.05, max_size=256)
    assert (measured, at) == (pytest.approx(tflops), size)
    # One product at each size while it takes under 1/8 of the budget, doubling up to the cap; then the products at
    # the last size repeated to fill the budget.
    one_product = 2.0 * size**3 / (tflops * 1e12)
    assert timed == [(n, 1) for n in (128, 256) if n <= size] + [(size, max(1, int(0.05 / one_product)))]


def test_matmul_throughput_is_measured_on_the_device() -> None:
    tflops, size = matmul_tflops("cpu", torch.float32, budget_s=0.05, max_size=256)
    assert tflops > 0 and size in (128, 256)


@pytest.mark.parametrize(
    ("report", "precision", "master_weights", "reason"),
    [
        (cuda("NVIDIA A100", "8.0", {"float32": 19.0, "bfloat16": 250.0}), "bf16-mixed", False, "Ampere or newer"),
        (cuda("Tesla V100", "7.0", {"float32": 14.0, "float16": 100.0}), "16-mixed", False, "predates Ampere"),
        (cuda("Tesla K80", "3.7", {"float32": 4.0}, {"float16": False, "bfloat16": False}), "32-true", False, "fp32"),
        (cpu({"float32": 0.1, "float16": 0.001, "bfloat16": 0.001}), "32-true", False, "100.0x slower"),
        (cpu({"float32": 1.0, "float16": None, "bfloat16": 4.0}), "bf16-mixed", False, "4.0x faster"),
        (cpu({"float32": None, "float16": None, "bfloat16": None}), "32-true", False, "not measured"),
        (cpu({"float32": None, "float16": None, "bfloat16": None}, native=True), "bf16-mixed", False, "avx512_bf16"),
        (cpu({"float32": 1.0, "float16": None, "bfloat16": 4.0}, native=False), "32-true", False, "neither"),
    ],
)
def test_recommendation_follows_the_device_found(
    report: DeviceReport, precision: str, master_weights: bool, reason: str
) -> None:
    advice = recommend(report)
    assert (advice.precision, advice.master_weights) == (precision, master_weights)
    assert reason in advice.reasons[0]
    assert precision in advice.code


def test_doctor_json_recommends_fp16_for_a_gpu_without_bf16(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    slow_cpu = cpu({"float32": 0.1, "float16": 0.001, "bfloat16": 0.001})
    v100 = cuda("Tesla V100-SXM2-16GB", "7.0", {"float32": 14.0, "float16": 100.0, "bfloat16": None})
    monkeypatch.setattr(doctor, "collect", lambda benchmark=True: [slow_cpu, v100])
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [device["label"] for device in data["devices"]] == ["cpu", "cuda:0"]
    chosen = data["recommended"]
    assert (chosen["device"], chosen["precision"]) == ("cuda:0", "16-mixed")
    assert chosen["code"] == 'Trainer(plugins=[MixedPrecisionPlugin("16-mixed")])'


@pytest.mark.parametrize(
    ("flags", "native", "precision"),
    [(AVX512 + " avx512_bf16", True, "bf16-mixed"), (AVX512 + " amx_bf16 amx_tile", True, "bf16-mixed"),
     (AVX512, False, "32-true")],
)  # fmt: skip
def test_the_cpus_bf16_support_is_read_from_its_feature_flags_with_or_without_the_benchmark(
    tmp_path: Path, flags: str, native: bool, precision: str
) -> None:
    cpuinfo = fake_cpuinfo(tmp_path, flags)
    assert doctor.cpu_bf16_native(doctor.cpu_flags(cpuinfo)) is native
    unmeasured = doctor.collect(benchmark=False, cpuinfo=cpuinfo)[0]
    assert unmeasured.details["bf16_native"] is native
    advice = recommend(unmeasured)
    assert advice.precision == precision
    # The measurement adds a number to the reasons; it does not change the verdict of the flags.
    measured = DeviceReport(**{**unmeasured.__dict__, "tflops": {"float32": 1.0, "float16": None, "bfloat16": 0.5}})
    assert recommend(measured).precision == precision
    assert "2.0x slower than fp32" in recommend(measured).reasons[0]


def test_without_feature_flags_the_measured_speed_decides(tmp_path: Path) -> None:
    report = doctor.collect(benchmark=False, cpuinfo=tmp_path / "missing")[0]
    assert report.details["bf16_native"] is None
    assert recommend(report).precision == "32-true" and "could not be read" in recommend(report).reasons[0]


@pytest.mark.skipif(doctor.cpu_flags() is None, reason="this OS lists no CPU feature flags in /proc/cpuinfo")
def test_doctor_recommends_the_same_for_this_cpu_with_and_without_the_benchmark(
    capsys: pytest.CaptureFixture[str],
) -> None:
    verdicts = []
    for argv in (["doctor", "--json", "--no-benchmark"], ["doctor", "--json"]):
        assert main(argv) == 0
        data = json.loads(capsys.readouterr().out)
        here = data["devices"][0]
        assert here["kind"] == "cpu" and here["autocast"]["bfloat16"] is True
        verdicts.append(data["recommendations"][0]["precision"])
    measured = data["devices"][0]
    assert measured["tflops"]["float32"] > 0 and measured["matmul_size"]["float32"] >= 128
    native = doctor.cpu_bf16_native(doctor.cpu_flags())
    assert verdicts == ["bf16-mixed" if native else "32-true"] * 2


def test_doctor_text_report_lists_devices_support_speed_and_advice() -> None:
    text = doctor.format_report(report_dict([cpu({"float32": 0.1, "float16": 0.001, "bfloat16": 0.002})]))
    assert "cpu: a CPU" in text and "vector ISA AVX512, native bf16: unknown" in text
    assert "autocast: float16 yes, bfloat16 yes" in text
    assert "bfloat16 0.002 TFLOP/s" in text and "0.02x fp32" in text
    assert 'recommended on cpu: Trainer(precision="32-true")' in text
