"""Triton kernels for the lossless format, byte-identical to zipccl/reference.

GPU-only in production: on CPU tensors they run only under TRITON_INTERPRET=1
(how the tests prove them here), and ``compile_for`` builds them for sm_80 /
sm_90 without a GPU. docs/GPU.md explains the design; in short:

encode, two passes over the input and one read by the host:
  1. ``_analyse``: one program per block reads it once (its sample twice) and writes the block's
     reference (coded field) and two 32-bin symbol histograms of 16-bit counts, of
     its sample and of all its elements (132 bytes per block).
  2. kernels/device_plan.py picks each block's entry of the fixed bank of codes
     (zipccl/bank.py) in one kernel (``_choose``) and lays the packet out with a
     prefix sum in another (``_place``, one program), as reference/plan.py does on
     the host; the host reads the two data section sizes, which size the packet
     (``encode_into`` leaves them on the device, and ``_place`` seals the header).
  3. ``_encode``: one program per block reads it again and writes its codes and
     rest bytes and side bits at the planned offsets. Bit positions come from an
     in-block prefix sum of code widths; each 32-bit word is the sum of its
     codes at their shifts: the difference of one running sum taken at two words'
     last elements, which store it in place for their neighbours to read after a
     barrier (the side bits of each byte alike), so there are no atomics, no
     zero-filling and no shared-memory gathers.

decode: the header is validated on the host and the block index on
the device (device_plan.index: one program that checks it, sums its offsets and
orders the blocks, coded ones first), whose verdict stays there: until it is
known good, the kernels read nothing through the index, and the host reads it
with the blocks' errors in the call's one read at the end. ``decode_into``
checks the header on the device too, in the same program (against the one that
``out`` implies), and leaves the whole verdict there, for a read later: no host
read in the call, so a CUDA graph can capture it. Raw blocks are copied by
``_decode_raw``; coded ones take two kernels, so that every scattered access is
one a lane cannot avoid:
  1. ``_decode_symbols`` runs LANES blocks per program in lock step, one symbol
     per block per iteration, and writes each element's 16-bit code where the
     lanes' stores are contiguous; it reports errors per block.
  2. ``_decode_join`` reads those codes as tiles, finds each element's
     rest bytes and side bits and writes the elements contiguously.
Measured on an H100, the fused decoder it replaced spent its time on
scattered accesses (four loads and a store per element and lane), not on the
serial chain (docs/GPU.md).
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch
import triton
import triton.language as tl

from ..bank import BANK, BANK_SIZE
from ..errors import FormatError, UnsupportedError
from ..format import (CODEC_LOSSLESS, FLAG_CRC, GPU_BLOCK_SIZE, HEADER_SIZE, LAYOUTS, MAXLEN, NSYM, RAW_BLOCK,
                      SAMPLE_STRIDE, SUBSTREAM, SYM_ESC, SYM_ZERO, Header, num_blocks, prefix_sizes, substreams)
from ..reference import tables as T
from ..reference.packet import LosslessPacket, Verdict, block_error, index_error, parse_lossless, to_device, to_host
from . import device_plan
from .constants import Constants
from .launch import launch

BLOCK_SIZE = GPU_BLOCK_SIZE  # Lossless()'s default here
_TEMPLATES = Constants(limit=256)  # (dtype, numel, block size, device) -> encode_into's header template there
JOIN_CHUNK = 32  # _decode_join's program: elements of each of a program's sub-streams
COUNT_ROWS = SUBSTREAM // JOIN_CHUNK + 1  # int32 counts per sub-stream between the two decode kernels
DECODE_SCRATCH = 1 << 27  # elements decoded per pair of launches (their 16-bit codes: 256 MiB)
# The largest block _encode takes: a program holds its block in registers, 8 elements a thread at
# 4096; at 16384 it spills 512 bytes a thread and at 32768 2.8 KB (sm_90, Triton 3.9), which
# larger blocks only make worse. Decoders take any block.
MAX_ENCODE_BLOCK = 16384

# Format constants as Triton compile-time constants (kernels may read only constexpr globals; a
# layout's numbers, the offset bias among them, come in as constexpr arguments).
_NSYM, _ESC, _ZERO, _RAW, _LUT, _STRIDE = (tl.constexpr(v) for v in (
    NSYM, SYM_ESC, SYM_ZERO, RAW_BLOCK, 1 << MAXLEN, SAMPLE_STRIDE))

_ERR_CODE, _ERR_RANGE, _ERR_ZEROS, _ERR_REST, _ERR_LENGTH = (tl.constexpr(1 << k) for k in range(5))
_SUB, _HEADER = tl.constexpr(SUBSTREAM), tl.constexpr(HEADER_SIZE)


@triton.jit
def _bits(x_ptr, offs, valid, VMASK: tl.constexpr):
    """Elements as non-negative bit patterns (int32 for 16-bit types; fp32 keeps its sign bit)."""
    return tl.load(x_ptr + offs, mask=valid, other=0).to(tl.int32) & VMASK


@triton.jit
def _symbols(v, valid, ref, MBITS: tl.constexpr, EMAX: tl.constexpr, BIAS: tl.constexpr):
    exp = (v >> MBITS) & EMAX
    d = exp - ref
    sym = tl.where((d >= 2 - BIAS) & (d <= _NSYM - 1 - BIAS), d + BIAS, _ESC)
    return exp, tl.where(v == 0, _ZERO, sym)


@triton.jit
def _analyse(x_ptr, xoff_ptr, n, ref_ptr, hist_ptr, BS: tl.constexpr, VMASK: tl.constexpr, MBITS: tl.constexpr,
             EMAX: tl.constexpr, BIAS: tl.constexpr, PARTS: tl.constexpr):
    """Per block: reference coded field (most common among the sample's non-zero elements, ties to the
    smallest), then the histograms of its symbols: the sample's (the tables' input) and the whole
    block's (its exact size). With PARTS, block ``program_id(0)`` of part ``program_id(1)``, whose
    elements start xoff_ptr[part] after x_ptr, its rows after the parts' before it."""
    if PARTS:
        part = tl.program_id(1)
        x_ptr += tl.load(xoff_ptr + part)
        ref_ptr += part * tl.num_programs(0)
        hist_ptr += part.to(tl.int64) * tl.num_programs(0) * 2 * _NSYM
    b = tl.program_id(0)
    start = b.to(tl.int64) * BS
    # The sample (every _STRIDE-th element) loaded on its own, so that its two histograms (of
    # 2**EBITS and _NSYM bins: the costly ones) count BS / _STRIDE elements, not a masked BS.
    at = start + tl.arange(0, BS // _STRIDE) * _STRIDE
    sampled = at < n
    s = _bits(x_ptr, at, sampled, VMASK)
    counts = tl.histogram((s >> MBITS) & EMAX, EMAX + 1, mask=sampled & (s != 0))
    ref = tl.argmax(counts, axis=0, tie_break_left=True).to(tl.int32)
    _, ssym = _symbols(s, sampled, ref, MBITS, EMAX, BIAS)
    offs = start + tl.arange(0, BS)
    valid = offs < n
    _, sym = _symbols(_bits(x_ptr, offs, valid, VMASK), valid, ref, MBITS, EMAX, BIAS)
    tl.store(ref_ptr + b, ref)
    bins = hist_ptr + b.to(tl.int64) * 2 * _NSYM + tl.arange(0, _NSYM)  # 16-bit counts: a block has at most 32768
    tl.store(bins, tl.histogram(ssym, _NSYM, mask=sampled).to(tl.int16))
    tl.store(bins + _NSYM, tl.histogram(sym, _NSYM, mask=valid).to(tl.int16))


@triton.jit
def _wrapped(x):
    """int64 ``x`` mod 2**32 as int32: a difference taken in 64 bits, so that no int32 operation
    overflows (the interpreter checks that they do not; the GPU wraps alike)."""
    return (x & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _encode(x_ptr, xoff_ptr, n, block_ptr, codes_ptr, lens_ptr, sub_ptr, words_ptr, rest_ptr, slot, totals_ptr,
            BS: tl.constexpr, VMASK: tl.constexpr, MBITS: tl.constexpr, EBITS: tl.constexpr,
            REST_BYTES: tl.constexpr, SIDE_BITS: tl.constexpr, BIAS: tl.constexpr, ITEMSIZE: tl.constexpr,
            PARTS: tl.constexpr):
    """One block: its sub-stream lengths (section 0, at sub_ptr: u16 bits of each SUBSTREAM
    elements' codes; a raw block's 0), its exponent stream (or raw bytes), and its rest bytes
    followed by its side bits.

    block_ptr holds (ref, table, first word, first rest byte of the rest section) per block, as
    int64, and totals_ptr the plan's stream words and rest bytes; rest_ptr is the stream's
    start, and the rest section follows the stream. Every store is clamped to the planned packet: the plan
    was made from a first pass over x, and an x changed since (by another stream) may code longer
    than planned; that gives a wrong packet, never a write outside it (a raw block's bytes do not
    depend on its values). With PARTS, block ``program_id(0)`` of part ``program_id(1)``, whose
    elements start xoff_ptr[part] after x_ptr, its rows after the parts' before it, its packet's
    stream and rest ``slot`` bytes after the part's before it."""
    if PARTS:
        part = tl.program_id(1)
        x_ptr += tl.load(xoff_ptr + part)
        block_ptr += part.to(tl.int64) * 4 * tl.num_programs(0)
        words_ptr += part.to(tl.int64) * (slot // 4)
        rest_ptr += part.to(tl.int64) * slot
        sub_ptr += part.to(tl.int64) * slot
        totals_ptr += 2 * part
    b = tl.program_id(0)
    i = tl.arange(0, BS)
    offs = b.to(tl.int64) * BS + i
    valid = offs < n
    v = _bits(x_ptr, offs, valid, VMASK)
    ref = tl.load(block_ptr + 4 * b).to(tl.int32)
    t = tl.load(block_ptr + 4 * b + 1).to(tl.int32)
    w0 = tl.load(block_ptr + 4 * b + 2)
    wlimit = tl.load(totals_ptr)
    r0 = 4 * wlimit + tl.load(block_ptr + 4 * b + 3)  # from the stream's start
    rlimit = 4 * wlimit + tl.load(totals_ptr + 1)
    SUBS: tl.constexpr = BS // _SUB
    js = tl.arange(0, SUBS)  # the block's sub-streams
    if t == _RAW:
        for k in tl.static_range(ITEMSIZE):
            tl.store(rest_ptr + r0 + i * ITEMSIZE + k, ((v >> (8 * k)) & 255).to(tl.uint8), mask=valid)
        if SUBS > 1:
            for k in tl.static_range(2):
                tl.store(sub_ptr + 2 * (b * SUBS + js) + k, (js * 0).to(tl.uint8))
    else:
        exp, sym = _symbols(v, valid, ref, MBITS, (1 << EBITS) - 1, BIAS)
        # The rest bytes first: their registers are free before the codes' words.
        rest = (v & ((1 << MBITS) - 1)) | (((v >> (MBITS + EBITS)) & 1) << MBITS)
        keep = valid & (v != 0)
        k = tl.cumsum(keep.to(tl.int32), 0) - keep.to(tl.int32)
        for j in tl.static_range(REST_BYTES):
            ra = r0 + k * REST_BYTES + j
            tl.store(rest_ptr + ra, ((rest >> (8 * j)) & 255).to(tl.uint8), mask=keep & (ra < rlimit))
        value = tl.load(codes_ptr + t * _NSYM + sym)
        width = tl.load(lens_ptr + t * _NSYM + sym)
        esc = sym == _ESC
        value = value | tl.where(esc, exp << width, 0)
        width = width + tl.where(esc, EBITS, 0)
        # Widths and positions in 32 bits: an element is at most 20 bits, a block at most 2**20 bits.
        width = tl.where(valid, width, 0)
        value = tl.where(valid, value, 0)
        if SUBS > 1:  # at most 20 * SUBSTREAM bits each: a u16
            bits = tl.sum(tl.reshape(width, (SUBS, _SUB)), 1)
            for h in tl.static_range(2):
                tl.store(sub_ptr + 2 * (b * SUBS + js) + h, ((bits >> (8 * h)) & 255).to(tl.uint8))
        end = tl.cumsum(width, 0)
        pos = end - width
        # A word is the sum of its elements' codes shifted into place (their bits do not overlap) and
        # of what the word before spilled into it (a code is at most 20 bits: only a word's last
        # element spills, into the next). So with ``run`` the running sum of every element's code
        # and spill, and A(q) = run - spill at word q's last element, word q is A(q) - A(q - 1),
        # all mod 2**32: each word's last element stores A at its word (the block's very last
        # element also A of the word its spill alone fills), and after a barrier each word is the
        # difference of two neighbours, read back from the words the program wrote.
        sh = pos & 31
        lo = value << sh                 # wraps: the bits that spill go to ``hi``
        hi = (value >> 1) >> (31 - sh)   # two shifts, so that sh == 0 never shifts by 32
        run = tl.cumsum(lo | hi, 0)      # lo | hi == lo + hi (their bits do not meet); wraps, as words do
        word = pos >> 5
        last = i == BS - 1
        nwords = (tl.sum(width, 0) + 31) >> 5  # at most 20 * BS / 32
        at = words_ptr + w0 + word
        ends = ((end >> 5) != word) | last
        tl.store(at, _wrapped(run.to(tl.int64) - hi), mask=ends & (word < nwords) & (w0 + word < wlimit))
        tl.store(at + 1, run, mask=last & (word + 1 < nwords) & (w0 + word + 1 < wlimit))
        tl.debug_barrier()  # global stores before a CTA barrier: seen by all of the program's threads
        q = tl.arange(0, BS)
        live = (q < nwords) & (w0 + q < wlimit)
        a = tl.load(words_ptr + w0 + q, mask=live, other=0)
        before = tl.load(words_ptr + w0 + q - 1, mask=live & (q > 0), other=0)
        tl.debug_barrier()  # every A read before any word replaces it
        tl.store(words_ptr + w0 + q, _wrapped(a.to(tl.int64) - before), mask=live)
        if SIDE_BITS > 0:  # fp16: the k-th kept element's side bits at bit k * SIDE_BITS after the rest bytes
            # Each byte the sum of its kept elements' side bits at their place (8 // SIDE_BITS of
            # them; none straddles two bytes): a difference of one running sum at the last of two
            # bytes' elements, as the codes' words above, mod 256.
            nonzero = tl.sum(keep.to(tl.int32), 0)
            bit = k * SIDE_BITS
            run = tl.cumsum(tl.where(keep, (rest >> (8 * REST_BYTES)) << (bit & 7), 0), 0)
            side_at = r0 + nonzero * REST_BYTES  # the side bits' first byte
            byte = bit >> 3
            ends = keep & ((((bit + SIDE_BITS) & 7) == 0) | (k == nonzero - 1))
            tl.store(rest_ptr + side_at + byte, (run & 255).to(tl.uint8), mask=ends & (side_at + byte < rlimit))
            tl.debug_barrier()
            NBYTES: tl.constexpr = BS * SIDE_BITS // 8
            qb = tl.arange(0, NBYTES)
            live = (qb < (nonzero * SIDE_BITS + 7) >> 3) & (side_at + qb < rlimit)
            a = tl.load(rest_ptr + side_at + qb, mask=live, other=0).to(tl.int32)
            before = tl.load(rest_ptr + side_at + qb - 1, mask=live & (qb > 0), other=0).to(tl.int32)
            tl.debug_barrier()
            tl.store(rest_ptr + side_at + qb, ((a - before) & 255).to(tl.uint8), mask=live)


@triton.jit
def _packet(part, span, part_words, err_stride, code_ptr, count_ptr, coded_ptr, meta_ptr, rows_ptr, err_ptr,
            BS: tl.constexpr, COUNTS: tl.constexpr):
    """The coded-block kernels' pointers for packet ``part`` of a decode_many: its codes and
    counts scratch (COUNTS int32 per block), its order, meta and rows (device_plan.index's,
    ``part_words`` apart) and its verdict's errors (``err_stride`` apart)."""
    return (code_ptr + part * span * BS, count_ptr + part * span * COUNTS, coded_ptr + part * part_words,
            meta_ptr + part * part_words, rows_ptr + part * part_words, err_ptr + part * err_stride)


@triton.jit
def _lanes(meta_ptr, coded_ptr, first, span, n, BS: tl.constexpr, LANES: tl.constexpr):
    """This program's lanes, one per sub-stream (of _SUB elements; a block of _SUB or fewer: one):
    (lane number in the program, sub-stream number in its block, is it live, its block, the
    block's elements, the sub-stream's elements). Live lanes take the coded blocks from the
    ``first``-th of the order (coded ones first) below meta_ptr's count of coded blocks, at most
    ``span`` of them."""
    SUBS: tl.constexpr = BS // _SUB
    lanes = tl.arange(0, LANES)
    sub = lanes % SUBS
    slot = tl.program_id(0) * (LANES // SUBS) + lanes // SUBS
    live = slot < tl.minimum(tl.maximum(tl.load(meta_ptr) - first, 0), span)
    b = tl.load(coded_ptr + slot, mask=live, other=0)
    nvb = tl.where(live, tl.minimum(n - b * BS, BS), 0).to(tl.int32)
    nv = tl.minimum(tl.maximum(nvb - sub * _SUB, 0), _SUB)
    return lanes, sub, live, b, nvb, nv


@triton.jit
def _in_block(x, lanes, sub, INCLUSIVE: tl.constexpr):
    """Per lane, the sum of ``x`` over the lanes of its block before it (and its own, INCLUSIVE):
    a block's lanes are neighbours in a program."""
    run = tl.cumsum(x, 0)
    before = run - x
    first = tl.gather(before, lanes - sub, 0)
    return (run if INCLUSIVE else before) - first


# not specialized on what a packet's sizes make of them (a multiple of 16 or not): one compiled
# kernel for every packet of a tensor's size, not a second compile when a received size first differs
@triton.jit(do_not_specialize=["nwords"])
def _decode_symbols(words_ptr, nwords, pkt_ptr, code_ptr, count_ptr, coded_ptr, meta_ptr, first, span, n, rows_ptr,
                    stride, lut_ptr, err_ptr, parts_ptr, part_words, err_stride, BS: tl.constexpr,
                    LANES: tl.constexpr, CHUNK: tl.constexpr, EBITS: tl.constexpr, BIAS: tl.constexpr,
                    PARTS: tl.constexpr):
    """LANES sub-streams in lock step, one symbol each per iteration: the chain a lane walks is
    at most _SUB symbols (a format-4 block's stream is sub-streams of _SUB elements, whose
    bits section 0 gives, so that each one's start is known). Each element's code (a nonzero
    flag and its coded field as decoded, in 16 bits: _decode_join checks the field's range,
    off the serial chain) goes to code_ptr laid out as [program][element of the sub-stream]
    [lane], so that the lanes' stores are contiguous; each lane's count of nonzero elements
    before every CHUNK-th element, then the block's nonzero elements before its sub-stream, to
    count_ptr ([program][chunk, then one more][lane]), so that _decode_join can make the
    elements of every chunk in parallel. A lane keeps its two current stream words in
    registers and loads the next only when its position crosses a word (one element is at
    most 20 bits): most iterations make one scattered load, the table's.

    rows_ptr holds the index's rows (device_plan._index: ref, table, _, nzero, _, stream start,
    rest start; ``stride`` apart); coded_ptr the blocks in the order, coded ones first (_lanes);
    pkt_ptr the packet (section 0 after its header). Each lane checks that its sub-stream ends
    where section 0 says, a block's last within its words; errors are OR-ed into err_ptr by
    block (int64, zeroed by device_plan._index). Every load is masked to its section, so a
    corrupt stream yields an error code, never a stray access. With PARTS, packet
    ``program_id(1)`` of a decode_many (``_packet``)."""
    EMAX: tl.constexpr = (1 << EBITS) - 1
    SUBS: tl.constexpr = BS // _SUB
    ROWS: tl.constexpr = _SUB // CHUNK + 1
    if PARTS:
        part = tl.program_id(1).to(tl.int64)
        words_ptr += tl.load(parts_ptr + 3 * part) // 4
        pkt_ptr += tl.load(parts_ptr + 3 * part)
        nwords = tl.load(parts_ptr + 3 * part + 2) // 4
        code_ptr, count_ptr, coded_ptr, meta_ptr, rows_ptr, err_ptr = _packet(
            part, span, part_words, err_stride, code_ptr, count_ptr, coded_ptr, meta_ptr, rows_ptr, err_ptr, BS,
            SUBS * ROWS)
    lanes, sub, live, b, nvb, nv = _lanes(meta_ptr, coded_ptr, first, span, n, BS, LANES)
    ref = tl.load(rows_ptr + b, mask=live, other=0).to(tl.int32)
    t = tl.load(rows_ptr + stride + b, mask=live, other=0).to(tl.int32)
    w0 = tl.load(rows_ptr + 5 * stride + b, mask=live, other=0)
    block_end = tl.load(rows_ptr + 5 * stride + b + 1, mask=live, other=0) * 32
    nzero = tl.load(rows_ptr + 3 * stride + b, mask=live, other=0).to(tl.int32)
    if SUBS > 1:  # the sub-stream's bits, a u16 of section 0, and where it starts
        at = pkt_ptr + _HEADER + 2 * (b * SUBS + sub)
        length = tl.load(at, mask=live, other=0).to(tl.int32) | (tl.load(at + 1, mask=live, other=0).to(tl.int32) << 8)
        bit0 = w0 * 32 + _in_block(length, lanes, sub, False)
    else:
        length = nv * 0
        bit0 = w0 * 32
    lut = lut_ptr + t * _LUT  # each lane's table
    base = ref - BIAS  # an offset symbol's field, less the symbol
    w = bit0 >> 5
    lo = tl.load(words_ptr + w, mask=live & (w < nwords), other=0).to(tl.uint32)
    hi = tl.load(words_ptr + w + 1, mask=live & (w + 1 < nwords), other=0).to(tl.uint32)
    bit = (bit0 & 31).to(tl.int32)  # position in lo
    err = tl.zeros([LANES], dtype=tl.int32)
    nonzero = tl.zeros([LANES], dtype=tl.int32)
    dst = code_ptr + tl.program_id(0).to(tl.int64) * (_SUB * LANES) + lanes
    counts = count_ptr + tl.program_id(0).to(tl.int64) * (ROWS * LANES) + lanes
    # Up to the longest lane's sub-stream only (a short last block, a tiny tensor): _decode_join
    # masks the chunks after a lane's by nv, so their counts are never read into anything.
    for c in range(0, tl.max(nv, 0), CHUNK):
        tl.store(counts + c // CHUNK * LANES, nonzero)
        for kk in range(CHUNK):
            k = c + kk
            act = k < nv
            sh = bit.to(tl.uint32)
            window = ((lo >> sh) | ((hi << 1) << (31 - sh))).to(tl.int32)  # 32 bits; an element is at most 20
            e = tl.load(lut + (window & (_LUT - 1)), mask=act, other=0)
            length_k = e >> 8
            s = e & 255
            esc = s == _ESC
            nz = s != _ZERO
            exp = tl.where(esc, (window >> length_k) & EMAX, base + s)  # -BIAS..EMAX+31-BIAS: _decode_join checks it
            used = length_k + tl.where(esc, EBITS, 0)
            err |= tl.where(act & (length_k == 0), _ERR_CODE, 0)
            nonzero += (act & nz).to(tl.int32)
            tl.store(dst + k * LANES, tl.where(nz, 1 | (exp << 1), 0).to(tl.int16), mask=act)
            bit += tl.where(act, used, 0)
            cross = bit >= 32
            bit = tl.where(cross, bit - 32, bit)
            w += cross.to(w.dtype)
            lo = tl.where(cross, hi, lo)
            hi = tl.where(cross, tl.load(words_ptr + w + 1, mask=cross & (w + 1 < nwords), other=0).to(tl.uint32),
                          hi)
    tl.store(counts + (ROWS - 1) * LANES, _in_block(nonzero, lanes, sub, False))
    end = w * 32 + bit
    err |= tl.where(end > block_end, _ERR_CODE, 0)
    if SUBS > 1:
        err |= tl.where(end - bit0 != length, _ERR_LENGTH, 0)
    err |= tl.where(nvb - tl.gather(_in_block(nonzero, lanes, sub, True), lanes - sub + SUBS - 1, 0) != nzero,
                    _ERR_ZEROS, 0)
    tl.atomic_or(err_ptr + b, err.to(tl.int64), mask=live & (err != 0), sem="relaxed")  # ordered by the launches


@triton.jit
def _decode_join(code_ptr, count_ptr, rest_ptr, out_ptr, n, coded_ptr, meta_ptr, first, span, rows_ptr, stride,
                 err_ptr, parts_ptr, part_words, err_stride, BS: tl.constexpr, LANES: tl.constexpr,
                 CHUNK: tl.constexpr, MBITS: tl.constexpr, EBITS: tl.constexpr, REST_BYTES: tl.constexpr,
                 SIDE_BITS: tl.constexpr, PARTS: tl.constexpr):
    """One chunk of CHUNK elements of each of one _decode_symbols program's sub-streams: the codes
    read as a [CHUNK, LANES] tile; each element's rank among its block's nonzero elements, from
    the counts before its sub-stream and its chunk and a running count within the chunk, places
    its rest bytes and its side bits (after the rest bytes of as many elements as the index
    counts nonzero); the elements stored contiguously per sub-stream; a coded field out of
    range, or rest bytes or side bits outside the block's, add their error bits to the block's.
    Arguments as _decode_symbols'; meta_ptr's third number is the rest section's offset in
    rest_ptr (the packet). With PARTS, packet ``program_id(2)`` of a decode_many (``_packet``)."""
    EMAX: tl.constexpr = (1 << EBITS) - 1
    SUBS: tl.constexpr = BS // _SUB
    ROWS: tl.constexpr = _SUB // CHUNK + 1
    if PARTS:
        part = tl.program_id(2).to(tl.int64)
        rest_ptr += tl.load(parts_ptr + 3 * part)
        out_ptr += tl.load(parts_ptr + 3 * part + 1)
        code_ptr, count_ptr, coded_ptr, meta_ptr, rows_ptr, err_ptr = _packet(
            part, span, part_words, err_stride, code_ptr, count_ptr, coded_ptr, meta_ptr, rows_ptr, err_ptr, BS,
            SUBS * ROWS)
    g = tl.program_id(0)
    c = tl.program_id(1)
    lanes, sub, live, b, nvb, nv = _lanes(meta_ptr, coded_ptr, first, span, n, BS, LANES)
    counts = count_ptr + g.to(tl.int64) * (ROWS * LANES) + lanes
    # A chunk past a lane's sub-stream has no count (_decode_symbols writes none there): read none.
    before = tl.load(counts + c * LANES, mask=c * CHUNK < nv, other=0) + \
        tl.load(counts + (ROWS - 1) * LANES, mask=live, other=0)
    section = tl.load(meta_ptr + 2)
    r0 = section + tl.load(rows_ptr + 6 * stride + b, mask=live, other=0)
    rest_end = section + tl.load(rows_ptr + 6 * stride + b + 1, mask=live, other=0)
    side0 = r0 + (nvb - tl.load(rows_ptr + 3 * stride + b, mask=live, other=0)) * REST_BYTES
    k = c * CHUNK + tl.arange(0, CHUNK)
    codes = tl.load(code_ptr + (g.to(tl.int64) * _SUB + k[:, None]) * LANES + lanes[None, :]).to(tl.int32)
    act = k[:, None] < nv[None, :]
    nz = act & ((codes & 1) != 0)
    count = nz.to(tl.int32)
    rank = before[None, :] + tl.cumsum(count, axis=0) - count
    rp = r0[None, :] + (rank * REST_BYTES).to(r0.dtype)
    take = nz & (rp + REST_BYTES <= side0[None, :])  # reads stay in the section: rest bytes before the side bits
    r = tl.zeros([CHUNK, LANES], dtype=tl.int32)
    if SIDE_BITS > 0:  # fp16: at bit rank * SIDE_BITS after the rest bytes, in a byte before the section's end
        at = rank * SIDE_BITS
        sp = side0[None, :] + (at >> 3)
        take &= sp < rest_end[None, :]
        side = tl.load(rest_ptr + sp, mask=take, other=0).to(tl.int32)
        r = ((side >> (at & 7)) & ((1 << SIDE_BITS) - 1)) << (8 * REST_BYTES)
    for j in tl.static_range(REST_BYTES):
        r |= tl.load(rest_ptr + rp + j, mask=take, other=0).to(tl.int32) << (8 * j)
    exp = codes >> 1  # as _decode_symbols found it: out of range in a corrupt stream
    val = (r & ((1 << MBITS) - 1)) | ((exp & EMAX) << MBITS) | ((r >> MBITS) << (MBITS + EBITS))  # fp32: wraps
    at_out = (b * BS + sub * _SUB)[None, :] + k[:, None]
    tl.store(out_ptr + at_out, tl.where(nz, val, 0).to(out_ptr.dtype.element_ty), mask=act)
    rest_bad = tl.max((nz & ~take).to(tl.int32), axis=0) != 0
    range_bad = tl.max((nz & ((exp < 0) | (exp > EMAX))).to(tl.int32), axis=0) != 0
    bad = tl.where(rest_bad, _ERR_REST, 0) | tl.where(range_bad, _ERR_RANGE, 0)
    tl.atomic_or(err_ptr + b, bad.to(tl.int64), mask=live & (bad != 0), sem="relaxed")


@triton.jit
def _decode_raw(rest_ptr, out_ptr, n, order_ptr, meta_ptr, rows_ptr, stride, err_ptr, parts_ptr, part_words, err_stride,
                BS: tl.constexpr, ITEMSIZE: tl.constexpr, PARTS: tl.constexpr):
    """One block of ``order`` (coded blocks first): if it is raw (at or after meta_ptr's second
    number), its elements' bytes, little-endian, from the rest section (meta_ptr's third), and
    its sub-stream lengths in section 0 checked to be 0. With PARTS, packet ``program_id(1)`` of
    a decode_many (parts_ptr's row: device_plan._index)."""
    SUBS: tl.constexpr = BS // _SUB
    if PARTS:
        part = tl.program_id(1).to(tl.int64)
        rest_ptr += tl.load(parts_ptr + 3 * part)
        out_ptr += tl.load(parts_ptr + 3 * part + 1)
        order_ptr += part * part_words
        meta_ptr += part * part_words
        rows_ptr += part * part_words
        err_ptr += part * err_stride
    j = tl.program_id(0)
    if j >= tl.load(meta_ptr + 1):  # raw blocks follow the coded ones (a coded block's program does nothing)
        b = tl.load(order_ptr + j)
        i = tl.arange(0, BS)
        valid = b * BS + i < n
        r0 = tl.load(meta_ptr + 2) + tl.load(rows_ptr + 6 * stride + b)
        v = tl.zeros([BS], dtype=tl.int64)
        for k in tl.static_range(ITEMSIZE):
            v |= tl.load(rest_ptr + r0 + i * ITEMSIZE + k, mask=valid, other=0).to(tl.int64) << (8 * k)
        tl.store(out_ptr + b * BS + i, v.to(out_ptr.dtype.element_ty), mask=valid)
        if SUBS > 1:
            lengths = tl.load(rest_ptr + _HEADER + 2 * SUBS * b + tl.arange(0, 2 * SUBS))
            bad = tl.max(lengths.to(tl.int32), 0) != 0
            tl.atomic_or(err_ptr + b, tl.where(bad, _ERR_LENGTH, 0).to(tl.int64), mask=bad, sem="relaxed")


def block_warps(block_size: int) -> int:
    """Warps of the per-block kernels: at most 8 elements per thread, 4 to 16 warps (a 4096-element
    block in 8 warps needed 247 registers in _encode; in 16, 107-128)."""
    return max(4, min(16, block_size // 256))


_LUTS = Constants()  # (dtype, device) -> the bank's decode lookups there, built and uploaded once


def _luts(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(BANK_SIZE, 2**MAXLEN) int32 lookups of the bank's entries on ``device``."""
    return _LUTS.get((dtype, device), device, lambda: to_device(T.decode_luts(BANK[dtype]), device))


def _ints(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.element_size() == 4 else torch.int16)


def _shape_args(layout) -> dict:
    return dict(VMASK=-1 if layout.itemsize == 4 else 0xFFFF, MBITS=layout.mbits)


def _plan(x: torch.Tensor, block_size: int, read: bool, index: torch.Tensor | None = None,
          seal: tuple[torch.Tensor, torch.Tensor] | None = None, parts: torch.Tensor | None = None, n: int = 0,
          slot: int = 0) -> device_plan.DevicePlan:
    """The blocks' histograms (``_analyse``) and the plan from them (device_plan.plan: its index
    entries into ``index`` where given, its header sealed into ``seal``'s where given), on the
    device, in one allocation and three launches; ``read``: the host reads the packet's size.
    ``parts``: the element offsets in ``x`` of that many tensors of ``n`` elements (their packets
    ``slot`` bytes apart), else x is the one tensor."""
    if block_size > MAX_ENCODE_BLOCK:
        raise UnsupportedError(f"the Triton encoder takes blocks of at most {MAX_ENCODE_BLOCK} elements (beyond, its "
                               f"registers spill ever more), not {block_size}; every decoder reads such packets")
    layout = LAYOUTS[x.dtype]
    n, dev = (x.numel(), x.device) if parts is None else (n, x.device)
    nb, count = num_blocks(n, block_size), 1 if parts is None else parts.numel()
    work = device_plan.scratch(nb, dev, count)
    if nb:  # every block's reference and histograms written: no zero-filling
        launch(_analyse, (nb, count), _ints(x), x if parts is None else parts, n, work.ref, work.hist,
               BS=block_size, EMAX=layout.emax, BIAS=layout.offset_bias, num_warps=block_warps(block_size),
               PARTS=parts is not None, **_shape_args(layout))
    return device_plan.plan(work.hist[:, 0], work.hist[:, 1], work.ref, n, block_size, x.dtype, read, work=work,
                            index=index, seal=seal, parts=count, slot=slot)


def _write(x: torch.Tensor, block_size: int, pl: device_plan.DevicePlan, body: torch.Tensor, prefix: int, words: int,
           parts: torch.Tensor | None = None, n: int = 0, slot: int = 0) -> None:
    """Sections 0, 2 and 3 into ``body`` (the packet after its header; sections 0 and 1 take its
    first ``prefix`` bytes): the sub-stream lengths, ``_encode``'s stream in the ``words`` 32-bit
    words after the index and the rest bytes after the stream, at the plan's offsets (pl.blocks'
    rest column counts from the stream's end); nothing past the planned sizes. ``parts``, ``n``,
    ``slot``: as ``_plan``'s (``body`` the first packet's)."""
    layout = LAYOUTS[x.dtype]
    n = x.numel() if parts is None else n
    nb, count = num_blocks(n, block_size), 1 if parts is None else parts.numel()
    stream = body[prefix:]
    if nb:
        launch(_encode, (nb, count), _ints(x), x if parts is None else parts, n, pl.blocks, pl.codes, pl.lengths,
               body, stream[:4 * words].view(torch.int32), stream, slot, pl.totals, BS=block_size,
               EBITS=layout.ebits, REST_BYTES=layout.rest_bytes, SIDE_BITS=layout.side_bits,
               BIAS=layout.offset_bias, ITEMSIZE=layout.itemsize, num_warps=block_warps(block_size),
               PARTS=parts is not None, **_shape_args(layout))


def on_its_device(fn):
    """Run ``fn`` with the current CUDA device set to that of its first argument (a tensor, or a
    list of them): Triton launches on the current device, while the codec allocates on the
    tensor's, so a tensor on another GPU than the current one would be coded there, through
    pointers of another device and out of order with its own stream. A no-op on the current
    device and on CPU tensors."""
    @functools.wraps(fn)
    def run(first, *args, **kwargs):
        t = first[0] if isinstance(first, (list, tuple)) else first
        if t.is_cuda and t.device.index != torch.cuda.current_device():
            with torch.cuda.device(t.device):
                return fn(first, *args, **kwargs)
        return fn(first, *args, **kwargs)
    return run


#: The block index read on the packet's device (Lossless.decode's parse, before ``decode``).
read_index = on_its_device(device_plan.read_index)


@on_its_device
def encode(x: torch.Tensor, block_size: int, checksum: bool) -> torch.Tensor:
    n, dev = x.numel(), x.device
    # The plan on the device (kernels/device_plan.py): the host reads only the two data section
    # sizes, which size the packet.
    pl = _plan(x, block_size, read=True)
    packet = torch.empty(HEADER_SIZE + sum(pl.sizes), dtype=torch.uint8, device=dev)
    s0, s1 = pl.sizes[:2]
    packet[HEADER_SIZE + s0:HEADER_SIZE + s0 + s1] = pl.index
    _write(x, block_size, pl, packet[HEADER_SIZE:], s0 + s1, pl.sizes[2] // 4)
    crc = 0
    if checksum:  # a host pass over the payload, as on every device
        crc = zlib.crc32(to_host(packet[HEADER_SIZE:]).tobytes())
    h = Header(CODEC_LOSSLESS, x.dtype, n, FLAG_CRC if checksum else 0, block_size, BANK_SIZE, NSYM, MAXLEN,
               pl.sizes, crc)
    packet[:HEADER_SIZE] = to_device(h.pack(), dev)
    return packet


def _template(dtype: torch.dtype, n: int, block_size: int, device: torch.device) -> torch.Tensor:
    """The header of encode_into's packets of ``n`` elements, data sizes and CRC zero, kept on the
    device (decode_into compares packets with it there): a graph that captures either reads it
    from there at every replay (a copy from host memory would replay from wherever that memory
    went). The last 256 are kept, and for good any that a graph capture used (kernels.constants)."""
    def make():
        h = Header(CODEC_LOSSLESS, dtype, n, 0, block_size, BANK_SIZE, NSYM, MAXLEN,
                   (*prefix_sizes(n, block_size), 0, 0), 0)
        return to_device(h.pack(), device)
    return _TEMPLATES.get((dtype, n, block_size, device), device, make)


@on_its_device
def encode_into(x: torch.Tensor, out: torch.Tensor, block_size: int) -> torch.Tensor:
    """The packet of ``encode`` (without checksum) written to the front of ``out`` (uint8 on x's
    device, at least the codec's bound), its size returned as an int64 tensor there: the host
    reads nothing, so a pipeline can read sizes in batches, and a CUDA graph can capture the call.
    One allocation and four launches: ``_analyse``, ``_choose`` (the index entries straight into
    ``out``), ``_place`` (the offsets, and the header sealed from the template with its sizes
    and CRC) and ``_encode``."""
    return _encode_packets(x, None, x.numel(), out, 0, block_size)[0]


@on_its_device
def encode_many(parts: list[torch.Tensor], out: torch.Tensor, slot: int, block_size: int) -> torch.Tensor:
    """``encode_into`` of each of ``parts`` (1-D, one dtype, numel and storage), packet k at
    ``out[k * slot:]``, in one launch sequence: their sizes as an int64 tensor on the device.
    Two more device operations than one encode_into (the parts' offsets uploaded, and their
    sizes), however many parts."""
    x, offsets = _covering(parts)
    return _encode_packets(x, to_device(np.array(offsets, np.int64), out.device), parts[0].numel(), out, slot,
                           block_size)


def _covering(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """A 1-D view of ``tensors``' storage (one dtype) from the lowest of them to the end of the
    highest, and each one's offset in it, in elements: what the batched kernels address."""
    base = min(tensors, key=lambda t: t.data_ptr())
    offsets = [(t.data_ptr() - base.data_ptr()) // t.element_size() for t in tensors]
    end = max(o + t.numel() for o, t in zip(offsets, tensors))
    return base.as_strided((end,), (1,), base.storage_offset()), offsets


def _encode_packets(x: torch.Tensor, parts: torch.Tensor | None, n: int, out: torch.Tensor, slot: int,
                    block_size: int) -> torch.Tensor:
    """encode_into (``parts`` None: x is the tensor) or encode_many (``parts``: element offsets in
    x): the packets' sizes, a view of the call's Scratch."""
    nb = num_blocks(n, block_size)
    s0, s1 = prefix_sizes(n, block_size)
    room = (slot or out.numel()) - HEADER_SIZE - s0 - s1
    index = out[HEADER_SIZE + s0:HEADER_SIZE + s0 + s1].view(torch.int16).view(nb, 4)
    pl = _plan(x, block_size, read=False, index=index, seal=(_template(x.dtype, n, block_size, out.device), out),
               parts=parts, n=n, slot=slot)
    _write(x, block_size, pl, out[HEADER_SIZE:], s0 + s1, room // 4, parts=parts, n=n, slot=slot)
    return pl.size


@on_its_device
def decode(packet: torch.Tensor, out: torch.Tensor, header: Header | LosslessPacket | None = None) -> torch.Tensor:
    # The header is validated on the host before any launch; the block index on the device, once
    # (read_index: device_plan.index), its verdict read with the blocks' errors at the end (_raise_first).
    p = parse_lossless(packet, header, read_index)
    h = p.header
    if h.numel == 0:
        _raise_first(p, None)
        return out
    ix = p.device_index
    if ix is None:  # parsed on the host
        ix = device_plan.index(packet, HEADER_SIZE + h.sections[0], p.table.numel(), h.numel, h.block_size,
                               h.ntables, p.layout, sizes=h.sections[2:])
    _decode_blocks(packet[p.stream_offset:p.rest_offset], packet, ix, out, h.numel, h.block_size)
    _raise_first(p, ix.verdict[1 + HEADER_SIZE:])
    return out


@on_its_device
def decode_into(packet: torch.Tensor, out: torch.Tensor, block_size: int) -> Verdict:
    """Decode into ``out`` (its numel and dtype are what the packet must hold, in blocks of
    ``block_size``) without the host reading anything: the header is checked on the device
    against the one such a packet has, the index there too (device_plan.index), and no kernel
    reads through either until both are known good; the blocks' errors stay there. The returned
    Verdict says later, in one read, whether the packet was good (FormatError as ``decode``
    raises it). A pipeline can so read many packets' verdicts at once, and a CUDA graph can
    capture the call. Packets with a payload CRC are refused (checking it reads the host).
    Two allocations (the verdict; the index's rows with the decoders' scratch) and four launches
    (``_index``, ``_decode_raw``, ``_decode_symbols``, ``_decode_join``), up to DECODE_SCRATCH
    elements; two more launches per DECODE_SCRATCH elements beyond."""
    short = _short(packet.numel(), out, block_size)
    return short or _decode_packets(packet, None, [packet.numel()], out, out.numel(), block_size)[0]


@on_its_device
def decode_many(packets: list[torch.Tensor], outs: list[torch.Tensor], block_size: int) -> list[Verdict]:
    """``decode_into`` of each packet into its out (packets: 1-D uint8 of one storage, at 4-byte
    aligned offsets; outs: of one dtype, numel and storage), in one launch sequence: their
    Verdicts. The operations of one decode_into and the upload of the packets' places; the
    decoders' scratch is as many times one's as there are packets."""
    n = outs[0].numel()
    if any(_short(p.numel(), outs[0], block_size) for p in packets):  # each known short on the host
        return [decode_into(p, o, block_size) for p, o in zip(packets, outs)]
    stream_offset = HEADER_SIZE + sum(prefix_sizes(n, block_size))
    (pbuf, poffs), (obuf, ooffs) = _covering(packets), _covering(outs)
    table = np.array([[p, o, q.numel() - stream_offset] for p, o, q in zip(poffs, ooffs, packets)], np.int64)
    return _decode_packets(pbuf, to_device(table, pbuf.device), [p.numel() for p in packets], obuf, n, block_size)


def _short(size: int, out: torch.Tensor, block_size: int) -> Verdict | None:
    """The Verdict of a packet of ``size`` bytes too short for the header and index that ``out``
    implies, known to the host: no read, nothing to decode; else None."""
    n = out.numel()
    stream_offset = HEADER_SIZE + sum(prefix_sizes(n, block_size))
    if size >= stream_offset:
        return None
    return Verdict(None, size, n, out.dtype, block_size,
                   known=f"packet of {size} bytes is shorter than the header, sub-stream lengths and index of {n} "
                         f"elements in blocks of "
                         f"{block_size} ({stream_offset} bytes)")


def _decode_packets(packet: torch.Tensor, parts: torch.Tensor | None, sizes: list[int], out: torch.Tensor, n: int,
                    block_size: int) -> list[Verdict]:
    """decode_into (``parts`` None: the packet and out are the tensors) or decode_many (``parts``:
    each packet's row of 3 in ``packet`` and ``out``, as device_plan._index reads it): the
    Verdicts, views of one tensor."""
    layout, dev, count = LAYOUTS[out.dtype], packet.device, len(sizes)
    nb = num_blocks(n, block_size)
    s0, s1 = prefix_sizes(n, block_size)
    stream_offset = HEADER_SIZE + s0 + s1
    words, scratch = count * device_plan.index_words(nb), count * _scratch_words(nb, block_size)
    work = torch.empty(words + scratch, dtype=torch.int64, device=dev)
    ix = device_plan.index(packet, HEADER_SIZE + s0, nb, n, block_size, BANK_SIZE, layout,
                           template=_template(out.dtype, n, block_size, dev), work=work[:words], parts=parts,
                           count=count)
    if n:
        stream_words = (packet.numel() - stream_offset) // 4  # a bound for the loads; the index keeps each block to its own
        _decode_blocks(packet[stream_offset:stream_offset + 4 * stream_words], packet, ix, out, n, block_size,
                       work[words:], parts, count)
    v = device_plan.VERDICT_ERRORS + nb
    return [Verdict(ix.verdict[k * v:(k + 1) * v], sizes[k], n, out.dtype, block_size) for k in range(count)]


def lanes(bs: int) -> tuple[int, int]:
    """(sub-streams, blocks) that one _decode_symbols program decodes: 32 sub-streams (a warp),
    or a whole block's where it has more; so a program holds whole blocks. Each lane walks a
    sub-stream, at most SUBSTREAM symbols."""
    subs = max(1, substreams(bs))
    width = max(32, subs)
    return width, width // subs


def join_warps(width: int) -> int:
    """Warps of a _decode_join program over ``width`` lanes: 16 elements of its tile or fewer a
    thread (at 128 lanes in 4 warps, Triton 3.6 spilled 224 bytes a thread; 3.9 did not)."""
    return max(4, width * JOIN_CHUNK // 512)


def _span(nb: int, bs: int) -> int:
    """Coded blocks per pair of decode launches: their codes between the two kernels take 2 bytes
    per element, at most DECODE_SCRATCH elements' worth at a time, so that a large packet does
    not need a second output's memory. A multiple of a program's blocks."""
    per = lanes(bs)[1]
    return min(per * max(1, DECODE_SCRATCH // (bs * per)), num_blocks(nb, per) * per)


def _scratch_words(nb: int, bs: int) -> int:
    """int64 words of _decode_blocks' scratch for one packet: the 16-bit codes of a span's
    elements and their counts (COUNT_ROWS int32 per sub-stream)."""
    span = _span(nb, bs)
    return span * bs // 4 + (span * max(1, substreams(bs)) * COUNT_ROWS + 1) // 2 + 2


def _decode_blocks(stream: torch.Tensor, packet: torch.Tensor, ix: device_plan.Index, out: torch.Tensor, n: int,
                   bs: int, scratch: torch.Tensor | None = None, parts: torch.Tensor | None = None,
                   count: int = 1) -> None:
    """The kernels of a decode: ``stream`` (the exponent streams, read up to its end), the packet
    (its sub-stream lengths, and its rest section where ix.meta says), the index read on the
    device (``ix``: nothing is read through it unless it held), ``n`` elements into ``out`` and
    ``scratch`` (int64, count x _scratch_words; allocated where not given). The blocks' errors go
    to ix.verdict. ``parts``, ``count``: decode_many's packets (device_plan.index's), the first's
    being those given."""
    layout = LAYOUTS[out.dtype]
    view = _ints(out)
    nb, stride = ix.order.numel(), ix.rows.shape[1]
    table = packet if parts is None else parts
    part_words, err_stride = device_plan.index_words(nb), device_plan.VERDICT_ERRORS + nb
    many = dict(PARTS=parts is not None)
    err = ix.verdict[device_plan.VERDICT_ERRORS:]
    launch(_decode_raw, (nb, count), packet, view, n, ix.order, ix.meta, ix.rows, stride, err, table, part_words,
           err_stride, BS=bs, ITEMSIZE=layout.itemsize, num_warps=block_warps(bs), **many)
    nwords = stream.numel() // 4
    words = stream.view(torch.int32) if stream.data_ptr() % 4 == 0 else stream.clone().view(torch.int32)
    luts = _luts(out.dtype, packet.device)
    span, (width, per) = _span(nb, bs), lanes(bs)
    if scratch is None:
        scratch = torch.empty(count * _scratch_words(nb, bs), dtype=torch.int64, device=packet.device)
    codes = count * span * bs
    symbols = scratch[:codes // 4].view(torch.int16)
    counts = scratch[codes // 4:].view(torch.int32)[:count * span * max(1, substreams(bs)) * COUNT_ROWS]
    for first in range(0, nb, span):
        coded = ix.order[first:first + span]
        programs = num_blocks(len(coded), per)
        launch(_decode_symbols, (programs, count),
               words, nwords, packet, symbols, counts, coded, ix.meta, first, span, n, ix.rows, stride, luts, err,
               table, part_words, err_stride, BS=bs, LANES=width, CHUNK=JOIN_CHUNK, EBITS=layout.ebits,
               BIAS=layout.offset_bias, num_warps=width // 32, **many)
        launch(_decode_join, (programs, SUBSTREAM // JOIN_CHUNK, count),
               symbols, counts, packet, view, n, coded, ix.meta, first, span, ix.rows, stride, err, table, part_words,
               err_stride, BS=bs, LANES=width, CHUNK=JOIN_CHUNK, MBITS=layout.mbits, EBITS=layout.ebits,
               REST_BYTES=layout.rest_bytes, SIDE_BITS=layout.side_bits, num_warps=join_warps(width), **many)


def _raise_first(p: LosslessPacket, values: torch.Tensor | None) -> None:
    """The call's one read at the end: the index's check and the blocks' errors (``values``, as
    a verdict holds them from the check on), else the check parse_lossless left on the device;
    FormatError for the first problem, the index's before the blocks'."""
    if values is None:
        values = p.index_check
    if values is None:
        return
    values = to_host(values)
    if problem := index_error(values[:3], p.header):
        raise FormatError(problem)
    if problem := block_error(values[3:]):
        raise FormatError(problem)
