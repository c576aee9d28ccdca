"""``python -m lightning_amp_plus``: the demo training run."""

from lightning_amp_plus.demo import main

main()
