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
    plugin.engine.log.held_schedulers.ledger.record_outcome(object(), Known(skipped=True))
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy.engine.log.held_schedulers.held_steps == 0
    assert copy.settings.master_weights and copy.precision == "bf16-mixed"


class Pending:
    """A fused step's outcome: its fate on the device until someone reads it (``arrive``)."""

    def __init__(self, skipped: bool) -> None:
        self._skipped, self.resolved, self.reads = skipped, False, 0

    def arrive(self) -> None:
        self.resolved = True

    @property
    def skipped(self) -> bool:
        self.reads += 1
        return self._skipped


def test_a_step_whose_fate_is_on_the_device_is_never_read_and_an_owed_step_is_held_once_it_is_known() -> None:
    opt, sched = scheduler()
    arrived: list[Pending] = []
    ledger = _schedulers.StepLedger(read_ready=lambda: [o.arrive() for o in arrived])
    _schedulers.hold(sched, ledger)
    first = Pending(skipped=True)
    opt.step()  # torch warns of a scheduler stepped before its optimizer ever was
    ledger.record_outcome(opt, first)
    sched.step()  # its fate unknown: taken as applied, the scheduler steps (no wait for the device)
    assert lr(opt) == 0.5 and first.reads == 0
    second = Pending(skipped=False)
    ledger.record_outcome(opt, second)
    arrived += [first, second]  # both values reach host memory before the next scheduler step
    sched.step()  # the first turned out skipped: its scheduler step is paid back by holding this one
    assert lr(opt) == 0.5 and ledger.held_steps == 1
    ledger.record_outcome(opt, Known(skipped=False))
    sched.step()
    assert lr(opt) == 0.25  # back on the schedule: two applied steps, two scheduler steps


def test_the_outcomes_kept_stay_bounded_when_no_scheduler_asks() -> None:
    opt, sched = scheduler()
    ledger = _schedulers.StepLedger()
    _schedulers.hold(sched, ledger)
    opt.step()
    for _ in range(5000):
        ledger.record_outcome(opt, Known(skipped=False))
    assert len(ledger._steps[id(opt)]) <= 5000 and all(isinstance(o, bool) for o in ledger._steps[id(opt)])
    sched.step()
    assert ledger._steps[id(opt)] == [] and lr(opt) == 0.5  # what it saw is dropped once it has asked
