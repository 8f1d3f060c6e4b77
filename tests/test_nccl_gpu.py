"""The gpu suite (``pytest -m gpu``, docs/GPU.md): Triton kernels on real CUDA tensors, and the NCCL
transport on one GPU and on every GPU of the machine, against the reference and the gloo path.
Skipped, with the reason, where CUDA is unavailable (CI here: tests/conftest.py allows that skip).
Run with TRITON_INTERPRET=0, or tests/conftest.py puts Triton in its CPU interpreter."""

from __future__ import annotations

import datetime
import hashlib
import os
import queue
import time

import pytest
import torch
import torch.multiprocessing as mp

from zipccl.launch import free_port

NO_CUDA = "no CUDA device: the gpu suite runs on a GPU machine (docs/GPU.md)"
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha1(x.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def _data(rank: int, n: int, dtype) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * 0.02
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 65504.0])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_on_cuda_matches_the_reference(dtype):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: run the gpu suite with TRITON_INTERPRET=0 (docs/GPU.md)")
    from zipccl.codecs import Lossless
    x = _data(0, (1 << 22) + 77, dtype)
    packet = Lossless("triton").encode(x.cuda())
    assert packet.is_cuda
    assert torch.equal(packet.cpu(), Lossless("reference").encode(x))  # the specification's bytes
    back = Lossless("triton").decode(packet)
    assert _digest(back) == _digest(x)


def _worker(rank: int, n: int, port: int, results) -> None:
    """One rank: the collectives over CuPy's NCCL on cuda:rank, and over gloo on CPU copies."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ZIPCCL_TRANSPORT="nccl")
    import zipccl
    from zipccl.transport import NcclTransport
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", rank=rank, world_size=n, timeout=datetime.timedelta(seconds=120))
    out = {}
    try:
        t = NcclTransport.of(None)
        if n == 1:  # a grouped send and receive to itself
            got = torch.empty(1000, dtype=torch.uint8, device="cuda")
            with t.grouped():
                works = [t.isend(torch.arange(1000, device="cuda").to(torch.uint8), 0), t.irecv(got, 0)]
            for w in works:
                t.wait(w)
            out["self"] = torch.equal(got.cpu(), torch.arange(1000).to(torch.uint8))
        for dtype in DTYPES:
            for codec in ("native", "raw", "lossless"):
                for where in ("cuda", "cpu"):  # cpu: the gloo path, the expected bits
                    x = _data(rank, 3_000_001, dtype).to(where)
                    zipccl.all_reduce(x, codec=codec)
                    rs = torch.empty(1_000_000, dtype=dtype, device=where)
                    zipccl.reduce_scatter(rs, _data(rank, n * 1_000_000, dtype).to(where), codec=codec)
                    ag = torch.empty(n * 999_999, dtype=dtype, device=where)
                    zipccl.all_gather(ag, _data(rank, 999_999, dtype).to(where), codec=codec)
                    out[(str(dtype), codec, where)] = (_digest(x), _digest(rs), _digest(ag))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = f"{type(e).__name__}: {e}"
    results.put((rank, out))
    dist.destroy_process_group()


def _run(n: int) -> list:
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_worker, args=(r, n, port, results)) for r in range(n)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + 500
    try:
        while len(got) < n and time.monotonic() < deadline:
            try:
                rank, value = results.get(timeout=1)
                got[rank] = value
            except queue.Empty:
                pass
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert sorted(got) == list(range(n)), got
    return [got[r] for r in range(n)]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_nccl_transport_matches_gloo(n):
    """Native codec: NCCL's own collectives (sums may round differently from gloo's rank order, so
    only the all-gather's bits are compared); raw and lossless: zipccl's pipeline over NCCL, whose
    bits equal the gloo path's on every rank (invariant 3)."""
    if torch.cuda.device_count() < n:
        pytest.skip(f"{n} ranks need {n} GPUs, this machine has {torch.cuda.device_count()}")
    res = _run(n)
    for out in res:
        assert not isinstance(out, str), res
        if n == 1:
            assert out.pop("self")
        for dtype in DTYPES:
            for codec in ("native", "raw", "lossless"):
                gpu, cpu = out[(str(dtype), codec, "cuda")], out[(str(dtype), codec, "cpu")]
                assert gpu[2] == cpu[2], (dtype, codec)
                if codec != "native":
                    assert gpu == cpu, (dtype, codec)
    assert len({str(out) for out in res}) == 1  # every rank has the same bits
