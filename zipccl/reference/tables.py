"""Code tables of the lossless format: how they are built, stored and read.

Shared by every implementation, because it runs once per packet on a few
hundred numbers: per-block symbol histograms in, Huffman code lengths and a
table choice per block out. Everything is integer arithmetic with explicit
tie-breaking, so every implementation that feeds it the same histograms
produces the same bytes.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError
from ..format import MAXLEN, NSYM, SYM_ESC, SYM_ZERO, TABLE_BYTES, FloatLayout

CLUSTER_ROUNDS = 2


def limited_lengths(freqs, maxlen: int = MAXLEN) -> np.ndarray:
    """Optimal length-limited Huffman code lengths (package-merge).

    Ties are broken by symbol number and leaves sort before packages of equal
    weight, which makes the result a pure function of ``freqs``.
    """
    freqs = [int(f) for f in freqs]
    active = [s for s, f in enumerate(freqs) if f > 0]
    lengths = np.zeros(len(freqs), dtype=np.int64)
    if len(active) == 1:
        lengths[active[0]] = 1
    if len(active) <= 1:
        return lengths
    if len(active) > (1 << maxlen):
        raise ValueError("too many symbols for the length limit")
    leaves = sorted(((freqs[s], s) for s in active))
    leaf_items = []
    for w, s in leaves:
        members = np.zeros(len(freqs), dtype=np.int64)
        members[s] = 1
        leaf_items.append((w, members))
    items = list(leaf_items)
    for _ in range(maxlen - 1):
        packages = [(items[i][0] + items[i + 1][0], items[i][1] + items[i + 1][1])
                    for i in range(0, len(items) - 1, 2)]
        merged, i, j = [], 0, 0
        while i < len(leaf_items) or j < len(packages):
            if j >= len(packages) or (i < len(leaf_items) and leaf_items[i][0] <= packages[j][0]):
                merged.append(leaf_items[i])
                i += 1
            else:
                merged.append(packages[j])
                j += 1
        items = merged
    for _, members in items[: 2 * len(active) - 2]:
        lengths += members
    return lengths


def canonical_codes(lengths) -> np.ndarray:
    """Canonical prefix codes, bit-reversed so that they are written LSB first."""
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(len(lengths), dtype=np.int64)
    code, prev = 0, 0
    for s in sorted((s for s in range(len(lengths)) if lengths[s]), key=lambda s: (lengths[s], s)):
        code <<= int(lengths[s]) - prev
        prev = int(lengths[s])
        codes[s] = int(f"{code:0{prev}b}"[::-1], 2)
        code += 1
    return codes


def extra_bits(layout: FloatLayout) -> np.ndarray:
    """Raw bits written after each symbol's code: the exponent after ESC, fp16's top rest bits."""
    extra = np.full(NSYM, layout.inline_bits, dtype=np.int64)
    extra[SYM_ZERO] = 0
    extra[SYM_ESC] += layout.ebits
    return extra


def choose_tables(hist: np.ndarray, ntables: int, layout: FloatLayout):
    """Cluster blocks into ``ntables`` code tables and pick the cheapest table per block.

    hist: (nblocks, NSYM) int64 symbol counts. Returns (lengths (ntables, NSYM),
    table id per block, coded bits per block). Blocks start in groups of equal
    size ordered by how peaked they are (count of the offset-0 symbol, ties by
    block number); then CLUSTER_ROUNDS times: build one table per group from its
    summed histogram (+1 per symbol so every table codes every symbol), move
    each block to its cheapest table (ties to the lowest id).
    """
    nblocks = hist.shape[0]
    order = sorted(range(nblocks), key=lambda b: (int(hist[b, 28]) * 65536 // max(1, int(hist[b].sum())), b))
    assign = np.zeros(nblocks, dtype=np.int64)
    for g in range(ntables):
        assign[order[g * nblocks // ntables:(g + 1) * nblocks // ntables]] = g
    extra = extra_bits(layout)
    for _ in range(CLUSTER_ROUNDS):
        lengths = np.stack([limited_lengths(hist[assign == g].sum(axis=0) + 1) for g in range(ntables)])
        cost = hist @ (lengths + extra).T
        assign = cost.argmin(axis=1)
    return lengths, assign, cost[np.arange(nblocks), assign]


def pack_tables(lengths: np.ndarray) -> np.ndarray:
    """Code lengths as nibbles, two symbols per byte, low nibble first."""
    nib = lengths.astype(np.uint8).reshape(len(lengths), TABLE_BYTES, 2)
    return (nib[..., 0] | (nib[..., 1] << 4)).reshape(-1)


def unpack_tables(data: np.ndarray, ntables: int) -> np.ndarray:
    data = data.reshape(ntables, TABLE_BYTES)
    lengths = np.stack([data & 15, data >> 4], axis=-1).reshape(ntables, NSYM).astype(np.int64)
    for t in range(ntables):
        used = lengths[t][lengths[t] > 0]
        if used.size == 0 or used.max() > MAXLEN:
            raise FormatError(f"code table {t} is empty or has a code longer than {MAXLEN} bits")
        if int((1 << (MAXLEN - used)).sum()) > (1 << MAXLEN):
            raise FormatError(f"code table {t} is over-subscribed (not a prefix code)")
    return lengths


def decode_luts(lengths: np.ndarray) -> np.ndarray:
    """(ntables, 2**MAXLEN) int32 lookup: symbol | length << 8 for the next MAXLEN bits; 0 = invalid."""
    luts = np.zeros((len(lengths), 1 << MAXLEN), dtype=np.int32)
    for t, lens in enumerate(lengths):
        codes = canonical_codes(lens)
        for s in range(NSYM):
            n = int(lens[s])
            if n:
                luts[t, int(codes[s])::1 << n] = s | (n << 8)
    return luts
