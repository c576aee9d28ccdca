"""The front ends: thin adapters of Lightning's and Fabric's precision hooks over one step engine.

The Trainer's plugins (:mod:`~lightning_amp_plus.plugins.trainer`, :mod:`~lightning_amp_plus.plugins.trainer_fsdp`)
and Fabric's (:mod:`~lightning_amp_plus.plugins.fabric`, :mod:`~lightning_amp_plus.plugins.fabric_fsdp`) side by side,
over one shared core (:mod:`~lightning_amp_plus.plugins.core`: settings, refusals, ranks and names) and one checkpoint
format (:mod:`~lightning_amp_plus.plugins.state`). Users import them as ``lightning_amp_plus.MixedPrecisionPlugin`` and
``lightning_amp_plus.fabric.MixedPrecisionPlugin``.
"""
