"""The README's main job: a short run of the built-in demo."""

from __future__ import annotations

import pytest

from lightning_amp_plus.demo import blobs, main, runs


def test_fp16_demo_backs_off_from_an_overflowing_scale_counts_the_skips_and_learns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = main(["--steps", "120"])
    assert report["steps"] == 120
    # 2**24 overflows fp16 gradients of this model: the first steps are skipped while the scale backs off.
    first_run = report["scale_runs"][0]
    assert first_run[0] == 0 and first_run[2] == 2.0**24
    assert report["skipped_steps"] == len(report["skipped_at"]) >= 1
    assert report["skipped_at"][0] == 0
    assert report["accuracy"] > 0.6  # four classes: chance is 0.25
    out = capsys.readouterr().out
    assert "MixedPrecisionMonitor: 120 optimizer steps" in out
    assert "loss scale history" in out and "2**24 = 16,777,216" in out and "skipped steps:" in out


def test_bf16_demo_runs_without_a_scaler() -> None:
    report = main(["--precision", "bf16-mixed", "--steps", "60"])
    assert report["skipped_steps"] == 0
    assert [value for _, _, value in report["scale_runs"]] == [1.0]


def test_blobs_share_their_clusters_across_splits_but_not_their_samples() -> None:
    train_x, _ = blobs(400, seed=3)[:]
    held_x, _ = blobs(400, seed=3, split=1)[:]
    assert not train_x.equal(held_x)
    # Same task: the class means agree up to sampling noise (std 1 / sqrt(100 per class)).
    assert (train_x[0::4].mean(0) - held_x[0::4].mean(0)).abs().max() < 0.6


def test_runs_compresses_equal_neighbours() -> None:
    assert runs([]) == []
    assert runs([1.0, 1.0, 1.0]) == [(0, 2, 1.0)]
