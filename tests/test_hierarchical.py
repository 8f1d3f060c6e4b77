"""Hierarchical collectives and the planner over emulated nodes (ZIPCCL_TOPOLOGY=2x2 on 4 ranks,
2x3 on 6): every rank's result equals the documented summation order, computed here with plain
torch on the gathered inputs; lossless equals raw; auto's choices agree on every rank."""

from __future__ import annotations

import contextlib
import math
import os
import re

import pytest
import torch
import torch.distributed as dist

import zipccl
from zipccl.bench.common import verifiable

pytestmark = pytest.mark.timeout(600)

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def pool6():
    from workers import Pool
    p = Pool(6)
    yield p
    p.close()


@contextlib.contextmanager
def emulated(shape: str | None):
    """ZIPCCL_TOPOLOGY in this live worker (its groups are made anew, on every rank alike)."""
    old, zipccl.config.TOPOLOGY = zipccl.config.TOPOLOGY, shape
    zipccl.topology.forget()
    try:
        yield
    finally:
        zipccl.config.TOPOLOGY = old
        zipccl.topology.forget()


def data(rank: int, n: int, dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.randn(n, generator=g) * 0.02).to(dtype)


def gathered(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``x`` by plain torch.distributed (the reference's inputs)."""
    n = dist.get_world_size()
    out = torch.empty(n * x.numel(), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x.contiguous().view(-1))
    return list(out.view(n, -1))


def documented(parts: list[torch.Tensor], nodes: int, local: int, op: str) -> torch.Tensor:
    """The hierarchical order (zipccl/hierarchical.py): each node's ranks in local order with fp32
    accumulation for 16-bit types, rounded to the dtype; then the nodes in order, rounded once;
    AVG = that sum divided by the group's size."""
    dtype = parts[0].dtype
    acc_t = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    if op in ("max", "min"):
        f = torch.maximum if op == "max" else torch.minimum
        out = parts[0]
        for p in parts[1:]:
            out = f(out, p)
        return out
    node_sums = []
    for i in range(nodes):
        acc = parts[i * local].to(acc_t)
        for j in range(1, local):
            acc = acc + parts[i * local + j].to(acc_t)
        node_sums.append(acc.to(dtype))
    acc = node_sums[0].to(acc_t)
    for s in node_sums[1:]:
        acc = acc + s.to(acc_t)
    total = acc.to(dtype)
    return total / (nodes * local) if op == "avg" else total


def ints(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


LEVELS = {"raw": {"intra": "raw", "inter": "raw"}, "lossless": {"intra": "lossless", "inter": "lossless"},
          "mixed": {"intra": "raw", "inter": "lossless"}, "shm": {"intra": "shm", "inter": "lossless"}}


def _exact(rank, groups, shape, nodes, local, n):
    """Every dtype x op x collective with zipccl's own levels, against the documented order."""
    out = {}
    with emulated(shape):
        for dname, dtype in DTYPES.items():
            for oname, op in OPS.items():
                x = data(rank, n, dtype)
                parts = gathered(x)
                ref = documented(parts, nodes, local, oname)
                size = nodes * local
                inp = data(rank + 100, n * size, dtype)
                rs_ref = documented([p.view(size, n)[rank] for p in gathered(inp)], nodes, local, oname)
                for lname, codec in LEVELS.items():
                    y = x.clone()
                    zipccl.all_reduce(y, op=op, codec=codec, algorithm="hierarchical")
                    out[("ar", dname, oname, lname)] = bool(torch.equal(ints(y), ints(ref))), ints(y).tolist()
                    rs = torch.empty(n, dtype=dtype)
                    zipccl.reduce_scatter(rs, inp, op=op, codec=codec, algorithm="hierarchical")
                    out[("rs", dname, oname, lname)] = bool(torch.equal(ints(rs), ints(rs_ref))), None
            for lname, codec in LEVELS.items():
                x = data(rank, n, dtype)
                ag = torch.empty(n * nodes * local, dtype=dtype)
                zipccl.all_gather(ag, x, codec=codec, algorithm="hierarchical")
                out[("ag", dname, lname)] = bool(torch.equal(ints(ag), ints(torch.cat(gathered(x))))), None
        out["stats"] = zipccl.stats()["last"]["codec"]
    return out


def check_exact(res):
    for r in res:
        assert not isinstance(r, BaseException), r
    assert res[0]["stats"] == "hierarchical/shm+lossless"  # the last call: "shm" levels
    for key in res[0]:
        if key == "stats":
            continue
        bad = [rank for rank, r in enumerate(res) if not r[key][0]]
        assert not bad, (key, bad)  # the documented order, exactly, on every rank
        if key[0] == "ar":  # all ranks identical, and lossless == raw (implied by both equal to the reference)
            assert all(r[key][1] == res[0][key][1] for r in res)


@pytest.mark.parametrize("n", [1, 70001])  # fewer elements than ranks; pieces of several blocks, uneven
def test_2x2_equals_the_documented_order(pool, n):
    check_exact(pool.run(_exact, "2x2", 2, 2, n, timeout=500))


def test_2x3_equals_the_documented_order(pool6):
    check_exact(pool6.run(_exact, "2x3", 2, 3, 4099, timeout=500))


def _native_levels(rank, groups, shape, nodes, local, n):
    """Native levels sum in the backend's order: on values whose sums are exact in any order
    (nccl-tests' verifiable data) the result is still exactly known."""
    out = {}
    with emulated(shape):
        size = nodes * local
        for dname, dtype in DTYPES.items():
            x = verifiable(n, dtype, rank, size)
            parts = gathered(x)
            exact = torch.stack([p.double() for p in parts]).sum(0).to(dtype)
            for codec in ("native", {"intra": "native", "inter": "lossless"}):
                y = x.clone()
                zipccl.all_reduce(y, codec=codec, algorithm="hierarchical")
                out[(dname, str(codec))] = bool(torch.equal(ints(y), ints(exact)))
    return out


def test_native_levels_on_verifiable_data(pool):
    res = pool.run(_native_levels, "2x2", 2, 2, 5000, timeout=300)
    for r in res:
        assert not isinstance(r, BaseException), r
        assert all(r.values()), r


def _levels_timeouts(rank, groups):
    """A group of the whole job made with a 7 s timeout, its first hierarchical call on two
    emulated nodes: the timeouts of its levels and of its second gloo group (torch's new_group
    gives a group its backend's default, 30 minutes, unless told)."""
    import datetime

    from zipccl.transport import torch_dist
    g = dist.new_group(list(range(4)), timeout=datetime.timedelta(seconds=7))
    with emulated("2x2"):
        x = torch.ones(5000)
        zipccl.all_reduce(x, group=g, codec="lossless", algorithm="hierarchical")
        lv, cpu = zipccl.topology.levels(g), torch.device("cpu")
        made = [torch_dist._own_timeout(h, cpu) for h in (lv.intra, lv.inter, torch_dist._twin(g))]
    dist.destroy_process_group(g)
    return bool((x == 4).all()), made


def test_levels_keep_their_groups_timeout(pool):
    """A rank that stops inside a level is waited for as long as on the group itself, not 30 minutes."""
    res = pool.run(_levels_timeouts, timeout=120)
    assert res == [(True, [7.0, 7.0, 7.0])] * 4, res


def _auto(rank, groups, shape, calls):
    """codec="auto" on two levels: every plan is tried, the same way on every rank, and every
    result is exact (verifiable data: all plans give the same bits)."""
    used, ok = [], True
    with emulated(shape):
        x0 = verifiable(1 << 20, torch.bfloat16, rank, 4)  # 2 MiB: above the probe floor
        exact = torch.stack([p.double() for p in gathered(x0)]).sum(0).to(torch.bfloat16)
        for _ in range(calls):
            x = x0.clone()
            zipccl.all_reduce(x)
            used.append(zipccl.stats()["last"]["codec"])
            ok &= bool(torch.equal(ints(x), ints(exact)))
        lines = zipccl.collectives.auto_policy().explain()
    return used, ok, lines


def test_auto_tries_hierarchical_plans_identically_on_every_rank(pool):
    res = pool.run(_auto, "2x2", 14, timeout=300)
    for r in res:
        assert not isinstance(r, BaseException), r
    used = res[0][0]
    assert all(r[0] == used for r in res) and all(r[1] for r in res)
    assert set(used[:12]) == {"native", "raw", "lossless", "hierarchical/shm+native",
                              "hierarchical/shm+raw", "hierarchical/shm+lossless"}
    assert any("hierarchical/lossless" in line for line in res[0][2])


def _auto_on_new_nodes(rank, groups):
    """The same call signature on one node, then, the nodes found anew, on two: auto's plans
    follow the nodes found, not those of the signature's first call."""
    x0 = verifiable(3 << 19, torch.float16, rank, 4)  # 3 MiB: above the probe floor, a class no other test uses
    used = {}
    for shape in ("1x4", "2x2"):
        with emulated(shape):
            used[shape] = set()
            for _ in range(12):
                x = x0.clone()
                zipccl.all_reduce(x)
                used[shape].add(zipccl.stats()["last"]["codec"])
    return used


def test_auto_follows_the_nodes_found_anew(pool):
    res = pool.run(_auto_on_new_nodes, timeout=300)
    for r in res:
        assert not isinstance(r, BaseException), r
        assert r["1x4"] and not any(p.startswith("hierarchical") for p in r["1x4"]), r
        assert any(p.startswith("hierarchical") for p in r["2x2"]), r


def _first_call_async_on_some_ranks(rank, groups):
    """A new group's first call, async on ranks 0 and 2 and not on 1 and 3 (torch lets each rank
    choose), over two emulated nodes: the groups that call makes (gloo's second group, the
    nodes' levels) are made in one order on every rank, and a small call (64 KiB: the group's own collective
    alone) makes none on either. Data whose sums are exact in any order."""
    out = []
    for case in ("auto", "small", "lossy"):  # auto's call, one below its probe floor, a named top-k call
        lossy = case == "lossy"
        g = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
        x = verifiable(1 << 19 if case == "auto" else 1 << 14, torch.float32, rank, 4) if not lossy else \
            torch.randn(256, 256, generator=torch.Generator().manual_seed(rank))  # a matrix: the rules let it go lossy
        parts = gathered(x)
        if lossy:  # each rank's 1% largest magnitudes (the first call: no residual yet), summed in rank order
            for p in parts:
                p[p.abs() < p.abs().topk(math.ceil(0.01 * p.numel())).values[-1]] = 0.0
        want = torch.stack(parts).sum(0)
        try:
            with emulated("2x2"):
                kwargs = dict(codec="topk", name="w") if lossy else {}
                work = zipccl.all_reduce(x, group=g, async_op=rank % 2 == 0, **kwargs)
                if work is not None:
                    work.wait()
                out.append(torch.equal(x.reshape(-1), want))
        finally:
            dist.destroy_process_group(g)
    return out


def test_a_first_call_async_on_some_ranks_only(pool):
    assert pool.run(_first_call_async_on_some_ranks, timeout=120) == [[True, True, True]] * 4


def _refusals(rank, groups, case):
    try:
        if case == "no_levels":  # one node (no override): nothing to be hierarchical over
            with emulated(None):
                zipccl.all_reduce(torch.ones(10), codec="raw", algorithm="hierarchical")
        elif case == "bad_algorithm":
            zipccl.all_reduce(torch.ones(10), algorithm="tree")
        elif case == "bad_levels":
            zipccl.all_reduce(torch.ones(10), codec={"intra": "raw"}, algorithm="hierarchical")
        elif case == "single_level_mapping":  # one node: the mapping's "intra" codec runs flat
            with emulated(None):
                x = torch.full((10,), float(rank))
                zipccl.all_reduce(x, codec={"intra": "lossless", "inter": "raw"})
                return "ok", zipccl.stats()["last"]["codec"], x.tolist()
    except Exception as e:
        return type(e).__name__, str(e)
    return "ok", None


@pytest.mark.parametrize("case,expected", [("no_levels", "UnsupportedError"), ("bad_algorithm", "ValueError"),
                                           ("bad_levels", "ValueError"), ("single_level_mapping", "ok")])
def test_refusals_are_clear_and_the_same_on_every_rank(pool, case, expected):
    res = pool.run(_refusals, case, timeout=120)
    assert all(r[0] == expected for r in res), res
    if case == "no_levels":
        assert "several nodes" in res[0][1]
    if case == "single_level_mapping":
        assert all(r[1] == "lossless" and r[2] == [6.0] * 10 for r in res), res


def _interleaved(rank, groups, nodes):
    """Nodes whose ranks interleave (``nodes``, as a host layout could give them): levels only
    where each local rank's group across the nodes is in node order, which torch's ascending group
    ranks keep; else a hierarchical call is refused on every rank, and auto keeps to flat plans."""
    from zipccl import topology as T
    T.forget()
    found = T.topology()
    with T._lock:
        T._found[T._group_key(None)] = T.Topology(nodes, found.source, found.link)
    try:
        made = T.levels() is not None
        try:
            zipccl.all_reduce(torch.ones(10), codec="raw", algorithm="hierarchical")
            refused = None
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            refused = type(e).__name__
        return made, refused
    finally:
        T.forget()


@pytest.mark.parametrize("nodes,made", [(((0, 3), (1, 2)), False), (((0, 2), (1, 3)), True)])
def test_nodes_of_interleaved_ranks_have_levels_only_in_node_order(pool, nodes, made):
    res = pool.run(_interleaved, nodes, timeout=120)
    assert res == [(made, None if made else "UnsupportedError")] * 4, res


def _unsorted(rank, groups, order):
    """A group of the whole job made with its ranks in ``order`` (new_group's sort_ranks=False),
    two emulated nodes: levels only where each node's group numbers its ranks in local order
    (then every hierarchical collective equal to torch's on the group, bit for bit); elsewhere
    a hierarchical call refused on every rank, and the flat ones torch's."""
    from test_alltoall import nodes

    from zipccl import topology as T
    g = dist.new_group(order, sort_ranks=False)
    try:
        with nodes(g, "2x2"):
            made = T.levels(g) is not None
            how = dict(group=g, codec={"intra": "raw", "inter": "raw"}, algorithm="hierarchical") if made else \
                dict(group=g, codec="raw", algorithm="flat")
            me, n = dist.get_rank(g), 8
            x = torch.arange(4 * n, dtype=torch.float32) * (rank + 1) + 100 * rank
            want, got = torch.empty(n), torch.empty(n)
            dist.reduce_scatter_tensor(want, x.clone(), group=g)
            zipccl.reduce_scatter(got, x.clone(), **how)
            same = torch.equal(got, want)
            want, got = torch.empty(4 * n), torch.empty(4 * n)
            dist.all_gather_into_tensor(want, x[:n].clone(), group=g)
            zipccl.all_gather(got, x[:n].clone(), **how)
            same &= torch.equal(got, want)
            want, got = x.clone(), x.clone()
            dist.all_reduce(want, group=g)
            zipccl.all_reduce(got, **how)
            same &= torch.equal(got, want)
            refused = None
            if not made:
                try:
                    zipccl.all_reduce(x.clone(), group=g, codec={"intra": "raw", "inter": "raw"},
                                      algorithm="hierarchical")
                except Exception as e:  # noqa: BLE001 - the test asserts on it
                    refused = type(e).__name__
            return me, made, same, refused
    finally:
        dist.destroy_process_group(g)


@pytest.mark.parametrize("order,made", [([0, 1, 2, 3], True), ([2, 3, 0, 1], True), ([1, 0, 2, 3], False),
                                        ([1, 0, 3, 2], False)])
def test_a_group_of_unsorted_ranks_has_levels_only_in_local_order(pool, order, made):
    res = pool.run(_unsorted, order, timeout=120)
    assert [r[0] for r in res] == [order.index(rank) for rank in range(4)], res
    assert all(r[1:] == (made, True, None if made else "UnsupportedError") for r in res), res


def _levels_of_one_node(rank, groups):
    """A per-level codec on a group of one level: one node takes its "intra" codec ("shm": the
    backend's own collective), nodes of one rank their "inter" one; the sums are plain torch's
    (whole numbers: exact in any order)."""
    def whole(r: int) -> torch.Tensor:
        return torch.randint(-100, 100, (5000,), generator=torch.Generator().manual_seed(r)).float()
    out = []
    for shape, codec in (("1x4", {"intra": "shm", "inter": "raw"}), ("1x4", {"intra": "lossless", "inter": "raw"}),
                         ("4x1", {"intra": "shm", "inter": "lossless"})):
        with emulated(shape):
            x = whole(rank)
            try:
                zipccl.all_reduce(x, codec=codec)
            except Exception as e:
                out.append(f"{type(e).__name__}: {e}")
                continue
            out.append((torch.equal(x, sum(whole(r) for r in range(4))), zipccl.stats()["last"]["codec"]))
    return out


def test_a_per_level_codec_on_a_group_of_one_level(pool):
    want = [(True, "native"), (True, "lossless"), (True, "lossless")]
    assert pool.run(_levels_of_one_node, timeout=120) == [want] * 4


_ACROSS: list = []  # this worker's group of ranks 1 and 3, made once by every rank


def _groups_of_some_ranks(rank, groups):
    """ZIPCCL_TOPOLOGY describes the job's ranks: a group of some of them (ranks 0 and 1, one
    node; ranks 1 and 3, one on each) finds its nodes from their ranks in the job, and auto's
    all-reduce of 2 MiB on it sums as plain torch does."""
    if not _ACROSS:
        _ACROSS.append(dist.new_group([1, 3]))
    out = []
    with emulated("2x2"):
        for g, members in ((groups[2], [0, 1]), (_ACROSS[0], [1, 3])):
            if rank not in members:
                out.append(None)
                continue
            x = data(rank, 1 << 19, torch.float32)
            want = data(members[0], 1 << 19, torch.float32) + data(members[1], 1 << 19, torch.float32)
            try:
                zipccl.all_reduce(x, group=g)
            except Exception as e:
                out.append(f"{type(e).__name__}: {e}")
                continue
            out.append((zipccl.topology.topology(g).nodes, torch.equal(x, want)))
    return out


def test_a_group_of_some_ranks_finds_its_nodes_from_their_ranks_in_the_job(pool):
    one, across = (((0, 1),), True), (((0,), (1,)), True)
    assert pool.run(_groups_of_some_ranks, timeout=120) == [[one, None], [one, across], [None, None], [None, across]]


def _disagree(rank, groups):
    """Rank 3 believes in another topology: every rank raises MismatchError, none hangs."""
    with emulated("2x2" if rank != 3 else "1x4"):
        try:
            zipccl.topology.topology()
        except Exception as e:
            return type(e).__name__, str(e)
    return "ok", ""


def test_topology_disagreement_raises_on_every_rank(pool):
    res = pool.run(_disagree, timeout=60)
    assert all(r[0] == "MismatchError" and "ZIPCCL_TOPOLOGY" in r[1] for r in res), res


def _shm_off_on_one_rank(rank, groups):
    """Rank 3 has ZIPCCL_SHM=0: the ranks that allow shared memory would set it up with each
    other, without rank 3, and wait for good; every rank raises when the nodes are found."""
    old, zipccl.config.SHM = zipccl.config.SHM, rank != 3
    try:
        with emulated("2x2"):
            try:
                zipccl.all_reduce(torch.ones(64), codec="raw", algorithm="hierarchical")
            except Exception as e:
                return type(e).__name__, str(e)
    finally:
        zipccl.config.SHM = old
    return "ok", ""


def test_a_rank_without_shared_memory_makes_every_rank_raise(pool):
    res = pool.run(_shm_off_on_one_rank, timeout=60)
    assert all(r == ("MismatchError", "ranks disagree on ZIPCCL_SHM: ranks [3] have it off, the others on")
               for r in res), res


def _a_setting_on_one_rank(rank, groups, name, value):
    """Rank 2 alone has config ``name`` at ``value``: what the group's first auto call of a size
    that auto measures (4 MiB) gave each rank."""
    old = getattr(zipccl.config, name)
    if rank == 2:
        setattr(zipccl.config, name, value)
    try:
        with emulated("2x2"):
            try:
                zipccl.all_reduce(torch.ones(1 << 20))
            except Exception as e:  # noqa: BLE001 - the test reads it
                return type(e).__name__, str(e)
    finally:
        setattr(zipccl.config, name, old)
    return "ok", ""


@pytest.mark.parametrize("name,value,told", [
    ("CHECK_NATIVE", True, "ZIPCCL_CHECK_NATIVE: ranks [0, 1, 3]: ZIPCCL_CHECK_NATIVE=0; ranks [2]: ZIPCCL_CHECK_NATIVE=1"),
    ("AUTO_LEARN", False, "ZIPCCL_AUTO_LEARN: ranks [0, 1, 3]: ZIPCCL_AUTO_LEARN=1; ranks [2]: ZIPCCL_AUTO_LEARN=0"),
    ("TRANSPORT", "torch", "ZIPCCL_TRANSPORT: ranks [0, 1, 3]: ZIPCCL_TRANSPORT=auto; ranks [2]: ZIPCCL_TRANSPORT=torch"),
])
def test_ranks_that_disagree_on_a_setting_their_calls_share_raise_on_every_rank(pool, name, value, told):
    """One rank checking native calls (an exchange its peers never enter), or not learning where
    they learn, would wait for good: the ranks compare these settings as they find their nodes."""
    res = pool.run(_a_setting_on_one_rank, name, value, timeout=60)
    assert all(r == ("MismatchError", f"ranks disagree on {told}") for r in res), res


def _invalid_on_one_rank(rank, groups, inter):
    """Rank 0's tensor is not contiguous: with a zipccl level between nodes (or with
    ZIPCCL_CHECK_NATIVE=1) the whole group's exchange makes every rank raise, none hangs."""
    old, zipccl.config.CHECK_NATIVE = zipccl.config.CHECK_NATIVE, inter == "native"
    try:
        with emulated("2x2"):
            x = torch.ones(64, 2)[:, 0] if rank == 0 else torch.ones(64)
            zipccl.all_reduce(x, codec={"intra": "shm", "inter": inter}, algorithm="hierarchical")
    except Exception as e:
        return type(e).__name__
    finally:
        zipccl.config.CHECK_NATIVE = old
    return "ok"


@pytest.mark.parametrize("inter", ["lossless", "native"])
def test_an_invalid_call_raises_on_every_rank(pool, inter):
    res = pool.run(_invalid_on_one_rank, inter, timeout=60)
    assert res == ["UnsupportedError", "MismatchError", "MismatchError", "MismatchError"], res


def test_the_arrangement_index_is_made_on_the_tensors_device():
    """index_copy_ takes no index from another device: on an H100 the all-gather of CUDA tensors
    failed with a CPU index. The index follows the device asked for (meta stands in for CUDA)."""
    from types import SimpleNamespace
    from zipccl.hierarchical import _arrangement
    levels = SimpleNamespace(topology=SimpleNamespace(nodes=[[0, 1], [2, 3]]))
    index = _arrangement(levels, torch.device("meta"))
    assert index.device.type == "meta" and index.shape == (4,)
    assert _arrangement(levels, torch.device("cpu")).tolist() == [0, 2, 1, 3]


_FULL_SHM = """
import os, sys
import torch
import torch.distributed as dist
from zipccl.transport import shm
shm._DIR = sys.argv[1]
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
memory = shm.NodeMemory.available(dist.group.WORLD, 0, 1, agree=lambda ok: ok)
print("mapped:", memory is not None)
try:
    memory.stage(torch.ones(1 << 20))  # 4 MiB a half-slot, in a file system of 1 MiB
except OSError as e:
    print("refused:", e)
print("left:", os.listdir(sys.argv[1]))
dist.destroy_process_group()  # gloo's threads ended before the interpreter's: an abort at exit otherwise, under load
"""


def test_a_full_dev_shm_raises_instead_of_killing_the_ranks(tmp_path):
    """/dev/shm too small for the area (a container's 64 MiB; here a tmpfs of 1 MiB in a mount
    namespace of the test's own): the growth is refused with OSError, as the collectives expect,
    and no file is left; not SIGBUS at the first write into pages tmpfs cannot back."""
    import subprocess
    import sys
    d = tmp_path / "shm"
    d.mkdir()
    r = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1M zipccl-test "$0" && exec "$1" -c "$2" "$0"',
                        str(d), sys.executable, _FULL_SHM], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "mapped: True" in r.stdout and "refused: the node's shared memory could not grow" in r.stdout, r.stdout
    assert "left: []" in r.stdout, r.stdout


def _auto_beside_a_small_dev_shm(rank, groups):
    """Two emulated nodes, a new group (its own levels and policy); /dev/shm on node 1 too small
    for an area over 1 MiB (its local rank 0's allocation refused, as a full tmpfs refuses it):
    16 auto all-reduces of 4 MiB of fp32. The call whose shared-memory plan cannot grow its area
    raises on every rank; auto's later hierarchical calls keep the node level to the backend's
    collective, and give torch's sums (whole numbers: exact in any order)."""
    from test_alltoall import nodes

    from zipccl.errors import RankFailure
    from zipccl.transport import shm
    real = shm._allocate

    def small(path: str, size: int) -> None:
        if size > 1 << 20:
            raise OSError(28, "No space left on device")
        real(path, size)

    g = dist.new_group([0, 1, 2, 3])
    shm._allocate = small if rank == 2 else real
    outcomes = []
    try:
        with nodes(g, "2x2"):
            x = (torch.arange(1 << 20, dtype=torch.float32) % 97) * (rank + 1)
            want = x.clone()
            dist.all_reduce(want, group=g)
            for _ in range(16):
                got = x.clone()
                try:
                    zipccl.all_reduce(got, group=g)
                    outcomes.append("same" if torch.equal(got, want) else "wrong")
                except RankFailure as e:
                    outcomes.append(e.kind)
        return outcomes
    finally:
        shm._allocate = real
        dist.destroy_process_group(g)


def test_auto_keeps_to_the_backend_inside_a_node_once_its_shared_memory_could_not_grow(pool):
    res = pool.run(_auto_beside_a_small_dev_shm, timeout=180)
    assert all(r == res[0] for r in res), res
    assert res[0].count("memory") == 1 and res[0].count("same") == 15, res[0]


def test_an_area_left_by_a_killed_maker_is_removed_by_the_next(tmp_path, monkeypatch):
    """An area file names the process that made it; the next area made on the machine removes
    the files of makers that are gone, once older than a minute (not a live process's, not a
    young one's, not a file of another name)."""
    import subprocess
    import time

    import torch.distributed as dist
    from zipccl.transport import shm
    monkeypatch.setattr(shm, "_DIR", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    token = "0123456789abcdef" * 2
    files = {"dead, old": f"zipccl-{gone.pid}-{token}-0", "dead, young": f"zipccl-{gone.pid}-{token}-1",
             "live, old": f"zipccl-{os.getpid()}-{token}-0", "another name": f"zipccl-x{gone.pid}-{token}-0"}
    for what, name in files.items():
        (tmp_path / name).write_bytes(b"area")
        if what != "dead, young":
            os.utime(tmp_path / name, (time.time() - 120, time.time() - 120))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        memory = shm.NodeMemory.available(dist.group.WORLD, 0, 1, lambda ok: ok)
        assert memory is not None and re.fullmatch(rf"zipccl-{os.getpid()}-[0-9a-f]{{32}}", memory.name), memory.name
    finally:
        if created:
            dist.destroy_process_group()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for w, n in files.items() if w != "dead, old")


def test_an_area_is_unlinked_where_a_barrier_breaks(tmp_path, monkeypatch):
    """A peer lost while the area grows (the barrier after the mapping raises): local rank 0
    still unlinks the file, so nothing is left in /dev/shm."""
    import torch.distributed as dist
    from zipccl.transport import shm
    monkeypatch.setattr(shm, "_DIR", str(tmp_path))
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        memory = shm.NodeMemory(dist.group.WORLD, 0, 2, "zipccl-test")
        calls = []

        def barrier():
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("a peer is gone")

        monkeypatch.setattr(memory, "_barrier", barrier)
        with pytest.raises(RuntimeError, match="a peer is gone"):
            memory._map(4096)
        assert len(calls) == 2 and os.listdir(tmp_path) == []
    finally:
        if created:
            dist.destroy_process_group()


def _one_rank_invalid(rank, groups, shape, kwargs):
    """Rank 0's call is invalid (a strided tensor) where its peers' valid calls go hierarchical
    with the group's own collective between the nodes (auto's first hierarchical plan, or a
    mapping's "inter": "native"), or are refused for want of levels: every rank raises at once,
    and the group's next call is right on every rank."""
    import time
    n = 1 << 14
    x = torch.ones(2 * n)[::2] if rank == 0 else torch.ones(n)
    with emulated(shape):
        t0 = time.monotonic()
        try:
            zipccl.all_reduce(x, **kwargs)
            first = "no error"
        except Exception as e:  # noqa: BLE001 - the test compares them
            first = f"{type(e).__name__}: {e}"
        took = time.monotonic() - t0
        y = torch.full((n,), float(rank + 1))
        zipccl.all_reduce(y, codec="raw")
    return first, took < 20, bool((y == 10).all())


@pytest.mark.parametrize("shape,kwargs", [("2x2", dict(algorithm="hierarchical")),
                                          ("2x2", dict(codec={"intra": "raw", "inter": "native"})),
                                          (None, dict(algorithm="hierarchical"))],
                         ids=["auto-hierarchical", "inter-native", "no-levels"])
def test_an_invalid_call_where_the_peers_go_hierarchical_raises_on_every_rank_at_once(pool, shape, kwargs):
    res = pool.run(_one_rank_invalid, shape, kwargs, timeout=120)
    for rank, r in enumerate(res):
        assert not isinstance(r, BaseException), (rank, r)
        assert r[0] != "no error" and r[1:] == (True, True), (rank, r)
    if shape is None:  # no rank waits for another: each raises its own error, the valid ones the levels'
        assert "several nodes" not in res[0][0] and all(r[0].startswith("UnsupportedError: algorithm 'hier")
                                                         for r in res[1:]), res


def _one_rank_differs(rank, groups, case):
    """On 2x2, rank 0's hierarchical call differs from its peers' where the plans' names once
    agreed, so the whole group's exchange passed and the levels parted, each waiting for good:
    ``raw``: rank 0's levels go through zipccl's exchange ("raw" on an int tensor), its peers'
    are the backend's collective alone ("native"); ``nameless``: rank 0's levels are a user's
    codec without a name, its peers' "native" (both were named "native"); ``setting``: rank
    0's intra-node level checksums its packets, its peers' does not (one name, another wire:
    rank 0's node raised at its level while the other waited at the next). Then a call that
    agrees: plain torch's sum."""
    from zipccl.codecs import Lossless
    from workers import UserCodec
    n = 1 << 10
    dtype = torch.int32 if case == "raw" else torch.float32
    if case == "setting":
        agreed = {"intra": Lossless(checksum=True), "inter": "lossless"}
        mine = agreed if rank == 0 else {"intra": "lossless", "inter": "lossless"}
    else:
        agreed = "native"
        mine = {"raw": "raw", "nameless": UserCodec(name=None)}[case] if rank == 0 else agreed
    x = torch.arange(n, dtype=dtype) * (rank + 1)
    with emulated("2x2"):
        try:
            zipccl.all_reduce(x, codec=mine, algorithm="hierarchical")
            first = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads it
            first = type(e).__name__
        y = torch.arange(n, dtype=dtype) * (rank + 1)
        zipccl.all_reduce(y, codec=agreed, algorithm="hierarchical")
    return first, torch.equal(y, torch.arange(n, dtype=dtype) * 10)


@pytest.mark.parametrize("case", ["raw", "nameless", "setting"])
def test_a_rank_whose_levels_differ_raises_on_every_rank(pool, case):
    res = pool.run(_one_rank_differs, case, timeout=60)
    assert res == [("MismatchError", True)] * 4, res
