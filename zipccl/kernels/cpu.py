"""numba CPU kernels for the lossless format, byte-identical to zipccl/reference.

Encode reads the data three times: analyse (histograms), pack (codes into the
bit stream) and rest (sign+mantissa bytes; float16: and side bits). Decode takes four
blocks at a time: their Huffman symbols into a small byte buffer (a 10-bit lookup
yields up to four symbols, stored with one 32-bit write), then a pass joining coded
fields and rest while that buffer is in cache (without branches where a block has
few +0.0). Huffman
decoding is serial within a block, so the four blocks go in lock step to keep the
core busy while one waits on a table lookup. The codes are the fixed bank's (zipccl/bank.py); reference/plan.py picks
each block's entry from its sampled histogram.

Numba lessons measured here: index through per-block slices rather than
``offset + i`` (offset indexing kept loops from vectorizing: 10x slower); keep
stores out of branches in hot loops (a conditional store cost 4-7x); one
32-bit lookup per element instead of three int64 ones made packing 2.4x
faster; unaligned 64-bit loads and stores (an LLVM intrinsic) let the bit
reader and writer move whole bytes (the symbol decoder 2.7x faster); blocks
without +0.0 (known from the histogram pass) skip the test that tells it apart
from other zero exponents (packing 1.35x faster), and blocks with a few look up
the pairs that hold one again afterwards (float16 packing 1.09x); blocks without +0.0 do their
lookups inside the serial append, which overlaps them with its chain only where no branch
guards its stores (groups too long to append whole are caught after the block, which is then
packed again: bf16 packing 1.06-1.10x, float16 1.09-1.17x); float16 pairs looked up whole,
in a table of pairs of coded fields kept from call to call and indexed by one BMI2 pext, where
two element lookups and a join took twice the instructions (float16 packing 1.35x; pext on the
side bits too was slower than the shifts LLVM vectorizes); the sign+mantissa section is
written with overlapping 32-bit stores and no branches (fp32 encode 2.1x);
float16 gained from the lane decoder only once its join checked the offsets'
range inside the vectorized loop instead of falling back to the scalar path
(decode 2.4x); the dtype's layout compiled in as constants rather than passed
at run time (see _constants) made the bf16 join and the sign+mantissa section
about 4x faster; a run-time value inside an otherwise constant loop (the join's
reference exponent) is best added in a loop of its own; eight interleaved
histograms instead of four made the histogram pass steady (3-11 ms -> 3 ms)."""

from __future__ import annotations

import threading
import zlib
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch
from numba import njit

from ..bank import BANK_SIZE
from ..errors import FormatError
from ..format import (CODEC_LOSSLESS, FLAG_CRC, HEADER_SIZE, LAYOUTS, MAXLEN, NSYM, RAW_BLOCK,
                      SAMPLE_STRIDE, SUBSTREAM, SYM_ESC, Header, num_blocks, substreams)
from ..reference import tables as T
from ..reference.packet import SUBSTREAM_ERROR, LosslessPacket, parse_lossless
from ..reference.plan import choose, plan
from .bits import FAST_PEXT, pext, prefetch, prefetch_write
from .bits import load_u32 as _load_u32, load_u64 as _load_u64, store_u32 as _store_u32, store_u64 as _store_u64

_NOGIL = dict(cache=True, nogil=True, boundscheck=False)
LANES = 4          # blocks decoded in lock step
WINDOW = 10        # bits a multi-symbol lookup resolves: 8 KB of table per code, which stays in
                   # cache while the collectives decode peers' packets in turn (12 bits: 1.2x slower
                   # on an all-reduce's packets replayed, the same on one tensor decoded repeatedly)
ROUND = 4          # lookups per refill of a lane's bit container (4 x WINDOW <= 57 bits)
_SPECIAL = 1 << 6  # multi-symbol entry for an element that takes the single-symbol path
_SUB_SHIFT = SUBSTREAM.bit_length() - 1  # element -> its sub-stream
_PAIRS_SHIFT = _SUB_SHIFT - 1  # pair -> its sub-stream
_SUB_PAIRS = SUBSTREAM // 2
_HISTS = 4  # interleaved histograms of the sample, so that repeated exponents don't wait on each
            # other's counts (bf16 bucket: 2, 4 and 8 histograms 0.51, 0.49 and 0.52 ms)


def _constants(dtype) -> tuple:
    """``dtype``'s layout as a global tuple, which numba compiles in as constants: the
    kernels' loops take it through their ``*_layout`` bodies, one copy per dtype, because
    with the same numbers as run-time values LLVM kept the shifts in 64-bit lanes or
    did not vectorize (the join 4x slower, the sign+mantissa section 4x)."""
    lay = LAYOUTS[dtype]
    return lay.mbits, lay.ebits, lay.emax, lay.rest_bytes, lay.side_bits, lay.itemsize, lay.offset_bias


_BF16, _FP16, _FP32 = _constants(torch.bfloat16), _constants(torch.float16), _constants(torch.float32)


def _analyse(bits, bs, mbits, ref, hist, nzero):
    """_analyse_layout for the dtype that ``mbits`` tells (see _constants), compiled for that
    dtype alone (as _pack)."""
    _ANALYSES[mbits](bits, bs, ref, hist, nzero)


@njit(**_NOGIL)
def _analyse_bf16(bits, bs, ref, hist, nzero):
    _analyse_layout(bits, bs, _BF16, ref, hist, nzero)


@njit(**_NOGIL)
def _analyse_fp16(bits, bs, ref, hist, nzero):
    _analyse_layout(bits, bs, _FP16, ref, hist, nzero)


@njit(**_NOGIL)
def _analyse_fp32(bits, bs, ref, hist, nzero):
    _analyse_layout(bits, bs, _FP32, ref, hist, nzero)


_ANALYSES = {_BF16[0]: _analyse_bf16, _FP16[0]: _analyse_fp16, _FP32[0]: _analyse_fp32}  # by mbits


@njit(inline="always")
def _analyse_layout(bits, bs, layout, ref, hist, nzero):
    """Per block: reference exponent (mode of the non-zero exponents of its sample, every
    SAMPLE_STRIDE-th element, ties to the smallest), the sample's symbol histogram, and the
    count of +0.0 elements in the whole block."""
    mbits, ebits, emax, rest_bytes, side_bits, itemsize, bias = layout
    n = bits.shape[0]
    nb = ref.shape[0]
    cnt = np.zeros((_HISTS, emax + 1), dtype=np.int16)  # by exponent; a block has at most 4096 samples
    tot = np.zeros(emax + 1, dtype=np.int32)
    for b in range(nb):
        lo = b * bs
        hi = min(n, lo + bs)
        cnt[:] = 0
        vb = bits[lo:hi]
        m = -(-(hi - lo) // SAMPLE_STRIDE)  # samples
        zs = 0  # +0.0 hides among exponent 0: counted apart, in the same loop (float16 0.1 ms)
        j = 0
        while j + _HISTS <= m:
            for k in range(0, _HISTS * SAMPLE_STRIDE * itemsize, 64):  # the lines of the next samples
                prefetch(vb, j * SAMPLE_STRIDE + PREFETCH + k // itemsize)
            for k in range(_HISTS):
                v = vb[(j + k) * SAMPLE_STRIDE]
                cnt[k, (v >> mbits) & emax] += 1
                zs += v == 0
            j += _HISTS
        while j < m:
            v = vb[j * SAMPLE_STRIDE]
            cnt[0, (v >> mbits) & emax] += 1
            zs += v == 0
            j += 1
        tot[:] = 0
        for k in range(_HISTS):
            for e in range(emax + 1):
                tot[e] += cnt[k, e]
        tot[0] -= zs
        best = 0
        bestc = 0
        for e in range(emax + 1):
            if tot[e] > bestc:
                bestc = tot[e]
                best = e
        ref[b] = best
        hist[b, :] = 0
        hist[b, 0] = zs
        escapes = m - zs
        for d in range(max(2 - bias, -best), min(NSYM - 1 - bias, emax - best) + 1):
            hist[b, d + bias] = tot[best + d]
            escapes -= tot[best + d]
        hist[b, 1] = escapes
        z = 0
        for i in range(hi - lo):  # vectorizes
            z += vb[i] == 0
        nzero[b] = z


_U3, _U7, _U8, _U56, _U63, _U255 = (np.uint64(3), np.uint64(7), np.uint64(8), np.uint64(56), np.uint64(63),
                                    np.uint64(255))
_ONES, _HIGH = np.uint64(0x0101010101010101), np.uint64(0x8080808080808080)  # per byte lane
_HIGH16, _HIGH32 = np.uint64(0x8000800080008000), np.uint64(0x8000000080000000)  # per 2- and 4-byte lane


@njit(inline="always")
def _nonzero_lanes(v, high):
    """``v`` (uint64) with each lane's top bit (``high``) set where the lane is nonzero and
    every other bit clear: the low bits of a lane add into its top bit without a carry out."""
    return (((v & ~high) + ~high) | v) & high


@njit(**_NOGIL)
def _element_table(r, t, codes, lens, ebits, bias, tab):
    """One block's code per element index, code << 8 | length: index ``bits >> mbits`` (the sign
    and the coded field), or 1 << (ebits + 1) for +0.0. The code already carries an escape's raw
    field, so packing needs one lookup per element and no branches."""
    emax = (1 << ebits) - 1
    for idx in range(1 << (ebits + 1)):
        e = idx & emax
        d = e - r
        if d >= 2 - bias and d <= NSYM - 1 - bias:
            c = codes[t, d + bias]
            ln = lens[t, d + bias]
        else:
            c = codes[t, 1] | (e << lens[t, 1])
            ln = lens[t, 1] + ebits
        tab[idx] = (c << 8) | ln
    tab[1 << (ebits + 1)] = (codes[t, 0] << 8) | lens[t, 0]


@njit(inline="always")
def _element(tab, v, shift, width):
    """Element ``v``'s entry in _element_table's table ``tab``, telling +0.0 apart."""
    return np.uint64(tab[(v >> shift) + (np.uint32(v == 0) << width)])


@njit(inline="always")
def _join(e0, e1):
    """Two elements' table entries (code << 8 | length) into the pair's, in the same form
    (with the length in the low byte, the lengths add without a carry into the code: the
    pair loop took 3.4 ms on the bf16 bucket where code | length << 24 took 4.0)."""
    return (e0 | ((e1 >> _U8) << ((e0 & _U255) + _U8))) + (e1 & _U255)


def _pack(bits, bs, mbits, ref, table, nzero, hist, codes, lens, out, cost, subs, ptabs):
    """_pack_layout for the dtype that ``mbits`` tells (see _constants), compiled for that dtype
    alone: one function holding all three bodies compiled all three for each element type
    (49 s of _pack, 17 s of _rest on a 2-core EPYC), where a dtype needs its own."""
    _PACKS[mbits](bits, bs, ref, table, nzero, hist, codes, lens, out, cost, subs, ptabs)


@njit(**_NOGIL)
def _pack_bf16(bits, bs, ref, table, nzero, hist, codes, lens, out, cost, subs, ptabs):
    _pack_layout(bits, bs, _BF16, ref, table, nzero, hist, codes, lens, out, cost, subs, ptabs)


@njit(**_NOGIL)
def _pack_fp16(bits, bs, ref, table, nzero, hist, codes, lens, out, cost, subs, ptabs):
    _pack_layout(bits, bs, _FP16, ref, table, nzero, hist, codes, lens, out, cost, subs, ptabs)


@njit(**_NOGIL)
def _pack_fp32(bits, bs, ref, table, nzero, hist, codes, lens, out, cost, subs, ptabs):
    _pack_layout(bits, bs, _FP32, ref, table, nzero, hist, codes, lens, out, cost, subs, ptabs)


_PACKS = {_BF16[0]: _pack_bf16, _FP16[0]: _pack_fp16, _FP32[0]: _pack_fp32}  # by mbits


PREFETCH = 1024  # elements ahead that the encoder's passes ask the cache for
PAIR_SLOTS = 64  # float16 pair tables a thread keeps (32 KB each)
PAIR_MIN = 16384  # elements of one (reference, bank entry) that pay for building its pair table


class PairTables(NamedTuple):
    """A thread's float16 pair tables, kept from call to call: table[slot[ref, entry]] = the
    joined entries of two elements' coded fields (index: first | second << 6), slot -1 where none
    is built; seen[ref, entry] = elements packed under that key so far, which builds its table
    once they reach PAIR_MIN (so that small tensors get tables too, after a few calls); used[0] =
    slots in use. Neighbouring blocks and successive tensors share few keys (the real bucket's
    812 float16 blocks have 35), so that each table is built about once."""
    slot: np.ndarray
    seen: np.ndarray
    table: np.ndarray
    used: np.ndarray


def pair_tables(slots: int) -> PairTables:
    """Empty float16 pair tables with room for ``slots`` (32 KB each)."""
    lay = LAYOUTS[torch.float16]
    keys = (1 << lay.ebits, BANK_SIZE)
    return PairTables(np.full(keys, -1, np.int64), np.zeros(keys, np.int64),
                      np.empty((slots, 1 << (2 * lay.ebits)), np.uint64), np.zeros(1, np.int64))


def _pair_tables() -> PairTables:
    """This thread's float16 pair tables (2 MB, paged in as tables are built; bfloat16 and float32
    packing leaves them alone: two 8-bit fields would index 65,536 pairs)."""
    t = getattr(_local, "pairs", None)
    if t is None:
        t = _local.pairs = pair_tables(PAIR_SLOTS)
    return t


@njit(inline="always")
def _pair_fields_pext(w, mbits, ebits):
    """The coded fields of the two float16 elements in ``w``'s low 32 bits, first | second << ebits."""
    field = ((1 << ebits) - 1) << mbits
    return np.int64(pext(w, field | (field << 16)))


@njit(inline="always")
def _pair_fields_shifts(w, mbits, ebits):
    """_pair_fields_pext with shifts, for hosts without a fast pext."""
    emax = (1 << ebits) - 1
    return np.int64(((w >> mbits) & emax) | ((w >> (16 + mbits - ebits)) & (emax << ebits)))


_pair_fields = _pair_fields_pext if FAST_PEXT else _pair_fields_shifts


@njit(inline="always")
def _pair_table(r, t, ebits, tab, ptabs):
    """Key (r, t)'s slot in ``ptabs`` (see PairTables), -1 if it has none: its table built from
    _element_table's ``tab`` once PAIR_MIN elements have been seen under the key, in a new slot,
    or in slot 0 after forgetting every table once all slots are taken."""
    s = ptabs.slot[r, t]
    if s < 0 and ptabs.seen[r, t] >= PAIR_MIN:
        if ptabs.used[0] == ptabs.table.shape[0]:
            ptabs.slot[:] = -1
            ptabs.used[0] = 0
        s = ptabs.used[0]
        ptabs.used[0] += 1
        ptabs.slot[r, t] = s
        pt = ptabs.table[s]
        emax = (1 << ebits) - 1
        for k in range(1 << (2 * ebits)):
            pt[k] = _join(np.uint64(tab[k & emax]), np.uint64(tab[k >> ebits]))
    return s


@njit(inline="always")
def _pair_code(vb, raw, i, tab, shift, pt, by_pair, mbits, ebits):
    """Pair i of ``vb`` (neither element +0.0) as code << 8 | length: from the pair table ``pt``
    if ``by_pair``, else from _element_table's ``tab``."""
    if by_pair:
        return pt[_pair_fields(_load_u32(raw, 4 * i), mbits, ebits)]
    return _join(np.uint64(tab[vb[2 * i] >> shift]), np.uint64(tab[vb[2 * i + 1] >> shift]))


@njit(inline="always")
def _lookup_pairs(vb, i0, i1, tab, shift, ptab, s, mbits, ebits, pairs):
    """pairs[i0:i1] = the codes of element pairs i0..i1 of ``vb``, none of them +0.0: from pair
    table ``s`` of ``ptab`` if there is one (s >= 0), else from _element_table's ``tab``."""
    raw = vb.view(np.uint8)
    if s >= 0:
        for i in range(i0, i1):
            pairs[i] = _pair_code(vb, raw, i, tab, shift, ptab[s], True, mbits, ebits)
    else:
        for i in range(i0, i1):
            pairs[i] = _pair_code(vb, raw, i, tab, shift, ptab[0], False, mbits, ebits)


@njit(inline="always")
def _put(out, pos, acc, pending, code, length):
    """Append ``length`` bits of ``code`` (pending + length < 64) to the stream at byte ``pos``
    of ``out``, whose last ``pending`` (< 8) bits are in ``acc``: one unaligned 64-bit store,
    advancing by whole bytes. Returns (pos, acc, pending)."""
    acc |= code << pending
    pending += length
    _store_u64(out, pos, acc)
    return pos + np.int64(pending >> _U3), acc >> (pending & _U56), pending & _U7


@njit(inline="always")
def _pack_direct(vb, tab, shift, pt, by_pair, mbits, ebits, out, pos, ends):
    """_pack_groups four pairs a step, else two: (the block's bits, whether either fitted)."""
    total, fits = _pack_groups(vb, tab, shift, pt, by_pair, mbits, ebits, 4, out, pos, ends)
    if not fits:
        total, fits = _pack_groups(vb, tab, shift, pt, by_pair, mbits, ebits, 2, out, pos, ends)
    return total, fits


@njit(inline="always")
def _pack_groups(vb, tab, shift, pt, by_pair, mbits, ebits, group, out, pos, ends):
    """Code a block without +0.0 straight into the stream at byte ``pos`` of ``out``, looking up
    ``group`` (2 or 4) pairs per append, and the bits up to the end of each sub-stream into
    ``ends`` (a group lies in one): (its bits, whether it fits), where it does not fit if
    some group's codes are over 56 bits (7 pending + 56 < 64), and the stream written is then
    garbage that the caller writes again another way. With the lookups inside the serial append
    the core overlaps them with its chain, which takes 8 elements a step where 4 pairs fit (93%
    of the real bucket's bf16 blocks): its packing 2.20 -> 2.00-2.07 ms in bf16, 1.69 -> 1.45-1.55
    in float16. Taking a group that does not fit pair by pair as it comes was slower: with the
    stores inside a branch, 5x; leaving the loop for it, 1.3x. With the lookups in the append, the
    core keeps fewer loads in flight, so the loop asks the cache for the data PREFETCH elements
    ahead: packing the bf16 bucket as the codec benchmark's other calls leave the caches took
    3.7-4.0 ms without, 2.4 with."""
    raw = vb.view(np.uint8)
    h = vb.shape[0] // 2
    acc = np.uint64(0)
    pending = np.uint64(0)
    total = np.uint64(0)
    over = np.uint64(0)  # ORs each group's bits + 7: >= 64 where one did not fit
    i = 0
    while i + group <= h:
        prefetch(vb, 2 * i + PREFETCH)
        if group == 4:
            c0 = _join(_pair_code(vb, raw, i, tab, shift, pt, by_pair, mbits, ebits),
                       _pair_code(vb, raw, i + 1, tab, shift, pt, by_pair, mbits, ebits))
            c1 = _join(_pair_code(vb, raw, i + 2, tab, shift, pt, by_pair, mbits, ebits),
                       _pair_code(vb, raw, i + 3, tab, shift, pt, by_pair, mbits, ebits))
        else:
            c0 = _pair_code(vb, raw, i, tab, shift, pt, by_pair, mbits, ebits)
            c1 = _pair_code(vb, raw, i + 1, tab, shift, pt, by_pair, mbits, ebits)
        ln = (c0 & _U255) + (c1 & _U255)
        total += ln
        over |= ln + _U7
        # & 63: a defined shift where the group is over
        pos, acc, pending = _put(out, pos, acc, pending, (c0 >> _U8) | ((c1 >> _U8) << ((c0 & _U255) & _U63)), ln)
        i += group
        if (i & (_SUB_PAIRS - 1)) == 0:  # a sub-stream's end (groups do not straddle one)
            ends[(i - 1) >> _PAIRS_SHIFT] = total
    while i < h:  # the last pairs, at most 40 bits each
        c0 = _pair_code(vb, raw, i, tab, shift, pt, by_pair, mbits, ebits)
        total += c0 & _U255
        pos, acc, pending = _put(out, pos, acc, pending, c0 >> _U8, c0 & _U255)
        i += 1
    if vb.shape[0] & 1:
        c0 = np.uint64(tab[vb[vb.shape[0] - 1] >> shift])
        total += c0 & _U255
        pos, acc, pending = _put(out, pos, acc, pending, c0 >> _U8, c0 & _U255)
    ends[(vb.shape[0] - 1) >> _SUB_SHIFT] = total
    _store_u64(out, pos, acc)
    return total, over < 64


@njit(inline="always")
def _lengths(ends, nv, total):
    """A block's sub-stream ends (bits from its start, written for its sub-streams that hold
    elements) into each sub-stream's bits, the empty ones' 0. ``ends`` is u16: the ends wrap
    at 2^16 (a block's bits reach 20 x 4096), their differences, under 2^16, do not."""
    for j in range(-(-nv // SUBSTREAM), ends.shape[0]):
        ends[j] = total
    for j in range(ends.shape[0] - 1, 0, -1):
        ends[j] -= ends[j - 1]


@njit(inline="always")
def _pack_layout(bits, bs, layout, ref, table, nzero, hist, codes, lens, out, cost, subs, ptabs):
    """Huffman-code the exponents of every block into the byte array ``out``, one block's
    stream after the other, each starting at a 32-bit word; cost[b] = block b's bits, subs[b, j]
    = the bits of its sub-stream j (SUBSTREAM elements; u16, see _lengths; ``subs`` has a column
    where it has none).
    ``out`` needs 8 bytes of slack after the streams.

    A block without +0.0 or escapes in its sample (``hist``, the histogram pass's) goes through
    _pack_direct, four pairs a step, else two: where the sample holds escapes, groups
    too long for a step are likely, and trying cost more than it saved (the small GPT's bf16
    gradients, where 30 of 105 blocks have one: packing 0.31 ms, 0.36 with every such block tried,
    0.32 with those whose sample holds escapes left out). Otherwise (or if neither fits), a
    branch-free pass looks up each pair of elements and joins their
    codes (float16: one lookup per pair in a table of pairs of coded fields, where the block's
    reference and bank entry have covered PAIR_MIN elements, in this call or before: packing
    the real bucket 1.35x with pext, 1.15x with shifts); in a block with a few +0.0, as if it
    had none, and the pairs that hold one are then looked up again (testing every element cost
    float16 0.2 ms of 2.36 on the real bucket, where 334 of 812 blocks hold 3.5 on average).
    Then a serial pass appends one or two pairs at a time to a 64-bit accumulator and stores
    it unaligned, advancing by whole bytes.
    The store spills zeros past the stream's end, which the next block overwrites;
    the last store always runs, so a block's last word is padded with zeros."""
    mbits, ebits, emax, rest_bytes, side_bits, itemsize, bias = layout
    shift, width = mbits, ebits + 1  # an element's index in _element_table's table
    paired = ebits <= 6  # float16: a table of element pairs (4,096 entries)
    n = bits.shape[0]
    tab = np.zeros((1 << width) + 1, np.uint32)
    pairs = np.zeros(bs // 2 + 1, np.uint64)
    zpos = np.empty(bs // 16 + 2, np.int64)
    bounds = np.empty(bs // 8 + 2, np.int64)  # see _nonzero_runs
    for b in range(table.shape[0] if paired else 0):
        ptabs.seen[ref[b], table[b]] += min(n - b * bs, bs)
    last_ref = last_table = -1
    s = -1
    word = 0
    for b in range(table.shape[0]):
        if ref[b] != last_ref or table[b] != last_table:  # neighbouring blocks often share both
            _element_table(np.int64(ref[b]), table[b], codes, lens, ebits, bias, tab)
            last_ref, last_table = ref[b], table[b]
            if paired:
                s = _pair_table(ref[b], table[b], ebits, tab, ptabs)
        vb = bits[b * bs:min(n, b * bs + bs)]
        nv = vb.shape[0]
        h = nv // 2
        if nzero[b] == 0 and hist[b, SYM_ESC] == 0:  # whole groups of pairs, else the passes below
            if s >= 0:
                total, fits = _pack_direct(vb, tab, shift, ptabs.table[s], True, mbits, ebits, out, word * 4, subs[b])
            else:
                total, fits = _pack_direct(vb, tab, shift, ptabs.table[0], False, mbits, ebits, out, word * 4, subs[b])
            if fits:
                cost[b] = total
                word += (np.int64(total) + 31) // 32
                _lengths(subs[b], nv, total)
                continue
        few = nzero[b] * 16 <= nv
        runs = -1 if few or h == 0 else _nonzero_runs(vb, nv // 16, bounds)
        if few:  # the pairs as if none held +0.0, then those that do again
            _lookup_pairs(vb, 0, h, tab, shift, ptabs.table, s, mbits, ebits, pairs)
            _zero_positions(vb, nzero[b], zpos)
            for k in range(nzero[b] if h else 0):
                i = min(zpos[k] >> 1, h - 1)  # zpos[k] is nv where the tensor changed since it was counted
                pairs[i] = _join(_element(tab, vb[2 * i], shift, width), _element(tab, vb[2 * i + 1], shift, width))
        elif runs >= 0:  # +0.0 in a few runs: the pairs inside a run of nonzero elements looked up as
            # above, those inside the zeros given the zero pair, those across a run's ends a second look
            zero = np.uint64(tab[1 << width])
            a = 0  # where the zeros before the next run start
            for q in range(runs + 1):
                lo, hi = (bounds[2 * q], bounds[2 * q + 1]) if q < runs else (nv, nv)
                pairs[(a + 1) >> 1:lo >> 1] = _join(zero, zero)
                _lookup_pairs(vb, (lo + 1) >> 1, hi >> 1, tab, shift, ptabs.table, s, mbits, ebits, pairs)
                for i in (a >> 1, lo >> 1):
                    if a < lo and i < h:
                        pairs[i] = _join(_element(tab, vb[2 * i], shift, width),
                                         _element(tab, vb[2 * i + 1], shift, width))
                a = hi
        else:
            for i in range(h):
                pairs[i] = _join(_element(tab, vb[2 * i], shift, width), _element(tab, vb[2 * i + 1], shift, width))
        if nv & 1:
            pairs[h] = _element(tab, vb[nv - 1], shift, width)
            h += 1
        longest = np.uint64(0)
        total = np.uint64(0)
        for i in range(h):
            longest = max(longest, pairs[i] & _U255)
            total += pairs[i] & _U255
        acc = np.uint64(0)
        pending = np.uint64(0)  # bits in acc, < 8 after each flush
        pos = start = word * 4
        i = 0
        if longest <= 28:  # two pairs fit: 7 + 2 * 28 < 64
            while i + 2 <= h:
                p0, p1 = pairs[i], pairs[i + 1]
                pos, acc, pending = _put(out, pos, acc, pending, (p0 >> _U8) | ((p1 >> _U8) << (p0 & _U255)),
                                         (p0 & _U255) + (p1 & _U255))
                i += 2
                if (i & (_SUB_PAIRS - 1)) == 0:  # a sub-stream's end
                    subs[b, (i - 1) >> _PAIRS_SHIFT] = 8 * (pos - start) + np.int64(pending)
        while i < h:  # a pair is at most 40 bits (two escapes)
            pos, acc, pending = _put(out, pos, acc, pending, pairs[i] >> _U8, pairs[i] & _U255)
            i += 1
            if (i & (_SUB_PAIRS - 1)) == 0:
                subs[b, (i - 1) >> _PAIRS_SHIFT] = 8 * (pos - start) + np.int64(pending)
        subs[b, (h - 1) >> _PAIRS_SHIFT] = total
        _store_u64(out, pos, acc)
        cost[b] = total
        word += (np.int64(total) + 31) // 32
        _lengths(subs[b], nv, total)


@njit(**_NOGIL)
def _place_streams(streams, cost, table, word_start, out):
    """Copy each coded block's stream from where _pack wrote it (every block, one after the
    other) to its place in section 2 (``out``), skipping the blocks stored raw."""
    src = 0
    for b in range(table.shape[0]):
        nw = (cost[b] + 31) // 32
        if table[b] != RAW_BLOCK:
            out[4 * word_start[b]:4 * (word_start[b] + nw)] = streams[4 * src:4 * (src + nw)]
        src += nw


@njit(inline="always")
def _zero_positions(values, count, zpos):
    """zpos[:count] = the indices of the ``count`` zeros of ``values`` (unsigned, 1, 2 or 4 bytes
    each), and zpos[count] = len(values): the ends of the runs between them. Eight bytes at a
    time, looking into a word only where a lane of it is zero: blocks hold a few zeros (an element
    by element pass over every float16 block with a +0.0 took 0.4 ms of the real bucket's 2.5 ms
    decode: 334 such blocks, 3.5 zeros each)."""
    if count:
        raw = values.view(np.uint8)
        lanes = 8 // values.itemsize
        high = _HIGH if lanes == 8 else (_HIGH16 if lanes == 4 else _HIGH32)
        w = values.shape[0] // lanes
        z = 0
        for i in range(w):
            v = np.uint64(_load_u64(raw, 8 * i))
            if _nonzero_lanes(v, high) != high:  # a lane of v is zero
                for t in range(lanes):
                    zpos[z] = lanes * i + t
                    z = min(z + (values[lanes * i + t] == 0), count)
        for i in range(lanes * w, values.shape[0]):
            zpos[z] = i
            z = min(z + (values[i] == 0), count)
        zpos[z:count] = values.shape[0]  # fewer zeros than counted (a tensor written while encoded)
    zpos[count] = values.shape[0]


@njit(inline="always")
def _nonzero_runs(values, cap, bounds):
    """The runs of nonzero elements of ``values`` (unsigned, 1, 2 or 4 bytes each), run q being
    values[bounds[2q]:bounds[2q + 1]]; returns their count, or -1 once there are more than ``cap``
    (element by element is then as fast). Eight bytes at a time, looking into a word only where
    a run starts or ends in it: blocks dense with +0.0 mostly hold them in long runs (a
    gradient's rows that the batch did not touch), which the per-element paths took 4-5x longer
    over than over a block without +0.0."""
    raw = values.view(np.uint8)
    lanes = 8 // values.itemsize
    high = _HIGH if lanes == 8 else (_HIGH16 if lanes == 4 else _HIGH32)
    n = values.shape[0]
    w = n // lanes
    k = 0
    inside = False  # in a run
    for i in range(w + (n > lanes * w)):
        if i < w:
            m = _nonzero_lanes(np.uint64(_load_u64(raw, 8 * i)), high)
            if m == (high if inside else np.uint64(0)):  # a uint64 both ways: an int would make both floats
                continue
        for t in range(lanes * i, min(n, lanes * i + lanes)):
            if (values[t] != 0) != inside:
                if inside:
                    bounds[2 * k + 1] = t
                    k += 1
                elif k == cap:
                    return -1
                else:
                    bounds[2 * k] = t
                inside = not inside
    if inside:
        bounds[2 * k + 1] = n
        k += 1
    return k


@njit(inline="always")
def _rest_value_of(v, mmask, mbits, ebits):
    """An element's rest: its sign above the mantissa bits below the coded field."""
    return (v & mmask) | ((v >> (mbits + ebits)) << mbits)


@njit(inline="always")
def _rest_run(vb, rest, j, sv, mmask, mbits, ebits, rest_bytes, side_bits):
    """Rest bytes of a run without +0.0, from byte ``j`` of section 3, and (float16) each
    element's side bits into ``sv``, a slice as long as the run. In chunks of 256 elements, each
    asking the cache for its lines PREFETCH elements ahead."""
    size = 4 if rest_bytes == 3 else 2  # an element's bytes
    for c in range(0, vb.shape[0], 256):
        for k in range(0, 256 * size, 64):
            prefetch(vb, c + PREFETCH + k // size)
        vc = vb[c:c + 256]
        if rest_bytes == 1:
            rb = rest[j + c:j + c + vc.shape[0]]  # a slice, not offsets: the loop vectorizes
            for i in range(vc.shape[0]):
                rb[i] = _rest_value_of(np.int64(vc[i]), mmask, mbits, ebits)
            if side_bits:
                sc = sv[c:c + vc.shape[0]]
                for i in range(vc.shape[0]):
                    sc[i] = _rest_value_of(np.int64(vc[i]), mmask, mbits, ebits) >> 8
        else:
            for i in range(vc.shape[0]):
                _store_u32(rest, j + rest_bytes * (c + i), _rest_value_of(np.int64(vc[i]), mmask, mbits, ebits))


@njit(inline="always")
def _pack_side(src, out, side_bits, elements, mmask, mbits, ebits):
    """Side bits packed LSB first into ``out``, ceil(len(src) * side_bits / 8) bytes: ``src``
    holds them, or, if ``elements``, holds elements whose rest above its byte they are."""
    per = 8 // side_bits
    m = src.shape[0]
    for i in range(m // per):
        acc = 0
        for t in range(per):
            acc |= _side_of(src[per * i + t], elements, mmask, mbits, ebits) << (side_bits * t)
        out[i] = acc
    if m % per:
        acc = 0
        for t in range(m % per):
            acc |= _side_of(src[m - m % per + t], elements, mmask, mbits, ebits) << (side_bits * t)
        out[m // per] = acc


@njit(inline="always")
def _side_of(v, element, mmask, mbits, ebits):
    """``v``'s side bits if it is an ``element``, else ``v`` (side bits already)."""
    return _rest_value_of(np.int64(v), mmask, mbits, ebits) >> 8 if element else np.int64(v)


def _rest(bits, bs, mbits, table, nzero, rest_start, rest):
    """_rest_layout for the dtype that ``mbits`` tells (see _constants), compiled for that dtype
    alone (as _pack)."""
    _RESTS[mbits](bits, bs, table, nzero, rest_start, rest)


@njit(**_NOGIL)
def _rest_bf16(bits, bs, table, nzero, rest_start, rest):
    _rest_layout(bits, bs, _BF16, table, nzero, rest_start, rest)


@njit(**_NOGIL)
def _rest_fp16(bits, bs, table, nzero, rest_start, rest):
    _rest_layout(bits, bs, _FP16, table, nzero, rest_start, rest)


@njit(**_NOGIL)
def _rest_fp32(bits, bs, table, nzero, rest_start, rest):
    _rest_layout(bits, bs, _FP32, table, nzero, rest_start, rest)


_RESTS = {_BF16[0]: _rest_bf16, _FP16[0]: _rest_fp16, _FP32[0]: _rest_fp32}  # by mbits


@njit(inline="always")
def _rest_layout(bits, bs, layout, table, nzero, rest_start, rest):
    """Section 3: the rest bytes of non-zero elements, then (float16) their side bits; whole raw blocks.

    Single rest bytes of blocks with few +0.0 (which have no rest bytes) go out in
    runs between the zeros, which vectorize (bf16 of summed gradients, where most
    blocks hold a zero or two: 1.3x). Multi-byte rests are unaligned 32-bit stores
    whose surplus bytes the next element overwrites (or the next block, or the 8
    bytes of slack after the section); zeros there are dropped by not advancing,
    without a branch (runs were slower for them). Side bits are packed straight from
    the elements of a block without +0.0 (float16 section 1.08x), and are gathered a
    byte per element alike in others, then packed."""
    mbits, ebits, emax, rest_bytes, side_bits, itemsize, bias = layout
    n = bits.shape[0]
    mmask = (1 << mbits) - 1
    zpos = np.empty(bs // 16 + 2, np.int64)
    bounds = np.empty(bs // 8 + 2, np.int64)
    sv = np.empty(bs + 4 if side_bits else 0, np.uint8)  # side bits of a block's non-zero elements
    for b in range(table.shape[0]):
        lo = b * bs
        nv = min(n, lo + bs) - lo
        j = rest_start[b]
        vb = bits[lo:lo + nv]
        if table[b] == RAW_BLOCK:
            for i in range(nv):
                _store_u32(rest, j + itemsize * i, vb[i])
            continue
        k = 0
        if side_bits and nzero[b] == 0:  # one run: side bits packed from the elements in place
            _rest_run(vb, rest, j, sv[:0], mmask, mbits, ebits, rest_bytes, 0)
            _pack_side(vb, rest[j + nv * rest_bytes:], side_bits, True, mmask, mbits, ebits)
            continue
        few = nzero[b] == 0 or (rest_bytes == 1 and nzero[b] * 16 <= nv)
        runs = -1 if few else _nonzero_runs(vb, nv // 16, bounds)
        if few:  # runs between the few +0.0
            nz = nzero[b]
            _zero_positions(vb, nz, zpos)
            a = 0
            for z in range(nz + 1):
                # the runs hold the planned nv - nz elements at most: fewer zeros than counted (a
                # tensor written while it is encoded) would make the last runs longer
                e = min(max(zpos[z], a), a + nv - nz - k)
                _rest_run(vb[a:e], rest, j, sv[k:k + e - a], mmask, mbits, ebits, rest_bytes, side_bits)
                j += (e - a) * rest_bytes
                k += e - a
                a = e + 1
        elif runs >= 0:  # many +0.0, in a few runs
            planned = nv - nzero[b]
            for q in range(runs):
                a = bounds[2 * q]
                e = min(bounds[2 * q + 1], a + planned - k)  # held to the plan, as above
                _rest_run(vb[a:e], rest, j, sv[k:k + e - a], mmask, mbits, ebits, rest_bytes, side_bits)
                j += (e - a) * rest_bytes
                k += e - a
        else:  # j and k held to the plan: a tensor written while it is encoded cannot push them past it
            end = j + (nv - nzero[b]) * rest_bytes
            for i in range(nv):
                v = np.int64(vb[i])
                r = _rest_value_of(v, mmask, mbits, ebits)
                _store_u32(rest, j, r)
                j = min(j + rest_bytes * (v != 0), end)
                if side_bits:
                    sv[k] = r >> 8
                    k = min(k + (v != 0), nv - nzero[b])
        if side_bits:
            _pack_side(sv[:k], rest[j:], side_bits, False, mmask, mbits, ebits)


def _int_view(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16).numpy().view(
        np.uint32 if x.element_size() == 4 else np.uint16)


_local = threading.local()
SCRATCH_MAX = 8 << 20  # elements: larger buffers are allocated per call rather than kept


def _scratch(name: str, size: int, dtype) -> np.ndarray:
    """A buffer of ``size`` elements that this thread reuses from call to call (up to SCRATCH_MAX):
    the encoder's streams before they are placed, and the decoder's zero-padded copy of a stream
    that lies too near its packet's end; a fresh allocation would fault them in page by page."""
    if size > SCRATCH_MAX:
        return np.empty(size, dtype)
    buf = getattr(_local, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, 1 << 20), dtype)
        setattr(_local, name, buf)
    return buf[:size]


def encode(x: torch.Tensor, block_size: int, checksum: bool) -> torch.Tensor:
    layout = LAYOUTS[x.dtype]
    n = x.numel()
    bits = _int_view(x.reshape(-1))
    nb = num_blocks(n, block_size)
    ref = np.zeros(nb, np.int64)
    hist = np.zeros((nb, NSYM), np.int64)
    nzero = np.zeros(nb, np.int64)
    cost = np.zeros(nb, np.int64)
    _analyse(bits, block_size, layout.mbits, ref, hist, nzero)
    tables = choose(hist, x.dtype)
    # Every block's stream first, into a buffer this thread reuses: the packet's size, and so
    # where section 3 starts, is known only once the blocks' exact sizes are.
    longest = MAXLEN + layout.ebits
    streams = _scratch("streams", 4 * nb * -(-block_size * longest // 32) + 8, np.uint8)
    cols = max(1, substreams(block_size))
    subs = _scratch("subs", nb * cols, np.uint16).reshape(nb, cols)
    if nb:
        _pack(bits, block_size, layout.mbits, ref, tables.assign, nzero, hist, tables.codes, tables.lengths, streams,
              cost, subs, _pair_tables())
    pl = plan(tables, ref, cost, nzero, n, block_size, layout)
    buf = np.empty(pl.total_size + 8, dtype=np.uint8)  # the rest section's stores spill up to 8 bytes
    s0 = pl.sizes[0]
    raw = nb and (pl.table == RAW_BLOCK).any()
    if s0:  # section 0: the sub-stream lengths, a raw block's 0
        if raw:
            subs[pl.table == RAW_BLOCK] = 0
        buf[HEADER_SIZE:HEADER_SIZE + s0] = subs.view(np.uint8).reshape(-1)
    front = pl.front()
    p = HEADER_SIZE + s0 + len(front)
    buf[HEADER_SIZE + s0:p] = front
    if nb:
        if raw:
            _place_streams(streams, cost, pl.table, pl.word_start, buf[p:])
        else:
            buf[p:p + pl.sizes[2]] = streams[:pl.sizes[2]]
        _rest(bits, block_size, layout.mbits, pl.table, pl.nzero, pl.rest_start, buf[p + pl.sizes[2]:])
    buf = buf[:pl.total_size]
    crc = zlib.crc32(memoryview(buf)[HEADER_SIZE:]) if checksum else 0
    h = Header(CODEC_LOSSLESS, x.dtype, n, FLAG_CRC if checksum else 0, block_size, BANK_SIZE, NSYM, MAXLEN,
               pl.sizes, crc)
    buf[:HEADER_SIZE] = np.frombuffer(h.pack(), dtype=np.uint8)
    return torch.from_numpy(buf)


@lru_cache(maxsize=64)
def _decoder_tables(key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(single-symbol, multi-symbol) int64 lookups of every table of a packet, keyed by the
    int64 code lengths' bytes (treat as read-only). Packets of one tensor often repeat all
    their tables; where they do not, each table's lookups come from the caches below."""
    lengths = np.frombuffer(key, dtype=np.int64).reshape(-1, NSYM)
    if not len(lengths):
        return np.zeros((1, 1 << MAXLEN), np.int64), np.zeros((1, 1 << WINDOW), np.int64)
    return (T.decode_luts(lengths).astype(np.int64),
            np.stack([_multi_lut(row.tobytes()) for row in lengths]))


@lru_cache(maxsize=1024)
def _multi_lut(key: bytes) -> np.ndarray:
    """One table's multi-symbol lookup, cached by its code lengths' bytes (treat as read-only)."""
    lut = T.decode_lut(np.frombuffer(key, dtype=np.int64)).astype(np.int64)
    return _multi_luts(lut)


@njit(**_NOGIL)
def _multi_luts(lut):
    """A lookup that resolves up to four symbols from the next WINDOW bits.

    entry = bits used (bits 0-5) | symbol bytes << 9 (first element lowest) | count << 56:
    the bits used lowest, so that the bit reader shifts by the entry's low six bits and a round's
    entries summed hold their bits used in the low six bits; the count on top, so that one
    shift gives it. _SPECIAL (bit 6; nothing used, count 0) sends the element to the
    single-symbol path: an escape, an invalid code, or a code longer than the window. A window
    stops before such an element."""
    m = np.zeros(1 << WINDOW, dtype=np.int64)
    for w in range(1 << WINDOW):
        toks, cnt, used = np.int64(0), 0, 0
        while cnt < 4:
            e = lut[w >> used]  # the window's remaining bits, zeros above: a code that fits them is found
            ln = e >> 8
            s = e & 255
            if ln == 0 or used + ln > WINDOW or s == 1:
                break
            toks |= s << (8 * cnt)
            cnt += 1
            used += ln
        m[w] = used | (toks << 9) | (np.int64(cnt) << 56) if cnt else _SPECIAL
    return m


@njit(inline="always")
def _reader(stream, p):
    """At least 57 bits of the stream from bit ``p`` (``stream`` carries 8 bytes of zero padding)."""
    return _load_u64(stream, p >> 3) >> (p & 7)


@njit(inline="always")
def _multi(mlut, c, used, sym, k):
    """One lookup on the bit container ``c``: four symbol bytes stored at once at ``sym[k]`` (the
    surplus is overwritten next). Returns (c, used, k, entry): ``c`` and ``k`` advanced, the entry
    added to ``used``, whose low six bits sum the bits of a round's lookups (at most 40)."""
    e = mlut[c & ((1 << WINDOW) - 1)]
    _store_u32(sym, k, e >> 9)
    return c >> (e & 63), used + e, k + (e >> 56), e


@njit(inline="always")
def _single(stream, lut, p, k, x, xbits, sym, xexp):
    """One element by the single-symbol lookup: its symbol into sym[k], an escape's raw field
    into xexp[k]. Returns (p, k, escapes, error), advanced."""
    e = lut[_reader(stream, p) & ((1 << MAXLEN) - 1)]
    tok = e & 255
    p += e >> 8
    if tok == 1:
        xexp[k] = _reader(stream, p) & ((1 << xbits) - 1)
        p += xbits
        x += 1
    sym[k] = tok
    return p, k + 1, x, (e >> 8) == 0


@njit(inline="always")
def _lane_symbols(stream, bs, n, xbits, blocks, m, table, word_start, luts, mluts, sym, xexp, lanes,
                  rest, out, ps, pr, po, rest_lines, out_lines):
    """Decode the symbols of the ``m`` coded blocks ``blocks[:m]`` into ``sym``, block q's at
    q * bs, and each escape's raw field into ``xexp`` alike.
    lanes[q] = (bit position, symbol position, escapes, error), block q's at the end.
    ps, pr, po = where the next group's stream, rest bytes and output start (bytes, bytes,
    elements): each round asks the cache for a line of the one, ``rest_lines`` of the other and
    ``out_lines`` of the output, so that they are in when the next group comes.

    Four blocks go in lock step. Each lane refills a 64-bit bit container once per round
    and makes ROUND lookups on it, loading nothing but the table, so the loop
    carries no branch: a lane that meets an element for the single-symbol path (a
    _SPECIAL entry uses no bits) repeats it until the round ends, then decodes it alone.
    A lookup stores four symbols, so a round stays 4 * ROUND short of a block's end."""
    bad = False
    for q in range(m):
        lanes[q, 0], lanes[q, 1], lanes[q, 2], lanes[q, 3] = word_start[blocks[q]] * 32, q * bs, 0, 0
    if m == LANES:
        b0, b1, b2, b3 = blocks[0], blocks[1], blocks[2], blocks[3]
        t0, t1, t2, t3 = mluts[table[b0]], mluts[table[b1]], mluts[table[b2]], mluts[table[b3]]
        l0, l1, l2, l3 = luts[table[b0]], luts[table[b1]], luts[table[b2]], luts[table[b3]]
        p0, p1, p2, p3 = lanes[0, 0], lanes[1, 0], lanes[2, 0], lanes[3, 0]
        k0, k1, k2, k3 = lanes[0, 1], lanes[1, 1], lanes[2, 1], lanes[3, 1]
        x0 = x1 = x2 = x3 = np.int64(0)
        lim = min(bs, n - b3 * bs) - 4 * ROUND
        step = 64 // out.itemsize
        while k0 <= lim and k1 <= bs + lim and k2 <= 2 * bs + lim and k3 <= 3 * bs + lim and not bad:
            prefetch(stream, ps)
            ps += 64
            for _ in range(rest_lines):
                prefetch(rest, pr)
                pr += 64
            for _ in range(out_lines):
                prefetch_write(out, po)
                po += step
            c0, c1, c2, c3 = _reader(stream, p0), _reader(stream, p1), _reader(stream, p2), _reader(stream, p3)
            u0 = u1 = u2 = u3 = np.int64(0)
            for _ in range(ROUND):
                c0, u0, k0, e0 = _multi(t0, c0, u0, sym, k0)
                c1, u1, k1, e1 = _multi(t1, c1, u1, sym, k1)
                c2, u2, k2, e2 = _multi(t2, c2, u2, sym, k2)
                c3, u3, k3, e3 = _multi(t3, c3, u3, sym, k3)
            p0, p1, p2, p3 = p0 + (u0 & 63), p1 + (u1 & 63), p2 + (u2 & 63), p3 + (u3 & 63)
            if (e0 | e1 | e2 | e3) & _SPECIAL:  # four tests written out: one inlined function
                # holding the test and the call made decoding 2.2-2.7x slower
                if e0 & _SPECIAL:
                    p0, k0, x0, f0 = _single(stream, l0, p0, k0, x0, xbits, sym, xexp)
                    bad |= f0
                if e1 & _SPECIAL:
                    p1, k1, x1, f1 = _single(stream, l1, p1, k1, x1, xbits, sym, xexp)
                    bad |= f1
                if e2 & _SPECIAL:
                    p2, k2, x2, f2 = _single(stream, l2, p2, k2, x2, xbits, sym, xexp)
                    bad |= f2
                if e3 & _SPECIAL:
                    p3, k3, x3, f3 = _single(stream, l3, p3, k3, x3, xbits, sym, xexp)
                    bad |= f3
        lanes[0, 0], lanes[1, 0], lanes[2, 0], lanes[3, 0] = p0, p1, p2, p3
        lanes[0, 1], lanes[1, 1], lanes[2, 1], lanes[3, 1] = k0, k1, k2, k3
        lanes[0, 2], lanes[1, 2], lanes[2, 2], lanes[3, 2] = x0, x1, x2, x3
    for q in range(m):  # each lane's tail, and groups of fewer than LANES blocks
        b = blocks[q]
        end = q * bs + min(bs, n - b * bs)
        p, k, x = lanes[q, 0], lanes[q, 1], lanes[q, 2]
        ml, sl = mluts[table[b]], luts[table[b]]
        while k + 4 <= end and not bad:
            _, u, k, e = _multi(ml, _reader(stream, p), np.int64(0), sym, k)
            p += u & 63
            if e & _SPECIAL:
                p, k, x, bad = _single(stream, sl, p, k, x, xbits, sym, xexp)
        while k < end and not bad:
            p, k, x, bad = _single(stream, sl, p, k, x, xbits, sym, xexp)
        lanes[q, 0], lanes[q, 2], lanes[q, 3] = p, x, bad


@njit(inline="always")
def _join_run(ob, sb, xb, rb, ub, base, escapes, mmask, mbits, ebits, rest_bytes, side_bits):
    """Elements of a run without +0.0: coded field ``base`` + symbol, or an escape's raw field,
    joined with their rest bytes (float16: and their side bits, a byte each in ``ub``).

    Three loops that vectorize: symbol, sign and mantissa with the layout's constants only,
    then ``base`` added to every field (with the run-time ``base`` in the first loop,
    LLVM kept 64-bit lanes: 4x slower), then, if the block has escapes, their fields."""
    m = ob.shape[0]
    if rest_bytes == 3:  # each element's three bytes as one load of four, but the last's
        for i in range(m - 1):
            rv = _load_u32(rb, 3 * i) & 0xFFFFFF
            ob[i] = (rv & mmask) | (np.int64(sb[i]) << mbits) | ((rv >> mbits) << (mbits + ebits))
    for i in range(max(m - 1, 0) if rest_bytes == 3 else 0, m):  # runs may be empty
        rv = _rest_value(rb, i, rest_bytes)
        if side_bits:
            rv |= np.int64(ub[i]) << 8
        ob[i] = (rv & mmask) | (np.int64(sb[i]) << mbits) | ((rv >> mbits) << (mbits + ebits))
    shifted = base << mbits
    for i in range(m):
        ob[i] += shifted
    if escapes:  # the base's add leaves the mantissa as it was; the sign is the rest's top bit
        for i in range(m):
            if side_bits:
                sign = np.int64(ub[i]) >> (side_bits - 1)
            else:
                sign = np.int64(rb[rest_bytes * i + rest_bytes - 1]) >> 7
            esc = (ob[i] & mmask) | (np.int64(xb[i]) << mbits) | (sign << (mbits + ebits))
            ob[i] = esc if sb[i] == 1 else ob[i]


@njit(inline="always")
def _rest_value(rb, i, rest_bytes):
    """Element ``i``'s rest bytes, little-endian."""
    if rest_bytes == 1:
        return np.int64(rb[i])
    return np.int64(rb[3 * i]) | (np.int64(rb[3 * i + 1]) << 8) | (np.int64(rb[3 * i + 2]) << 16)


@njit(inline="always")
def _unpack_side(packed, m, ub, side_bits):
    """The first ``m`` ``side_bits``-bit values of ``packed`` (LSB first), a byte each, into ub[:m]."""
    per = 8 // side_bits
    mask = (1 << side_bits) - 1
    for i in range(m // per):
        v = np.int64(packed[i])
        for t in range(per):
            ub[per * i + t] = (v >> (side_bits * t)) & mask
    for i in range(m - m % per, m):
        ub[i] = (np.int64(packed[i // per]) >> (side_bits * (i % per))) & mask


@njit(inline="always")
def _scan_symbols(sb, base, emax):
    """(the number of +0.0 symbols of a block, whether every offset symbol (not +0.0's, not an
    escape) gives a coded field in 0..emax), in one pass eight symbols at a time (twice as fast
    as byte by byte). The range test, needed only where ``base`` sits near either end (float16's
    references sit low), compares symbols (below 128) bytewise without a borrow across bytes:
    the high bit of (s | 0x80) - t is s >= t."""
    lo, hi = max(2, -base), min(31, emax - base)
    w = sb.shape[0] // 8
    words = sb[:8 * w].view(np.uint64)
    nonzero = np.uint64(0)
    bad = np.uint64(0)
    if lo <= 2 and hi >= 31:
        for i in range(w):
            v = words[i]
            nonzero += ((_nonzero_lanes(v, _HIGH) >> _U7) * _ONES) >> _U56
    else:
        at_lo, at_hi, at_one = np.uint64(lo) * _ONES, (np.uint64(hi) * _ONES) | _HIGH, _ONES | _HIGH
        for i in range(w):
            v = words[i]
            nonzero += ((_nonzero_lanes(v, _HIGH) >> _U7) * _ONES) >> _U56
            fits = (((v | _HIGH) - at_lo) & (at_hi - v)) | (at_one - v)  # lo <= s <= hi, or s <= 1
            bad |= ~fits & _HIGH
    zeros = np.int64(8 * w) - np.int64(nonzero)
    for i in range(8 * w, sb.shape[0]):
        v = sb[i]
        zeros += v == 0
        bad |= np.uint64((v > 1) & ((v < lo) | (v > hi)))
    return zeros, bad == 0


def _decode(stream, rest, bs, n, mbits, ref, table, nzero, word_start, rest_start, s0, luts, mluts, out):
    """_decode_layout for the dtype that ``mbits`` tells (see _constants), compiled for that dtype
    alone (as _pack: one function holding the three bodies took 46-59 s to compile per element
    type)."""
    return _DECODES[mbits](stream, rest, bs, n, ref, table, nzero, word_start, rest_start, s0, luts, mluts, out)


@njit(**_NOGIL)
def _decode_bf16(stream, rest, bs, n, ref, table, nzero, word_start, rest_start, s0, luts, mluts, out):
    return _decode_layout(stream, rest, bs, n, _BF16, ref, table, nzero, word_start, rest_start, s0, luts, mluts,
                          out)


@njit(**_NOGIL)
def _decode_fp16(stream, rest, bs, n, ref, table, nzero, word_start, rest_start, s0, luts, mluts, out):
    return _decode_layout(stream, rest, bs, n, _FP16, ref, table, nzero, word_start, rest_start, s0, luts, mluts,
                          out)


@njit(**_NOGIL)
def _decode_fp32(stream, rest, bs, n, ref, table, nzero, word_start, rest_start, s0, luts, mluts, out):
    return _decode_layout(stream, rest, bs, n, _FP32, ref, table, nzero, word_start, rest_start, s0, luts, mluts,
                          out)


@njit(inline="always")
def _decode_layout(stream, rest, bs, n, layout, ref, table, nzero, word_start, rest_start, s0, luts, mluts,
                   out):
    """Decode every block into ``out``; returns 0 or an error code: the first failing block's, where
    an invalid code would fail the whole group of LANES blocks it is decoded with (none is: the
    bank's codes are complete prefix codes; a corrupt stream fails by where it ends). s0: section
    0's bytes, each block's sub-stream lengths (empty where blocks have none), whose sum must be
    the bits its stream took (a raw block's 0): this decoder walks a block in one chain and
    relies on no sub-stream's start, so their sum is what it can go wrong by (docs/FORMAT.md).

    Coded blocks go LANES at a time: their symbols into a buffer of LANES blocks, then joined
    with their rest bytes while that buffer is still in the core's cache (a buffer for the
    whole tensor, written by one pass and read by the next, made decoding 1.03-1.2x slower,
    most where other work had run between calls)."""
    itemsize = layout[5]
    subs = s0.shape[0] // (2 * ref.shape[0]) if ref.shape[0] else 0
    for b in range(ref.shape[0]):
        if table[b] == RAW_BLOCK:
            if _block_bits(s0, b, subs):
                return -4
            lo, j = b * bs, rest_start[b]
            for i in range(min(n, lo + bs) - lo):
                v = np.int64(0)
                for k in range(itemsize):
                    v |= np.int64(rest[j + itemsize * i + k]) << (8 * k)
                out[lo + i] = v
    coded = np.nonzero(table != RAW_BLOCK)[0]
    sym = np.empty(LANES * bs + 4, np.uint8)
    xexp = np.empty(LANES * bs + 4, np.uint8)  # used only where a symbol is an escape
    lanes = np.zeros((LANES, 4), np.int64)  # see _lane_symbols
    zpos = np.empty(bs // 16 + 2, np.int64)
    bounds = np.empty(bs // 8 + 2, np.int64)  # see _nonzero_runs
    ub = np.empty(bs if layout[4] else 0, np.uint8)  # a block's side bits, a byte per element
    for g in range(0, coded.shape[0], LANES):
        m = min(LANES, coded.shape[0] - g)
        nxt = coded[min(g + LANES, coded.shape[0] - 1)]  # the next group's first block (the last: itself)
        _lane_symbols(stream, bs, n, layout[1], coded[g:g + m], m, table, word_start, luts, mluts, sym, xexp, lanes,
                      rest, out, 4 * word_start[nxt], rest_start[nxt], nxt * bs, layout[3] + (layout[4] > 0), itemsize)
        for q in range(m):
            b = coded[g + q]
            lo = b * bs
            nv = min(n, lo + bs) - lo
            if lanes[q, 3] or lanes[q, 0] > word_start[b + 1] * 32:
                return -1
            if subs and lanes[q, 0] - word_start[b] * 32 != _block_bits(s0, b, subs):
                return -4
            err = _join_block(sym[q * bs:q * bs + nv], xexp[q * bs:q * bs + nv], lanes[q, 2], rest, rest_start[b],
                              layout, np.int64(ref[b]), nzero[b], zpos, bounds, ub, out[lo:lo + nv])
            if err:
                return err
    return 0


@njit(inline="always")
def _block_bits(s0, b, subs):
    """The sum of block b's sub-stream lengths in section 0 (``s0``, its bytes; ``subs`` a block)."""
    total = np.int64(0)
    for j in range(2 * b * subs, 2 * (b + 1) * subs, 2):
        total += np.int64(s0[j]) | (np.int64(s0[j + 1]) << 8)
    return total


@njit(inline="always")
def _join_block(sb, xb, escapes, rest, j, layout, r, nzero, zpos, bounds, ub, ob):
    """Join one coded block's coded fields and rest (its bytes from byte ``j``; float16: then its
    side bits, unpacked into ``ub``) into ``ob``; returns 0 or an error code."""
    mbits, ebits, emax, rest_bytes, side_bits, itemsize, bias = layout
    mmask = (1 << mbits) - 1
    nv = ob.shape[0]
    zeros, fits = _scan_symbols(sb, r - bias, emax)
    if zeros != nzero:
        return -3
    if side_bits:
        _unpack_side(rest[j + (nv - zeros) * rest_bytes:], nv - zeros, ub, side_bits)
    if zeros * 16 <= nv:
        # Every symbol but the few zeros is an offset or an escape: between zeros, the
        # runs join without branches (they vectorize); the zeros take no rest.
        if not fits:
            return -2
        _zero_positions(sb, zeros, zpos)
        a = k = 0
        for z in range(zeros + 1):
            e = zpos[z]
            _join_run(ob[a:e], sb[a:e], xb[a:e], rest[j:j + (e - a) * rest_bytes], ub[k:k + e - a], r - bias,
                      escapes, mmask, mbits, ebits, rest_bytes, side_bits)
            j += (e - a) * rest_bytes
            k += e - a
            if e < nv:
                ob[e] = 0
            a = e + 1
        return 0
    runs = _nonzero_runs(sb, nv // 16, bounds) if fits else -1
    if runs >= 0:  # many zeros, in a few runs: as above, run by run, and the gaps zeroed
        a = k = 0
        for q in range(runs):
            lo, hi = bounds[2 * q], bounds[2 * q + 1]
            ob[a:lo] = 0
            _join_run(ob[lo:hi], sb[lo:hi], xb[lo:hi], rest[j:j + (hi - lo) * rest_bytes], ub[k:k + hi - lo],
                      r - bias, escapes, mmask, mbits, ebits, rest_bytes, side_bits)
            j += (hi - lo) * rest_bytes
            k += hi - lo
            a = hi
        ob[a:] = 0
        return 0
    k = 0
    for i in range(nv):
        s = np.int64(sb[i])
        if s == 0:
            ob[i] = 0
            continue
        if s == 1:
            ex = np.int64(xb[i])
        else:
            ex = r + s - bias
            if ex < 0 or ex > emax:
                return -2
        rv = np.int64(0)
        for t in range(rest_bytes):
            rv |= np.int64(rest[j]) << (8 * t)
            j += 1
        if side_bits:
            rv |= np.int64(ub[k]) << (8 * rest_bytes)
            k += 1
        ob[i] = (rv & mmask) | (ex << mbits) | ((rv >> mbits) << (mbits + ebits))
    return 0


_ERRORS = {-1: "invalid or truncated code in an exponent stream", -2: "decoded exponent out of range",
           -3: "zero count of a block does not match its index entry", -4: SUBSTREAM_ERROR}


_DECODES = {_BF16[0]: _decode_bf16, _FP16[0]: _decode_fp16, _FP32[0]: _decode_fp32}  # by mbits


def decode(packet: torch.Tensor, out: torch.Tensor, header: Header | LosslessPacket | None = None) -> torch.Tensor:
    p = parse_lossless(packet, header)
    layout, h = p.layout, p.header
    n, bs = h.numel, h.block_size
    buf = packet.numpy()
    rest = buf[p.rest_offset:p.rest_offset + int(p.rest_start[-1])]
    luts, mluts = _decoder_tables(p.lengths.tobytes())
    view = _int_view(out)
    # A corrupt block's stream can make its decoder read up to the longest element (code,
    # escaped field) per element from the block's start: the streams are read
    # in place where the packet's rest bytes cover that reach, else from a zero-padded copy.
    nw = int(p.word_start[-1])
    reach = 4 * nw + 8 + (MAXLEN + layout.ebits) * bs // 8
    if buf.shape[0] - p.stream_offset >= reach:
        stream = buf[p.stream_offset:]
    else:
        stream = _scratch("words", reach, np.uint8)
        stream[4 * nw:] = 0
        stream[:4 * nw] = buf[p.stream_offset:p.rest_offset]
    s0 = buf[HEADER_SIZE:HEADER_SIZE + h.sections[0]]
    err = _decode(stream, rest, bs, n, layout.mbits, p.ref, p.table, p.nzero, p.word_start, p.rest_start, s0,
                  luts, mluts, view)
    if err:
        raise FormatError(_ERRORS[err])
    return out
