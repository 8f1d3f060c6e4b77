"""Code tables of the lossless format: the canonical codes and decode lookups of the fixed
bank's entries (zipccl/bank.py), the raw bits after each symbol, and the length-limited Huffman
codes (package-merge) and per-packet clustering from which the bank was derived and against
which bench/ measures it (tests/test_bank.py derives the bank again with limited_lengths).

Everything is integer arithmetic with explicit tie-breaking, so that the same histograms give
the same codes everywhere.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit

from ..format import MAXLEN, NSYM, SYM_ESC, FloatLayout

CLUSTER_ROUNDS = 2


def limited_lengths(freqs, maxlen: int = MAXLEN) -> np.ndarray:
    """Optimal length-limited Huffman code lengths (package-merge).

    Ties are broken by symbol number and leaves sort before packages of equal
    weight, which makes the result a pure function of ``freqs``.
    """
    freqs = np.asarray(freqs, dtype=np.int64)
    if np.count_nonzero(freqs) > (1 << maxlen):
        raise ValueError("too many symbols for the length limit")
    return _package_merge(freqs, maxlen)


@njit(cache=True)
def _package_merge(freqs, maxlen):
    """Each level's list holds leaves and packages (two items of the level below); the
    lengths count how often each leaf sits under the top list's first 2m-2 items."""
    n = freqs.shape[0]
    lengths = np.zeros(n, dtype=np.int64)
    active = np.nonzero(freqs)[0]
    m = active.shape[0]
    if m == 1:
        lengths[active[0]] = 1
    if m <= 1:
        return lengths
    order = active[np.argsort(freqs[active], kind="mergesort")]  # stable: ties by symbol
    leaf_w = freqs[order]
    cap = 2 * m
    sym = np.full((maxlen, cap), -1, dtype=np.int64)   # leaf: its symbol; package: -1
    pkg = np.zeros((maxlen, cap), dtype=np.int64)      # package: k, made of items 2k, 2k+1 one level down
    size = np.zeros(maxlen, dtype=np.int64)
    w = np.empty(cap, dtype=np.int64)
    for i in range(m):
        w[i] = leaf_w[i]
        sym[0, i] = order[i]
    size[0] = m
    for lv in range(1, maxlen):
        npk = size[lv - 1] // 2
        pw = np.empty(npk, dtype=np.int64)
        for k in range(npk):
            pw[k] = w[2 * k] + w[2 * k + 1]
        i = k = c = 0
        while i < m or k < npk:
            if k >= npk or (i < m and leaf_w[i] <= pw[k]):
                w[c] = leaf_w[i]
                sym[lv, c] = order[i]
                i += 1
            else:
                w[c] = pw[k]
                pkg[lv, c] = k
                k += 1
            c += 1
        size[lv] = c
    need = np.zeros(cap, dtype=np.int64)
    need[:2 * m - 2] = 1
    for lv in range(maxlen - 1, -1, -1):
        below = np.zeros(cap, dtype=np.int64)
        for i in range(size[lv]):
            if need[i]:
                if sym[lv, i] >= 0:
                    lengths[sym[lv, i]] += need[i]
                else:
                    below[2 * pkg[lv, i]] += need[i]
                    below[2 * pkg[lv, i] + 1] += need[i]
        need = below
    return lengths


def canonical_codes(lengths) -> np.ndarray:
    """Canonical prefix codes, bit-reversed so that they are written LSB first."""
    return _canonical_codes(np.asarray(lengths, dtype=np.int64).tobytes()).copy()


@lru_cache(maxsize=1024)  # tables repeat from packet to packet: data of one shape gives the same lengths
def _canonical_codes(key: bytes) -> np.ndarray:
    """Keyed by the int64 lengths' bytes: hashing them is 20x cheaper than a tuple of ints."""
    lengths = np.frombuffer(key, dtype=np.int64)
    codes = np.zeros(len(lengths), dtype=np.int64)
    code, prev = 0, 0
    for s in sorted((s for s in range(len(lengths)) if lengths[s]), key=lambda s: (lengths[s], s)):
        code <<= int(lengths[s]) - prev
        prev = int(lengths[s])
        codes[s] = int(f"{code:0{prev}b}"[::-1], 2)
        code += 1
    return codes


@lru_cache(maxsize=None)
def extra_bits(layout: FloatLayout) -> np.ndarray:
    """Raw bits written after each symbol's code: the coded field after ESC (read-only)."""
    extra = np.zeros(NSYM, dtype=np.int64)
    extra[SYM_ESC] = layout.ebits
    extra.flags.writeable = False
    return extra


def choose_tables(hist: np.ndarray, ntables: int, layout: FloatLayout):
    """Cluster blocks into ``ntables`` code tables and pick the cheapest table per block.

    hist: (nblocks, NSYM) int64 symbol counts. Returns (lengths (ntables, NSYM),
    table id per block, coded bits per block). Blocks start in groups of equal
    size ordered by how peaked they are (count of the offset-0 symbol * 65536 //
    block size, ties by block number); then CLUSTER_ROUNDS times: build one table
    per group from its summed histogram (+1 per symbol so every table codes every
    symbol), move each block to its cheapest table (ties to the lowest id).
    Compiled: encoders call it once per packet, and in Python its overhead was a
    third of encoding a 1M-element piece.
    """
    hist = np.ascontiguousarray(hist, dtype=np.int64)
    return _choose(hist, ntables, extra_bits(layout), MAXLEN, CLUSTER_ROUNDS)


@njit(cache=True)
def _choose(hist, ntables, extra, maxlen, rounds):
    nblocks, nsym = hist.shape
    peak = np.empty(nblocks, dtype=np.int64)
    for b in range(nblocks):
        peak[b] = hist[b, 28] * 65536 // max(1, hist[b].sum())
    order = np.argsort(peak, kind="mergesort")  # stable: ties by block number
    assign = np.zeros(nblocks, dtype=np.int64)
    for g in range(ntables):
        for i in range(g * nblocks // ntables, (g + 1) * nblocks // ntables):
            assign[order[i]] = g
    lengths = np.zeros((ntables, nsym), dtype=np.int64)
    cost = np.zeros(nblocks, dtype=np.int64)
    for _ in range(rounds):
        sums = np.ones((ntables, nsym), dtype=np.int64)
        for b in range(nblocks):
            sums[assign[b]] += hist[b]
        for g in range(ntables):
            lengths[g] = _package_merge(sums[g], maxlen)
        bits = lengths + extra
        for b in range(nblocks):
            best, best_cost = 0, -1
            for g in range(ntables):
                c = 0
                for s in range(nsym):
                    c += hist[b, s] * bits[g, s]
                if best_cost < 0 or c < best_cost:
                    best, best_cost = g, c
            assign[b] = best
            cost[b] = best_cost
    return lengths, assign, cost


def decode_luts(lengths: np.ndarray) -> np.ndarray:
    """(ntables, 2**MAXLEN) int32 lookup: symbol | length << 8 for the next MAXLEN bits; 0 = invalid."""
    return np.stack([decode_lut(lens) for lens in lengths]) if len(lengths) \
        else np.zeros((0, 1 << MAXLEN), np.int32)


def decode_lut(lengths) -> np.ndarray:
    """One table's lookup (cached: treat as read-only)."""
    return _decode_lut(np.asarray(lengths, dtype=np.int64).tobytes())


@lru_cache(maxsize=1024)
def _decode_lut(key: bytes) -> np.ndarray:
    lengths = np.frombuffer(key, dtype=np.int64)
    lut = np.zeros(1 << MAXLEN, dtype=np.int32)
    codes = _canonical_codes(key)
    for s in range(NSYM):
        n = int(lengths[s])
        if n:
            lut[int(codes[s])::1 << n] = s | (n << 8)
    return lut
