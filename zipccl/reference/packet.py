"""Assembling packets and validating lossless packets: shared by every implementation.

Validation runs on the host over the header, the code tables and the block
index (a few bytes per 4096 elements) before any payload is touched, so a
decoder that passes it can trust every offset it computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import FormatError
from ..format import (CODEC_LOSSLESS, FLAG_CRC, HEADER_SIZE, INDEX_ENTRY, LAYOUTS, MAX_BLOCK_SIZE, MAX_TABLES,
                      MAXLEN, MIN_BLOCK_SIZE, NSYM, RAW_BLOCK, TABLE_BYTES, FloatLayout, Header,
                      check_payload_crc, num_blocks, parse_header)
from .tables import unpack_tables


def assemble(header: Header, sections: list[torch.Tensor]) -> torch.Tensor:
    """Header followed by the sections, as one uint8 tensor on the sections' device."""
    sizes = tuple(int(s.numel()) for s in sections)
    assert len(sizes) == 4, "a packet has four sections (empty ones included)"
    header = Header(header.codec, header.dtype, header.numel, header.flags, header.block_size,
                    header.ntables, header.nsym, header.maxlen, sizes, 0)
    device = sections[0].device if sections else torch.device("cpu")
    out = torch.empty(header.total_size, dtype=torch.uint8, device=device)
    pos = HEADER_SIZE
    for s in sections:
        out[pos:pos + s.numel()] = s
        pos += s.numel()
    if header.flags & FLAG_CRC:
        import zlib
        crc = zlib.crc32(out[HEADER_SIZE:].cpu().numpy().tobytes())
        header = Header(header.codec, header.dtype, header.numel, header.flags, header.block_size,
                        header.ntables, header.nsym, header.maxlen, sizes, crc)
    out[:HEADER_SIZE] = torch.frombuffer(bytearray(header.pack()), dtype=torch.uint8)
    return out


def host_bytes(packet: torch.Tensor, start: int, stop: int) -> np.ndarray:
    return packet[start:stop].cpu().numpy()


@dataclass
class LosslessPacket:
    """A validated lossless packet: everything a decoder needs, as host arrays."""
    header: Header
    layout: FloatLayout
    lengths: np.ndarray     # (ntables, NSYM) code lengths
    ref: np.ndarray         # (nblocks,) reference exponent
    table: np.ndarray       # (nblocks,) table id, RAW_BLOCK for raw blocks
    nwords: np.ndarray      # (nblocks,) 32-bit words of exponent stream
    nzero: np.ndarray       # (nblocks,) +0.0 elements (no rest bytes)
    nvalid: np.ndarray      # (nblocks,) elements in the block
    word_start: np.ndarray  # (nblocks + 1,) prefix sum of nwords
    rest_start: np.ndarray  # (nblocks + 1,) prefix sum of section-3 bytes
    stream_offset: int      # byte offset of section 2 in the packet
    rest_offset: int        # byte offset of section 3 in the packet


def parse_lossless(packet: torch.Tensor) -> LosslessPacket:
    h = parse_header(host_bytes(packet, 0, HEADER_SIZE).tobytes(), CODEC_LOSSLESS, packet.numel())
    layout = LAYOUTS[h.dtype]
    n, bs = h.numel, h.block_size
    if bs < MIN_BLOCK_SIZE or bs > MAX_BLOCK_SIZE or bs & (bs - 1):
        raise FormatError(f"block size {bs} is not a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
    if h.nsym != NSYM or h.maxlen != MAXLEN:
        raise FormatError(f"tables of {h.nsym} symbols / {h.maxlen} bits; this version reads {NSYM} / {MAXLEN}")
    nb = num_blocks(n, bs)
    if not (nb == 0 and h.ntables == 0) and not (nb > 0 and 1 <= h.ntables <= MAX_TABLES):
        raise FormatError(f"{h.ntables} code tables for {nb} blocks")
    s0, s1, s2, s3 = h.sections
    if s0 != h.ntables * TABLE_BYTES or s1 != nb * INDEX_ENTRY or s2 % 4:
        raise FormatError("section sizes do not match the header's counts")
    pos = HEADER_SIZE
    lengths = unpack_tables(host_bytes(packet, pos, pos + s0), h.ntables) if nb else np.zeros((0, NSYM), np.int64)
    pos += s0
    index = host_bytes(packet, pos, pos + s1).copy().view(np.uint16).reshape(nb, 4).astype(np.int64)
    pos += s1
    ref, table = index[:, 0] & 255, index[:, 0] >> 8
    nwords, nzero = index[:, 1], index[:, 2]
    nvalid = np.minimum(bs, n - np.arange(nb) * bs)
    raw = table == RAW_BLOCK
    bad = (index[:, 3] != 0) | (~raw & (table >= h.ntables)) | (ref > layout.emax) | (nzero > nvalid)
    bad |= raw & ((nwords != 0) | (nzero != 0) | (ref != 0))
    if bad.any():
        raise FormatError(f"block index entry {int(np.argmax(bad))} is invalid")
    rest = np.where(raw, nvalid * layout.itemsize, (nvalid - nzero) * layout.rest_bytes)
    word_start = np.concatenate([[0], np.cumsum(nwords)])
    rest_start = np.concatenate([[0], np.cumsum(rest)])
    if word_start[-1] * 4 != s2 or rest_start[-1] != s3:
        raise FormatError("block index does not add up to the section sizes")
    if h.flags & FLAG_CRC:
        check_payload_crc(host_bytes(packet, 0, h.total_size).tobytes(), h)
    return LosslessPacket(h, layout, lengths, ref, table, nwords, nzero, nvalid, word_start, rest_start,
                          pos, pos + s2)
