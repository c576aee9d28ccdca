"""What one plugin for both front ends must keep: each test here is a defect that shipped, reproduced as a user met it.

The reference in each is somebody else's behaviour: the other front end, ``torch.amp.GradScaler``, Lightning's or
Fabric's own plugin, or FP32 arithmetic. Each failed before the change that fixed it (the core's redesign).
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
from helpers import call_counts, host_reads, lightning_plugin, loader, make_trainer, our_plugin
from lightning.fabric.plugins.precision import MixedPrecision as FabricsMixedPrecision
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from lightning.pytorch.plugins.precision import MixedPrecision as LightningsMixedPrecision
from torch import Tensor, nn

import lightning_amp_plus.fabric as amp_fabric
from lightning_amp_plus import DynamicLossScaler, MixedPrecisionPlugin

pytestmark = pytest.mark.filterwarnings(r"ignore:.*MixedPrecisionPlugin\('16-mixed'\) on CPU:UserWarning")

NUDGE, NUDGES = 1e-4, 200  # 200 SGD steps of +1e-4 on a weight of 1.0: 1.02 in FP32 arithmetic


# ------------------------------------------------------------------------------ the same options, the same run
class Nudged(pl.LightningModule):
    """One weight of 1.0 whose gradient is -1e-4 at every step: SGD(lr=1) adds 1e-4 each time."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        return -NUDGE * (self.weight * x).sum()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(torch.ones(1, dtype=self.weight.dtype))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


def nudged_by_the_trainer(plugin: Any) -> Tensor:
    model = Nudged()
    make_trainer(plugin, max_steps=NUDGES, max_epochs=-1).fit(model, loader(n=NUDGES, batch_size=1))
    return model.weight.detach().clone()


def nudged_by_fabric(plugin: Any) -> Tensor:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = Nudged()
    module, optimizer = fabric.setup(model, model.configure_optimizers())
    for _ in range(NUDGES):
        optimizer.zero_grad()
        fabric.backward(module(torch.ones(1, dtype=model.weight.dtype)))
        optimizer.step()
    return model.weight.detach().clone()


def test_bf16_true_without_the_check_compensates_the_weights_on_the_trainer_as_on_fabric() -> None:
    trainer = nudged_by_the_trainer(MixedPrecisionPlugin("bf16-true", skip_nonfinite=False))
    fabric = nudged_by_fabric(amp_fabric.MixedPrecisionPlugin("bf16-true", skip_nonfinite=False))
    torch.testing.assert_close(trainer, fabric, rtol=0, atol=0)
    # FP32 arithmetic on the same bf16 gradient: compensated bf16 weights are its nearest bf16 value.
    fp32 = 1.0 + NUDGES * torch.tensor(NUDGE).bfloat16().float()
    assert trainer.dtype == torch.bfloat16 and trainer.float().item() == fp32.bfloat16().float().item() != 1.0
    # The control: Lightning's own bf16-true loses every nudge (1e-4 is below half a bf16 ulp at 1.0).
    assert nudged_by_the_trainer(HalfPrecision("bf16-true")).item() == 1.0


# ------------------------------------------------------------------------------- only inf/NaN skips a step
def test_a_finite_gradient_whose_square_overflows_float32_steps_on_the_fused_path_as_grad_scaler_steps_it() -> None:
    def run(scaler: Any) -> tuple[list[float], torch.optim.Optimizer]:
        weight = nn.Parameter(torch.ones(4))
        optimizer = torch.optim.SGD([weight], lr=1e-16, fused=True)
        scaler.scale((1e15 * weight).sum()).backward()  # 1e15 x 65536 = 6.6e19: finite; its square is not
        scaler.step(optimizer)
        scaler.update()
        return weight.detach().tolist(), optimizer

    ours, theirs = DynamicLossScaler(init_scale=65536.0), torch.amp.GradScaler("cpu", init_scale=65536.0)
    (our_weight, optimizer), (their_weight, _) = run(ours), run(theirs)
    assert our_weight == their_weight != [1.0] * 4  # stepped: 1 - 1e-16 x 1e15 = 0.9
    assert ours.get_scale() == theirs.get_scale() == 65536.0
    assert ours.skipped_steps == 0 and not ours.result(optimizer).skipped


# ------------------------------------------------------------------------------------------- sync-free
class FusedWithScheduler(pl.LightningModule):
    """Fused AdamW with a per-step LR schedule: the standard LLM set-up."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def trainer_reads(plugin: Any, steps: int) -> int:
    reads: list[str] = []
    trainer = make_trainer(plugin, max_steps=steps, max_epochs=-1, logger=False, enable_progress_bar=False)
    with host_reads(reads):
        trainer.fit(FusedWithScheduler(), loader(n=8 * steps))
    return len(reads)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_the_trainer_reads_nothing_more_than_fp32_with_fused_adamw_and_a_per_step_scheduler(precision: str) -> None:
    # Lightning's own loop reads a few values per run, whatever the precision: fp32 without a plugin is the baseline.
    baseline = trainer_reads(Precision(), 12)
    assert trainer_reads(MixedPrecisionPlugin(precision), 12) - baseline == 0


def fabric_reads(plugin: Any, steps: int) -> int:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin] if plugin is not None else None)
    model = FusedWithScheduler()
    scheduler_config = model.configure_optimizers()
    module, optimizer = fabric.setup(model, scheduler_config["optimizer"])
    scheduler = scheduler_config["lr_scheduler"]["scheduler"]
    data = [(torch.randn(8, 8), torch.randn(8, 1)) for _ in range(steps)]
    reads: list[str] = []
    with host_reads(reads):
        for x, y in data:
            optimizer.zero_grad()
            fabric.backward(nn.functional.mse_loss(module(x).float(), y))  # forward under the plugin's autocast
            optimizer.step()
            scheduler.step()
    return len(reads)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_a_fabric_loop_with_fused_adamw_and_a_per_step_scheduler_reads_nothing_from_the_device(precision: str) -> None:
    assert fabric_reads(None, 12) == 0  # the loop itself reads nothing
    assert fabric_reads(amp_fabric.MixedPrecisionPlugin(precision), 12) == 0


# ------------------------------------------------------------------------------ the drop-in in nanoGPT's loop
def profiled_ops(scaler: Any) -> list[str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    scaler.scale(model(torch.randn(4, 32)).sum()).backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        scaler.unscale_(optimizer)
    return [event.name for event in profile.events() if event.name.startswith("aten::")]


def test_unscale_makes_grad_scalers_one_pass_and_measures_no_norm() -> None:
    # nanoGPT's and Accelerate's loops clip with torch's clip_grad_norm_ after unscale_: a norm here is a wasted pass.
    ours, theirs = profiled_ops(DynamicLossScaler()), profiled_ops(torch.amp.GradScaler("cpu"))
    assert ours.count("aten::_amp_foreach_non_finite_check_and_unscale_") == 1
    assert not [op for op in ours if "norm" in op] and not [op for op in theirs if "norm" in op]


# ------------------------------------------------------------------------------------ Lightning's contract
class TwoOptimizers(pl.LightningModule):
    """Manual optimization, two optimizers stepped per batch (Lightning's own call-count test does the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(32, 2)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        first, second = self.optimizers()  # type: ignore[misc]
        for optimizer in (first, second):
            self.manual_backward(self.layer(batch[0].repeat(1, 4)).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.layer.parameters(), lr=0.1)


def test_the_scalers_step_can_be_wrapped_with_mock_as_lightnings_tests_do() -> None:
    batches = 3
    plugin = MixedPrecisionPlugin("16-mixed")
    trainer = make_trainer(plugin, max_epochs=1, limit_train_batches=batches)
    assert plugin.scaler is not None
    with mock.patch.object(plugin.scaler, "step", wraps=plugin.scaler.step) as step:
        trainer.fit(TwoOptimizers(), loader(n=8 * batches))
    assert step.call_count == 2 * batches
    assert trainer.global_step == 2 * batches


SCALER_CALLS = ("scale", "unscale_", "step", "update")  # what Lightning's fp16 plugin calls of its GradScaler


class SkipsOddBatches(pl.LightningModule):
    """Lightning's own skip test's model: ``training_step`` returns ``None`` on odd batches (no backward, no step)."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)
        self.fused = fused

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        if batch_idx % 2:
            return None
        return self.layer(batch[0]).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.layer.parameters(), lr=0.1, fused=self.fused)


def scaler_calls(plugin: Any, how: str, clip: float | None, fused: bool = False) -> dict[str, int]:
    """The calls of each of the scaler's methods in a fit of 5 batches (3 train), counted as Lightning's tests count."""
    trainer = make_trainer(plugin, limit_train_batches=5, gradient_clip_val=clip)
    if how == "Mock(wraps=scaler)":  # tests_pytorch/plugins/precision/test_amp_integration.py's way
        plugin.scaler = mock.Mock(wraps=plugin.scaler)
        trainer.fit(SkipsOddBatches(fused), loader(n=40))
        return {name: getattr(plugin.scaler, name).call_count for name in SCALER_CALLS}
    with call_counts(plugin.scaler, SCALER_CALLS) as counted:  # test_manual_optimization.py's way
        trainer.fit(SkipsOddBatches(fused), loader(n=40))
    return {name: method.call_count for name, method in counted.items()}


RETURNED_NONE = "ignore:`training_step` returned `None`:UserWarning"  # Lightning's warning, on purpose here


@pytest.mark.filterwarnings(RETURNED_NONE)
@pytest.mark.parametrize("how", ["Mock(wraps=scaler)", "patch.object"])
@pytest.mark.parametrize("clip", [0.5, None], ids=["clipped", "unclipped"])
def test_the_scaler_is_called_as_lightnings_plugin_calls_its_grad_scaler(how: str, clip: float | None) -> None:
    # Lightning's skip test wraps the plugin's scaler with Mock(wraps=...) and counts unscale_, step and update: the
    # plugin scales, unscales before the hooks, steps and updates through its scaler, as Lightning's does.
    ours = scaler_calls(our_plugin("16-mixed"), how, clip)
    assert ours == scaler_calls(lightning_plugin("16-mixed"), how, clip) == dict.fromkeys(SCALER_CALLS, 3)


@pytest.mark.filterwarnings(RETURNED_NONE)
def test_a_fused_optimizer_unscales_in_its_step_as_under_lightnings_plugin() -> None:
    # Lightning calls no unscale_ for an optimizer that unscales in its own kernel; nor does ours (its fused path).
    ours = scaler_calls(our_plugin("16-mixed"), "patch.object", None, fused=True)
    theirs = scaler_calls(lightning_plugin("16-mixed"), "patch.object", None, fused=True)
    assert ours == theirs == {"scale": 3, "unscale_": 0, "step": 3, "update": 3}


@pytest.mark.parametrize("clip", [True, False], ids=["clip_gradients", "no-clipping"])
def test_fabric_scales_and_unscales_through_the_scaler_as_fabrics_own_plugin(clip: bool) -> None:
    def calls(plugin: Any) -> dict[str, int]:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        module, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with call_counts(plugin.scaler, ("scale", "unscale_", "step")) as counted:
            for x, _ in loader(n=24):
                fabric.backward(module(x).float().pow(2).mean())
                if clip:
                    fabric.clip_gradients(module, optimizer, max_norm=1.0)
                optimizer.step()  # without clipping, the scaler's step calls unscale_, as GradScaler's does
                optimizer.zero_grad()
        return {name: method.call_count for name, method in counted.items()}

    theirs = calls(FabricsMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
    assert calls(amp_fabric.MixedPrecisionPlugin("16-mixed", "cpu")) == theirs == {"scale": 3, "unscale_": 3, "step": 3}


def test_a_scaler_wrapped_by_mock_at_construction_is_called_and_its_engine_steps() -> None:
    def fit(plugin: Any, scaler: Any) -> tuple[dict[str, int], Tensor]:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        module, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, _ in loader(n=24):
            fabric.backward(module(x).float().pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
        return {name: getattr(scaler, name).call_count for name in ("scale", "step")}, model.weight.detach()

    ours_scaler = mock.Mock(wraps=DynamicLossScaler(init_scale=1024.0))
    their_scaler = mock.Mock(wraps=torch.amp.GradScaler("cpu", init_scale=1024.0))
    plugin = amp_fabric.MixedPrecisionPlugin("16-mixed", "cpu", scaler=ours_scaler)
    ours, weight = fit(plugin, ours_scaler)
    theirs, reference = fit(FabricsMixedPrecision("16-mixed", "cpu", scaler=their_scaler), their_scaler)
    assert plugin.scaler is ours_scaler and ours == theirs == {"scale": 3, "step": 3}
    torch.testing.assert_close(weight, reference, rtol=0, atol=0)  # the wrapped scaler's engine stepped, as GradScaler


def test_a_bare_mock_is_still_refused_as_a_scaler() -> None:
    plugin = MixedPrecisionPlugin("16-mixed")
    with pytest.raises(TypeError, match=r"fp16 needs a lightning_amp_plus.DynamicLossScaler"):
        plugin.scaler = mock.Mock()
    with pytest.raises(TypeError, match=r"fp16 needs a lightning_amp_plus.DynamicLossScaler"):
        plugin.scaler = mock.Mock(wraps=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize("make", [MixedPrecisionPlugin, amp_fabric.MixedPrecisionPlugin], ids=["trainer", "fabric"])
def test_autocast_context_manager_is_there_and_autocasts_as_lightnings_does(make: Any) -> None:
    ours = make("bf16-mixed", "cpu")
    with ours.autocast_context_manager():
        result = torch.ones(2, 2) @ torch.ones(2, 2)
    with LightningsMixedPrecision("bf16-mixed", "cpu").autocast_context_manager():
        reference = torch.ones(2, 2) @ torch.ones(2, 2)
    assert result.dtype == reference.dtype == torch.bfloat16


def test_removing_the_scaler_under_fp16_is_refused_and_the_scale_and_skip_count_stay() -> None:
    plugin = MixedPrecisionPlugin("16-mixed", scaler=DynamicLossScaler(init_scale=1024.0))
    scaler = plugin.scaler
    with pytest.raises(ValueError, match=r"scaler = None`: fp16 needs a loss scaler"):
        plugin.scaler = None
    assert plugin.scaler is scaler and scaler is not None and scaler.get_scale() == 1024.0


@pytest.mark.parametrize(
    ("precision", "option"),
    [
        ("bf16-mixed", {"fp8_recipe": "tensorwise"}),
        ("16-mixed", {"fp8_check_interval": 10}),
        ("bf16-mixed", {"compensation": "kahan"}),
        ("bf16-true", {"compensation": "kahan", "rounding_seed": 3}),
        ("16-mixed", {"skip_nonfinite": False}),
        ("bf16-mixed", {"skip_nonfinite": False, "max_consecutive_skips": 5}),
    ],
)
@pytest.mark.parametrize("make", [MixedPrecisionPlugin, amp_fabric.MixedPrecisionPlugin], ids=["trainer", "fabric"])
def test_an_option_the_precision_would_ignore_is_refused_naming_it(make: Any, precision: str, option: dict) -> None:
    name = next(iter(option)) if len(option) == 1 else list(option)[-1]
    with pytest.raises(ValueError, match=name):
        make(precision, **option)


# -------------------------------------------------------------------------------------- Fabric's contract
def clipped_at_an_overflow(plugin: Any, error_if_nonfinite: bool) -> Tensor:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    module, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(module(torch.ones(2, 4)).sum() * torch.inf)
    return fabric.clip_gradients(module, optimizer, max_norm=1.0, error_if_nonfinite=error_if_nonfinite)


def fabrics_own() -> FabricsMixedPrecision:
    return FabricsMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def test_fabric_clip_gradients_returns_the_overflowed_norm_as_fabrics_own_plugin_does() -> None:
    plugin = amp_fabric.MixedPrecisionPlugin("16-mixed", "cpu")
    ours, theirs = clipped_at_an_overflow(plugin, False), clipped_at_an_overflow(fabrics_own(), False)
    assert not torch.isfinite(ours) and not torch.isfinite(theirs)
    with pytest.raises(RuntimeError, match="non-finite"):
        clipped_at_an_overflow(fabrics_own(), True)
    with pytest.raises(RuntimeError, match="non-finite"):
        clipped_at_an_overflow(amp_fabric.MixedPrecisionPlugin("16-mixed", "cpu"), True)
