"""The fused passes over gradients: unscale + measure, and clipping with a measured norm."""

from __future__ import annotations

import pytest
import torch

from lightning_amp_plus._grads import clip_by_norm_, unscale_and_measure_

CPU = torch.device("cpu")


def grads(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(shape).to(dtype) for shape in [(7, 5), (300,), (3, 4, 5), (1,)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_multiplies_in_place_and_measures_the_unscaled_norms(dtype: torch.dtype) -> None:
    g = [t * 64 for t in grads(dtype)]
    expected = [t.float() / 64 for t in g]
    squared = unscale_and_measure_(g, 1 / 64, CPU)
    # Multiplying by a power of two is exact in every float format.
    for got, want in zip(g, expected, strict=True):
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0)
    reference = torch.stack([torch.linalg.vector_norm(t) ** 2 for t in expected])
    # float32 sums in a different order than vector_norm: a few ulps.
    torch.testing.assert_close(squared, reference, rtol=1e-5, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_single_non_finite_value_makes_only_its_tensors_norm_non_finite(bad: float) -> None:
    g = grads()
    g[2][1, 2, 3] = bad
    squared = unscale_and_measure_(g, 0.5, CPU)
    assert torch.isfinite(squared).tolist() == [True, True, False, True]


def test_overflow_created_by_the_unscale_itself_is_caught() -> None:
    # A scale below 1 multiplies: 40000 * 2 overflows fp16. The check runs after the multiply, so it sees the inf.
    g = [torch.tensor([40000.0, 1.0], dtype=torch.float16)]
    squared = unscale_and_measure_(g, 2.0, CPU)
    assert not torch.isfinite(squared).all()


def test_fp16_gradients_do_not_overflow_their_norm_accumulation() -> None:
    # The squared norm of these fp16 values (~1e9) is far beyond fp16's 65504: it is accumulated in float32.
    g = [torch.full((1000,), 1000.0, dtype=torch.float16)]
    squared = unscale_and_measure_(g, None, CPU)
    torch.testing.assert_close(squared, torch.tensor([1e9]), rtol=1e-6, atol=0)


def test_measuring_without_a_scale_leaves_gradients_untouched() -> None:
    g = grads()
    before = [t.clone() for t in g]
    unscale_and_measure_(g, None, CPU)
    for got, want in zip(g, before, strict=True):
        assert torch.equal(got, want)


def test_gradients_of_mixed_dtypes_keep_their_order() -> None:
    g = [torch.tensor([3.0]), torch.tensor([4.0], dtype=torch.float16), torch.tensor([5.0], dtype=torch.bfloat16)]
    assert unscale_and_measure_(g, None, CPU).tolist() == [9.0, 16.0, 25.0]


def test_no_gradients_give_an_empty_result() -> None:
    assert unscale_and_measure_([], None, CPU).numel() == 0


def test_sparse_gradients_are_refused_with_a_clear_error() -> None:
    sparse = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (3,), check_invariants=True)
    with pytest.raises(TypeError, match="sparse"):
        unscale_and_measure_([sparse], None, CPU)


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e6])
def test_clip_by_norm_matches_torch_clip_grad_norm(max_norm: float) -> None:
    ours = grads()
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in ours]
    for p, t in zip(params, ours, strict=True):
        p.grad = t.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    clip_by_norm_(ours, float(total), max_norm)
    # Same formula (max_norm / (norm + 1e-6)) and the same total norm: identical results.
    for got, p in zip(ours, params, strict=True):
        torch.testing.assert_close(got, p.grad, rtol=0, atol=0)


def test_clip_does_not_touch_gradients_under_the_limit() -> None:
    g = grads()
    before = [t.data_ptr() for t in g]
    assert clip_by_norm_(g, 1.0, 2.0) == 1.0
    assert [t.data_ptr() for t in g] == before
