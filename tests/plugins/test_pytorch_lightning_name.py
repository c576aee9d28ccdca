"""``import pytorch_lightning as pl``: Lightning's standalone package trains with this package's plugins and monitor.

``pytorch_lightning`` is installed beside ``lightning`` as one of its dependencies: the same Trainer under another
name, with its own copy of every class. ``lightning_amp_plus.pytorch_lightning`` holds the same plugins, monitor,
models and data modules built over it, from the same source; each Trainer refuses the other namespace's plugin with
``MisconfigurationException(f"Found invalid type for plugin {plugin}. ...")``, where ``{plugin}`` (the plugin's
``str``) names the import to use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch
import pytest
import torch

import lightning_amp_plus
from lightning_amp_plus import FSDPMixedPrecisionPlugin, MixedPrecisionPlugin

pytorch_lightning = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")
from pytorch_lightning.utilities.exceptions import MisconfigurationException  # noqa: E402

from lightning_amp_plus import pytorch_lightning as standalone  # noqa: E402

pytestmark = pytest.mark.filterwarnings(r"ignore:.*does not have many workers.*")


@pytest.mark.parametrize("plugin", [MixedPrecisionPlugin("bf16-mixed", "cpu"), FSDPMixedPrecisionPlugin("bf16-mixed")])
def test_pytorch_lightnings_trainer_refuses_a_lightning_plugin_naming_the_import_to_use(plugin: Any) -> None:
    with pytest.raises(MisconfigurationException) as refusal:
        pytorch_lightning.Trainer(plugins=[plugin], logger=False)
    assert str(refusal.value).startswith(
        f"Found invalid type for plugin {type(plugin).__name__}('bf16-mixed') (for `lightning.pytorch`; with the "
        "`pytorch_lightning` package, import it from lightning_amp_plus.pytorch_lightning)"
    )


@pytest.mark.parametrize(
    "plugin", [standalone.MixedPrecisionPlugin("bf16-mixed", "cpu"), standalone.FSDPMixedPrecisionPlugin("bf16-mixed")]
)
def test_lightnings_trainer_refuses_a_pytorch_lightning_plugin_naming_the_import_to_use(plugin: Any) -> None:
    from lightning.fabric.utilities.exceptions import MisconfigurationException as LightningsRefusal

    with pytest.raises(LightningsRefusal) as refusal:
        lightning.pytorch.Trainer(plugins=[plugin], logger=False)
    assert str(refusal.value).startswith(
        f"Found invalid type for plugin {type(plugin).__name__}('bf16-mixed') (for `pytorch_lightning`; with the "
        "`lightning` package, import it from lightning_amp_plus)"
    )


def test_the_plugins_repr_is_short_and_lightnings_trainer_takes_the_plugin() -> None:
    plugin = MixedPrecisionPlugin("16-mixed", "cpu")
    assert repr(plugin) == "MixedPrecisionPlugin('16-mixed')"
    trainer = lightning.pytorch.Trainer(plugins=[plugin], accelerator="cpu", logger=False, enable_progress_bar=False)
    assert trainer.precision_plugin is plugin


def test_the_classes_are_the_same_source_over_pytorch_lightnings_bases() -> None:
    assert isinstance(standalone.MixedPrecisionPlugin("bf16-mixed"), pytorch_lightning.plugins.precision.Precision)
    assert issubclass(standalone.MixedPrecisionMonitor, pytorch_lightning.Callback)
    assert issubclass(standalone.CifarCNN, pytorch_lightning.LightningModule)
    assert issubclass(standalone.SyntheticCIFAR10DataModule, pytorch_lightning.LightningDataModule)
    plugins = Path(lightning_amp_plus.__file__).parent / "plugins" / "precision.py"
    assert standalone.MixedPrecisionPlugin.optimizer_step.__code__.co_filename == str(plugins)
    # What imports no Lightning is shared: a scaler is one class whichever namespace drives it.
    assert standalone.DynamicLossScaler is lightning_amp_plus.DynamicLossScaler


def fit_the_cnn(pl: Any, amp: Any, precision: str, tmp_path: Path) -> tuple[list[torch.Tensor], Any, Any]:
    pl.seed_everything(0, verbose=False)
    model = amp.CifarCNN(width=8)
    data = amp.SyntheticCIFAR10DataModule(num_train=64, num_val=32, image_size=16, batch_size=16)
    monitor = amp.MixedPrecisionMonitor(log_memory=False, prog_bar=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=6,
        plugins=[amp.MixedPrecisionPlugin(precision)],
        callbacks=[monitor],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=data)
    return [p.detach().clone() for p in model.parameters()], trainer, monitor


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_pytorch_lightning_trains_the_shipped_cnn_with_the_plugin_and_the_monitor_as_lightning_does(
    precision: str, tmp_path: Path
) -> None:
    from lightning_amp_plus import data, models

    class Lightning:  # the lightning namespace's names, as the standalone module holds them
        CifarCNN = models.CifarCNN
        SyntheticCIFAR10DataModule = data.SyntheticCIFAR10DataModule
        MixedPrecisionMonitor = lightning_amp_plus.MixedPrecisionMonitor
        MixedPrecisionPlugin = MixedPrecisionPlugin

    ours, trainer, monitor = fit_the_cnn(pytorch_lightning, standalone, precision, tmp_path / "pl")
    reference, _, lightnings_monitor = fit_the_cnn(lightning.pytorch, Lightning, precision, tmp_path / "lightning")
    assert trainer.global_step == 6
    for mine, theirs in zip(ours, reference, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert standalone.skipped_steps(trainer) == 0
    # The monitor saw every step, with the same scale and norm as under lightning.pytorch.
    seen = [(entry.step, entry.scale, entry.grad_norm) for entry in monitor.history.steps]
    assert len(seen) == 6 and seen == [(e.step, e.scale, e.grad_norm) for e in lightnings_monitor.history.steps]


def gpt_module(pl: Any) -> Any:
    """litgpt's tiny GPT in a LightningModule over ``pl`` (either package), a NaN at one layer's input at step 2."""
    from fp8_models import LAYER, LR, Faults, gpt, lm_loss

    class GPTModule(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.gpt = gpt(0)
            self.faults = Faults(self.gpt.get_submodule(LAYER))

        def training_step(self, batch: tuple[torch.Tensor, int], _index: int) -> torch.Tensor:
            tokens, step = batch
            self.faults.on = int(step) == 2
            return lm_loss(self.gpt, tokens)

        def validation_step(self, batch: tuple[torch.Tensor, int], _index: int) -> None:
            self.log("val_loss", lm_loss(self.gpt, batch[0]), batch_size=len(batch[0]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)

    return GPTModule()


@pytest.mark.filterwarnings(r"ignore:.*'fp8-mixed'\) on CPU:UserWarning")
@pytest.mark.filterwarnings("ignore:MixedPrecisionMonitor. step 2. layer:RuntimeWarning")  # the autopsy, on both
def test_fp8_under_pytorch_lightning_equals_lightning_bit_for_bit_with_a_nan_step_validation_and_the_monitor() -> None:
    pytest.importorskip("torchao.float8", reason="fp8-mixed needs torchao (the fp8 extra)")
    pytest.importorskip("litgpt", reason="the FP8 model is litgpt's GPT")
    from fp8_models import loader

    def fit(pl: Any, amp: Any) -> tuple[Any, Any, Any]:
        model = gpt_module(pl)
        plugin = amp.MixedPrecisionPlugin("fp8-mixed", "cpu", fp8_check_interval=2)
        monitor = amp.MixedPrecisionMonitor(log_memory=False, prog_bar=False)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=5,
            plugins=[plugin],
            callbacks=[monitor],
            val_check_interval=2,
            limit_val_batches=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        trainer.fit(model, loader(range(5)), loader([100]))
        return model, plugin, monitor

    model, plugin, monitor = fit(pytorch_lightning, standalone)
    reference_model, reference, reference_monitor = fit(lightning.pytorch, lightning_amp_plus)
    for (name, p), (_, q) in zip(model.named_parameters(), reference_model.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert plugin.skipped_steps == reference.skipped_steps == 1
    assert list(plugin.fp8.layers) == list(reference.fp8.layers) and len(plugin.fp8.layers) == 9
    assert [c.step for c in plugin.fp8.checks] == [c.step for c in reference.fp8.checks] == [0, 2, 4]
    assert repr([c.readings for c in plugin.fp8.checks]) == repr([c.readings for c in reference.fp8.checks])
    # Each load has its own record class: compared by their fields.
    assert monitor.history.fp8 is not None and repr(monitor.history.fp8) == repr(reference_monitor.history.fp8)
    assert monitor.summary() == reference_monitor.summary()
    assert "transformer.h.0.mlp.proj" in monitor.summary()  # the layer whose input held the NaN, named first
