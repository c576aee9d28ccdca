"""Compensated bf16 weights through the front ends: ``MixedPrecisionPlugin("bf16-true", compensation=...)``.

The reference for ``compensation=None`` is Lightning's own ``bf16-true``; for the compensations, an FP32 run (they
must track it where plain bf16-true does not). The numerics themselves are tested in ``test_compensated.py``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import make_trainer, parameters_of
from launch import run_pool, scenario
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_amp_plus import MixedPrecisionPlugin
from lightning_amp_plus import fabric as amp_fabric

pytestmark = pytest.mark.filterwarnings("ignore:.*your dataloader is not resumable.*")


# --------------------------------------------------------------------------------------------- the model
def teacher_data(n: int = 512, seed: int = 0) -> TensorDataset:
    """A fixed random teacher network's outputs on random inputs: the student can learn it exactly.

    Drawn in FP32 whatever the default dtype (bf16 inside a bf16-true training step): torch 2.6 draws another stream
    for a bf16 ``randn``, which would make the training data another teacher's.
    """
    generator = torch.Generator().manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    for p in teacher.parameters():
        p.data = torch.randn(p.shape, generator=generator, dtype=torch.float32) * 0.5
    x = torch.randn(n, 16, generator=generator, dtype=torch.float32)
    with torch.no_grad():
        return TensorDataset(x, teacher(x))


class Student(pl.LightningModule):
    """A student of the teacher; its batches come from the step number, so a resumed run sees the batches an
    uninterrupted one sees whatever the loader's position."""

    def __init__(self, optimizer: str = "adamw", lr: float = 1e-3, overflow_at: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        self.optimizer_name, self.lr, self.overflow_at = optimizer, lr, overflow_at

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        step = self.trainer.global_step % 16
        x, y = (t[32 * step : 32 * (step + 1)].to(batch[0].dtype) for t in teacher_data()[:])
        loss = F.mse_loss(self.net(x).float(), y.float())
        if self.trainer.global_step == self.overflow_at:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        elif self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, nesterov=True)
        else:
            optimizer = torch.optim.RMSprop(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def batches(n: int = 512, batch_size: int = 32) -> DataLoader[tuple[Tensor, ...]]:
    return DataLoader(teacher_data(n), batch_size=batch_size)


def full_loss(model: Student) -> float:
    x, y = teacher_data()[:]
    with torch.no_grad():
        return float(F.mse_loss(model.net.float()(x.float()), y))


def bf16_true(compensation: Any = "auto", **options: Any) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("bf16-true", device="cpu", compensation=compensation, **options)


def train(model: pl.LightningModule, plugin: Any = None, steps: int = 80, n: int = 512, **kwargs: Any) -> pl.Trainer:
    trainer = make_trainer(plugin, max_steps=steps, max_epochs=-1, **kwargs)
    trainer.fit(model, batches(n))
    return trainer


# -------------------------------------------------------------------------------------------- behaviour
def test_compensation_recovers_what_plain_bf16_true_loses_and_tracks_fp32() -> None:
    """AdamW at lr 1e-3 moves each weight by about 1e-3 a step, under half a bf16 spacing for weights above ~0.5: plain
    bf16-true loses those updates (measured: loss 3.73 against FP32's 3.25, from 5.66), compensation keeps them."""
    torch.manual_seed(0)
    start = Student(lr=1e-3)
    losses = {}
    for name, plugin, precision in [
        ("fp32", None, "32-true"),
        ("bf16-true", None, "bf16-true"),
        ("kahan", bf16_true("kahan"), None),
        ("stochastic", bf16_true("stochastic"), None),
    ]:
        model = copy.deepcopy(start)
        train(model, plugin, steps=300, **({} if precision is None else {"precision": precision}))
        losses[name] = full_loss(model)
    # Premise: FP32 learns, and plain bf16-true ends clearly above it.
    assert losses["fp32"] < 0.7 * full_loss(start) and losses["bf16-true"] > 1.1 * losses["fp32"]
    # Both compensations track FP32: within 2% of its loss (measured 0.06% Kahan, 0.3% stochastic: Kahan keeps ~16
    # bits; stochastic rounding adds noise of half a bf16 spacing per step, which 300 steps average out).
    assert losses["kahan"] == pytest.approx(losses["fp32"], rel=0.02)
    assert losses["stochastic"] == pytest.approx(losses["fp32"], rel=0.02)


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_a_step_with_non_finite_gradients_is_skipped_and_holds_the_schedule(compensation: str) -> None:
    model = Student(overflow_at=5)
    weights: list[list[Tensor]] = []

    class Weights(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            weights.append(parameters_of(model))

    plugin = bf16_true(compensation)
    trainer = train(model, plugin, steps=8, callbacks=[Weights()])
    assert plugin.skipped_steps == 1 and plugin.engine.log.held_schedulers.held_steps == 1
    torch.testing.assert_close(weights[5], weights[4], rtol=0, atol=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.optimizers[0].param_groups[0]["lr"] == 1e-3  # 7 applied steps of StepLR(step_size=20)


@pytest.mark.parametrize(("compensation", "optimizer"), [("kahan", "adamw"), ("stochastic", "sgd")])
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(
    tmp_path: Path, compensation: str, optimizer: str
) -> None:
    torch.manual_seed(0)
    straight = Student(optimizer=optimizer, lr=1e-4)
    first, second = copy.deepcopy(straight), copy.deepcopy(straight)
    whole = train(straight, bf16_true(compensation), steps=20)
    half_way = train(first, bf16_true(compensation), steps=10)
    path = tmp_path / "ten.ckpt"
    half_way.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)  # tensors and plain containers only, as Lightning loads it
    assert checkpoint["MixedPrecisionPlugin"]["compensation_method"] == compensation
    trainer = make_trainer(bf16_true(compensation), max_steps=20, max_epochs=-1)
    trainer.fit(second, batches(), ckpt_path=path)
    torch.testing.assert_close(parameters_of(second), parameters_of(straight), rtol=0, atol=0)
    torch.testing.assert_close(
        trainer.optimizers[0].state_dict()["state"], whole.optimizers[0].state_dict()["state"], rtol=0, atol=0
    )
    # The FP32 second moment came back FP32 (torch's load_state_dict casts it to the parameter's bf16 first).
    if optimizer == "adamw":
        assert {s["exp_avg_sq"].dtype for s in trainer.optimizers[0].state.values()} == {torch.float32}


def test_load_from_checkpoint_gives_the_bf16_weights(tmp_path: Path) -> None:
    model = Student()
    trainer = train(model, bf16_true(), steps=5)
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    alone = Student.load_from_checkpoint(path)
    torch.testing.assert_close(parameters_of(alone), [p.float() for p in parameters_of(model)], rtol=0, atol=0)


def test_resuming_with_the_other_compensation_is_refused_naming_both(tmp_path: Path) -> None:
    trainer = train(Student(), bf16_true("kahan"), steps=3)
    path = tmp_path / "k.ckpt"
    trainer.save_checkpoint(path)
    with pytest.raises(ValueError) as refused:
        make_trainer(bf16_true("stochastic"), max_steps=4, max_epochs=-1).fit(Student(), batches(), ckpt_path=path)
    # Named as the constructor's argument (the checkpoint's key is compensation_method), with the way out.
    message = str(refused.value)
    assert "MixedPrecisionPlugin(compensation='kahan'), this run uses compensation='stochastic'" in message
    assert "Resume with compensation='kahan'" in message and "compensation_method" not in message


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"precision": "bf16-mixed", "compensation": "kahan"},
            r"compensation='kahan'\)`: compensation compensates bf16",
        ),
        (
            {"precision": "16-mixed", "compensation": "stochastic"},
            r"precision='16-mixed' does not hold \(its weights are",
        ),
        ({"precision": "bf16-true", "compensation": "float"}, r"compensation='float'\)` is not supported"),
        (
            {"precision": "bf16-true", "master_weights": True},
            r"precision='bf16-true' keeps the weights in bf16.*Use precision='bf16-mixed' with master_weights",
        ),
        (
            {"precision": "bf16-true", "keep_fp32": (nn.Linear,)},
            r"keep_fp32=.*Use precision='bf16-mixed' with keep_fp32",
        ),
        ({"precision": "bf16-true", "rounding_seed": -1}, r"rounding_seed=-1\)` must be an int >= 0"),
    ],
)
def test_bad_combinations_are_refused_naming_the_argument(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MixedPrecisionPlugin(**kwargs)


def test_an_optimizer_the_compensation_does_not_implement_is_refused_before_any_step() -> None:
    model = Student(optimizer="rmsprop")
    before = parameters_of(model)
    with pytest.raises(TypeError, match=r"RMSprop.*AdamW.*Adam.*SGD"):
        train(model, bf16_true(), steps=2)
    # Converted to bf16 at setup (as Lightning's bf16-true), never stepped.
    rounded = [p.to(torch.bfloat16) for p in before]
    torch.testing.assert_close(parameters_of(model), rounded, rtol=0, atol=0)


def test_compensation_none_keeps_the_optimizers_own_step() -> None:
    # Plain bf16-true steps any optimizer (RMSprop too): compensation=None adds only the skip of non-finite steps.
    model = Student(optimizer="rmsprop")
    train(model, bf16_true(None), steps=3)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# ------------------------------------------------------------------------------------------------ Fabric
def fabric_run(
    precision: str, steps: int, compensation: Any = "auto", load: Path | None = None, save: Path | None = None
) -> list[Tensor]:
    torch.manual_seed(0)
    plugin = amp_fabric.MixedPrecisionPlugin(precision, device="cpu", compensation=compensation)  # type: ignore[arg-type]
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(net, optimizer)
    state = {"model": model, "optimizer": optimizer, "amp": plugin, "step": 0}
    if load is not None:
        fabric.load(load, state)
    x, y = teacher_data()[:]
    for step in range(int(state["step"]), steps):
        batch = slice(32 * (step % 16), 32 * (step % 16 + 1))
        fabric.backward(F.mse_loss(model(x[batch]).float(), y[batch]))
        optimizer.step()
        optimizer.zero_grad()
        state["step"] = step + 1
        if save is not None and step + 1 == steps // 2:
            fabric.save(save, state)
    return parameters_of(model)


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
def test_fabric_trains_bf16_weights_compensated_and_resumes_bit_for_bit(tmp_path: Path, compensation: str) -> None:
    path = tmp_path / "half.ckpt"
    straight = fabric_run("bf16-true", 16, compensation, save=path)
    assert {p.dtype for p in straight} == {torch.bfloat16}
    resumed = fabric_run("bf16-true", 16, compensation, load=path)
    torch.testing.assert_close(resumed, straight, rtol=0, atol=0)
    plain = fabric_run("bf16-true", 16, None)
    assert any(not torch.equal(a, b) for a, b in zip(plain, straight, strict=True))  # compensation did something


# --------------------------------------------------------------------------------- DDP and FSDP2 (2 ranks)
class Sharded(Student):
    """The student, fully sharded by FSDP2 in ``configure_model`` (``ModelParallelStrategy``)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(self.net)


def distributed_fit(strategy: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch.manual_seed(0)
    model = Sharded(lr=1e-4) if strategy == "fsdp2" else Student(lr=1e-4)
    plugin = bf16_true("kahan")
    chosen: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if strategy == "fsdp2" else "ddp"
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=chosen, plugins=[plugin], max_steps=6, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(model, batches(n=256))
    compensator = plugin.compensators.of(trainer.optimizers[0], 0)
    buffers = [b for group in compensator.state_dict()["compensation"] for b in group if b is not None]
    local = [getattr(b, "to_local", lambda b=b: b)() for b in buffers]
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    return {
        "params": [p.clone() for p in full],
        "buffer_types": sorted({type(b).__name__ for b in buffers}),
        "local_numel": sum(b.numel() for b in local),
        "param_numel": sum(p.numel() for p in model.parameters()),
    }


def ddp_scenario(out: Path) -> dict[str, Any]:
    return distributed_fit("ddp")


def fsdp2_scenario(out: Path) -> dict[str, Any]:
    return distributed_fit("fsdp2")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_pool({"ddp": ddp_scenario, "fsdp2": fsdp2_scenario}, tmp_path_factory.mktemp("compensated"))


@pytest.mark.integration
def test_under_ddp_both_replicas_step_alike(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = scenario(ranks, "ddp")
    torch.testing.assert_close(rank0["params"], rank1["params"], rtol=0, atol=0)
    assert rank0["buffer_types"] == ["Tensor"] and rank0["local_numel"] == rank0["param_numel"]


@pytest.mark.integration
def test_under_fsdp2_the_buffers_follow_the_parameters_sharding(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = scenario(ranks, "fsdp2")
    assert rank0["buffer_types"] == ["DTensor"]
    # Each rank holds its shard of every buffer: the shards add up to the whole model.
    assert rank0["local_numel"] + rank1["local_numel"] >= rank0["param_numel"]
    assert rank0["local_numel"] < rank0["param_numel"]
    torch.testing.assert_close(rank0["params"], rank1["params"], rtol=0, atol=0)
    # The same training as DDP's, sharded: the same compensated updates of the same averaged gradients.
    ddp = scenario(ranks, "ddp")[0]
    torch.testing.assert_close(rank0["params"], ddp["params"], rtol=0, atol=0)


def test_the_monitors_summary_says_how_the_bf16_weights_were_kept_and_what_they_cost() -> None:
    from lightning_amp_plus import MixedPrecisionMonitor

    monitor = MixedPrecisionMonitor(log_memory=False)
    train(Student(), bf16_true("kahan"), steps=3, callbacks=[monitor])
    # AdamW: a bf16 weight (2), a bf16 Kahan buffer (2), a bf16 first moment (2), an FP32 second moment (4), and the
    # step counters (4 bytes per parameter tensor: a little above 10).
    summary = monitor.summary()
    assert (
        "bf16 weights compensated (kahan): weights, compensation and optimizer state hold 10.0 bytes per trainable "
        "parameter and 10.0 per model parameter (1,153 of 1,153 parameters train)"
    ) in summary


class Adapted(Student):
    """A frozen layer and a trainable adapter beside it (the LoRA shape); the optimizer gets every parameter, frozen
    ones included, or only the trainable ones."""

    def __init__(self, everything: bool) -> None:
        super().__init__()
        self.net[0].requires_grad_(False)
        self.everything = everything

    def configure_optimizers(self) -> Any:
        params = self.parameters() if self.everything else [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr)


def test_the_bytes_per_parameter_are_two_named_figures_whatever_the_optimizer_was_handed() -> None:
    """Before: one figure, 3.1 bytes per parameter with the frozen parameters in the optimizer and 10.0 without, for the
    same model. Now the figure per trainable parameter and the one per model parameter, each the same either way."""
    from lightning_amp_plus import MixedPrecisionMonitor

    summaries = []
    for everything in (True, False):
        monitor = MixedPrecisionMonitor(log_memory=False)
        train(Adapted(everything), bf16_true("kahan"), steps=3, callbacks=[monitor])
        summaries.append(monitor.summary())
    # 65 trainable parameters (the 64-wide output layer and its bias) at 10 bytes and a little for the step counters;
    # the 1,088 frozen ones hold their 2-byte bf16 weights only: (65 x 10.06 + 1,088 x 2) / 1,153 = 2.5.
    note = "hold 10.1 bytes per trainable parameter and 2.5 per model parameter (65 of 1,153 parameters train)"
    assert note in summaries[0] and note in summaries[1]
