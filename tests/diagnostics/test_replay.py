"""``RngState``: a replay draws the random numbers its step drew, on the CPU and on every device of an accelerator.

The accelerator part runs here on the CPU: a stand-in device module with two devices, each with its own generator,
takes the place of ``torch.cuda`` (the calls ``RngState`` makes are the device-generic ones, ``get_rng_state_all`` and
``set_rng_state_all`` of ``torch.get_device_module``).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

from lightning_amp_plus.diagnostics.replay import RngState


class TwoDevices:
    """A device module with two devices whose generators are CPU generators (what ``torch.cuda`` offers, in small)."""

    def __init__(self, initialized: bool = True) -> None:
        self.generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
        self.initialized = initialized

    def is_initialized(self) -> bool:
        return self.initialized

    def get_rng_state_all(self) -> list[Tensor]:
        return [generator.get_state() for generator in self.generators]

    def set_rng_state_all(self, states: list[Tensor]) -> None:
        for generator, state in zip(self.generators, states, strict=True):
            generator.set_state(state)

    def draw(self) -> list[Tensor]:
        return [torch.rand(3, generator=generator) for generator in self.generators]


@pytest.fixture
def devices(monkeypatch: pytest.MonkeyPatch) -> TwoDevices:
    module = TwoDevices()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    monkeypatch.setattr(torch, "get_device_module", lambda device=None: module)
    return module


def test_a_restore_replays_every_devices_draws_not_only_the_current_ones(devices: TwoDevices) -> None:
    state = RngState.capture()
    first = [*devices.draw(), torch.rand(3)]
    state.restore()
    again = [*devices.draw(), torch.rand(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_an_accelerator_not_initialised_is_left_alone(devices: TwoDevices) -> None:
    devices.initialized = False
    assert RngState.capture().accelerator is None


def test_without_an_accelerator_the_cpu_generator_is_captured_where_torch_26_raises_on_asking_which(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def raises(check_available: bool = False) -> torch.device:
        raise RuntimeError("Cannot access accelerator device when none is available.")  # torch 2.6's words

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", raises)
    state = RngState.capture()
    first = torch.rand(3)
    state.restore()
    assert state.accelerator is None and torch.equal(torch.rand(3), first)


def test_with_host_the_python_generator_is_replayed_too() -> None:
    state = RngState.capture(host=True)
    first = random.random()
    state.restore()
    assert random.random() == first
