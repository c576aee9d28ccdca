"""``pytorch_lightning.Trainer`` (Lightning's older package name) refuses the plugin: the refusal must name the fix.

``pytorch_lightning`` is installed beside ``lightning`` as one of its dependencies: the same Trainer under another
name, with its own copy of every class. Its ``Trainer(plugins=[...])`` checks each plugin against *its* ``Precision``,
which ``MixedPrecisionPlugin`` (a ``lightning.pytorch`` plugin) is not, and raises ``MisconfigurationException(f"Found
invalid type for plugin {plugin}. Expected one of: Precision, CheckpointIO, ClusterEnvironment, or LayerSync.")``
(``pytorch_lightning/trainer/connectors/accelerator_connector.py``). ``{plugin}`` is ``str(plugin)``, which the plugin
controls: :data:`proposed_str` is the ``__str__`` proposed for ``lightning_amp_plus/precision.py`` (owned by the step
engine's redesign; see notes/newcomer.md). The first test runs against the real plugin and is an expected failure
until that change lands (it then runs as a plain test, by itself); the others check the proposal on a subclass.
"""

from __future__ import annotations

import sys

import pytest

from lightning_amp_plus import MixedPrecisionPlugin

pytorch_lightning = pytest.importorskip("pytorch_lightning", reason="pytorch_lightning is not installed")
from pytorch_lightning.utilities.exceptions import MisconfigurationException  # noqa: E402

FIX = "from lightning.pytorch import Trainer"


def proposed_str(self: MixedPrecisionPlugin) -> str:  # the method to add to MixedPrecisionPlugin, verbatim
    """``MixedPrecisionPlugin('bf16-mixed')``; as ``pytorch_lightning`` words its refusal of the plugin, with the fix.

    ``pytorch_lightning.Trainer`` (the older package name, a copy of ``lightning.pytorch``) checks plugins against its
    own ``Precision`` and refuses this one: "Found invalid type for plugin {plugin}. Expected one of: Precision, ...".
    """
    name = f"{type(self).__name__}({self.precision!r})"
    if sys._getframe(1).f_globals.get("__name__", "").startswith("pytorch_lightning."):
        return (
            f"{name}, a plugin for the `lightning` package: import the Trainer with `from lightning.pytorch import "
            "Trainer` (`pytorch_lightning` is Lightning's older package name, and its Trainer accepts only its own "
            "plugins)"
        )
    return name


class Proposed(MixedPrecisionPlugin):
    __str__ = proposed_str


LANDED = MixedPrecisionPlugin.__str__ is not object.__str__


@pytest.mark.xfail(not LANDED, reason="needs MixedPrecisionPlugin.__str__ (notes/newcomer.md)", strict=True)
def test_pytorch_lightnings_trainer_refuses_the_plugin_saying_to_import_the_trainer_from_lightning() -> None:
    with pytest.raises(MisconfigurationException) as refusal:
        pytorch_lightning.Trainer(plugins=[MixedPrecisionPlugin("bf16-mixed", "cpu")], logger=False)
    assert FIX in str(refusal.value) and "pytorch_lightning" in str(refusal.value)


def test_the_proposed_str_puts_the_fix_into_pytorch_lightnings_refusal() -> None:
    with pytest.raises(MisconfigurationException) as refusal:
        pytorch_lightning.Trainer(plugins=[Proposed("bf16-mixed", "cpu")], logger=False)
    assert str(refusal.value).startswith(
        "Found invalid type for plugin Proposed('bf16-mixed'), a plugin for the `lightning` package: import the "
        "Trainer with `from lightning.pytorch import Trainer` (`pytorch_lightning` is Lightning's older package name"
    )


def test_the_proposed_str_is_short_everywhere_else_and_lightnings_trainer_takes_the_plugin() -> None:
    plugin = Proposed("16-mixed", "cpu")
    assert str(plugin) == f"{plugin}" == "Proposed('16-mixed')"
    import lightning.pytorch as pl

    trainer = pl.Trainer(plugins=[plugin], accelerator="cpu", logger=False, enable_progress_bar=False)
    assert trainer.precision_plugin is plugin
