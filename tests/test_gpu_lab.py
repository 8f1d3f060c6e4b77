"""The gpu suite's multi-rank tests of zipccl over NCCL, on 2 and 4 ranks of one GPU where the
machine has fewer GPUs than ranks (the one-GPU lab: every rank on cuda:0, each its own NCCL host,
NCCL's socket transport on loopback; tests/workers.py join_gpu_world): the collectives against
plain torch, a rank killed mid-call, the host synchronisations per pipeline piece, the CUDA-event
clock and zipccl-perf's lab. Skipped, with the reason, where CUDA is unavailable."""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from zipccl.launch import free_port
from workers import join_gpu_world, spawn

NO_CUDA = "no CUDA device: the gpu suite runs on a GPU machine (docs/GPU.md)"
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROOT = Path(__file__).resolve().parents[1]
M, K = 1_000_003, 333_331  # elements: a reduce-scatter's output per rank, an all-gather's input per rank


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha1(x.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def _data(rank: int, n: int, dtype) -> torch.Tensor:
    """Gradient-like values with the special ones up front (zeros of both signs, infinities, a
    NaN, subnormals, the largest fp16)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(1000 + rank)) * 0.02
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 65504.0])
    return x.to(dtype)


def _rank_order_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """Plain torch: the inputs added in rank order, fp32 for 16-bit types, rounded once."""
    wide = torch.float32 if inputs[0].element_size() == 2 else inputs[0].dtype
    total = inputs[0].to(wide, copy=True)
    for x in inputs[1:]:
        total += x.to(wide)
    return total.to(inputs[0].dtype)


def _differences(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int]:
    """(elements whose bits differ, those of them that are not NaN on both sides)."""
    ints = torch.int32 if got.element_size() == 4 else torch.int16
    differ = got.view(ints) != want.view(ints)
    return int(differ.sum()), int((differ & ~(torch.isnan(got) & torch.isnan(want))).sum())


def _collectives(rank: int, n: int, port: int, results) -> None:
    """One rank: all-reduce, reduce-scatter and all-gather of every dtype with raw and lossless,
    on CUDA tensors through zipccl's NCCL transport, each output against plain torch on every
    rank's input (made here from each rank's seed: the gathered inputs)."""
    import torch.distributed as dist

    import zipccl
    join_gpu_world(rank, n, port)
    out = {}
    try:
        for dtype in DTYPES:
            inputs = [_data(r, n * M, dtype) for r in range(n)]
            total = _rank_order_sum(inputs)
            want = (total, total[rank * M:(rank + 1) * M], torch.cat([x[:K] for x in inputs]))
            for codec in ("raw", "lossless"):
                x = inputs[rank].cuda()
                zipccl.all_reduce(x, codec=codec)
                rs = torch.empty(M, dtype=dtype, device="cuda")
                zipccl.reduce_scatter(rs, inputs[rank].cuda(), codec=codec)
                ag = torch.empty(n * K, dtype=dtype, device="cuda")
                zipccl.all_gather(ag, inputs[rank][:K].cuda(), codec=codec)
                got = (x.cpu(), rs.cpu(), ag.cpu())
                out[(str(dtype), codec)] = dict(
                    digests=[_digest(g) for g in got],
                    rs_is_all_reduce_slice=_digest(got[0][rank * M:(rank + 1) * M]) == _digest(got[1]),
                    diffs=[_differences(g, w) for g, w in zip(got, want)])
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = f"{type(e).__name__}: {e}"
    results.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_match_plain_torch_on_every_rank(n, monkeypatch):
    """Every rank's all-reduce and reduce-scatter equal plain torch's rank-order sum bit for bit
    (NaN payloads aside: CUDA's fp32-to-16-bit conversion writes its own, docs/GPU.md; counted
    and shown with -s), every all-gather equals the concatenated inputs exactly, every rank has
    the same all-reduce and all-gather bits, a rank's reduce-scatter is its slice of the
    all-reduce, and lossless gives raw's bits."""
    monkeypatch.setenv("ZIPCCL_TRANSPORT", "nccl")  # the spawned ranks inherit it
    monkeypatch.setenv("ZIPCCL_TIMEOUT", "20")  # a rank that fails leaves its peers raising, not hanging
    got, _ = spawn(_collectives, n, (n, free_port()), seconds=500)
    assert sorted(got) == list(range(n)), got
    res = [got[r] for r in range(n)]
    nan_payloads = {}
    for rank, out in enumerate(res):
        assert not isinstance(out, str), res
        for dtype in DTYPES:
            for codec in ("raw", "lossless"):
                case = out[(str(dtype), codec)]
                (ar, ar_real), (rs, rs_real), (ag, _) = case["diffs"]
                assert ar_real == 0 and rs_real == 0 and ag == 0, (rank, dtype, codec, case["diffs"])
                assert case["rs_is_all_reduce_slice"], (rank, dtype, codec)
                nan_payloads[(rank, str(dtype), codec)] = (ar, rs)
            assert out[(str(dtype), "lossless")]["digests"] == out[(str(dtype), "raw")]["digests"], (rank, dtype)
    for key in res[0]:
        for i in (0, 2):  # all-reduce, all-gather
            assert len({out[key]["digests"][i] for out in res}) == 1, (key, i)
    print("NaN payloads that differ from the CPU's (all-reduce, reduce-scatter):", nan_payloads)


# ---- every entry point on CUDA tensors, 4 ranks -----------------------------------------------------------

def _exact(rank: int, numel: int, dtype) -> torch.Tensor:
    """Values whose sums are exact in any order (multiples of 1/64 below 16 in fp32, integers in
    -8..8 in bf16): hierarchical plans add in another order than plain torch's rank order."""
    g = torch.Generator().manual_seed(70 + rank)
    if dtype == torch.float32:
        return torch.randint(-1000, 1001, (numel,), generator=g).float() / 64
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype)


def _topk_sum(inputs: list[torch.Tensor], k: int) -> torch.Tensor:
    """Plain torch: each rank's k largest magnitudes, the rest zero, added in rank order."""
    total = torch.zeros_like(inputs[0])
    for x in inputs:
        dense = torch.zeros_like(x)
        idx = x.abs().topk(k).indices
        dense[idx] = x[idx]
        total += dense
    return total


def _ddp_grads(model_fn, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain torch on one device: the mean over ranks of each rank's gradients (fp64)."""
    model = model_fn()
    total = None
    for inp in inputs:
        model.zero_grad()
        model(inp).square().mean().backward()
        grads = [p.grad.double() for p in model.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [g / len(inputs) for g in total]


def _entry_points(rank: int, n: int, port: int, results) -> None:
    """One rank: each entry point on CUDA tensors, each check's outcome (or its error) reported
    apart, so that one failure hides none of the others."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zipccl
    from zipccl.backend import Options
    join_gpu_world(rank, n, port)
    out = {}

    def check(name, fn):
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = f"{type(e).__name__}: {e}"
        # as it ends (pytest -s): a run cut short still shows the checks done
        print(f"rank {rank} {name} ({time.perf_counter() - t0:.1f} s): {out[name]!r}", flush=True)

    def flat():
        """The three collectives, flat, lossless and raw, against plain torch's sums (values whose
        sums are exact in any order), bits differing."""
        diffs = {}
        inputs = [_exact(r, n * M, torch.bfloat16) for r in range(n)]
        total = sum(x.double() for x in inputs).to(torch.bfloat16)
        want = (total, total[rank * M:(rank + 1) * M], torch.cat([y[:K] for y in inputs]))
        for codec in ("lossless", "raw"):
            x = inputs[rank].cuda()
            zipccl.all_reduce(x, codec=codec, algorithm="flat")
            rs = torch.empty(M, dtype=torch.bfloat16, device="cuda")
            zipccl.reduce_scatter(rs, inputs[rank].cuda(), codec=codec, algorithm="flat")
            ag = torch.empty(n * K, dtype=torch.bfloat16, device="cuda")
            zipccl.all_gather(ag, inputs[rank][:K].cuda(), codec=codec, algorithm="flat")
            diffs[codec] = [_differences(g.cpu(), w)[0] for g, w in zip((x, rs, ag), want)]
        return diffs

    def all_to_all_and_point_to_point():
        """zipccl.all_to_all_single (equal splits; auto, then lossless) against the blocks each rank sends, then
        zipccl.send / zipccl.recv between rank pairs (0-1, 2-3), auto (inside a node on this gloo
        world: the plain bytes framed on zipccl's NCCL pair, never gloo's send of CUDA memory)
        and lossless both ways in one batch (each direction on the NcclPair of its two ranks
        alone), then 32 MiB both ways as a separate irecv and isend (more than NCCL buffers: on
        one stream for both directions the two ranks would block each other), bits differing."""
        inputs = [_exact(r, n * K, torch.bfloat16) for r in range(n)]
        got = torch.empty(n * K, dtype=torch.bfloat16, device="cuda")
        zipccl.all_to_all_single(got, inputs[rank].cuda())
        packed = torch.empty(n * K, dtype=torch.bfloat16, device="cuda")  # every link's packets lossless
        zipccl.all_to_all_single(packed, inputs[rank].cuda(), codec="lossless")
        want = torch.cat([inputs[r][rank * K:(rank + 1) * K] for r in range(n)])
        peer = rank ^ 1
        mine, theirs = inputs[rank][:K].cuda(), torch.empty(K, dtype=torch.bfloat16, device="cuda")
        if rank < peer:
            zipccl.send(mine, peer)
            zipccl.recv(theirs, peer)
        else:
            zipccl.recv(theirs, peer)
            zipccl.send(mine, peer)
        framed = torch.empty(K, dtype=torch.bfloat16, device="cuda")
        for h in zipccl.batch_isend_irecv([zipccl.P2POp(zipccl.irecv, framed, peer, codec="lossless"),
                                           zipccl.P2POp(zipccl.isend, mine, peer, codec="lossless")]):
            h.wait()

        def big(r):
            return torch.randn(1 << 24, device="cuda", generator=torch.Generator("cuda").manual_seed(r)).bfloat16()
        mine_big, theirs_big = big(rank), torch.empty(1 << 24, dtype=torch.bfloat16, device="cuda")
        handles = [zipccl.irecv(theirs_big, peer, codec="lossless"), zipccl.isend(mine_big, peer, codec="lossless")]
        for h in handles:
            h.wait()
        return tuple(_differences(g.cpu(), w)[0] for g, w in ((got, want), (packed, want), (theirs, inputs[peer][:K]),
                                                               (framed, inputs[peer][:K]),
                                                               (theirs_big, big(peer).cpu())))

    def hierarchical():
        """ZIPCCL_TOPOLOGY=2x2: the three collectives, against plain torch's sums, bits differing."""
        diffs = {}
        for dtype in (torch.float32, torch.bfloat16):
            inputs = [_exact(r, n * M, dtype) for r in range(n)]
            total = sum(x.double() for x in inputs).to(dtype)
            for codec in ("lossless", {"intra": "native", "inter": "lossless"}):
                key = f"{dtype} {codec}"
                x = inputs[rank].cuda()
                work = zipccl.all_reduce(x, codec=codec, algorithm="hierarchical", async_op=True)
                work.wait()
                rs = torch.empty(M, dtype=dtype, device="cuda")
                zipccl.reduce_scatter(rs, inputs[rank].cuda(), codec=codec, algorithm="hierarchical")
                ag = torch.empty(n * K, dtype=dtype, device="cuda")
                zipccl.all_gather(ag, inputs[rank][:K].cuda(), codec=codec, algorithm="hierarchical")
                want = (total, total[rank * M:(rank + 1) * M], torch.cat([y[:K] for y in inputs]))
                diffs[key] = [_differences(g.cpu(), w)[0] for g, w in zip((x, rs, ag), want)]
        return diffs

    def topk():
        """zipccl.all_reduce with codec "topk" (1%) against each rank's top 1% added in rank order."""
        numel = 200_003
        inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(300 + r)) for r in range(n)]
        x = inputs[rank].cuda()
        zipccl.all_reduce(x, codec="topk")
        want = _topk_sum(inputs, -(-numel // 100))
        got = x.cpu()
        return _differences(got, want)[0], float((got - want).abs().max())

    def ddp(options, steps):
        """DDP on a group of the drop-in backend: gradients against plain torch's mean of every
        rank's gradients, and every rank's gradient bits (digests)."""
        group = dist.new_group(list(range(n)), backend="zipccl", pg_options=options)

        def make():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
        model = DDP(make(), process_group=group)
        inputs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(500 + r)).cuda() for r in range(n)]
        for _ in range(steps):
            model.zero_grad()
            model(inputs[rank]).square().mean().backward()
        want = _ddp_grads(make, inputs)
        got = [p.grad for p in model.parameters()]
        error = max(float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(got, want))
        return error, _digest(torch.cat([g.flatten() for g in got]))

    def fsdp2(custom):
        """FSDP2 on a group of the drop-in backend (its own comms, which go through zipccl's, or
        zipccl.fsdp's lossless comms): gradients against plain torch's mean of every rank's."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        import zipccl.fsdp
        group = dist.new_group(list(range(n)), backend="zipccl")

        def make():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
        model, mesh = make(), DeviceMesh.from_group(group, "cuda")
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if custom:
            zipccl.fsdp.compress(model, codec="lossless")
        inputs = [torch.randn(32, 64, generator=torch.Generator().manual_seed(500 + r)).cuda() for r in range(n)]
        model(inputs[rank]).square().mean().backward()
        want = _ddp_grads(make, inputs)
        got = [p.grad.full_tensor() for p in model.parameters()]
        return max(float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(got, want))

    def dropin_int_batch():
        """``dist.batch_isend_irecv`` on a drop-in group, 32 MiB of int64 each way, each rank
        receiving first: torch hands the drop-in its messages one at a time, which on the NCCL
        underneath would queue on one stream and block both ranks; zipccl frames their bytes on
        its NCCL pair. Elements differing."""
        group = dist.new_group(list(range(n)), backend="zipccl")
        peer = rank ^ 1

        def ids(r):
            return torch.randint(0, 2**40, (1 << 22,), generator=torch.Generator().manual_seed(900 + r))
        got = torch.empty(1 << 22, dtype=torch.int64, device="cuda")
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, peer, group=group),
                                            dist.P2POp(dist.isend, ids(rank).cuda(), peer, group=group)]):
            work.wait()
        return int((got.cpu() != ids(peer)).sum())

    def premul_sum():
        """dist.all_reduce and reduce_scatter_tensor with NCCL's PREMUL_SUM (a factor of 1/3, which
        bf16 rounds) on a drop-in group under auto (8 KiB: the backend's own), with nothing queued
        and behind an async call in zipccl's queue, against a plain NCCL group's calls: elements
        differing. Rank 0's values alone are nonzero, so that no order of the sum rounds."""
        zgroup, ngroup = dist.new_group(list(range(n)), backend="zipccl"), dist.new_group(list(range(n)), backend="nccl")
        x = (torch.arange(4096, dtype=torch.float32).remainder(301) * (rank == 0)).to(torch.bfloat16).cuda()
        want_ar, want_rs = x.clone(), torch.empty(4096 // n, dtype=torch.bfloat16, device="cuda")
        dist.all_reduce(want_ar, op=dist._make_nccl_premul_sum(1 / 3), group=ngroup)
        dist.reduce_scatter_tensor(want_rs, x, op=dist._make_nccl_premul_sum(1 / 3), group=ngroup)
        diffs = []
        for queued in (False, True):
            busy = zipccl.executor.submit(lambda: time.sleep(0.3)) if queued else None
            y, rs = x.clone(), torch.empty_like(want_rs)
            dist.all_reduce(y, op=dist._make_nccl_premul_sum(1 / 3), group=zgroup)
            dist.reduce_scatter_tensor(rs, x, op=dist._make_nccl_premul_sum(1 / 3), group=zgroup)
            if busy is not None:
                busy.wait()
            diffs += [int((y != want_ar).sum()), int((rs != want_rs).sum())]
        return diffs

    check("flat", flat)
    check("premul_sum", premul_sum)
    check("all_to_all_and_point_to_point", all_to_all_and_point_to_point)
    check("hierarchical", hierarchical)
    check("topk", topk)
    check("ddp_auto", lambda: ddp(Options(), 2))
    check("ddp_lossless", lambda: ddp(Options(codec="lossless"), 2))
    check("ddp_topk", lambda: ddp(Options(lossy="topk", lossy_min_numel=1000), 2))
    check("fsdp2_dropin", lambda: fsdp2(False))
    check("fsdp2_zipccl_comms", lambda: fsdp2(True))
    check("dropin_int_batch", dropin_int_batch)  # last: a batch that blocks would hide no other check
    results.put((rank, out))
    dist.destroy_process_group()


def test_every_entry_point_on_cuda_tensors(monkeypatch):
    """4 ranks, two emulated nodes of two (ZIPCCL_TOPOLOGY=2x2): flat and hierarchical (async)
    all-reduce, reduce-scatter and all-gather, lossless, raw and native-inside/lossless-between,
    give plain torch's bits (values whose sums are exact in any order); NCCL's PREMUL_SUM through
    the drop-in is NCCL's whether or not a call is queued before it; all-to-all and send/recv
    (where this checkout has them) move the bits; top-k 1% equals each rank's top 1% added in
    rank order; DDP and FSDP2 over the drop-in backend (DDP's default policy and lossless;
    FSDP2's own comms and zipccl.fsdp's) match plain torch's mean gradient to fp32 rounding, DDP
    the same bits on every rank; with the lossy top-k policy (error feedback in its second step)
    every rank still ends with the same bits; the drop-in's batch of int64 messages, each rank
    receiving first, moves the values."""
    monkeypatch.setenv("ZIPCCL_TRANSPORT", "nccl")
    monkeypatch.setenv("ZIPCCL_TOPOLOGY", "2x2")
    monkeypatch.setenv("ZIPCCL_TIMEOUT", "20")  # a rank that fails leaves its peers raising, not hanging
    n = 4
    got, _ = spawn(_entry_points, n, (n, free_port()), seconds=300)
    assert sorted(got) == list(range(n)), got
    res = [got[r] for r in range(n)]
    print(res[0])
    problems = [(r, name, v) for r, out in enumerate(res) for name, v in out.items() if isinstance(v, str)]
    assert not problems, problems
    for r, out in enumerate(res):
        assert all(d == [0, 0, 0] for d in out["flat"].values()), (r, out["flat"])
        assert out["all_to_all_and_point_to_point"] == (0, 0, 0, 0, 0), (r, out["all_to_all_and_point_to_point"])
        assert out["premul_sum"] == [0, 0, 0, 0], (r, out["premul_sum"])
        assert all(d == [0, 0, 0] for d in out["hierarchical"].values()), (r, out["hierarchical"])
        for name in ("fsdp2_dropin", "fsdp2_zipccl_comms"):
            assert out[name] < 1e-5, (r, name, out[name])
        assert out["topk"][0] == 0, (r, out["topk"])
        assert out["dropin_int_batch"] == 0, (r, out["dropin_int_batch"])
        for name in ("ddp_auto", "ddp_lossless"):
            assert out[name][0] < 1e-5, (r, name, out[name])
    for name in ("ddp_auto", "ddp_lossless", "ddp_topk"):
        assert len({out[name][1] for out in res}) == 1, (name, [out[name] for out in res])


# ---- host synchronisations per pipeline piece -------------------------------------------------------------

def _syncs(rank: int, n: int, port: int, results) -> None:
    """The host's waits for the device (tests/host_waits.py: event waits and polls, stream and
    device synchronisations, host copies, torch's and CuPy's) in one warm lossless call of each
    collective on 64 MiB of bf16 per rank, with the call's pipeline pieces (of each phase), and
    what torch.cuda.set_sync_debug_mode sees of them."""
    import torch.distributed as dist

    import zipccl
    from host_waits import recording
    from zipccl.collectives.pipeline import pieces
    join_gpu_world(rank, n, port)
    numel = 32 << 20
    x = _data(rank, numel, torch.bfloat16).cuda()
    calls = {"all_reduce": (lambda: zipccl.all_reduce(x.clone(), codec="lossless"),
                            2 * len(pieces(numel // n, n, 2, cuda=True))),
             "reduce_scatter": (lambda: zipccl.reduce_scatter(torch.empty(numel // n, dtype=x.dtype, device="cuda"),
                                                              x, codec="lossless"),
                                len(pieces(numel // n, n, 2, cuda=True))),
             "all_gather": (lambda: zipccl.all_gather(torch.empty(n * numel, dtype=x.dtype, device="cuda"), x,
                                                      codec="lossless"), len(pieces(numel, n, 2, cuda=True)))}
    out = {}
    for name, (call, phase_pieces) in calls.items():
        call()  # warm: the communicators exist (CuPy imported), the kernels are compiled
        torch.cuda.synchronize()
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught, recording() as rec:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out[name] = dict(waits=rec.host_waits(), pieces=phase_pieces, table=rec.table(), missed=rec.missed,
                         torch_sees=sum("synchronizing" in str(w.message) for w in caught))
    results.put((rank, out))
    dist.destroy_process_group()


def test_at_most_one_host_wait_per_pipeline_piece(monkeypatch):
    """DESIGN.md invariant 9: the host waits for the device at most once per pipeline piece (a
    piece of each phase: an all-reduce's reduce-scatter and all-gather pieces both count), for
    that piece's sizes, and three times more per call (the metadata exchange, the one read of the
    decoded packets' verdicts, the status round).
    Counted by tests/host_waits.py, which sees event waits and polls, stream and device
    synchronisations and host copies (torch's sync debug mode sees only torch's synchronising
    operations, shown beside): 2 ranks, printed per call with -s."""
    monkeypatch.setenv("ZIPCCL_TRANSPORT", "nccl")
    n = 2
    got, _ = spawn(_syncs, n, (n, free_port()), seconds=400)
    assert sorted(got) == list(range(n)), got
    for r in range(n):
        for name, c in got[r].items():
            print(f"rank {r} {name}: {c['waits']} host waits for {c['pieces']} pieces (sync debug mode saw "
                  f"{c['torch_sees']}; not wrapped: {c['missed']})\n{c['table']}")
    for r in range(n):
        for name, c in got[r].items():
            assert c["waits"] <= c["pieces"] + 3, (r, name, c["waits"], c["pieces"], c["table"])


# ---- zipccl-perf's clock and its lab -----------------------------------------------------------------------

def test_clock_times_a_queued_call_to_its_end_on_the_device():
    """A kernel that runs about 0.1 s returns to the host at once: the clock times the device."""
    from zipccl.bench.cuda import Clock
    torch.cuda.set_device(0)
    clock = Clock("cuda")
    t0 = time.perf_counter()
    with clock:
        torch.cuda._sleep(200_000_000)  # GPU cycles: about 0.1 s at 2 GHz
    host = time.perf_counter() - t0
    (device,) = clock.seconds()
    assert device >= 0.03 and host < device / 3, (device, host)


@pytest.mark.timeout(400)
def test_perf_lab_tables_and_json(tmp_path):
    """zipccl-perf --device cuda --share-gpu on 2 ranks: the NCCL baseline table first, then each
    codec's; every checked row right (#wrong 0); the JSON names the device and the lab."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="0")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "NCCL_SOCKET_IFNAME"):
        env.pop(k, None)  # no launcher; the lab's default interface, lo
    out = tmp_path / "lab.json"
    r = subprocess.run([sys.executable, "-m", "zipccl.bench", "--device", "cuda", "--share-gpu", "--nranks", "2",
                        "-b", "1M", "-e", "4M", "-f", "4", "-d", "bfloat16", "--codec", "all", "-n", "3", "-w", "1",
                        "-J", str(out)], capture_output=True, text=True, env=env, timeout=380)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "# zipccl-perf on CUDA: cuda:0 shared by 2 ranks" in r.stdout
    doc = json.loads(out.read_text())
    tables = doc["zipccl"]["tables"]
    assert [t["codec"] for t in tables] == ["torch", "raw", "lossless", "auto"], tables
    assert all(t["out_of_bounds"]["count"] == 0 for t in tables), tables
    checked = [row for row in doc["results"] if row["zipccl"]["codec"] in ("raw", "lossless")]
    assert checked and all(row[p]["nwrong"] == 0 for row in checked for p in ("out_of_place", "in_place")), checked
    assert "NCCL_HOSTID=zipccl-lab-rank0" in doc["env"] and "NCCL_SOCKET_IFNAME=lo" in doc["env"], doc["env"]
    devices = doc["config"]["devices"]
    assert [d["device"] for d in devices] == [0, 0], devices
    assert all(torch.cuda.get_device_name(0) in d["device_info"] for d in devices), devices


# ---- a rank killed in the middle of a call (last: a hang here costs no other test its time) ---------------

VICTIM, TIMEOUT, KILL_AFTER = 3, 5.0, 0.5


def _killed(rank: int, n: int, port: int, results) -> None:
    """All-reduces of 16M bf16 elements (lossless) until one raises; the victim SIGKILLs itself
    KILL_AFTER seconds in. Reports (exception, its rank, message, seconds from the kill)."""
    import zipccl
    join_gpu_world(rank, n, port)
    import torch.distributed as dist
    x = _data(rank, 16 << 20, torch.bfloat16).nan_to_num().cuda()
    zipccl.all_reduce(x.clone(), codec="lossless")  # warm: the communicator exists, the kernels are compiled
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    if rank == VICTIM:
        threading.Timer(KILL_AFTER, os.kill, (os.getpid(), signal.SIGKILL)).start()
    else:  # a survivor still in the loop well after it should have raised: where each thread is
        faulthandler.dump_traceback_later(KILL_AFTER + TIMEOUT + 5.5)
    try:
        while time.perf_counter() - start < 120:
            zipccl.all_reduce(x.clone(), codec="lossless")
            torch.cuda.synchronize()
        outcome = ("ok", None, "")
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = (type(e).__name__, getattr(e, "rank", None), str(e))
    faulthandler.cancel_dump_traceback_later()
    results.put((rank, (*outcome, time.perf_counter() - start - KILL_AFTER)))
    results.close()
    results.join_thread()  # delivered before the hard exit below
    time.sleep(2)  # a survivor that exits at once can cut off a peer still settling the call
    os._exit(0)  # the group is broken: tearing it down would wait on the dead rank


def test_killed_rank_makes_every_survivor_raise_rank_failure(monkeypatch):
    """SIGKILL of rank 3 of 4 in the middle of NCCL all-reduces: every survivor raises RankFailure
    naming rank 3 within ZIPCCL_TIMEOUT + 5 s of the kill, and exits (no process left hanging)."""
    monkeypatch.setenv("ZIPCCL_TRANSPORT", "nccl")
    monkeypatch.setenv("ZIPCCL_TIMEOUT", str(TIMEOUT))
    n = 4
    got, procs = spawn(_killed, n, (n, free_port()), answers=n - 1, seconds=90)
    survivors = [r for r in range(n) if r != VICTIM]
    assert sorted(got) == survivors, got
    for r in survivors:
        kind, named, message, seconds = got[r]
        assert kind == "RankFailure" and named == VICTIM, (r, got[r])
        assert seconds <= TIMEOUT + 5, (r, got[r])
    assert procs[VICTIM].exitcode == -signal.SIGKILL
    assert all(procs[r].exitcode == 0 for r in survivors), [p.exitcode for p in procs]
