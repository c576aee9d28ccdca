"""`amp-plus` with compensated bf16 weights and headroom readings, through its real entry point and in-process."""

from __future__ import annotations

import pytest
from processes import amp_plus

from lightning_amp_plus import cli
from lightning_amp_plus.cli import compare

pytestmark = pytest.mark.integration  # starts processes or runs whole commands

TINY = ["--num-train", "16", "--num-val", "8", "--batch-size", "8", "--width", "2", "--accelerator", "cpu",
        "--threads", "1"]  # fmt: skip


@pytest.mark.parametrize(("method", "said"), [([], "kahan"), (["--compensation", "stochastic"], "stochastic")])
def test_train_bf16_true_says_how_its_bf16_weights_are_compensated(method: list[str], said: str) -> None:
    done = amp_plus("train", "cnn", *TINY, "--precision", "bf16-true", *method, "--max-steps", "2", timeout=180)
    assert done.returncode == 0, done.stderr
    assert f"bf16-true, bf16 weights compensated ({said}) on cpu" in done.stdout.splitlines()[0]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--precision", "bf16-mixed", "--compensation", "kahan"],
         "--compensation compensates bf16 weights, which --precision bf16-mixed does not hold (its weights are FP32). "
         "Use --precision bf16-true, or drop --compensation."),
        (["--precision", "bf16-true", "--master-weights"],
         "--master-weights is for half-precision compute over FP32 weights; --precision bf16-true keeps the weights in "
         "bf16"),
        (["--precision", "bf16-true", "--compensation", "fp32"], "invalid choice: 'fp32'"),
        (["--headroom", "-1"], "--headroom"),
    ],
)  # fmt: skip
def test_a_compensation_or_headroom_that_cannot_apply_is_refused_first_with_exit_2(argv: list[str], error: str) -> None:
    done = amp_plus("train", "cnn", *TINY, *argv, timeout=60)
    assert done.returncode == 2 and error in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_train_with_headroom_summarises_the_tightest_layer() -> None:
    done = amp_plus("train", "cnn", *TINY, "--precision", "bf16-mixed", "--headroom", "2", "--max-steps", "4",
                    timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "headroom at step 3: the tightest layer is `" in done.stdout


def test_compare_gains_the_bf16_true_rows_with_their_bytes_per_parameter() -> None:
    argv = ["compare", "cnn", *TINY, "--steps", "2", "--warmup", "0", "--in-process",
            "--configs", "32-true", "lightning-bf16-true", "ours-bf16-true-kahan", "ours-bf16-true-sr"]  # fmt: skip
    results = {r.config: r for r in compare.run(cli.build_parser().parse_args(argv))}
    # The CNN trains with SGD + momentum: weights and the momentum buffer, plus Kahan's buffer (bytes each).
    assert results["32-true"].bytes_per_param == pytest.approx(8.0)
    assert results["lightning-bf16-true"].bytes_per_param == pytest.approx(4.0)
    assert results["ours-bf16-true-kahan"].bytes_per_param == pytest.approx(6.0)
    assert results["ours-bf16-true-sr"].bytes_per_param == pytest.approx(4.0)
    assert all(r.steps == 2 and r.skipped_steps == 0 for r in results.values())
