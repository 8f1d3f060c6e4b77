"""The lossless codec in plain torch: the specification, slow and obvious.

Every step is a whole-tensor torch operation, so it runs on any device. The
codes are the fixed bank's (zipccl/bank.py): each block takes the entry that
codes its sample (every SAMPLE_STRIDE-th element) in the fewest bits. Fast kernels
(kernels/cpu.py, kernels/gpu.py) must produce the same bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import FormatError
from ..format import (CODEC_LOSSLESS, FLAG_CRC, HEADER_SIZE, LAYOUTS, LENGTH_ENTRY, MAXLEN, SAMPLE_STRIDE, RAW_BLOCK,
                      SUBSTREAM, SYM_ESC, SYM_ZERO, Header, num_blocks, substreams)
from ..bank import BANK, BANK_SIZE
from . import tables as T
from .packet import SUBSTREAM_ERROR, LosslessPacket, assemble, parse_lossless


def float_bits(x: torch.Tensor) -> torch.Tensor:
    """The bit pattern of each element as a non-negative int64."""
    layout = LAYOUTS[x.dtype]
    ints = x.reshape(-1).view(torch.int32 if layout.itemsize == 4 else torch.int16).to(torch.int64)
    return ints & ((1 << (8 * layout.itemsize)) - 1)


def to_bytes(values: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Little-endian bytes of non-negative int64 values, nbytes each, row-major."""
    shifts = torch.arange(nbytes, device=values.device) * 8
    return ((values.unsqueeze(-1) >> shifts) & 255).to(torch.uint8).reshape(-1)


def from_bytes(data: torch.Tensor, nbytes: int) -> torch.Tensor:
    shifts = torch.arange(nbytes, device=data.device) * 8
    return (data.reshape(-1, nbytes).to(torch.int64) << shifts).sum(dim=1)


def sample_mask(block_size: int, device) -> torch.Tensor:
    """The elements of a block that the encoder's choices look at: every SAMPLE_STRIDE-th."""
    return torch.arange(block_size, device=device) % SAMPLE_STRIDE == 0


def block_symbols(bits: torch.Tensor, layout, block_size: int):
    """Per block: reference (the sample's most common coded field), symbols, coded fields, zero mask
    (padded to whole blocks)."""
    n = bits.numel()
    nb = num_blocks(n, block_size)
    padded = torch.zeros(nb * block_size, dtype=torch.int64, device=bits.device)
    padded[:n] = bits
    valid = (torch.arange(nb * block_size, device=bits.device) < n).reshape(nb, block_size)
    bits2 = padded.reshape(nb, block_size)
    exp = (bits2 >> layout.mbits) & layout.emax
    zero = bits2 == 0
    counts = torch.zeros(nb, layout.emax + 1, dtype=torch.int64, device=bits.device)
    counts.scatter_add_(1, exp, (valid & ~zero & sample_mask(block_size, bits.device)).to(torch.int64))
    ref = counts.argmax(dim=1)  # ties -> smallest field; all-zero block -> 0
    d = exp - ref[:, None]
    fits = (d >= layout.min_offset) & (d <= layout.max_offset)
    sym = torch.where(fits, d + layout.offset_bias, torch.full_like(d, SYM_ESC))
    sym = torch.where(zero, torch.zeros_like(sym), sym)
    return ref, sym, exp, zero, valid, bits2


def side_bytes(values: torch.Tensor, keep: torch.Tensor, side_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (row), the ``side_bits``-bit ``values`` of its kept elements packed LSB first, the
    k-th kept element at bit k * side_bits, and which of those bytes the block has (uint8 and bool,
    (rows, ceil(row length * side_bits / 8)))."""
    rows, cols = values.shape
    cap = -(-cols * side_bits // 8)
    if not side_bits:
        z = torch.zeros(rows, 0, dtype=torch.int64, device=values.device)
        return z.to(torch.uint8), z.bool()
    assert 8 % side_bits == 0  # no value straddles two bytes
    k = torch.cumsum(keep.to(torch.int64), dim=1) - 1
    pos = torch.where(keep, k * side_bits, 0)
    side = torch.zeros(rows, cap, dtype=torch.int64, device=values.device)
    side.scatter_add_(1, pos >> 3, torch.where(keep, (values & ((1 << side_bits) - 1)) << (pos & 7), 0))
    used = -(-keep.sum(dim=1) * side_bits // 8)
    return side.to(torch.uint8), torch.arange(cap, device=values.device)[None, :] < used[:, None]


def encode(x: torch.Tensor, block_size: int, checksum: bool) -> torch.Tensor:
    layout = LAYOUTS[x.dtype]
    n = x.numel()
    bits = float_bits(x)
    nb = num_blocks(n, block_size)
    dev = x.device
    if n == 0:
        empty = torch.zeros(0, dtype=torch.uint8, device=dev)
        flags = FLAG_CRC if checksum else 0
        return assemble(Header(CODEC_LOSSLESS, x.dtype, 0, flags, block_size, BANK_SIZE, T.NSYM, MAXLEN),
                        [empty] * 4)
    ref, sym, exp, zero, valid, bits2 = block_symbols(bits, layout, block_size)
    hist = torch.zeros(nb, T.NSYM, dtype=torch.int64, device=dev)
    hist.scatter_add_(1, sym, valid.to(torch.int64))
    sampled = torch.zeros_like(hist)
    sampled.scatter_add_(1, sym, (valid & sample_mask(block_size, dev)).to(torch.int64))
    lengths = BANK[x.dtype]
    per_symbol = lengths + T.extra_bits(layout)  # bits of each symbol under each entry
    assign = (sampled[:, None, :] * torch.from_numpy(per_symbol).to(dev)).sum(dim=2).argmin(dim=1).cpu().numpy()
    cost = (hist.cpu().numpy() * per_symbol[assign]).sum(axis=1)  # entries from the sample, sizes from all
    nvalid = valid.sum(dim=1).cpu().numpy()
    nzero = (zero & valid).sum(dim=1).cpu().numpy()
    coded_bytes = 4 * (-(-cost // 32)) + layout.rest_len(nvalid - nzero)
    raw = coded_bytes >= nvalid * layout.itemsize
    nwords = np.where(raw, 0, -(-cost // 32))

    m = layout.mbits
    rest_val = (bits2 & ((1 << m) - 1)) | ((bits2 >> (m + layout.ebits)) << m)  # sign above mantissa

    # Exponent streams: each symbol's code, then an escape's raw field, LSB first.
    codes = torch.from_numpy(np.stack([T.canonical_codes(l) for l in lengths])).to(dev)
    lens = torch.from_numpy(lengths.copy()).to(dev)
    tab = torch.from_numpy(assign).to(dev)[:, None]
    coded = torch.from_numpy(~raw).to(dev)[:, None] & valid
    value = codes[tab, sym]
    width = lens[tab, sym]
    esc = sym == SYM_ESC
    value = value | torch.where(esc, exp << width, torch.zeros_like(exp))
    width = width + torch.where(esc, layout.ebits, 0)
    width = torch.where(coded, width, torch.zeros_like(width))
    word_start = torch.from_numpy(np.concatenate([[0], np.cumsum(nwords)])).to(dev)
    pos = (torch.cumsum(width, dim=1) - width) + word_start[:-1, None] * 32
    total_words = int(word_start[-1])
    words = torch.zeros(total_words + 1, dtype=torch.int64, device=dev)
    shifted = (value << (pos & 31))[coded]
    w = (pos >> 5)[coded]
    words.index_add_(0, w, shifted & 0xFFFFFFFF)
    words.index_add_(0, w + 1, shifted >> 32)
    stream = to_bytes(words[:total_words], 4)
    subs = substreams(block_size)  # section 0: each sub-stream's bits (raw blocks': 0)
    lengths_section = to_bytes(width.reshape(nb, subs, SUBSTREAM).sum(dim=2).reshape(-1), LENGTH_ENTRY) if subs \
        else torch.zeros(0, dtype=torch.uint8, device=dev)

    # Section 3, block by block: a coded block's rest bytes of its non-zero elements, then their
    # side bits (float16: the sign and the mantissa bit below the field), LSB first; a raw block whole.
    is_raw = torch.from_numpy(raw).to(dev)[:, None]
    per_elem = torch.where(is_raw[..., None], to_bytes(bits2, layout.itemsize).reshape(nb, block_size, -1),
                           to_bytes(rest_val, layout.itemsize).reshape(nb, block_size, -1))
    count = torch.where(is_raw & valid, layout.itemsize, torch.where(coded & ~zero, layout.rest_bytes, 0))
    keep_bytes = torch.arange(layout.itemsize, device=dev) < count[..., None]
    side, keep_side = side_bytes(rest_val >> (8 * layout.rest_bytes), coded & ~zero, layout.side_bits)
    section3 = torch.cat([per_elem.reshape(nb, -1), side], dim=1)[torch.cat([keep_bytes.reshape(nb, -1), keep_side], 1)]

    index = np.zeros((nb, 4), dtype=np.uint16)
    refs = np.where(raw, 0, ref.cpu().numpy())
    index[:, 0] = refs | (np.where(raw, RAW_BLOCK, assign) << 8)
    index[:, 1] = nwords
    index[:, 2] = np.where(raw, 0, nzero)
    sections = [lengths_section, torch.from_numpy(index.view(np.uint8).reshape(-1).copy()).to(dev), stream, section3]
    header = Header(CODEC_LOSSLESS, x.dtype, n, FLAG_CRC if checksum else 0, block_size, BANK_SIZE, T.NSYM, MAXLEN)
    return assemble(header, sections)


def decode(packet: torch.Tensor, out: torch.Tensor, header: Header | LosslessPacket | None = None) -> torch.Tensor:
    """Decode into ``out`` (1-D, the packet's dtype and numel). Blocks decode in lock step."""
    p = parse_lossless(packet, header)
    layout, h = p.layout, p.header
    n, bs, nb = h.numel, h.block_size, len(p.ref)
    dev = packet.device
    bits = torch.zeros(nb, bs, dtype=torch.int64, device=dev)
    t_idx = torch.arange(bs, device=dev)
    valid = t_idx[None, :] < torch.from_numpy(p.nvalid).to(dev)[:, None]
    raw = torch.from_numpy(p.table == RAW_BLOCK).to(dev)
    coded_blocks = torch.nonzero(~raw).reshape(-1)
    subs = substreams(bs)
    lengths = from_bytes(packet[HEADER_SIZE:HEADER_SIZE + h.sections[0]], LENGTH_ENTRY).reshape(nb, subs)
    if bool((lengths[raw] != 0).any()):
        raise FormatError(SUBSTREAM_ERROR)

    if coded_blocks.numel():
        nc = coded_blocks.numel()
        words = torch.zeros(int(p.word_start[-1]) + 2, dtype=torch.int64, device=dev)
        words[:-2] = from_bytes(packet[p.stream_offset:p.rest_offset], 4)
        luts = torch.from_numpy(T.decode_luts(p.lengths).astype(np.int64)).to(dev)
        table = torch.from_numpy(p.table).to(dev)[coded_blocks]
        pos = torch.from_numpy(p.word_start[:-1] * 32).to(dev)[coded_blocks]
        end = torch.from_numpy(p.word_start[1:] * 32).to(dev)[coded_blocks]
        nvalid = torch.from_numpy(p.nvalid).to(dev)[coded_blocks]
        sym = torch.zeros(nc, bs, dtype=torch.int64, device=dev)
        exp_esc = torch.zeros(nc, bs, dtype=torch.int64, device=dev)

        def take(nbits):
            """The next nbits at each block's bit position (clamped reads stay inside ``words``)."""
            w = torch.clamp(pos >> 5, max=words.numel() - 2)
            return ((words[w] | (words[w + 1] << 32)) >> (pos & 31)) & ((1 << nbits) - 1)

        ends = torch.zeros(nc, subs + 1, dtype=torch.int64, device=dev)  # bits at each sub-stream's end
        start = pos
        for t in range(int(p.nvalid.max())):
            if subs and t % SUBSTREAM == 0:
                ends[:, t // SUBSTREAM] = pos - start
            active = t < nvalid
            entry = luts[table, take(MAXLEN)]
            length = entry >> 8
            if bool((active & (length == 0)).any()):
                raise FormatError("invalid code in exponent stream")
            s = entry & 255
            pos = pos + torch.where(active, length, 0)
            is_esc = active & (s == SYM_ESC)
            exp_esc[:, t] = torch.where(is_esc, take(layout.ebits), 0)
            pos = pos + torch.where(is_esc, layout.ebits, 0)
            if bool((pos > end).any()):
                raise FormatError("exponent stream overruns its block")
            sym[:, t] = torch.where(active, s, 0)
        if subs:
            ends[:, -(-int(p.nvalid.max()) // SUBSTREAM):] = (pos - start)[:, None]
            if not torch.equal(ends[:, 1:] - ends[:, :-1], lengths[coded_blocks]):
                raise FormatError(SUBSTREAM_ERROR)
        zero = (sym == SYM_ZERO) & valid[coded_blocks]
        if not torch.equal(zero.sum(dim=1).cpu(), torch.from_numpy(p.nzero)[coded_blocks.cpu()]):
            raise FormatError("zero count of a block does not match its index entry")
        ref = torch.from_numpy(p.ref).to(dev)[coded_blocks]
        exp = torch.where(sym == SYM_ESC, exp_esc, ref[:, None] + sym - layout.offset_bias)
        exp = torch.where(sym == SYM_ZERO, 0, exp)
        if bool(((exp < 0) | (exp > layout.emax)).any()):
            raise FormatError("decoded exponent out of range")
        # Rest: the k-th non-zero element of a block takes the k-th rest entry of that block, and
        # its side bits at bit k * side_bits after the block's rest bytes.
        rb = layout.rest_bytes
        rest_all = packet[p.rest_offset:p.rest_offset + int(p.rest_start[-1])]
        k = torch.cumsum((~zero).to(torch.int64), dim=1) - 1
        start = torch.from_numpy(p.rest_start[:-1]).to(dev)[coded_blocks][:, None] + k * rb
        keep = ~zero & valid[coded_blocks]
        rest = torch.zeros(nc, bs, dtype=torch.int64, device=dev)
        for j in range(rb):
            idx = torch.where(keep, start + j, 0)
            rest |= torch.where(keep, rest_all[idx].to(torch.int64) << (8 * j), 0) if rest_all.numel() else 0
        sb = layout.side_bits
        if sb:
            nonzero = torch.from_numpy(p.nvalid - p.nzero).to(dev)[coded_blocks][:, None]
            bit = k * sb
            idx = torch.where(keep, start - k * rb + nonzero * rb + (bit >> 3), 0)
            side = torch.where(keep, rest_all[idx].to(torch.int64), 0) if rest_all.numel() else 0
            rest |= ((side >> (bit & 7)) & ((1 << sb) - 1)) << (8 * rb)
        m = layout.mbits
        value = (rest & ((1 << m) - 1)) | (exp << m) | ((rest >> m) << (m + layout.ebits))
        bits[coded_blocks] = torch.where(keep, value, 0)

    for b in torch.nonzero(raw).reshape(-1).tolist():
        a = p.rest_offset + int(p.rest_start[b])
        bits[b, :int(p.nvalid[b])] = from_bytes(packet[a:a + int(p.nvalid[b]) * layout.itemsize], layout.itemsize)

    flat = bits.reshape(-1)[:n]
    ints = torch.where(flat >= 1 << (8 * layout.itemsize - 1), flat - (1 << (8 * layout.itemsize)), flat)
    out.view(torch.int32 if layout.itemsize == 4 else torch.int16).copy_(ints)
    return out
