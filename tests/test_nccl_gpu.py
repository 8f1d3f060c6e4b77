"""The gpu suite (``pytest -m gpu``, docs/GPU.md): Triton kernels on real CUDA tensors, and the NCCL
transport on 1, 2 and 4 ranks, against the reference and the gloo path: one GPU per rank where the
machine has enough, else every rank on cuda:0 as its own NCCL host (the one-GPU lab,
zipccl.launch.lab_env). Where CUDA is unavailable every gpu-marked test skips for that reason
alone (tests/ci_rules.py NO_CUDA, the one skip CI allows). The tests that take the ``compiled``
fixture run the compiled kernels, in a pytest of their own without Triton's interpreter
(tests/triton_mode.py). More multi-rank tests: tests/test_gpu_lab.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from zipccl.codecs import Lossless
from zipccl.format import GPU_BLOCK_SIZE
from zipccl.launch import free_port
from workers import join_gpu_world, spawn

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _specification(block_size: int = GPU_BLOCK_SIZE) -> Lossless:
    """The format's bytes for inputs of millions of elements: numba's encoder, which equals the
    reference byte for byte (tests/test_codec.py, every block size) at a hundredth of its time,
    so that the codec's GPU step leaves room for its benchmark; the reference itself checks the
    16-bit patterns."""
    return Lossless("numba", block_size=block_size)


def _digest(x: torch.Tensor) -> str:
    return hashlib.sha1(x.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def _data(rank: int, n: int, dtype) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * 0.02
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 65504.0])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_on_cuda_matches_the_specification(compiled, dtype):
    x = _data(0, (1 << 22) + 77, dtype)
    packet = Lossless("triton").encode(x.cuda())
    assert packet.is_cuda
    # the specification's bytes, at Triton's default block size (the CPU's default is smaller)
    assert torch.equal(packet.cpu(), _specification().encode(x))
    back = Lossless("triton").decode(packet)
    assert _digest(back) == _digest(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_many_and_decode_many_on_cuda(compiled, dtype):
    """Seven peers' chunks of a reduce-scatter piece (rows of an (8, m) matrix, this rank's left
    out) in one launch sequence: each packet at its slot is the specification's, and decodes back,
    alone and with decode_many into the rows of one tensor."""
    m = torch.stack([_data(r, 300_007, dtype) for r in range(8)]).cuda()
    parts = [m[j, 5:] for j in range(8) if j != 3]
    codec = Lossless("triton")
    slot = codec.slot(parts[0].numel(), dtype)
    out = torch.empty(len(parts) * slot, dtype=torch.uint8, device="cuda")
    sizes = codec.encode_many(parts, out).tolist()
    for k, x in enumerate(parts):
        want = _specification().encode(x.cpu())
        assert torch.equal(out[k * slot:k * slot + sizes[k]].cpu(), want), k
        assert _digest(codec.decode(out[k * slot:k * slot + sizes[k]])) == _digest(x), k
    back = torch.empty(len(parts), parts[0].numel(), dtype=dtype, device="cuda")
    verdicts = codec.decode_many([out[k * slot:k * slot + s] for k, s in enumerate(sizes)], list(back))
    assert all(v.problem() is None for v in verdicts)
    assert all(_digest(back[k]) == _digest(x) for k, x in enumerate(parts))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [256, 1024, 16384, 32768])
def test_every_16bit_pattern_on_cuda(compiled, dtype, block_size):
    """All 2^16 patterns, shuffled, through the compiled kernels at the smallest block, 1024,
    the largest the encoder takes (16384: its packet against the reference's) and the largest of
    the format (32768: the reference's packet, decoded)."""
    from zipccl.kernels import gpu
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(2))].repeat(3)
    want = Lossless("reference", block_size=block_size).encode(x)
    if block_size <= gpu.MAX_ENCODE_BLOCK:
        packet = Lossless("triton", block_size=block_size).encode(x.cuda())
        assert torch.equal(packet.cpu(), want)
    else:
        packet = want.cuda()
    assert _digest(Lossless("triton").decode(packet)) == _digest(x)


def test_no_synchronising_torch_operation_in_encode_or_decode_into_out(compiled):
    """torch.cuda.set_sync_debug_mode("error") raises nothing inside an encode, an encode_into a
    caller's buffer and a decode into a given out: their host reads (one, none, two) wait on
    events after copies to pinned memory, not on synchronising operations; the bits come back."""
    x = _data(0, (1 << 22) + 77, torch.bfloat16).cuda()
    codec = Lossless("triton")
    buf = torch.empty(codec.max_encoded_size(x.numel(), x.dtype), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(x)
    codec.decode(codec.encode(x), out)  # warm: compiled, the bank's tables on the device
    codec.encode_into(x, buf)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        packet = codec.encode(x)
        size = codec.encode_into(x, buf)
        codec.decode(packet, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert int(size) == packet.numel() and torch.equal(buf[:packet.numel()], packet)
    assert _digest(out) == _digest(x)


COLD = textwrap.dedent("""
    import torch
    from zipccl.codecs import Lossless
    x = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(8)) * 0.02).to(torch.bfloat16).cuda()
    codec = Lossless("triton")
    buf = torch.empty(codec.max_encoded_size(x.numel(), x.dtype), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        codec.encode_into(x, buf)
        verdict = codec.decode_into(buf, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert verdict.problem() is None
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    print("clean")
""")


def test_a_cold_first_call_makes_no_synchronising_call(compiled):
    """In a fresh process (nothing compiled, no table of the bank on the device yet) the first
    encode_into and decode_into run under set_sync_debug_mode("error"): the tables go up from
    pinned memory on the current stream, the host not waiting (reference.packet.to_device)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", COLD], capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "clean", r.stderr[-3000:]


def test_encode_into_replays_bit_exactly_from_a_cuda_graph(compiled):
    """encode_into captured in a CUDA graph: replayed on new values of the captured input (of
    another spread, so another packet size), the buffer holds encode's packet of those values,
    the size tensor its size, and the packet decodes to them."""
    codec = Lossless("triton")
    x = _data(1, 1 << 20, torch.bfloat16).cuda()
    buf = torch.zeros(codec.max_encoded_size(x.numel(), x.dtype), dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm on a side stream, as torch's graph recipe does
        for _ in range(2):
            codec.encode_into(x, buf)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        size = codec.encode_into(x, buf)
    for seed, spread in ((2, 1e-3), (3, 10.0)):
        new = (torch.randn(x.numel(), generator=torch.Generator().manual_seed(seed)) * spread).to(x.dtype)
        x.copy_(new.cuda())
        graph.replay()
        torch.cuda.synchronize()
        want = codec.encode(x)
        assert int(size) == want.numel(), (seed, int(size), want.numel())
        assert torch.equal(buf[:want.numel()], want), seed
        assert _digest(codec.decode(buf)) == _digest(new), seed


def test_a_round_trip_replays_from_one_cuda_graph(compiled):
    """encode_into then decode_into, captured in one CUDA graph (neither reads the host): replayed
    on new values of the captured input (other spreads, other packet sizes), the output holds
    those values bit for bit and each replay's verdict is good; with sync debug mode at "error"
    decode_into makes no synchronising call."""
    codec = Lossless("triton")
    x = _data(4, 1 << 20, torch.bfloat16).cuda()
    buf = torch.zeros(codec.max_encoded_size(x.numel(), x.dtype), dtype=torch.uint8, device="cuda")
    out = torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm: compiled, tables and templates on the device
        for _ in range(2):
            codec.encode_into(x, buf)
            codec.decode_into(buf, out)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        codec.decode_into(buf, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        codec.encode_into(x, buf)
        verdict = codec.decode_into(buf, out)
    for seed, spread in ((5, 1e-3), (6, 10.0), (7, 0.02)):
        new = (torch.randn(x.numel(), generator=torch.Generator().manual_seed(seed)) * spread).to(x.dtype)
        x.copy_(new.cuda())
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert verdict.problem() is None, seed
        assert _digest(out) == _digest(new), seed


def test_many_packets_replay_from_one_cuda_graph(compiled):
    """encode_many then decode_many, warmed, then captured in one CUDA graph: each call uploads its
    packets' places from pinned memory, which every replay copies again (zipccl keeps it:
    reference.packet.to_device). Between replays other small uploads pass through pinned memory,
    as a training step's would; each replay still gives every part back bit for bit, each
    verdict good."""
    dtype, n, count = torch.bfloat16, 200_003, 4
    m = torch.stack([_data(r, n, dtype) for r in range(count)]).cuda()
    parts, back = list(m), torch.empty_like(m)
    codec = Lossless("triton")
    slot = codec.slot(n, dtype)
    out = torch.zeros(count * slot, dtype=torch.uint8, device="cuda")

    def round_trip():
        codec.encode_many(parts, out)
        return codec.decode_many([out[k * slot:(k + 1) * slot] for k in range(count)], list(back))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            round_trip()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verdicts = round_trip()
    for seed, spread in ((8, 1e-3), (9, 10.0)):
        new = torch.stack([(torch.randn(n, generator=torch.Generator().manual_seed(seed + 10 * r)) * spread).to(dtype)
                           for r in range(count)])
        m.copy_(new.cuda())
        back.zero_()
        for k in range(16):  # other data through pinned memory of the same sizes
            torch.full((3 * count,), 7_777_777 + k, dtype=torch.int64).pin_memory().to("cuda", non_blocking=True)
            torch.full((count,), 5_555_555 + k, dtype=torch.int64).pin_memory().to("cuda", non_blocking=True)
        graph.replay()
        torch.cuda.synchronize()
        assert all(v.problem() is None for v in verdicts), seed
        assert _digest(back) == _digest(new), seed


@pytest.mark.parametrize("dtype", DTYPES)
def test_real_gradients_on_cuda(compiled, real_grads, dtype):
    """The whole real bucket (3.3M elements, not a block multiple) on the GPU: the specification's bytes,
    and the same bits back; the numba decoder reads the GPU's packet too."""
    x = real_grads.to(dtype)
    packet = Lossless("triton").encode(x.cuda())
    assert torch.equal(packet.cpu(), _specification().encode(x))
    assert _digest(Lossless("triton").decode(packet)) == _digest(x)
    assert _digest(Lossless("numba").decode(packet.cpu())) == _digest(x)


def _differences(gpu: torch.Tensor, cpu: torch.Tensor) -> tuple[int, int, list]:
    """Elements whose bits differ, those of them that are not NaN on both sides, and the first
    five as (index, GPU bits, CPU bits)."""
    ints = torch.int32 if gpu.element_size() == 4 else torch.int16
    a, b = gpu.view(ints), cpu.view(ints)
    where = torch.nonzero(a != b).flatten()
    both_nan = torch.isnan(gpu[where]) & torch.isnan(cpu[where])
    return int(where.numel()), int((~both_nan).sum()), [(int(i), int(a[i]), int(b[i])) for i in where[:5]]


def _worker(rank: int, n: int, port: int, results) -> None:
    """One rank: the collectives over CuPy's NCCL on its GPU (join_gpu_world), and over gloo on
    CPU copies."""
    import torch.distributed as dist

    import zipccl
    assert zipccl.config.TRANSPORT == "nccl"  # set by the test before the spawn: read at import
    from zipccl.transport import NcclTransport
    join_gpu_world(rank, n, port)
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
                got = {}
                for where in ("cuda", "cpu"):  # cpu: the gloo path, the expected bits
                    x = _data(rank, 3_000_001, dtype).to(where)
                    zipccl.all_reduce(x, codec=codec)
                    rs = torch.empty(1_000_000, dtype=dtype, device=where)
                    zipccl.reduce_scatter(rs, _data(rank, n * 1_000_000, dtype).to(where), codec=codec)
                    ag = torch.empty(n * 999_999, dtype=dtype, device=where)
                    zipccl.all_gather(ag, _data(rank, 999_999, dtype).to(where), codec=codec)
                    got[where] = (x.cpu(), rs.cpu(), ag.cpu())
                x, rs, ag = got["cuda"]
                out[(str(dtype), codec)] = dict(
                    same=dict(all_reduce=_digest(x), all_gather=_digest(ag)),  # the same on every rank
                    diffs=[_differences(*pair) for pair in zip(got["cuda"], got["cpu"])])
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = f"{type(e).__name__}: {e}"
    results.put((rank, out))
    dist.destroy_process_group()


def _run(n: int) -> list:
    got, _ = spawn(_worker, n, (n, free_port()), seconds=500)
    assert sorted(got) == list(range(n)), got
    return [got[r] for r in range(n)]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_nccl_transport_matches_gloo(n, monkeypatch):
    """zipccl's pipeline over NCCL against the gloo path on CPU copies of the same data, on every
    rank: raw and lossless give the same bits except NaN payloads (a NaN stays a NaN; CUDA's fp32
    to bf16/fp16 conversion writes its own NaN bits, docs/GPU.md); native is NCCL's own
    collective, whose summation order NCCL chooses, so only its all-gather is compared; every
    all-gather moves bits and matches exactly. Every rank ends with the same all-reduce and
    all-gather bits (a reduce-scatter's output is the rank's own slice: compared with gloo's)."""
    monkeypatch.setenv("ZIPCCL_TRANSPORT", "nccl")  # the spawned ranks inherit it
    res = _run(n)
    for out in res:
        assert not isinstance(out, str), res
        if n == 1:
            assert out.pop("self")
        for dtype in DTYPES:
            for codec in ("native", "raw", "lossless"):
                diffs = out[(str(dtype), codec)]["diffs"]
                assert diffs[2][0] == 0, (dtype, codec, "all_gather", diffs)
                if codec != "native":
                    assert diffs[0][1] == 0 and diffs[1][1] == 0, (dtype, codec, diffs)
    for key in res[0]:
        assert len({str(out[key]["same"]) for out in res}) == 1, key  # every rank has the same bits
    print({k: v["diffs"] for k, v in res[0].items()})  # NaN payload differences, shown with -s


def _stream_rules(rank: int, n: int, port: int, results) -> None:
    """Two ranks. The mail channel: rank 0 sends rank 1 a 256 MiB packet, whose receive rank 1
    posts only once it has both ranks' mails; the mails are exchanged after the packet is issued.
    On one channel rank 0's mail would queue behind its packet, which waits for a receive that
    waits for that mail: each rank gives up after ZIPCCL_TIMEOUT. On the mail channel the mails
    pass the pending packet (where the GPU runs kernels of several streams side by side: not with
    CUDA_DEVICE_MAX_CONNECTIONS=1). Then an async all-reduce issued on a side stream whose input is
    written there behind about 50 ms of GPU work, and read there right after ``wait()``: the
    sum comes back only where the call starts after the caller's stream and ``wait()`` orders
    the caller's stream after the call (zipccl.executor)."""
    import torch.distributed as dist

    import zipccl
    from zipccl.transport import NcclTransport
    join_gpu_world(rank, n, port)
    out = {}
    try:
        t = NcclTransport.of(None)
        # NCCL connects two ranks on a channel at their first send or receive, inside the host's
        # group call, which returns once the peer has posted its side: a first packet that one rank
        # posts alone holds its host until then (zipccl's calls post both sides). Connect first.
        first = [torch.zeros(1, dtype=torch.uint8, device="cuda"), torch.zeros(1, dtype=torch.int64)]
        with t.grouped():
            hello = [w for x in first for w in (t.isend(x, 1 - rank), t.irecv(x.clone(), 1 - rank))]
        for w in hello:
            t.wait(w, timeout=20)
        packet = torch.full((256 << 20,), 7 if rank == 0 else 0, dtype=torch.uint8, device="cuda")
        mine, theirs = torch.tensor([100 + rank]), torch.zeros(1, dtype=torch.int64)
        if rank == 0:
            with t.grouped():
                bulk = t.isend(packet, 1)
        with t.grouped():
            mails = [t.isend(mine, 1 - rank), t.irecv(theirs, 1 - rank)]
        for w in mails:
            t.wait(w, timeout=20)
        if rank == 1:
            with t.grouped():
                bulk = t.irecv(packet, 0)
        t.wait(bulk, timeout=60)
        out["mail"] = (int(theirs), bool((packet == 7).all()))
        x, side = torch.zeros(1 << 22, device="cuda"), torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)  # GPU cycles: about 50 ms
            x.fill_(rank + 1)
            zipccl.all_reduce(x, codec="raw", async_op=True).wait()
            y = x.clone()
        torch.cuda.synchronize()
        out["async"] = bool((y == 3).all())
    except Exception as e:  # noqa: BLE001 - reported to the test
        out = f"{type(e).__name__}: {e}"
    results.put((rank, out))
    dist.destroy_process_group()


def test_nccl_transport_mail_and_async_stream_rules(monkeypatch):
    """On 2 ranks: a host tensor's message does not wait for a device tensor's message issued
    before it (the mail channel), and an async call keeps the caller's stream order."""
    monkeypatch.setenv("ZIPCCL_TIMEOUT", "30")
    monkeypatch.setenv("ZIPCCL_TRANSPORT", "nccl")
    got, _ = spawn(_stream_rules, 2, (2, free_port()), seconds=200)
    assert got == {r: {"mail": (101 - r, True), "async": True} for r in range(2)}, got


_ONE_GPU = r'''
import os, sys, torch, torch.distributed as dist
import zipccl, zipccl.fsdp
from torch.distributed.fsdp import fully_shard
torch.cuda.set_device(0)
dist.init_process_group("zipccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
assert dist.get_backend() == "zipccl"
x = (torch.randn(1_000_003, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
for codec in ("native", "raw", "lossless"):  # zipccl's front door on CUDA tensors, one rank
    y = x.cuda()
    zipccl.all_reduce(y, codec=codec)
    assert torch.equal(y.cpu().view(torch.int16), x.view(torch.int16)), codec
    assert zipccl.stats()["last"]["codec"] == codec, (codec, zipccl.stats()["last"])  # the path asked for ran
y = x.cuda()
calls = zipccl.stats()["all_reduce"]["calls"]
dist.all_reduce(y)  # the drop-in: CUDA through zipccl's planner, on its NCCL communicator for the group
assert zipccl.stats()["all_reduce"]["calls"] == calls + 1, "the drop-in's all_reduce did not go through zipccl"
ag = torch.empty_like(y)
calls = {k: zipccl.stats().get(k, {}).get("calls", 0) for k in ("all_gather", "reduce_scatter")}
dist.all_gather_into_tensor(ag, y)  # torch 2.11 calls the group's _allgather_base: zipccl's too
rs = torch.empty_like(y)
dist.reduce_scatter_tensor(rs, y, op=dist.ReduceOp.AVG)
assert all(zipccl.stats()[k]["calls"] == calls[k] + 1 for k in calls), (calls, zipccl.stats())
for t in (y, ag, rs):
    assert torch.equal(t.cpu().view(torch.int16), x.view(torch.int16))
torch.manual_seed(0)
make = lambda: torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
plain, model = make(), make()
model.load_state_dict(plain.state_dict())
for m in model:
    if isinstance(m, torch.nn.Linear):
        fully_shard(m)
fully_shard(model)
zipccl.fsdp.compress(model, codec="lossless")
inp = torch.randn(64, 256, device="cuda")
plain(inp).square().mean().backward()
model(inp).square().mean().backward()
for (name, p), q in zip(plain.named_parameters(), model.parameters()):
    g = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
    assert torch.equal(g, p.grad), name
dist.destroy_process_group()
print("one-GPU drop-in and FSDP2: OK")
'''


def test_dropin_backend_and_fsdp2_on_one_gpu(tmp_path):
    """One rank on one GPU, in a fresh process: zipccl's collectives on CUDA tensors (native, raw,
    lossless: each the path it names), the drop-in backend's CUDA calls (through zipccl's planner:
    counted there), and
    FSDP2 with zipccl's comms, whose gradients equal an unsharded copy's."""
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="0", ZIPCCL_TRANSPORT="nccl")
    r = subprocess.run([sys.executable, "-c", _ONE_GPU, str(free_port())], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
