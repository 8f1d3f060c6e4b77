"""Top-k codec, error feedback, and the sparse all-reduce."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st

import zipccl
from zipccl import format as F
from zipccl.codecs import TopK
from zipccl.errors import UnsupportedError
from zipccl.feedback import Residuals


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 3000), density=st.floats(0.001, 1.0), seed=st.integers(0, 10**6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_roundtrip_keeps_the_largest_entries(n, density, seed, dtype):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    c = TopK(density)
    p = c.encode(x)
    assert p.numel() == c.max_encoded_size(n, dtype)
    y = c.decode(p)
    kept = y != 0
    k = c.k(n)
    assert int(kept.sum()) <= k
    assert torch.equal(y[kept], x[kept])
    idx, _ = c.select(x)
    assert idx.numel() == k
    threshold = x.float().abs()[idx.long()].min()
    rest = torch.ones(n, dtype=torch.bool)
    rest[idx.long()] = False
    assert bool((x.float().abs()[rest] <= threshold).all())


def test_selection_is_deterministic_with_ties():
    x = torch.tensor([1.0, -1.0, 1.0, 0.5, -1.0])
    idx, values = TopK(0.6).select(x)
    assert idx.tolist() == [0, 1, 2] and values.tolist() == [1.0, -1.0, 1.0]


def _rewrite(p, idx=None, **header):
    h = F.parse_header(p[:F.HEADER_SIZE].numpy().tobytes(), None, p.numel())
    body = p[F.HEADER_SIZE:].clone()
    if idx is not None:
        body[:len(idx) * 4] = torch.tensor(idx, dtype=torch.int32).view(torch.uint8)
    fields = {**h.__dict__, **header}
    q = torch.cat([torch.frombuffer(bytearray(F.Header(**fields).pack()), dtype=torch.uint8), body])
    return q


def test_corrupt_packets_raise():
    c = TopK(0.5)
    p = c.encode(torch.arange(8, dtype=torch.float32))  # keeps indices 4..7
    with pytest.raises(zipccl.FormatError, match="range"):
        c.decode(_rewrite(p, idx=[4, 5, 6, 8]))
    with pytest.raises(zipccl.FormatError, match="ascending"):
        c.decode(_rewrite(p, idx=[4, 5, 5, 7]))
    with pytest.raises(zipccl.FormatError, match="ascending"):
        c.decode(_rewrite(p, idx=[7, 5, 6, 4]))
    h = F.parse_header(p[:F.HEADER_SIZE].numpy().tobytes(), None, p.numel())
    s0, s1, s2, s3 = h.sections
    with pytest.raises(zipccl.FormatError):
        c.decode(_rewrite(p, sections=(s0, s1, s2 - 4, s3)))
    with pytest.raises(zipccl.FormatError):
        c.decode(p[:-1].clone())
    with pytest.raises(zipccl.FormatError):
        zipccl.codecs.Lossless().decode(p)


def test_bad_configuration():
    for bad in (0, -0.1, 1.5, "0.1"):
        with pytest.raises(ValueError):
            TopK(bad)
    with pytest.raises(ValueError):
        Residuals(torch.float16)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=300), st.integers(1, 300))
def test_the_kth_largest_is_the_same_by_kthvalue_and_by_topk(keys, k):
    """The exact selection's threshold on CUDA (topk's least of k) equals kthvalue's, ties included."""
    keys = torch.tensor(keys, dtype=torch.int32)
    k = min(k, keys.numel())
    want = sorted(keys.tolist(), reverse=True)[k - 1]
    assert zipccl.topk.kth_largest(keys, k, spread=False).item() == want
    assert zipccl.topk.kth_largest(keys, k, spread=True).item() == want


@pytest.mark.parametrize("path", ["select", "error feedback"])
def test_more_elements_than_int32_indices_address_are_refused_before_selecting(monkeypatch, path):
    """Above MAX_NUMEL (2**31; here made 1000) an int32 index would wrap and count from the end:
    refused before anything is selected, and the residual is left as it was."""
    monkeypatch.setattr(zipccl.topk, "MAX_NUMEL", 1000)
    comp = zipccl.lossy.Compressor("topk", rules=None)
    call = (lambda x: TopK(0.1).select(x)) if path == "select" else \
        (lambda x: comp._select(x, "bucket", TopK(0.1), None))
    call(torch.randn(1000))  # at the bound: taken
    comp.residuals.store.clear()
    with pytest.raises(UnsupportedError, match="at most 1000 elements"):
        call(torch.randn(1001))
    assert not comp.residuals.store


def test_error_feedback_is_exact_and_pickles():
    res = Residuals()
    c = TopK(0.1)
    g = torch.Generator().manual_seed(0)
    old = torch.zeros(1000)
    for step in range(3):
        grad = torch.randn(1000, generator=g)
        comp = res.compensate(("bucket", 0), grad)
        assert torch.equal(comp, grad + old)
        sent = c.decode(c.encode(comp))
        res.update(("bucket", 0), comp, sent)
        assert torch.equal(res.store[("bucket", 0)], (grad + old) - sent)
        old = res.store[("bucket", 0)]
    assert res.memory_bytes() == 4000
    assert torch.equal(res.compensate(("bucket", 0), torch.zeros(7)), torch.zeros(7))  # rebuilt bucket: fresh
    back = pickle.loads(pickle.dumps(res))
    assert torch.equal(back.store[("bucket", 0)], old)
    half = Residuals(torch.bfloat16)
    half.update("w", torch.ones(10), torch.zeros(10))
    assert half.memory_bytes() == 20


def _sparse(rank, groups, size, density):
    if rank >= size:
        return None
    g = groups[size]
    c = TopK(density)
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    y = x.clone()
    zipccl.all_reduce(y, group=g, codec=c)
    errors = {}
    entropy = zipccl.lossy.Compressor("entropy")  # its first steps are lossless: MAX is refused from the first
    for name, call in (("ag", lambda: zipccl.all_gather(torch.empty(10 * size), torch.ones(10), group=g, codec=c)),
                       ("max", lambda: zipccl.all_reduce(torch.ones(10), op=dist.ReduceOp.MAX, group=g, codec=c)),
                       ("entropy max", lambda: entropy.all_reduce(torch.ones(100, 100), "layer.weight",
                                                                  op=dist.ReduceOp.MAX, group=g)),
                       ("entropy min, reduce-scatter", lambda: entropy.reduce_scatter(
                           torch.ones(100 * size), torch.empty(100), "w", 0, True, g, op=dist.ReduceOp.MIN))):
        try:
            call()
            errors[name] = "no error"
        except zipccl.UnsupportedError as e:
            errors[name] = str(e)
    return y.view(torch.int16).clone(), errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 4])
def test_sparse_all_reduce_equals_dense_sum_of_what_was_sent(pool, size):
    res = pool.run(_sparse, size, 0.05)[:size]
    assert all(not isinstance(r, BaseException) for r in res), res
    assert all(torch.equal(r[0], res[0][0]) for r in res)  # bit-identical on every rank
    c = TopK(0.05)
    total = torch.zeros(10_001)
    for q in range(size):  # rank order, fp32 accumulation, rounded once
        x = torch.randn(10_001, generator=torch.Generator().manual_seed(q)).to(torch.bfloat16)
        total += c.decode(c.encode(x)).float()
    assert torch.equal(res[0][0], total.to(torch.bfloat16).view(torch.int16))
    for r in res:
        assert "all_reduce and reduce_scatter only" in r[1]["ag"] and "SUM or AVG" in r[1]["max"]
        assert "SUM or AVG" in r[1]["entropy max"] and "SUM or AVG" in r[1]["entropy min, reduce-scatter"], r[1]


def _sparse_rs(rank, groups, size, density, m, dtype, op):
    if rank >= size:
        return None
    g = groups[size]
    x = torch.randn(size * m, generator=torch.Generator().manual_seed(20 + rank)).to(dtype)
    out = torch.empty(m, dtype=dtype)
    zipccl.reduce_scatter(out, x, op=op, group=g, codec=TopK(density))
    rs_wire = zipccl.stats()["last"]["wire_bytes"]
    zipccl.all_reduce(x.clone(), op=op, group=g, codec=TopK(density, algorithm="gather"))
    return out, rs_wire, zipccl.stats()["last"]["wire_bytes"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,density,m,dtype,op", [(2, 0.05, 5_001, torch.bfloat16, dist.ReduceOp.SUM),
                                                     (4, 0.02, 12_345, torch.bfloat16, dist.ReduceOp.AVG),
                                                     (4, 0.3, 999, torch.float32, dist.ReduceOp.SUM),
                                                     (4, 0.01, 7, torch.float32, dist.ReduceOp.AVG)])
def test_sparse_reduce_scatter_equals_dense_sum_of_what_was_sent(pool, size, density, m, dtype, op):
    """Each rank's chunk is the rank-order fp32 sum of what every rank sent of it (each rank's
    top-k, decoded on its own), rounded once; and only each chunk's pairs travel, to its owner:
    a (n-1)-th or less of the bytes of the gather all-reduce of the same selections."""
    res = pool.run(_sparse_rs, size, density, m, dtype, op)[:size]
    assert all(not isinstance(r, BaseException) for r in res), res
    c = TopK(density)
    total = torch.zeros(size * m)
    for q in range(size):
        x = torch.randn(size * m, generator=torch.Generator().manual_seed(20 + q)).to(dtype)
        total += c.decode(c.encode(x)).float()
    if op == dist.ReduceOp.AVG:
        total /= size
    want = total.to(dtype).view(size, m)
    for r, (out, rs_wire, ar_wire) in enumerate(res):
        assert torch.equal(out.view(torch.uint8), want[r].contiguous().view(torch.uint8)), r
        assert rs_wire * (size - 1) <= ar_wire + (size - 1) * size * 64, (rs_wire, ar_wire)  # headers aside


def _algorithms(rank, groups, size, density, numel):
    if rank >= size:
        return None
    out = {}
    for algorithm in ("gather", "scatter"):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(10 + rank)).to(torch.bfloat16)
        zipccl.all_reduce(x, op=dist.ReduceOp.AVG, group=groups[size], codec=TopK(density, algorithm=algorithm))
        out[algorithm] = x.view(torch.int16).clone()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,density,numel", [(2, 0.05, 10_001), (4, 0.01, 50_003), (4, 0.6, 4_001)])
def test_sparse_gather_and_scatter_give_the_same_bits(pool, size, density, numel):
    """The owner-reduces-its-chunk algorithm (dense or sparse second phase) equals the all-gather one,
    bit for bit, on every rank; and both equal the rank-order fp32 sum of what each rank sent."""
    res = pool.run(_algorithms, size, density, numel)[:size]
    assert all(not isinstance(r, BaseException) for r in res), res
    c = TopK(density)
    total = torch.zeros(numel)
    for q in range(size):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(10 + q)).to(torch.bfloat16)
        total += c.decode(c.encode(x)).float()
    want = (total / size).to(torch.bfloat16).view(torch.int16)
    for r in res:
        assert torch.equal(r["gather"], want) and torch.equal(r["scatter"], want)


def test_sparse_algorithm_choice():
    """Gather while few ranks share few pairs; scatter once the all-gather would outgrow it."""
    from zipccl.collectives import sparse_algorithm
    assert sparse_algorithm(2, 0.01, 2) == "gather"
    assert sparse_algorithm(4, 0.01, 4) == "gather"
    assert sparse_algorithm(64, 0.01, 2) == "scatter"
    assert sparse_algorithm(8, 0.3, 4) == "scatter"
    with pytest.raises(ValueError):
        TopK(0.1, algorithm="ring")


@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.sampled_from([0.0, -0.0, 0.5, -0.5, 1.0, -2.0, 3.0, float("inf"), float("nan")]),
                       min_size=1, max_size=300),
       density=st.floats(0.001, 1.0))
def test_selection_equals_the_stable_sort_definition(values, density):
    """The O(n) selection picks exactly what sorting by magnitude would: NaN first (above Inf,
    so that a NaN reaches the sum as an Inf does), ties to the lower index."""
    x = torch.tensor(values)
    c = TopK(density)
    order = torch.tensor(sorted(range(len(values)), key=lambda i: (not math.isnan(values[i]), -abs(values[i]), i))
                         [:c.k(x.numel())])
    idx, picked = c.select(x)
    assert torch.equal(idx, torch.sort(order).values.to(torch.int32))
    assert torch.equal(picked.view(torch.int32), x[idx.long()].view(torch.int32))


def _named(rank, groups, steps):
    import zipccl.lossy
    g = groups[2]
    if rank >= 2:
        return None
    comp = zipccl.lossy.Compressor("topk", density=0.02)
    gen = torch.Generator().manual_seed(rank)
    out = {"errors": []}
    for codec in ("entropy", "bogus"):
        try:
            zipccl.all_reduce(torch.ones(4), group=g, codec=codec)
        except ValueError as e:
            out["errors"].append(str(e))
    residual_ok = True
    for _ in range(steps):
        w, b = torch.randn(64, 128, generator=gen), torch.randn(128, generator=gen)
        old = comp.residuals.store.get("w")
        compensated = w.reshape(-1) + (old.float() if old is not None else 0)
        b_sum = b.clone()
        dist.all_reduce(b_sum, group=g)
        comp.all_reduce(w, "w", group=g)
        comp.all_reduce(b, "b", group=g)
        residual_ok &= bool(torch.equal(b, b_sum / 2))  # 1-D: lossless by the default rules
        # residual = compensated - sent, where sent is the top 2% of the compensated gradient
        _, idx = torch.sort(compensated.abs().neg(), stable=True)
        sent = torch.zeros_like(compensated)
        keep = idx[:TopK(0.02).k(compensated.numel())]
        sent[keep] = compensated[keep]
        residual_ok &= bool(torch.equal(comp.residuals.store["w"], compensated - sent))
        both = [torch.empty_like(sent) for _ in range(2)]
        dist.all_gather(both, sent, group=g)  # the average of what each rank sent, by plain torch
        residual_ok &= bool(torch.equal(w.reshape(-1), (both[0] + both[1]) / 2))
    out.update(w=w, residual_ok=residual_ok, step=comp.step, densities=comp.densities)
    # the module-level path: name= keeps feedback in zipccl.lossy.default("topk")
    x = torch.randn(100, 50, generator=gen)
    zipccl.all_reduce(x, group=g, codec="topk", name="x")
    out["default_residual"] = "x" in zipccl.lossy.default("topk").residuals.store
    return out


@pytest.mark.timeout(120)
def test_named_lossy_all_reduce_keeps_feedback_and_rules(pool):
    res = pool.run(_named, 3)[:2]
    assert all(not isinstance(r, BaseException) for r in res), res
    assert torch.equal(res[0]["w"], res[1]["w"])
    for r in res:
        assert r["residual_ok"] and r["step"] == 2 and r["densities"] == [0.02] * 3 and r["default_residual"]
        assert "name=" in r["errors"][0] and "unknown codec" in r["errors"][1]


def test_a_step_counts_when_its_first_tensor_has_no_gradient():
    """Lossy tensors a then b each step; a, the first to reduce, absent from the second step (a
    frozen layer, a branch not taken): that step still counts, begun by b, so that the density
    policy decides once per step on every rank."""
    import zipccl.lossy
    c = zipccl.lossy.Compressor("topk")
    begun = [c.begin(name) for name in ("a", "b", "b", "a", "b")]
    assert begun == [(0, True), (0, False), (1, True), (2, True), (2, False)]


def test_marked_steps_follow_the_marks_whatever_the_order():
    """Where the caller marks each step's start (zipccl.fsdp: the model's forward), a tensor that
    comes out of its usual place (FSDP2 reduces a module whose inputs need no gradient in its
    final callback, the root first) begins no step, and a step whose usual first tensor is
    absent still counts once; a Compressor pickled before marks and places (its ``anchor``)
    goes on counting."""
    import zipccl.lossy
    c = zipccl.lossy.Compressor("topk")
    begun = []
    for step in (("l2", "l1", "l0", "root"), ("l2", "root", "l1"), ("l1", "root"), ("l2", "l1", "l0", "root")):
        c.mark()
        begun.append([c.begin(name) for name in step])
    assert begun == [[(0, True), (0, False), (0, False), (0, False)], [(1, True), (1, False), (1, False)],
                     [(2, True), (2, False)], [(3, True), (3, False), (3, False), (3, False)]]
    old = zipccl.lossy.Compressor("topk")
    old.step = 4
    state = old.__dict__.copy()
    for key in ("order", "last", "marked"):
        del state[key]
    state["anchor"] = "w"
    restored = zipccl.lossy.Compressor.__new__(zipccl.lossy.Compressor)
    restored.__setstate__(state)
    assert [restored.begin(name) for name in ("w", "b", "w")] == [(5, True), (5, False), (6, True)]


def test_remembered_selection_is_used_once_and_only_for_the_unmodified_tensor():
    c = TopK(0.1)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    first = c.select(x, remember=True)
    assert c.select(x.view(-1)) is first          # a view of the same, unmodified tensor
    assert c.select(x) is not first               # taken: the next call selects again
    c.select(x, remember=True)
    x.mul_(-1)                                    # modified in place: the version counter moved
    idx, values = c.select(x)
    assert torch.equal(values, x[idx.long()])
    assert pickle.loads(pickle.dumps(c)).density == 0.1


def test_sampled_selection_is_deterministic_and_bounded():
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(5))
    c = TopK(0.01, sampled=True)
    idx, values = c.select(x)
    again, _ = TopK(0.01, sampled=True).select(x.clone())
    assert torch.equal(idx, again)
    k = c.k(x.numel())
    assert 0.8 * k <= idx.numel() <= 2 * k
    threshold = values.abs().min()
    assert bool((x.abs() >= threshold).sum() == idx.numel())  # everything at or above its threshold
    assert c.encode(x).numel() <= c.max_encoded_size(x.numel(), x.dtype)
    assert torch.equal(TopK(0.01, sampled=True).select(x[:1000])[0], TopK(0.01).select(x[:1000])[0])  # small: exact


def _bf16_values(rank, groups):
    import zipccl.lossy
    if rank >= 2:
        return None
    g = groups[2]
    comp = zipccl.lossy.Compressor("topk", density=0.05, value_dtype=torch.bfloat16)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(rank))
    compensated = w.reshape(-1).clone()
    call = comp.all_reduce(w, "w", group=g)
    wire = compensated.to(torch.bfloat16)
    idx, values = TopK(0.05).select(wire)
    sent = torch.zeros_like(compensated)
    sent[idx.long()] = values.float()
    both = [torch.empty_like(sent) for _ in range(2)]
    dist.all_gather(both, sent, group=g)  # the average of what each rank sent, by plain torch, in bf16
    average = ((both[0] + both[1]) / 2).to(torch.bfloat16).float()
    return w, bool(torch.equal(comp.residuals.store["w"], compensated - sent)), stats_bytes(), \
        bool(torch.equal(w.reshape(-1), average)), call["raw_bytes"]


def stats_bytes():
    return zipccl.stats()["last"]["wire_bytes"]


@pytest.mark.timeout(120)
def test_bf16_values_shrink_entries_to_six_bytes(pool):
    """fp32 gradients with bf16 values on the wire: 6 bytes per entry, residual keeps the rounding,
    identical result on both ranks (a bf16-rounded average)."""
    res = pool.run(_bf16_values)[:2]
    assert all(not isinstance(r, BaseException) for r in res), res
    assert torch.equal(res[0][0], res[1][0]) and res[0][1] and res[1][1]
    assert res[0][3] and res[1][3], "not the bf16-rounded average of what the ranks sent"
    k = TopK(0.05).k(64 * 128)
    assert res[0][2] == F.HEADER_SIZE + 6 * k  # one packet to the one other rank
    assert res[0][4] == 2 * (2 - 1) * (64 * 128 // 2) * 4  # against the plain fp32 all-reduce's bytes
    assert torch.equal(res[0][0], res[0][0].to(torch.bfloat16).float())


def _where_topk_would_not_pay(rank, groups):
    """Three lossy calls on 2 ranks whose top-k packets would outweigh the plain collective: a
    DDP-like bucket of 4,096 lossy and 16,384 exact elements (every exact element a pair) at
    density 0.01, twice; a tensor at density 0.5, all-reduced and reduce-scattered."""
    import zipccl.lossy
    g, out = groups[2], {}
    gen = torch.Generator().manual_seed(70 + rank)
    comp = zipccl.lossy.Compressor("topk", density=0.01, rules=None)
    for step in range(2):
        bucket = torch.randn(20480, generator=gen).to(torch.bfloat16)
        out[f"bucket{step}"] = bucket.clone()
        comp.reduce(bucket[:4096], "b", step, True, g, exact=(bucket, [(0, 4096)], [(4096, 20480)]))
        out[f"bucket{step} reduced"], out[f"bucket{step} stats"] = bucket, dict(zipccl.stats()["last"])
        out[f"bucket{step} residual"] = comp.residuals.store["b"].clone()
    half = zipccl.lossy.Compressor(TopK(0.5), rules=None)
    x = torch.randn(30, 100, generator=gen).to(torch.bfloat16)
    out["x"], y = x.clone(), x.clone()
    half.all_reduce(y, "x", op=dist.ReduceOp.SUM, group=g)
    out["x reduced"], out["x stats"] = y, dict(zipccl.stats()["last"])
    rs = torch.empty(1500, dtype=torch.bfloat16)
    half.reduce_scatter(x.view(-1).clone(), rs, "xs", 0, True, g, op=dist.ReduceOp.SUM)
    out["xs reduced"], out["xs stats"] = rs, dict(zipccl.stats()["last"])
    z = torch.randn(3000, generator=gen).to(torch.bfloat16)  # with a residual of earlier steps going in
    half.residuals.store["z"] = out["z residual before"] = torch.randn(3000, generator=gen) * 1e-2
    out["z"] = z.clone()
    half.all_reduce(z, "z", op=dist.ReduceOp.SUM, group=g)
    out["z reduced"], out["z residual"] = z, half.residuals.store["z"].clone()
    # sampled at 0.45 (up to 0.9 sent): 30% large, 50% tied at the threshold, 20% small, fp32
    n, big, tied = 300_000, 90_000, 150_000
    t = torch.cat([3 + torch.rand(big, generator=gen), torch.ones(tied), torch.rand(n - big - tied, generator=gen) / 10])
    t = t[torch.randperm(n, generator=torch.Generator().manual_seed(5))]
    out["t"], u = t.clone(), t.clone()
    zipccl.lossy.Compressor("topk", density=0.45, rules=None, sampled=True).all_reduce(u, "t", op=dist.ReduceOp.SUM,
                                                                                        group=g)
    out["t reduced"], out["t stats"] = u, dict(zipccl.stats()["last"])
    return out


@pytest.mark.timeout(120)
def test_a_lossy_call_that_top_k_would_make_larger_goes_dense(pool):
    """Top-k never moves more than the plain collective: where its pairs would (a bucket mostly
    of exact ranges, a density of 0.5 in bf16), the call goes whole and lossless, as if every
    entry were selected: the exact sum (plain torch's, fp32 of two bf16 rounded once), no more
    wire bytes than the dense call's (a sampled selection counted at its most, twice its
    density), and a residual of zeros, or with a residual going in, of
    what rounding gradient and residual to bf16 left."""
    res = pool.run(_where_topk_would_not_pay)[:2]
    assert all(not isinstance(r, BaseException) for r in res), res
    for step in range(2):
        want = ((res[0][f"bucket{step}"].float() + res[1][f"bucket{step}"].float()) / 2).to(torch.bfloat16)
        for r in res:
            assert torch.equal(r[f"bucket{step} reduced"], want), step
            stats = r[f"bucket{step} stats"]
            assert 0 < stats["wire_bytes"] <= stats["raw_bytes"], stats
            assert not r[f"bucket{step} residual"].any()
    want = (res[0]["x"].float() + res[1]["x"].float()).to(torch.bfloat16)
    for rank, r in enumerate(res):
        assert torch.equal(r["x reduced"], want)
        assert torch.equal(r["xs reduced"], want.view(-1)[1500 * rank:1500 * (rank + 1)])
        for name in ("x stats", "xs stats", "t stats"):
            assert 0 < r[name]["wire_bytes"] <= r[name]["raw_bytes"], (name, r[name])
        assert torch.equal(r["t reduced"], res[0]["t"] + res[1]["t"])  # whole, lossless: exact in fp32
    # every entry of gradient + residual sent, rounded to bf16; the residual keeps that rounding
    compensated = [r["z"].float() + r["z residual before"] for r in res]
    sent = [c.to(torch.bfloat16) for c in compensated]
    for rank, r in enumerate(res):
        assert torch.equal(r["z reduced"], (sent[0].float() + sent[1].float()).to(torch.bfloat16))
        assert torch.equal(r["z residual"], compensated[rank] - sent[rank].float())
        assert r["z residual"].any()


def _fp16_beyond_its_range(rank, groups):
    """fp16 top-k (k = 1 of 10) whose gradient plus residual passes fp16's largest finite value:
    rank 0's 60,000 waits in the residual behind 65,000, then comes back with 10,000 more."""
    import zipccl.lossy
    comp, out = zipccl.lossy.Compressor("topk", density=0.1, rules=None), []
    for first in (True, False):
        g = torch.zeros(10, dtype=torch.float16)
        if rank == 0:
            g[0], g[1] = (60000, 65000) if first else (10000, 0)
        comp.all_reduce(g, "w", op=dist.ReduceOp.SUM, group=groups[2])
        out.append((g.tolist(), comp.residuals.store["w"].tolist()))
    return out


def test_fp16_error_feedback_sends_what_fp16_carries_and_keeps_the_rest(pool):
    """The second step's 70,000 is sent as 65,504 (not Inf, which would make a GradScaler skip a
    step the plain collective would not, and drop the carried mass), 4,496 kept for later."""
    res = pool.run(_fp16_beyond_its_range, timeout=120)[:2]
    assert all(not isinstance(r, BaseException) for r in res), res
    (step1, residual1), (step2, residual2) = res[0]
    assert step1[1] == 64992.0 and residual1[0] == 60000.0, res[0]  # 65,000 rounded to fp16
    assert step2[0] == 65504.0 and residual2[0] == 4496.0, res[0]
    assert [s for s, _ in res[1]] == [step1, step2], res


def _empty_tensors(rank, groups):
    """An empty gradient through each lossy codec and dtype (rules=None: nothing keeps it exact)."""
    import zipccl.lossy
    from zipccl.entropy import EntropyRate
    done = []
    for codec in ("topk", "entropy"):
        comp = zipccl.lossy.Compressor(codec, rules=None, rate=EntropyRate(warmup=0) if codec == "entropy" else None)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.zeros(0, dtype=dtype)
            comp.all_reduce(x, f"e{dtype}", group=groups[2])
            done.append((codec, str(dtype), x.numel()))
    return done


def test_an_empty_gradient_goes_through_every_lossy_codec(pool):
    res = pool.run(_empty_tensors, timeout=120)[:2]
    assert all(not isinstance(r, BaseException) for r in res), res
    assert res[0] == res[1] and len(res[0]) == 6 and all(n == 0 for _, _, n in res[0]), res


def test_packets_parsed_together_are_each_checked():
    """parse_many raises for a bad packet wherever it stands, as parse of that packet would, and
    otherwise gives each packet's own pairs."""
    c = TopK(0.5)
    xs = [torch.arange(8, dtype=torch.float32) * s for s in (1, -2, 3)]
    good = [c.encode(x) for x in xs]
    for (h, idx, values), x in zip(c.parse_many(good, 8), xs):
        assert h.numel == 8 and idx.tolist() == [4, 5, 6, 7] and torch.equal(values, x[4:])
    assert c.parse_many([]) == []
    for bad, match in ((_rewrite(good[1], idx=[4, 5, 6, 8]), "range"), (_rewrite(good[1], idx=[4, 5, 5, 7]), "ascending"),
                       (good[1][:10].clone(), "shorter"), (zipccl.codecs.Raw().encode(xs[1]), "codec")):
        with pytest.raises(zipccl.FormatError, match=match):
            c.parse_many([good[0], bad, good[2]])
    with pytest.raises(zipccl.FormatError, match="claims"):
        c.parse_many(good, max_numel=7)


def test_sample_positions_are_drawn_once_per_size_and_device():
    """The sampled threshold's positions: the seeded draw of the size, the same tensor for every
    call of that size and device (drawn and placed once, not uploaded for each selection)."""
    c = TopK(0.01, sampled=True)
    n = 5 * 65536
    pos = c.sample_positions(n)
    assert torch.equal(pos, torch.randint(0, n, (65536,), generator=torch.Generator().manual_seed(n)))
    assert c.sample_positions(n, torch.device("cpu")) is pos and TopK(0.5, sampled=True).sample_positions(n) is pos
    assert c.sample_positions(n + 1) is not pos and TopK(0.01).sample_positions(n) is None
