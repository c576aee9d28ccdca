"""CIFAR-10's per-channel pixel statistics, the one definition the real and the synthetic modules normalise with.

Apart from :mod:`lightning_amp_plus.data.cifar`, which imports torchvision: the synthetic module never needs it.
"""

from __future__ import annotations

__all__ = ["CIFAR10_MEAN", "CIFAR10_STD"]

# Per-channel mean and standard deviation of the 50,000 training images (pixels scaled to [0, 1]). The often-copied
# (0.2023, 0.1994, 0.2010) is the mean of per-image deviations, not the dataset's deviation.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
