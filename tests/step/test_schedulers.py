"""The scheduler hold on its own: the ledger's rule, one class per scheduler class, release."""

from __future__ import annotations

import torch

from lightning_amp_plus.step import schedulers as _schedulers


def scheduler() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


def lr(opt: torch.optim.Optimizer) -> float:
    return float(opt.param_groups[0]["lr"])


class Known:
    """A step's outcome read at once (the unscale path's)."""

    resolved = True

    def __init__(self, skipped: bool) -> None:
        self.skipped = skipped


def test_a_scheduler_is_held_only_when_every_step_since_its_last_was_skipped() -> None:
    opt, sched = scheduler()
    ledger = _schedulers.StepLedger()
    _schedulers.hold(sched, ledger)
    ledger.record_outcome(opt, Known(skipped=True))
    sched.step()  # the only step since the last was skipped: held
    assert lr(opt) == 1.0
    ledger.record_outcome(opt, Known(skipped=True))
    opt.step()
    ledger.record_outcome(opt, Known(skipped=False))
    sched.step()  # one of two applied (an epoch-interval scheduler, say): advances
    assert lr(opt) == 0.5
    sched.step()  # no optimizer step at all since: advances, as a scheduler stepped by hand would
    assert lr(opt) == 0.25
    assert ledger.held_steps == 1


def test_schedulers_of_many_plugins_share_one_held_class_and_release_restores_it() -> None:
    (_, a), (_, b) = scheduler(), scheduler()
    _schedulers.hold(a, _schedulers.StepLedger())
    _schedulers.hold(b, _schedulers.StepLedger())
    assert type(a) is type(b) and isinstance(a, torch.optim.lr_scheduler.StepLR)
    _schedulers.release(a)
    assert type(a) is torch.optim.lr_scheduler.StepLR
    _schedulers.hold(a, _schedulers.StepLedger())  # holding twice does not stack subclasses
    _schedulers.hold(a, _schedulers.StepLedger())
    assert type(a).__mro__[1] is torch.optim.lr_scheduler.StepLR


def test_a_plugin_holding_schedulers_pickles_for_ddp_spawn() -> None:
    # `strategy="ddp_spawn"` pickles the Trainer's plugins to start its processes.
    import pickle

    from lightning_amp_plus import MixedPrecisionPlugin

    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=True)
    plugin.engine.held_schedulers.ledger.record_outcome(object(), Known(skipped=True))
    copy = pickle.loads(pickle.dumps(plugin))
    assert (
        copy.engine.held_schedulers.held_steps == 0 and copy.settings.master_weights and copy.precision == "bf16-mixed"
    )


class Pending:
    """A fused step's outcome: unread until ``skipped`` is asked."""

    def __init__(self, skipped: bool) -> None:
        self._skipped, self.reads = skipped, 0

    @property
    def resolved(self) -> bool:
        return self.reads > 0

    @property
    def skipped(self) -> bool:
        self.reads += 1
        return self._skipped


def test_pending_outcomes_are_read_when_a_scheduler_asks_and_never_pile_up() -> None:
    opt, sched = scheduler()
    ledger = _schedulers.StepLedger()
    _schedulers.hold(sched, ledger)
    outcomes = [Pending(skipped=True) for _ in range(3)]
    for outcome in outcomes:
        ledger.record_outcome(opt, outcome)
    assert [o.reads for o in outcomes] == [0, 0, 0]  # nothing read in the steps
    sched.step()  # every step since the last was skipped: held, and now they were read
    assert lr(opt) == 1.0 and all(o.reads == 1 for o in outcomes)
    # A run whose schedulers never ask: the unread outcomes are read in batches, not kept forever.
    for _ in range(1000):
        ledger.record_outcome(opt, Pending(skipped=False))
    assert len(ledger._pending[id(opt)]) <= 256
