"""Wire format constants and the packet header (docs/FORMAT.md is the prose twin).

Every packet, whatever its codec, starts with the same 56-byte little-endian
header so that a receiver can validate it before touching the payload:

    offset size field
      0     4   magic b"ZCCL"
      4     1   version (4)
      5     1   codec   (0 raw, 1 lossless, 2 top-k)
      6     1   dtype   (1 float32, 2 float16, 3 bfloat16)
      7     1   flags   (bit 0: payload CRC32 present)
      8     8   numel
     16     4   block_size (elements per block; 0 for codecs without blocks)
     20     1   ntables (lossless: the size of the bank of codes, 32)
     21     1   nsym   (symbols per table)
     22     1   maxlen (longest code, bits)
     23     1   reserved, 0
     24     4   section 0 bytes (lossless: sub-stream lengths)
     28     4   section 1 bytes (lossless: block index)
     32     8   section 2 bytes (lossless: exponent streams)
     40     8   section 3 bytes (lossless: sign+mantissa; raw: the data)
     48     4   payload CRC32 (0 unless flags bit 0)
     52     4   header CRC32 of bytes 0..51
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import torch

from .errors import FormatError, UnsupportedError

MAGIC = b"ZCCL"
VERSION = 4  # 2: lossless blocks name entries of the fixed bank of codes (zipccl/bank.py);
             # 3: float16 codes its exponent with the top mantissa bit, no raw bits in the streams;
             # 4: section 0 gives the bits of each 256-element sub-stream of a block
HEADER_SIZE = 56
_HEADER = struct.Struct("<4sBBBBQIBBBBIIQQII")
assert _HEADER.size == HEADER_SIZE

CODEC_RAW, CODEC_LOSSLESS, CODEC_TOPK = 0, 1, 2
FLAG_CRC = 1

#: Top-k's order (zipccl.topk, zipccl.kernels.sparse): the key of a value is its magnitude's float32
#: bits, and NaN's is this one, above Inf's (0x7F800000): a NaN is sent first, as an Inf is, so
#: that it reaches the sum and GradScaler skips the step, rather than dropped from it unseen.
TOPK_NAN_KEY = 0x7F800001

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
DTYPES = {v: k for k, v in DTYPE_CODES.items()}
SUPPORTED = "torch.float32, torch.float16 and torch.bfloat16"


@dataclass(frozen=True)
class Header:
    codec: int
    dtype: torch.dtype
    numel: int
    flags: int = 0
    block_size: int = 0
    ntables: int = 0
    nsym: int = 0
    maxlen: int = 0
    sections: tuple[int, int, int, int] = (0, 0, 0, 0)
    payload_crc: int = 0

    @property
    def total_size(self) -> int:
        return HEADER_SIZE + sum(self.sections)

    def pack(self) -> bytes:
        body = _HEADER.pack(MAGIC, VERSION, self.codec, DTYPE_CODES[self.dtype], self.flags,
                            self.numel, self.block_size, self.ntables, self.nsym, self.maxlen, 0,
                            *self.sections, self.payload_crc, 0)
        return body[:52] + struct.pack("<I", zlib.crc32(body[:52]))


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of a float dtype, or UnsupportedError naming what is supported."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise UnsupportedError(f"dtype {dtype} is not supported; zipccl codecs take {SUPPORTED}") from None


def parse_header(head: bytes, expect_codec: int | None, packet_size: int) -> Header:
    """Validate and unpack the header of a packet of ``packet_size`` bytes; any inconsistency is a FormatError."""
    if packet_size < HEADER_SIZE or len(head) < HEADER_SIZE:
        raise FormatError(f"packet of {packet_size} bytes is shorter than the {HEADER_SIZE}-byte header")
    raw = bytes(head[:HEADER_SIZE])
    (magic, version, codec, dt, flags, numel, block_size, ntables, nsym, maxlen, reserved,
     s0, s1, s2, s3, pcrc, hcrc) = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise FormatError(f"unsupported format version {version}, this zipccl reads version {VERSION}")
    if zlib.crc32(raw[:52]) != hcrc:
        raise FormatError("header checksum mismatch (corrupt header)")
    if codec not in (CODEC_RAW, CODEC_LOSSLESS, CODEC_TOPK):
        raise FormatError(f"unknown codec id {codec}")
    if expect_codec is not None and codec != expect_codec:
        raise FormatError(f"packet holds codec {codec}, expected codec {expect_codec}")
    if dt not in DTYPES:
        raise FormatError(f"unknown dtype code {dt}")
    if flags & ~FLAG_CRC or reserved:
        raise FormatError(f"unknown flags {flags:#x} or nonzero reserved byte")
    if not flags & FLAG_CRC and pcrc:
        raise FormatError("payload CRC set without its flag")
    h = Header(codec, DTYPES[dt], numel, flags, block_size, ntables, nsym, maxlen, (s0, s1, s2, s3), pcrc)
    if packet_size < h.total_size:
        raise FormatError(f"packet truncated: {packet_size} bytes, header declares {h.total_size}")
    return h


def check_numel(header: Header, max_numel: int | None) -> None:
    """FormatError if the header claims more elements than the caller's bound (decoders check it
    before allocating anything of the header's size)."""
    if max_numel is not None and header.numel > max_numel:
        raise FormatError(f"packet claims {header.numel} elements, more than the caller's bound of {max_numel}")


def payload_crc(packet_bytes: bytes | memoryview, header: Header) -> int:
    return zlib.crc32(packet_bytes[HEADER_SIZE:header.total_size])


def check_payload_crc(packet_bytes, header: Header) -> None:
    if header.flags & FLAG_CRC and payload_crc(packet_bytes, header) != header.payload_crc:
        raise FormatError("payload checksum mismatch (corrupt payload)")


# ---- lossless layout (see docs/FORMAT.md, "Lossless payload") ----
NSYM = 32            # symbols per code table
SYM_ZERO = 0         # the element is +0.0 (all bits zero): no sign+mantissa stored
SYM_ESC = 1          # coded field stored as raw bits right after the code
MAXLEN = 12          # longest Huffman code, bits (decoders peek MAXLEN bits)
SAMPLE_STRIDE = 8    # encoders choose reference exponents and bank entries from every 8th element of
                     # a block (its elements 0, 8, 16, ...); exact sizes come from all of them
RAW_BLOCK = 0xFF     # block index table id of a block stored raw
INDEX_ENTRY = 8      # bytes per block index entry: u8 ref, u8 bank entry, u16 nwords, u16 nzero, u16 0
TABLE_BYTES = NSYM // 2  # a code table as nibbles (version 1's section 0; bench/ scripts)
DEFAULT_BLOCK_SIZE = 4096      # CPU encoders
GPU_BLOCK_SIZE = 4096          # Triton encoder (its decoder's lanes are sub-streams: docs/GPU.md)
MIN_DEFAULT_BLOCK_SIZE = min(DEFAULT_BLOCK_SIZE, GPU_BLOCK_SIZE)  # bounds max_encoded_size for either
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 256, 32768
SUBSTREAM = 256  # elements per sub-stream: a block's stream in pieces whose starts section 0 gives,
                 # so that a decoder can decode them apart (a GPU lane walks 256 codes, not a block's)
LENGTH_ENTRY = 2  # bytes per sub-stream length in section 0 (u16 bits)


@dataclass(frozen=True)
class FloatLayout:
    """How one dtype splits into the coded field (the exponent; float16: with the top mantissa bit)
    and the rest (the sign above the mantissa bits below the field), stored in section 3."""
    itemsize: int
    ebits: int        # coded field width: bits mbits .. mbits + ebits - 1
    mbits: int        # mantissa bits below the coded field (the sign sits above it)
    rest_bytes: int   # whole bytes of each element's rest in section 3: its low 8 * rest_bytes bits
    side_bits: int    # the rest's remaining top bits, packed after a block's rest bytes
    offset_bias: int  # symbol = coded field - block reference + offset_bias, for 2 <= symbol < NSYM

    @property
    def emax(self) -> int:
        return (1 << self.ebits) - 1

    @property
    def min_offset(self) -> int:
        return 2 - self.offset_bias

    @property
    def max_offset(self) -> int:
        return NSYM - 1 - self.offset_bias

    def rest_len(self, nonzero):
        """Section-3 bytes of a coded block with ``nonzero`` elements other than +0.0 (an int or
        an integer array)."""
        return nonzero * self.rest_bytes + (nonzero * self.side_bits + 7) // 8


LAYOUTS = {
    torch.float32: FloatLayout(4, 8, 23, 3, 0, 28),
    # float16's field is its exponent and top mantissa bit: half-octave steps, because 43% of the
    # real bucket's values are subnormal and their top mantissa bit is magnitude (docs/FORMAT.md)
    torch.float16: FloatLayout(2, 6, 9, 1, 2, 16),
    torch.bfloat16: FloatLayout(2, 8, 7, 1, 0, 28),
}


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size) if numel else 0


def substreams(block_size: int) -> int:
    """Sub-stream lengths per block in section 0: one per SUBSTREAM elements, none where a block
    is one sub-stream (its index entry bounds it)."""
    return block_size // SUBSTREAM if block_size > SUBSTREAM else 0


def prefix_sizes(numel: int, block_size: int) -> tuple[int, int]:
    """Sections 0 and 1 of a lossless packet, in bytes: the sub-stream lengths and the block index."""
    nb = num_blocks(numel, block_size)
    return nb * substreams(block_size) * LENGTH_ENTRY, nb * INDEX_ENTRY


def check_input(x: torch.Tensor) -> None:
    """A codec input must be a contiguous float tensor of a supported dtype."""
    if not isinstance(x, torch.Tensor):
        raise UnsupportedError(f"expected a torch.Tensor, got {type(x).__name__}")
    dtype_code(x.dtype)
    if x.layout != torch.strided or not x.is_contiguous():
        raise UnsupportedError("codecs take contiguous strided tensors; call .contiguous() first")


def check_out(header: Header, out: torch.Tensor) -> torch.Tensor:
    """``out`` as a 1-D view, if it is a contiguous tensor of the packet's dtype and numel; a packet
    that disagrees with the caller's buffer is a FormatError (the packet is the untrusted side)."""
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if problem := out_mismatch(header, out.numel(), out.dtype):
        raise FormatError(problem)
    return out.view(-1)


def out_mismatch(header: Header, numel: int, dtype: torch.dtype) -> str | None:
    """What differs between a packet's elements and an output of ``numel`` ``dtype`` ones, or None."""
    if dtype != header.dtype or numel != header.numel:
        return f"packet holds {header.numel} elements of {header.dtype}, out has {numel} of {dtype}"
    return None
