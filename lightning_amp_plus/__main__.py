"""``python -m lightning_amp_plus``: the ``amp-plus`` command (``train``, ``compare``, ``doctor``)."""

from lightning_amp_plus.cli._main import console

raise SystemExit(console())
