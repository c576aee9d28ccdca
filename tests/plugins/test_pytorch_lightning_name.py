"""``pytorch_lightning.Trainer`` (Lightning's older package name) refuses the plugins: the refusal must name the fix.

``pytorch_lightning`` is installed beside ``lightning`` as one of its dependencies: the same Trainer under another
name, with its own copy of every class. Its ``Trainer(plugins=[...])`` checks each plugin against *its* ``Precision``,
which this package's Trainer plugins (``lightning.pytorch`` plugins) are not, and raises ``MisconfigurationException(
f"Found invalid type for plugin {plugin}. Expected one of: ...")``. ``{plugin}`` is ``str(plugin)``, which the plugins
control (``_front_end.plugin_str``).
"""

from __future__ import annotations

import pytest

from lightning_amp_plus import FSDPMixedPrecisionPlugin, MixedPrecisionPlugin

pytorch_lightning = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")
from pytorch_lightning.utilities.exceptions import MisconfigurationException  # noqa: E402


@pytest.mark.parametrize("plugin", [MixedPrecisionPlugin("bf16-mixed", "cpu"), FSDPMixedPrecisionPlugin("bf16-mixed")])
def test_pytorch_lightnings_trainer_refuses_the_plugin_saying_to_import_the_trainer_from_lightning(plugin) -> None:
    with pytest.raises(MisconfigurationException) as refusal:
        pytorch_lightning.Trainer(plugins=[plugin], logger=False)
    assert str(refusal.value).startswith(
        f"Found invalid type for plugin {type(plugin).__name__}('bf16-mixed'), a plugin for the `lightning` package: "
        "import the Trainer with `from lightning.pytorch import Trainer` (`pytorch_lightning` is Lightning's older "
        "package name"
    )


def test_the_plugins_str_is_short_everywhere_else_and_lightnings_trainer_takes_the_plugin() -> None:
    plugin = MixedPrecisionPlugin("16-mixed", "cpu")
    assert str(plugin) == f"{plugin}" == "MixedPrecisionPlugin('16-mixed')"
    import lightning.pytorch as pl

    trainer = pl.Trainer(plugins=[plugin], accelerator="cpu", logger=False, enable_progress_bar=False)
    assert trainer.precision_plugin is plugin
