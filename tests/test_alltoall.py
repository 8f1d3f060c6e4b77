"""zipccl.all_to_all_single and all_to_all on 4 gloo ranks of the pool (tests/workers.py), against
torch's own dist.all_to_all_single and dist.all_to_all on the same inputs, bit for bit: bf16,
fp16 and fp32 activations of a small GPT and real gradients, even, uneven and zero splits, every
codec; mismatches and failures on one rank raising on every rank; async handles."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import zipccl
from zipccl.collectives import pipeline as P
from test_collectives import piece_bytes

pytestmark = pytest.mark.timeout(300)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CODECS = {"raw": "raw", "lossless": "lossless", "auto": "auto", "links": {"intra": "native", "inter": "lossless"}}
ROOT = Path(__file__).resolve().parents[1]


def activations(numel: int, seed: int = 0, grads: bool = False) -> torch.Tensor:
    """Hidden states (or their gradients) of examples/train_gpt.py's GPT, fp32 (bench/activations.py)."""
    spec = importlib.util.spec_from_file_location("activations", ROOT / "bench" / "activations.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.hidden_states(numel, seed, d=64, layers=2, ctx=32, grads=grads)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.int16 if x.element_size() == 2 else torch.int32)


@contextlib.contextmanager
def nodes(group, shape: str | None):
    """ZIPCCL_TOPOLOGY=shape for the calls inside, in this worker (the pool lives on)."""
    from zipccl import topology
    old = zipccl.config.TOPOLOGY
    zipccl.config.TOPOLOGY = shape
    topology.forget(group)
    try:
        yield
    finally:
        zipccl.config.TOPOLOGY = old
        topology.forget(group)


def _counts(kind: str, n: int):
    """count(i, j): rows rank i sends to rank j."""
    if kind == "even":
        return lambda i, j: 24
    if kind == "uneven":
        return lambda i, j: 3 * i + 5 * j + 1
    return lambda i, j: 0 if j == (i + 1) % n or i == 2 else 7 * (i + j) + 2  # zero: rank 2 sends nothing


def _source(rank, data, seed):
    """This rank's values: the shared tensor's slice for the rank (real data differ per rank)."""
    return data.roll(seed * 7919 + rank * 104729)


def _compare(rank, groups, data_kind, codec_key, shape, path):
    """Every dtype x split kind x form: zipccl's result and torch's on the same inputs (gloo), as
    bit patterns; the bytes zipccl sent; the plans it ran."""
    g, n, width = groups[4], 4, 5
    data = torch.from_numpy(np.load(path)).float() if data_kind == "grads" else activations(1 << 16)
    codec = CODECS[codec_key]
    out, stats = {}, {}
    with nodes(g, shape):
        for dname, dtype in DTYPES.items():
            for split in ("even", "uneven", "zero"):
                count = _counts(split, n)
                ins = [count(rank, j) for j in range(n)]
                outs = [count(j, rank) for j in range(n)]
                x = _source(rank, data, len(out))[:sum(ins) * width].reshape(-1, width).to(dtype)
                want = torch.empty(sum(outs), width, dtype=dtype)
                dist.all_to_all_single(want, x, outs, ins, group=g)
                got = torch.full_like(want, float("nan"))
                zipccl.reset_stats()
                if split == "even":
                    zipccl.all_to_all_single(got, x, group=g, codec=codec)
                else:
                    zipccl.all_to_all_single(got, x, outs, ins, group=g, codec=codec)
                s = zipccl.stats()["all_to_all"]
                out[(dname, split, "single")] = torch.equal(bits(got), bits(want))
                stats[(dname, split)] = (s["raw_bytes"], s["wire_bytes"], zipccl.stats()["last"]["codec"])
                # the list form, on the same parts
                xs = list(x.split(ins))
                wants = list(want.split(outs))
                gots = [torch.full_like(w, float("nan")) for w in wants]
                zipccl.all_to_all(gots, xs, group=g, codec=codec)
                ref = [torch.empty_like(w) for w in wants]
                if split == "even":  # gloo's list form takes one size only
                    dist.all_to_all(ref, xs, group=g)
                else:
                    ref = wants
                out[(dname, split, "list")] = all(torch.equal(bits(a), bits(b)) and torch.equal(bits(a), bits(c))
                                                  for a, b, c in zip(gots, ref, wants))
    return out, stats


@pytest.mark.parametrize("codec", ["raw", "lossless", "auto", "links"])
@pytest.mark.parametrize("data_kind", ["activations", "grads"])
def test_matches_torch_bit_for_bit(pool, real_grads, codec, data_kind):
    """On one node (auto: the backend's all-to-all) and on 2 emulated nodes of 2 ranks (links:
    plain bytes inside the node, lossless across)."""
    from conftest import GRADS
    shape = "2x2" if codec == "links" else None
    for rank, res in enumerate(pool.run(_compare, data_kind, codec, shape, str(GRADS), timeout=240)):
        assert not isinstance(res, BaseException), f"rank {rank}: {res!r}"
        same, stats = res
        assert all(same.values()), (rank, [k for k, v in same.items() if not v])
        for (dname, split), (raw, wire, plan) in stats.items():
            if codec == "raw":  # the tensor's own bytes: no packet, no header
                assert plan == "plain" and wire == raw, (dname, split, raw, wire)
            if codec == "auto":
                assert plan == "native" and wire == 0  # one node: the backend's all-to-all
            if codec == "links":
                assert plan == "links/plain+lossless", plan


def _pipelined(rank, groups):
    """2 MiB of bf16 activations per rank in pieces of 256 KiB, uneven: several rounds, two deep."""
    g, n = groups[4], 4
    ins = [(1 << 18) + 4096 * (rank + 3 * j) for j in range(n)]
    outs = [(1 << 18) + 4096 * (j + 3 * rank) for j in range(n)]
    x = activations(sum(ins), seed=rank).to(torch.bfloat16)
    want = torch.empty(sum(outs), dtype=torch.bfloat16)
    dist.all_to_all_single(want, x, outs, ins, group=g)
    got = torch.empty_like(want)
    zipccl.reset_stats()
    with piece_bytes(1 << 18):
        rounds = len(P.pieces(ins[0], n, 2))
        zipccl.all_to_all_single(got, x, outs, ins, group=g, codec="lossless")
    s = zipccl.stats()["all_to_all"]
    return rounds, torch.equal(bits(got), bits(want)), s["wire_bytes"] / s["raw_bytes"]


def test_pipelined_in_rounds(pool):
    """Several rounds of pieces, uneven: torch's bits, in about two thirds of the bytes."""
    for rank, res in enumerate(pool.run(_pipelined, timeout=240)):
        assert not isinstance(res, BaseException), f"rank {rank}: {res!r}"
        rounds, same, ratio = res
        assert rounds > 2 and same and ratio < 0.72, (rank, rounds, ratio)


def _auto_learns(rank, groups):
    """2 emulated nodes: auto tries the backend's call, lossless everywhere and lossless across
    nodes only, the same way on every rank, each result torch's bits."""
    g = groups[4]
    x = activations(1 << 20, seed=rank).to(torch.bfloat16)  # 2 MiB per rank: above the probe floor
    want = torch.empty_like(x)
    dist.all_to_all_single(want, x, group=g)
    used, same = [], True
    with nodes(g, "2x2"):
        for _ in range(6):
            got = torch.empty_like(x)
            zipccl.all_to_all_single(got, x, group=g)
            used.append(zipccl.stats()["last"]["codec"])
            same &= torch.equal(bits(got), bits(want))
    return used, same


def test_auto_tries_each_plan_alike_on_every_rank(pool):
    res = pool.run(_auto_learns, timeout=240)
    for r in res:
        assert not isinstance(r, BaseException), r
    assert all(r == res[0] for r in res), res
    used, same = res[0]
    assert same and used == ["native", "lossless", "links/plain+lossless"] * 2, used


def _mismatch(rank, groups, case):
    g, n = groups[4], 4
    ins, outs, dtype = [16] * n, [16] * n, torch.bfloat16
    x = torch.arange(64, dtype=torch.float32)
    if case in ("counts", "list counts") and rank == 2:
        outs = [16, 16, 16, 17]  # expects 17 from rank 3, which sends 16
    if case == "dtype" and rank == 1:
        dtype = torch.float32
    y = torch.empty(sum(outs), dtype=dtype)
    try:
        if case == "list counts":
            zipccl.all_to_all(list(y.split(outs)), list(x.to(dtype).split(ins)), group=g, codec="lossless")
            return "ok", ""
        zipccl.all_to_all_single(y, x.to(dtype) if case != "noncontig" or rank else torch.zeros(64, 2)[:, 0],
                                 outs, ins, group=g, codec="lossless")
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return type(e).__name__, str(e)
    return "ok", ""


def _healthy(rank, groups):
    g = groups[4]
    x = torch.arange(8, dtype=torch.bfloat16) + 8 * rank
    y = torch.empty_like(x)
    zipccl.all_to_all_single(y, x, group=g, codec="lossless")
    return torch.equal(y, torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.bfloat16) + 8 * j
                                     for j in range(4)]))


@pytest.mark.parametrize("case", ["counts", "list counts", "dtype"])
def test_mismatches_raise_on_every_rank(pool, case):
    """A count that rank 2 expects from rank 3 but rank 3 does not send, or a dtype: the same
    MismatchError on every rank, before any data moves; the group works afterwards."""
    res = pool.run(_mismatch, case, timeout=120)
    assert all(r[0] == "MismatchError" for r in res), res
    assert len({r[1] for r in res}) == 1, res
    if case != "dtype":
        assert "rank 3 sends 16 elements to rank 2, which expects 17 from it" in res[0][1], res
    else:
        assert "dtype" in res[0][1], res
    assert all(h is True for h in pool.run(_healthy, timeout=120))


def test_an_invalid_call_raises_on_every_rank(pool):
    """Rank 0 passes a strided input: its own error there, MismatchError on the others."""
    res = pool.run(_mismatch, "noncontig", timeout=120)
    assert res[0] == ("UnsupportedError", "input must be contiguous"), res
    assert all(r[0] == "MismatchError" and "rank(s) [0]" in r[1] for r in res[1:]), res
    assert all(h is True for h in pool.run(_healthy, timeout=120))


def _invalid_under_auto(rank, groups):
    """Codec "auto" on one node is the backend's all-to-all, decided without an exchange: rank 1's
    invalid splits raise there at once, as the backend's call would, and rank 1 then makes the
    valid call that the others are waiting in."""
    import time
    g = groups[4]
    x = torch.arange(8, dtype=torch.bfloat16) + 8 * rank
    y = torch.empty_like(x)
    timeout, zipccl.config.TIMEOUT = zipccl.config.TIMEOUT, 20.0  # an exchange nobody joins: RankFailure, not a hang
    try:
        if rank == 1:
            said = []
            for call in (lambda: zipccl.all_to_all_single(y, x, [4, 3, 0, 2], None, group=g),
                         lambda: zipccl.all_to_all_single(y, x, [3, 1, 2, 2], [2, 2, 2, 2], group=g),
                         lambda: zipccl.all_to_all(list(torch.empty(7, dtype=x.dtype).split([2, 1, 2, 2])), list(x.split(2)),
                                                   group=g)):
                t0 = time.monotonic()
                try:
                    call()
                    said.append(("no error",))
                except Exception as e:  # noqa: BLE001 - the test asserts on it
                    said.append((type(e).__name__, str(e), time.monotonic() - t0))
            dist.all_to_all_single(y, x, group=g)
            return said
        zipccl.all_to_all_single(y, x, group=g)
        return torch.equal(y, torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.bfloat16) + 8 * j
                                         for j in range(4)]))
    finally:
        zipccl.config.TIMEOUT = timeout


def test_an_invalid_call_under_auto_on_one_node_fails_as_the_backends(pool):
    """Rank 1's invalid calls: splits that do not add up, and (single and list forms) a part for
    itself that it would not receive as sent (gloo raises that as a lost connection)."""
    res = pool.run(_invalid_under_auto, timeout=120)
    (kind, text, seconds), *own = res[1]
    assert kind == "ValueError" and "output split sizes [4, 3, 0, 2]" in text and seconds < 5, res[1]
    for said in own:
        assert said[0] == "ValueError" and "rank 1 sends itself 2 elements but receives 1" in said[1] \
            and said[2] < 5, res[1]
    assert res[0] is res[2] is res[3] is True, res


def _own_part_wrong_in_a_subgroup(rank, groups):
    """On a group of job ranks 2 and 3, rank 3 (the group's rank 1) would not receive from itself
    what it sends itself, compressed (lossless: its peer raises MismatchError) and natively
    (auto on one node: at once); each error names it by its rank in the job, as its peer's does."""
    g = dist.new_group([2, 3])
    if rank < 2:
        return None
    timeout, zipccl.config.TIMEOUT = zipccl.config.TIMEOUT, 20.0
    said = []
    try:
        x = torch.arange(4, dtype=torch.bfloat16) + 4 * rank
        for codec in ("lossless", "auto") if rank == 3 else ("lossless",):  # auto raises before any exchange
            y = torch.empty(4 if rank == 2 else 3, dtype=x.dtype)
            outs = None if rank == 2 else [2, 1]
            try:
                zipccl.all_to_all_single(y, x, outs, None, group=g, codec=codec)
                said.append(("no error",))
            except Exception as e:  # noqa: BLE001 - the test asserts on it
                said.append((type(e).__name__, str(e)))
        return said
    finally:
        zipccl.config.TIMEOUT = timeout


def test_an_invalid_call_in_a_subgroup_names_the_rank_in_the_job(pool):
    res = pool.run(_own_part_wrong_in_a_subgroup, timeout=120)
    assert len(res[3]) == 2, res[3]
    for kind, text in res[3]:
        assert kind == "ValueError" and "rank 3 sends itself 2 elements but receives 1" in text, res[3]
    assert res[2][0][0] == "MismatchError" and "rank(s) [3]" in res[2][0][1], res[2]


def _invalid_checked(rank, groups, codec):
    """ZIPCCL_CHECK_NATIVE=1: the backend's all-to-all (codec "native", or "auto" on one node)
    after the counts' exchange, so rank 1's invalid splits raise on every rank, and valid
    calls still give the backend's result."""
    g = groups[4]
    x = torch.arange(8, dtype=torch.bfloat16) + 8 * rank
    want = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.bfloat16) + 8 * j for j in range(4)])
    old = zipccl.config.CHECK_NATIVE, zipccl.config.TIMEOUT
    zipccl.config.CHECK_NATIVE, zipccl.config.TIMEOUT = True, 20.0  # a broken check: RankFailure, not a hang
    try:
        y = torch.empty_like(x)
        zipccl.all_to_all_single(y, x, group=g, codec=codec)
        before = torch.equal(y, want)
        try:
            zipccl.all_to_all_single(y, x, [4, 3, 0, 2] if rank == 1 else None, None, group=g, codec=codec)
            said = ("no error", "")
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            said = (type(e).__name__, str(e))
        y = torch.empty_like(x)
        zipccl.all_to_all(list(y.split(2)), list(x.split(2)), group=g, codec=codec)
        return before, said, torch.equal(y, want), zipccl.stats()["last"]["codec"]
    finally:
        zipccl.config.CHECK_NATIVE, zipccl.config.TIMEOUT = old


@pytest.mark.parametrize("codec", ["native", "auto"])
def test_check_native_makes_an_invalid_call_raise_on_every_rank(pool, codec):
    res = pool.run(_invalid_checked, codec, timeout=120)
    assert all(r[0] is True and r[2] is True and r[3] == "native" for r in res), res
    assert res[1][1][0] == "ValueError" and "output split sizes [4, 3, 0, 2]" in res[1][1][1], res[1]
    assert all(r[1][0] == "MismatchError" and "rank(s) [1]" in r[1][1] for r in res[:1] + res[2:]), res


def _decoder_fails(rank, groups, codec, shape):
    """Rank 1's decoder raises in the middle of the call (in pieces: several rounds follow):
    RankFailure on every rank, naming it."""
    from zipccl.collectives import alltoall as A
    g = groups[4]
    real = A.decode_to

    def broken(*args):
        raise RuntimeError("decoder broke")

    if rank == 1:
        A.decode_to = broken
    try:
        x = activations(1 << 16, seed=rank).to(torch.bfloat16)
        with nodes(g, shape), piece_bytes(1 << 14):
            zipccl.all_to_all_single(torch.empty_like(x), x, group=g, codec=CODECS[codec])
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, getattr(e, "rank", None), getattr(e, "kind", None), getattr(e, "broken", None)
    finally:
        A.decode_to = real
    return "ok", None, None, None


@pytest.mark.parametrize("codec", ["lossless", "links"])
def test_a_failure_reaches_every_rank(pool, codec):
    """Lossless to every peer, and on 2 emulated nodes of 2 ranks plain bytes inside the node
    (rank 0, rank 1's node peer, mails it nothing: it learns of the failure in the status round)."""
    res = pool.run(_decoder_fails, codec, "2x2" if codec == "links" else None, timeout=120)
    assert all(r == ("RankFailure", 1, "decode", False) for r in res), res
    assert all(h is True for h in pool.run(_healthy, timeout=120))


def _async(rank, groups, last_codec):
    """Three async calls (two of them zipccl's pipeline), then a sync one: every result torch's."""
    g = groups[4]
    xs = [activations(4096 * (k + 1), seed=rank + k).to(torch.bfloat16) for k in range(3)]
    wants = []
    for x in xs:
        w = torch.empty_like(x)
        dist.all_to_all_single(w, x, group=g)
        wants.append(w)
    gots = [torch.empty_like(x) for x in xs]
    handles = [zipccl.all_to_all_single(y, x, group=g, async_op=True, codec=c)
               for y, x, c in zip(gots, xs, ("lossless", "native", "raw"))]
    last = torch.empty_like(xs[0])
    zipccl.all_to_all_single(last, xs[0], group=g, codec=last_codec)
    done = [h.is_completed() for h in handles]
    for h in handles:
        h.wait()
    return done, [torch.equal(bits(a), bits(b)) for a, b in zip(gots, wants)], torch.equal(bits(last), bits(wants[0]))


@pytest.mark.parametrize("last_codec", ["lossless", "native", "auto"])
def test_async_handles(pool, last_codec):
    """The sync call last: zipccl's pipeline, or the backend's call (native; auto's small call),
    which must still wait for the async calls queued before it."""
    for rank, res in enumerate(pool.run(_async, last_codec, timeout=120)):
        assert not isinstance(res, BaseException), f"rank {rank}: {res!r}"
        done, same, last = res
        assert done == [True] * 3, "a sync call runs after the async calls issued before it"
        assert same == [True] * 3 and last


def _list_shapes(rank, groups, codec):
    """The list form with tensors of one size but not one shape: rank 1 receives into 2x4 blocks,
    rank 2 sends 4x2 ones, the others flat; each output against the values its sender put in."""
    g, n = groups[4], 4
    ins = [torch.arange(8, dtype=torch.bfloat16) + 100 * rank + 10 * j for j in range(n)]
    ins = [x.view(4, 2) for x in ins] if rank == 2 else ins
    outs = [torch.full((2, 4) if rank == 1 else (8,), float("nan"), dtype=torch.bfloat16) for _ in range(n)]
    zipccl.all_to_all(outs, ins, group=g, codec=codec)
    return all(torch.equal(y.reshape(-1), torch.arange(8, dtype=torch.bfloat16) + 100 * j + 10 * rank)
               for j, y in enumerate(outs))


@pytest.mark.parametrize("codec", ["native", "auto", "lossless"])
def test_list_tensors_of_one_size_in_other_shapes(pool, codec):
    """Any sizes and shapes, as docs/USAGE.md says: gloo's own list call takes one shape only, so
    the backend's call gets the tensors' flat views."""
    assert pool.run(_list_shapes, codec, timeout=120) == [True] * 4


def _conjugated(rank, groups):
    """ZIPCCL_CHECK_NATIVE=1: rank 1 passes a conjugated view of complex64 (whose memory holds
    the unconjugated values) to the backend's all-to-all: what each rank raises."""
    g = groups[4]
    x = torch.complex(torch.arange(8.0), torch.ones(8))
    old = zipccl.config.CHECK_NATIVE, zipccl.config.TIMEOUT
    zipccl.config.CHECK_NATIVE, zipccl.config.TIMEOUT = True, 20.0
    try:
        zipccl.all_to_all_single(torch.empty_like(x), x.conj() if rank == 1 else x, group=g, codec="native")
        return "no error", ""
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return type(e).__name__, str(e)
    finally:
        zipccl.config.CHECK_NATIVE, zipccl.config.TIMEOUT = old


def test_a_conjugated_view_is_refused_on_every_rank(pool):
    """A conjugated view is refused before the exchange (torch's own calls refuse it too, as
    view_as_real does): under ZIPCCL_CHECK_NATIVE every rank raises, none waits in the backend."""
    res = pool.run(_conjugated, timeout=120)
    assert res[1][0] == "UnsupportedError" and "conjugated" in res[1][1], res
    assert all(r[0] == "MismatchError" and "rank(s) [1]" in r[1] for r in res[:1] + res[2:]), res


def _strided_lists(rank, groups, codec):
    """The list form with strided inputs and outputs (columns of a row-major block), async,
    against gloo's own dist.all_to_all of the same tensors (which takes them)."""
    g = groups[4]
    x = activations(4 * 6 * 512, seed=rank).to(torch.bfloat16)
    ins = [x[k * 3072:(k + 1) * 3072].view(6, 512).t() for k in range(4)]
    gots = [torch.empty(6, 512, dtype=x.dtype).t() for _ in range(4)]
    wants = [torch.empty(6, 512, dtype=x.dtype).t() for _ in range(4)]
    dist.all_to_all(wants, ins, group=g)
    h = zipccl.all_to_all(gots, ins, group=g, async_op=True, codec=codec)
    h.wait()
    return all(not y.is_contiguous() and torch.equal(bits(y), bits(w)) for y, w in zip(gots, wants))


@pytest.mark.parametrize("codec", ["lossless", "native", "auto"])
def test_strided_lists_async(pool, codec):
    assert pool.run(_strided_lists, codec, timeout=120) == [True] * 4


def _in_place(rank, groups, codec):
    """Uneven splits whose rows and columns add up alike (circulant), so that one buffer serves
    as input and output, but each peer's part lands where other parts still wait to be sent."""
    g, n, parts = groups[4], 4, [700, 9000, 150, 3100]
    ins = [parts[(j - rank) % n] for j in range(n)]
    outs = [parts[(rank - j) % n] for j in range(n)]
    x = activations(sum(ins), seed=rank).to(torch.bfloat16)
    want = torch.empty_like(x)
    dist.all_to_all_single(want, x, outs, ins, group=g)
    buf = x.clone()
    with piece_bytes(1 << 15):  # several rounds
        zipccl.all_to_all_single(buf, buf, outs, ins, group=g, codec=codec)
    parts = [activations(256, seed=10 * rank + j).to(torch.bfloat16) for j in range(n)]  # the list call:
    expect = [torch.empty_like(x) for x in parts]                                       # each output its input
    dist.all_to_all(expect, [x.clone() for x in parts], group=g)
    zipccl.all_to_all(parts, parts, group=g, codec=codec)
    return torch.equal(bits(buf), bits(want)) and all(torch.equal(bits(a), bits(b)) for a, b in zip(parts, expect))


@pytest.mark.parametrize("codec", ["lossless", "native", "auto"])
def test_in_place(pool, codec):
    """Output and input one buffer (zipccl-perf's in-place column): the input is kept until sent,
    by zipccl's pipeline and where the call is the backend's (native; auto on one node)."""
    assert all(r is True for r in pool.run(_in_place, codec, timeout=120))


def _batched(rank, groups):
    """all_to_all_single with lossless, uneven splits, its packets coded as on CUDA: into one
    buffer by encode_into, sizes left in a tensor (pipeline.Deferred), against torch's."""
    from zipccl.codecs import Lossless
    g, n, width = groups[4], 4, 5
    count = _counts("uneven", n)
    ins, outs = [count(rank, j) for j in range(n)], [count(j, rank) for j in range(n)]
    x = _source(rank, activations(1 << 14), 0)[:sum(ins) * width].reshape(-1, width).to(torch.bfloat16)
    want = torch.empty(sum(outs), width, dtype=x.dtype)
    dist.all_to_all_single(want, x, outs, ins, group=g)
    got = torch.full_like(want, float("nan"))
    batches, used = P.batches, []
    P.batches = lambda codec, part: used.append(1) or isinstance(codec, Lossless)
    try:
        zipccl.all_to_all_single(got, x, outs, ins, group=g, codec="lossless")
    finally:
        P.batches = batches
    return bool(used), torch.equal(bits(got), bits(want))


def test_packets_coded_into_one_buffer_as_on_cuda(pool):
    """The all-to-all takes encode_all's batched packets (CUDA's Lossless: one buffer, sizes on the
    device), here forced on CPU."""
    assert pool.run(_batched) == [(True, True)] * 4


def _edges(rank, groups):
    """Empty split lists (torch's even splits), a group of this rank alone with a per-link and a
    hierarchical codec, and a small auto call on a new group while only rank 0's async queue is
    busy: each against torch's result on the same inputs."""
    import time
    g, n = groups[4], 4
    alone = [dist.new_group([r]) for r in range(n)][rank]  # every rank makes every group
    fresh = dist.new_group(list(range(n)))  # its topology not yet known
    x = activations(4 * 1024, seed=rank).to(torch.bfloat16).reshape(-1, 8)
    want = torch.empty_like(x)
    dist.all_to_all_single(want, x, [], [], group=g)
    got = {}
    for codec in ("lossless", "auto", "raw"):
        y = torch.full_like(x, float("nan"))
        zipccl.all_to_all_single(y, x, [], [], group=g, codec=codec)
        got[f"empty splits {codec}"] = torch.equal(bits(y), bits(want))
    for label, codec, algorithm in (("links", {"intra": "native", "inter": "lossless"}, "auto"),
                                    ("hierarchical", "lossless", "hierarchical")):
        y = torch.full_like(x, float("nan"))
        zipccl.all_to_all_single(y, x, group=alone, codec=codec, algorithm=algorithm)
        got[f"alone {label}"] = torch.equal(bits(y), bits(x))
    small = x[:64]
    want = torch.empty_like(small)
    dist.all_to_all_single(want, small, group=g)
    handle = zipccl.collectives.submit(lambda: time.sleep(1.0)) if rank == 0 else None
    y = torch.full_like(small, float("nan"))
    zipccl.all_to_all_single(y, small, group=fresh, codec="auto")
    got["behind a busy queue"] = torch.equal(bits(y), bits(want)) and (handle is None or handle.is_completed())
    return got


def test_empty_splits_a_group_of_one_and_a_busy_queue(pool):
    """torch's [] splits are even splits; a group of one rank under a per-link or hierarchical
    codec hands the input back; a call that one rank issues behind its own async work takes the
    same path as its peers' (the backend's call, after that work), not a path of its own."""
    for rank, res in enumerate(pool.run(_edges, timeout=90)):
        assert not isinstance(res, BaseException), f"rank {rank}: {res!r}"
        assert all(res.values()), (rank, res)


def _rank_local_differences(rank, groups, shape):
    """Calls that differ from rank to rank where torch lets them, on a new group (its first call
    finds the nodes) and again once it is known: rank 0 asks for a handle (async_op), rank 1
    passes its even splits, the others neither; then the list form where rank 0's tensors are all
    one size and its peers' are not. Each rank's result, against the values it must receive."""
    n = 4
    g = dist.new_group(list(range(n)))

    def count(i, j):  # rows rank i sends to rank j: rank 0 sends and receives 4 each
        return 4 if 0 in (i, j) else 3 + i + 2 * j

    got = []
    with nodes(g, shape):
        for _ in range(2):  # the group's first call, then one where its nodes are known
            x = torch.arange(8 * n, dtype=torch.bfloat16) + 100 * rank
            y = torch.full_like(x, float("nan"))
            if rank == 0:
                zipccl.all_to_all_single(y, x, group=g, async_op=True).wait()
            elif rank == 1:
                zipccl.all_to_all_single(y, x, [8] * n, [8] * n, group=g)
            else:
                zipccl.all_to_all_single(y, x, group=g)
            want = torch.cat([torch.arange(8 * rank, 8 * rank + 8, dtype=torch.bfloat16) + 100 * j for j in range(n)])
            got.append(torch.equal(y, want))
            ins = [torch.full((count(rank, j),), 10.0 * rank + j, dtype=torch.bfloat16) for j in range(n)]
            outs = [torch.full((count(j, rank),), float("nan"), dtype=torch.bfloat16) for j in range(n)]
            zipccl.all_to_all(outs, ins, group=g)
            got.append(all(torch.equal(o, torch.full_like(o, 10.0 * j + rank)) for j, o in enumerate(outs)))
    return got


@pytest.mark.parametrize("shape", [None, "2x2"], ids=["one node", "two nodes"])
def test_calls_that_differ_only_where_torch_lets_them_take_one_path(pool, shape):
    """Whether a call goes to the backend alone is decided from what every rank shares, never
    from async_op, split sizes given or left even, or the list form's sizes: a rank that took
    another path than its peers (zipccl's, which makes groups on its first call and exchanges
    counts across nodes) would wait for good."""
    res = pool.run(_rank_local_differences, shape, timeout=120)
    assert res == [[True] * 4] * 4, res


def _one_rank_differs(rank, groups, case):
    """On 2x2, rank 0's call differs from its peers' where their plans' names agreed:
    ``algorithm``: codec="auto" everywhere, but rank 0 asks for "flat" where its peers ask for
    "hierarchical", so their candidates differ, and so would their plans (rank 0 ran the
    backend's all-to-all while its peers ran zipccl's packets, each waiting for good).
    ``setting``: per-link codecs, rank 0's packets between the nodes checksummed, its peers'
    not ("links/plain+lossless" on every rank), which a flat call's check refuses (a CUDA
    receiver decodes with its own settings). Then a call that agrees: torch's result."""
    from zipccl.codecs import Lossless
    g = dist.new_group(list(range(4)))
    x = torch.arange(4 * 1024, dtype=torch.float32) + 10_000 * rank
    out = torch.empty_like(x)
    if case == "algorithm":
        agreed = dict(codec="auto", algorithm="hierarchical")
        mine = dict(agreed, algorithm="flat") if rank == 0 else agreed
    else:
        agreed = dict(codec={"intra": "native", "inter": "lossless"})
        mine = dict(codec={"intra": "native", "inter": Lossless(checksum=True)}) if rank == 0 else agreed
    with nodes(g, "2x2"):
        try:
            zipccl.all_to_all_single(out, x, group=g, **mine)
            first = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads it
            first = type(e).__name__
        zipccl.all_to_all_single(out, x, group=g, **agreed)
    want = torch.cat([torch.arange(1024 * rank, 1024 * (rank + 1), dtype=torch.float32) + 10_000 * j
                      for j in range(4)])
    return first, torch.equal(out, want)


@pytest.mark.parametrize("case", ["algorithm", "setting"])
def test_a_rank_whose_auto_candidates_or_link_codecs_differ_raises_on_every_rank(pool, case):
    res = pool.run(_one_rank_differs, case, timeout=60)
    assert res == [("MismatchError", True)] * 4, res


def _zero_dimensional(rank, groups):
    said = {}
    for codec in ("raw", "lossless", "auto", "native"):
        try:
            zipccl.all_to_all_single(torch.zeros(()), torch.tensor(float(rank)), codec=codec)
            said[codec] = "no error"
        except ValueError as e:
            said[codec] = str(e)
    return said


def test_a_zero_dimensional_tensor_is_refused_as_it_has_no_rows(pool):
    """gloo's all_to_all_single returns whatever its buffers held for a 0-dimensional tensor."""
    res = pool.run(_zero_dimensional, timeout=60)
    want = "input has 0 rows: without split sizes they must divide evenly among the group's 4 ranks"
    assert res == [dict.fromkeys(("raw", "lossless", "auto", "native"), want)] * 4, res
