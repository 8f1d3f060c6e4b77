"""The fixed bank of codes of format version 3 (zipccl/bank.py) and the version check."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import zipccl
from zipccl import format as F
from zipccl.bank import BANK, BANK_SIZE
from zipccl.codecs import Lossless, Raw
from zipccl.reference import tables as T

KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _symbol_histogram(x: torch.Tensor) -> np.ndarray:
    """The format's symbol counts of ``x`` as one block (docs/FORMAT.md "Blocks and symbols"):
    ``ref`` the most frequent coded field of every 8th element other than +0.0 (ties to the
    smaller), then ZERO, ref + offset or ESC for each element."""
    lay = F.LAYOUTS[x.dtype]
    bits = x.view(torch.int32 if lay.itemsize == 4 else torch.int16).numpy().astype(np.int64) & ((1 << 8 * lay.itemsize) - 1)
    field, zero = (bits >> lay.mbits) & lay.emax, bits == 0
    ref = np.bincount(field[::8][~zero[::8]], minlength=lay.emax + 1).argmax()
    offset = field - ref
    sym = np.where((offset >= lay.min_offset) & (offset <= lay.max_offset), offset + lay.offset_bias, F.SYM_ESC)
    return np.bincount(np.where(zero, F.SYM_ZERO, sym), minlength=F.NSYM)


def _model_histograms(dtype: torch.dtype) -> np.ndarray:
    """The Gaussian family of docs/FORMAT.md "The fixed bank of codes", in its order: per scale
    (float16: 2^-24 .. 2^1; others 2^-10), phase k/16 and tail s, 16,384 draws
    z * exp(s * w) * 2^(scale + phase) (z, then w: standard normals in float64 from one torch
    generator seeded 0) cast to ``dtype``; its symbol histogram without +0.0, scaled to a
    4096-element block for each share of zeros (rounded half to even)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for scale in (range(-24, 2) if dtype == torch.float16 else [-10]):
        for k in range(16):
            for s in (0.0, 0.35, 0.7, 1.1, 1.6):
                z = torch.randn(16384, generator=g, dtype=torch.float64).numpy()
                w = torch.randn(16384, generator=g, dtype=torch.float64).numpy()
                x = z * np.exp(s * w) * 2.0 ** (scale + k / 16)
                x = torch.from_numpy(x.astype(np.float16)) if dtype == torch.float16 else torch.from_numpy(x).to(dtype)
                h = _symbol_histogram(x).astype(np.float64)
                h[F.SYM_ZERO] = 0
                for zeros in (0.0, 0.02, 0.15, 0.5, 0.9):
                    row = h / h.sum() * (1 - zeros)
                    row[F.SYM_ZERO] += zeros
                    out.append(np.round(row * 4096).astype(np.int64))
    return np.array(out)


def _derive_bank(hists: np.ndarray, size: int, dtype: torch.dtype) -> np.ndarray:
    """The clustering of docs/FORMAT.md "The fixed bank of codes": a group's code is the 12-bit
    limited Huffman code (the format's package-merge) of its summed histogram + 1 per symbol; each
    histogram goes to the code that costs it fewest bits (ties to the first), codes rebuilt (an
    empty group keeps its code), up to 8 rounds or until nothing changes; then, below ``size``
    codes, a new code from the histogram that loses most bits against its own code (the first of
    equals), and again."""
    extra = np.zeros(F.NSYM, np.int64)
    extra[F.SYM_ESC] = F.LAYOUTS[dtype].ebits  # an escape's raw field follows its code

    def code(summed: np.ndarray) -> np.ndarray:
        return T.limited_lengths(summed + 1, F.MAXLEN)

    own = np.array([(h * (code(h) + extra)).sum() for h in hists])
    lengths = np.array([code(hists.sum(axis=0))])
    while True:
        for _ in range(8):
            assign = (hists @ (lengths + extra).T).argmin(axis=1)
            members = np.bincount(assign, minlength=len(lengths))
            sums = np.stack([np.bincount(assign, hists[:, j], len(lengths)) for j in range(F.NSYM)], axis=1)
            new = np.array([code(sums[i].astype(np.int64)) if members[i] else lengths[i] for i in range(len(lengths))])
            if np.array_equal(new, lengths):
                break
            lengths = new
        if len(lengths) == size:
            return lengths
        lost = (hists @ (lengths + extra).T).min(axis=1) - own
        lengths = np.vstack([lengths, code(hists[lost.argmax()])])


@pytest.mark.parametrize("dtype", list(KEYS), ids=str)
def test_bank_is_the_derivation_from_its_definition(dtype):
    """zipccl's bank, entry for entry, is what the Gaussian family and the clustering rules of
    docs/FORMAT.md derive (no real tensor, no stored record)."""
    hists = _model_histograms(dtype)
    assert len(hists) == (10_400 if dtype == torch.float16 else 400)
    assert BANK[dtype].shape == (BANK_SIZE, F.NSYM)
    assert _derive_bank(hists, BANK_SIZE, dtype).tolist() == BANK[dtype].tolist()


@pytest.mark.parametrize("dtype", list(KEYS), ids=str)
def test_every_entry_is_a_complete_prefix_code(dtype):
    """Every entry codes every symbol in 1..MAXLEN bits with Kraft sum exactly 1 (a complete
    prefix code); no two entries are the same."""
    for row in BANK[dtype]:
        assert row.min() >= 1 and row.max() <= F.MAXLEN
        assert int((1 << (F.MAXLEN - row)).sum()) == 1 << F.MAXLEN
    assert len({row.tobytes() for row in BANK[dtype]}) == BANK_SIZE


def _resign(p: torch.Tensor, offset: int, value: int) -> torch.Tensor:
    q = p.clone()
    q[offset] = value
    q[52:56] = torch.frombuffer(bytearray(zlib.crc32(q[:52].numpy().tobytes()).to_bytes(4, "little")),
                                dtype=torch.uint8)
    return q


@pytest.mark.parametrize("codec", [Lossless("reference"), Lossless("numba"), Raw()], ids=repr)
def test_other_versions_are_refused_naming_both(codec):
    p = codec.encode(torch.randn(300, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    assert int(p[4]) == F.VERSION == 4
    for version in (3, 5):
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
