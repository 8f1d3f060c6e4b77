"""The GPU codec's per-block bookkeeping, computed on the device.

Encode (``plan``): reference/plan.py's choice of each block's bank entry (the one that codes
its sample in the fewest bits) and its layout (raw blocks, offsets, the block index), with the
same integer arithmetic and tie-breaking, so the bytes are the host plan's
(tests/test_device_plan.py). One Triton kernel (``_choose``) decides every block from its
histograms; one more (``_place``, a single program) places them with a prefix sum and, for
encode_into, seals the packet's header. The host reads only the packet's two data section
sizes, which size the packet: one read (none for encode_into). Everything a call needs on the
device besides the caller's tensors comes from one allocation (``Scratch``).

Costs are products of counts (at most 32768) and bit widths (at most 31) summed over 32
symbols, below 2^25: exact in int32, and still so times BANK_SIZE with the entry's id added,
which makes every compared key unique, so ties go to the lowest id.

Decode (``index``, and ``read_index`` on it): reference/packet.py's checks of the block index
and its prefix sums, where the packet is, in one program (``_index``), with the order of the
blocks and the counts that the decoders mask by; decode_into's header check too. Three numbers
(the first invalid entry, the stream and rest totals) stay there for the decoder to check with
its one read at the end, instead of 8 bytes per block crossing to the host.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from ..bank import BANK, BANK_SIZE
from ..format import (HEADER_SIZE, INDEX_ENTRY, LAYOUTS, NSYM, RAW_BLOCK, SYM_ZERO, FloatLayout, num_blocks,
                      prefix_sizes)
from ..reference import tables as T
from ..reference.packet import to_device, to_host
from ..reference.plan import _encoder_codes
from .constants import Constants
from .launch import launch

__all__ = ["DevicePlan", "Index", "Scratch", "VERDICT_ERRORS", "bank", "index", "plan", "read_index", "scratch"]

_BANKS = Constants()  # (dtype, device) -> the bank's tensors there, uploaded once


def bank(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bank of ``dtype`` on ``device``: code lengths, canonical codes and each symbol's bits
    (code plus an escape's raw field after it), all (BANK_SIZE, NSYM) int32; uploaded once per device,
    asynchronously (kernels.constants)."""
    def make():
        lengths = BANK[dtype]
        return tuple(to_device(a, device) for a in (
            lengths.astype(np.int32), _encoder_codes(dtype).astype(np.int32),
            (lengths + T.extra_bits(LAYOUTS[dtype])).astype(np.int32)))
    return _BANKS.get((dtype, device), device, make)


TILE = 4  # blocks per program of _choose: its cost products are TILE x BANK_SIZE x NSYM int32 values


@triton.jit
def _choose(sampled_ptr, exact_ptr, stride, ref_ptr, bits_ptr, index_ptr, index_stride, block_ptr, lens_ptr, nb,
            numel, BS: tl.constexpr, NSYM: tl.constexpr, NBANK: tl.constexpr, ZERO: tl.constexpr, RAW: tl.constexpr,
            REST_BYTES: tl.constexpr, SIDE_BITS: tl.constexpr, ITEMSIZE: tl.constexpr, TILE: tl.constexpr):
    """TILE blocks of part ``program_id(1)`` (nb blocks each; its rows follow the parts before
    it, its index entries ``index_stride`` u16 after theirs): each one's bank entry (the fewest
    bits for its sample, ties to the lowest), its exact coded size from its whole histogram, or
    raw where coding would not make it smaller; writes its index entry (u16 ref | entry << 8,
    words, zeros, 0), its row's ref and entry, and its stream words and rest bytes in the two
    rows of lens (nb long: ``_place``'s prefix sum gives the starts). Histogram rows are
    ``stride`` counts apart, read as u16."""
    part = tl.program_id(1).to(tl.int64)
    sampled_ptr += part * nb * stride
    exact_ptr += part * nb * stride
    ref_ptr += part * nb
    index_ptr += part * index_stride
    block_ptr += part * 4 * nb
    lens_ptr += part * 2 * nb
    blk = tl.program_id(0) * TILE + tl.arange(0, TILE)
    live = blk < nb
    syms = tl.arange(0, NSYM)
    ids = tl.arange(0, NBANK)
    bits = tl.load(bits_ptr + ids[:, None] * NSYM + syms[None, :])
    rows = blk.to(tl.int64)[:, None] * stride + syms[None, :]
    sampled = tl.load(sampled_ptr + rows, mask=live[:, None], other=0).to(tl.int32) & 0xFFFF
    exact = tl.load(exact_ptr + rows, mask=live[:, None], other=0).to(tl.int32) & 0xFFFF
    cost = tl.sum(sampled[:, None, :] * bits[None, :, :], axis=2)
    entry = tl.min(cost * NBANK + ids[None, :], axis=1) % NBANK
    mine = tl.where(ids[:, None] == entry[None, :], 1, 0)  # (NBANK, TILE): the chosen entry's row
    chosen = tl.sum(mine[:, :, None] * bits[:, None, :], axis=0)  # (TILE, NSYM)
    coded = tl.sum(exact * chosen, axis=1).to(tl.int64)
    nzero = tl.sum(tl.where(syms[None, :] == ZERO, exact, 0), axis=1).to(tl.int64)
    nvalid = tl.minimum(numel - blk.to(tl.int64) * BS, BS)
    nwords = (coded + 31) // 32
    rest = (nvalid - nzero) * REST_BYTES + ((nvalid - nzero) * SIDE_BITS + 7) // 8  # FloatLayout.rest_len
    raw = 4 * nwords + rest >= nvalid * ITEMSIZE
    ref = tl.where(raw, 0, tl.load(ref_ptr + blk, mask=live, other=0).to(tl.int64))
    table = tl.where(raw, RAW, entry.to(tl.int64))
    nwords = tl.where(raw, 0, nwords)
    nzero = tl.where(raw, 0, nzero)
    rest = tl.where(raw, nvalid * ITEMSIZE, rest)
    out = index_ptr + 4 * blk
    tl.store(out, (ref | (table << 8)).to(tl.int16), mask=live)
    tl.store(out + 1, nwords.to(tl.int16), mask=live)
    tl.store(out + 2, nzero.to(tl.int16), mask=live)
    tl.store(out + 3, (nzero * 0).to(tl.int16), mask=live)
    row = block_ptr + 4 * blk
    tl.store(row, ref, mask=live)
    tl.store(row + 1, table, mask=live)
    tl.store(lens_ptr + blk, nwords, mask=live)
    tl.store(lens_ptr + nb + blk, rest, mask=live)


@triton.jit
def _crc32_byte(crc, b):
    """zlib's CRC-32 register after one more byte ``b`` (bitwise, reflected polynomial)."""
    crc = crc ^ b
    for _ in range(8):
        crc = (crc >> 1) ^ (0xEDB88320 * (crc & 1))
    return crc


@triton.jit
def _place(lens_ptr, block_ptr, totals_ptr, nb, tmpl_ptr, hdr_ptr, hdr_stride, size_ptr, prefix, SCAN: tl.constexpr,
           SEAL: tl.constexpr):
    """One program per part (its rows after the parts' before it): each block's first stream
    word and rest byte (columns 2 and 3 of block_ptr's rows of 4), an exclusive prefix sum of
    lens_ptr's two rows of nb (stream words, rest bytes), SCAN blocks a step, and the two
    totals. With SEAL (encode_into), the header too: the template's bytes with the data sizes
    (u64 at 32 and 40) from the totals and the CRC-32 of the first 52 bytes (zlib's) at 52, into
    hdr_ptr (the part's packet ``hdr_stride`` bytes after the one before); the packet's size
    into size_ptr (``prefix``: the bytes of sections 0 and 1)."""
    part = tl.program_id(0).to(tl.int64)
    lens_ptr += part * 2 * nb
    block_ptr += part * 4 * nb
    totals_ptr += part * 2
    hdr_ptr += part * hdr_stride
    size_ptr += part
    words = part * 0
    rest = words
    for first in range(0, nb, SCAN):
        b = first + tl.arange(0, SCAN)
        live = b < nb
        w = tl.load(lens_ptr + b, mask=live, other=0)
        r = tl.load(lens_ptr + nb + b, mask=live, other=0)
        tl.store(block_ptr + 4 * b + 2, words + tl.cumsum(w, 0) - w, mask=live)
        tl.store(block_ptr + 4 * b + 3, rest + tl.cumsum(r, 0) - r, mask=live)
        words += tl.sum(w, 0)
        rest += tl.sum(r, 0)
    tl.store(totals_ptr, words)
    tl.store(totals_ptr + 1, rest)
    if SEAL:
        crc = words * 0 + 0xFFFFFFFF
        for i in range(52):
            size = tl.where(i < 40, words * 4, rest)
            byte = tl.load(tmpl_ptr + i).to(tl.int64) | tl.where((i >= 32) & (i < 48), (size >> (8 * (i % 8))) & 0xFF, 0)
            tl.store(hdr_ptr + i, byte.to(tl.uint8))
            crc = _crc32_byte(crc, byte)
        crc = crc ^ 0xFFFFFFFF
        for j in range(4):
            tl.store(hdr_ptr + 52 + j, ((crc >> (8 * j)) & 0xFF).to(tl.uint8))
        tl.store(size_ptr, 56 + prefix + 4 * words + rest)


SCAN = 1024  # blocks per step of _place's and _index's prefix sums
INDEX_WARPS = 8  # _index's: 4 entries a thread (in 4 warps it needed 255 registers on sm_80)


class Scratch(NamedTuple):
    """The device memory of one encode besides the caller's tensors: views of one allocation
    (about 190 bytes per block, 9% of a bf16 input in blocks of 1024), which lives as long as
    encode_into's returned size, a view of it."""
    ref: torch.Tensor      # (nb,) int32 reference fields (_analyse)
    hist: torch.Tensor     # (nb, 2, NSYM) int16 sampled and whole histograms (_analyse), read as u16
    entries: torch.Tensor  # (nb, 4) int16 index entries, where the caller gives no place in the packet
    blocks: torch.Tensor   # (nb, 4) int64 ref, entry, first stream word, first rest byte
    lens: torch.Tensor     # (parts, 2, nb) int64 stream words and rest bytes per block
    totals: torch.Tensor   # (parts, 2) int64 stream words and rest bytes in all
    size: torch.Tensor     # (parts,) int64 the packets' bytes (encode_into)


def scratch(nb: int, device: torch.device, parts: int = 1) -> Scratch:
    """One allocation (the caching allocator's: no device operation) carved into a Scratch for
    ``parts`` tensors of nb blocks each, the parts' rows one after the other."""
    total, views = _carving(nb, parts)
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    return Scratch(*(buf[at:at + nbytes].view(dtype).view(shape) for at, nbytes, dtype, shape in views))


@functools.lru_cache(maxsize=256)
def _carving(nb: int, parts: int) -> tuple[int, tuple]:
    """A Scratch's bytes in all and each view's (offset, bytes, dtype, shape), 8-byte aligned:
    computed once per shape (a small call's host time is mostly bookkeeping)."""
    m = parts * nb
    shapes = [((m,), torch.int32), ((m, 2, NSYM), torch.int16), ((m, 4), torch.int16), ((m, 4), torch.int64),
              ((parts, 2, nb), torch.int64), ((parts, 2), torch.int64), ((parts,), torch.int64)]
    views, at = [], 0
    for shape, dtype in shapes:
        nbytes = math.prod(shape) * dtype.itemsize
        views.append((at, nbytes, dtype, shape))
        at += -(-nbytes // 8) * 8
    return at, tuple(views)


@dataclass
class DevicePlan:
    lengths: torch.Tensor      # (BANK_SIZE, NSYM) int32 code lengths, on the device
    codes: torch.Tensor        # (BANK_SIZE, NSYM) int32 canonical codes, LSB first
    index: torch.Tensor        # section 1 (uint8, on the device)
    blocks: torch.Tensor       # (nblocks, 4) int64 ref, entry, word start, rest start: the encoder's
    sizes: tuple[int, int, int, int] | None  # the sections' bytes, read by the host; None: not read,
    totals: torch.Tensor                      # their stream words and rest bytes, int64 on the device
    size: torch.Tensor                        # (1,) int64: the sealed packet's bytes (encode_into)


def plan(sampled: torch.Tensor, exact: torch.Tensor, ref: torch.Tensor, numel: int, block_size: int,
         dtype: torch.dtype, read: bool = True, work: Scratch | None = None, index: torch.Tensor | None = None,
         seal: tuple[torch.Tensor, torch.Tensor] | None = None, parts: int = 1, slot: int = 0) -> DevicePlan:
    """reference/plan.py's choose and plan from the blocks' sampled and whole symbol histograms
    ((nblocks, NSYM) integer views with one row stride, counts read as u16) and reference
    exponents, all on one device: two launches. ``read``: the host reads the packet's size (the
    one read); otherwise it stays on the device. ``work``: the call's Scratch (else one is made);
    ``index``: where the index entries go (an (nb, 4) int16 view of the packet; else into
    ``work``); ``seal``: (the header template, the packet's header) for _place to seal.
    ``parts``: that many tensors of ``numel`` elements, their blocks' rows one after the other,
    their packets ``slot`` bytes apart (``index`` and ``seal`` being the first's)."""
    nb, dev = ref.shape[0] // parts, ref.device
    layout = LAYOUTS[dtype]
    lengths, codes, bits = bank(dtype, dev)
    if nb and (exact.stride(0) != sampled.stride(0) or sampled.stride(1) != 1 or exact.stride(1) != 1):
        raise ValueError("the histograms need rows of one stride, their counts contiguous")
    work = scratch(nb, dev, parts) if work is None else work
    entries, index_stride = (work.entries, 4 * nb) if index is None else (index, slot // 2)
    if nb:
        launch(_choose, (num_blocks(nb, TILE), parts),
               sampled, exact, sampled.stride(0), ref, bits, entries, index_stride, work.blocks, work.lens, nb, numel,
               BS=block_size, NSYM=NSYM, NBANK=BANK_SIZE, ZERO=SYM_ZERO, RAW=RAW_BLOCK, REST_BYTES=layout.rest_bytes,
               SIDE_BITS=layout.side_bits, ITEMSIZE=layout.itemsize, TILE=TILE)
    tmpl, hdr = seal if seal is not None else (work.size, work.size)
    prefix = prefix_sizes(numel, block_size)
    launch(_place, (parts,), work.lens, work.blocks, work.totals, nb, tmpl, hdr, slot, work.size, sum(prefix),
           SCAN=SCAN, SEAL=seal is not None)
    sizes = None
    if read:
        words, rest_bytes = (int(v) for v in to_host(work.totals[0]))  # the one read
        sizes = (*prefix, words * 4, rest_bytes)
    return DevicePlan(lengths, codes, entries.view(torch.uint8).reshape(-1), work.blocks, sizes, work.totals,
                      work.size)


#: Where the blocks' error codes start in a decode's verdict (int64): the good flag, the header's
#: bytes, the index's check (first invalid entry or the block count, stream words, rest bytes).
VERDICT_ERRORS = 1 + HEADER_SIZE + 3


# not specialized on what a packet's sizes make of them (a multiple of 16 or not): one compiled
# kernel for every packet of a tensor's size, not a second compile when a received size first differs
@triton.jit(do_not_specialize=["room", "s2", "s3"])
def _index(pkt_ptr, start, nb, n, bs, ntables, rows_ptr, order_ptr, meta_ptr, verdict_ptr, tmpl_ptr, room, s2, s3,
           parts_ptr, part_words, EMAX: tl.constexpr, ITEMSIZE: tl.constexpr, REST_BYTES: tl.constexpr,
           SIDE_BITS: tl.constexpr, RAW: tl.constexpr, SCAN: tl.constexpr, HEADER: tl.constexpr,
           ERRORS: tl.constexpr, PARTS: tl.constexpr):
    """One program, SCAN entries a step: the block index at ``pkt_ptr + start`` (nb entries) read
    and checked as reference/packet.py does, and everything the decoders need from it, so that
    no kernel reads through the index before it is known good.

    rows_ptr: 7 rows of nb + 1 (ref, table, stream words, zeros, elements, then the stream's and
    the rest section's starts, an exclusive prefix sum with the totals last); order_ptr: the
    blocks, coded ones first (raw ones from the end, backwards: one pass); meta_ptr: the coded
    blocks to decode, the first raw place to decode, the rest section's offset in the packet
    (both counts mask everything where the packet is bad: 0 and nb); verdict_ptr: the good flag,
    the header's 56 bytes (HEADER), the check, and each block's error code, zeroed here. With
    HEADER (decode_into) the packet's header is checked against the template at tmpl_ptr (every
    field the caller's ``out`` fixes, its CRC-32, data sizes that fit in the ``room`` bytes after
    the index and hold n elements; compared one at a time in int64: a sum could wrap) and gives
    the sizes; else they are ``s2`` and ``s3`` (a header the host validated). With PARTS
    (decode_many), packet ``program_id(0)``: parts_ptr's row of 3 (its byte offset from pkt_ptr,
    its output's element offset, its room) places it, its rows, order and meta ``part_words``
    after the packet's before it, its verdict ERRORS + nb after that one's."""
    if PARTS:
        part = tl.program_id(0).to(tl.int64)
        pkt_ptr += tl.load(parts_ptr + 3 * part)
        room = tl.load(parts_ptr + 3 * part + 2)
        rows_ptr += part * part_words
        order_ptr += part * part_words
        meta_ptr += part * part_words
        verdict_ptr += part * (ERRORS + nb)
    zero = tl.program_id(0).to(tl.int64) * 0
    words, rest, raws, bad = zero, zero, zero, zero + nb
    stride = nb + 1
    for first in range(0, nb, SCAN):
        b = first + tl.arange(0, SCAN).to(tl.int64)
        live = b < nb
        e = pkt_ptr + start + b * 8
        ref = tl.load(e, mask=live, other=0).to(tl.int64)
        table = tl.load(e + 1, mask=live, other=0).to(tl.int64)
        nwords = tl.load(e + 2, mask=live, other=0).to(tl.int64) | (tl.load(e + 3, mask=live, other=0).to(tl.int64) << 8)
        nzero = tl.load(e + 4, mask=live, other=0).to(tl.int64) | (tl.load(e + 5, mask=live, other=0).to(tl.int64) << 8)
        pad = tl.load(e + 6, mask=live, other=0).to(tl.int64) | tl.load(e + 7, mask=live, other=0).to(tl.int64)
        nvalid = tl.minimum(n - b * bs, bs)
        raw = (table == RAW) & live
        ok = tl.where(raw, (nwords == 0) & (nzero == 0) & (ref == 0),  # coded: a bit per element at least
                      (table < ntables) & (ref <= EMAX) & (nzero <= nvalid) & (nvalid <= 32 * nwords)) & (pad == 0)
        size = tl.where(raw, nvalid * ITEMSIZE, (nvalid - nzero) * REST_BYTES + ((nvalid - nzero) * SIDE_BITS + 7) // 8)
        size = tl.where(live, size, 0)
        tl.store(rows_ptr + b, ref, mask=live)
        tl.store(rows_ptr + stride + b, table, mask=live)
        tl.store(rows_ptr + 2 * stride + b, nwords, mask=live)
        tl.store(rows_ptr + 3 * stride + b, nzero, mask=live)
        tl.store(rows_ptr + 4 * stride + b, nvalid, mask=live)
        tl.store(rows_ptr + 5 * stride + b, words + tl.cumsum(nwords, 0) - nwords, mask=live)
        tl.store(rows_ptr + 6 * stride + b, rest + tl.cumsum(size, 0) - size, mask=live)
        words += tl.sum(nwords, 0)
        rest += tl.sum(size, 0)
        bad = tl.minimum(bad, tl.min(tl.where(ok | ~live, nb, b), 0))
        counted = raw.to(tl.int64)
        before = raws + tl.cumsum(counted, 0) - counted
        tl.store(order_ptr + tl.where(raw, nb - 1 - before, b - before), b, mask=live)
        raws += tl.sum(counted, 0)
        tl.store(verdict_ptr + ERRORS + b, tl.zeros_like(b), mask=live)
    tl.store(rows_ptr + 5 * stride + nb, words)
    tl.store(rows_ptr + 6 * stride + nb, rest)
    head = zero + 1
    if HEADER:
        crc = zero + 0xFFFFFFFF
        s2, s3, stored, differ = zero, zero, zero, zero
        for i in range(56):
            byte = tl.load(pkt_ptr + i).to(tl.int64)
            tl.store(verdict_ptr + 1 + i, byte)
            fixed = (i < 32) | ((i >= 48) & (i < 52))
            differ += tl.where(fixed & (byte != tl.load(tmpl_ptr + i).to(tl.int64)), 1, 0)
            s2 += tl.where((i >= 32) & (i < 40), byte << (8 * (i % 8)), 0)
            s3 += tl.where((i >= 40) & (i < 48), byte << (8 * (i % 8)), 0)
            stored += tl.where(i >= 52, byte << (8 * ((i + 4) % 8)), 0)
            crc = tl.where(i < 52, _crc32_byte(crc, byte), crc)
        fits = (s2 >= 0) & (s3 >= 0) & (s2 <= room) & (s3 <= room - s2)
        head = ((differ == 0) & ((crc ^ 0xFFFFFFFF) == stored) & (s2 % 4 == 0) & fits & (n <= 8 * s2 + s3)).to(tl.int64)
    good = (head == 1) & (bad == nb) & (words * 4 == s2) & (rest == s3)
    ncoded = nb - raws
    tl.store(verdict_ptr, good.to(tl.int64))
    tl.store(verdict_ptr + ERRORS - 3, bad)  # the check, after the header's bytes
    tl.store(verdict_ptr + ERRORS - 2, words)
    tl.store(verdict_ptr + ERRORS - 1, rest)
    tl.store(meta_ptr, tl.where(good, ncoded, 0))
    tl.store(meta_ptr + 1, tl.where(good, ncoded, nb))
    tl.store(meta_ptr + 2, zero + start + nb * 8 + s2)  # in int64: the host's s2 comes as int32 below 2**31


class Index(NamedTuple):
    """A block index read on the device (``_index``): rows, order and meta as its docstring says;
    ``verdict``: the good flag, header bytes, check and the blocks' error codes (int64)."""
    rows: torch.Tensor
    order: torch.Tensor
    meta: torch.Tensor
    verdict: torch.Tensor

    @property
    def check(self) -> torch.Tensor:
        return self.verdict[1 + HEADER_SIZE:VERDICT_ERRORS]


def index(packet: torch.Tensor, start: int, nb: int, n: int, bs: int, ntables: int, layout: FloatLayout,
          sizes: tuple[int, int] | None = None, template: torch.Tensor | None = None,
          work: torch.Tensor | None = None, parts: torch.Tensor | None = None, count: int = 1) -> Index:
    """``_index`` over the nb entries at ``packet[start:]``: two allocations (the verdict, and
    ``work``'s rows, order and meta where the caller gives no int64 ``work``) and one launch.
    ``sizes``: the stream and rest bytes of a header the host validated; else ``template``: the
    header the packet must have, checked on the device (decode_into). ``parts``: ``count`` packets
    in ``packet``, placed by its rows (device_plan._index); the Index is then the first's, the
    others' ``index_words(nb)`` words (and verdicts VERDICT_ERRORS + nb) after it."""
    dev = packet.device
    words = index_words(nb)
    verdict = torch.empty(count * (VERDICT_ERRORS + nb), dtype=torch.int64, device=dev)
    work = torch.empty(count * words, dtype=torch.int64, device=dev) if work is None else work
    rows = work[:7 * (nb + 1)].view(7, nb + 1)
    order, meta = work[7 * (nb + 1):8 * nb + 7], work[8 * nb + 7:8 * nb + 10]
    s2, s3 = sizes if sizes is not None else (0, 0)
    launch(_index, (count,), packet, start, nb, n, bs, ntables, rows, order, meta, verdict,
           packet if template is None else template, packet.numel() - start - nb * INDEX_ENTRY, s2, s3,
           packet if parts is None else parts, words, EMAX=layout.emax, ITEMSIZE=layout.itemsize,
           REST_BYTES=layout.rest_bytes, SIDE_BITS=layout.side_bits, RAW=RAW_BLOCK, SCAN=SCAN,
           HEADER=template is not None, ERRORS=VERDICT_ERRORS, PARTS=parts is not None,
           num_warps=INDEX_WARPS)
    return Index(rows, order, meta, verdict)


def index_words(nb: int) -> int:
    """The int64 words of ``index``'s ``work`` per packet: 7 rows of nb + 1, the order, 3 of meta."""
    return 8 * nb + 10


def read_index(packet: torch.Tensor, start: int, stop: int, n: int, bs: int, ntables: int, layout: FloatLayout,
               sizes: tuple[int, int] | None = None):
    """reference/packet.py's read_index on the packet's device (``index``): the same rows as int64
    tensors there, its check (the first invalid entry or the block count, stream words, rest
    bytes) as a tensor there too, for the decoder to check, and the Index, which the decoder
    reads (``sizes``: the header's stream and rest bytes, as ``index`` takes them)."""
    nb = (stop - start) // INDEX_ENTRY
    ix = index(packet, start, nb, n, bs, ntables, layout, sizes=sizes or (-1, -1))
    return (*(row[:nb] for row in ix.rows[:5]), ix.rows[5], ix.rows[6]), ix.check, ix
