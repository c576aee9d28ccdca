"""``import lightning_fabric``: Lightning's standalone Fabric package trains with this package's Fabric plugins.

``lightning_fabric`` (the ``pytorch-lightning`` wheel holds it, beside ``pytorch_lightning``) is the same Fabric as
``lightning.fabric``, with its own copy of every class: its ``Fabric`` refuses a plugin built on ``lightning.fabric``'s
``Precision`` with ``TypeError(f"Found invalid type for plugin {plugin}. ...")``, and ``lightning.Fabric`` refuses one
built on ``lightning_fabric``'s. ``lightning_amp_plus.lightning_fabric`` holds the Fabric plugins built over it from
the same source; the plugin's ``str`` names the import to use. The reference for the standalone plugin is the same
plugin under ``lightning.Fabric`` and ``lightning_fabric``'s own ``MixedPrecision`` with ``torch.amp.GradScaler``, run
through the same loop (:mod:`fabric_loops`), bit for bit.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from fabric_loops import GROWTH_INTERVAL, START_SCALE, FabricRun, Loop, assert_same_runs, ours
from torch import nn

import lightning_amp_plus
import lightning_amp_plus.fabric as amp_fabric
from lightning_amp_plus import DynamicLossScaler, MixedPrecisionMonitor

lightning_fabric = pytest.importorskip("lightning_fabric", reason="lightning_fabric is not installed")
from lightning_amp_plus import lightning_fabric as standalone  # noqa: E402

pytestmark = pytest.mark.filterwarnings(r"ignore:.*MixedPrecisionPlugin\('16-mixed'\) on CPU:UserWarning")


def standalone_ours(precision: str = "16-mixed") -> Any:
    """The standalone plugin, set as :func:`fabric_loops.ours` sets the lightning one."""
    scaler = (
        DynamicLossScaler(init_scale=START_SCALE, growth_interval=GROWTH_INTERVAL) if precision == "16-mixed" else None
    )
    return standalone.MixedPrecisionPlugin(precision, "cpu", scaler)


def standalone_fabrics(precision: str = "16-mixed") -> Any:
    """``lightning_fabric``'s own plugin, fp16 with ``torch.amp.GradScaler`` set like our scaler."""
    from lightning_fabric.plugins.precision import MixedPrecision

    if precision == "16-mixed":
        scaler = torch.amp.GradScaler("cpu", init_scale=START_SCALE, growth_interval=GROWTH_INTERVAL)
        return MixedPrecision("16-mixed", "cpu", scaler=scaler)
    return MixedPrecision("bf16-mixed", "cpu")


# --------------------------------------------------------------------------------------------- the refusals
@pytest.mark.parametrize("kind", ["MixedPrecisionPlugin", "FSDPMixedPrecisionPlugin"])
def test_lightning_fabrics_fabric_refuses_a_lightning_plugin_naming_the_import_to_use(kind: str) -> None:
    plugin = getattr(amp_fabric, kind)("bf16-mixed")
    with pytest.raises(TypeError) as refusal:
        lightning_fabric.Fabric(accelerator="cpu", plugins=[plugin])
    assert str(refusal.value).startswith(
        f"Found invalid type for plugin lightning_amp_plus.fabric.{kind}('bf16-mixed'), a plugin for "
        "`lightning.fabric`'s Fabric (with the `lightning_fabric` package, import it from "
        f"lightning_amp_plus.lightning_fabric; for the Trainer, use lightning_amp_plus.{kind})"
    )


@pytest.mark.parametrize("kind", ["MixedPrecisionPlugin", "FSDPMixedPrecisionPlugin"])
def test_lightnings_fabric_refuses_a_lightning_fabric_plugin_naming_the_import_to_use(kind: str) -> None:
    plugin = getattr(standalone, kind)("bf16-mixed")
    with pytest.raises(TypeError) as refusal:
        L.Fabric(accelerator="cpu", plugins=[plugin])
    assert str(refusal.value).startswith(
        f"Found invalid type for plugin lightning_amp_plus.lightning_fabric.{kind}('bf16-mixed'), a plugin for "
        "`lightning_fabric`'s Fabric (with the `lightning` package, import it from lightning_amp_plus.fabric; for the "
        f"Trainer, use lightning_amp_plus.pytorch_lightning.{kind})"
    )


def test_pytorch_lightnings_trainer_plugin_given_to_lightning_fabric_is_refused_naming_its_fabric_plugin() -> None:
    pytest.importorskip("pytorch_lightning")
    from lightning_amp_plus import pytorch_lightning as trainer_standalone

    fabric = lightning_fabric.Fabric(
        accelerator="cpu", devices=1, plugins=[trainer_standalone.MixedPrecisionPlugin("bf16-mixed", "cpu")]
    )
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match=re.escape("use lightning_amp_plus.lightning_fabric.MixedPrecisionPlugin(")):
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_classes_are_the_same_source_over_lightning_fabrics_bases() -> None:
    from lightning_fabric.plugins.precision import FSDPPrecision, Precision

    plugin = standalone.MixedPrecisionPlugin("16-mixed", "cpu")
    assert isinstance(plugin, Precision) and not isinstance(plugin, amp_fabric.MixedPrecisionPlugin)
    assert isinstance(standalone.FSDPMixedPrecisionPlugin("bf16-mixed"), FSDPPrecision)
    assert repr(plugin) == "lightning_amp_plus.lightning_fabric.MixedPrecisionPlugin('16-mixed')"
    source = Path(lightning_amp_plus.__file__).parent / "plugins" / "precision.py"
    assert standalone.MixedPrecisionPlugin.optimizer_step.__code__.co_filename == str(source)
    # The numerics import no Lightning: the scaler and the engine are one class whichever namespace drives them.
    assert type(plugin.scaler) is DynamicLossScaler and type(plugin.engine) is type(ours().engine)
    assert standalone.__all__ == amp_fabric.__all__ == ["FSDPMixedPrecisionPlugin", "MixedPrecisionPlugin"]
    assert dir(standalone) == standalone.__all__
    with pytest.raises(AttributeError, match="has no attribute 'MixedPrecisionMonitor'"):
        standalone.MixedPrecisionMonitor  # noqa: B018  # the monitor is one for both Fabrics: lightning_amp_plus's


# --------------------------------------------------------------------------------------- the same training
@pytest.mark.parametrize("clip", [None, "norm"])
def test_fp16_under_lightning_fabric_equals_lightning_and_lightning_fabrics_own_plugin_bit_for_bit(clip: Any) -> None:
    loop = Loop(steps=8, accumulate=2, clip=clip, overflow_at=(1, 4))
    mine = FabricRun(standalone_ours(), loop, fabric=lightning_fabric.Fabric).run()
    lightnings = FabricRun(ours(), loop).run()
    theirs = FabricRun(standalone_fabrics(), loop, fabric=lightning_fabric.Fabric).run()
    assert_same_runs(mine, lightnings, what="lightning_fabric against lightning")
    assert_same_runs(mine, theirs, what="ours against lightning_fabric's MixedPrecision with GradScaler")
    assert mine.plugin.skipped_steps == 2
    assert [r.skipped for r in mine.plugin.recent_steps] == [s in (1, 4) for s in range(8)]
    if clip == "norm":
        assert [repr(n) for n in mine.clip_norms] == [repr(n) for n in theirs.clip_norms]


def test_bf16_under_lightning_fabric_skips_a_nan_step_that_lightning_fabrics_own_plugin_applies() -> None:
    loop = Loop(steps=4, nan_at=(2,), optimizer="adamw-fused")
    mine = FabricRun(standalone_ours("bf16-mixed"), loop, fabric=lightning_fabric.Fabric).run()
    lightnings = FabricRun(ours("bf16-mixed"), loop).run()
    theirs = FabricRun(standalone_fabrics("bf16-mixed"), loop, fabric=lightning_fabric.Fabric).run()
    assert_same_runs(mine, lightnings, what="lightning_fabric against lightning")
    assert mine.plugin.skipped_steps == 1
    for before, after in zip(mine.params[1], mine.params[2], strict=True):
        assert torch.equal(before, after)  # the NaN step left the parameters as they were
    assert all(torch.isfinite(p).all() for p in mine.params[-1])
    assert not all(torch.isfinite(p).all() for p in theirs.params[-1])  # premise: unchecked, the NaN is applied


@pytest.mark.filterwarnings(r"ignore:.*'fp8-mixed'\) on CPU:UserWarning")
def test_fp8_under_lightning_fabric_equals_lightning_bit_for_bit_and_names_the_layers_of_a_nan_step() -> None:
    pytest.importorskip("torchao.float8", reason="fp8-mixed needs torchao (the fp8 extra)")

    def run(fabric_type: Any, plugin: Any) -> tuple[list[torch.Tensor], Any]:
        fabric = fabric_type(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
        for step in range(4):
            loss = model(torch.randn(16, 32)).float().square().mean()
            fabric.backward(loss * (math.nan if step == 2 else 1.0))
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in net.parameters()], plugin

    mine, plugin = run(
        lightning_fabric.Fabric, standalone.MixedPrecisionPlugin("fp8-mixed", "cpu", fp8_check_interval=2)
    )
    theirs, reference = run(L.Fabric, amp_fabric.MixedPrecisionPlugin("fp8-mixed", "cpu", fp8_check_interval=2))
    for p, q in zip(mine, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert plugin.skipped_steps == reference.skipped_steps == 1
    assert list(plugin.fp8.layers) == list(reference.fp8.layers) == ["0", "2"]
    assert plugin.fp8.nonfinite_layers() == reference.fp8.nonfinite_layers() != []
    assert [check.step for check in plugin.fp8.checks] == [check.step for check in reference.fp8.checks] == [0, 2]


def test_a_checkpoint_saved_under_lightning_resumes_under_lightning_fabric_as_the_run_would_have_gone_on(
    tmp_path: Path,
) -> None:
    loop = Loop(steps=6, clip="norm", overflow_at=(1, 4))
    whole = FabricRun(ours(), loop).run()
    first = FabricRun(ours(), loop).run(3)
    first.save(tmp_path / "step3.ckpt")
    resumed = FabricRun(standalone_ours(), loop, fabric=lightning_fabric.Fabric, seed=1)
    resumed.load(tmp_path / "step3.ckpt")
    resumed.run()
    for mine, theirs in zip(resumed.params, whole.params[3:], strict=True):
        for p, q in zip(mine, theirs, strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert resumed.plugin.skipped_steps == whole.plugin.skipped_steps == 2
    assert resumed.plugin.state_dict()["scaler"] == whole.plugin.state_dict()["scaler"]


# ------------------------------------------------------------------------------------------------ the monitor
@pytest.mark.parametrize("fabric_type", [L.Fabric, lightning_fabric.Fabric], ids=["lightning", "lightning_fabric"])
def test_both_loads_look_through_the_fabric_wrapper_of_either_package(fabric_type: Any) -> None:
    # The monitor is imported from one namespace and may observe a loop of the other: the names it gives (the
    # autopsy's layer, the non-finite parameters) are the user's, without the wrapper's `_forward_module.` prefix.
    from lightning_amp_plus._standalone.plugins import wrappers as standalone_wrappers

    from lightning_amp_plus.plugins import wrappers

    net = nn.Sequential(nn.Linear(2, 2))
    model = fabric_type(accelerator="cpu", devices=1).setup_module(net)
    for load in (wrappers, standalone_wrappers):
        assert load.unwrapped(model) is net
        assert [name for name, _ in load.user_names(model)] == ["0.weight", "0.bias"]


def observe_an_overflow(fabric_type: Any, plugin: Any) -> tuple[MixedPrecisionMonitor, list[dict[str, float]]]:
    """Three Fabric steps observed by the monitor with a replay; the second overflows fp16."""
    fabric = fabric_type(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, optimizer = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
    monitor, seen = MixedPrecisionMonitor(log_memory=False), []
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for step in range(3):
        monitor.batch_start()
        if step == 1:
            with torch.no_grad():
                net[2].weight.mul_(1e5)  # this step overflows fp16 in the last layer
        fabric.backward(F.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
        # The replay runs backward outside fabric.backward: Fabric's wrapper allows it only inside the plugin's
        # suspended precision, which sets the flag of the wrapper's own package (lightning_fabric's here).
        seen.append(monitor.observe(plugin, model=model, replay=lambda: F.mse_loss(model(x).float(), y)))
        if step == 1:
            with torch.no_grad():
                net[2].weight.div_(1e5)
    return monitor, seen


@pytest.mark.filterwarnings(r"ignore:MixedPrecisionMonitor. step 1.:RuntimeWarning")
def test_the_monitor_observes_the_plugin_under_lightning_fabric_and_replays_its_overflow_step_as_under_lightning() -> (
    None
):
    plugin = standalone.MixedPrecisionPlugin("16-mixed", "cpu", DynamicLossScaler(init_scale=2.0**10))
    monitor, seen = observe_an_overflow(lightning_fabric.Fabric, plugin)
    lightnings = amp_fabric.MixedPrecisionPlugin("16-mixed", "cpu", DynamicLossScaler(init_scale=2.0**10))
    reference, reference_seen = observe_an_overflow(L.Fabric, lightnings)
    assert [metrics["amp/step_skipped"] for metrics in seen] == [0.0, 1.0, 0.0]
    assert repr(seen) == repr(reference_seen)  # NaN equals nothing: repr
    assert len(monitor.autopsies) == 1  # the overflow step replayed, and its layer found
    assert [(a.kind, a.module) for a in monitor.autopsies] == [(a.kind, a.module) for a in reference.autopsies]
    assert plugin.skipped_steps == 1 and plugin._suspended is False
