"""Looking inside a step, with torch only.

Where an inf/NaN started (:mod:`~lightning_amp_plus.diagnostics.autopsy`), per-layer headroom
(:mod:`~lightning_amp_plus.diagnostics.headroom`), replaying a batch with nothing left behind
(:mod:`~lightning_amp_plus.diagnostics.replay`), and the low-precision formats they judge by
(:mod:`~lightning_amp_plus.diagnostics.formats`). The step core never imports these (a test checks it).
"""
