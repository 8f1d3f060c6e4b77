"""Strict transport mode (ZIPCCL_STRICT_TRANSPORT=1, on for the whole suite: tests/conftest.py):
gloo held to NCCL's rules. Each rule broken on purpose must raise TransportRuleError; the
pipeline must keep them; the loose gloo path (strict off) must still give plain torch's results."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zipccl
from zipccl import config
from zipccl.collectives import pipeline
from zipccl.transport import TorchTransport
from zipccl.transport.strict import TransportRuleError

pytestmark = pytest.mark.timeout(300)


def _pair(strict: bool = True):
    """A fresh group of ranks {0, 1} (every rank of the pool must call new_group) and, on its
    members, a fresh transport: a broken rule leaves a group's messages out of step, so each
    test that breaks one gets its own."""
    old, config.STRICT_TRANSPORT = config.STRICT_TRANSPORT, strict
    try:
        g = dist.new_group([0, 1], backend="gloo")
        return g, (TorchTransport(g) if dist.get_rank() < 2 else None)
    finally:
        config.STRICT_TRANSPORT = old


def _outcome(fn):
    try:
        return fn()
    except TransportRuleError as e:
        return f"TransportRuleError: {e}"


def _larger_receive(rank, groups):
    """Rank 0 sends 8 bytes; rank 1 receives into 12: gloo takes it, NCCL would not."""
    _, t = _pair()
    if t is None:
        return None
    x = torch.arange(8, dtype=torch.uint8)
    with t.grouped():
        work = t.isend(x, 1, 3) if rank == 0 else t.irecv(torch.empty(12, dtype=torch.uint8), 0, 3)
    return _outcome(lambda: t.wait(work))


def _crossed_order(rank, groups):
    """Rank 0 sends tag 1 then tag 2; rank 1 receives tag 2 first: gloo pairs them by tag, NCCL by order."""
    _, t = _pair()
    if t is None:
        return None
    a, b = torch.full((8,), 1, dtype=torch.uint8), torch.full((8,), 2, dtype=torch.uint8)
    with t.grouped():
        if rank == 0:
            works = [t.isend(a, 1, 1), t.isend(b, 1, 2)]
        else:
            works = [t.irecv(torch.empty(8, dtype=torch.uint8), 0, 2), t.irecv(torch.empty(8, dtype=torch.uint8), 0, 1)]
    return [_outcome(lambda: t.wait(w)) for w in works]


def _ungrouped(rank, groups):
    """A send outside a group call, and a wait inside one, fail where they are issued."""
    _, t = _pair()
    if t is None:
        return None
    outside = _outcome(lambda: t.isend(torch.zeros(4, dtype=torch.uint8), 1 - rank, 0))
    with t.grouped():
        send = t.isend(torch.zeros(4, dtype=torch.uint8), 1 - rank, 0)
        recv = t.irecv(torch.empty(4, dtype=torch.uint8), 1 - rank, 0)
        inside = _outcome(lambda: t.wait(recv))
    t.wait(recv)
    t.wait(send)
    return outside, inside


def _exact(rank, groups):
    """A correct grouped exchange passes, and the log records it."""
    _, t = _pair()
    if t is None:
        return None
    peer = 1 - rank
    got = torch.empty(5 + peer, dtype=torch.uint8)
    with t.grouped():
        send = t.isend(torch.full((5 + rank,), rank + 7, dtype=torch.uint8), peer, 4)
        recv = t.irecv(got, peer, 4)
    t.wait(recv)
    t.wait(send)
    return got.tolist(), [tuple(op) for op in t.strict.log]


def _posted_after_a_wait(rank, groups, split):
    """Rank 0 sends a size and a packet, as one group call (``split``: two); rank 1 waits for the
    size before it posts the packet's receive, as a framed message's receiver does: on NCCL the
    one group may wait for that receive, which waits for the group."""
    _, t = _pair()
    if t is None:
        return None
    size, packet = torch.tensor([6], dtype=torch.int64), torch.arange(6, dtype=torch.uint8)
    if rank == 0:
        with t.grouped():
            sends = [t.isend(size, 1, 5)]
            if not split:
                sends.append(t.isend(packet, 1, 5))
        if split:
            with t.grouped():
                sends.append(t.isend(packet, 1, 5))
        return [_outcome(lambda: t.wait(w)) for w in sends]
    got = torch.empty(1, dtype=torch.int64)
    with t.grouped():
        work = t.irecv(got, 0, 5)
    t.wait(work)
    buf = torch.empty(int(got), dtype=torch.uint8)
    with t.grouped():
        work = t.irecv(buf, 0, 5)
    return _outcome(lambda: t.wait(work)) or buf.tolist()


@pytest.mark.parametrize("split", [False, True])
def test_a_receive_posted_after_waiting_for_a_message_of_the_same_group_fails(pool, split):
    res = pool.run(_posted_after_a_wait, split)
    assert res[0] == [None, None] and res[2] is None and res[3] is None, res
    if split:
        assert res[1] == list(range(6)), res
    else:
        assert res[1].startswith("TransportRuleError") and "message #0, sent in the same group call" in res[1], res


def _sent_after_a_wait(rank, groups, split):
    """Rank 0 sends a message and receives the answer in one group call (``split``: two); rank 1
    waits for the message before it posts the answer: on NCCL the one group may wait for the
    answer's send, which waits for the group."""
    _, t = _pair()
    if t is None:
        return None
    ask, answer = torch.arange(4, dtype=torch.uint8), torch.empty(4, dtype=torch.uint8)
    if rank == 0:
        with t.grouped():
            sent = t.isend(ask, 1, 6)
            if not split:
                got = t.irecv(answer, 1, 6)
        if split:
            with t.grouped():
                got = t.irecv(answer, 1, 6)
        return _outcome(lambda: t.wait(sent)), _outcome(lambda: t.wait(got)) or answer.tolist()
    with t.grouped():
        work = t.irecv(answer, 0, 6)
    t.wait(work)
    with t.grouped():
        work = t.isend(answer + 1, 0, 6)
    return _outcome(lambda: t.wait(work))


@pytest.mark.parametrize("split", [False, True])
def test_a_send_posted_after_waiting_for_a_message_of_its_receives_group_fails(pool, split):
    res = pool.run(_sent_after_a_wait, split)
    assert res[1] is None and res[2] is None and res[3] is None, res
    if split:
        assert res[0] == (None, [1, 2, 3, 4]), res
    else:
        assert res[0][0] is None and res[0][1].startswith("TransportRuleError"), res
        assert "a message of which rank 1 had waited for before it posted the send" in res[0][1], res


def test_larger_receive_fails(pool):
    res = pool.run(_larger_receive)
    assert res[0] is None and res[2] is None and res[3] is None
    assert res[1].startswith("TransportRuleError") and "has 12 bytes, but the send it matches has 8" in res[1], res


def test_crossed_order_fails(pool):
    res = pool.run(_crossed_order)
    assert res[0] == [None, None], res
    assert "different orders" in res[1][0] and "tag 2" in res[1][0] and "tag 1" in res[1][0], res


def test_ungrouped_fails(pool):
    for outside, inside in pool.run(_ungrouped)[:2]:
        assert outside.startswith("TransportRuleError") and "outside a group call" in outside
        assert inside.startswith("TransportRuleError") and "inside a group call" in inside


def test_grouped_exact_exchange_passes(pool):
    res = pool.run(_exact)
    for rank in (0, 1):
        got, log = res[rank]
        peer = 1 - rank
        assert got == [peer + 7] * (5 + peer)
        assert log == [("send", peer, 0, 5 + rank, 1, 4), ("recv", peer, 0, 5 + peer, 1, 4)]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def _direct(parts: list[torch.Tensor]) -> torch.Tensor:
    """The direct reduce-scatter's sum, in plain torch: rank order, fp32 accumulation for 16-bit
    types, rounded once."""
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


def _ring(parts: list[torch.Tensor], owner: int) -> torch.Tensor:
    """The ring's sum of chunk ``owner``, in plain torch: from rank owner+1 round to the owner,
    each hop's sum (fp32 for 16-bit types) rounded to the dtype (zipccl/collectives/algorithms.py)."""
    n, dtype = len(parts), parts[0].dtype
    acc = parts[(owner + 1) % n]
    for k in range(2, n + 1):
        acc = (acc.float() + parts[(owner + k) % n].float()).to(dtype)
    return acc


def _tolerance(parts: list[torch.Tensor], algorithm: str) -> torch.Tensor:
    """A bound on |sum - exact sum| per element: each fp32 addition may err by eps32 of the sum
    of magnitudes so far; a ring hop rounds to the dtype (its eps), the direct sum once at the
    end (half its eps of the result)."""
    dtype, n = parts[0].dtype, len(parts)
    magnitude = torch.stack([p.double().abs() for p in parts]).sum(0)
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    if algorithm == "ring":
        return (n - 1) * max(eps, eps32) * magnitude
    return (n - 1) * eps32 * magnitude + eps / 2 * _direct(parts).double().abs()


def _collectives(rank, groups, strict, algorithm):
    """Every flat collective, raw and lossless, fp32, bf16 and fp16, on a fresh group of all four
    ranks with ``strict`` as given, in many pipeline pieces, against plain torch on the inputs
    gathered by torch.distributed: (all-reduce, reduce-scatter) bit for bit as the algorithm's
    documented summation order computes them and within ``_tolerance`` of the exact (float64)
    sum, all-gather bit for bit."""
    old = config.STRICT_TRANSPORT, config.REDUCE_SCATTER, pipeline.PIECE_BYTES
    config.STRICT_TRANSPORT, config.REDUCE_SCATTER, pipeline.PIECE_BYTES = strict, algorithm, 64 << 10
    try:
        g = dist.new_group([0, 1, 2, 3], backend="gloo")
        t = TorchTransport.of(g)
        out = {"loose": (t.loose_receives, t.tags)}
        n = 40_000
        gen = torch.Generator().manual_seed(rank)
        for codec in ("raw", "lossless"):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x = (torch.randn(4 * n, generator=gen) * 0.01).to(dtype)
                ar = x.clone()
                zipccl.all_reduce(ar, group=g, codec=codec)
                rs = torch.empty(n, dtype=dtype)
                zipccl.reduce_scatter(rs, x, group=g, codec=codec)
                ag = torch.empty(16 * n, dtype=dtype)
                zipccl.all_gather(ag, x, group=g, codec=codec)
                inputs = [torch.empty_like(x) for _ in range(4)]
                dist.all_gather(inputs, x, group=g)  # plain torch from here: the expected results
                chunks = [[p[c * n:(c + 1) * n] for p in inputs] for c in range(4)]
                want = torch.cat([_direct(ch) if algorithm == "direct" else _ring(ch, c) for c, ch in enumerate(chunks)])
                exact = torch.stack([p.double() for p in inputs]).sum(0)
                close = bool(((ar.double() - exact).abs() <= _tolerance(inputs, algorithm)).all())
                out[(codec, str(dtype))] = (torch.equal(_bits(ar), _bits(want)), close,
                                            torch.equal(_bits(rs), _bits(want[rank * n:(rank + 1) * n])),
                                            torch.equal(_bits(ag), _bits(torch.cat(inputs))))
        return out
    finally:
        config.STRICT_TRANSPORT, config.REDUCE_SCATTER, pipeline.PIECE_BYTES = old


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
@pytest.mark.parametrize("algorithm", ["direct", "ring"])
def test_pipeline_keeps_the_rules(pool, strict, algorithm):
    """Under strict mode the pipeline's every message keeps NCCL's rules (a violation raises);
    without it gloo's loose receives and tags are used. Both give plain torch's results in the
    algorithm's summation order, bit for bit, and so within each dtype's rounding of the exact sum."""
    res = pool.run(_collectives, strict, algorithm, timeout=240)
    for out in res:
        assert not isinstance(out, BaseException), res
        assert out.pop("loose") == (not strict, not strict)
        for key, checks in out.items():
            assert checks == (True, True, True, True), (key, checks)


def test_tolerance_is_tight():
    """The bound is about eps of the magnitudes: fp32 about 1e-7 relative, not a loose rtol, so
    a sum that loses bits (fp32 rounded through bf16) falls outside it."""
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(10_000, generator=gen) for _ in range(4)]
    magnitude = torch.stack([p.double().abs() for p in parts]).sum(0)
    assert float((_tolerance(parts, "direct") / magnitude).max()) < 1e-6
    assert float((_tolerance(parts, "ring") / magnitude).max()) < 1e-6
    exact = torch.stack([p.double() for p in parts]).sum(0)
    lossy = _direct([p.bfloat16().float() for p in parts])
    assert not bool(((lossy.double() - exact).abs() <= _tolerance(parts, "direct")).all())


def test_each_threads_messages_carry_its_own_group_calls_number():
    """Two threads' group calls open at once (a send lane and the async calls' thread share a
    transport): a message carries the number of its own thread's call, not of the call opened
    last, or two separate calls would look like one (and one call like two)."""
    import threading

    from zipccl.transport.strict import Strict
    strict, opened, sent = Strict(0), threading.Event(), threading.Event()

    def first():
        with strict.grouped():
            opened.wait(10)  # the second thread's call is open by now
            strict.send(lambda x, peer: None, torch.zeros(8, dtype=torch.uint8), 1, 0)
            sent.set()

    def second():
        with strict.grouped():
            opened.set()
            sent.wait(10)
            strict.send(lambda x, peer: None, torch.zeros(6, dtype=torch.uint8), 1, 0)

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert [(op.nbytes, op.group) for op in strict.log] == [(8, 1), (6, 2)], list(strict.log)
