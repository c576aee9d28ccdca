"""The passes over gradients: unscale, the global norm (torch's, bit for bit), each gradient's norm, clipping."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_amp_plus.step.grads import (
    PIECE,
    clip_by_norm_,
    global_norm,
    measure,
    multiply_,
    nonfinite_names,
    unscale_and_measure_,
)

CPU = torch.device("cpu")


def grads(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(shape).to(dtype) for shape in [(7, 5), (300,), (3, 4, 5), (1,)]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_multiplies_in_place(dtype: torch.dtype) -> None:
    g = [t * 64 for t in grads(dtype)]
    expected = [t.float() / 64 for t in g]
    multiply_(g, 1 / 64)
    # Multiplying by a power of two is exact in every float format.
    for got, want in zip(g, expected, strict=True):
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0)


def test_unscale_gives_gradscalers_values() -> None:
    # GradScaler multiplies by the float32 inverse of the scale in its fused kernel: the same values.
    torch.manual_seed(0)
    ours = [torch.randn(50) * 3000 for _ in range(3)]
    theirs = [t.clone() for t in ours]
    found_inf, inv = torch.zeros(1), torch.full((1,), 1 / 3000.0)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_inf, inv)
    multiply_(ours, float(inv.item()))
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("shapes", [[(7, 5), (300,), (3, 4, 5), (1,)], [(1000, 1000), (70_000,), (3,)]])
def test_the_global_norm_is_clip_grad_norms_bit_for_bit(shapes: list[tuple[int, ...]]) -> None:
    torch.manual_seed(3)
    g = [torch.randn(shape) for shape in shapes] + [torch.randn(9, dtype=torch.float64)]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in g]
    for p, t in zip(params, g, strict=True):
        p.grad = t.clone()
    total = torch.nn.utils.clip_grad_norm_(params, 1e9)
    assert global_norm(g).item() == total.float().item()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_single_non_finite_value_makes_the_global_norm_and_its_tensors_norm_non_finite(bad: float) -> None:
    g = grads()
    g[2][1, 2, 3] = bad
    assert not torch.isfinite(global_norm(g))
    assert torch.isfinite(measure(g, CPU)).tolist() == [True, True, False, True]


def test_overflow_created_by_the_unscale_itself_is_caught() -> None:
    # A scale below 1 multiplies: 40000 * 2 overflows fp16. The norm is taken after the multiply, so it sees the inf.
    g = [torch.tensor([40000.0, 1.0], dtype=torch.float16)]
    multiply_(g, 2.0)
    assert not torch.isfinite(global_norm(g))


def test_fp16_gradients_do_not_overflow_their_norm_accumulation() -> None:
    # The norm of these fp16 values (~31623) squared is far beyond fp16's 65504: it is accumulated in float32.
    g = [torch.full((1000,), 1000.0, dtype=torch.float16)]
    torch.testing.assert_close(global_norm(g), torch.tensor(1e9).sqrt(), rtol=1e-6, atol=0)
    torch.testing.assert_close(measure(g, CPU), torch.tensor([1e9]).sqrt(), rtol=1e-6, atol=0)


def test_measuring_leaves_gradients_untouched() -> None:
    g = grads()
    before = [t.clone() for t in g]
    global_norm(g)
    measure(g, CPU)
    for got, want in zip(g, before, strict=True):
        assert torch.equal(got, want)


def test_gradients_of_mixed_dtypes_keep_their_order() -> None:
    g = [torch.tensor([3.0]), torch.tensor([4.0], dtype=torch.float16), torch.tensor([5.0], dtype=torch.bfloat16)]
    assert measure(g, CPU).tolist() == [3.0, 4.0, 5.0]
    assert global_norm(g).item() == pytest.approx(50**0.5, rel=1e-6)


def test_no_gradients_give_an_empty_result_and_a_zero_norm() -> None:
    assert measure([], CPU).numel() == 0
    assert global_norm([]).item() == 0.0


def sparse(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # Index 1 twice: an uncoalesced tensor, as nn.Embedding(sparse=True) produces.
    indices = torch.tensor([[0, 1, 1, 3]])
    return torch.sparse_coo_tensor(indices, torch.tensor(values), (4,), dtype=dtype, check_invariants=True)


def test_sparse_gradients_are_unscaled_in_place_and_measured_by_their_dense_norm() -> None:
    g = sparse([8.0, 4.0, 4.0, 16.0])
    multiply_([g], 0.25)
    assert not g.is_coalesced()  # the same sparse tensor, its values multiplied
    torch.testing.assert_close(g.to_dense(), torch.tensor([2.0, 2.0, 0.0, 4.0]), rtol=0, atol=0)
    torch.testing.assert_close(measure([g], CPU), torch.tensor([24.0]).sqrt(), rtol=0, atol=0)
    torch.testing.assert_close(global_norm([g, torch.tensor([5.0])]), torch.tensor(49.0).sqrt(), rtol=1e-7, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_sparse_value_makes_its_norm_non_finite(bad: float) -> None:
    g = [torch.ones(3), sparse([1.0, bad, 1.0, 1.0])]
    assert torch.isfinite(measure(g, CPU)).tolist() == [True, False]
    assert not torch.isfinite(global_norm(g))


def test_float64_gradients_are_measured_in_float64_and_returned_in_float32() -> None:
    # A moderate float64 value keeps its precision until the final rounding to float32.
    g = [torch.tensor([1e-30, 3.0], dtype=torch.float64), torch.tensor([1.0 + 2**-40], dtype=torch.float64)]
    multiply_(g, 0.5)
    norms = measure(g, CPU)
    assert norms.dtype == torch.float32 and global_norm(g).dtype == torch.float32
    torch.testing.assert_close(norms, torch.tensor([1.5, 0.5]), rtol=0, atol=0)
    assert g[0].dtype == torch.float64 and g[1].item() == (1.0 + 2**-40) / 2


def test_a_large_non_contiguous_tensor_is_unscaled_in_place() -> None:
    torch.manual_seed(0)
    base = torch.randn(400, 400) * 4
    original = base.clone()
    g = base.t()  # not contiguous
    multiply_([g], 0.25)
    torch.testing.assert_close(base, original * 0.25, rtol=0, atol=0)  # in place, through the transposed view


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
def test_clip_by_norm_with_the_global_norm_matches_torch_clip_grad_norm(max_norm: float) -> None:
    ours = grads()
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in ours]
    for p, t in zip(params, ours, strict=True):
        p.grad = t.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm)
    measured = global_norm(ours)
    assert measured.item() == total.item()
    clip_by_norm_(ours, float(measured), max_norm)
    # Same formula (max_norm / (norm + 1e-6)) and the same total norm: identical results.
    for got, p in zip(ours, params, strict=True):
        torch.testing.assert_close(got, p.grad, rtol=0, atol=0)


def test_clip_does_not_touch_gradients_under_the_limit() -> None:
    g = grads()
    before = [t.data_ptr() for t in g]
    assert clip_by_norm_(g, 1.0, 2.0) == 1.0
    assert [t.data_ptr() for t in g] == before


def test_measure_keeps_the_order_of_interleaved_dtypes_and_sizes() -> None:
    big = 1 << 17
    g = [torch.full((big,), 1.0), torch.full((3,), 2.0, dtype=torch.float16), torch.full((4,), 3.0),
         torch.full((big,), 0.5, dtype=torch.float64), torch.full((2,), 4.0, dtype=torch.bfloat16)]  # fmt: skip
    expected = torch.stack([torch.linalg.vector_norm(t.double()) for t in g]).float()
    torch.testing.assert_close(measure(g, CPU), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_unscale_and_measure_unscales_bit_for_bit_and_measures_within_float32_rounding(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    sizes = (3, PIECE - 1, PIECE + 5, 2 * PIECE + 7, 11)  # small ones batched, large ones cut into pieces
    grads = [(torch.randn(n) * 64).to(dtype) for n in sizes]
    expected = [g.clone() for g in grads]
    norm = unscale_and_measure_(grads, 2.0**-6, torch.device("cpu"))
    multiply_(expected, 2.0**-6)
    for got, want in zip(grads, expected, strict=True):
        assert torch.equal(got, want)  # the same multiply, element for element
    # The same sum of squares taken in pieces: float32 accumulation error over ~800k terms, not bit for bit.
    torch.testing.assert_close(norm, global_norm(expected), rtol=1e-5, atol=0)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_unscale_and_measure_makes_the_norm_non_finite_wherever_the_bad_value_is(bad: float) -> None:
    for position in (0, PIECE + 3):
        grads = [torch.ones(2 * PIECE), torch.ones(4)]
        grads[0][position] = bad
        assert not torch.isfinite(unscale_and_measure_(grads, 0.5, torch.device("cpu")))
