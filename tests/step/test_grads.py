"""The passes over gradients: unscale, the global norm (torch's, bit for bit), each gradient's norm, clipping."""

from __future__ import annotations

import pytest
import torch

from lightning_amp_plus.step import grads as step_grads
from lightning_amp_plus.step.grads import (
    clip_by_norm_,
    clip_coefficient,
    global_norm,
    measure,
    multiply_,
    nonfinite_names,
)
from lightning_amp_plus.step.sharding import Ranks, Sharding

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
    assert global_norm(g).item() == total.item() and global_norm(g).dtype == total.dtype


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_global_norm_of_half_gradients_is_torchs_in_their_dtype_and_each_norm_is_accumulated_in_float32(
    dtype: torch.dtype,
) -> None:
    # A clip takes torch's number (what clip_grad_norm_ computes for these gradients, in their dtype); each gradient's
    # own norm, which names the non-finite ones, accumulates in float32 where fp16's would overflow at 65504.
    g = [torch.full((1000,), 1000.0, dtype=dtype), torch.full((3,), 0.5, dtype=dtype)]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in g]
    for p, t in zip(params, g, strict=True):
        p.grad = t.clone()
    expected = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert torch.equal(global_norm(g), expected)
    torch.testing.assert_close(measure(g, CPU)[0], torch.tensor(1e9).sqrt(), rtol=1e-6, atol=0)


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


def test_float64_gradients_are_measured_in_float64() -> None:
    # A moderate float64 value keeps its precision until the final rounding to float32.
    g = [torch.tensor([1e-30, 3.0], dtype=torch.float64), torch.tensor([1.0 + 2**-40], dtype=torch.float64)]
    multiply_(g, 0.5)
    norms = measure(g, CPU)
    assert norms.dtype == torch.float32 and global_norm(g).dtype == torch.float64  # torch's, in float64
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
    clip_by_norm_(ours, float(clip_coefficient(measured, max_norm)))
    # Same formula (max_norm / (norm + 1e-6)) and the same total norm: identical results.
    for got, p in zip(ours, params, strict=True):
        torch.testing.assert_close(got, p.grad, rtol=0, atol=0)


def test_clip_does_not_touch_gradients_under_the_limit() -> None:
    g = grads()
    before = [t.clone() for t in g]
    clip_by_norm_(g, float(clip_coefficient(torch.tensor(1.0), 2.0)))
    assert all(torch.equal(a, b) for a, b in zip(g, before, strict=True))


def test_measure_keeps_the_order_of_interleaved_dtypes_and_sizes() -> None:
    big = 1 << 17
    g = [torch.full((big,), 1.0), torch.full((3,), 2.0, dtype=torch.float16), torch.full((4,), 3.0),
         torch.full((big,), 0.5, dtype=torch.float64), torch.full((2,), 4.0, dtype=torch.bfloat16)]  # fmt: skip
    expected = torch.stack([torch.linalg.vector_norm(t.double()) for t in g]).float()
    torch.testing.assert_close(measure(g, CPU), expected, rtol=1e-6, atol=0)


def test_the_norm_across_ranks_in_one_process_is_the_local_global_norm() -> None:
    g = grads()
    one = Ranks(sharding=Sharding(replicas=1))  # in one process the SUM over ranks is this rank's own
    torch.testing.assert_close(global_norm(g, CPU, one), global_norm(g, CPU), rtol=1e-6, atol=0)


def test_a_copy_of_norms_to_host_memory_waits_for_them_and_one_to_an_accelerator_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A non-blocking copy into pageable host memory may be read before it lands; towards an accelerator it is safe.
    seen: list[tuple[str, bool]] = []

    def to(self: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
        seen.append((torch.device(device).type, non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "to", to)
    values = torch.empty(2, device="meta")
    step_grads._to(values, torch.device("cpu"))
    step_grads._to(values, torch.device("cuda"))
    assert seen == [("cpu", False), ("cuda", True)]
