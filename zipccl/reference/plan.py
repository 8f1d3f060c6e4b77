"""From per-block statistics to a packet's layout: shared by the fast encoders.

An encoder's first pass yields, per block, the reference exponent, the symbol
histogram and the count of +0.0 elements. That is all the host needs to build
the code tables, decide which blocks stay raw, and compute every block's
offset in the exponent streams and the sign+mantissa section, so the second
pass can write each block independently (one CPU loop iteration or one GPU
program per block). The reference encoder (reference/lossless.py) spells the
same rules out with whole-tensor operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..format import HEADER_SIZE, INDEX_ENTRY, NSYM, RAW_BLOCK, TABLE_BYTES, FloatLayout, num_tables
from . import tables as T


@dataclass
class Plan:
    lengths: np.ndarray     # (ntables, NSYM) code lengths
    codes: np.ndarray       # (ntables, NSYM) canonical codes, LSB first
    ref: np.ndarray         # (nblocks,) reference exponent (0 for raw blocks)
    table: np.ndarray       # (nblocks,) table id, RAW_BLOCK for raw blocks
    nwords: np.ndarray      # (nblocks,) 32-bit words of exponent stream
    nzero: np.ndarray       # (nblocks,) +0.0 elements (0 for raw blocks)
    word_start: np.ndarray  # (nblocks + 1,) prefix sum of nwords
    rest_start: np.ndarray  # (nblocks + 1,) prefix sum of section-3 bytes
    sizes: tuple[int, int, int, int]

    @property
    def total_size(self) -> int:
        return HEADER_SIZE + sum(self.sizes)

    def front(self) -> np.ndarray:
        """Sections 0 and 1 (code tables and block index) as bytes."""
        index = np.zeros((len(self.ref), 4), np.uint16)
        index[:, 0] = self.ref | (self.table << 8)
        index[:, 1] = self.nwords
        index[:, 2] = self.nzero
        return np.concatenate([T.pack_tables(self.lengths), index.view(np.uint8).reshape(-1)])


def plan(ref: np.ndarray, hist: np.ndarray, nzero: np.ndarray, numel: int, block_size: int,
         layout: FloatLayout) -> Plan:
    """Tables, raw-block decisions and offsets of a packet from its blocks' statistics."""
    nb = len(ref)
    K = num_tables(nb)
    if nb:
        lengths, assign, cost = T.choose_tables(hist, K, layout)
    else:
        lengths, assign, cost = np.zeros((0, NSYM), np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    nvalid = np.minimum(block_size, numel - np.arange(nb) * block_size)
    nw = -(-cost // 32)
    raw = 4 * nw + (nvalid - nzero) * layout.rest_bytes >= nvalid * layout.itemsize
    nwords = np.where(raw, 0, nw).astype(np.int64)
    rest_len = np.where(raw, nvalid * layout.itemsize, (nvalid - nzero) * layout.rest_bytes)
    word_start = np.concatenate([[0], np.cumsum(nwords)]).astype(np.int64)
    rest_start = np.concatenate([[0], np.cumsum(rest_len)]).astype(np.int64)
    codes = np.stack([T.canonical_codes(l) for l in lengths]).astype(np.int64) if K else np.zeros((0, NSYM), np.int64)
    sizes = (K * TABLE_BYTES, nb * INDEX_ENTRY, int(word_start[-1]) * 4, int(rest_start[-1]))
    return Plan(lengths.astype(np.int64), codes, np.where(raw, 0, ref).astype(np.int64),
                np.where(raw, RAW_BLOCK, assign).astype(np.int64), nwords,
                np.where(raw, 0, nzero).astype(np.int64), word_start, rest_start, sizes)
