"""The shipped LightningModules: a CIFAR-10 CNN and an IMDB sentiment LSTM."""

from lightning_amp_plus.models.cnn import CifarCNN
from lightning_amp_plus.models.lstm import ImdbLSTM

__all__ = ["CifarCNN", "ImdbLSTM"]
