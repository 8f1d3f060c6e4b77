"""Assembling packets and validating lossless packets: shared by every implementation.

Validation runs over the header and the block index (a few bytes per 4096
elements) before any payload is touched, so a decoder that passes it can trust
every offset it computes. The header is read on the host; the index there too,
or, for the GPU decoder, where the packet is (kernels/device_plan.py's
read_index, the same checks with torch operations). The code tables are the
fixed bank's (zipccl/bank.py), which each block's index entry names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from .. import config
from ..errors import FormatError, TimeoutError  # noqa: A004 - zipccl's, also the builtin's subclass
from ..format import (CODEC_LOSSLESS, FLAG_CRC, HEADER_SIZE, INDEX_ENTRY, LAYOUTS, MAX_BLOCK_SIZE, MAXLEN,
                      MIN_BLOCK_SIZE, NSYM, RAW_BLOCK, FloatLayout, Header, prefix_sizes,
                      check_payload_crc, num_blocks, out_mismatch, parse_header)
from ..bank import BANK, BANK_SIZE


def assemble(header: Header, sections: list[torch.Tensor]) -> torch.Tensor:
    """Header followed by the sections, as one uint8 tensor on the sections' device. On CUDA the
    header goes up from pinned memory without the host waiting (a copy from pageable memory
    synchronises: one per packet); with a CRC the host reads the payload anyway."""
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
    out[:HEADER_SIZE] = to_device(header.pack(), device)
    return out


def to_host(t: torch.Tensor, bound: float | None = None, watch=None) -> np.ndarray:
    """``t``'s values on the host: the one way the codecs and collectives read the device. From
    CUDA, a copy into pinned memory and a wait on an event recorded after it: the host waits for
    the current stream's work up to the copy, as any read must, but through no synchronising torch
    operation, so that torch's sync debug mode can check a call for any other. The wait takes at
    most ``bound`` seconds (None: config.wait_bound()), then errors.TimeoutError: the stream may
    wait on a receive from a peer that stopped, and no read may block for ever. ``watch``: see
    ``passed``."""
    if t.device.type != "cuda":
        return t.cpu().numpy()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)  # on the current stream of t's device, which may not be the current device
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    passed(done, config.wait_bound() if bound is None else bound, watch)
    return host.numpy()


def passed(event, bound: float, watch=None) -> None:
    """Wait until ``event`` has passed, polling it (a wait on it has no limit): spinning for the
    first 2 ms (a codec's read: the device is about to finish), then in sleeps of at most 200 us,
    so that a longer wait costs the host little and overshoots little; errors.TimeoutError after
    ``bound`` seconds, or as soon as ``watch()`` (called at each poll: a transport's look at its
    errors and its ranks' heartbeats, Transport.watch; it may raise) says why to give up."""
    start = time.monotonic()
    nap = 0.0
    while not event.query():
        waited = time.monotonic() - start
        if waited > bound:
            raise TimeoutError(f"the device did not reach a read of its results within {bound:g} s: its stream "
                               "still waits, as on a receive from a peer that stopped")
        if watch is not None and (why := watch()) is not None:
            raise TimeoutError(f"the device had not reached a read of its results after {waited:.1f} s, and {why}")
        if waited > 2e-3:
            nap = min(2e-4, nap * 2 or 2e-5)
            time.sleep(nap)


#: Pinned host copies that a CUDA graph captured a copy from: each replay copies from that address
#: again, so they are never freed (nor reused for other data, as a freed pinned block would be).
_CAPTURED_SOURCES: list = []


def to_device(data: bytes | np.ndarray, device: torch.device) -> torch.Tensor:
    """``data`` (bytes as uint8, or an array as its dtype) on ``device``; to CUDA from pinned
    memory on the current stream, without the host waiting (a first call is no synchronising
    call, and later work on the stream follows the copy)."""
    host = torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(data, (bytes, bytearray)) else \
        torch.from_numpy(np.ascontiguousarray(data))
    if device.type != "cuda":
        return host.to(device)
    pinned = host.pin_memory()
    if torch.cuda.is_current_stream_capturing():
        _CAPTURED_SOURCES.append(pinned)
    return pinned.to(device, non_blocking=True)


def host_bytes(packet: torch.Tensor, start: int, stop: int) -> np.ndarray:
    return to_host(packet[start:stop])


def headers_of(packets: list[torch.Tensor]) -> list[bytes]:
    """Each packet's first HEADER_SIZE bytes (all it has where it is shorter), in one read of the
    device for all of them (the packets are on one device)."""
    if not packets:
        return []
    heads = [p[:HEADER_SIZE] for p in packets]
    read = to_host(torch.cat(heads)).tobytes()
    at = np.cumsum([0] + [h.numel() for h in heads]).tolist()
    return [read[at[j]:at[j + 1]] for j in range(len(packets))]


@dataclass
class LosslessPacket:
    """A validated lossless packet: everything a decoder needs. The per-block rows are numpy
    arrays, or int64 tensors on the packet's device where the index was read there."""
    header: Header
    layout: FloatLayout
    lengths: np.ndarray     # (BANK_SIZE, NSYM) code lengths: the bank's for the dtype
    ref: np.ndarray         # (nblocks,) reference exponent
    table: np.ndarray       # (nblocks,) table id, RAW_BLOCK for raw blocks
    nwords: np.ndarray      # (nblocks,) 32-bit words of exponent stream
    nzero: np.ndarray       # (nblocks,) +0.0 elements (no rest bytes)
    nvalid: np.ndarray      # (nblocks,) elements in the block
    word_start: np.ndarray  # (nblocks + 1,) prefix sum of nwords
    rest_start: np.ndarray  # (nblocks + 1,) prefix sum of section-3 bytes
    stream_offset: int      # byte offset of section 2 in the packet (section 0, the sub-stream
                            # lengths, at HEADER_SIZE: decoders read and check them as they decode)
    rest_offset: int        # byte offset of section 3 in the packet
    # Where the index was read on the device: (first invalid entry or nblocks, stream words,
    # rest bytes) there, not yet checked. The decoder checks it (index_error) with its one read at
    # the end and lets no kernel read through the index before it is known good.
    index_check: torch.Tensor | None = None
    # What a device reader read the index into (its decoder's input, so that it reads it once).
    device_index: object = None


def read_index(packet: torch.Tensor, start: int, stop: int, n: int, bs: int, ntables: int, layout: FloatLayout,
               sizes: tuple[int, int] | None = None):
    """The block index in packet[start:stop], read on the host: (rows as _read_index's, (the first
    invalid entry or the block count, stream words, rest bytes)). A reader on the device returns
    that triple as a tensor there instead, for the decoder to check (LosslessPacket.index_check),
    and a third item, what its decoder reads the index from (LosslessPacket.device_index);
    ``sizes``: the header's stream and rest bytes, which it checks against there."""
    fields, bad = _read_index(host_bytes(packet, start, stop), n, bs, ntables, layout.emax, layout.itemsize,
                              layout.rest_bytes, layout.side_bits)
    return fields, (fields.shape[1] - 1 if bad < 0 else bad, int(fields[5, -1]), int(fields[6, -1]))


def index_error(check, h: Header) -> str | None:
    """What is wrong with a block index, from its check (first invalid entry or the block count,
    stream words, rest bytes) against the header's sections; None if nothing."""
    bad, words, rest = (int(v) for v in check)
    if bad < num_blocks(h.numel, h.block_size):
        return f"block index entry {bad} is invalid"
    if words * 4 != h.sections[2] or rest != h.sections[3]:
        return "block index does not add up to the section sizes"
    return None


def check_lossless_header(h: Header) -> None:
    """FormatError where a parsed header's fields do not make a lossless packet this version reads."""
    n, bs = h.numel, h.block_size
    if bs < MIN_BLOCK_SIZE or bs > MAX_BLOCK_SIZE or bs & (bs - 1):
        raise FormatError(f"block size {bs} is not a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
    if h.nsym != NSYM or h.maxlen != MAXLEN:
        raise FormatError(f"tables of {h.nsym} symbols / {h.maxlen} bits; this version reads {NSYM} / {MAXLEN}")
    if h.ntables != BANK_SIZE:
        raise FormatError(f"a bank of {h.ntables} codes; this version's bank has {BANK_SIZE}")
    s0, s1, s2, s3 = h.sections
    if (s0, s1) != prefix_sizes(n, bs) or s2 % 4:
        raise FormatError("section sizes do not match the header's counts")
    if n > 8 * s2 + s3:  # every element takes a bit of a stream (a code) or a byte of section 3 (raw)
        raise FormatError(f"{n} elements cannot fit in {s2} stream bytes and {s3} rest bytes")


def parse_lossless(packet: torch.Tensor, header: Header | LosslessPacket | None = None,
                   index_reader=read_index) -> LosslessPacket:
    """Validate a lossless packet; ``header``: its header if the caller has parsed it already, or the
    packet already validated (returned as it is). ``index_reader``: read_index, or a reader with its
    signature and checks that leaves the rows where the packet is."""
    if isinstance(header, LosslessPacket):
        return header
    h = header or parse_header(host_bytes(packet, 0, HEADER_SIZE).tobytes(), CODEC_LOSSLESS, packet.numel())
    check_lossless_header(h)
    layout = LAYOUTS[h.dtype]
    n, bs = h.numel, h.block_size
    nb, (s0, s1, s2) = num_blocks(n, bs), h.sections[:3]
    pos = HEADER_SIZE + s0
    fields, check, *kept = index_reader(packet, pos, pos + s1, n, bs, h.ntables, layout, sizes=(s2, h.sections[3]))
    pos += s1
    deferred = isinstance(check, torch.Tensor) and not h.flags & FLAG_CRC  # the CRC reads the host anyway
    if not deferred and (problem := index_error(check.tolist() if isinstance(check, torch.Tensor) else check, h)):
        raise FormatError(problem)
    ref, table, nwords, nzero, nvalid, word_start, rest_start = fields
    if h.flags & FLAG_CRC:
        check_payload_crc(host_bytes(packet, 0, h.total_size).tobytes(), h)
    return LosslessPacket(h, layout, BANK[h.dtype], ref[:nb], table[:nb], nwords[:nb], nzero[:nb], nvalid[:nb],
                          word_start, rest_start, pos, pos + s2, check if deferred else None, *kept)


@njit(cache=True)
def _read_index(entries, n, bs, ntables, emax, itemsize, rest_bytes, side_bits):
    """The block index (section 1, INDEX_ENTRY bytes per block: u16 ref | bank entry << 8, u16 nwords,
    u16 nzero, u16 0) as rows ref, table, nwords, nzero, nvalid, word_start, rest_start (the
    last two are prefix sums, one longer than the block count), and the first invalid entry's
    number (-1 if none). Compiled: a packet of a few hundred blocks took 50 us in numpy."""
    nb = entries.shape[0] // INDEX_ENTRY
    f = np.zeros((7, nb + 1), np.int64)
    for b in range(nb):
        e = entries[b * INDEX_ENTRY:(b + 1) * INDEX_ENTRY]
        ref, table = np.int64(e[0]), np.int64(e[1])
        nwords = np.int64(e[2]) | (np.int64(e[3]) << 8)
        nzero = np.int64(e[4]) | (np.int64(e[5]) << 8)
        nvalid = min(bs, n - b * bs)
        if table == RAW_BLOCK:
            ok = nwords == 0 and nzero == 0 and ref == 0
            rest = nvalid * itemsize
        else:  # every element's code takes at least a bit of the block's nwords
            ok = table < ntables and ref <= emax and nzero <= nvalid and nvalid <= 32 * nwords
            rest = (nvalid - nzero) * rest_bytes + ((nvalid - nzero) * side_bits + 7) // 8
        if not ok or e[6] != 0 or e[7] != 0:
            return f, b
        f[0, b], f[1, b], f[2, b], f[3, b], f[4, b] = ref, table, nwords, nzero, nvalid
        f[5, b + 1] = f[5, b] + nwords
        f[6, b + 1] = f[6, b] + rest
    return f, -1


#: The error bits of the GPU decoder's blocks (zipccl/kernels/gpu.py), lowest first.
SUBSTREAM_ERROR = "a block's sub-stream lengths in section 0 do not match its stream"
BLOCK_ERRORS = {1: "invalid or truncated code in an exponent stream", 2: "decoded exponent out of range",
                4: "zero count of a block does not match its index entry",
                8: "sign+mantissa bytes of a block overrun its section", 16: SUBSTREAM_ERROR}


def block_error(codes: np.ndarray) -> str | None:
    """The message of the lowest error bit among the GPU decoder's blocks' codes, or None."""
    code = int(np.bitwise_or.reduce(codes)) if codes.size else 0
    return BLOCK_ERRORS[code & -code] if code else None


class Verdict:
    """What a ``decode_into`` found, kept on the device until read (the GPU decoder's: a good
    flag, the packet's header bytes, the index's check and the blocks' errors), or known
    already (``known``: a decoder that checked on the host). ``problem()`` (one host read) says
    what was wrong (in ``decode``'s words wherever ``decode`` refuses the packet too), or None;
    ``check()`` raises that FormatError; ``read_all`` reads several verdicts in one go."""
    __slots__ = ("values", "packet_size", "numel", "dtype", "block_size", "known")

    def __init__(self, values: torch.Tensor | None, packet_size: int, numel: int, dtype: torch.dtype,
                 block_size: int, known: str | None = None):
        self.values, self.packet_size, self.numel = values, packet_size, numel
        self.dtype, self.block_size, self.known = dtype, block_size, known

    def check(self) -> None:
        if (problem := self.problem()) is not None:
            raise FormatError(problem)

    def problem(self) -> str | None:
        return read_all([self])[0]

    def explain(self, values: np.ndarray) -> str | None:
        """The problem that ``values`` (this verdict's, on the host) show, or None."""
        good, head, check, errors = values[0], values[1:1 + HEADER_SIZE], values[1 + HEADER_SIZE:4 + HEADER_SIZE], \
            values[4 + HEADER_SIZE:]
        try:
            h = parse_header(head.astype(np.uint8).tobytes(), CODEC_LOSSLESS, self.packet_size)
            check_lossless_header(h)
        except FormatError as e:
            return str(e)
        if h.flags & FLAG_CRC:
            return "decode_into takes packets without a payload checksum (decode checks one)"
        if problem := out_mismatch(h, self.numel, self.dtype):
            return problem
        if h.block_size != self.block_size:
            return f"packet's blocks hold {h.block_size} elements; this decoder reads blocks of {self.block_size}"
        if problem := index_error(check, h):
            return problem
        if not good:  # every check above passed on the host: the device's must have too
            return "packet header failed the device's check"
        return block_error(errors)


def read_all(verdicts: list, watch=None) -> list:
    """Each verdict's problem (None where its packet was good), read from the device at once
    (``watch``: see ``passed``)."""
    live = [v for v in verdicts if v.values is not None]
    values = to_host(torch.cat([v.values for v in live]), config.wait_bound(), watch) if live else None
    out, at = [], 0
    for v in verdicts:
        if v.values is None:
            out.append(v.known)
            continue
        out.append(v.explain(values[at:at + v.values.numel()]))
        at += v.values.numel()
    return out
