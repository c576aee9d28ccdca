"""The ``amp-plus`` command: one module per command over shared parts, importing only downward.

* :mod:`~lightning_amp_plus.cli._main`: the parser, the checks of a request before any work, ``main``.
* :mod:`~lightning_amp_plus.cli.train`, :mod:`~lightning_amp_plus.cli.compare`, :mod:`~lightning_amp_plus.cli.doctor`:
  the commands (they import torch and Lightning; the parser does not, so ``--help`` answers at once).
* Shared: ``_checks`` (argument types, paths, messages), ``_settings`` (``AmpSettings``: the mixed-precision options
  worded for Python or for the command line), ``_configs`` (the table of precision set-ups), ``_runs`` (device, data,
  model and quiet Lightning runs), ``_machine`` (what the machine holds and has free), ``_workers`` (the processes of
  ``--devices N`` die with the command), ``_noise`` (the Lightning warnings the commands and examples silence, only
  while they run).
"""

from lightning_amp_plus.cli._checks import UsageError
from lightning_amp_plus.cli._main import build_parser, check_request, main
from lightning_amp_plus.cli._noise import without_lightning_noise
from lightning_amp_plus.cli._settings import AmpSettings

__all__ = ["AmpSettings", "UsageError", "build_parser", "check_request", "main", "without_lightning_noise"]
