"""Device operations of the GPU codec per call, counted on CPU under Triton's interpreter.

On a GPU every Triton launch and every torch kernel costs a launch (a few microseconds), and on
the 1-8 MiB packets of a pipeline the launches, not the bytes, set a call's time. So one
``encode_into`` and one ``decode_into`` may make at most 6 device operations each: Triton
launches, torch operations that run a kernel, and allocations (served by the caching allocator
on CUDA, but counted: no scratch beyond one or two per call). Views (``view``, slices,
``select``) are metadata and not counted. A warm call is counted (the first call of a dtype
uploads the bank's tables once: tests/test_nccl_gpu.py runs that one under sync-debug "error").
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from zipccl.codecs import Lossless

pytest.importorskip("triton", reason="triton not installed (pip install zipccl[gpu]); .ci/run installs it")

LIMIT = 6
#: aten operations that only make a new view of a tensor's memory: no kernel, no allocation.
METADATA = ("view", "slice", "select", "detach", "alias", "unbind", "permute", "expand", "as_strided", "reshape",
            "_reshape_alias", "lift_fresh", "t.default", "transpose", "unsqueeze", "squeeze")


class _Ops(TorchDispatchMode):
    """Counts the torch operations dispatched inside it, but those that make views."""

    def __init__(self, seen: Counter):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        if not name.startswith(METADATA):
            self.seen[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def device_ops():
    """A Counter of the device operations made inside: torch's (``_Ops``) and each Triton launch
    ("triton:<kernel>"); what the interpreter itself does during a launch is not counted (on a GPU
    it is the kernel)."""
    from triton.runtime.jit import KernelInterface
    seen: Counter = Counter()
    real = KernelInterface.__getitem__

    def launch(kernel, grid):
        run = real(kernel, grid)

        def counted(*args, **kwargs):
            seen[f"triton:{getattr(kernel, 'fn', kernel).__name__}"] += 1
            with _disable_current_modes():
                return run(*args, **kwargs)
        return counted

    KernelInterface.__getitem__ = launch
    try:
        with _Ops(seen):
            yield seen
    finally:
        KernelInterface.__getitem__ = real


def _gradients(dtype: torch.dtype, n: int) -> torch.Tensor:
    """Gradient-like values with +0.0 among them, and two blocks of random bits (raw blocks)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(n, generator=g) * 1e-3).to(dtype)
    x[::13] = 0.0
    ints = x.view(torch.int32 if dtype == torch.float32 else torch.int16)
    top = 2**31 - 1 if dtype == torch.float32 else 2**15
    ints[n // 2:n // 2 + 2048] = torch.randint(0, top, (2048,), generator=g).to(ints.dtype)
    return x


def _counted(codec: Lossless, x: torch.Tensor, extra=None, decode: bool = True) -> tuple[Counter, Counter | None]:
    """The device operations of a warm encode_into and (``decode``) decode_into of x, which must
    round-trip."""
    out = torch.empty(codec.max_encoded_size(x.numel(), x.dtype), dtype=torch.uint8)
    back = torch.empty_like(x)
    size = codec.encode_into(x, out)  # warm: the tables uploaded
    if decode:
        codec.decode_into(out[:int(size)], back).check()
    with device_ops() as enc:
        size = codec.encode_into(x, out)
        if extra is not None:
            extra(size)
    if not decode:
        return enc, None
    packet = out[:int(size)]
    with device_ops() as dec:
        verdict = codec.decode_into(packet, back)
    verdict.check()
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))
    return enc, dec


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_at_most_six_device_operations_per_encode_into_and_decode_into(dtype):
    """The target, and the calls as built, so that any operation added fails: encode_into one
    allocation (kernels/device_plan.Scratch) and four launches; decode_into two allocations (the
    verdict; the index's rows and the decoders' scratch) and four launches."""
    enc, dec = _counted(Lossless("triton", block_size=256), _gradients(dtype, 4096))  # 256: the interpreter's pace
    assert sum(enc.values()) <= LIMIT and sum(dec.values()) <= LIMIT, (enc, dec)
    assert enc == Counter({"aten.empty.memory_format": 1, "triton:_analyse": 1, "triton:_choose": 1,
                           "triton:_place": 1, "triton:_encode": 1}), enc
    assert dec == Counter({"aten.empty.memory_format": 2, "triton:_index": 1, "triton:_decode_raw": 1,
                           "triton:_decode_symbols": 1, "triton:_decode_join": 1}), dec


def test_one_more_operation_is_counted():
    """The counter sees one more torch kernel made in the call, and one more launch (in an
    encode_into: what it counts in one call it counts in the other)."""
    from zipccl.kernels import device_plan
    x = _gradients(torch.bfloat16, 5_000)
    codec = Lossless("triton", block_size=1024)
    base, _ = _counted(codec, x, decode=False)
    more, _ = _counted(codec, x, extra=lambda size: size.add(0), decode=False)
    assert sum(more.values()) == sum(base.values()) + 1, (base, more)
    cell = torch.zeros(1, dtype=torch.int64)
    launched, _ = _counted(codec, x, extra=lambda size: device_plan._place[(1,)](
        cell, cell, cell, 0, cell, cell, 0, cell, 0, SCAN=device_plan.SCAN, SEAL=False), decode=False)
    assert launched["triton:_place"] == base["triton:_place"] + 1, (base, launched)


def test_encode_many_takes_one_launch_sequence_for_all_its_parts():
    """Three peers' chunks (rows of one matrix, one row left out, as a reduce-scatter's piece):
    the launches of one encode_into, not three times them, and at most 6 operations in all."""
    m = _gradients(torch.bfloat16, 4 * 3000).view(4, 3000)
    parts = [m[j, 200:2900] for j in (0, 2, 3)]
    codec = Lossless("triton", block_size=1024)
    out = torch.empty(3 * codec.slot(parts[0].numel(), torch.bfloat16), dtype=torch.uint8)
    codec.encode_many(parts, out)
    with device_ops() as seen:
        codec.encode_many(parts, out)
    assert sum(seen.values()) <= LIMIT, seen
    assert all(seen[f"triton:{k}"] == 1 for k in ("_analyse", "_choose", "_place", "_encode")), seen


def test_decode_many_takes_one_launch_sequence_for_all_its_packets():
    """Three packets in one buffer into three rows: the launches of one decode_into, and at most
    one operation more (the upload of the packets' places)."""
    m = _gradients(torch.bfloat16, 3 * 1400).view(3, 1400)  # six blocks each: the interpreter's pace
    codec = Lossless("triton", block_size=256)
    slot = codec.slot(1400, torch.bfloat16)
    buf = torch.empty(3 * slot, dtype=torch.uint8)
    sizes = codec.encode_many(list(m), buf).tolist()
    packets = [buf[k * slot:k * slot + sizes[k]] for k in range(3)]
    outs = torch.empty_like(m)
    codec.decode_many(packets, list(outs))
    with device_ops() as seen:
        verdicts = codec.decode_many(packets, list(outs))
    assert sum(seen.values()) <= LIMIT + 1, seen
    assert all(seen[f"triton:{k}"] == 1 for k in ("_index", "_decode_raw", "_decode_symbols", "_decode_join")), seen
    assert all(v.problem() is None for v in verdicts) and torch.equal(outs.view(torch.uint8), m.view(torch.uint8))


def test_decode_reads_the_block_index_once():
    """Lossless.decode (the caller's API, which validates the packet first) reads the index on
    the device once: the read its validation made is the one its kernels decode through."""
    x = _gradients(torch.bfloat16, 4096)
    codec = Lossless("triton", block_size=256)
    packet = codec.encode(x)
    codec.decode(packet)
    with device_ops() as seen:
        back = codec.decode(packet)
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))
    assert seen["triton:_index"] == 1 and all(seen[f"triton:{k}"] == 1 for k in (
        "_decode_raw", "_decode_symbols", "_decode_join")), seen
