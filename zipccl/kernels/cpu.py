"""numba CPU kernels for the lossless format, byte-identical to zipccl/reference.

Encode reads the data three times: analyse (histograms), pack (codes into the
bit stream) and rest (sign+mantissa bytes). Decode runs two passes: tokens into
a byte buffer (a token is a symbol joined with float16's 3 inline bits; a
12-bit lookup yields up to four, stored with one 32-bit write), then a
branch-free pass joining exponents, inline bits and rest bytes. Huffman
decoding is serial within a block, so four blocks go in lock step to keep the
core busy while one waits on a table lookup. Code tables come from
reference/tables.py, which runs once per packet on the block histograms.

Numba lessons measured here: index through per-block slices rather than
``offset + i`` (offset indexing kept loops from vectorizing: 10x slower); keep
stores out of branches in hot loops (a conditional store cost 4-7x), and
choices too (a conditional expression in the join was 4x slower than an
arithmetic select; a helper branching on the rest width, 4x); one 32-bit
lookup per element instead of three int64 ones made packing 2.4x faster;
unaligned 64-bit loads and stores (an LLVM intrinsic) let the bit reader and
writer move whole bytes (the symbol decoder 2.7x faster)."""

from __future__ import annotations

import zlib
from functools import lru_cache

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ..errors import FormatError
from ..format import CODEC_LOSSLESS, FLAG_CRC, HEADER_SIZE, LAYOUTS, MAXLEN, NSYM, RAW_BLOCK, Header, num_blocks
from ..reference import tables as T
from ..reference.packet import parse_lossless
from ..reference.plan import plan

_NOGIL = dict(cache=True, nogil=True, boundscheck=False)
LANES = 4          # blocks coded in lock step
_SPECIAL = -(1 << 63)  # multi-token entry flag: an escape (count 1), an invalid code (count 0) or, with
_LONG = 1 << 40        # this bit, an element whose code and inline bits overrun the lookup (count 0)


@njit(**_NOGIL)
def _analyse(bits, bs, mbits, emax, ref, hist, nzero):
    """Per block: reference exponent (mode of non-zero exponents, ties to the smallest),
    symbol histogram and count of +0.0 elements."""
    n = bits.shape[0]
    nb = ref.shape[0]
    cnt = np.zeros((4, emax + 1), dtype=np.int64)
    for b in range(nb):
        lo = b * bs
        hi = min(n, lo + bs)
        cnt[:] = 0
        z = 0
        vb = bits[lo:hi]
        m = hi - lo
        i = 0
        while i + 4 <= m:  # four histograms: repeated exponents don't wait on each other
            for k in range(4):
                v = np.int64(vb[i + k])
                cnt[k, (v >> mbits) & emax] += 1
                z += v == 0
            i += 4
        while i < m:
            v = np.int64(vb[i])
            cnt[0, (v >> mbits) & emax] += 1
            z += v == 0
            i += 1
        best = 0
        bestc = -1
        for e in range(emax + 1):
            c = cnt[0, e] + cnt[1, e] + cnt[2, e] + cnt[3, e] - (z if e == 0 else 0)
            cnt[0, e] = c
            if c > bestc:
                bestc = c
                best = e
        if bestc == 0:
            best = 0
        ref[b] = best
        nzero[b] = z
        hist[b, :] = 0
        hist[b, 0] = z
        for e in range(emax + 1):
            d = e - best
            if d >= -26 and d <= 3:
                hist[b, d + 28] += cnt[0, e]
            else:
                hist[b, 1] += cnt[0, e]


def _unaligned(nbits: int, load: bool):
    """An intrinsic for an unaligned little-endian load (``f(buf, pos) -> int64``) or
    store (``f(buf, pos, value)``, truncating) of ``nbits`` at byte ``pos`` of a uint8 array.

    LSB-first bits in little-endian 32-bit words (the format) are the same bytes
    as an LSB-first byte stream, so the coder may read and write whole bytes."""
    ty = ir.IntType(nbits)

    def address(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.bitcast(builder.gep(arr.data, [args[1]]), ty.as_pointer())

    if load:
        @intrinsic
        def load_(typingctx, buf, pos):
            def codegen(context, builder, sig, args):
                v = builder.load(address(context, builder, sig, args))
                v.align = 1
                return builder.zext(v, ir.IntType(64)) if nbits < 64 else v
            return types.int64(buf, pos), codegen
        return load_

    @intrinsic
    def store_(typingctx, buf, pos, value):
        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[2], sig.args[2], types.int64)
            builder.store(builder.trunc(v, ty) if nbits < 64 else v, address(context, builder, sig, args)).align = 1
            return context.get_dummy_value()
        return types.void(buf, pos, value), codegen
    return store_


_load_u64 = _unaligned(64, load=True)
_store_u64 = _unaligned(64, load=False)
_store_u32 = _unaligned(32, load=False)
_U3, _U7, _U24, _U56 = np.uint64(3), np.uint64(7), np.uint64(24), np.uint64(56)
_CODE = np.uint64((1 << 24) - 1)


def _index_bits(layout) -> tuple[int, int]:
    """(shift, width): ``bits >> shift`` is the sign, the exponent and the mantissa bits
    that travel inline (float16: two), ``width`` bits in all; +0.0 gets index 1 << width."""
    low = max(0, layout.inline_bits - 1)
    return layout.mbits - low, 1 + layout.ebits + low


@njit(**_NOGIL)
def _element_table(r, t, codes, lens, ebits, inline_bits, width, tab):
    """One block's code per element index (see _index_bits): code | length << 24.

    The code already carries an escape's raw exponent and float16's inline bits,
    so packing needs one lookup per element and no branches."""
    emax = (1 << ebits) - 1
    low = width - 1 - ebits
    for idx in range(1 << width):
        e = (idx >> low) & emax
        d = e - r
        if d >= -26 and d <= 3:
            c = codes[t, d + 28]
            ln = lens[t, d + 28]
        else:
            c = codes[t, 1] | (e << lens[t, 1])
            ln = lens[t, 1] + ebits
        if inline_bits:
            c |= ((idx & ((1 << low) - 1)) | ((idx >> (width - 1)) << low)) << ln
            ln += inline_bits
        tab[idx] = c | (ln << 24)
    tab[1 << width] = codes[t, 0] | (lens[t, 0] << 24)


@njit(**_NOGIL)
def _pack(bits, bs, ebits, inline_bits, shift, width, ref, table, codes, lens, word_start, out):
    """Huffman-code the exponents of every coded block into the byte array ``out``
    (section 2, with at least 8 bytes of slack after it).

    Per block, a branch-free pass (it vectorizes) looks up each pair of elements
    and joins their codes; then a serial pass appends one or two pairs at a time
    to a 64-bit accumulator and stores it unaligned, advancing by whole bytes.
    The store spills zeros past the stream's end, which the next block (and
    section 3, written afterwards) overwrite; the last one is the padding."""
    n = bits.shape[0]
    tab = np.zeros((1 << width) + 1, np.uint32)
    code = np.zeros(bs // 2 + 1, np.uint64)
    size = np.zeros(bs // 2 + 1, np.uint64)
    last_ref = last_table = -1
    for b in range(table.shape[0]):
        if table[b] == RAW_BLOCK:
            continue
        if ref[b] != last_ref or table[b] != last_table:  # neighbouring blocks often share both
            _element_table(np.int64(ref[b]), table[b], codes, lens, ebits, inline_bits, width, tab)
            last_ref, last_table = ref[b], table[b]
        vb = bits[b * bs:min(n, b * bs + bs)]
        nv = vb.shape[0]
        h = nv // 2
        longest = np.uint64(0)
        for i in range(h):
            v0, v1 = vb[2 * i], vb[2 * i + 1]
            e0 = np.uint64(tab[(v0 >> shift) + (np.uint32(v0 == 0) << width)])
            e1 = np.uint64(tab[(v1 >> shift) + (np.uint32(v1 == 0) << width)])
            code[i] = (e0 & _CODE) | ((e1 & _CODE) << (e0 >> _U24))
            size[i] = (e0 >> _U24) + (e1 >> _U24)
            longest = max(longest, size[i])
        if nv & 1:
            e0 = np.uint64(tab[(vb[nv - 1] >> shift) + (np.uint32(vb[nv - 1] == 0) << width)])
            code[h] = e0 & _CODE
            size[h] = e0 >> _U24
            h += 1
        acc = np.uint64(0)
        pending = np.uint64(0)  # bits in acc, < 8 after each flush
        pos = word_start[b] * 4
        i = 0
        if longest <= 28:  # two pairs fit: 7 + 2 * 28 < 64
            while i + 2 <= h:
                acc |= (code[i] | (code[i + 1] << size[i])) << pending
                pending += size[i] + size[i + 1]
                _store_u64(out, pos, acc)
                pos += np.int64(pending >> _U3)
                acc >>= pending & _U56
                pending &= _U7
                i += 2
        while i < h:  # a pair is at most 40 bits (float16 escapes)
            acc |= code[i] << pending
            pending += size[i]
            _store_u64(out, pos, acc)
            pos += np.int64(pending >> _U3)
            acc >>= pending & _U56
            pending &= _U7
            i += 1
        if pending:
            _store_u64(out, pos, acc)


@njit(**_NOGIL)
def _rest(bits, bs, mbits, ebits, rest_bytes, itemsize, table, nzero, rest_start, rest):
    """Section 3: sign+mantissa bytes of non-zero elements; whole raw blocks."""
    n = bits.shape[0]
    mmask = (1 << mbits) - 1
    for b in range(table.shape[0]):
        lo = b * bs
        nv = min(n, lo + bs) - lo
        j = rest_start[b]
        if table[b] == RAW_BLOCK:
            for i in range(nv):
                v = np.int64(bits[lo + i])
                for k in range(itemsize):
                    rest[j + itemsize * i + k] = (v >> (8 * k)) & 255
        elif nzero[b] == 0 and rest_bytes == 1:
            vb, rb = bits[lo:lo + nv], rest[j:j + nv]  # slices, not offsets: the loop vectorizes
            for i in range(nv):
                v = np.int64(vb[i])
                rb[i] = (v & mmask) | ((v >> (mbits + ebits)) << mbits)
        else:
            for i in range(lo, lo + nv):
                v = np.int64(bits[i])
                if v != 0:
                    rv = (v & mmask) | ((v >> (mbits + ebits)) << mbits)
                    for k in range(rest_bytes):
                        rest[j + k] = (rv >> (8 * k)) & 255
                    j += rest_bytes


def _int_view(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16).numpy().view(
        np.uint32 if x.element_size() == 4 else np.uint16)


def encode(x: torch.Tensor, block_size: int, checksum: bool) -> torch.Tensor:
    layout = LAYOUTS[x.dtype]
    n = x.numel()
    bits = _int_view(x.reshape(-1))
    nb = num_blocks(n, block_size)
    ref = np.zeros(nb, np.int64)
    hist = np.zeros((nb, NSYM), np.int64)
    nzero = np.zeros(nb, np.int64)
    _analyse(bits, block_size, layout.mbits, layout.emax, ref, hist, nzero)
    pl = plan(ref, hist, nzero, n, block_size, layout)
    buf = np.empty(pl.total_size + 8, dtype=np.uint8)  # the packer's stores spill up to 8 bytes
    front = pl.front()
    p = HEADER_SIZE + len(front)
    buf[HEADER_SIZE:p] = front
    if nb:
        shift, width = _index_bits(layout)
        _pack(bits, block_size, layout.ebits, layout.inline_bits, shift, width, pl.ref, pl.table, pl.codes,
              pl.lengths, pl.word_start, buf[p:])
        _rest(bits, block_size, layout.mbits, layout.ebits, layout.rest_bytes, layout.itemsize, pl.table, pl.nzero,
              pl.rest_start, buf[p + pl.sizes[2]:])
    buf = buf[:pl.total_size]
    crc = zlib.crc32(memoryview(buf)[HEADER_SIZE:]) if checksum else 0
    h = Header(CODEC_LOSSLESS, x.dtype, n, FLAG_CRC if checksum else 0, block_size, len(pl.lengths), NSYM, MAXLEN,
               pl.sizes, crc)
    buf[:HEADER_SIZE] = np.frombuffer(h.pack(), dtype=np.uint8)
    return torch.from_numpy(buf)


@lru_cache(maxsize=1024)
def _multi_lut(lengths: tuple, inline_bits: int) -> np.ndarray:
    """One table's multi-token lookup, cached by its code lengths (treat as read-only)."""
    return _multi_luts(T.decode_lut(lengths)[None].astype(np.int64), inline_bits)[0]


@njit(**_NOGIL)
def _multi_luts(luts, inline_bits):
    """Lookups that resolve up to four elements from the next 12 bits.

    An element's token is its symbol, shifted left by ``inline_bits`` and joined with
    the inline bits that follow its code (float16: 3; +0.0 has none), so a token fits
    a byte. entry = token bytes (bits 0-31, first lowest) | count << 32 | bits << 36;
    the sign bit flags an escape (alone, count 1: its raw exponent, then its inline
    bits, follow), an invalid code (count 0) and, with bit 40, an element whose code and
    inline bits overrun the 12 bits (count 0: decoded alone). A window stops before those."""
    K = luts.shape[0]
    m = np.zeros((K, 1 << MAXLEN), dtype=np.int64)
    for t in range(K):
        for w in range(1 << MAXLEN):
            tokens, cnt, used = 0, 0, 0
            while cnt < 4:
                e = luts[t, (w >> used) & ((1 << MAXLEN) - 1)]
                ln, s = e >> 8, e & 255
                extra = inline_bits if s != 0 else 0
                if ln == 0 or s == 1 or used + ln + extra > MAXLEN:
                    if cnt == 0:  # the window's first element is special
                        if ln == 0:
                            tokens = _SPECIAL
                        elif s == 1:
                            tokens = _SPECIAL | (1 << inline_bits) | (1 << 32) | (ln << 36)
                        else:
                            tokens = _SPECIAL | _LONG
                    break
                tokens |= ((s << inline_bits) | ((w >> (used + ln)) & ((1 << extra) - 1))) << (8 * cnt)
                cnt += 1
                used += ln + extra
            m[t, w] = tokens | (cnt << 32) | (used << 36) if cnt else tokens
    return m


@njit(inline="always")
def _peek(stream, p):
    """At least 57 bits of the stream from bit ``p`` (``stream`` carries 8 bytes of zero padding)."""
    return _load_u64(stream, p >> 3) >> (p & 7)


@njit(inline="always")
def _multi(stream, mlut, tok, s, p, k):
    """One lookup: store four token bytes at once (the surplus is overwritten next)."""
    e = mlut[_peek(stream, p) & ((1 << MAXLEN) - 1)]
    _store_u32(tok, s + k, e)
    return p + ((e >> 36) & 15), k + ((e >> 32) & 7), e


@njit(inline="always")
def _one(stream, lut, tok, xexp, i, p, ebits, inline_bits):
    """Decode one element the plain way into tok[i] (and xexp[i]). Returns (p, escapes, error)."""
    e = lut[_peek(stream, p) & ((1 << MAXLEN) - 1)]
    s = e & 255
    p += e >> 8
    x = 0
    if s == 1:
        xexp[i] = _peek(stream, p) & ((1 << ebits) - 1)
        p += ebits
        x = 1
    extra = inline_bits if s != 0 else 0
    tok[i] = (s << inline_bits) | (_peek(stream, p) & ((1 << extra) - 1))
    return p + extra, x, (e >> 8) == 0


@njit(inline="always")
def _special(stream, lut, e, tok, xexp, s, p, k, ebits, inline_bits):
    """After a flagged lookup: read an escape's exponent and inline bits, or decode a long
    element alone. Returns (p, k, escapes, error)."""
    if e >= 0:
        return p, k, 0, False
    if e & _LONG:
        p, x, bad = _one(stream, lut, tok, xexp, s + k, p, ebits, inline_bits)
        return p, k + 1, x, bad
    if (e >> 32) & 7 == 0:
        return p, k, 0, True
    w = _peek(stream, p)
    xexp[s + k - 1] = w & ((1 << ebits) - 1)
    tok[s + k - 1] = (1 << inline_bits) | ((w >> ebits) & ((1 << inline_bits) - 1))
    return p + ebits + inline_bits, k, 1, False


@njit(**_NOGIL)
def _symbols(stream, bs, n, ebits, inline_bits, table, word_start, luts, mluts, tok, xexp, stats):
    """Decode every coded block's tokens. stats[b] = (unused, escapes, end bit, error).

    The lock-step loop breaks out only for flagged lookups (escapes, long elements and
    invalid codes), which keeps it free of stores that depend on a branch. A lookup
    stores four tokens, so each lane stops four short of its block's end."""
    coded = np.nonzero(table != RAW_BLOCK)[0]
    nc = coded.shape[0]
    P = np.zeros(LANES, np.int64)
    Kk = np.zeros(LANES, np.int64)
    X = np.zeros(LANES, np.int64)
    for g in range(0, nc, LANES):
        m = min(LANES, nc - g)
        bad = False
        for q in range(m):
            P[q] = word_start[coded[g + q]] * 32
            Kk[q] = 0
            X[q] = 0
        if m == LANES:
            b0, b1, b2, b3 = coded[g], coded[g + 1], coded[g + 2], coded[g + 3]
            t0, t1, t2, t3 = mluts[table[b0]], mluts[table[b1]], mluts[table[b2]], mluts[table[b3]]
            l0, l1, l2, l3 = luts[table[b0]], luts[table[b1]], luts[table[b2]], luts[table[b3]]
            s0, s1, s2, s3 = b0 * bs, b1 * bs, b2 * bs, b3 * bs
            p0, p1, p2, p3 = P[0], P[1], P[2], P[3]
            k0 = k1 = k2 = k3 = np.int64(0)
            lim = min(bs, n - b3 * bs) - 4
            while k0 <= lim and k1 <= lim and k2 <= lim and k3 <= lim and not bad:
                e0 = e1 = e2 = e3 = np.int64(0)
                while k0 <= lim and k1 <= lim and k2 <= lim and k3 <= lim:
                    p0, k0, e0 = _multi(stream, t0, tok, s0, p0, k0)
                    p1, k1, e1 = _multi(stream, t1, tok, s1, p1, k1)
                    p2, k2, e2 = _multi(stream, t2, tok, s2, p2, k2)
                    p3, k3, e3 = _multi(stream, t3, tok, s3, p3, k3)
                    if (e0 | e1 | e2 | e3) < 0:
                        break
                p0, k0, d0, f0 = _special(stream, l0, e0, tok, xexp, s0, p0, k0, ebits, inline_bits)
                p1, k1, d1, f1 = _special(stream, l1, e1, tok, xexp, s1, p1, k1, ebits, inline_bits)
                p2, k2, d2, f2 = _special(stream, l2, e2, tok, xexp, s2, p2, k2, ebits, inline_bits)
                p3, k3, d3, f3 = _special(stream, l3, e3, tok, xexp, s3, p3, k3, ebits, inline_bits)
                X[0] += d0
                X[1] += d1
                X[2] += d2
                X[3] += d3
                bad = f0 or f1 or f2 or f3
            P[0], P[1], P[2], P[3] = p0, p1, p2, p3
            Kk[0], Kk[1], Kk[2], Kk[3] = k0, k1, k2, k3
        for q in range(m):
            b = coded[g + q]
            nv = min(bs, n - b * bs)
            p, k, x = P[q], Kk[q], X[q]
            ml, sl = mluts[table[b]], luts[table[b]]
            s = b * bs
            while k + 4 <= nv and not bad:
                p, k, e = _multi(stream, ml, tok, s, p, k)
                p, k, d, bad = _special(stream, sl, e, tok, xexp, s, p, k, ebits, inline_bits)
                x += d
            while k < nv and not bad:
                p, d, bad = _one(stream, sl, tok, xexp, s + k, p, ebits, inline_bits)
                x += d
                k += 1
            stats[b, 1] = x
            stats[b, 2] = p
            stats[b, 3] = bad


@njit(inline="always")
def _element(tv, rv, xv, base, mbits, ebits, inline_bits):
    """One element's bits from its token, rest bytes and escape exponent: (bits, exponent).
    An escape's exponent is chosen by a select, not a branch, so callers vectorize."""
    rv |= (tv & ((1 << inline_bits) - 1)) << (8 * ((mbits + 1) // 8))
    sv = tv >> inline_bits
    ex = sv + base + (sv == 1) * (xv - sv - base)
    return (rv & ((1 << mbits) - 1)) | (ex << mbits) | ((rv >> mbits) << (mbits + ebits)), ex


@njit(**_NOGIL)
def _compose(tok, xexp, rest, bs, n, mbits, ebits, rest_bytes, inline_bits, itemsize, ref, table, nzero,
             word_start, rest_start, stats, out):
    """Join exponents, inline bits and sign+mantissa bytes into ``out``; returns 0 or an error code.

    Branch-free per element, so the loops vectorize: a block without +0.0 reads its rest
    bytes in order; a block with +0.0 first counts, serially, where each element's rest
    bytes are, then gathers them and zeroes the +0.0 elements by a multiply. Exponents out
    of range (a corrupt packet) are caught by an OR over the block."""
    emax = (1 << ebits) - 1
    pos = np.empty(bs, np.int64)
    for b in range(ref.shape[0]):
        lo = b * bs
        nv = min(n, lo + bs) - lo
        j = rest_start[b]
        if table[b] == RAW_BLOCK:
            for i in range(nv):
                v = np.int64(0)
                for k in range(itemsize):
                    v |= np.int64(rest[j + itemsize * i + k]) << (8 * k)
                out[lo + i] = v
            continue
        if stats[b, 3] or stats[b, 2] > word_start[b + 1] * 32:
            return -1
        tb, xb, ob = tok[lo:lo + nv], xexp[lo:lo + nv], out[lo:lo + nv]
        zeros = 0
        for i in range(nv):
            zeros += tb[i] == 0
        if zeros != nzero[b]:
            return -3
        kept = nv - zeros
        rb = rest[j:j + kept * rest_bytes]
        base = np.int64(ref[b]) - 28
        outside = np.int64(0)
        if zeros == 0 and rest_bytes == 1:
            for i in range(nv):
                v, ex = _element(np.int64(tb[i]), np.int64(rb[i]), np.int64(xb[i]), base, mbits, ebits, inline_bits)
                outside |= ex | (emax - ex)  # negative if the exponent is out of range
                ob[i] = v
        elif zeros == 0:
            for i in range(nv):
                rv = np.int64(rb[3 * i]) | (np.int64(rb[3 * i + 1]) << 8) | (np.int64(rb[3 * i + 2]) << 16)
                v, ex = _element(np.int64(tb[i]), rv, np.int64(xb[i]), base, mbits, ebits, inline_bits)
                outside |= ex | (emax - ex)
                ob[i] = v
        elif kept == 0:
            for i in range(nv):
                ob[i] = 0
        else:
            q = 0
            for i in range(nv):
                pos[i] = rest_bytes * min(q, kept - 1)  # +0.0 elements point at valid bytes they then ignore
                q += tb[i] != 0
            for i in range(nv):
                tv = np.int64(tb[i])
                keep = np.int64(tv != 0)
                at = pos[i]
                rv = np.int64(rb[at])
                if rest_bytes == 3:
                    rv |= (np.int64(rb[at + 1]) << 8) | (np.int64(rb[at + 2]) << 16)
                v, ex = _element(tv, rv, np.int64(xb[i]), base, mbits, ebits, inline_bits)
                outside |= (ex | (emax - ex)) * keep
                ob[i] = v * keep
        if outside < 0:
            return -2
    return 0


_ERRORS = {-1: "invalid or truncated code in an exponent stream", -2: "decoded exponent out of range",
           -3: "zero count of a block does not match its index entry"}


def decode(packet: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    p = parse_lossless(packet)
    layout, h = p.layout, p.header
    n, bs = h.numel, h.block_size
    buf = packet.numpy()
    rest = buf[p.rest_offset:p.rest_offset + int(p.rest_start[-1])]
    luts = T.decode_luts(p.lengths).astype(np.int64) if len(p.lengths) else np.zeros((1, 1 << MAXLEN), np.int64)
    view = _int_view(out)
    # Aligned copy of the streams with zero padding: a corrupt stream may read past its
    # block by at most one element's worth of lookups per element, never past the padding.
    nw = int(p.word_start[-1])
    words = np.zeros(nw + 2 + (MAXLEN + layout.ebits + layout.inline_bits) * bs // 32, np.uint32)
    words[:nw] = buf[p.stream_offset:p.rest_offset].view(np.uint8).copy().view(np.uint32) if nw else 0
    tok = np.empty(n + 4, np.uint8)
    xexp = np.empty(n + 4, np.uint8)  # read only where a token is an escape
    stats = np.zeros((len(p.ref), 4), np.int64)
    mluts = np.stack([_multi_lut(tuple(int(v) for v in lens), layout.inline_bits) for lens in p.lengths]) \
        if len(p.lengths) else np.zeros((1, 1 << MAXLEN), np.int64)
    _symbols(words.view(np.uint8), bs, n, layout.ebits, layout.inline_bits, p.table, p.word_start, luts, mluts,
             tok, xexp, stats)
    err = _compose(tok, xexp, rest, bs, n, layout.mbits, layout.ebits, layout.rest_bytes, layout.inline_bits,
                   layout.itemsize, p.ref, p.table, p.nzero, p.word_start, p.rest_start, stats, view)
    if err:
        raise FormatError(_ERRORS[err])
    return out
