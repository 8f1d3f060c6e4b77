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


def _collectives(rank, groups, strict, algorithm):
    """Every flat collective, raw and lossless, on a fresh group of all four ranks with
    ``strict`` as given, in many pipeline pieces; results and plain torch's on the same inputs."""
    old = config.STRICT_TRANSPORT, config.REDUCE_SCATTER, pipeline.PIECE_BYTES
    config.STRICT_TRANSPORT, config.REDUCE_SCATTER, pipeline.PIECE_BYTES = strict, algorithm, 64 << 10
    try:
        g = dist.new_group([0, 1, 2, 3], backend="gloo")
        t = TorchTransport.of(g)
        out = {"loose": (t.loose_receives, t.tags)}
        n = 40_000
        gen = torch.Generator().manual_seed(rank)
        for codec in ("raw", "lossless"):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(4 * n, generator=gen) * 0.01).to(dtype)
                ar = x.clone()
                zipccl.all_reduce(ar, group=g, codec=codec)
                rs = torch.empty(n, dtype=dtype)
                zipccl.reduce_scatter(rs, x, group=g, codec=codec)
                ag = torch.empty(16 * n, dtype=dtype)
                zipccl.all_gather(ag, x, group=g, codec=codec)
                inputs = [torch.empty_like(x) for _ in range(4)]
                dist.all_gather(inputs, x, group=g)  # plain torch from here: the expected results
                total = inputs[0].float().clone()
                for other in inputs[1:]:  # rank order, fp32, rounded once
                    total += other.float()
                total = total.to(dtype)
                same = torch.equal(_bits(ar), _bits(total)) if algorithm == "direct" else \
                    bool(torch.allclose(ar.float(), total.float(), rtol=1e-2, atol=1e-3))
                out[(codec, str(dtype))] = (same, torch.equal(_bits(rs), _bits(ar[rank * n:(rank + 1) * n])),
                                            torch.equal(_bits(ag), _bits(torch.cat(inputs))))
        return out
    finally:
        config.STRICT_TRANSPORT, config.REDUCE_SCATTER, pipeline.PIECE_BYTES = old


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
@pytest.mark.parametrize("algorithm", ["direct", "ring"])
def test_pipeline_keeps_the_rules(pool, strict, algorithm):
    """Under strict mode the pipeline's every message keeps NCCL's rules (a violation raises);
    without it gloo's loose receives and tags are used. Both give plain torch's results: the
    direct algorithm bit for bit (rank order, fp32, rounded once), the ring to rounding."""
    res = pool.run(_collectives, strict, algorithm, timeout=240)
    for out in res:
        assert not isinstance(out, BaseException), res
        assert out.pop("loose") == (not strict, not strict)
        for key, checks in out.items():
            assert checks == (True, True, True), (key, checks)
