"""``python -m lightning_amp_plus``: the ``amp-plus`` command (``train``, ``compare``, ``doctor``)."""

from lightning_amp_plus.cli import main

raise SystemExit(main())
