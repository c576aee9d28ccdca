"""CifarCNN under LightningCLI, with MixedPrecisionPlugin and MixedPrecisionMonitor configured by ``--amp.*``.

Run (synthetic data generated offline by default; every option also goes in a YAML config):

    python examples/cifar_cnn.py fit --config examples/configs/cnn_synthetic.yaml
    python examples/cifar_cnn.py fit --trainer.max_epochs 2 --amp.precision 16-mixed --amp.init_scale 1024
    python examples/cifar_cnn.py fit --amp.precision bf16-mixed --amp.master_weights true --amp.report_path amp.png
    python examples/cifar_cnn.py fit --data lightning_amp_plus.data.CIFAR10DataModule --data.data_dir data
    python examples/cifar_cnn.py fit --print_config      # the full configuration, as YAML

``--amp.*`` is ``lightning_amp_plus.cli.AmpSettings``: precision (32-true, 16-mixed, bf16-mixed, bf16-true),
master_weights, compensation (bf16-true: kahan, stochastic or none), init_scale / growth_interval / hysteresis
(16-mixed), max_consecutive_skips, monitor, report_path, headroom_interval. The subclass below
turns it into the Trainer's ``plugins`` (or ``precision="32-true"``) and adds the monitor to its callbacks: one group
of flat options instead of a ``--trainer.plugins`` class path with a nested scaler. ``--trainer.*``, ``--model.*``
(CifarCNN's arguments) and ``--data`` (any LightningDataModule class path, then ``--data.*``) are LightningCLI's own.
The Trainer's own precision settings win when given: ``--trainer.precision 16-mixed`` (Lightning's built-in
``MixedPrecision``) or a precision plugin in ``--trainer.plugins`` replaces ``--amp``'s plugin, with the monitor still
attached; changing ``--amp.*`` plugin settings as well stops with a message saying which flag to use.
The run's config is saved in the logger's run folder (``lightning_logs/version_N/config.yaml``), never over an
existing file, and not at all when the logger is off (``RunFolderConfig`` below; the synthetic configs turn it off).
A run given no length (``--trainer.max_epochs``, ``--trainer.max_steps`` or ``--trainer.max_time``) trains 2 epochs
(Lightning's own default is 1,000). Ctrl-C takes Lightning's graceful shutdown (exit code 1); the monitor prints its
summary of the steps taken and writes its chart first. Needs jsonargparse: ``pip install 'lightning-amp-plus[cli]'``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities import rank_zero_info

from lightning_amp_plus.cli import AmpSettings, without_lightning_noise
from lightning_amp_plus.models import CifarCNN


class RunFolderConfig(SaveConfigCallback):
    """Saves the run's config in the run's own folder, and nowhere else: never over a file that is already there.

    With a logger, that folder is the logger's fresh ``version_N`` (``lightning_logs/version_3/config.yaml``), and an
    existing config there stops the run instead of being replaced (Lightning's ``overwrite=False``). Without a logger
    (``--trainer.logger false``, as the synthetic configs set) a run has no folder of its own, and Lightning would
    write ``config.yaml`` into ``default_root_dir``, the working folder by default, over whatever file has that name
    there: the config is then not saved (``--print_config`` shows it).
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.logger is None:
            if not self.already_saved:
                rank_zero_info("Config not saved: no logger, so the run has no folder of its own (--print_config).")
                self.already_saved = True
            return
        super().setup(trainer, pl_module, stage)


class AmpLightningCLI(LightningCLI):
    """LightningCLI plus an ``--amp`` group (``AmpSettings``) that supplies the precision plugin and the monitor."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_class_arguments(AmpSettings, "amp")
        parser.set_defaults({"data": {"class_path": "lightning_amp_plus.data.SyntheticCIFAR10DataModule"}})

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        amp: AmpSettings = config["amp"]
        # Adds the monitor to --trainer.callbacks and the plugin to --trainer.plugins; an explicit
        # --trainer.precision (or a precision plugin in --trainer.plugins) wins over --amp.* left at its defaults.
        try:
            for key, value in amp.trainer_arguments(config.get("trainer", {})).items():
                kwargs.setdefault(key, value)
        except ValueError as error:
            self.parser.error(str(error))  # usage and message, exit code 2
        trainer = config.get("trainer", {})
        if all(trainer.get(key) in (None, -1) for key in ("max_epochs", "max_steps", "max_time")):
            # Given no length, Lightning trains 1,000 epochs: every command of this script ends by itself instead.
            kwargs.setdefault("max_epochs", 2)
        return super().instantiate_trainer(**kwargs)


def main(args: list[str] | None = None, run: bool = True) -> AmpLightningCLI:
    with without_lightning_noise():  # Lightning's warnings about itself, silenced in this script only
        return AmpLightningCLI(
            CifarCNN,
            pl.LightningDataModule,
            subclass_mode_data=True,
            seed_everything_default=0,
            save_config_callback=RunFolderConfig,  # in the run's own folder; never over an existing file
            args=args,
            run=run,
            auto_configure_optimizers=False,  # CifarCNN configures its own optimizer and schedule
        )


if __name__ == "__main__":
    main()
