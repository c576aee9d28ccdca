"""The front ends: one plugin over one step engine, with Fabric's hooks and the Trainer's.

:mod:`~lightning_amp_plus.plugins.precision` holds the plugin (Fabric's face, and the Trainer's: the same plugin plus
the Trainer's hooks), :mod:`~lightning_amp_plus.plugins.fsdp` the same two under ``FSDPStrategy``,
:mod:`~lightning_amp_plus.plugins.options` the options all of them take (checked once), and
:mod:`~lightning_amp_plus.plugins.state` the one checkpoint format. Users import them as
``lightning_amp_plus.MixedPrecisionPlugin`` and ``lightning_amp_plus.fabric.MixedPrecisionPlugin``.
"""
