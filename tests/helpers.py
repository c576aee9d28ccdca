"""Tiny models, data and Trainer settings shared by the Lightning tests (CPU only, a few hundred steps at most)."""

from __future__ import annotations

import copy
import importlib.util
import sys
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from versions import at_least

from lightning_amp_plus import DynamicLossScaler, MixedPrecisionPlugin
from lightning_amp_plus.cli import main
from lightning_amp_plus.data._download import file_md5
from lightning_amp_plus.step.policy import LossScale, ScalePolicy

# The plugin warns once per fit that fp16 autocast on CPU is slow; these tests use it on CPU on purpose.
FP16_ON_CPU_WARNING = r"ignore:MixedPrecisionPlugin\('16-mixed'\) on CPU:UserWarning"
PRECISIONS = ("16-mixed", "bf16-mixed")
HALF = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}  # the half dtype of each mixed precision
INF = float("inf")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The fp16 start scale of the plugins below: it keeps these tiny models clear of fp16 overflow, so that runs under our
# plugin and under Lightning's compare step for step.
START_SCALE = 2.0**10


def regression_data(n: int = 64, seed: int = 0) -> TensorDataset:
    """``n`` random samples of 8 features and 1 target, the same for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=generator), torch.randn(n, 1, generator=generator))


def loader(n: int = 64, batch_size: int = 8) -> DataLoader[tuple[Tensor, ...]]:
    """A DataLoader in a fixed order (``shuffle=False``): two runs see the same batches."""
    return DataLoader(regression_data(n), batch_size=batch_size, shuffle=False)


def step_batch(step: int, batch_size: int = 8) -> tuple[Tensor, Tensor]:
    """A batch that depends only on the optimizer step, not on where a sampler is (for resumed runs)."""
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(batch_size, 8, generator=generator), torch.randn(batch_size, 1, generator=generator)


def make_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def mse(net: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.mse_loss(net(x).float(), y)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it is handed at each ``step``: what the optimizer really sees."""

    def __init__(self, params: Iterable[Any], lr: float) -> None:
        super().__init__(params, lr=lr)
        self.seen: list[list[Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append(
            [p.grad.detach().clone() for g in self.param_groups for p in g["params"] if p.grad is not None]
        )
        return super().step(closure)


class TinyRegressor(pl.LightningModule):
    """Linear(8,16)-ReLU-Linear(16,1) on an MSE loss, with overflows injected at chosen optimizer steps.

    Args:
        overflow_steps: global steps (optimizer steps) whose loss is multiplied by inf, so every gradient is non-finite.
        optimizer: "sgd", "recording_sgd", "adam", "fused_adam" or "lbfgs".
        scheduler: "step" for a StepLR(step_size=1, gamma=0.5) stepped every optimizer step, or None.
        data_from_step: ignore the loader's batch and use ``step_batch(global_step)`` instead.
    """

    def __init__(
        self,
        overflow_steps: Iterable[int] = (),
        optimizer: str = "sgd",
        lr: float = 0.05,
        weight_decay: float = 0.0,
        scheduler: str | None = None,
        data_from_step: bool = False,
    ) -> None:
        super().__init__()
        self.net = make_net()
        self.overflow_steps = set(overflow_steps)
        self.optimizer_name = optimizer
        self.lr = lr
        self.weight_decay = weight_decay
        self.scheduler_name = scheduler
        self.data_from_step = data_from_step
        self.last_batch: tuple[Tensor, Tensor] | None = None
        self.forward_dtypes: list[torch.dtype] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        if self.data_from_step:
            batch = step_batch(self.trainer.global_step, batch_size=len(batch[0]))
        self.last_batch = batch
        self.forward_dtypes.append(self.net[0](batch[0]).dtype)
        loss = mse(self.net, batch)
        if self.trainer.global_step in self.overflow_steps:
            loss = loss * INF
        return loss

    def configure_optimizers(self) -> Any:
        params = self.parameters()
        if self.optimizer_name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(params, lr=self.lr)
        elif self.optimizer_name == "recording_sgd":
            optimizer = RecordingSGD(params, lr=self.lr)
        elif self.optimizer_name in ("adam", "fused_adam", "foreach_adam"):
            fused = self.optimizer_name == "fused_adam"
            optimizer = torch.optim.Adam(
                params, lr=self.lr, weight_decay=self.weight_decay, fused=fused, foreach=None if fused else True
            )
        elif self.optimizer_name == "lbfgs":
            optimizer = torch.optim.LBFGS(params, lr=self.lr)
        else:
            raise ValueError(self.optimizer_name)
        if self.scheduler_name is None:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SpikyRegressor(pl.LightningModule):
    """The tiny regressor on batches ``(x, y, factor)`` (the loss times ``factor``: a spike where it is large), AdamW
    with a StepLR stepped every step.

    ``clip_at``: a batch index and a norm: the hook clips that batch's gradients to the norm (the reference for
    ``action="clip"``), before Lightning's own clipping (``on_before_optimizer_step`` runs first).
    """

    def __init__(self, clip_at: tuple[int, float] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = make_net()
        self.clip_at = clip_at

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y, factor = batch
        return mse(self.net, (x, y)) * factor

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.clip_at is not None and self.trainer.global_step == self.clip_at[0]:
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.clip_at[1])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, foreach=True)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ScaleRecorder(pl.Callback):
    """Records ``trainer.scaler.get_scale()`` after every training batch, and our plugin's last step's gradient norm."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.grad_norms: list[float | None] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.scales.append(trainer.scaler.get_scale())
        recent = getattr(trainer.precision_plugin, "recent_steps", None)
        self.grad_norms.append(recent[-1].grad_norm if recent else None)


def walk_to_floor(policy: ScalePolicy) -> int:
    """Overflows in a row from ``max_scale`` until the scale stops falling, run by the scale's own state machine."""
    scale, count = LossScale(policy, policy.max_scale), 0
    scale.set(policy.max_scale, 0, 1)
    while policy.backs_off(*scale.read()[::2]):
        scale.advance(torch.tensor(1.0))
        count += 1
    return count


def skip_bound(scaler: Any) -> int | None:
    """The documented most steps in a row a run can skip before it stops.

    The skip limit plus the backoffs from the ceiling to the floor (``None`` without a limit).
    """
    limit = scaler.engine.max_consecutive_skips
    return None if limit is None else limit + walk_to_floor(scaler.engine.loss_scale.policy)


class StateAroundSteps(pl.Callback):
    """The weights and the optimizer's tensor state (Adam's moments...) at the start and at the end of each batch.

    ``before[i]`` and ``after[i]`` list the parameters, then the state tensors, of training batch ``i``.
    """

    def __init__(self) -> None:
        self.before: list[list[Tensor]] = []
        self.after: list[list[Tensor]] = []

    def _state(self, trainer: pl.Trainer, module: pl.LightningModule) -> list[Tensor]:
        opt = trainer.optimizers[0]
        state = [t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, Tensor)]
        return parameters_of(module) + state

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.before.append(self._state(trainer, module))

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.after.append(self._state(trainer, module))


class TrainingStateAfterBatches(pl.Callback):
    """After every training batch, in ``taken``: the parameters, the optimizer's state dict, the LR and the first
    scheduler's ``last_epoch`` (``None`` without a scheduler)."""

    def __init__(self) -> None:
        self.taken: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        optimizer = trainer.optimizers[0]
        configs = trainer.lr_scheduler_configs
        self.taken.append(
            {
                "params": parameters_of(pl_module),
                "state": copy.deepcopy(optimizer.state_dict()["state"]),
                "lr": optimizer.param_groups[0]["lr"],
                "last_epoch": configs[0].scheduler.last_epoch if configs else None,
            }
        )


def make_trainer(plugin: Precision | None = None, **kwargs: Any) -> pl.Trainer:
    """A quiet single-process CPU Trainer; keyword arguments override the defaults."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "max_epochs": 1,
    }
    if plugin is not None:
        settings["plugins"] = [plugin]
    settings.update(kwargs)
    return pl.Trainer(**settings)


# ------------------------------------------------------------------------------------------------- the plugins
def our_plugin(precision: str, growth_interval: int = 10_000, **options: Any) -> MixedPrecisionPlugin:
    """``MixedPrecisionPlugin`` on CPU; under fp16 its scaler starts at :data:`START_SCALE` and grows after
    ``growth_interval`` clean steps, as :func:`lightning_plugin`'s GradScaler does. ``options`` go to the plugin."""
    scaler = (
        DynamicLossScaler(init_scale=START_SCALE, growth_interval=growth_interval) if precision == "16-mixed" else None
    )
    return MixedPrecisionPlugin(precision, device="cpu", scaler=scaler, **options)  # type: ignore[arg-type]


class CastCaching(MixedPrecision):
    """Lightning's ``MixedPrecision`` with torch's autocast cast cache on (``cache_enabled=True``) or off."""

    def __init__(self, precision: str, device: str, cache_enabled: bool) -> None:
        super().__init__(precision, device)  # type: ignore[arg-type]
        self.cache_enabled = cache_enabled

    def autocast_context_manager(self) -> torch.autocast:
        dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.half
        return torch.autocast(self.device, dtype=dtype, cache_enabled=self.cache_enabled)


def lightning_plugin(precision: str, growth_interval: int = 10_000, cast_cache: bool | None = None) -> MixedPrecision:
    """Lightning's ``MixedPrecision`` on CPU, the reference for :func:`our_plugin`: under fp16 its GradScaler starts
    at :data:`START_SCALE` and grows after ``growth_interval`` clean steps.

    Its autocast is the one of Lightning 2.5.5 and later, without torch's cast cache, as this package's: before 2.5.5
    Lightning's autocast kept the cache on, which casts a weight to half once per step, so a layer applied twice in a
    step (a GAN's discriminator, a WGAN critic) has its two weight gradients summed in half precision, not in FP32
    (``test_lightning_features.py`` shows it on Lightning's own plugin). ``cast_cache`` sets the cache whatever the
    release; ``None`` keeps the installed plugin's own autocast from 2.5.5 on.
    """
    if cast_cache is None and not at_least("lightning", "2.5.5"):
        cast_cache = False
    plugin = (
        MixedPrecision(precision, device="cpu")  # type: ignore[arg-type]
        if cast_cache is None
        else CastCaching(precision, "cpu", cache_enabled=cast_cache)
    )
    if plugin.scaler is not None:
        plugin.scaler = torch.amp.GradScaler("cpu", init_scale=START_SCALE, growth_interval=growth_interval)
    return plugin


def parameters_of(module: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def assert_same_parameters(a: nn.Module, b: nn.Module, rtol: float = 0.0, atol: float = 0.0) -> None:
    """``a``'s parameters equal ``b``'s (bit for bit by default), the failure naming the first that differs."""
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def global_norm(tensors: Iterable[Tensor]) -> Tensor:
    """The L2 norm of all tensors together, computed in float64 as an independent reference."""
    return torch.linalg.vector_norm(torch.cat([t.detach().double().reshape(-1) for t in tensors]))


def unscaled_reference_grads(module: pl.LightningModule, batch: tuple[Tensor, Tensor]) -> list[Tensor]:
    """The gradients of ``module``'s loss on ``batch`` under the plugin's autocast, without any loss scaling.

    Computed on a copy, so the module's own gradients are left alone. The forward runs in the trainer's
    ``forward_context`` (same autocast as training) and the backward outside it, as Lightning does.
    """
    twin = copy.deepcopy(module.net)
    twin.zero_grad(set_to_none=True)
    with module.trainer.precision_plugin.forward_context():
        loss = mse(twin, batch)
    loss.backward()
    return [p.grad.detach().clone() for p in twin.parameters() if p.grad is not None]


# ------------------------------------------------------------------------------------------- the command line
def native_bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this CPU's feature flags list native bf16, so that ``--precision auto`` runs bf16-mixed on any machine.

    ``auto`` is what ``amp-plus doctor`` recommends: bf16-mixed only on a CPU with native bf16 arithmetic, 32-true on
    the others. A test about what auto chooses says which kind of CPU it means.
    """
    from lightning_amp_plus.cli import doctor

    monkeypatch.setattr(doctor, "cpu_flags", lambda cpuinfo=doctor.CPUINFO: frozenset({"avx2", "avx512_bf16"}))


def usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``amp-plus argv`` in this process, expect exit code 2, and return stderr (which must hold no traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err: str = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# ------------------------------------------------------------------------------------------------ host reads
# Tensor methods that copy a device value to the host.
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu", "__array__")


@contextmanager
def host_reads(calls: list[str]) -> Iterator[None]:
    """Record in ``calls`` the name of every host read of a tensor (:data:`HOST_READS`) made inside the block.

    Hand-made rather than pytest's ``monkeypatch``: hypothesis runs many examples in one test call, and a
    function-scoped fixture would be shared by all of them.
    """
    originals = {name: getattr(Tensor, name) for name in HOST_READS if hasattr(Tensor, name)}

    def spy(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    try:
        for name, original in originals.items():
            setattr(Tensor, name, spy(name, original))
        yield
    finally:
        for name, original in originals.items():
            setattr(Tensor, name, original)


@contextmanager
def call_counts(instance: object, names: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The named methods of ``instance`` patched on the instance, each counting its calls and running as before.

    ``mock.patch.object(instance, name, wraps=...)``, as Lightning's own tests count a scaler's calls; the mocks are
    yielded by name (``.call_count``) and removed on exit.
    """
    with ExitStack() as stack:
        patch = mock.patch.object
        yield {name: stack.enter_context(patch(instance, name, wraps=getattr(instance, name))) for name in names}


# ------------------------------------------------------------------------------------------------- downloads
class FakeNetwork:
    """Stands in for torchvision's ``download_url``: records each attempt and, by default, fails as if offline.

    As torchvision's, it does nothing when the file is already there and passes the (optional) md5. Set
    ``behaviour(url, path)`` to serve a download.
    """

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.behaviour: Callable[[str, Path], None] = self.offline

    @staticmethod
    def offline(url: str, path: Path) -> None:
        raise OSError(f"network disabled in tests: {url}")

    def download_url(self, url: str, root: str, filename: str | None = None, md5: str | None = None) -> None:
        path = Path(root) / (filename or Path(url).name)
        if path.is_file() and (md5 is None or file_md5(path) == md5):
            return
        self.urls.append(url)
        self.behaviour(url, path)


def fake_network(monkeypatch: pytest.MonkeyPatch) -> FakeNetwork:
    """Put a :class:`FakeNetwork` in torchvision's place, and make any other URL opened fail the test."""
    from torchvision.datasets import utils as tv_utils

    fake = FakeNetwork()
    monkeypatch.setattr(tv_utils, "download_url", fake.download_url)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a test tried to open a URL")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    return fake


def load_script(path: Path, module_name: str) -> ModuleType:
    """Import a script that is not in a package (an example, a benchmark) as ``module_name``, fresh each call."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a module up by its name
    spec.loader.exec_module(module)
    return module
