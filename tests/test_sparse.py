"""The numba kernels of the lossy path (zipccl/kernels/sparse.py) against the torch path they
replace: the same selection, values, residuals and sums, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zipccl.collectives import _sum_pairs
from zipccl.errors import FormatError
from zipccl.feedback import Residuals
from zipccl.kernels import sparse
from zipccl.topk import SAMPLE, TopK

COMBOS = [(torch.float32, torch.float32, torch.float32), (torch.float32, torch.bfloat16, torch.float32),
          (torch.float32, torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16, torch.float32),
          (torch.bfloat16, torch.bfloat16, torch.bfloat16)]


def _torch_path(grad, residual, codec, value_dtype, residual_dtype):
    """zipccl.lossy's torch path: compensate, round to the value dtype, select, keep the rest."""
    store = Residuals(residual_dtype)
    if residual is not None:
        store.store["k"] = residual.clone()
    compensated = store.compensate("k", grad)
    wire = torch.empty_like(grad, dtype=value_dtype)
    wire.copy_(compensated)
    idx, values = codec.select(wire)
    sent = torch.zeros_like(compensated)
    sent[idx.long()] = values.float()
    store.update("k", compensated, sent)
    return idx, values, store.store["k"]


def _gradient(n, dtype, seed, ties=False):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-3
    g[::97] = 0.0
    g[5::131] = -0.0
    if ties:  # many equal magnitudes around the threshold
        g = torch.round(g * 2e3) / 2e3
    return g.to(dtype)


@pytest.mark.parametrize("grad_dtype,value_dtype,residual_dtype", COMBOS, ids=str)
@pytest.mark.parametrize("sampled", [False, True], ids=["exact", "sampled"])
@pytest.mark.parametrize("n,density,ties", [(1, 0.5, False), (1000, 0.05, True), (300_001, 0.01, False),
                                            (300_001, 0.2, True), (5000, 1.0, False)])
def test_selection_and_residual_match_the_torch_path(grad_dtype, value_dtype, residual_dtype, sampled, n, density,
                                                     ties):
    codec = TopK(density, sampled=sampled)
    g = _gradient(n, grad_dtype, n, ties)
    for residual in (None, (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-4).to(residual_dtype)):
        want = _torch_path(g, residual, codec, value_dtype, residual_dtype)
        got = sparse.compensated_topk(g, None if residual is None else residual.clone(), codec.k(n), value_dtype,
                                      residual_dtype, codec.sample_positions(n), codec.sample_k())
        assert torch.equal(got[0], want[0])
        for a, b in zip(got[1:], want[1:]):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_sampled_threshold_is_used_when_it_fits():
    """Above 4 x SAMPLE elements the sampled threshold decides: about k entries, not exactly k."""
    n = 5 * SAMPLE
    codec = TopK(0.03, sampled=True)
    g = _gradient(n, torch.float32, 3)
    idx, values, _ = sparse.compensated_topk(g, None, codec.k(n), torch.float32, torch.float32,
                                             codec.sample_positions(n), codec.sample_k())
    assert idx.numel() != codec.k(n) and 0 < idx.numel() <= 2 * codec.k(n)
    assert torch.equal(values, g[idx.long()])


@pytest.mark.parametrize("grad_dtype,value_dtype,residual_dtype", COMBOS, ids=str)
def test_a_misjudging_sample_falls_back_to_the_exact_selection(grad_dtype, value_dtype, residual_dtype):
    """Tiny values at the sampled positions put the threshold so low that nearly every entry
    passes it: the kernels, like the torch path, select exactly k instead, and the residual
    written in place (float32: in the same pass) comes out as if nothing had been sent first."""
    n = 5 * SAMPLE
    codec = TopK(0.01, sampled=True)
    pos = codec.sample_positions(n)
    g = _gradient(n, torch.float32, 5)
    g[pos] *= 1e-6
    g = g.to(grad_dtype)
    residual = (torch.randn(n, generator=torch.Generator().manual_seed(2)) * 1e-4).to(residual_dtype)
    want = _torch_path(g, residual, codec, value_dtype, residual_dtype)
    got = sparse.compensated_topk(g, residual.clone(), codec.k(n), value_dtype, residual_dtype, pos,
                                  codec.sample_k())
    assert got[0].numel() == codec.k(n) and torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_nan_is_never_selected_before_numbers():
    g = _gradient(1000, torch.float32, 4)
    g[10:20] = float("nan")
    idx, values, residual = sparse.compensated_topk(g, None, 50, torch.float32, torch.float32)
    assert idx.numel() == 50 and not bool(values.isnan().any()) and bool(residual[10:20].isnan().all())


def _packets(n, numel, k, dtype, seed):
    codec = TopK(k / numel)
    gen = torch.Generator().manual_seed(seed)
    return codec, [codec.encode((torch.randn(numel, generator=gen) * 1e-2).to(dtype)) for _ in range(n)]


@pytest.mark.parametrize("dtype", sparse.DTYPES, ids=str)
@pytest.mark.parametrize("nranks", [1, 2, 5])
@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG], ids=["sum", "avg"])
def test_sum_of_pairs_matches_the_torch_path(dtype, nranks, op):
    numel = 20_011
    codec, parts = _packets(nranks, numel, 700, dtype, nranks)
    total, _ = _sum_pairs(parts, codec, torch.empty(numel, dtype=dtype), op, nranks)
    out = torch.full((numel,), 7.0, dtype=dtype)  # every element is written
    sparse.sum_pairs_into(parts, dtype, op == dist.ReduceOp.AVG, nranks, out)
    assert torch.equal(out.view(torch.uint8), total.to(dtype).view(torch.uint8))


def test_sum_of_pairs_rejects_bad_indices():
    codec, parts = _packets(2, 1000, 10, torch.float32, 0)
    out = torch.empty(1000)
    for offset, value in ((56, 1000), (60, 0)):  # out of range; not ascending (first index repeated)
        bad = parts[1].clone()
        first = int(bad[56:60].view(torch.int32)) if value == 0 else value
        bad[offset:offset + 4] = torch.tensor([first], dtype=torch.int32).view(torch.uint8)
        with pytest.raises(FormatError):
            sparse.sum_pairs_into([parts[0], bad], torch.float32, False, 2, out)


def test_exact_ranges_join_the_selection_in_bucket_order():
    from zipccl.lossy import _with_exact_ranges
    bucket = torch.arange(20, dtype=torch.float32)
    lossy_ranges, exact_ranges = [(0, 5), (8, 14)], [(5, 8), (14, 20)]  # lossy elements back to back: 0-4, 8-13
    idx = torch.tensor([1, 4, 5, 10], dtype=torch.int32)  # bucket positions 1, 4, 8, 13
    values = torch.tensor([-1.0, -4.0, -8.0, -13.0])
    got_idx, got_values = _with_exact_ranges(idx, values, bucket, lossy_ranges, exact_ranges)
    assert got_idx.tolist() == [1, 4, 5, 6, 7, 8, 13, 14, 15, 16, 17, 18, 19]
    assert got_values.tolist() == [-1, -4, 5, 6, 7, -8, -13, 14, 15, 16, 17, 18, 19]
