"""Lightning's throughput monitors read a plugin's compute dtype from its class: ours give what Lightning's give.

``ThroughputMonitor`` (the Trainer's callback) and Fabric's ``ThroughputMonitor`` (litgpt's pretraining loop logs its
MFU with it) divide the FLOPs done by the device's peak FLOPs in the plugin's compute dtype, which Lightning finds from
the plugin's class: a ``MixedPrecision`` computes in its autocast dtype, a ``HalfPrecision`` in its half dtype, an
``FSDPPrecision`` in its ``mixed_precision_config.reduce_dtype``, any other plugin in FP32.

Found here and fixed: our plugins were taken for FP32 plugins (on an H100, an MFU against 66.9 TFLOP/s instead of
989.4: 15x too high; 2x with TF32 matmuls), and under the FSDP plugins without master weights (no
``mixed_precision_config``) both monitors failed with ``AttributeError: 'NoneType' object has no attribute
'reduce_dtype'``. The plugins are now instances of their front end's ``MixedPrecision``.

What is compared is the dtype a monitor hands ``get_available_flops`` (the one decision the plugin takes part in: this
machine has no GPU to look a peak up for), and the peak Lightning's table gives that dtype on every GPU it lists.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities.throughput import _CUDA_FLOPS
from torch.utils.data import DataLoader, TensorDataset

import lightning_amp_plus
from lightning_amp_plus import fabric

pytestmark = [
    pytest.mark.filterwarnings(r"ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings(r"ignore:.*\('fp8-mixed'\) on CPU. torch emulates:UserWarning"),
]

TRAINERS = {"lightning_amp_plus": "lightning.pytorch", "lightning_amp_plus.pytorch_lightning": "pytorch_lightning"}
FABRICS = {"lightning_amp_plus.fabric": "lightning.fabric", "lightning_amp_plus.lightning_fabric": "lightning_fabric"}
PRECISIONS = ["16-mixed", "bf16-mixed", "bf16-true", "fp8-mixed"]
# Lightning's Trainer reads a MixedPrecision as "bf16 if precision == 'bf16-mixed' else fp16": for our bf16-true and
# fp8-mixed it names fp16, whose peak equals bf16's on every GPU of its table that computes in bf16 (checked below).
TRAINER_NAMES_FP16 = {"bf16-true", "fp8-mixed"}


def imported(namespace: str, package: str, precision: str) -> Any:
    """Our ``namespace`` (skipped where Lightning's ``package`` or, for fp8-mixed, torchao is not installed)."""
    pytest.importorskip(package, reason=f"{package} is not installed")
    if precision == "fp8-mixed":
        pytest.importorskip("torchao.float8", reason="fp8-mixed needs torchao")
    return importlib.import_module(namespace)


def peaks(dtype: torch.dtype) -> dict[str, float | None]:
    """The peak FLOP/s Lightning's table gives ``dtype`` on each GPU it lists that computes in bf16."""
    return {chip: flops.get(dtype) for chip, flops in _CUDA_FLOPS.items() if torch.bfloat16 in flops}


def lightnings_plugin(package: str, precision: str) -> Any:
    """Lightning's own plugin at ``precision`` (torchao's recipe runs under its bf16-mixed)."""
    plugins = importlib.import_module(f"{package}.plugins.precision")
    if precision == "bf16-true":
        return plugins.HalfPrecision("bf16-true")
    return plugins.MixedPrecision("bf16-mixed" if precision == "fp8-mixed" else precision, "cpu")


def dtype_read(monitors: str, set_up: Callable[[], Any]) -> torch.dtype:
    """The compute dtype handed to ``get_available_flops`` while ``set_up()`` sets up a monitor of ``monitors``."""
    module = importlib.import_module(monitors)
    with mock.patch.object(module, "get_available_flops", wraps=module.get_available_flops) as spy:
        set_up()
    assert spy.call_count == 1
    dtype = spy.call_args.args[1]
    assert isinstance(dtype, torch.dtype)
    return dtype


def one_layer(package: str) -> Any:
    """A LightningModule of ``package``'s: one Linear layer FP8 takes (16 x 16), SGD on its output's mean."""
    trainers = importlib.import_module(package)

    class OneLayer(trainers.LightningModule):  # type: ignore[misc,name-defined]
        flops_per_batch = 3 * 2 * 16 * 16 * 16  # the forward and backward GEMMs of a batch of 16: what MFU counts

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 16))

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).float().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return OneLayer()


def trainer_dtype(package: str, plugin: Any, **trainer_kwargs: Any) -> torch.dtype:
    """What the Trainer's ``ThroughputMonitor`` reads in a one-step fit under ``plugin``."""
    trainers = importlib.import_module(package)
    trainer = trainers.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[plugin],
        callbacks=[trainers.callbacks.ThroughputMonitor(batch_size_fn=len)],
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **trainer_kwargs,
    )
    data = DataLoader(TensorDataset(torch.randn(16, 16)), batch_size=16)
    return dtype_read(f"{package}.callbacks.throughput_monitor", lambda: trainer.fit(one_layer(package), data))


def fabric_dtype(package: str, plugin: Any, **fabric_kwargs: Any) -> torch.dtype:
    """What Fabric's ``ThroughputMonitor(fabric)`` reads for a Fabric with ``plugin``."""
    runner = importlib.import_module(package).Fabric(accelerator="cpu", devices=1, plugins=[plugin], **fabric_kwargs)
    runner.launch()
    monitors = f"{package}.utilities.throughput"
    return dtype_read(monitors, lambda: importlib.import_module(monitors).ThroughputMonitor(runner))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("namespace", list(TRAINERS))
def test_the_trainers_throughput_monitor_reads_the_compute_dtype_lightnings_plugin_gives(
    namespace: str, precision: str
) -> None:
    package = TRAINERS[namespace]
    plugin = imported(namespace, package, precision).MixedPrecisionPlugin(precision, "cpu")
    ours, theirs = trainer_dtype(package, plugin), trainer_dtype(package, lightnings_plugin(package, precision))
    assert ours == (torch.float16 if precision in TRAINER_NAMES_FP16 else theirs)
    assert peaks(ours) == peaks(theirs)
    assert isinstance(plugin, importlib.import_module(f"{package}.plugins.precision").MixedPrecision)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("namespace", list(FABRICS))
def test_fabrics_throughput_monitor_reads_the_compute_dtype_lightnings_plugin_gives(
    namespace: str, precision: str
) -> None:
    package = FABRICS[namespace]
    plugin = imported(namespace, package, precision).MixedPrecisionPlugin(precision, "cpu")
    ours, theirs = fabric_dtype(package, plugin), fabric_dtype(package, lightnings_plugin(package, precision))
    assert ours == theirs
    assert isinstance(plugin, importlib.import_module(f"{package}.plugins.precision").MixedPrecision)


# Lightning's own FSDPPrecision makes a ShardedGradScaler at 16-mixed and autocasts on CUDA only: each says there is no
# CUDA here and disables itself (in torch's words of each release). FSDP on one process does not shard.
@pytest.mark.filterwarnings("ignore:.*CUDA is not available.*Disabling:UserWarning")
@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`:UserWarning")
@pytest.mark.parametrize("master_weights", [False, True])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_both_throughput_monitors_set_up_under_the_fsdp_plugins_and_read_what_lightnings_fsdp_plugin_gives(
    precision: str, master_weights: bool, one_process_group: None
) -> None:
    from cpu_fsdp import CPUFSDPStrategy
    from cpu_fsdp_fabric import CPUFabricFSDPStrategy
    from lightning.fabric.plugins.precision import FSDPPrecision as FabricFSDPPrecision
    from lightning.pytorch.plugins.precision import FSDPPrecision

    half = torch.float16 if precision == "16-mixed" else torch.bfloat16
    ours = lightning_amp_plus.FSDPMixedPrecisionPlugin(precision, master_weights=master_weights)
    theirs = FSDPPrecision(precision)  # type: ignore[arg-type]
    for plugin in (ours, theirs):
        assert trainer_dtype("lightning.pytorch", plugin, strategy=CPUFSDPStrategy()) == half
    ours_fabric = fabric.FSDPMixedPrecisionPlugin(precision, master_weights=master_weights)
    theirs_fabric = FabricFSDPPrecision(precision)  # type: ignore[arg-type]
    for plugin in (ours_fabric, theirs_fabric):
        assert fabric_dtype("lightning.fabric", plugin, strategy=CPUFabricFSDPStrategy()) == half


class Metrics(pl.loggers.Logger):
    """Keeps what is logged, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: dict[str, list[float]] = {}

    @property
    def name(self) -> str:
        return "metrics"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.logged.setdefault(key, []).append(value)


def test_a_fit_under_the_plugin_logs_the_throughput_lightnings_plugin_logs() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    logged = []
    for plugin in (lightning_amp_plus.MixedPrecisionPlugin("16-mixed", "cpu"), MixedPrecision("16-mixed", "cpu")):
        metrics = Metrics()
        trainer = pl.Trainer(
            accelerator="cpu",
            plugins=[plugin],
            callbacks=[pl.callbacks.ThroughputMonitor(batch_size_fn=len, window_size=2)],
            max_steps=4,
            logger=metrics,
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(one_layer("lightning.pytorch"), DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=16))
        logged.append({key: len(values) for key, values in metrics.logged.items()})
    assert logged[0] == logged[1]
    assert logged[0]["train/device/samples_per_sec"] == logged[0]["train/device/flops_per_sec"] == 3  # 2nd step on


@pytest.mark.parametrize(
    ("ours", "lightnings"),
    [
        (lightning_amp_plus.MixedPrecisionPlugin, "lightning.pytorch.plugins.precision"),
        (lightning_amp_plus.FSDPMixedPrecisionPlugin, "lightning.pytorch.plugins.precision"),
        (fabric.MixedPrecisionPlugin, "lightning.fabric.plugins.precision"),
        (fabric.FSDPMixedPrecisionPlugin, "lightning.fabric.plugins.precision"),
    ],
)
def test_the_plugins_are_lightnings_mixed_precision_by_class_and_run_none_of_its_methods(
    ours: type, lightnings: str
) -> None:
    # Its methods would scale through a torch GradScaler, refuse to clip a fused optimizer's gradients and autocast to
    # fp16 for every precision but bf16-mixed: where its bases put it first, the Trainer plugin names what it keeps.
    mixed_precision = importlib.import_module(lightnings).MixedPrecision
    assert issubclass(ours, mixed_precision)
    methods = [name for name, value in vars(mixed_precision).items() if callable(value)]
    assert "optimizer_step" in methods and "state_dict" in methods
    assert [name for name in methods if getattr(ours, name) is getattr(mixed_precision, name)] == []
