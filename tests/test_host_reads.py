"""Host reads of the GPU codec, counted on CPU under Triton's interpreter.

On CUDA each read of a tensor's value by the host waits for the device. Here there is no
device, so the test counts the calls instead: every such call made from zipccl's own files
during one ``Lossless(impl="triton")`` encode, and one decode into a given ``out``. The ways
counted: ``Tensor.cpu``, ``.numpy``, ``.item``, ``.tolist``, ``.nonzero`` and ``torch.nonzero``,
``int``/``float``/``bool``/``operator.index`` of a tensor, ``.to("cpu")``, ``torch.equal`` and ``Tensor.equal``,
``masked_select``, one-argument ``torch.where``, indexing by a boolean tensor (read or
write), ``torch.cuda.synchronize`` and the waits of CUDA events and streams, CuPy's
``asnumpy``, and a Triton launch whose grid holds a tensor. Adding a read back makes the
count, and this test, fail. A copy into host memory (``copy_``) cannot be told from a copy on
the device where both are CPU tensors; the GPU suite's sync-debug runs see those.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import zipccl
from zipccl.codecs import Lossless

pytest.importorskip("triton", reason="triton not installed (pip install zipccl[gpu]); .ci/run installs it")

PACKAGE = str(Path(zipccl.__file__).resolve().parent)
READS = ("cpu", "item", "tolist", "nonzero", "__int__", "__float__", "__bool__", "__index__")

# Counts of format version 2 (2026-11-26; version 1: 5 and 9), the same in version 3 (its side
# bits are placed on the device as the rest bytes are): encode reads only the packet's size;
# decode reads the header, then at the end the index's check (first invalid entry and totals)
# with the blocks' errors, in one read (the coded and raw blocks are ordered and counted on the
# device). The targets are encode <= 1 and decode into a given out <= 2.
ENCODE_READS = 1
DECODE_READS = 2


def _names_host(args, kwargs) -> bool:
    """Whether a ``.to`` call names the host: "cpu" (a string), given as the device argument
    (``.to(x.device)`` names wherever x is: on CPU it cannot be told from the host)."""
    for a in list(args[:1]) + [kwargs.get("device")]:
        if isinstance(a, str) and a.split(":")[0] == "cpu":
            return True
    return False


def _bool_index(args, kwargs) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


#: The ids of the live tensors that a counted read returned: ``x.cpu().numpy()`` is one read.
_FROM_READS: set = set()

#: (owner, attribute, when): each way to the host, counted where ``when(args, kwargs)`` holds
#: (the call's arguments, a method's self first).
WAYS = [(torch.Tensor, name, None) for name in READS] + [
    (torch.Tensor, "numpy", lambda a, k: id(a[0]) not in _FROM_READS),
    (torch.Tensor, "equal", None), (torch.Tensor, "masked_select", None),
    (torch.Tensor, "to", lambda a, k: _names_host(a[1:], k)),
    (torch.Tensor, "__getitem__", _bool_index), (torch.Tensor, "__setitem__", _bool_index),
    (torch, "nonzero", None), (torch, "equal", None), (torch, "masked_select", None),
    (torch, "where", lambda a, k: len(a) + len(k) == 1),
    (torch.cuda, "synchronize", None), (torch.cuda.Event, "synchronize", None), (torch.cuda.Event, "query", None),
    (torch.cuda.Stream, "synchronize", None), (torch.cuda.Stream, "query", None),
]


def _launch_grid(args, kwargs) -> bool:
    grid = args[1] if len(args) > 1 else None
    return isinstance(grid, (tuple, list)) and any(isinstance(g, torch.Tensor) for g in grid) or \
        isinstance(grid, torch.Tensor)


def _more_ways() -> list:
    """The ways that need their package: a Triton launch's grid, CuPy's copies to the host."""
    ways = []
    try:
        from triton.runtime.jit import KernelInterface
        ways.append((KernelInterface, "__getitem__", _launch_grid))
    except ImportError:
        pass
    try:
        import cupy
        ways.append((cupy, "asnumpy", None))
    except Exception:  # noqa: BLE001 - no CuPy, or one that cannot load without a GPU
        pass
    return ways


@contextmanager
def host_reads():
    """A Counter of (way, zipccl file:line) for each read made from zipccl's own code."""
    seen: Counter = Counter()

    def counting(label, original, when):
        def read(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            counted = str(Path(caller).resolve()).startswith(PACKAGE) and (when is None or when(args, kwargs))
            if counted:
                seen[(label, f"{Path(caller).name}:{sys._getframe(1).f_lineno}")] += 1
            out = original(*args, **kwargs)
            if counted and isinstance(out, torch.Tensor):
                _FROM_READS.add(id(out))
                weakref.finalize(out, _FROM_READS.discard, id(out))
            return out
        return read

    ways = WAYS + _more_ways()
    own = [(owner, name, name in vars(owner), vars(owner).get(name)) for owner, name, _ in ways]
    try:
        for owner, name, when in ways:
            label = f"{getattr(owner, '__name__', owner)}.{name}"
            setattr(owner, name, counting(label, getattr(owner, name), when))
        yield seen
    finally:
        for owner, name, had, original in own:
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # inherited: the base's own shows through again


#: One read of each way, as zipccl's code would make it (``x``: a float tensor of 4 elements;
#: ``kernel``: a Triton kernel). Each line is compiled as if it were in a file of zipccl.
TOYS = {
    "cpu": "x.cpu()", "cpu numpy": "x.cpu().numpy()", "numpy": "x.numpy()", "item": "x[0].item()",
    "tolist": "x.tolist()",
    "nonzero": "x.nonzero()", "torch.nonzero": "torch.nonzero(x)", "int": "int(x[0])", "float": "float(x[0])",
    "bool": "bool(x[0])", "index": "operator.index(x[0].long())", "to cpu": "x.to('cpu')",
    "to device=cpu": "x.to(device='cpu')", "equal": "x.equal(x)", "torch.equal": "torch.equal(x, x)",
    "masked_select": "x.masked_select(x > 0)", "torch.masked_select": "torch.masked_select(x, x > 0)",
    "where": "torch.where(x > 0)", "mask read": "x[x > 0]", "mask write": "x.__setitem__(x > 5, 0.0)",
    "synchronize": "suppress(lambda: torch.cuda.synchronize())",
    "event": "suppress(lambda: torch.cuda.Event.synchronize(None))",
    "event query": "suppress(lambda: torch.cuda.Event.query(None))",
    "stream": "suppress(lambda: torch.cuda.Stream.synchronize(None))",
    "launch grid": "kernel[(torch.tensor(1),)]",
}


def _suppress(fn):
    """A CUDA call where there is none: it raises after the counter saw it."""
    try:
        fn()
    except Exception:  # noqa: BLE001 - no CUDA here
        pass


@pytest.mark.parametrize("way", list(TOYS))
def test_the_counter_sees_every_way_to_the_host(way):
    """Each way made once from a zipccl file is counted once; the device-side twins (``.to``
    of a dtype, ``torch.where`` of three arguments, indexing by integers, a grid of ints) and
    the same reads from outside zipccl are not."""
    import operator
    from zipccl.kernels.device_plan import _place as kernel
    toy = compile(TOYS[way], str(Path(PACKAGE) / "toy.py"), "eval")
    scope = dict(x=torch.tensor([1.0, 2.0, 0.0, 7.0]), torch=torch, operator=operator, suppress=_suppress,
                 kernel=kernel)
    with host_reads() as seen:
        eval(toy, scope)
        twins = compile("(x.to(torch.float64), torch.where(x > 0, x, x), x[torch.tensor([0, 1])], kernel[(1,)])",
                        str(Path(PACKAGE) / "toy.py"), "eval")
        eval(twins, scope)
        eval(TOYS[way], scope)  # this file's: not zipccl's
    assert sum(seen.values()) == 1, dict(seen)


def _data() -> torch.Tensor:
    """Three blocks of 256 and a partial one, with a block stored raw: every path of the codec."""
    g = torch.Generator().manual_seed(33)
    x = (torch.randn(3 * 256 + 100, generator=g) * 0.01).to(torch.bfloat16)
    x[::17] = 0.0
    x[256:512] = torch.randint(-2**15, 2**15, (256,), generator=g, dtype=torch.int16).view(torch.bfloat16)
    return x


def test_the_counter_sees_a_read_from_zipccl_and_not_from_elsewhere():
    """The counter itself: a read in a zipccl frame counts, one in this file does not."""
    from zipccl.reference.packet import host_bytes
    with host_reads() as seen:
        torch.ones(3).sum().item()
        host_bytes(torch.zeros(16, dtype=torch.uint8), 0, 16)
    assert sum(seen.values()) >= 1 and all(where.startswith("packet.py") for _, where in seen)


def test_triton_encode_and_decode_into_out_host_reads():
    x = _data()
    codec = Lossless("triton", block_size=256)
    codec.encode(x)  # compiles and caches, so that the counts are those of a warm call
    with host_reads() as enc:
        packet = codec.encode(x)
    out = torch.empty_like(x)
    codec.decode(packet, out)
    with host_reads() as dec:
        codec.decode(packet, out)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    assert sum(enc.values()) <= ENCODE_READS, f"encode reads the device {sum(enc.values())} times: {dict(enc)}"
    assert sum(dec.values()) <= DECODE_READS, f"decode reads the device {sum(dec.values())} times: {dict(dec)}"


@pytest.mark.parametrize("corrupt", ["entry", "totals"])
def test_a_bad_index_is_caught_at_the_one_read_and_nothing_is_written(corrupt):
    """The index's check waits on the device for the call's last read: a packet with an invalid
    entry (a bank entry past the bank) or with entries that do not add up to the sections raises
    the reference's FormatError, and no kernel has read through the index: ``out`` is untouched
    (its raw and coded blocks alike)."""
    x = _data()
    codec = Lossless("triton", block_size=256)
    packet = codec.encode(x).clone()
    entry = zipccl.format.HEADER_SIZE + 3 * zipccl.format.INDEX_ENTRY  # the last block's, coded
    if corrupt == "entry":
        packet[entry + 1] = zipccl.format.RAW_BLOCK - 1
    else:
        packet[entry + 2] += 1  # one more stream word than the stream holds
    with pytest.raises(zipccl.FormatError) as want:
        Lossless("reference", block_size=256).decode(packet)
    out = torch.full((x.numel(),), 7, dtype=torch.int16)
    with host_reads() as dec:
        with pytest.raises(zipccl.FormatError) as got:
            codec.decode(packet, out.view(torch.bfloat16))
    assert str(got.value) == str(want.value), (got.value, want.value)
    assert torch.equal(out, torch.full_like(out, 7))
    assert sum(dec.values()) <= DECODE_READS, dict(dec)


@pytest.mark.parametrize("impl", ["reference", "numba", "triton"])
@pytest.mark.parametrize("dtype,numel", [(torch.bfloat16, 3 * 256 + 100), (torch.float16, 1), (torch.float32, 0),
                                         (torch.float32, 2 * 256)], ids=str)
def test_encode_into_writes_encodes_packet_and_returns_its_size(impl, dtype, numel):
    """encode_into: encode's bytes at the front of a caller's buffer of the codec's bound (the
    header sealed with its sizes and CRC where the Triton kernels keep them on the device), the
    bytes after the packet as they were, the size as a 0-d int64 tensor; the Triton path reads
    nothing on the host."""
    x = _data()[:numel].to(dtype) if numel else torch.empty(0, dtype=dtype)
    codec = Lossless(impl, block_size=256)
    want = codec.encode(x)
    buf = torch.full((codec.max_encoded_size(numel, dtype) + 16,), 0xA5, dtype=torch.uint8)
    codec.encode_into(x, buf)  # warm
    buf.fill_(0xA5)
    with host_reads() as seen:
        size = codec.encode_into(x, buf)
    assert size.dtype == torch.int64 and size.dim() == 0 and int(size) == want.numel()
    assert torch.equal(buf[:want.numel()], want)
    assert bool((buf[want.numel():] == 0xA5).all())
    if impl == "triton":
        assert not seen, dict(seen)
    assert torch.equal(codec.decode(buf).view(torch.uint8), x.view(torch.uint8))


def test_encode_into_refuses_a_buffer_it_cannot_fill():
    x = _data()
    codec = Lossless("triton", block_size=256)
    bound = codec.max_encoded_size(x.numel(), x.dtype)
    for bad in (torch.empty(bound - 1, dtype=torch.uint8), torch.empty(bound, dtype=torch.int8),
                torch.empty(bound + 1, dtype=torch.uint8)[1:], torch.empty(2, bound, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="encode_into needs"):
            codec.encode_into(x, bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_triton_decode_into_reads_nothing_and_its_verdict_once(dtype):
    """decode_into: the reference's packet decoded into ``out`` with no host read (the header and
    index checked on the device), the same bits back; its verdict read in one read, good."""
    x = _data().to(dtype)
    packet = Lossless("reference", block_size=256).encode(x)
    codec = Lossless("triton", block_size=256)
    out = torch.empty_like(x)
    codec.decode_into(packet, out)  # warm
    out.zero_()
    with host_reads() as seen:
        verdict = codec.decode_into(packet, out)
    assert not seen, dict(seen)
    with host_reads() as read:
        assert verdict.problem() is None
    assert sum(read.values()) == 1, dict(read)
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(ints), x.view(ints))


@pytest.mark.parametrize("corrupt", ["numel", "header_byte", "header_crc", "sizes", "entry", "totals", "block_size"])
def test_decode_into_writes_nothing_through_a_bad_header_or_index(corrupt):
    """A packet whose header is not the one ``out`` implies (a valid packet of 867 elements into
    868; a header byte flipped without its CRC, or its CRC; a stream size with the top bit set,
    re-signed; blocks of 512), or whose index is bad, leaves
    ``out`` untouched, and its verdict names the problem as the reference names it (the
    reference's decode into an ``out`` of 868, or with blocks of 256: its FormatError)."""
    x = _data()
    codec = Lossless("triton", block_size=256)
    packet = Lossless("reference", block_size=256).encode(x)
    entry = zipccl.format.HEADER_SIZE + 3 * zipccl.format.INDEX_ENTRY  # the last block's, coded
    if corrupt == "numel":
        packet = Lossless("reference", block_size=256).encode(x[:-1])
    elif corrupt == "header_byte":
        packet[20] ^= 1  # ntables
    elif corrupt == "header_crc":
        packet[52] ^= 1
    elif corrupt == "sizes":  # stream bytes with the top bit set, the header re-signed: far past the packet
        h = zipccl.format.parse_header(packet[:56].numpy().tobytes(), None, packet.numel())
        s0, s1, s2, s3 = h.sections
        packet = packet.clone()
        packet[:56] = torch.frombuffer(bytearray(zipccl.format.Header(**{**h.__dict__, "sections": (
            s0, s1, s2 | (1 << 63), s3)}).pack()), dtype=torch.uint8)
    elif corrupt == "entry":
        packet[entry + 1] = zipccl.format.RAW_BLOCK - 1
    elif corrupt == "totals":
        packet[entry + 2] += 1
    if corrupt == "block_size":
        packet = Lossless("reference", block_size=512).encode(x)
        want = "packet's blocks hold 512 elements; this decoder reads blocks of 256"
    else:
        with pytest.raises(zipccl.FormatError) as raised:
            Lossless("reference", block_size=256).decode(packet, torch.empty_like(x))
        want = str(raised.value)
    out = torch.full((x.numel(),), 7, dtype=torch.int16)
    assert codec.decode_into(packet, out.view(torch.bfloat16)).problem() == want
    assert torch.equal(out, torch.full_like(out, 7))


def test_a_sparse_sum_reads_the_device_once_for_its_headers_and_once_for_its_indices():
    """The top-k sum of n ranks' packets (the GPU path's: collectives._sum_pairs) reads the
    device twice whatever n is: the packets' headers together, then their indices' checks
    together; once where the headers were read already (sparse_reduce._validate's one read).
    Its result: the dense sum of what each packet holds, by plain torch."""
    from zipccl import format as F
    from zipccl.codecs import TopK
    from zipccl.collectives import _sum_pairs
    g = torch.Generator().manual_seed(8)
    codec, xs = TopK(0.1), [torch.randn(1000, generator=g) for _ in range(5)]
    parts = [codec.encode(x) for x in xs]
    want = torch.zeros(1000)
    for x in xs:
        keep = torch.topk(x.abs(), 100).indices
        want[keep] += x[keep]
    with host_reads() as seen:
        total, _ = _sum_pairs(parts, codec, torch.empty(1000), dist_sum(), 5)
    assert torch.equal(total, want)
    assert sum(seen.values()) == 2, dict(seen)
    headers = [F.parse_header(p[:F.HEADER_SIZE].numpy().tobytes(), None, p.numel()) for p in parts]
    with host_reads() as seen:
        again, _ = _sum_pairs(parts, codec, torch.empty(1000), dist_sum(), 5, headers)
    assert torch.equal(again, want)
    assert sum(seen.values()) == 1, dict(seen)


def dist_sum():
    import torch.distributed as dist
    return dist.ReduceOp.SUM
