"""``MixedPrecisionMonitor`` and what it is made of.

Imported as ``from lightning_amp_plus import MixedPrecisionMonitor``. The callback
(:mod:`~lightning_amp_plus.monitor.callback`), where it learns about each step
(:mod:`~lightning_amp_plus.monitor.step_sources`), its replays for the autopsy and the headroom
(:mod:`~lightning_amp_plus.monitor.examiner`), memory readings (:mod:`~lightning_amp_plus.monitor.memory`), the run's
record (:mod:`~lightning_amp_plus.monitor.history`), its summary (:mod:`~lightning_amp_plus.monitor.summary`) and its
chart (:mod:`~lightning_amp_plus.monitor.chart`).
"""
