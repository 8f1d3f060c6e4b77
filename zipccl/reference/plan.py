"""From per-block statistics to a packet's layout: shared by the fast encoders.

An encoder's first pass yields, per block, the reference exponent and the symbol
histogram of a sample (every SAMPLE_STRIDE-th element), and the count of +0.0
elements. ``choose`` picks each block's code from the fixed bank (zipccl/bank.py):
the entry that codes its sample in the fewest bits; ``plan`` then decides which
blocks stay raw and computes every block's offset in the exponent streams and the
sign+mantissa section from the blocks' exact coded sizes, which an encoder gets from
the whole histogram
(``Tables.cost``: the Triton encoder, whose second pass writes each block
independently) or from packing the blocks (the numba encoder). The reference
encoder (reference/lossless.py) spells the same rules out with whole-tensor
operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import njit

from ..bank import BANK
from ..format import HEADER_SIZE, INDEX_ENTRY, LAYOUTS, NSYM, RAW_BLOCK, FloatLayout, prefix_sizes
from . import tables as T


@dataclass
class Tables:
    """The bank's codes and each block's choice among them."""
    lengths: np.ndarray     # (BANK_SIZE, NSYM) code lengths
    codes: np.ndarray       # (BANK_SIZE, NSYM) canonical codes, LSB first
    assign: np.ndarray      # (nblocks,) bank entry per block

    def cost(self, hist: np.ndarray, layout: FloatLayout) -> np.ndarray:
        """Coded bits of each block, from its whole (not sampled) symbol histogram."""
        if not len(self.assign):
            return np.zeros(0, np.int64)
        return (hist * (self.lengths + T.extra_bits(layout))[self.assign]).sum(axis=1)


def choose(sampled: np.ndarray, dtype) -> Tables:
    """Each block's bank entry from its sampled symbol histogram: the entry that codes the sample
    in the fewest bits (code plus an escape's raw field), ties to the lowest entry."""
    lengths = BANK[dtype]
    return Tables(lengths, _encoder_codes(dtype), _cheapest(np.asarray(sampled, np.int64).reshape(-1, NSYM),
                                                           _weights(dtype)))


@lru_cache(maxsize=None)
def _weights(dtype) -> np.ndarray:
    """Bits of each symbol under each bank entry, (NSYM, BANK_SIZE) int64 (read-only)."""
    w = np.ascontiguousarray((BANK[dtype] + T.extra_bits(LAYOUTS[dtype])).T)
    w.flags.writeable = False
    return w


@njit(cache=True)
def _cheapest(sampled, weights):
    """Per block, the entry with the fewest bits for its histogram, ties to the lowest: each
    symbol the block has adds its count times its row of ``weights`` (a vector over the entries).
    Compiled rather than a BLAS product: with another process busy on the core, OpenBLAS's
    threads made the 811-block product of the real bucket take 4-8 ms instead of 0.05 (2 cores,
    2026-11-27)."""
    nb, nsym = sampled.shape
    best = np.zeros(nb, np.int64)
    cost = np.empty(weights.shape[1], np.int64)
    for b in range(nb):
        cost[:] = 0
        for s in range(nsym):
            c = sampled[b, s]
            if c:
                for k in range(cost.shape[0]):
                    cost[k] += c * weights[s, k]
        best[b] = np.argmin(cost)  # the first of equal minima
    return best


@dataclass
class Plan:
    lengths: np.ndarray     # (BANK_SIZE, NSYM) code lengths
    codes: np.ndarray       # (BANK_SIZE, NSYM) canonical codes, LSB first
    ref: np.ndarray         # (nblocks,) reference exponent (0 for raw blocks)
    table: np.ndarray       # (nblocks,) bank entry, RAW_BLOCK for raw blocks
    nwords: np.ndarray      # (nblocks,) 32-bit words of exponent stream
    nzero: np.ndarray       # (nblocks,) +0.0 elements (0 for raw blocks)
    word_start: np.ndarray  # (nblocks + 1,) prefix sum of nwords
    rest_start: np.ndarray  # (nblocks + 1,) prefix sum of section-3 bytes
    sizes: tuple[int, int, int, int]

    @property
    def total_size(self) -> int:
        return HEADER_SIZE + sum(self.sizes)

    def front(self) -> np.ndarray:
        """Section 1, the block index, as bytes (section 0 comes from the packer's sub-stream ends)."""
        return _index_bytes(self.ref, self.table, self.nwords, self.nzero)


def plan(tables: Tables, ref: np.ndarray, cost: np.ndarray, nzero: np.ndarray, numel: int, block_size: int,
         layout: FloatLayout) -> Plan:
    """Raw-block decisions and offsets of a packet from its tables and its blocks' exact coded bits."""
    nb = len(ref)
    f = _layout(np.asarray(ref, np.int64), np.asarray(nzero, np.int64), np.asarray(cost, np.int64), tables.assign,
                numel, block_size, layout.itemsize, layout.rest_bytes, layout.side_bits)
    word_start, rest_start = f[4], f[5]
    sizes = (*prefix_sizes(numel, block_size), int(word_start[-1]) * 4, int(rest_start[-1]))
    return Plan(tables.lengths, tables.codes, f[0, :nb], f[1, :nb], f[2, :nb], f[3, :nb], word_start,
                rest_start, sizes)


@lru_cache(maxsize=None)
def _encoder_codes(dtype) -> np.ndarray:
    """The bank's canonical codes for ``dtype`` (read-only), built once."""
    codes = np.stack([T.canonical_codes(row) for row in BANK[dtype]]).astype(np.int64)
    codes.flags.writeable = False
    return codes


@njit(cache=True)
def _layout(ref, nzero, cost, assign, numel, block_size, itemsize, rest_bytes, side_bits):
    """Rows ref, table, nwords, nzero (0 for raw blocks, whose table is RAW_BLOCK), then the
    prefix sums word_start and rest_start (one longer than the block count). A block stays raw
    when coding it would not make it smaller. Compiled: in numpy this bookkeeping cost as much
    as packing a 64-block piece's codes."""
    nb = ref.shape[0]
    f = np.zeros((6, nb + 1), np.int64)
    for b in range(nb):
        nvalid = min(block_size, numel - b * block_size)
        nw = (cost[b] + 31) // 32
        rest = (nvalid - nzero[b]) * rest_bytes + ((nvalid - nzero[b]) * side_bits + 7) // 8
        if 4 * nw + rest >= nvalid * itemsize:
            f[1, b] = RAW_BLOCK
            nw, rest = 0, nvalid * itemsize
        else:
            f[0, b], f[1, b], f[3, b] = ref[b], assign[b], nzero[b]
        f[2, b] = nw
        f[4, b + 1] = f[4, b] + nw
        f[5, b + 1] = f[5, b] + rest
    return f


@njit(cache=True)
def _index_bytes(ref, table, nwords, nzero):
    """Section 1: per block u16 ref | table << 8, u16 nwords, u16 nzero, u16 0, little-endian."""
    out = np.zeros(ref.shape[0] * INDEX_ENTRY, np.uint8)
    for b in range(ref.shape[0]):
        e = out[b * INDEX_ENTRY:(b + 1) * INDEX_ENTRY]
        e[0], e[1] = ref[b], table[b]
        e[2], e[3] = nwords[b] & 255, nwords[b] >> 8
        e[4], e[5] = nzero[b] & 255, nzero[b] >> 8
    return out
