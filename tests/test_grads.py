"""The fused passes over gradients: unscale + measure, and clipping with a measured norm."""

from __future__ import annotations

import pytest
import torch

from lightning_amp_plus.numerics.grads import _PIECE, clip_by_norm_, measure, nonfinite_names, unscale_and_measure_

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


def sparse(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # Index 1 twice: an uncoalesced tensor, as nn.Embedding(sparse=True) produces.
    indices = torch.tensor([[0, 1, 1, 3]])
    return torch.sparse_coo_tensor(indices, torch.tensor(values), (4,), dtype=dtype, check_invariants=True)


def test_sparse_gradients_are_unscaled_in_place_and_measured_by_their_dense_norm() -> None:
    g = sparse([8.0, 4.0, 4.0, 16.0])
    squared = unscale_and_measure_([g], 0.25, CPU)
    assert not g.is_coalesced()  # the same sparse tensor, its values multiplied
    torch.testing.assert_close(g.to_dense(), torch.tensor([2.0, 2.0, 0.0, 4.0]), rtol=0, atol=0)
    torch.testing.assert_close(squared, torch.tensor([4.0 + 4.0 + 16.0]), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_sparse_value_makes_its_norm_non_finite(bad: float) -> None:
    squared = unscale_and_measure_([torch.ones(3), sparse([1.0, bad, 1.0, 1.0])], 0.5, CPU)
    assert torch.isfinite(squared).tolist() == [True, False]


def test_float64_gradients_are_measured_in_float64() -> None:
    # 1e30**2 overflows float32 but not float64; the squared norm is returned in float32 (inf here, as documented),
    # while a moderate float64 value keeps its precision until that final rounding.
    g = [torch.tensor([1e-30, 3.0], dtype=torch.float64), torch.tensor([1.0 + 2**-40], dtype=torch.float64)]
    squared = unscale_and_measure_(g, 0.5, CPU)
    assert squared.dtype == torch.float32
    torch.testing.assert_close(squared, torch.tensor([2.25, 0.25]), rtol=0, atol=0)
    assert g[0].dtype == torch.float64 and g[1].item() == (1.0 + 2**-40) / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_large_tensors_measured_piece_by_piece_give_the_norm_of_the_whole(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    big = [(torch.randn(3 * _PIECE + 17) * 8).to(dtype), (torch.randn(70_000) * 8).to(dtype)]
    expected = torch.stack([(t.double() / 8).square().sum() for t in big]).float()
    squared = unscale_and_measure_(big, 1 / 8, CPU)
    # Against float64: a float32 dot over ~1e6 terms carries a relative error of order sqrt(n) * 2**-24 (~6e-5).
    torch.testing.assert_close(squared, expected, rtol=2e-4, atol=0)


def test_a_large_non_contiguous_tensor_is_unscaled_in_place() -> None:
    torch.manual_seed(0)
    base = torch.randn(400, 400) * 4
    original = base.clone()
    g = base.t()  # not contiguous: no flat view to cut into pieces
    squared = unscale_and_measure_([g], 0.25, CPU)
    torch.testing.assert_close(base, original * 0.25, rtol=0, atol=0)  # in place, through the transposed view
    # Against float64: a float32 dot over 160k terms, relative error of order sqrt(n) * 2**-24.
    torch.testing.assert_close(squared[0], (original.double() / 4).square().sum().float(), rtol=1e-4, atol=0)


def test_measure_reads_each_norm_without_touching_the_gradients() -> None:
    g = grads(torch.float16)
    before = [t.clone() for t in g]
    norms = measure(g, CPU)
    reference = torch.stack([torch.linalg.vector_norm(t.float()) for t in before])
    torch.testing.assert_close(norms, reference, rtol=1e-6, atol=0)  # the same float32 norm, another kernel
    assert all(torch.equal(a, b) for a, b in zip(g, before, strict=True))
    g[1][7] = float("nan")
    assert torch.isfinite(measure(g, CPU)).tolist() == [True, False, True, True]


def test_nonfinite_names_judges_sparse_tensors_by_their_values() -> None:
    assert nonfinite_names([("dense", torch.ones(2)), ("emb", sparse([1.0, float("inf"), 0.0, 2.0]))]) == ["emb"]


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


def test_measure_keeps_the_order_of_interleaved_dtypes_and_sizes() -> None:
    big = 1 << 17  # above the size measured with a dot product on CPU
    g = [torch.full((big,), 1.0), torch.full((3,), 2.0, dtype=torch.float16), torch.full((4,), 3.0),
         torch.full((big,), 0.5, dtype=torch.float64), torch.full((2,), 4.0, dtype=torch.bfloat16)]  # fmt: skip
    expected = torch.stack([torch.linalg.vector_norm(t.double()) for t in g]).float()
    torch.testing.assert_close(measure(g, CPU), expected, rtol=1e-6, atol=0)
