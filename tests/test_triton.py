"""The Triton kernels: under the interpreter on real data, and compiled ahead of time for sm_80/sm_90.

The shared matrix against the reference (sizes, data kinds, corrupt packets) lives in
test_codec.py; this file adds what is specific to the GPU path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import zipccl
from zipccl import format as F
from zipccl.codecs import Lossless
from test_codec import assert_same_bits

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("triton", reason="triton not installed (pip install zipccl[gpu]); .ci/run installs it")


@pytest.mark.parametrize("dtype,block_size", [(torch.bfloat16, 4096), (torch.float16, 1024), (torch.float32, 1024)],
                         ids=str)
def test_real_gradients_match_reference(real_grads, dtype, block_size):
    """33K elements of the real bucket (the interpreter's pace sets the size), cut mid-block: at
    1024-element blocks more than one program of the decoder's lanes (8 blocks each), at 4096
    several programs (2 blocks each) and a tail."""
    x = real_grads[2_000_000:2_000_000 + 33 * 1024 + 123].to(dtype)
    from zipccl.kernels import gpu
    assert x.numel() // block_size > gpu.lanes(block_size)[1]
    ref, gpu = Lossless("reference", block_size=block_size), Lossless("triton", block_size=block_size)
    p = ref.encode(x)
    assert torch.equal(gpu.encode(x), p)
    assert_same_bits(gpu.decode(p), x)


def _rows(dtype: torch.dtype, cols: int, seed: int) -> torch.Tensor:
    """A (4, cols) matrix of gradient-like rows, row 2 with a run of +0.0 and row 3 with random
    bits in its middle (raw blocks)."""
    g = torch.Generator().manual_seed(seed)
    m = (torch.randn(4, cols, generator=g) * 1e-2).to(dtype)
    m[2, 400:1400] = 0.0
    ints = m.view(torch.int32 if dtype == torch.float32 else torch.int16)
    ints[3, 1000:2000] = torch.randint(0, 2**31 - 1 if dtype == torch.float32 else 2**15, (1000,),
                                       generator=g).to(ints.dtype)
    return m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_encode_many_writes_each_parts_reference_packet(dtype):
    """A reduce-scatter piece's parts: columns 300..2900 of three rows of a (4, 3000) matrix, one
    row left out, the last block short, one part with a run of +0.0 and one of random bits (raw
    blocks). Each packet at its slot is the reference's encode of its part, byte for byte, its
    size the reference's, and the bytes between packets are untouched."""
    m = _rows(dtype, 3000, seed=8)
    parts = [m[j, 300:2900] for j in (0, 2, 3)]
    codec, ref = Lossless("triton", block_size=256), Lossless("reference", block_size=256)
    slot = codec.slot(parts[0].numel(), dtype)
    out = torch.full((3 * slot,), 0xA5, dtype=torch.uint8)
    sizes = codec.encode_many(parts, out).tolist()
    for k, x in enumerate(parts):
        want = ref.encode(x)
        assert sizes[k] == want.numel(), (k, sizes, want.numel())
        assert torch.equal(out[k * slot:k * slot + sizes[k]], want), k
        assert bool((out[k * slot + sizes[k]:(k + 1) * slot] == 0xA5).all()), k
    from zipccl.reference.packet import parse_lossless
    assert (parse_lossless(ref.encode(parts[2])).table == F.RAW_BLOCK).any()  # the random bits went raw


def test_encode_many_of_separate_tensors_and_its_errors():
    """Parts of separate storages take one encode_into each, with the same packets; parts of
    two sizes, or too small an ``out``, are refused."""
    g = torch.Generator().manual_seed(9)
    parts = [(torch.randn(700, generator=g) * 1e-3).to(torch.bfloat16) for _ in range(2)]
    codec, ref = Lossless("triton", block_size=256), Lossless("reference", block_size=256)
    slot = codec.slot(700, torch.bfloat16)
    out = torch.empty(2 * slot, dtype=torch.uint8)
    sizes = codec.encode_many(parts, out).tolist()
    for k, x in enumerate(parts):
        assert torch.equal(out[k * slot:k * slot + sizes[k]], ref.encode(x)), k
    with pytest.raises(ValueError, match="one dtype, numel"):
        codec.encode_many([parts[0], parts[1][:600]], out)
    with pytest.raises(ValueError, match="at least 2 x"):
        codec.encode_many(parts, out[:slot])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_decode_many_decodes_each_packet_into_its_out(dtype):
    """Three packets at the slots of one buffer (encode_many's, one of them with raw blocks) into
    rows 0, 2 and 4 of a matrix: each row holds its part's bits, the rows between are untouched.
    With packet 1's header corrupted, its verdict names the problem and its row stays as it was,
    while the other two decode as before."""
    parts = list(_rows(dtype, 2600, seed=10)[[0, 2, 3]])
    codec = Lossless("triton", block_size=256)
    slot = codec.slot(2600, dtype)
    buf = torch.empty(3 * slot, dtype=torch.uint8)
    sizes = codec.encode_many(parts, buf).tolist()
    packets = [buf[k * slot:k * slot + sizes[k]] for k in range(3)]
    for bad in (None, 1):
        if bad is not None:
            buf[bad * slot + 20] ^= 0xFF
        outs = torch.full((5, 2600), 7.0, dtype=dtype)
        verdicts = codec.decode_many(packets, [outs[0], outs[2], outs[4]])
        for k, row in enumerate((0, 2, 4)):
            if k == bad:
                assert "header" in verdicts[k].problem() and bool((outs[row] == 7.0).all()), verdicts[k].problem()
            else:
                assert verdicts[k].problem() is None
                assert_same_bits(outs[row], parts[k])
        assert bool((outs[1] == 7.0).all() and (outs[3] == 7.0).all())


def test_decode_many_of_separate_tensors_and_its_errors():
    """Packets and outs of separate storages take one decode_into each, with the same results;
    outs of two sizes, or fewer outs than packets, are refused."""
    g = torch.Generator().manual_seed(11)
    parts = [(torch.randn(700, generator=g) * 1e-3).to(torch.bfloat16) for _ in range(2)]
    codec = Lossless("triton", block_size=256)
    packets = [Lossless("reference", block_size=256).encode(x) for x in parts]
    outs = [torch.empty(700, dtype=torch.bfloat16) for _ in parts]
    assert all(v.problem() is None for v in codec.decode_many(packets, outs))
    for out, x in zip(outs, parts):
        assert_same_bits(out, x)
    with pytest.raises(ValueError, match="one dtype and numel"):
        codec.decode_many(packets, [outs[0], outs[1][:600]])
    with pytest.raises(ValueError, match="as many outs as packets"):
        codec.decode_many(packets, outs[:1])


@pytest.mark.overflow_checked
def test_largest_block_of_one_symbol():
    """The largest block the Triton encoder takes (gpu.MAX_ENCODE_BLOCK, 16384) of one value: that
    many of one symbol in the analysis's 16-bit counts, the longest word packing. Encode only: the
    interpreter decodes a block that long slowly. Larger blocks, which the format allows, are
    refused by name; the Triton decoder reads them."""
    from zipccl.kernels import gpu
    x = torch.full((gpu.MAX_ENCODE_BLOCK,), 0.375, dtype=torch.bfloat16)
    ref, tri = Lossless("reference", block_size=gpu.MAX_ENCODE_BLOCK), Lossless("triton", block_size=gpu.MAX_ENCODE_BLOCK)
    assert torch.equal(tri.encode(x), ref.encode(x))
    y = torch.full((300,), 0.375, dtype=torch.bfloat16)
    with pytest.raises(zipccl.UnsupportedError, match="at most 16384"):
        Lossless("triton", block_size=32768).encode(y)
    assert_same_bits(Lossless("triton", block_size=32768).decode(Lossless("reference", block_size=32768).encode(y)), y)


@pytest.mark.overflow_checked
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_16bit_pattern(dtype):
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(2))]
    gpu = Lossless("triton", block_size=512)
    p = gpu.encode(x)
    assert torch.equal(p, Lossless("reference", block_size=512).encode(x))  # the specification's bytes
    assert_same_bits(gpu.decode(p), x)


def test_decode_in_spans_of_bounded_scratch(monkeypatch):
    """A packet whose codes outgrow the decoder's scratch is decoded span by span, around a raw
    block: same bits, and a corrupt block in a later span is still reported."""
    from zipccl.kernels import gpu
    from zipccl.reference.packet import parse_lossless
    monkeypatch.setattr(gpu, "DECODE_SCRATCH", 256 * gpu.lanes(256)[1])  # one program's blocks per launch
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(256 * 70 + 77, generator=g) * 0.01).to(torch.bfloat16)
    x[::13] = 0.0
    x[256 * 5:256 * 6] = torch.randint(-2**15, 2**15, (256,), generator=g, dtype=torch.int16).view(torch.bfloat16)
    ref, tri = Lossless("reference", block_size=256), Lossless("triton", block_size=256)
    p = ref.encode(x)
    lp = parse_lossless(p)
    assert int((torch.as_tensor(lp.table) == F.RAW_BLOCK).sum()) == 1  # block 5: 70 coded blocks, 3 spans
    assert_same_bits(tri.decode(p), x)
    # A corrupt block in each span (coded blocks 2, 59 and 65), each packet the first flip of that
    # block's stream that the reference rejects: a later span must neither lose nor overwrite it.
    for b in (2, 60, 66):
        first, end = (lp.stream_offset + 4 * int(lp.word_start[i]) for i in (b, b + 1))
        for off in range(first, end):
            q = p.clone()
            q[off] ^= 1
            try:
                ref.decode(q)
            except zipccl.FormatError:
                break
        else:
            pytest.fail(f"no flip of block {b}'s stream is rejected by the reference")
        with pytest.raises(zipccl.FormatError):
            tri.decode(q)


@pytest.mark.overflow_checked
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("entry", ["encode", "encode_into"])
def test_an_input_changed_after_the_plan_writes_nothing_outside_the_packet(monkeypatch, dtype, entry):
    """The plan comes from a first pass over x (``_analyse``); another stream may change x before
    ``_encode`` reads it. Here x is planned as small values, nine in ten of them +0.0 (short
    codes, few rest bytes), then overwritten with random nonzero bit patterns (exponents far from
    the planned ones, no +0.0): its blocks code far longer than planned. The packet is then wrong (its decode differs or raises), but
    not one byte past it is written: encode's packet lies at the front of a larger buffer, and
    encode_into's ``out`` is a view of one, the rest of each filled with a guard byte."""
    from zipccl.kernels import gpu
    g = torch.Generator().manual_seed(21)
    n = 5 * 256 + 40
    x = (torch.randn(n, generator=g) * 1e-3).to(dtype)
    x[torch.rand(n, generator=g) < 0.9] = 0.0
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    hostile = torch.randint(1, 2**15, (n,), generator=g, dtype=torch.int32).to(ints).view(dtype)
    codec = Lossless("triton", block_size=256)
    bound = codec.max_encoded_size(n, dtype)
    arena = torch.full((bound + 4096,), 0xA5, dtype=torch.uint8)
    planned = gpu._plan

    real_empty = torch.empty

    def packet_in_arena(*size, dtype=None, device=None, **kw):  # encode's packet: the arena's front
        if dtype == torch.uint8 and len(size) == 1 and isinstance(size[0], int) and size[0] <= bound:
            return arena[:size[0]]
        return real_empty(*size, dtype=dtype, device=device, **kw)

    def plan_then_change(x_, block_size, read, **kw):
        pl = planned(x_, block_size, read, **kw)
        x_.copy_(hostile)
        if entry == "encode":  # the next allocation is the packet's
            monkeypatch.setattr(gpu.torch, "empty", packet_in_arena)
        return pl

    monkeypatch.setattr(gpu, "_plan", plan_then_change)
    if entry == "encode":
        packet = codec.encode(x)
        assert packet.data_ptr() == arena.data_ptr()
        size = packet.numel()
        monkeypatch.setattr(gpu.torch, "empty", real_empty)
    else:
        size = int(codec.encode_into(x, arena[:bound]))
    assert size <= bound
    assert bool((arena[size:] == 0xA5).all()), f"{int((arena[size:] != 0xA5).sum())} bytes written past the packet"
    monkeypatch.setattr(gpu, "_plan", planned)
    try:
        back = Lossless("reference", block_size=256).decode(arena[:size])
    except zipccl.FormatError:
        return
    assert not torch.equal(back.view(ints), hostile.view(ints))  # planned from other data: no packet of it


def test_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(zipccl.UnsupportedError, match="CUDA"):
        Lossless("triton").encode(torch.zeros(8, dtype=torch.bfloat16))


def test_coding_runs_with_the_tensors_own_gpu_current(monkeypatch):
    """Triton launches on the current CUDA device, the codec allocates on the tensor's: every
    entry point makes the tensor's device current for the call (a stand-in for torch.cuda.device
    records which, with cuda:0 current), and leaves the current one alone where they agree and on
    CPU tensors."""
    from zipccl.kernels import gpu
    made_current = []

    class Device:  # torch.cuda.device's stand-in
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            made_current.append(self.device)

        def __exit__(self, *exc):
            made_current.append("restored")

    class OnGpu:  # what the guard reads of a CUDA tensor
        def __init__(self, index):
            self.is_cuda, self.device = True, torch.device("cuda", index)

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    during = []
    call = gpu.on_its_device(lambda first, *args: during.append(list(made_current)) or len(during))
    assert call(OnGpu(1), "more") == 1 and during[-1] == [torch.device("cuda", 1)]
    assert made_current == [torch.device("cuda", 1), "restored"]
    assert call([OnGpu(2), OnGpu(2)]) == 2 and during[-1][-1] == torch.device("cuda", 2)  # a list: its first
    made_current.clear()
    assert call(OnGpu(0)) == 3 and call(torch.zeros(2)) == 4 and made_current == []
    for name in ("encode", "encode_into", "encode_many", "decode", "decode_into", "decode_many", "read_index"):
        assert getattr(gpu, name).__code__ is call.__code__, f"gpu.{name} runs on whatever device is current"


def _run(code_or_args, env_drop=("TRITON_INTERPRET",), timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, env=env, timeout=timeout)


class _Stream:
    """A CUDA stream's stand-in: records the events it is made to wait for."""

    def __init__(self, name: str):
        self.name, self.waited = name, []

    def wait_event(self, event) -> None:
        self.waited.append(event)


class _Event:
    """A CUDA event's stand-in; passes once ``done`` is set, and may not be asked while capturing."""

    def __init__(self, state: dict):
        self.done, self.state = False, state

    def record(self, stream) -> None:
        self.stream = stream

    def query(self) -> bool:
        assert not self.state["capturing"], "an event queried during a capture"
        return self.done


class _Table:
    """A kept table's stand-in: the streams it is recorded on."""

    def __init__(self, name: str):
        self.name, self.recorded = name, []

    def record_stream(self, stream) -> None:
        self.recorded.append(stream.name)


def test_a_table_uploaded_on_one_stream_is_waited_for_on_another(monkeypatch):
    """kernels.constants: a kept table's upload is asynchronous on the stream of its first call;
    a call on another stream waits for it by event until it is seen done, and records it there;
    the uploading stream needs no wait; made inside a graph capture a table is not kept (it holds
    its data only in the graph's replays), a capture asks no event, and a kept table that a
    capture read is never evicted."""
    from zipccl.kernels.constants import Constants
    a, b, c = _Stream("a"), _Stream("b"), _Stream("c")
    state = {"stream": a, "capturing": False}
    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(state))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["stream"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    gpu, made = torch.device("cuda", 0), []

    def make(name):
        return lambda: made.append(name) or _Table(name)

    tables = Constants(limit=2)
    t = tables.get("t", gpu, make("t"))
    assert tables.get("t", gpu, make("t")) is t and made == ["t"] and a.waited == [] and t.recorded == []
    state["stream"] = b
    assert tables.get("t", gpu, make("t")) is t and len(b.waited) == 1 and t.recorded == ["b"]
    assert b.waited[0].stream is a  # the upload's event, recorded on the uploading stream
    state["capturing"] = True
    assert tables.get("in graph", gpu, make("in graph")).name == "in graph"
    assert tables.get("in graph", gpu, make("in graph")).name == "in graph"
    assert made == ["t", "in graph", "in graph"]
    assert tables.get("t", gpu, make("t")) is t  # read by a capture: kept for good
    state["capturing"] = False
    b.waited[0].done = True
    state["stream"] = c
    assert tables.get("t", gpu, make("t")) is t and c.waited == [] and t.recorded == ["b", "c"]  # done: no wait
    for name in ("u", "v", "w"):
        tables.get(name, gpu, make(name))
    assert tables.get("t", gpu, make("t")) is t and made.count("t") == 1 and len(tables) == 3
    tables.get("u", gpu, make("u"))
    assert made.count("u") == 2  # evicted (the oldest of those not captured), made again


def test_import_zipccl_never_imports_triton():
    r = _run(["-c", "import sys, zipccl, zipccl.codecs, zipccl.collectives, zipccl.ddp; "
                    "print('triton' in sys.modules)"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


@pytest.mark.timeout(600)
def test_every_kernel_compiles_for_sm80_and_sm90():
    """AOT, no GPU: PTX and cubin for every kernel, dtype and arch, with the compiler's resource report."""
    r = _run(["-m", "zipccl.kernels.aot", "--json"])
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    got = {(row["kernel"], row["dtype"], row["arch"]) for row in rows}
    want = {(k, d, a) for k in ("_analyse", "_encode", "_decode_symbols", "_decode_join", "_decode_raw", "_place",
                                "_choose", "_index")
            for d in ("bfloat16", "float16", "float32") for a in ("sm_80", "sm_90")}
    assert got == want
    for row in rows:
        assert row["cubin_bytes"] > 0 and row["ptx_bytes"] > 0
    # Registers and spills come from cuobjdump, which ships with Triton's NVIDIA backend (beside the
    # ptxas that made the cubins), so CI has it: a skip here fails a CI run (tests/ci_rules.py).
    unread = [row for row in rows if "cubin_reg" not in row]
    if unread:
        pytest.skip(f"cuobjdump not found (Triton's backends/nvidia/bin or PATH): registers and spills of "
                    f"{len(unread)} kernel builds not checked")
    for row in rows:
        assert 0 < row["cubin_reg"] <= 255
        # Spilled registers live in the thread's stack frame (cuobjdump's STACK; a kernel built
        # with maxnreg=32 shows STACK:264 and LOCAL:0), other local memory in LOCAL: neither is wanted.
        where = f"{row['kernel']} ({row['dtype']}, {row['arch']})"
        assert row["cubin_stack"] == 0, f"{where} spills registers: {row['cubin_stack']} bytes of stack"
        assert row["cubin_local"] == 0, f"{where} uses {row['cubin_local']} bytes of local memory"


def image_triton() -> Path:
    """Where `make setup` installed the CUDA image's Triton (IMAGE_TRITON in the Makefile)."""
    version = re.search(r"^IMAGE_TRITON := (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    where = ROOT / "build" / f"triton-{version}"
    assert (where / "triton").is_dir(), f"{where} is missing: `make setup` installs Triton {version} there"
    return where


def test_every_kernel_compiles_without_spills_on_the_cuda_images_triton():
    """The GPU checks run on a CUDA image whose Triton (3.6.0; docs/GPU.md) is older than CI's, and
    older Tritons lower some operations otherwise: with 3.6, tl.histogram of 4096 bins made _encode
    spill 2.3 KB a thread, which 3.9 does not. So the kernels are compiled with that Triton too
    (`make setup` puts it in build/), for sm_90, the image's cards."""
    where = image_triton()
    version = where.name.removeprefix("triton-")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(where), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, "-m", "zipccl.kernels.aot", "--json", "--arch", "90"], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)
    assert {row["triton"] for row in rows} == {version} and len(rows) == 36, rows
    assert all("cubin_stack" in row for row in rows), "no spills read: cuobjdump not found beside that Triton's ptxas"
    spills = [(row["kernel"], row["dtype"], row["block"], row["cubin_stack"], row["cubin_local"]) for row in rows
              if row["cubin_stack"] or row["cubin_local"]]
    assert not spills, spills


def test_default_block_size_per_impl():
    """Triton and numba both default to 4096-element blocks (format 4's GPU lanes are sub-streams,
    not blocks); each decodes the other's packets and those of other block sizes."""
    from zipccl import format as F
    x = (torch.randn(300, generator=torch.Generator().manual_seed(3)) * 0.01).to(torch.bfloat16)
    for impl, block_size in (("triton", 4096), ("numba", 4096), ("reference", 1024)):
        p = Lossless(impl, block_size=None if impl != "reference" else block_size).encode(x)
        h = F.parse_header(p[:F.HEADER_SIZE].numpy().tobytes(), None, p.numel())
        assert h.block_size == block_size
        assert torch.equal(p, Lossless("reference", block_size=block_size).encode(x))
        assert p.numel() <= Lossless(impl, block_size=h.block_size).max_encoded_size(x.numel(), x.dtype)
        for other in ("numba", "triton"):
            assert_same_bits(Lossless(other).decode(p), x)


@pytest.mark.parametrize("block_size", [256, 1024, 4096, 16384])
def test_no_decode_lane_walks_more_than_256_symbols(block_size):
    """From the launch configuration of every _decode_symbols launch: its programs' lanes, at most
    256 symbols each, cover every element of the blocks it decodes (version 3 ran one lane per
    block: 1024 or 4096 symbols); and the packet decodes to its input."""
    from triton.runtime.jit import KernelInterface
    from zipccl.kernels import gpu
    launches = []
    real = KernelInterface.__getitem__

    def launch(kernel, grid):
        run = real(kernel, grid)
        if getattr(kernel, "fn", kernel).__name__ != "_decode_symbols":
            return run

        def recorded(*args, **kwargs):
            launches.append((grid[0], kwargs["LANES"], kwargs["BS"], args[5].numel()))  # programs, lanes, block, blocks
            return run(*args, **kwargs)
        return recorded

    x = (torch.randn(2 * block_size + 300, generator=torch.Generator().manual_seed(5)) * 0.01).to(torch.bfloat16)
    packet = Lossless("reference", block_size=block_size).encode(x)
    KernelInterface.__getitem__ = launch
    try:
        out = Lossless("triton", block_size=block_size).decode(packet)
    finally:
        KernelInterface.__getitem__ = real
    assert_same_bits(out, x)
    assert launches
    for programs, lanes, bs, blocks in launches:
        assert bs == block_size and programs * lanes * 256 >= blocks * bs, (programs, lanes, bs, blocks)


def _add_one():
    """A kernel that adds 1 to an int32 in place (defined here, after the skip without Triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) + 1)
    return add_one


@pytest.mark.overflow_checked
def test_marked_tests_catch_an_int32_overflow():
    """A test marked ``overflow_checked`` runs the interpreter with its overflow checks
    (tests/triton_mode.py): 2**31 - 1 + 1 in int32 fails the kernel."""
    x = torch.tensor([2**31 - 1], dtype=torch.int32)
    with pytest.raises(Exception, match="overflow"):
        _add_one()[(1,)](x)


def test_other_tests_wrap_as_the_gpu_does():
    """Unmarked, the interpreter wraps 32-bit arithmetic as compiled code does."""
    x = torch.tensor([2**31 - 1], dtype=torch.int32)
    _add_one()[(1,)](x)
    assert x.item() == -2**31
