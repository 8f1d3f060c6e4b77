"""The drop-in backend (zipccl.backend): dist.* calls on backend="zipccl" against independent
references: plain torch on the inputs gathered over a separate gloo group, and gloo's own
result on that group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from workers import Pool, Restarting

R = dist.ReduceOp
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = ("SUM", "AVG", "MAX", "MIN", "PREMUL_SUM")


def zipccl_groups(nranks: int) -> dict:
    """Groups of every world made on every rank of the zipccl pool: one per codec policy, and
    plain gloo over the same ranks (the reference's)."""
    from zipccl.backend import Options
    ranks = list(range(nranks))
    out = {c: dist.new_group(ranks, backend="zipccl", pg_options=Options(codec=c))
           for c in ("raw", "lossless", "native")}
    out["topk"] = dist.new_group(ranks, backend="zipccl", pg_options=Options(lossy="topk", lossy_min_numel=50_000))
    out["entropy"] = dist.new_group(ranks, backend="zipccl",
                                    pg_options=Options(lossy="entropy", lossy_min_numel=10_000))
    for algorithm in ("flat", "hierarchical"):
        out[algorithm] = dist.new_group(ranks, backend="zipccl",
                                        pg_options=Options(codec="lossless", algorithm=algorithm))
    out["gloo"] = dist.new_group(ranks, backend="gloo")
    for k in (2, 3):  # smaller worlds: ranks 0..k-1
        out[f"lossless{k}"] = dist.new_group(ranks[:k], backend="zipccl", pg_options=Options(codec="lossless"))
        out[f"gloo{k}"] = dist.new_group(ranks[:k], backend="gloo")
    return out


@pytest.fixture(scope="module")
def zpool():
    """The file's pool of 4 ranks on the drop-in, started again after a test ended it."""
    pools = Restarting(lambda: Pool(4, backend="zipccl", more_groups=zipccl_groups))
    yield pools
    pools.close()


def _op(name: str, factor: float = 0.375):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(R, name)


def _data(rank: int, n: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.randn(n, generator=g) * (rank + 1)).to(dtype)


def _gathered(x: torch.Tensor, gloo) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(gloo))]
    dist.all_gather(parts, x.contiguous(), group=gloo)
    return parts


def _reference(parts: list[torch.Tensor], op: str, factor: float = 0.375) -> torch.Tensor:
    """zipccl's documented reduction, in plain torch: rank order, fp32 accumulation, rounded
    once; PREMUL_SUM multiplies each input in its dtype first; AVG divides the fp32 sum."""
    if op in ("MAX", "MIN"):
        out = parts[0]
        for p in parts[1:]:
            out = torch.maximum(out, p) if op == "MAX" else torch.minimum(out, p)
        return out
    if op == "PREMUL_SUM":
        parts = [p * factor for p in parts]
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    if op == "AVG":
        acc = acc / len(parts)
    return acc.to(parts[0].dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.element_size() == 2 else x.view(torch.int32)


def _every_override(rank, groups, codec, n, world=""):
    """Every override, dtype and op on the ``codec`` group; the mismatches with the reference."""
    import zipccl
    g, gloo = groups[codec + world], groups["gloo" + world]
    if g == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    size = dist.get_world_size(g)
    bad, seed = [], 0
    zipccl.reset_stats()
    for dtype in DTYPES:
        for op in OPS:
            seed += 1
            x = _data(rank, n, dtype, seed)
            parts = _gathered(x, gloo)
            want = _reference(parts, op)
            # all_reduce, in place
            y = x.clone()
            dist.all_reduce(y, op=_op(op), group=g)
            if not torch.equal(_bits(y), _bits(want)):
                bad.append(("all_reduce", dtype, op))
            # all_reduce_coalesced: two tensors, one call
            a, b = x[: n // 3].clone(), x[n // 3:].clone()
            dist.all_reduce_coalesced([a, b], op=_op(op), group=g)
            if not torch.equal(_bits(torch.cat([a, b])), _bits(want)):
                bad.append(("all_reduce_coalesced", dtype, op))
            # reduce_scatter_tensor: chunk `rank` of the reduction
            m = n // size
            out = torch.empty(m, dtype=dtype)
            dist.reduce_scatter_tensor(out, x[: m * size].clone(), op=_op(op), group=g)
            if not torch.equal(_bits(out), _bits(want[rank * m:(rank + 1) * m])):
                bad.append(("reduce_scatter_tensor", dtype, op))
            # reduce_scatter, list form
            out2 = torch.empty(m, dtype=dtype)
            dist.reduce_scatter(out2, list(x[: m * size].clone().view(size, m).unbind()), op=_op(op), group=g)
            if not torch.equal(_bits(out2), _bits(want[rank * m:(rank + 1) * m])):
                bad.append(("reduce_scatter", dtype, op))
        x = _data(rank, n, dtype, 99)
        parts = _gathered(x, gloo)
        out = torch.empty(n * size, dtype=dtype)
        dist.all_gather_into_tensor(out, x, group=g)
        if not torch.equal(_bits(out), _bits(torch.cat(parts))):
            bad.append(("all_gather_into_tensor", dtype))
        lst = [torch.empty(n, dtype=dtype) for _ in range(size)]
        dist.all_gather(lst, x, group=g)
        if not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(lst, parts)):
            bad.append(("all_gather", dtype))
    return bad, {k: v["calls"] for k, v in zipccl.stats().items() if k not in ("total", "last")}


@pytest.mark.parametrize("codec,world", [("raw", ""), ("lossless", ""), ("lossless", "3"), ("lossless", "2")])
def test_every_override_matches_plain_torch(zpool, codec, world):
    out = zpool().run(_every_override, codec, 3000, world, timeout=300)
    for rank, value in enumerate(out):
        assert not isinstance(value, BaseException), f"rank {rank}: {value!r}"
        if world and rank >= int(world):
            assert value is None
            continue
        bad, calls = value
        assert bad == [], f"rank {rank}: results differ from plain torch in {bad}"
        # each compressed call reached zipccl (the all-reduce counts include nothing else)
        assert calls["all_reduce"] == 2 * len(DTYPES) * len(OPS), calls
        assert calls["reduce_scatter"] == 2 * len(DTYPES) * len(OPS), calls
        assert calls["all_gather"] == 2 * len(DTYPES), calls


def _like_gloo(rank, groups, codec):
    """auto (small calls: the backend's collective) and native: gloo's own bits."""
    g, gloo, size = groups[codec], groups["gloo"], dist.get_world_size()
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        for op in ("SUM", "MAX", "MIN"):
            x = _data(rank, 5000, dtype, 7)
            y, z = x.clone(), x.clone()
            dist.all_reduce(y, op=_op(op), group=g)
            dist.all_reduce(z, op=_op(op), group=gloo)
            if not torch.equal(_bits(y), _bits(z)):
                bad.append(("all_reduce", dtype, op))
            out, ref = torch.empty(5000 // size * size // size, dtype=dtype), None
            ref = torch.empty_like(out)
            dist.reduce_scatter_tensor(out, x[: out.numel() * size], op=_op(op), group=g)
            dist.reduce_scatter_tensor(ref, x[: out.numel() * size], op=_op(op), group=gloo)
            if not torch.equal(_bits(out), _bits(ref)):
                bad.append(("reduce_scatter_tensor", dtype, op))
            chunks = list(x[: out.numel() * size].chunk(size))  # the list form, which gloo sums in its own order
            dist.reduce_scatter(ref, chunks, op=_op(op), group=gloo)
            for queued in (False, True):  # True: behind a coded async call on another group, in zipccl's queue
                busy = dist.all_reduce(torch.ones(1 << 18), group=groups["lossless"], async_op=True) if queued else None
                dist.reduce_scatter(out, chunks, op=_op(op), group=g)
                if busy is not None:
                    busy.wait()
                if not torch.equal(_bits(out), _bits(ref)):
                    bad.append(("reduce_scatter", dtype, op, queued))
    return bad


def _lanes(rank, groups):
    """zipccl's transport on the drop-in's groups: what it would be on a gloo group over the
    same ranks (the drop-in hands their CPU messages to gloo)."""
    from zipccl.transport.torch_dist import TorchTransport
    out = {}
    for name in ("lossless", "lossless3", "gloo", "gloo3"):
        g = groups[name]
        if rank >= dist.get_world_size(g) and name.endswith("3"):
            continue
        dist.all_reduce(torch.ones(70_000), group=g)  # a call through the pipeline where zipccl takes it
        t = TorchTransport.of(g)
        out[name] = (t._upward is not None, t.strict is not None, t.loose_receives, t.tags)
    return out


def test_drop_in_groups_travel_as_gloo_groups(zpool):
    """A second lane (the payloads to higher ranks on their own gloo connections) where the group
    spans the job, and gloo's receive rules (strict mode, on in the tests, checks them): the
    drop-in's lossless DDP steps were 10-12% slower than zipccl's hook without them."""
    for rank, value in enumerate(zpool().run(_lanes, timeout=120)):
        assert value["lossless"] == value["gloo"] == (True, True, False, False), (rank, value)
        if rank < 3:
            assert value["lossless3"] == value["gloo3"] == (False, True, False, False), (rank, value)


@pytest.mark.parametrize("codec", [4, "native"])  # 4: the zipccl world, ZIPCCL_CODEC unset ("auto")
def test_auto_and_native_give_gloos_bits(zpool, codec):
    out = zpool().run(_like_gloo, codec, timeout=120)
    for rank, value in enumerate(out):
        assert value == [], f"rank {rank}: {value!r}"


def _passthrough(rank, groups):
    """Calls zipccl does not compress, on the zipccl world and on gloo: the same results."""
    size, gloo = dist.get_world_size(), groups["gloo"]
    results = {}
    for label, g in (("zipccl", None), ("gloo", gloo)):
        r = {}
        x = torch.arange(12, dtype=torch.int64) * (rank + 1)
        dist.all_reduce(x, group=g)
        r["int_sum"] = x.tolist()
        x = torch.full((5,), 1.0 + rank)
        dist.all_reduce(x, op=R.PRODUCT, group=g)
        r["product"] = x.tolist()
        x = torch.tensor([0b1100 | rank], dtype=torch.int32)
        dist.all_reduce(x, op=R.BOR, group=g)
        r["bor"] = x.tolist()
        x = torch.tensor([1 + 1j * rank], dtype=torch.complex64)
        dist.all_reduce(x, group=g)
        r["complex"] = [x.real.item(), x.imag.item()]
        x = torch.tensor([rank * 10.0])
        dist.broadcast(x, src=1, group=g)
        r["broadcast"] = x.item()
        outs = [torch.empty(2, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(outs, torch.tensor([rank, -rank]), group=g)
        r["all_gather_int"] = [o.tolist() for o in outs]
        a2a = torch.empty(size, dtype=torch.int64)
        dist.all_to_all_single(a2a, torch.arange(size) + 100 * rank, group=g)
        r["all_to_all"] = a2a.tolist()
        x = torch.tensor([float(rank)])
        dist.reduce(x, dst=0, group=g)
        r["reduce"] = x.item() if rank == 0 else None
        gathered = [torch.empty(1) for _ in range(size)] if rank == 0 else None
        dist.gather(torch.tensor([rank + 0.5]), gathered, dst=0, group=g)
        r["gather"] = [t.item() for t in gathered] if rank == 0 else None
        sc = torch.empty(1)
        dist.scatter(sc, [torch.tensor([j * 2.0]) for j in range(size)] if rank == 0 else None, src=0, group=g)
        r["scatter"] = sc.item()
        if rank < 2:
            t = torch.tensor([rank + 7.0])
            (dist.send(t, dst=1, group=g) if rank == 0 else dist.recv(t, src=0, group=g))
            r["p2p"] = t.item()
        objs = [None] * size
        dist.all_gather_object(objs, {"rank": rank}, group=g)
        r["objects"] = objs
        dist.barrier(group=g)
        pg = g if g is not None else dist.group.WORLD
        one, two = torch.full((3,), rank + 1.0), torch.full((3,), 10.0 * rank)
        pg.allreduce(one).wait()  # direct calls on the group object
        pg.allreduce([two], dist.AllreduceOptions()).wait()
        r["direct"] = one.tolist() + two.tolist()
        pg.barrier(opts=dist.BarrierOptions()).wait()
        results[label] = r
    return results["zipccl"], results["gloo"], dist.get_backend(), dist.group.WORLD.getBackendName()


def test_other_calls_pass_through_unchanged(zpool):
    out = zpool().run(_passthrough, timeout=120)
    for rank, value in enumerate(out):
        assert not isinstance(value, BaseException), f"rank {rank}: {value!r}"
        z, g, backend, name = value
        assert z == g, f"rank {rank}"
        assert backend == "zipccl" and name == "zipccl"
    assert out[0][0]["int_sum"] == [10 * i for i in range(12)]  # 1+2+3+4 times each element


def _futures(rank, groups):
    """Async all-reduces on a lossless group: the Work's future done, its value readable, once
    ``wait()`` returns (200 calls: torch sets a ``then`` future after waking the waiters); then
    torch's PowerSGD pattern, a future's callback that issues an async call and waits for it
    (the callback runs on zipccl's async thread, behind which that call would be queued)."""
    g = groups["lossless"]
    x = _data(rank, 3000, torch.float32, 7)
    want = _reference(_gathered(x, groups["gloo"]), "SUM")
    unready = 0
    for _ in range(200):
        y = x.clone()
        work = dist.all_reduce(y, group=g, async_op=True)
        work.wait()
        unready += not (work.is_completed() and work.get_future().done())
        work.get_future().value()
    inner = x.clone()

    def then(future):
        return dist.all_reduce(inner, group=g, async_op=True).get_future().wait()[0]
    outer = x.clone()
    got = dist.all_reduce(outer, group=g, async_op=True).get_future().then(then).wait()
    return unready, torch.equal(y, want), torch.equal(outer, want), torch.equal(got, want) and got is inner


def test_a_works_future_is_done_when_it_returns_and_its_callbacks_may_issue_calls(zpool):
    assert zpool().run(_futures, timeout=120) == [(0, True, True, True)] * 4


def _gather_future(rank, groups):
    """all_gather_into_tensor's async future value on gloo and on the zipccl groups: each
    tensor's shape and where it starts in the output (bytes)."""
    out = {}
    for name in ("gloo", "raw", "lossless"):
        output, x = torch.zeros(3 * dist.get_world_size(), 2), torch.full((3, 2), float(rank))
        work = dist.all_gather_into_tensor(output, x, group=groups[name], async_op=True)
        work.wait()
        out[name] = [(tuple(t.shape), t.data_ptr() - output.data_ptr()) for t in work.get_future().value()]
    return out


def test_all_gather_into_tensors_future_holds_what_gloos_does(zpool):
    """gloo's future holds the output's chunk per rank (not the whole output): so do zipccl's."""
    for rank, value in enumerate(zpool().run(_gather_future, timeout=60)):
        assert not isinstance(value, BaseException), f"rank {rank}: {value!r}"
        assert value["gloo"] == [((3, 2), 24 * r) for r in range(4)], value
        assert value["raw"] == value["lossless"] == value["gloo"], value


def _async(rank, groups):
    import zipccl
    g = groups["lossless"]
    xs = [_data(rank, 4000 + 17 * i, torch.bfloat16, i) for i in range(4)]
    wants = [_reference(_gathered(x, groups["gloo"]), "SUM") for x in xs]
    zipccl.reset_stats()
    works = [dist.all_reduce(x, group=g, async_op=True) for x in xs]
    sync = _data(rank, 999, torch.float32, 50)  # a sync call after them runs after them
    want_sync = _reference(_gathered(sync, groups["gloo"]), "SUM")
    dist.all_reduce(sync, group=g)
    done = [w.is_completed() for w in works]
    futures_ok = all(w.get_future().value()[0] is x for w, x in zip(works, xs))
    for w in works:
        w.wait()
    same = [torch.equal(_bits(x), _bits(w)) for x, w in zip(xs, wants)]
    return done, futures_ok, same, torch.equal(sync, want_sync), zipccl.stats()["all_reduce"]["calls"]


def test_async_work_is_torchs(zpool):
    for rank, value in enumerate(zpool().run(_async, timeout=120)):
        assert not isinstance(value, BaseException), f"rank {rank}: {value!r}"
        done, futures_ok, same, sync_ok, calls = value
        assert done == [True] * 4, "a sync call must run after the async calls issued before it"
        assert futures_ok and same == [True] * 4 and sync_ok
        assert calls == 5


def _mismatch(rank, groups, what, async_op):
    """Rank 2 differs from the others in ``what``; each rank's (error type, message, whether the
    call itself raised rather than its Work's wait)."""
    n, dtype, op = 1000, torch.bfloat16, R.SUM
    if rank == 2:
        n, dtype, op = {"numel": (1008, dtype, op), "dtype": (n, torch.float32, op), "op": (n, dtype, R.MAX)}[what]
    x = torch.ones(n, dtype=dtype)
    work, at_call = None, True
    try:
        work = dist.all_reduce(x, op=op, group=groups["lossless"], async_op=async_op)
        at_call = False
        if work is not None:
            work.wait()
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return type(e).__name__, str(e), at_call
    return None


def _groups_made_while_a_call_is_queued(rank, groups, codec):
    """An async all-reduce as the first call of a new drop-in group, then the caller's own
    new_group while it may still be queued (rank 1 a second late): the caller's group is the same
    group on every rank (its name, and a sum over it), and the call's result is gloo's. "topk":
    zipccl's lossy all-reduce instead, on a new gloo group (its result is top-k's, not checked)."""
    import time

    import zipccl
    from zipccl.backend import Options
    x = torch.full((70_000,), float(rank + 1), dtype=torch.bfloat16)
    if codec == "topk":  # zipccl's lossy all-reduce with error feedback, on a new gloo group
        g = dist.new_group(backend="gloo")
        x = x.float()
        work = zipccl.all_reduce(x, group=g, codec="topk", name="w", async_op=True)
    else:
        g = dist.new_group(backend="zipccl", pg_options=Options(codec=codec))
        work = dist.all_reduce(x, group=g, async_op=True)
    if rank == 1:
        time.sleep(1.0)
    mine = dist.new_group(backend="gloo")
    y = torch.full((8,), float(rank + 1))
    dist.all_reduce(y, group=mine)
    work.wait()
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, mine.group_name, group=groups["gloo"])
    ok = len(set(names)) == 1 and bool((y == 10).all()) and (codec == "topk" or bool((x == 10).all()))
    dist.destroy_process_group(mine)
    dist.destroy_process_group(g)
    return ok


@pytest.mark.parametrize("codec", ["raw", "auto", "topk"])
def test_groups_zipccl_makes_are_made_on_the_callers_thread(zpool, codec):
    """A group made on zipccl's async thread (its transport's second gloo group, the topology's
    levels) would race the caller's own new_group: crossed names, then a hang."""
    assert zpool().run(_groups_made_while_a_call_is_queued, codec, timeout=60) == [True] * 4


@pytest.mark.parametrize("what", ["numel", "dtype", "op"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_mismatches_raise_on_every_rank(zpool, what, async_op):
    """A call whose ranks disagree on size, dtype or op: MismatchError on every rank, naming the
    field and each rank's value by its name (the sizes themselves; dtype and op as torch names
    them); an async call raises it from Work.wait(), not from the call."""
    import re
    out = zpool().run(_mismatch, what, async_op, timeout=120)
    for rank, value in enumerate(out):
        assert value is not None, f"rank {rank} did not raise"
        name, message, at_call = value
        assert name == "MismatchError" and at_call != async_op, value
        m = re.fullmatch(rf"zipccl\.all_reduce: ranks disagree on {what} \(ranks \[0, 1, 3\]: (\w+); ranks \[2\]: (\w+)\)",
                         message)
        assert m and m.groups() == {"numel": ("1000", "1008"), "dtype": ("bfloat16", "float32"),
                                    "op": ("SUM", "MAX")}[what], value
    # and the group still works afterwards
    for rank, value in enumerate(zpool().run(_like_gloo, "native", timeout=120)):
        assert value == [], f"rank {rank}: {value!r}"


def _native_behind_a_receive(rank, groups):
    """A new drop-in group (codec "auto", its nodes not found yet: ZIPCCL_TOPOLOGY=2x2): rank 0
    has a framed receive from rank 2 queued (lossless, across the nodes) when every rank makes
    small async calls that auto leaves to the backend (all-reduce, reduce-scatter, all-to-all). Rank 0 runs them behind its receive, its
    peers at once: none of them makes groups or finds nodes for them (an all-gather there would
    meet its peers' collectives), and the sums are gloo's."""
    import time

    import zipccl
    old, zipccl.config.TOPOLOGY = zipccl.config.TOPOLOGY, "2x2"
    zipccl.topology.forget()
    g = dist.new_group(backend="zipccl")
    try:
        big = torch.full((1 << 18,), float(rank + 1))  # 1 MiB: framed across the nodes
        message = dist.irecv(big, src=2, group=g) if rank == 0 else None
        if rank == 2:
            time.sleep(1.0)  # rank 0's receive is still queued when it makes its calls
            message = dist.isend(big, dst=0, group=g)
        small, scattered, exchanged = torch.full((8,), float(rank + 1)), torch.empty(2), torch.empty(4)
        works = [dist.all_reduce(small, group=g, async_op=True),
                 dist.reduce_scatter_tensor(scattered, torch.full((8,), float(rank + 1)), group=g, async_op=True),
                 dist.all_to_all_single(exchanged, torch.full((4,), float(rank + 1)), group=g, async_op=True)]
        for w in works + [message] * (message is not None):
            w.wait()
        return (bool((small == 10).all()) and bool((scattered == 10).all()) and exchanged.tolist() == [1, 2, 3, 4]
                and (rank != 0 or bool((big == 3).all())))
    finally:
        dist.destroy_process_group(g)
        zipccl.config.TOPOLOGY = old
        zipccl.topology.forget()


def test_a_native_call_behind_a_queued_receive_makes_no_groups(zpool):
    assert zpool().run(_native_behind_a_receive, timeout=120) == [True] * 4


def _old_names(rank, groups):
    """torch before 2.13 calls the drop-in's all-gather and reduce-scatter of one tensor by their
    old names, _allgather_base and _reduce_scatter_base: zipccl's, counted, with gloo's bits."""
    import zipccl
    g, gloo = groups["lossless"], groups["gloo"]
    x = _data(rank, 3000, torch.bfloat16, 8)
    got, want = torch.empty(4 * 3000, dtype=torch.bfloat16), torch.empty(4 * 3000, dtype=torch.bfloat16)
    before = zipccl.stats().get("all_gather", {}).get("calls", 0)
    g._allgather_base(got, x).wait()
    dist.all_gather_into_tensor(want, x, group=gloo)
    ok = torch.equal(_bits(got), _bits(want)) and zipccl.stats()["all_gather"]["calls"] == before + 1
    src = _data(rank, 4 * 3000, torch.float32, 9)
    out, ref = torch.empty(3000), torch.empty(3000)
    before = zipccl.stats().get("reduce_scatter", {}).get("calls", 0)
    g._reduce_scatter_base(out, src).wait()
    dist.reduce_scatter_tensor(ref, src, group=gloo)
    return ok and torch.allclose(out, ref, rtol=1e-6, atol=1e-6) and \
        zipccl.stats()["reduce_scatter"]["calls"] == before + 1


def test_the_old_names_of_the_single_tensor_collectives_are_zipccls(zpool):
    assert zpool().run(_old_names, timeout=120) == [True] * 4


def _pass_through_behind_queued(rank, groups):
    """Two async all-reduces of the drop-in (codec "auto": run on zipccl's thread, by the backend
    underneath), then a broadcast, which zipccl passes through, while rank 1 comes late: the
    backend meets the calls in the order issued on every rank."""
    import time
    a, b = torch.full((1 << 20,), float(rank + 1)), torch.full((3,), float(rank + 1))
    works = [dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)]
    if rank == 1:
        time.sleep(1.0)
    c = torch.tensor([7.0, 8.0, 9.0]) if rank == 0 else torch.zeros(3)
    dist.broadcast(c, src=0)
    for w in works:
        w.wait()
    return c.tolist() == [7.0, 8.0, 9.0] and bool((a == 10).all()) and bool((b == 10).all())


def test_a_passed_through_call_follows_the_queued_ones(zpool):
    assert zpool().run(_pass_through_behind_queued, timeout=120) == [True] * 4


def _callback_issues_a_call(rank, groups):
    """An async all-reduce of the drop-in (lossless, queued behind a held call), a callback chained
    on its future that all-reduces a tensor of its own (rank 0's callback 0.5 s late), and, once
    ``wait()`` returns, a blocking all-reduce of another size on the caller's thread: torch wakes
    the waiter before it runs the callbacks, so the caller's call must still come after the
    callback's, on every rank, or the two meet crosswise (a mismatch, or a hang)."""
    import time

    import zipccl
    g = groups["lossless"]
    old, zipccl.config.TIMEOUT = zipccl.config.TIMEOUT, 20.0
    try:
        held = zipccl.executor.submit(lambda: time.sleep(0.3))

        def callback(_):
            if rank == 0:
                time.sleep(0.5)
            a = torch.full((8,), rank + 1.0)
            dist.all_reduce(a, group=g)
            return a
        w = dist.all_reduce(torch.ones(1 << 16), group=g, async_op=True)
        f = w.get_future().then(callback)
        w.wait()
        b = torch.full((16,), 10.0 * (rank + 1))
        dist.all_reduce(b, group=g)
        held.wait()
        return bool((f.wait() == 10).all()) and bool((b == 100).all())
    finally:
        zipccl.config.TIMEOUT = old


def test_a_call_after_wait_comes_after_the_calls_of_the_futures_callbacks(zpool):
    assert zpool().run(_callback_issues_a_call, timeout=120) == [True] * 4


def _callback_then_a_passed_through_call(rank, groups):
    """As ``_callback_issues_a_call``, but the callback's all-reduce and the call after ``wait()``
    are of int64 tensors, which the drop-in passes to the backend underneath, and the callback
    averages the call's own tensor in place: as on gloo, ``wait()`` returns once the callbacks
    have run, so the caller reads the averaged tensor and its broadcast comes after the callback's
    all-reduce on every rank (else: the two meet crosswise, gloo's timeout)."""
    import time

    import zipccl
    g = groups["lossless"]
    old, zipccl.config.TIMEOUT = zipccl.config.TIMEOUT, 20.0
    try:
        held = zipccl.executor.submit(lambda: time.sleep(0.3))
        x = torch.full((1 << 16,), rank + 1.0)

        def callback(future):
            if rank == 0:
                time.sleep(0.5)
            a = torch.full((8,), rank + 1, dtype=torch.int64)
            dist.all_reduce(a, group=g)
            future.value()[0].div_(4)
            return a
        w = dist.all_reduce(x, group=g, async_op=True)
        f = w.get_future().then(callback)
        w.wait()
        averaged = bool((x == 2.5).all())  # (1 + 2 + 3 + 4) / 4: the callback has run
        b = torch.full((16,), 10 * (rank + 1), dtype=torch.int64)
        if rank == 1:
            time.sleep(0.5)
        dist.broadcast(b, src=0, group=g)
        held.wait()
        return averaged, bool((f.wait() == 10).all()), bool((b == 10).all())
    finally:
        zipccl.config.TIMEOUT = old


def test_wait_returns_once_the_futures_callbacks_have_run_as_on_gloo(zpool):
    assert zpool().run(_callback_then_a_passed_through_call, timeout=120) == [(True, True, True)] * 4


def _slow_peer(rank, groups, seconds):
    """Rank 1 enters the call ``seconds`` late: the others' Work.wait(timeout) runs out first,
    then their wait() returns with the result."""
    import datetime
    import time
    from zipccl.errors import TimeoutError as ZipcclTimeout
    x = _data(rank, 20_000, torch.bfloat16, 3)
    want = _reference(_gathered(x, groups["gloo"]), "SUM")
    if rank == 1:
        time.sleep(seconds)
        dist.all_reduce(x, group=groups["lossless"])
        return torch.equal(_bits(x), _bits(want))
    work = dist.all_reduce(x, group=groups["lossless"], async_op=True)
    t0 = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=0.2))
        timed_out = None
    except RuntimeError as e:  # as torch's backends raise there
        assert isinstance(e, ZipcclTimeout), e
        timed_out = time.monotonic() - t0, work.is_completed(), str(e)
    done = work.wait()
    return timed_out, done, torch.equal(_bits(x), _bits(want))


def test_work_wait_timeout_on_a_slow_call(zpool):
    out = zpool().run(_slow_peer, 3.0, timeout=120)
    assert out[1] is True, out[1]
    for rank in (0, 2, 3):
        assert not isinstance(out[rank], BaseException), f"rank {rank}: {out[rank]!r}"
        timed_out, done, same = out[rank]
        assert timed_out is not None, f"rank {rank}: wait(0.2 s) returned while rank 1 slept 3 s"
        waited, completed, _ = timed_out
        assert waited < 2.5 and not completed, (rank, timed_out)
        assert done is True and same, (rank, out[rank])


def _lossy(rank, groups, lossy, n, steps):
    """The backend's lossy all-reduces (``Options(lossy=...)``) and zipccl.lossy's Compressor on
    the plain gloo group, step by step on the same inputs: per step, whether the bits are equal,
    the result's nonzeros, and whether the small tensor kept gloo's exact result."""
    import zipccl
    import zipccl.backend
    from zipccl.lossy import Compressor
    g, gloo = groups[lossy], groups["gloo"]
    reference = Compressor(lossy, rules=None)
    out = []
    for step in range(steps):
        big = _data(rank, n, torch.float32, 5 + step)
        small = _data(rank, 1000, torch.float32, 6)
        want, want_small = big.clone(), small.clone()
        reference.all_reduce(want, "bucket", op=dist.ReduceOp.SUM, group=gloo)
        dist.all_reduce(want_small, group=gloo)  # auto: so small a call is gloo's own
        dist.all_reduce(big, group=g)
        dist.all_reduce(small, group=g)
        zipccl.backend.step(g)
        out.append((torch.equal(_bits(big), _bits(want)), int(big.count_nonzero()), torch.equal(small, want_small)))
    return out, reference.densities


def _fresh_topk():
    """A new lossy top-k group of every rank: no residuals, steps nor first backward pass left by
    the tests before in these long-lived workers."""
    from zipccl.backend import Options
    return dist.new_group(backend="zipccl", pg_options=Options(lossy="topk", lossy_min_numel=50_000))


def _ddp_lossy(rank, groups, steps):
    """DDP over the lossy top-k group, no ``step()`` calls: after its first step DDP rebuilds its
    buckets, whose sizes then differ from the first step's. Per step the residuals' keys and the
    compressor's step; the parameters' bits against every other rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    g = _fresh_topk()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]), process_group=g,
                bucket_cap_mb=0.6)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compressor = g._compressor
    seen = []
    for step in range(steps):
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        seen.append((sorted(compressor.residuals.store), compressor.step))
    return seen, _bits(torch.cat([p.detach().flatten() for p in model.parameters()]))


def test_lossy_ddp_keeps_one_residual_per_bucket_across_its_rebuild(zpool):
    """Each backward pass is a step: the first, before DDP's rebuild, is sent exact (no residual,
    no lossy step); the rebuilt buckets then keep their keys, one residual each (not new keys
    every step, which would leak a bucket's copy a step and drop its error feedback), and the
    compressor counts every step."""
    out = zpool().run(_ddp_lossy, 5, timeout=120)
    seen, params = out[0]
    assert all(torch.equal(params, other[1]) for other in out[1:])
    keys = [set(k) for k, _ in seen]
    assert [s for _, s in seen] == [-1, 0, 1, 2, 3], seen
    assert not keys[0] and keys[1] and keys[1] == keys[2] == keys[3] == keys[4], seen


def _ddp_lossy_sums(rank, groups, steps, drain):
    """DDP over the lossy top-k group: ``steps`` backward passes in which only rank 0 has
    gradients (the others' losses times 0), then ``drain`` passes in which none has, enough for
    top-k at density 0.01 to send every residual. Per parameter, the largest difference between
    the sum of what DDP left in its gradients and rank 0's own gradients by plain torch summed
    over the steps and divided by the world size; the largest residual left; |that sum| max."""
    import copy
    from torch.nn.parallel import DistributedDataParallel as DDP
    g = _fresh_topk()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    local, model = copy.deepcopy(net), DDP(net, process_group=g, bucket_cap_mb=0.6)
    got = [torch.zeros_like(p) for p in net.parameters()]
    for step in range(steps + drain):
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(100 * step))
        live = float(rank == 0 and step < steps)
        (model(x).square().mean() * live).backward()
        if step < steps:
            local(x).square().mean().backward()  # rank 0's, on every rank
        for total, p in zip(got, net.parameters()):
            total += p.grad
            p.grad = None
    want = [p.grad / dist.get_world_size(g) if p.grad is not None else torch.zeros_like(p) for p in local.parameters()]
    return ([float((a - b).abs().max()) for a, b in zip(got, want)],
            max(float(r.abs().max()) for r in g._compressor.residuals.store.values()),
            max(float(w.abs().max()) for w in want))


def test_lossy_ddp_sends_every_parameters_gradient_once_across_its_rebuild(zpool):
    """Error feedback per parameter across DDP's bucket rebuild, which the drop-in cannot see (it
    gets flat buckets): whatever top-k did not send at a step reaches the same parameter later,
    so once the residuals are sent, each parameter's sum over the steps is plain torch's, to fp32
    rounding. The first backward pass (DDP's buckets before the rebuild) is sent exact, or its
    residual would be added at other parameters' positions or stranded under a size no bucket has
    again."""
    out = zpool().run(_ddp_lossy_sums, 3, 100, timeout=180)
    for rank, value in enumerate(out):
        assert not isinstance(value, BaseException), f"rank {rank}: {value!r}"
        differences, left, largest = value
        assert max(differences) < 1e-5 * largest, (rank, differences, largest)
        assert largest > 1e-4 and left < 1e-6 * largest, (rank, left, largest)


@pytest.mark.parametrize("lossy,n,steps", [("topk", 100_000, 2), ("entropy", 20_000, 23)])
def test_lossy_equals_zipccl_lossy_on_gloo(zpool, lossy, n, steps):
    """Only with the opt-in and only for large tensors; the result is zipccl.lossy's, bit for bit,
    with its error feedback across steps (entropy: 20 lossless warm-up steps, then top-k at the
    density the gradient entropy sets)."""
    out = zpool().run(_lossy, lossy, n, steps, timeout=300)
    for rank, value in enumerate(out):
        assert not isinstance(value, BaseException), f"rank {rank}: {value!r}"
        per_step, densities = value
        assert len(densities) == steps
        for step, (same, nonzero, small_exact) in enumerate(per_step):
            assert same and small_exact, (rank, step, per_step[step])
            if densities[step] is not None:  # top-k: at most k elements from each of 4 ranks
                assert 0 < nonzero <= 4 * int(densities[step] * n + 1), (rank, step, nonzero)
        lossy_steps = [d for d in densities if d is not None]
        assert len(lossy_steps) == (steps if lossy == "topk" else 3), densities
    assert all(value == out[0] for value in out), "every rank ends with the same lossy result"


def _algorithm(rank, groups):
    """``Options(algorithm=...)``: the flat and hierarchical groups (ZIPCCL_TOPOLOGY=2x2 here)
    against plain torch in each algorithm's documented summation order."""
    import zipccl
    old, zipccl.config.TOPOLOGY = zipccl.config.TOPOLOGY, "2x2"
    zipccl.topology.forget(groups["hierarchical"])
    try:
        bad = []
        for dtype in (torch.float32, torch.bfloat16):
            x = _data(rank, 30_000, dtype, 11)
            parts = _gathered(x, groups["gloo"])
            nodes = [(parts[0].float() + parts[1].float()).to(dtype), (parts[2].float() + parts[3].float()).to(dtype)]
            wants = {"flat": _reference(parts, "SUM"), "hierarchical": (nodes[0].float() + nodes[1].float()).to(dtype)}
            for algorithm, want in wants.items():
                y = x.clone()
                dist.all_reduce(y, group=groups[algorithm])
                if not torch.equal(_bits(y), _bits(want)):
                    bad.append((algorithm, dtype))
        return bad
    finally:
        zipccl.config.TOPOLOGY = old
        zipccl.topology.forget(groups["hierarchical"])


def test_algorithm_option(zpool):
    for rank, value in enumerate(zpool().run(_algorithm, timeout=120)):
        assert value == [], f"rank {rank}: {value!r}"


def _dtensor_and_limits(rank, groups):
    import zipccl
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = DeviceMesh.from_group(groups["lossless"], "cpu")
    t = distribute_tensor(torch.arange(4096.0).reshape(64, 64), mesh, [Shard(0)])
    zipccl.reset_stats()
    full = t.full_tensor()
    calls = zipccl.stats().get("all_gather", {}).get("calls", 0)
    try:
        dist.monitored_barrier(group=groups["lossless"])
        refused = None
    except ValueError as e:
        refused = str(e)
    return torch.equal(full, torch.arange(4096.0).reshape(64, 64)), calls, refused


def test_dtensor_full_tensor_is_compressed_and_monitored_barrier_refused(zpool):
    for rank, value in enumerate(zpool().run(_dtensor_and_limits, timeout=120)):
        assert not isinstance(value, BaseException), f"rank {rank}: {value!r}"
        same, calls, refused = value
        assert same and calls == 1
        assert refused is not None and "GLOO" in refused


def _subgroup_lifecycle(rank, groups):
    import zipccl
    from zipccl.backend import ProcessGroupZipccl
    g = dist.new_group([1, 2, 3], backend="zipccl")  # every rank calls new_group; rank 0 is not in it
    if rank == 0:
        return g == dist.GroupMember.NON_GROUP_MEMBER
    x = torch.full((1 << 19,), float(rank), dtype=torch.bfloat16)
    zipccl.reset_stats()
    dist.all_reduce(x, group=g)
    name, desc = g.group_name, g.group_desc
    dist.destroy_process_group(g)
    return isinstance(g, ProcessGroupZipccl), x[0].item(), name != "", desc


def test_subgroups_are_zipccl_groups_and_can_be_destroyed(zpool):
    out = zpool().run(_subgroup_lifecycle, timeout=120)
    assert out[0] is True
    for rank in (1, 2, 3):
        assert not isinstance(out[rank], BaseException), f"rank {rank}: {out[rank]!r}"
        is_zipccl, value, named, _ = out[rank]
        assert is_zipccl and value == 6.0 and named


def _many_small_calls(rank, groups, n):
    """Calls that go to gloo underneath, back to back: with the GIL held across torch's C++ they
    deadlocked with gloo's worker thread, which needs the GIL to free a finished call's tensors."""
    size = dist.get_world_size()
    total = 0.0
    for i in range(n):
        t = torch.tensor([float(rank + i)], dtype=torch.float64)
        dist.all_reduce(t)                      # an override, passed through (float64)
        dist.broadcast(t, src=i % size)         # not overridden by zipccl's planner
        total += t.item()
        if i % 4 == 0:
            outs = [torch.empty(1, dtype=torch.int64) for _ in range(size)]
            dist.all_gather(outs, torch.tensor([rank]))
    return total


@pytest.mark.timeout(300)
def test_back_to_back_pass_through_calls_do_not_deadlock(zpool):
    out = zpool().run(_many_small_calls, 4000, timeout=240)
    assert all(not isinstance(v, BaseException) for v in out), out
    assert len(set(out)) == 1


def test_work_wait_honours_its_timeout():
    import datetime
    from zipccl.backend import _Work
    from zipccl.errors import TimeoutError as ZipcclTimeout
    from zipccl.executor import Handle
    pending = torch.futures.Future()
    work = _Work(Handle(pending))
    with pytest.raises(ZipcclTimeout):
        work.wait(datetime.timedelta(seconds=0.1))
    assert not work.is_completed()
    pending.set_result([torch.ones(1)])
    assert work.wait(datetime.timedelta(seconds=0.1)) and work.is_completed()
    assert work.get_future().value()[0].item() == 1.0
    failed = torch.futures.Future()
    failed.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        _Work(Handle(failed)).wait()


def test_options_are_checked():
    from zipccl.backend import Options
    with pytest.raises(ValueError, match="codec"):
        Options(codec="zstd")
    with pytest.raises(ValueError, match="lossy"):
        Options(lossy="yes")
    with pytest.raises(ValueError, match="algorithm"):
        Options(algorithm="tree")
    from zipccl.backend import _create
    with pytest.raises(TypeError, match="zipccl.backend.Options"):
        _create(None, dist.ProcessGroupGloo._Options() if hasattr(dist.ProcessGroupGloo, "_Options") else "lossless")
    assert "ZIPCCL" in dist.Backend._plugins  # registered by import zipccl


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 8))


def _train(rank, model, steps: int, params=None) -> list[torch.Tensor]:
    opt = torch.optim.SGD(params if params is not None else model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _ddp(rank, groups, codec, steps):
    import zipccl
    from torch.nn.parallel import DistributedDataParallel as DDP
    zipccl.reset_stats()
    ddp = DDP(_model(), process_group=groups[codec])
    _train(rank, ddp, steps)
    calls = zipccl.stats().get("all_reduce", {}).get("calls", 0)
    return [p.detach().clone() for p in ddp.module.parameters()], calls


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


def test_ddp_trains_bit_identically_lossless_and_raw(zpool):
    pool = zpool()
    steps = 30
    runs = {c: pool.run(_ddp, c, steps, timeout=300) for c in ("lossless", "raw", "gloo")}
    for c, out in runs.items():
        for rank, value in enumerate(out):
            assert not isinstance(value, BaseException), f"{c} rank {rank}: {value!r}"
    for rank in range(4):
        lossless, raw, gloo = (runs[c][rank][0] for c in ("lossless", "raw", "gloo"))
        assert _same(lossless, raw), f"rank {rank}: lossless and raw DDP differ"
        assert _same(lossless, runs["lossless"][0][0]), f"rank {rank} differs from rank 0"
        for a, b in zip(lossless, gloo):  # gloo sums in another order: the last bits differ
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert runs["lossless"][0][1] >= steps and runs["raw"][0][1] >= steps  # every bucket went through zipccl
    assert runs["gloo"][0][1] == 0


def _fsdp(rank, groups, codec, steps, hsdp):
    import zipccl
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    zipccl.reset_stats()
    if hsdp:  # 2 replicas x 2 shards, the groups made by DeviceMesh on the default backend
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = DeviceMesh.from_group(groups[codec], "cpu")
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(rank, model, steps)
    s = zipccl.stats()
    full = [p.full_tensor().detach().clone() for p in model.parameters()]
    return full, {k: s.get(k, {}).get("calls", 0) for k in ("all_gather", "reduce_scatter", "all_reduce")}


def test_fsdp2_trains_bit_identically_lossless_and_raw(zpool):
    pool = zpool()
    steps = 12
    runs = {c: pool.run(_fsdp, c, steps, False, timeout=300) for c in ("lossless", "raw", "gloo")}
    for c, out in runs.items():
        for rank, value in enumerate(out):
            assert not isinstance(value, BaseException), f"{c} rank {rank}: {value!r}"
    for rank in range(4):
        lossless, raw, gloo = (runs[c][rank][0] for c in ("lossless", "raw", "gloo"))
        assert _same(lossless, raw), f"rank {rank}: lossless and raw FSDP2 differ"
        assert _same(lossless, runs["lossless"][0][0])
        for a, b in zip(lossless, gloo):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    calls = runs["lossless"][0][1]
    assert calls["all_gather"] >= steps * 2 and calls["reduce_scatter"] >= steps, calls
    assert runs["gloo"][0][1] == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}


def test_hsdp_on_a_2d_device_mesh(zpool):
    """HSDP over init_device_mesh on the zipccl world (ZIPCCL_CODEC unset: auto): the mesh's
    groups are zipccl's, results match plain FSDP2 on gloo within summation order."""
    pool = zpool()
    hsdp = pool.run(_fsdp, "gloo", 10, True, timeout=300)
    flat = pool.run(_fsdp, "gloo", 10, False, timeout=300)
    for rank in range(4):
        assert not isinstance(hsdp[rank], BaseException), f"rank {rank}: {hsdp[rank]!r}"
        for a, b in zip(hsdp[rank][0], flat[rank][0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        calls = hsdp[rank][1]
        assert calls["all_gather"] > 0 and calls["reduce_scatter"] > 0 and calls["all_reduce"] > 0, calls


def _settings_changed_then_a_subgroup(rank, groups):
    """Every rank sets ZIPCCL_AUTO_LEARN=0, then the world makes a drop-in group of ranks 0 and 1:
    torch runs the backend's constructor on those two alone, yet the setting, which every rank of a
    group must share (config.SHARED), is read again on all four, so the world's next auto
    all-reduce goes one way on every rank and sums as gloo does (else: ranks 0 and 1 wait in
    zipccl's plan for the two others, which went to the backend's own)."""
    import zipccl
    from workers import environ
    timeout, zipccl.config.TIMEOUT = zipccl.config.TIMEOUT, 20.0
    try:
        with environ(ZIPCCL_AUTO_LEARN="0" if zipccl.config.AUTO_LEARN else "1"):
            dist.new_group([0, 1], backend="zipccl")
            learn = zipccl.config.AUTO_LEARN
            x = torch.full((1000,), rank + 1.0)
            dist.all_reduce(x)
            expected = torch.full((1000,), rank + 1.0)
            dist.all_reduce(expected, group=groups["gloo"])
            return learn, bool(torch.equal(x, expected))
    finally:
        zipccl.config.TIMEOUT = timeout


def test_settings_changed_before_a_subgroup_are_read_again_on_every_rank(zpool):
    res = zpool().run(_settings_changed_then_a_subgroup, timeout=120)
    assert len({r[0] for r in res}) == 1 and all(r[1] for r in res), res


def test_settings_are_read_again_on_zipccl_threads_without_waiting_for_the_queue():
    """A queued call that makes a zipccl group (a hierarchical call's levels, on a thread acting
    for zipccl's) reads changed settings at once: waiting there for the queue, which waits for
    that call, would hold it to the bound."""
    import threading

    from workers import environ
    from zipccl import backend, config, executor
    release, read = threading.Event(), []
    held = executor.submit(lambda: release.wait(30))

    def on_ours():
        executor._threads.ours = True
        backend._read_settings_again()
        read.append(config.AUTO_MIN_BYTES)
    try:
        with environ(ZIPCCL_AUTO_MIN_BYTES=str(config.AUTO_MIN_BYTES + 1)):
            thread = threading.Thread(target=on_ours)
            thread.start()
            thread.join(5)
            assert read == [int(os.environ["ZIPCCL_AUTO_MIN_BYTES"])], read
    finally:
        release.set()
        held.wait()


def _zipccl_calls_on_the_drop_in_world(rank, groups):
    """zipccl's own calls on a drop-in world: their messages go to the backend under it, not
    through the drop-in again, so what zipccl counts is the calls made (a lossless all-reduce
    was counted with six native receives on rank 0, a blocking receive with three), and they
    sum and deliver as gloo does."""
    import zipccl
    x = torch.full((1 << 16,), rank + 1.0)
    expected = x.clone()
    dist.all_reduce(expected, group=groups["gloo"])
    zipccl.reset_stats()
    zipccl.all_reduce(x, codec="lossless")
    counted = {k: v["calls"] for k, v in zipccl.stats().items() if isinstance(v, dict) and "calls" in v}
    msg = _activations(0, 1 << 12)
    zipccl.reset_stats()
    got = None
    if rank == 0:
        zipccl.send(msg, 1, codec="lossless")
    elif rank == 1:
        got = torch.empty_like(msg)
        zipccl.recv(got, 0, codec="lossless")
    messages = {k: v["calls"] for k, v in zipccl.stats().items() if isinstance(v, dict) and "calls" in v}
    return (counted, bool(torch.equal(x, expected)), messages,
            got is None or bool(torch.equal(got.view(torch.int16), msg.view(torch.int16))))


def test_zipccls_own_calls_on_a_drop_in_world_count_as_one_call(zpool):
    res = zpool().run(_zipccl_calls_on_the_drop_in_world, timeout=120)
    for rank, (counted, summed, messages, delivered) in enumerate(res):
        assert counted == {"all_reduce": 1, "total": 1} and summed and delivered, (rank, res[rank])
        want = {0: {"send": 1, "total": 1}, 1: {"recv": 1, "total": 1}}.get(rank, {"total": 0})
        assert messages == want, (rank, messages)


# ---- all-to-all and point-to-point through the drop-in ---------------------------------------------------------

def _activations(rank: int, numel: int) -> torch.Tensor:
    from test_alltoall import activations
    return activations(numel, seed=rank)


def _drop_in_group(codec: str):
    """A new drop-in group made with ZIPCCL_CODEC=``codec`` (read at the group's making, as
    torch's variables are); the worker's setting as it was afterwards, for the tests after this one."""
    from workers import environ
    with environ(ZIPCCL_CODEC=codec):
        return dist.new_group(backend="zipccl")


def _native_from_any_source(rank, groups):
    """On a drop-in group whose codec is lossless, zipccl.send and a receive from any source with
    codec "native" meet as the backend's own message: the bits, and the sender named (else: the
    drop-in's own any-source check, which reads the group's codec, refused the receive)."""
    import zipccl
    g = _drop_in_group("lossless")
    x = _activations(0, 1000)
    if rank == 0:
        zipccl.send(x, 1, group=g, codec="native")
        return True
    if rank == 1:
        got = torch.empty_like(x)
        sender = zipccl.recv(got, group=g, codec="native")
        return sender == 0 and bool(torch.equal(got, x))
    return True


def test_a_native_receive_from_any_source_on_a_compressing_drop_in_group(zpool):
    assert zpool().run(_native_from_any_source, timeout=120) == [True] * 4


def _exchanges(rank, groups, codec):
    """dist.all_to_all_single (even and uneven), dist.all_to_all, dist.send/recv, isend/irecv and
    batch_isend_irecv of bf16, fp16 and fp32 activations on a drop-in group made with
    ZIPCCL_CODEC=``codec``, against the same calls on gloo: bit for bit; what zipccl counted."""
    import zipccl
    from test_alltoall import bits
    g = _drop_in_group(codec)
    gloo, n = groups["gloo"], dist.get_world_size()
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    bad, base = [], _activations(rank, 1 << 16)
    zipccl.reset_stats()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = base[:4000].to(dtype)
        for splits in (None, ([(j + 2 * rank) * 100 for j in range(n)], [(rank + 2 * j) * 100 for j in range(n)])):
            outs, ins = (None, None) if splits is None else (splits[1], splits[0])
            size = x.numel() if splits is None else sum(outs)
            xin = x if splits is None else base[:sum(ins)].to(dtype)
            got, want = torch.empty(size, dtype=dtype), torch.empty(size, dtype=dtype)
            dist.all_to_all_single(got, xin, outs, ins, group=g)
            dist.all_to_all_single(want, xin, outs, ins, group=gloo)
            if not torch.equal(bits(got), bits(want)):
                bad.append(("all_to_all_single", dtype, splits is not None))
        parts = list(x.split(1000))
        gots, wants = [torch.empty(1000, dtype=dtype) for _ in range(n)], [torch.empty(1000, dtype=dtype)
                                                                         for _ in range(n)]
        dist.all_to_all(gots, parts, group=g)
        dist.all_to_all(wants, parts, group=gloo)
        if not all(torch.equal(bits(a), bits(b)) for a, b in zip(gots, wants)):
            bad.append(("all_to_all", dtype))
        want = torch.empty_like(x)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt, group=gloo),
                                         dist.P2POp(dist.irecv, want, prv, group=gloo)]):
            w.wait()
        got = torch.empty_like(x)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, prv, group=g),
                                         dist.P2POp(dist.isend, x, nxt, group=g)]):
            w.wait()
        if not torch.equal(bits(got), bits(want)):
            bad.append(("batch_isend_irecv", dtype))
        got = torch.empty_like(x)
        r, s = dist.irecv(got, prv, group=g), dist.isend(x, nxt, group=g)
        r.wait()
        s.wait()
        if not torch.equal(bits(got), bits(want)):
            bad.append(("isend/irecv", dtype))
        if not (r.result()[0] is got and s.get_future().wait()[0] is x):  # as gloo's Work: the message's tensor
            bad.append(("isend/irecv's values", dtype))
        got = torch.empty_like(x)
        if rank % 2 == 0:
            dist.send(x, nxt, group=g)
            dist.recv(got, prv, group=g)
        else:
            dist.recv(got, prv, group=g)
            dist.send(x, nxt, group=g)
        if not torch.equal(bits(got), bits(want)):
            bad.append(("send/recv", dtype))
    ints = torch.arange(n, dtype=torch.int64) + 10 * rank
    back = torch.empty_like(ints)
    dist.all_to_all_single(back, ints, group=g)  # not a float: gloo's own
    if back.tolist() != [rank + 10 * j for j in range(n)]:
        bad.append(("int64 all_to_all_single",))
    s = zipccl.stats()
    dist.destroy_process_group(g)
    return bad, {k: (s[k]["calls"], s[k]["raw_bytes"], s[k]["wire_bytes"]) for k in ("all_to_all", "send", "recv")}


@pytest.mark.parametrize("codec", ["raw", "lossless"])
def test_all_to_all_and_point_to_point_through_the_drop_in(zpool, codec):
    """ZIPCCL_CODEC forces every float all-to-all and message of the drop-in through zipccl (the
    list form and the three ways of sending); gloo's bits come out; integers pass to gloo."""
    for rank, res in enumerate(zpool().run(_exchanges, codec, timeout=300)):
        assert not isinstance(res, BaseException), f"rank {rank}: {res!r}"
        bad, calls = res
        assert bad == [], (rank, bad)
        assert calls["all_to_all"][0] == 3 * 3, calls  # even, uneven and the list form, per dtype
        assert calls["send"][0] == calls["recv"][0] == 3 * 3, calls
        raw, wire = calls["send"][1:]
        assert (wire == raw) if codec == "raw" else (wire < 0.9 * raw), (codec, calls)  # raw: the bytes alone


def _complex_and_the_list_form(rank, groups):
    """On a drop-in group under auto (one node: the backend's all-to-all): zipccl.all_to_all_single
    and all_to_all of complex64, which gloo takes only as real views, and dist.all_to_all, whose
    even list goes to gloo at once; against gloo's own calls, bit for bit."""
    import zipccl
    from test_alltoall import bits
    g, gloo, n = dist.new_group(backend="zipccl"), groups["gloo"], dist.get_world_size()
    x = torch.complex(_activations(rank, 8 * n), _activations(rank + n, 8 * n))
    bad = []
    for form in ("single", "list"):
        got, want = torch.empty_like(x), torch.empty_like(x)
        if form == "single":
            zipccl.all_to_all_single(got, x, group=g)
            dist.all_to_all_single(want, x, group=gloo)
        else:
            zipccl.all_to_all(list(got.split(8)), list(x.split(8)), group=g)
            dist.all_to_all(list(want.split(8)), list(x.split(8)), group=gloo)
        if not torch.equal(torch.view_as_real(got), torch.view_as_real(want)):
            bad.append(("complex", form))
    y = _activations(rank, 64 * n).to(torch.bfloat16)
    zipccl.reset_stats()
    gots, wants = [torch.empty(64, dtype=y.dtype) for _ in range(n)], [torch.empty(64, dtype=y.dtype)
                                                                       for _ in range(n)]
    dist.all_to_all(gots, list(y.split(64)), group=g)
    dist.all_to_all(wants, list(y.split(64)), group=gloo)
    if not all(torch.equal(bits(a), bits(b)) for a, b in zip(gots, wants)):
        bad.append(("bf16 list",))
    s = zipccl.stats()
    dist.destroy_process_group(g)
    return bad, s["all_to_all"]["calls"], s["last"]["codec"], s["all_to_all"]["wire_bytes"]


def test_complex_and_the_list_forms_backend_call_through_the_drop_in(zpool):
    """Complex tensors reach gloo's all-to-all as real views (gloo takes no complex type), and an
    even list all-to-all under auto on one node is gloo's, counted as native."""
    for rank, res in enumerate(zpool().run(_complex_and_the_list_form, timeout=120)):
        assert not isinstance(res, BaseException), f"rank {rank}: {res!r}"
        bad, calls, codec, wire = res
        assert bad == [], (rank, bad)
        assert (calls, codec, wire) == (1, "native", 0), res


def _layouts_through_the_drop_in(rank, groups):
    """Through the drop-in, against gloo's own calls (out of place), bit for bit: in place, a
    circulant all_to_all_single and a list all-to-all under auto (one node), each twice, the
    second once the nodes are known, where an idle queue hands the backend's call over at once;
    then under ZIPCCL_CODEC=lossless a list all-to-all in which rank 0's tensors are strided and
    its peers' contiguous, as torch lets them differ."""
    import zipccl
    from test_alltoall import bits
    gloo, n = groups["gloo"], dist.get_world_size()
    bad, g = [], dist.new_group(backend="zipccl")
    parts = [700, 9000, 150, 3100]
    ins, outs = [parts[(j - rank) % n] for j in range(n)], [parts[(rank - j) % n] for j in range(n)]
    x = _activations(rank, sum(ins)).to(torch.bfloat16)
    want = torch.empty_like(x)
    dist.all_to_all_single(want, x, outs, ins, group=gloo)
    pieces = [_activations(10 * rank + j, 256).to(torch.bfloat16) for j in range(n)]
    expect = [torch.empty_like(p) for p in pieces]
    dist.all_to_all(expect, pieces, group=gloo)
    for call in range(2):
        buf = x.clone()
        dist.all_to_all_single(buf, buf, outs, ins, group=g)
        if not torch.equal(bits(buf), bits(want)):
            bad.append(("in place, single", call))
        got = [p.clone() for p in pieces]
        dist.all_to_all(got, got, group=g)
        if not all(torch.equal(bits(a), bits(b)) for a, b in zip(got, expect)):
            bad.append(("in place, list", call))
    dist.destroy_process_group(g)
    g = _drop_in_group("lossless")
    block = _activations(rank, n * 6 * 512).to(torch.bfloat16)
    ins = [block[k * 3072:(k + 1) * 3072].view(6, 512) for k in range(n)]
    wants = [torch.empty(6, 512, dtype=block.dtype) for _ in range(n)]
    dist.all_to_all(wants, ins, group=gloo)
    if rank == 0:
        ins, gots = [x.t().contiguous().t() for x in ins], [torch.empty(512, 6, dtype=block.dtype).t() for _ in range(n)]
    else:
        gots = [torch.empty(6, 512, dtype=block.dtype) for _ in range(n)]
    before = zipccl.config.TIMEOUT
    zipccl.config.TIMEOUT = 30.0  # ranks that took different paths: a RankFailure, not a hang
    zipccl.reset_stats()
    try:
        dist.all_to_all(gots, ins, group=g)
    finally:
        zipccl.config.TIMEOUT = before
    if not all(torch.equal(bits(a), bits(b)) for a, b in zip(gots, wants)):
        bad.append(("strided on rank 0, lossless",))
    wire = zipccl.stats()["all_to_all"]["wire_bytes"]
    dist.destroy_process_group(g)
    return bad, wire


def test_layouts_through_the_drop_in(zpool):
    """An in-place all-to-all through the drop-in keeps its input until sent, whether the call
    goes through zipccl's queue or straight to the backend; a list all-to-all whose layouts
    differ across ranks takes one path on every rank (zipccl's packets, compressed)."""
    for rank, res in enumerate(zpool().run(_layouts_through_the_drop_in, timeout=180)):
        assert not isinstance(res, BaseException), f"rank {rank}: {res!r}"
        bad, wire = res
        assert bad == [] and wire > 0, (rank, res)


def _empty_lists(rank, groups):
    """Empty tensor lists, which the drop-in passes to gloo: torch's errors (a RuntimeError: torch
    refuses an empty list to gloo's all_reduce_coalesced before gloo, which refuses it on the
    drop-in), on each rank."""
    out = {}
    for name, call in [("all_reduce_coalesced", lambda g: dist.all_reduce_coalesced([], group=g)),
                       ("all_gather", lambda g: dist.all_gather([], torch.ones(2), group=g))]:
        for where in ("lossless", "gloo"):
            try:
                call(groups[where])
                out[name, where] = "no error"
            except Exception as e:  # noqa: BLE001 - the test compares them
                out[name, where] = isinstance(e, RuntimeError) or type(e).__name__
    return out


def test_empty_lists_fail_as_the_backends(zpool):
    for rank, res in enumerate(zpool().run(_empty_lists, timeout=60)):
        assert not isinstance(res, BaseException), f"rank {rank}: {res!r}"
        for name in ("all_reduce_coalesced", "all_gather"):
            assert res[name, "lossless"] is res[name, "gloo"] is True, (rank, res)


def _shapes_gloo_refuses(rank, groups):
    """All-gathers into, and reduce-scatters of, one tensor of shapes that gloo refuses (stacked,
    0-d, an element too many), small and 2 MiB: whether each raised a RuntimeError, per group (a
    0-d reduce-scatter output, on which gloo crashes, on zipccl's groups only)."""
    w, out = dist.get_world_size(), {}
    for n in (4, 1 << 19):
        calls = {"stacked output": lambda g: dist.all_gather_into_tensor(torch.empty(w, n), torch.ones(n), group=g),
                 "0-d input": lambda g: dist.all_gather_into_tensor(torch.empty(w), torch.ones(()), group=g),
                 "output too long": lambda g: dist.all_gather_into_tensor(torch.empty(w * n + 1), torch.ones(n),
                                                                          group=g),
                 "stacked input": lambda g: dist.reduce_scatter_tensor(torch.empty(n), torch.ones(w, n), group=g),
                 "input too long": lambda g: dist.reduce_scatter_tensor(torch.empty(n), torch.ones(w * n + 1),
                                                                        group=g),
                 "0-d output": lambda g: dist.reduce_scatter_tensor(torch.empty(()), torch.ones(w), group=g)}
        for name, call in calls.items():  # gloo crashes on a 0-d output: the drop-in raises
            for where in ("raw", "lossless", w) + (("gloo",) if name != "0-d output" else ()):
                try:
                    call(groups[where])
                    out[n, name, where] = "no error"
                except Exception as e:  # noqa: BLE001 - the test compares them
                    out[n, name, where] = isinstance(e, RuntimeError) or type(e).__name__
    return out


def test_shapes_gloo_refuses_are_refused_as_gloo_does_at_every_size(zpool):
    """zipccl needs only the element counts, but a CPU drop-in call of a shape gloo refuses is
    refused by gloo: before, the compressed paths took what gloo refuses (or raised a ValueError),
    so that under auto a call's fate depended on its size."""
    for rank, res in enumerate(zpool().run(_shapes_gloo_refuses, timeout=60)):
        assert not isinstance(res, BaseException), f"rank {rank}: {res!r}"
        assert set(res.values()) == {True}, (rank, {k: v for k, v in res.items() if v is not True})


def _first_call_async(rank, groups):
    """A new drop-in group's first call made async, on two nodes of two ranks, for each policy
    whose call finds the group's nodes (or makes its levels) while it is queued: the result,
    against gloo's all-to-all or torch's sum of the gathered inputs (whole numbers: exact in any
    order), and the seconds the call took."""
    import time

    from test_alltoall import bits, nodes
    from zipccl.backend import Options
    gloo, n, out = groups["gloo"], dist.get_world_size(), {}
    x = torch.arange(4096.0 * n) + 100 * rank
    for name, options, call in [("a2a lossless", Options(codec="lossless"), "a2a"),
                                ("a2a raw", Options(codec="raw"), "a2a"),
                                ("a2a auto, flat", Options(codec="auto", algorithm="flat"), "a2a"),
                                ("all_reduce lossless, hierarchical", Options(codec="lossless", algorithm="hierarchical"),
                                 "all_reduce")]:
        g = dist.new_group(backend="zipccl", pg_options=options)
        with nodes(g, "2x2"):
            t0 = time.monotonic()
            if call == "a2a":
                got, want = torch.empty_like(x), torch.empty_like(x)
                dist.all_to_all_single(got, x, group=g, async_op=True).wait()
                dist.all_to_all_single(want, x, group=gloo)
            else:
                got, parts = x.clone(), [torch.empty_like(x) for _ in range(n)]
                dist.all_reduce(got, group=g, async_op=True).wait()
                dist.all_gather(parts, x, group=gloo)
                want = torch.stack(parts).sum(0)
            out[name] = (torch.equal(bits(got), bits(want)), round(time.monotonic() - t0, 1))
        dist.destroy_process_group(g)
    return out


def test_a_groups_first_call_may_be_async(zpool):
    """A drop-in group's first call, async, under policies that find the group's nodes on
    zipccl's thread (all-to-all under lossless, raw, auto with algorithm "flat"; a hierarchical
    all-reduce, whose levels are made before it is queued): the set-up step's collective never
    waits for the queue that the call is in (it did, until ZIPCCL_TIMEOUT on every rank)."""
    for rank, res in enumerate(zpool().run(_first_call_async, timeout=120)):
        assert not isinstance(res, BaseException), f"rank {rank}: {res!r}"
        assert all(same and seconds < 5 for same, seconds in res.values()), (rank, res)


def _examples(rank, groups, example, codec):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / f"{example}.py"
    spec = importlib.util.spec_from_file_location(f"{example}_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.train(rank, dist.get_world_size(), steps=3, group=groups[codec])


@pytest.mark.parametrize("example", ["moe", "pipeline"])
def test_moe_and_pipeline_examples_train_bit_identically_to_gloo(zpool, example):
    """examples/moe.py (expert parallelism: all_to_all_single with uneven splits, forward and
    backward) and examples/pipeline.py (send/recv of bf16 activations and their gradients), a few
    steps through the drop-in: raw and lossless give gloo's parameters bit for bit, lossless
    moving fewer bytes."""
    runs = {c: zpool().run(_examples, example, c, timeout=300) for c in ("gloo", "raw", "lossless")}
    for c, out in runs.items():
        for rank, value in enumerate(out):
            assert not isinstance(value, BaseException), f"{c} rank {rank}: {value!r}"
    for rank in range(4):
        hashes = {c: runs[c][rank]["param_sha256"] for c in runs}
        assert len(set(hashes.values())) == 1, (rank, hashes)
    if example == "moe":
        lossless, raw = runs["lossless"][0], runs["raw"][0]
        assert lossless["all_to_all_calls"] == raw["all_to_all_calls"] > 0 and runs["gloo"][0]["all_to_all_calls"] == 0
        assert lossless["wire_bytes"] < 0.95 * raw["raw_bytes"], lossless
    else:
        sent = runs["lossless"][0]["moved"]["send"]
        assert sent["calls"] > 0 and sent["wire_bytes"] < 0.8 * sent["raw_bytes"], sent
        assert runs["gloo"][0]["moved"] == {}


def test_variables_set_after_import_take_effect_when_a_drop_in_group_is_made(monkeypatch):
    """ZIPCCL_CODEC set after zipccl's import: the next drop-in group takes it (as torch reads
    its own variables when a group is made); a setting assigned in code stays while its
    variable is unchanged; a bad value raises, naming the variable."""
    from datetime import timedelta

    from zipccl import config
    from zipccl.backend import ProcessGroupZipccl

    monkeypatch.setattr(config, "_SETTINGS", dict(config._SETTINGS))  # what refresh saw, restored after
    for name in config._SETTINGS:
        monkeypatch.setattr(config, name, getattr(config, name))

    def made() -> ProcessGroupZipccl:
        return ProcessGroupZipccl(dist.HashStore(), 0, 1, timedelta(seconds=30))

    monkeypatch.setenv("ZIPCCL_CODEC", "lossless")
    assert made().codec == "lossless"
    config.CODEC = "raw"  # assigned in code; the variable unchanged
    assert made().codec == "raw"
    monkeypatch.setenv("ZIPCCL_CODEC", "fast")
    with pytest.raises(ValueError, match="ZIPCCL_CODEC='fast' must be one of"):
        made()


@pytest.mark.parametrize("variable,value", [("ZIPCCL_TIMEOUT", "nan"), ("ZIPCCL_TIMEOUT", "inf"),
                                            ("ZIPCCL_TIMEOUT", "-1"), ("ZIPCCL_TIMEOUT", "soon"),
                                            ("ZIPCCL_TOPOLOGY", "2x"), ("ZIPCCL_TOPOLOGY", "0x4"),
                                            ("ZIPCCL_PIECE_BYTES", "8M"), ("ZIPCCL_PIECE_BYTES", "-1")])
def test_a_bad_setting_raises_naming_its_variable(monkeypatch, variable, value):
    """As at import: a timeout no wait can take (NaN, infinity: a timedelta of either raised deep
    in the first call, blamed on a peer), a topology that is not NxM, or piece bytes that are not
    a count of bytes."""
    from zipccl import config
    monkeypatch.setattr(config, "_SETTINGS", dict(config._SETTINGS))
    for name in config._SETTINGS:
        monkeypatch.setattr(config, name, getattr(config, name))
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=variable):
        config.refresh()


def test_refresh_reads_what_an_import_reads(monkeypatch):
    """Every setting, its variable changed after import: ``refresh`` sets what a fresh import of
    zipccl/config.py under that environment sets, and names each variable it read again."""
    import importlib.util
    import os

    from zipccl import config
    changed = {"ZIPCCL_AUTO_MIN_BYTES": "1234", "ZIPCCL_AUTO_LEARN": "0", "ZIPCCL_REDUCE_SCATTER": "ring",
               "ZIPCCL_SPLIT_DIRECTIONS": "0", "ZIPCCL_TOPOLOGY": "2x2", "ZIPCCL_CHECK_NATIVE": "1", "ZIPCCL_SHM": "0",
               "ZIPCCL_TIMEOUT": "7.5", "ZIPCCL_CODEC": "raw", "ZIPCCL_STRICT_TRANSPORT": "0",
               "ZIPCCL_TRANSPORT": "torch", "ZIPCCL_DATA": "some/folder", "ZIPCCL_TRITON_LAUNCH": "triton",
               "ZIPCCL_PIECE_BYTES": "4194304"}
    monkeypatch.setattr(config, "_SETTINGS", dict(config._SETTINGS))
    for name in config._SETTINGS:
        monkeypatch.setattr(config, name, getattr(config, name))
    assert sorted(v for _, v, _, _ in config._SETTINGS.values()) == sorted(changed)
    expected = {v for v, value in changed.items() if os.environ.get(v) != value}
    for variable, value in changed.items():
        monkeypatch.setenv(variable, value)
    names = config.refresh()
    spec = importlib.util.spec_from_file_location("fresh_config", config.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    got = {a: getattr(config, a) for a in config._SETTINGS}
    assert got == {a: getattr(fresh, a) for a in config._SETTINGS}, got
    assert config.TIMEOUT == 7.5 and config.AUTO_LEARN is False and config.TOPOLOGY == "2x2" and \
        config.PIECE_BYTES == 4 << 20
    assert set(names) == expected and len(expected) >= 11, names
    assert config.refresh() == [] and config.changed() == []  # nothing changed since
    from zipccl.collectives.resolve import resolve_codec
    assert resolve_codec("auto", torch.float32, 2000).name == "lossless"  # over the new floor of 1234 bytes
    monkeypatch.setenv("ZIPCCL_AUTO_MIN_BYTES", "4096")
    monkeypatch.setenv("ZIPCCL_SHM", "maybe")
    assert config.changed() == ["ZIPCCL_AUTO_MIN_BYTES", "ZIPCCL_SHM"]
    with pytest.raises(ValueError, match="ZIPCCL_SHM='maybe'"):
        config.refresh()
    assert config.AUTO_MIN_BYTES == 1234 and resolve_codec("auto", torch.float32, 2000).name == "lossless"  # nothing


def _coalesced_and_in_order(rank, groups):
    """What torch allows on a group and the drop-in must keep. Collectives inside torch's
    coalescing manager (whose state is the group's, not the caller's) reach the backend: gloo's
    results. A receive of a type zipccl leaves to the backend (int32, float64), issued after a
    float receive that waits behind a queued async all-reduce, takes its own message, not that
    one's (ranks 1 and 3 send to 0 and 2)."""
    from torch.distributed.distributed_c10d import _coalescing_manager
    out = {}
    outs = [torch.full((4,), -7.0) for _ in range(4)]
    with _coalescing_manager():
        dist.all_gather(outs, torch.full((4,), float(rank + 1)))
    out["all_gather"] = [o.tolist() for o in outs] == [[float(r + 1)] * 4 for r in range(4)]
    a, b = torch.full((4,), float(rank + 1)), torch.full((3,), float(rank + 1))
    with _coalescing_manager():
        dist.all_reduce_coalesced([a, b])
    out["all_reduce_coalesced"] = a.tolist() == [10.0] * 4 and b.tolist() == [10.0] * 3
    dist.all_reduce(torch.ones(1 << 20))
    queued = dist.all_reduce(torch.ones(1 << 20), async_op=True)  # codec auto: on zipccl's queue
    sent = [torch.tensor([1.5, 2.5, 3.5, 4.5]), torch.tensor([7, 8, 9, 10], dtype=torch.int32),
            torch.tensor([3.25], dtype=torch.float64)]
    if rank % 2 == 0:
        got = [torch.zeros_like(x) for x in sent]
        for w in [dist.irecv(x, src=rank + 1) for x in got]:
            w.wait()
        out["received"] = all(torch.equal(x, y) for x, y in zip(got, sent))
    else:
        for w in [dist.isend(x, dst=rank - 1) for x in sent]:
            w.wait()
    queued.wait()
    return out


def test_coalescing_manager_and_receives_the_backend_takes_alone_keep_torchs_semantics(zpool):
    for rank, res in enumerate(zpool().run(_coalesced_and_in_order, timeout=120)):
        assert not isinstance(res, BaseException), f"rank {rank}: {res!r}"
        assert all(res.values()) and len(res) == 3 - rank % 2, (rank, res)
