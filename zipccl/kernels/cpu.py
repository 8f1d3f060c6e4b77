"""numba CPU kernels for the lossless format, byte-identical to zipccl/reference.

Three passes over the data: analyse (histograms, one read), emit (codes and
sign+mantissa bytes, one read, one write), and for decode a single pass that
reads codes and rest bytes and writes the floats. Code tables come from
reference/tables.py, which runs once per packet on the block histograms.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from ..errors import FormatError
from ..format import (CODEC_LOSSLESS, FLAG_CRC, HEADER_SIZE, INDEX_ENTRY, LAYOUTS, MAX_OFFSET, MAXLEN,
                      MIN_OFFSET, NSYM, OFFSET_BIAS, RAW_BLOCK, SYM_ESC, SYM_ZERO, TABLE_BYTES, Header,
                      num_blocks, num_tables)
from ..reference import tables as T
from ..reference.packet import parse_lossless

_NOGIL = dict(cache=True, nogil=True, boundscheck=False)


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
        i = lo
        while i + 4 <= hi:
            for k in range(4):
                v = np.int64(bits[i + k])
                cnt[k, (v >> mbits) & emax] += 1
                z += v == 0
            i += 4
        while i < hi:
            v = np.int64(bits[i])
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


@njit(**_NOGIL)
def _emit(bits, bs, mbits, ebits, rest_bytes, inline_bits, itemsize, ref, table, codes, lens,
          word_start, rest_start, words, rest):
    """Write each coded block's exponent stream (LSB-first 32-bit words) and rest bytes;
    copy raw blocks into the rest section."""
    n = bits.shape[0]
    emax = (1 << ebits) - 1
    mmask = (1 << mbits) - 1
    imask = (1 << inline_bits) - 1
    for b in range(ref.shape[0]):
        lo = b * bs
        hi = min(n, lo + bs)
        t = table[b]
        j = rest_start[b]
        if t == 255:
            for i in range(lo, hi):
                v = np.int64(bits[i])
                for k in range(itemsize):
                    rest[j] = (v >> (8 * k)) & 255
                    j += 1
            continue
        r = np.int64(ref[b])
        w = word_start[b]
        acc = np.int64(0)
        nb_ = np.int64(0)
        for i in range(lo, hi):
            v = np.int64(bits[i])
            if v == 0:
                acc |= codes[t, 0] << nb_
                nb_ += lens[t, 0]
            else:
                e = (v >> mbits) & emax
                rv = (v & mmask) | ((v >> (mbits + ebits)) << mbits)
                d = e - r
                if d >= -26 and d <= 3:
                    s = d + 28
                    acc |= codes[t, s] << nb_
                    nb_ += lens[t, s]
                else:
                    acc |= codes[t, 1] << nb_
                    nb_ += lens[t, 1]
                    acc |= e << nb_
                    nb_ += ebits
                if inline_bits:
                    if nb_ >= 32:
                        words[w] = acc & 0xFFFFFFFF
                        w += 1
                        acc >>= 32
                        nb_ -= 32
                    acc |= ((rv >> (8 * rest_bytes)) & imask) << nb_
                    nb_ += inline_bits
                for k in range(rest_bytes):
                    rest[j] = (rv >> (8 * k)) & 255
                    j += 1
            if nb_ >= 32:
                words[w] = acc & 0xFFFFFFFF
                w += 1
                acc >>= 32
                nb_ -= 32
        if nb_ > 0:
            words[w] = acc & 0xFFFFFFFF
            w += 1


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
    K = num_tables(nb)
    if nb:
        lengths, assign, cost = T.choose_tables(hist, K, layout)
    else:
        lengths, assign, cost = np.zeros((0, NSYM), np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    nvalid = np.minimum(block_size, n - np.arange(nb) * block_size)
    nw = -(-cost // 32)
    raw = 4 * nw + (nvalid - nzero) * layout.rest_bytes >= nvalid * layout.itemsize
    nwords = np.where(raw, 0, nw)
    table = np.where(raw, RAW_BLOCK, assign)
    rest_len = np.where(raw, nvalid * layout.itemsize, (nvalid - nzero) * layout.rest_bytes)
    word_start = np.concatenate([[0], np.cumsum(nwords)]).astype(np.int64)
    rest_start = np.concatenate([[0], np.cumsum(rest_len)]).astype(np.int64)
    sizes = (K * TABLE_BYTES, nb * INDEX_ENTRY, int(word_start[-1]) * 4, int(rest_start[-1]))
    total = HEADER_SIZE + sum(sizes)
    buf = np.empty(total, dtype=np.uint8)
    p = HEADER_SIZE
    buf[p:p + sizes[0]] = T.pack_tables(lengths)
    p += sizes[0]
    index = buf[p:p + sizes[1]].view(np.uint16).reshape(nb, 4)
    index[:, 0] = np.where(raw, 0, ref) | (table << 8)
    index[:, 1] = nwords
    index[:, 2] = np.where(raw, 0, nzero)
    index[:, 3] = 0
    p += sizes[1]
    words = buf[p:p + sizes[2]].view(np.uint32)
    rest = buf[p + sizes[2]:]
    if nb:
        codes = np.stack([T.canonical_codes(l) for l in lengths]).astype(np.int64)
        _emit(bits, block_size, layout.mbits, layout.ebits, layout.rest_bytes, layout.inline_bits,
              layout.itemsize, ref, table, codes, lengths.astype(np.int64), word_start, rest_start, words, rest)
    crc = 0
    if checksum:
        import zlib
        crc = zlib.crc32(memoryview(buf)[HEADER_SIZE:])
    h = Header(CODEC_LOSSLESS, x.dtype, n, FLAG_CRC if checksum else 0, block_size, K, NSYM, MAXLEN, sizes, crc)
    buf[:HEADER_SIZE] = np.frombuffer(h.pack(), dtype=np.uint8)
    return torch.from_numpy(buf)


@njit(**_NOGIL)
def _decode(stream, rest, bs, n, mbits, ebits, rest_bytes, inline_bits, itemsize, ref, table, nzero,
            word_start, rest_start, luts, out):
    """Decode every block into ``out`` (integer view); returns 0 or a negative error code."""
    emax = (1 << ebits) - 1
    mask = (1 << 12) - 1
    imask = (1 << inline_bits) - 1
    nbytes = stream.shape[0]
    for b in range(ref.shape[0]):
        lo = b * bs
        hi = min(n, lo + bs)
        t = table[b]
        j = rest_start[b]
        if t == 255:
            for i in range(lo, hi):
                v = np.int64(0)
                for k in range(itemsize):
                    v |= np.int64(rest[j]) << (8 * k)
                    j += 1
                out[i] = v
            continue
        r = np.int64(ref[b])
        pos = word_start[b] * 4          # next byte to load
        end = word_start[b + 1] * 4
        acc = np.int64(0)
        have = 0
        zeros = 0
        for i in range(lo, hi):
            while have <= 48 and pos < end:
                acc |= np.int64(stream[pos]) << have
                pos += 1
                have += 8
            entry = luts[t, acc & mask]
            ln = entry >> 8
            if ln == 0 or ln > have:
                return -1
            s = entry & 255
            acc >>= ln
            have -= ln
            if s == 0:
                out[i] = 0
                zeros += 1
                continue
            if s == 1:
                if have < ebits:
                    return -1
                e = acc & emax
                acc >>= ebits
                have -= ebits
            else:
                e = r + s - 28
                if e < 0 or e > emax:
                    return -2
            rv = np.int64(0)
            for k in range(rest_bytes):
                rv |= np.int64(rest[j]) << (8 * k)
                j += 1
            if inline_bits:
                if have < inline_bits:
                    return -1
                rv |= (acc & imask) << (8 * rest_bytes)
                acc >>= inline_bits
                have -= inline_bits
            out[i] = (rv & ((1 << mbits) - 1)) | (e << mbits) | ((rv >> mbits) << (mbits + ebits))
        if zeros != nzero[b]:
            return -3
    return 0


_ERRORS = {-1: "invalid or truncated code in an exponent stream", -2: "decoded exponent out of range",
           -3: "zero count of a block does not match its index entry"}


def decode(packet: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    p = parse_lossless(packet)
    layout, h = p.layout, p.header
    buf = packet.numpy()
    stream = buf[p.stream_offset:p.rest_offset]
    rest = buf[p.rest_offset:p.rest_offset + int(p.rest_start[-1])]
    luts = T.decode_luts(p.lengths).astype(np.int64) if len(p.lengths) else np.zeros((1, 1 << MAXLEN), np.int64)
    view = _int_view(out)
    err = _decode(stream, rest, h.block_size, h.numel, layout.mbits, layout.ebits, layout.rest_bytes,
                  layout.inline_bits, layout.itemsize, p.ref, p.table, p.nzero, p.word_start, p.rest_start,
                  luts, view)
    if err:
        raise FormatError(_ERRORS[err])
    return out
