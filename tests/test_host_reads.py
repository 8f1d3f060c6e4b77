"""Host reads of the GPU codec, counted on CPU under Triton's interpreter (issue 33).

On CUDA each read of a tensor's value by the host (``Tensor.cpu``, ``.item``, ``.tolist``,
``.nonzero``, ``torch.nonzero``, ``int``/``float``/``bool``/``operator.index`` of a tensor)
waits for the device. Here there is no device, so the test counts the calls instead: every such
call made from zipccl's own files during one ``Lossless(impl="triton")`` encode, and one decode
into a given ``out``. Adding a read back makes the count, and this test, fail.
"""

from __future__ import annotations

import sys
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

# Counts of format version 2 (2026-11-26; version 1: 5 and 9): encode reads only the packet's
# size; decode reads the header, the index's first invalid entry and totals, and the error flag
# (the coded and raw blocks are ordered and counted on the device). The targets are
# encode <= 1 and decode into a given out <= 2.
ENCODE_READS = 1
DECODE_READS = 3


@contextmanager
def host_reads():
    """A Counter of (method, zipccl file:line) for each read made from zipccl's own code."""
    seen: Counter = Counter()

    def counting(name, original):
        def read(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if str(Path(caller).resolve()).startswith(PACKAGE):
                seen[(name, f"{Path(caller).name}:{sys._getframe(1).f_lineno}")] += 1
            return original(*args, **kwargs)
        return read

    saved = {name: getattr(torch.Tensor, name) for name in READS}
    saved_nonzero = torch.nonzero
    try:
        for name, original in saved.items():
            setattr(torch.Tensor, name, counting(name, original))
        torch.nonzero = counting("torch.nonzero", saved_nonzero)
        yield seen
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = saved_nonzero


def _data() -> torch.Tensor:
    """Three blocks of 256 and a partial one, with a block stored raw: every path of the codec."""
    g = torch.Generator().manual_seed(33)
    x = (torch.randn(3 * 256 + 100, generator=g) * 0.01).to(torch.bfloat16)
    x[::17] = 0.0
    x[256:512] = torch.randint(-2**15, 2**15, (256,), generator=g, dtype=torch.int16).view(torch.bfloat16)
    return x


def test_the_counter_sees_a_read_from_zipccl_and_not_from_elsewhere():
    """The counter itself: a read in a zipccl frame counts, one in this file does not."""
    from zipccl.kernels import device_plan
    with host_reads() as seen:
        torch.ones(3).sum().item()
        device_plan.read_index(torch.zeros(16, dtype=torch.uint8), 0, 16, 10, 256, 1,
                               zipccl.format.LAYOUTS[torch.bfloat16])
    assert sum(seen.values()) >= 1 and all(where.startswith("device_plan.py") for _, where in seen)


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
