"""The fixed bank of codes of format version 3 (zipccl/bank.py) and the version check."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import zipccl
from zipccl import format as F
from zipccl.bank import BANK, BANK_SIZE
from zipccl.codecs import Lossless, Raw
from zipccl.reference import tables as T

RECORD = Path(__file__).parents[1] / "docs" / "bench" / "2026-11-27-bank" / "block4096.json"
KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@pytest.mark.parametrize("dtype", list(KEYS), ids=str)
def test_bank_is_the_recorded_derivation(dtype):
    """zipccl's bank is the bank of 32 that bench/bank_design.py derived and recorded."""
    recorded = json.loads(RECORD.read_text())["banks"][KEYS[dtype]][str(BANK_SIZE)]
    assert BANK[dtype].shape == (BANK_SIZE, F.NSYM)
    assert BANK[dtype].tolist() == recorded


@pytest.mark.parametrize("dtype", list(KEYS), ids=str)
def test_every_entry_is_a_complete_prefix_code(dtype):
    """Every entry codes every symbol in 1..MAXLEN bits with Kraft sum exactly 1, and passes the
    decoder's table check; no two entries are the same."""
    for row in BANK[dtype]:
        assert row.min() >= 1 and row.max() <= F.MAXLEN
        assert int((1 << (F.MAXLEN - row)).sum()) == 1 << F.MAXLEN
        T._unpack_table(T.pack_tables(row[None])[:F.TABLE_BYTES].tobytes())
    assert len({row.tobytes() for row in BANK[dtype]}) == BANK_SIZE


def _resign(p: torch.Tensor, offset: int, value: int) -> torch.Tensor:
    q = p.clone()
    q[offset] = value
    q[52:56] = torch.frombuffer(bytearray(zlib.crc32(q[:52].numpy().tobytes()).to_bytes(4, "little")),
                                dtype=torch.uint8)
    return q


@pytest.mark.parametrize("codec", [Lossless("reference"), Lossless("numba"), Raw()], ids=repr)
def test_other_versions_are_refused_naming_both(codec):
    p = codec.encode(torch.randn(300).to(torch.bfloat16))
    assert int(p[4]) == F.VERSION == 3
    for version in (2, 4):
        with pytest.raises(zipccl.FormatError, match=f"version {version}.*version {F.VERSION}"):
            codec.decode(_resign(p, 4, version))


@pytest.mark.parametrize("impl", ["reference", "numba"])
@pytest.mark.parametrize("dtype", list(KEYS), ids=str)
def test_each_block_takes_the_cheapest_entry_for_its_sample(impl, dtype):
    """Against a brute-force count: per block, the bits of its sample under every entry, the
    least (ties to the lowest entry) is the one its index names."""
    bs = 256
    g = torch.Generator().manual_seed(3)
    scales = 2.0 ** torch.randint(-20, 2, (64,), generator=g).double()
    tails = torch.exp(torch.rand(64, generator=g, dtype=torch.float64)[:, None]
                      * torch.randn(64, bs, generator=g, dtype=torch.float64))
    x = (torch.randn(64, bs, generator=g, dtype=torch.float64) * scales[:, None] * tails)
    x[::5, ::3] = 0
    x = x.to(dtype).reshape(-1)
    p = Lossless(impl, block_size=bs).encode(x)
    index = p[F.HEADER_SIZE:F.HEADER_SIZE + 64 * F.INDEX_ENTRY].numpy().reshape(64, F.INDEX_ENTRY)
    lay = F.LAYOUTS[dtype]
    ints = x.view(torch.int32 if lay.itemsize == 4 else torch.int16).numpy().astype(np.int64)
    bits = ints & ((1 << (8 * lay.itemsize)) - 1)
    extra = np.zeros(F.NSYM, np.int64)
    extra[F.SYM_ESC] = lay.ebits  # an escape's raw field follows its code
    seen = set()
    for b in range(64):
        sample = bits[b * bs:(b + 1) * bs:F.SAMPLE_STRIDE]
        exps = [(v >> lay.mbits) & lay.emax for v in sample if v]
        ref = min(set(exps), key=lambda e: (-exps.count(e), e)) if exps else 0
        syms = [0 if v == 0 else (((v >> lay.mbits) & lay.emax) - ref + lay.offset_bias
                                  if lay.min_offset <= ((v >> lay.mbits) & lay.emax) - ref <= lay.max_offset else 1)
                for v in sample]
        costs = [sum(int(BANK[dtype][k][s]) + int(extra[s]) for s in syms) for k in range(BANK_SIZE)]
        best = costs.index(min(costs))
        if index[b, 1] != F.RAW_BLOCK:
            assert (index[b, 0], index[b, 1]) == (ref, best), b
            seen.add(best)
    assert len(seen) >= 3  # the data exercises several entries
