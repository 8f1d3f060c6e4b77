"""The numba kernels of the lossy path (zipccl/kernels/sparse.py) against the torch path they
replace, and both against plain torch: the same selection, values, residuals and sums, bit for bit.

The torch path is the library's own: ``Compressor.reduce`` on a one-rank gloo group in this
process, once as it runs (the kernels apply) and once with ``sparse.supports`` patched to say
no, which sends it down its torch fallback (zipccl.feedback, TopK.select). The expected bits come
from the definition, written here in plain torch without zipccl: compensated = gradient +
residual in float32; the value sent is that rounded to the value dtype; the k largest |value|
are sent (NaN below every number, ties to the lower index), or with a sampled threshold everything
at or above the sample's sample_k-th largest when that is 1 to 2k entries; the new residual is
compensated - sent (sent = 0 where nothing was), rounded to the residual dtype; the one-rank sum
is the sent values added to +0.0 in float32 and rounded to the value dtype."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zipccl.collectives import _sum_pairs
from zipccl.errors import FormatError
from zipccl.kernels import sparse
from zipccl.lossy import Compressor
from zipccl.topk import SAMPLE, TopK

COMBOS = [(torch.float32, torch.float32, torch.float32), (torch.float32, torch.bfloat16, torch.float32),
          (torch.float32, torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16, torch.float32),
          (torch.bfloat16, torch.bfloat16, torch.bfloat16)]
# Combinations the kernels do not take: the fallback alone, still against plain torch.
FALLBACK_ONLY = [(torch.float32, torch.float16, torch.float32), (torch.float16, torch.float16, torch.bfloat16),
                 (torch.bfloat16, torch.float32, torch.float32)]


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group in this process (Compressor.reduce ends in an all-reduce)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def _reduce(monkeypatch, g, residual, density, sampled, value_dtype, residual_dtype, kernels: bool):
    """Compressor.reduce of ``g`` on one rank (sum): (indices, values sent, new residual, the
    reduced tensor). kernels=False forces the torch fallback; either way, check which ran."""
    codec = TopK(density, algorithm="gather", sampled=sampled)
    sent = []
    encode = codec.encode_selected
    monkeypatch.setattr(codec, "encode_selected", lambda i, v, n: sent.append((i.clone(), v.clone())) or encode(i, v, n))
    comp = Compressor(codec, residual_dtype=residual_dtype, value_dtype=value_dtype)
    if residual is not None:
        comp.residuals.store["k"] = residual.clone()
    calls = []
    kernel = sparse.compensated_topk
    with monkeypatch.context() as m:
        m.setattr(sparse, "compensated_topk", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
        if not kernels:
            m.setattr(sparse, "supports", lambda *a: False)
        flat = g.clone()
        comp.reduce(flat, "k", 0, True, None, op=dist.ReduceOp.SUM)
    assert len(calls) == (1 if kernels else 0), "the path asked for did not run"
    assert len(sent) == 1
    return sent[0][0], sent[0][1], comp.residuals.store["k"], flat


def _plain_torch(g, residual, density, sampled, value_dtype, residual_dtype):
    """The same four results from the definition (module docstring), in plain torch."""
    n = g.numel()
    compensated = g.float() if residual is None else g.float() + residual.float()  # no residual: -0.0 stays
    value = compensated.to(value_dtype)
    mag = value.double().abs()  # ranked as float64: Inf above every finite float32, NaN above Inf
    mag[mag.isinf()] = 1e300
    mag[mag.isnan()] = float("inf")
    k = min(n, max(1, -int(-density * n // 1)))
    idx = None
    if sampled and n > 4 * SAMPLE:
        positions = torch.randint(0, n, (SAMPLE,), generator=torch.Generator().manual_seed(n))
        sample_k = min(SAMPLE, max(1, -int(-density * SAMPLE // 1)))
        threshold = torch.sort(mag[positions], descending=True).values[sample_k - 1]
        above = torch.nonzero(mag >= threshold).reshape(-1)
        if 0 < above.numel() <= 2 * k:
            idx = above
    if idx is None:  # a stable sort keeps equal magnitudes in index order
        idx = torch.sort(torch.sort(mag, descending=True, stable=True).indices[:k]).values
    sent = torch.zeros(n)
    sent[idx] = value[idx].float()
    reduced = (torch.zeros(n) + sent).to(value_dtype).to(g.dtype)  # +0.0 + -0.0 is +0.0
    residual = (compensated - sent).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # what is not finite is not carried
    return idx.to(torch.int32), value[idx], residual.to(residual_dtype), reduced


def _assert_same(got, want):
    """Equal indices, and values, residuals and sums equal bit for bit, but a NaN's payload
    (torch's vectorised conversion to bfloat16 makes 0xFFFF of it, its scalar one 0x7FC0)."""
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a[~a.isnan()].view(torch.uint8), b[~b.isnan()].view(torch.uint8))


def _gradient(n, dtype, seed, ties=False):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-3
    g[::97] = 0.0
    g[5::131] = -0.0
    if ties:  # many equal magnitudes around the threshold
        g = torch.round(g * 2e3) / 2e3
    return g.to(dtype)


def _residual(n, dtype):
    return (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-4).to(dtype)


@pytest.mark.parametrize("grad_dtype,value_dtype,residual_dtype", COMBOS + FALLBACK_ONLY, ids=str)
@pytest.mark.parametrize("sampled", [False, True], ids=["exact", "sampled"])
@pytest.mark.parametrize("n,density,ties,nonfinite", [(1, 0.5, False, False), (1000, 0.05, True, False),
                                                      (300_001, 0.01, False, False), (300_001, 0.2, True, False),
                                                      (5000, 1.0, False, False), (300_001, 0.01, False, True)])
def test_kernels_and_torch_path_match_plain_torch(one_rank, monkeypatch, grad_dtype, value_dtype, residual_dtype,
                                                  sampled, n, density, ties, nonfinite):
    g = _gradient(n, grad_dtype, n, ties)
    if nonfinite:  # an overflowed step's: NaN ranks above Inf, both above every number
        g[[3, 400, 901]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=grad_dtype)
    for residual in (None, _residual(n, residual_dtype)):
        args = (g, residual, density, sampled, value_dtype, residual_dtype)
        want = _plain_torch(*args)
        _assert_same(_reduce(monkeypatch, *args, kernels=False), want)
        if (grad_dtype, value_dtype, residual_dtype) in COMBOS:
            _assert_same(_reduce(monkeypatch, *args, kernels=True), want)


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
def test_a_misjudging_sample_falls_back_to_the_exact_selection(one_rank, monkeypatch, grad_dtype, value_dtype,
                                                               residual_dtype):
    """Tiny values at the sampled positions put the threshold so low that nearly every entry
    passes it: the kernels, like the torch path, select exactly k instead, and the residual
    written in place (float32: in the same pass) comes out as if nothing had been sent first."""
    n = 5 * SAMPLE
    g = _gradient(n, torch.float32, 5)
    g[TopK(0.01, sampled=True).sample_positions(n)] *= 1e-6
    args = (g.to(grad_dtype), _residual(n, residual_dtype), 0.01, True, value_dtype, residual_dtype)
    want = _plain_torch(*args)
    assert want[0].numel() == TopK(0.01).k(n)
    _assert_same(_reduce(monkeypatch, *args, kernels=False), want)
    _assert_same(_reduce(monkeypatch, *args, kernels=True), want)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_a_nan_is_selected_before_numbers_as_an_inf_is(one_rank, monkeypatch, kernels):
    """A NaN gradient (an overflowed step) is sent first, so that the sum holds it and GradScaler
    skips the step, as it does for an Inf; dropped, it would leave a step that looks clean."""
    g = _gradient(1000, torch.float32, 4)
    g[10:20] = float("nan")
    g[30] = float("inf")
    idx, values, residual, reduced = _reduce(monkeypatch, g, None, 0.05, False, torch.float32, torch.float32, kernels)
    assert idx.numel() == 50 and set(range(10, 20)) | {30} <= set(idx.tolist())
    assert int(values.isnan().sum()) == 10 and bool(reduced[10:20].isnan().all()) and reduced[30] == float("inf")
    assert torch.equal(residual[10:20], torch.zeros(10)) and bool(residual.isfinite().all())


@pytest.mark.parametrize("kernels,bad,value_dtype", [
    *((k, bad, torch.float32) for k in (True, False) for bad in (float("inf"), float("-inf"), float("nan"))),
    (False, float("inf"), torch.float16)])  # float16 values: the torch path alone
def test_an_overflowed_step_is_not_carried_into_later_steps(one_rank, monkeypatch, kernels, bad, value_dtype):
    """A step whose gradient holds Inf or NaN leaves a finite residual, 0 there, so that the next
    steps send that coordinate again: GradScaler skips the overflowed step, but a NaN kept in the
    residual (Inf - Inf) would cut the coordinate out for good."""
    g = _gradient(1000, torch.float32, 6)
    g[7] = bad
    idx, values, residual, _ = _reduce(monkeypatch, g, None, 0.05, False, value_dtype, torch.float32, kernels)
    assert residual[7] == 0.0 and bool(residual.isfinite().all()), residual[7]
    for step in (1, 2):
        g = _gradient(1000, torch.float32, 6 + step)
        g[7] = 1.0  # the largest from now on
        idx, values, residual, _ = _reduce(monkeypatch, g, residual, 0.05, False, value_dtype, torch.float32, kernels)
        assert 7 in idx.tolist() and bool(residual.isfinite().all()), (step, residual[7])


def test_a_value_beyond_the_sent_dtypes_range_is_sent_at_its_end_and_the_rest_kept(one_rank, monkeypatch):
    """fp32 gradients sent as float16 values: 1e5, finite, is sent as 65,504 (not Inf, which the
    plain fp32 collective would not have made), and 34,496 waits in the residual."""
    g = _gradient(1000, torch.float32, 6)
    g[7] = 1e5
    idx, values, residual, reduced = _reduce(monkeypatch, g, None, 0.05, False, torch.float16, torch.float32, False)
    assert values[idx.tolist().index(7)] == 65504.0 and residual[7] == 1e5 - 65504.0, residual[7]
    assert bool(values.isfinite().all()) and bool(reduced.isfinite().all())


def _packets(n, numel, k, dtype, seed):
    """n ranks' top-k packets of k pairs each, and the pairs: the indices crowd into the first
    third so that most positions get several ranks' values, of scales far apart, -0.0 among
    them. At position 0 rank order decides even in bfloat16: 256 - 256 + 2^-20 + ... is not
    ... + 2^-20 - 256 + 256."""
    codec = TopK(k / numel)
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for r in range(n):
        idx = torch.sort(torch.randperm(numel // 3 - 1, generator=gen)[:k - 1] + 1).values
        idx = torch.cat([torch.tensor([0]), idx]).to(torch.int32)
        values = torch.randn(k, generator=gen) * 10.0 ** torch.randint(-4, 4, (k,), generator=gen)
        values[1::50] = -0.0
        values[0] = (256.0, -256.0)[r] if r < 2 else 2.0 ** -20
        pairs.append((idx, values.to(dtype)))
    return codec, [codec.encode_selected(i, v, numel) for i, v in pairs], pairs


@pytest.mark.parametrize("dtype", sparse.DTYPES, ids=str)
@pytest.mark.parametrize("nranks", [1, 2, 5])
@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG], ids=["sum", "avg"])
def test_sum_of_pairs_matches_the_torch_path_and_plain_torch(dtype, nranks, op):
    numel = 20_011
    codec, parts, pairs = _packets(nranks, numel, 700, dtype, nranks)
    want = torch.zeros(numel)  # from +0.0, rank by rank in float32, averaged, rounded once
    for idx, values in pairs:
        want[idx.long()] += values.float()
    if op == dist.ReduceOp.AVG:
        want /= nranks
    want = want.to(dtype)
    total, _ = _sum_pairs(parts, codec, torch.empty(numel, dtype=dtype), op, nranks)  # the torch path
    assert torch.equal(total.to(dtype).view(torch.uint8), want.view(torch.uint8))
    out = torch.full((numel,), 7.0, dtype=dtype)  # every element is written
    sparse.sum_pairs_into(parts, dtype, op == dist.ReduceOp.AVG, nranks, out)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_sum_of_pairs_rejects_bad_indices():
    codec, parts, _ = _packets(2, 1000, 10, torch.float32, 0)
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
