"""Hostile packets: real packets, mutated, fed to every decoder.

Each case takes a valid packet of one decoder family, mutates it (bit flips,
truncation, extension, header fields with the header CRC re-signed so that the
change reaches the body, section sizes, bank entries named, block index entries,
streams, top-k indices, splices of two packets) and decodes it. A case passes
when the decoder raises FormatError, or returns a tensor of the header's numel
and dtype, having written nothing outside ``out`` (guard elements) and allocated
nothing beyond the bound it was given (AllocGuard); packets lie against an
inaccessible page (Fence), so that a read past one kills the process. Some cases must also decode to the original bits: a
packet whose declared bytes are unchanged (only trailing bytes added), and a
checksummed packet whose payload changed under an unchanged header (the payload
CRC must catch it). The reference and Triton decoders' cases are decoded by numba
too, which must accept and reject the same packets and give the same bits.

Cases are deterministic: case ``i`` of a family draws everything from a
generator seeded by (seed, family, i), so ``run_case(family, i, seed)``
replays a reported failure. tests/test_fuzz.py runs a fixed count per family in
CI; bench/fuzz.py runs long campaigns.
"""

from __future__ import annotations

import random
import re
import struct
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import format as F
from ..bank import BANK_SIZE
from ..codecs import Lossless, Raw, TopK
from ..errors import FormatError

FAMILIES = ("raw", "topk", "numba", "reference", "triton")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INTS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
GUARD = 64            # guard elements on each side of ``out``
OUT_LIMIT = 1 << 16   # largest header numel that a case decodes into a guarded ``out`` of that size
ALLOC_SLACK = 1 << 17  # elements an allocation may exceed the bound by (luts, padded streams)

# Header fields: name -> (offset, bytes), as in zipccl/format.py.
FIELDS = {"version": (4, 1), "codec": (5, 1), "dtype": (6, 1), "flags": (7, 1), "numel": (8, 8),
          "block_size": (16, 4), "ntables": (20, 1), "nsym": (21, 1), "maxlen": (22, 1), "reserved": (23, 1),
          "s0": (24, 4), "s1": (28, 4), "s2": (32, 8), "s3": (40, 8), "payload_crc": (48, 4)}


# ---- base packets ------------------------------------------------------------------------------------

@dataclass
class Base:
    """A valid packet of a family and what it decodes to."""
    label: str
    packet: np.ndarray      # uint8
    dtype: torch.dtype
    numel: int
    expected: torch.Tensor  # the decoded original, as integers
    checksum: bool


def _source(kind: str, n: int, grads: np.ndarray | None, seed: int) -> np.ndarray:
    """n float32 values of one kind of data."""
    rng = np.random.default_rng(seed)
    if kind == "grad" and grads is not None and len(grads) >= n:
        start = int(rng.integers(0, len(grads) - n + 1))
        return grads[start:start + n].astype(np.float32)
    if kind == "grad_x1e4" and grads is not None and len(grads) >= n:  # float16's normal range
        start = int(rng.integers(0, len(grads) - n + 1))
        return grads[start:start + n].astype(np.float32) * 1e4
    if kind == "mixed":  # exact zeros, infinities, NaNs, exponents far apart: escapes and raw blocks
        x = rng.normal(size=n) * 10.0 ** rng.integers(-40, 5, size=n)
        x[rng.random(n) < 0.2] = 0.0
        x[rng.random(n) < 0.01] = np.inf
        x[rng.random(n) < 0.01] = np.nan
        return x.astype(np.float32)
    if kind == "sparse":
        x = rng.laplace(0, 1e-3, size=n)
        x[rng.random(n) < 0.9] = 0.0
        return x.astype(np.float32)
    if kind == "zero_rows":  # +0.0 in runs of 1-64 (rows a batch did not touch): the run-by-run paths
        x = rng.laplace(0, 1e-3, size=n)
        ends = np.cumsum(rng.integers(1, 65, size=n // 2 + 2))
        for a, e in zip(ends[0::2], ends[1::2]):
            x[a:e] = 0.0
        return x.astype(np.float32)
    if kind == "random_bits":
        return rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    if kind == "zeros":
        return np.zeros(n, np.float32)
    return rng.normal(0, 1e-2, size=n).astype(np.float32)  # "gauss", and the gradients' stand-in


SOURCES = ("grad", "grad_x1e4", "gauss", "mixed", "sparse", "zero_rows", "random_bits", "zeros")
# (sizes, block sizes) per family: the interpreter and the reference decode small packets only.
SHAPES = {"raw": ((0, 1, 5, 300, 1000, 4097), (0,)),
          "topk": ((1, 5, 300, 1000, 4097), (0,)),
          "numba": ((0, 1, 7, 256, 300, 1000, 1500, 4097, 9000), (256, 1024, 4096, 512)),
          "reference": ((0, 1, 7, 256, 300, 600), (256, 1024)),
          "triton": ((0, 7, 300, 600, 300, 600), (256, 1024))}
DENSITIES = (0.01, 0.1, 0.5, 1.0)


def decoder(family: str):
    """The codec whose decoder a family exercises."""
    if family == "raw":
        return Raw()
    if family == "topk":
        return TopK()
    return Lossless(family)


def _encoder(family: str, i: int, checksum: bool, block_size: int):
    if family == "raw":
        return Raw()
    if family == "topk":
        return TopK(density=DENSITIES[i % len(DENSITIES)])
    # Every implementation encodes the same bytes: numba encodes for all (the interpreter is slow).
    return Lossless("numba", block_size=block_size, checksum=checksum)


def _make_bases(family: str, grads: np.ndarray | None) -> tuple[Base, ...]:
    sizes, block_sizes = SHAPES[family]
    bases = []
    i = 0
    for dname, dtype in DTYPES.items():
        for kind in SOURCES:
            for _ in range(2):
                pick = random.Random(f"base:{family}:{i}")
                n, bs = pick.choice(sizes), pick.choice(block_sizes)
                checksum = family not in ("raw", "topk") and i % 3 == 1
                x = torch.from_numpy(_source(kind, n, grads, seed=i)).to(dtype)
                codec = _encoder(family, i, checksum, bs)
                packet = codec.encode(x)
                # numba decodes for the slow two (invariant 2: every implementation gives the same bits)
                expected = decoder("numba" if family in ("reference", "triton") else family).decode(packet)
                if family != "topk":
                    assert torch.equal(expected.view(INTS[dtype]), x.view(INTS[dtype])), (family, kind, n)
                label = f"{dname}/{kind}/n={n}" + (f"/bs={bs}" if bs else "") + ("/crc" if checksum else "") + \
                    (f"/density={codec.density}" if family == "topk" else "")
                bases.append(Base(label, packet.numpy().copy(), dtype, n, expected.view(INTS[dtype]).clone(),
                                  checksum))
                i += 1
    return tuple(bases)


_BASES: dict = {}  # (family, id of the gradients) -> (gradients, packets)


def base_packets(family: str, grads: np.ndarray | None) -> tuple[Base, ...]:
    """The family's valid packets (42: every dtype, real gradient slices when ``grads`` is given,
    synthetic data), made once per process."""
    key = (family, id(grads))
    if key not in _BASES or _BASES[key][0] is not grads:
        _BASES[key] = (grads, _make_bases(family, grads))
    return _BASES[key][1]


def load_grads(path) -> np.ndarray | None:
    """The fp32 gradient bucket (flattened), or None if the file is missing."""
    try:
        return np.load(path).reshape(-1)
    except (FileNotFoundError, OSError):
        return None


# ---- mutations ---------------------------------------------------------------------------------------

def _get(buf: np.ndarray, name: str) -> int:
    off, size = FIELDS[name]
    return int.from_bytes(buf[off:off + size].tobytes(), "little")


def _set(buf: np.ndarray, name: str, value: int) -> None:
    off, size = FIELDS[name]
    buf[off:off + size] = np.frombuffer((value % (1 << (8 * size))).to_bytes(size, "little"), np.uint8)


def resign_header(buf: np.ndarray) -> None:
    """Recompute the header CRC (bytes 52..55) over bytes 0..51."""
    if len(buf) >= F.HEADER_SIZE:
        buf[52:56] = np.frombuffer(struct.pack("<I", zlib.crc32(buf[:52].tobytes())), np.uint8)


def resign_payload(buf: np.ndarray) -> None:
    """Recompute the payload CRC (if the flag is set and the packet holds its sections), then the header's."""
    if len(buf) < F.HEADER_SIZE:
        return
    total = F.HEADER_SIZE + sum(_get(buf, s) for s in ("s0", "s1", "s2", "s3"))
    if _get(buf, "flags") & F.FLAG_CRC and total <= len(buf):
        _set(buf, "payload_crc", zlib.crc32(buf[F.HEADER_SIZE:total].tobytes()))
    resign_header(buf)


def _sections(base: np.ndarray, buf: np.ndarray | None = None) -> list[tuple[int, int]]:
    """(start, stop) of the four sections as ``base``'s header declares them, clipped to ``buf``."""
    pos, out = F.HEADER_SIZE, []
    end = len(base if buf is None else buf)
    for s in ("s0", "s1", "s2", "s3"):
        size = _get(base, s)
        out.append((min(pos, end), min(pos + size, end)))
        pos += size
    return out


def _interesting(r: random.Random, v: int, bits: int) -> int:
    """A value of a ``bits``-wide field near ``v`` or at an edge (wrapped to the field's width)."""
    top = (1 << bits) - 1
    choices = (0, 1, v - 1, v + 1, top, 1 << r.randrange(bits), v * 2, v // 2,
               v + r.choice((-16, -8, -4, 4, 8, 16, 256, -256)), 1 << (bits - 1), v ^ (1 << r.randrange(bits)),
               r.randrange(top + 1))
    return r.choice(choices) & top


def _flip(r, buf, base):
    lo = F.HEADER_SIZE if len(buf) > F.HEADER_SIZE and r.random() < 0.9 else 0
    for _ in range(r.choice((1, 1, 2, 3, 8))):
        i = r.randrange(lo, len(buf))
        buf[i] ^= 1 << r.randrange(8)
    return buf, "flip"


def _flip_header(r, buf, base):
    for _ in range(r.choice((1, 1, 2))):
        i = r.randrange(4, 52)
        buf[i] ^= 1 << r.randrange(8)
    if r.random() < 0.9:
        resign_header(buf)
        return buf, "flip_header"
    return buf, "flip_header_unsigned"


def _truncate(r, buf, base):
    cut = r.choice((0, 1, F.HEADER_SIZE - 1, F.HEADER_SIZE, r.randrange(len(buf)), len(buf) - 1))
    return buf[:max(0, min(cut, len(buf) - 1))].copy(), "truncate"


def _extend(r, buf, base):
    extra = np.frombuffer(r.randbytes(r.choice((1, 3, 8, 64, 300))), np.uint8)
    return np.concatenate([buf, extra]), "extend"


def _field(r, buf, base):
    name = r.choice(tuple(FIELDS))
    size = FIELDS[name][1]
    old = _get(buf, name)
    if name == "numel" and r.random() < 0.4:
        new = r.choice((1 << 31, (1 << 31) + 1, 1 << 32, 1 << 40, 1 << 60, (1 << 63) - 1, 1 << 63, (1 << 64) - 1,
                        old + F.MAX_BLOCK_SIZE, old * 8, old + 1, max(old - 1, 0)))
    else:
        new = _interesting(r, old, 8 * size)
    _set(buf, name, new)
    if name != "payload_crc" and r.random() < 0.3:
        resign_payload(buf)  # a consistent payload CRC makes checksummed packets reach the body too
    else:
        resign_header(buf)
    return buf, f"field:{name}"


def _resize_section(r, buf, base):
    """A section grows or shrinks, with the header saying so: the packet's length stays consistent."""
    secs = _sections(base.packet)
    i = r.randrange(4)
    start, stop = secs[i]
    delta = r.choice((-16, -8, -4, -1, 1, 3, 4, 8, 16, 64))
    if stop - start + delta < 0:
        delta = start - stop
    at = r.randint(start, stop) if delta > 0 else r.randint(start, stop + delta)
    if delta > 0:
        buf = np.concatenate([buf[:at], np.frombuffer(r.randbytes(delta), np.uint8), buf[at:]])
    else:
        buf = np.concatenate([buf[:at], buf[at - delta:]])
    _set(buf, f"s{i}", stop - start + delta)
    if r.random() < 0.5:
        _set(buf, "numel", _get(buf, "numel") + r.choice((-1, 1, 8, -8, 256)))
    resign_payload(buf)
    return buf, f"resize:s{i}"


def _entry(r, buf, base):
    """A coded block names another entry of the bank of codes, so that its stream is read with a
    code it was not written with (format version 2's counterpart of a corrupt code table)."""
    start, stop = _sections(base.packet, buf)[1]
    entries = buf[start:start + (stop - start) // F.INDEX_ENTRY * F.INDEX_ENTRY].reshape(-1, F.INDEX_ENTRY)
    coded = np.flatnonzero(entries[:, 1] != F.RAW_BLOCK)
    if not len(coded):
        return _flip(r, buf, base)
    e = entries[int(coded[r.randrange(len(coded))])]
    e[1] = (int(e[1]) + r.randrange(1, BANK_SIZE)) % BANK_SIZE
    if r.random() < 0.5:
        resign_payload(buf)
    return buf, "entry"


def _index(r, buf, base):
    start, stop = _sections(base.packet, buf)[1]
    nb = (stop - start) // F.INDEX_ENTRY
    if not nb:
        return _flip(r, buf, base)
    b = r.randrange(nb)
    e = start + b * F.INDEX_ENTRY
    what = r.choice(("ref", "table", "nwords", "nzero", "pad", "move_words", "swap"))
    if what == "ref":
        buf[e] = _interesting(r, int(buf[e]), 8)
    elif what == "table":
        ntables = _get(base.packet, "ntables")
        buf[e + 1] = r.choice((ntables, max(ntables - 1, 0), F.RAW_BLOCK, F.RAW_BLOCK - 1, 0,
                               _interesting(r, int(buf[e + 1]), 8)))
    elif what in ("nwords", "nzero", "pad"):
        off = e + {"nwords": 2, "nzero": 4, "pad": 6}[what]
        old = int(buf[off]) | int(buf[off + 1]) << 8
        new = _interesting(r, old, 16)
        buf[off], buf[off + 1] = new & 255, new >> 8
    elif what == "move_words" and nb > 1:  # stream words move between blocks; the sum stays right
        c = r.randrange(nb)
        k = r.choice((1, 2, 8))
        for blk, sign in ((b, -1), (c, 1)):
            off = start + blk * F.INDEX_ENTRY + 2
            v = (int(buf[off]) | int(buf[off + 1]) << 8) + sign * k
            buf[off], buf[off + 1] = (v % 65536) & 255, (v % 65536) >> 8
    elif what == "swap" and nb > 1:
        c = r.randrange(nb)
        a, z = buf[e:e + 8].copy(), buf[start + c * 8:start + c * 8 + 8].copy()
        buf[e:e + 8], buf[start + c * 8:start + c * 8 + 8] = z, a
    else:
        buf[e + 2] ^= 1
    if r.random() < 0.7:
        resign_payload(buf)
    return buf, f"index:{what}"


def _index_resized(r, buf, base):
    """A coded block's zero count or stream words change, and its section-3 bytes or stream are
    cut or padded with noise at the block's end to match: the index still adds up, so the
    decoder's kernels read the block with a zero count its symbols contradict, or a stream cut
    short or run on (plain index mutations mostly stop at the index's sums)."""
    sections = _sections(base.packet, buf)
    start, stop = sections[1]
    nb = (stop - start) // F.INDEX_ENTRY
    rows = buf[start:start + nb * F.INDEX_ENTRY].reshape(-1, F.INDEX_ENTRY).astype(np.int64)
    coded = np.flatnonzero(rows[:, 1] != F.RAW_BLOCK)
    if not len(coded) or _get(buf, "codec") != F.CODEC_LOSSLESS or _get(buf, "dtype") not in F.DTYPES:
        return _flip(r, buf, base)
    layout = F.LAYOUTS[F.DTYPES[_get(buf, "dtype")]]
    n, bs = _get(buf, "numel"), _get(buf, "block_size")
    if not 0 < bs <= F.MAX_BLOCK_SIZE or not 0 < n <= nb * bs:  # a header another mutation broke
        return _flip(r, buf, base)
    nvalid = np.minimum(bs, n - np.arange(nb) * bs)
    words, nzero = rows[:, 2] | rows[:, 3] << 8, rows[:, 4] | rows[:, 5] << 8
    rest = np.where(rows[:, 1] == F.RAW_BLOCK, nvalid * layout.itemsize, layout.rest_len(nvalid - nzero))
    b = int(coded[r.randrange(len(coded))])
    if nvalid[b] <= 0:
        return _flip(r, buf, base)
    e = start + b * F.INDEX_ENTRY
    if r.random() < 0.5:
        new = min(max(int(nzero[b]) + r.choice((-3, -1, 1, 2, 5)), 0), int(nvalid[b]))
        old_len, new_len = int(rest[b]), layout.rest_len(int(nvalid[b]) - new)
        section, at, off, what = 3, sections[3][0] + int(rest[:b + 1].sum()), 4, "nzero"
    else:
        new = min(max(int(words[b]) + r.choice((-2, -1, 1, 3)), -(-int(nvalid[b]) // 32)), 65535)
        old_len, new_len = 4 * int(words[b]), 4 * new
        section, at, off, what = 2, sections[2][0] + 4 * int(words[:b + 1].sum()), 2, "nwords"
    if new_len > old_len:
        buf = np.concatenate([buf[:at], np.frombuffer(r.randbytes(new_len - old_len), np.uint8), buf[at:]])
    else:
        buf = np.concatenate([buf[:at - (old_len - new_len)], buf[at:]])
    buf[e + off], buf[e + off + 1] = new & 255, new >> 8
    _set(buf, f"s{section}", _get(buf, f"s{section}") + new_len - old_len)
    resign_payload(buf)
    return buf, f"index_resized:{what}"


def _payload_bytes(section: int, label: str):
    def mutate(r, buf, base):
        start, stop = _sections(base.packet, buf)[section]
        if stop <= start:
            return _flip(r, buf, base)
        how = r.randrange(3)
        if how == 0:
            for _ in range(r.choice((1, 2, 8))):
                buf[r.randrange(start, stop)] = r.randrange(256)
        elif how == 1:  # a run of one byte value (zeros: short codes; 0xFF: long ones)
            a = r.randrange(start, stop)
            b = min(stop, a + r.choice((4, 16, 64, 4096)))
            buf[a:b] = r.choice((0, 0xFF, 0x55, r.randrange(256)))
        else:
            buf[start:stop] = np.frombuffer(r.randbytes(stop - start), np.uint8)
        if r.random() < 0.5:
            resign_payload(buf)
        return buf, label
    return mutate


def _topk_index(r, buf, base):
    start, stop = _sections(base.packet, buf)[2]
    k = (stop - start) // 4
    if not k:
        return _flip(r, buf, base)
    stop = start + 4 * k  # an earlier mutation may have cut the section short
    idx = buf[start:stop].copy().view(np.int32)
    j = r.randrange(k)
    n = base.numel
    what = r.choice(("value", "dup", "swap", "negative", "numel"))
    if what == "value":
        idx[j:j + 1] = np.array([_interesting(r, int(idx[j]) & 0xFFFFFFFF, 32)], np.uint32).view(np.int32)
    elif what == "dup" and k > 1:
        idx[j] = idx[j - 1] if j else idx[1]
    elif what == "swap" and k > 1:
        c = r.randrange(k)
        idx[j], idx[c] = idx[c], idx[j]
    elif what == "negative":
        idx[j] = r.choice((-1, -(1 << 31), -n))
    else:
        idx[j] = r.choice((n, n - 1, n + 1, (1 << 31) - 1))
    buf[start:stop] = idx.view(np.uint8)
    return buf, f"topk:{what}"


def _splice(r, buf, base, other):
    """Bytes of another packet of the family over this one's, at the same offsets."""
    src = other.packet
    if r.random() < 0.3:  # the other's header over this body
        buf[:F.HEADER_SIZE] = src[:F.HEADER_SIZE]
        return buf, "splice:header"
    a = r.randrange(F.HEADER_SIZE, max(F.HEADER_SIZE + 1, min(len(buf), len(src))))
    b = min(len(buf), len(src), a + r.choice((8, 64, 1024, 1 << 20)))
    buf[a:b] = src[a:b]
    if r.random() < 0.5:
        resign_payload(buf)
    return buf, "splice:body"


_COMMON = (_flip, _flip, _flip_header, _truncate, _extend, _field, _field, _resize_section,
           _payload_bytes(3, "rest"))
MUTATIONS = {
    "raw": _COMMON,
    "topk": _COMMON + (_topk_index, _topk_index, _topk_index, _payload_bytes(2, "topk:bytes")),
    "lossless": _COMMON + (_entry, _entry, _index, _index, _index, _index, _index_resized, _index_resized,
                           _payload_bytes(2, "stream"), _payload_bytes(2, "stream"), _payload_bytes(0, "lengths")),
    # The Triton interpreter takes seconds per packet that reaches its kernel: its cases favour
    # mutations of the body that pass the (shared, host-side) validation.
    "deep": (_flip, _field, _truncate, _extend, _entry, _index, _index, _index_resized, _payload_bytes(3, "rest"),
             _payload_bytes(0, "lengths"), *(_payload_bytes(2, "stream"),) * 4),
}
DEEP = ("triton",)


def mutate(family: str, r: random.Random, base: Base, bases: tuple[Base, ...]) -> tuple[np.ndarray, str]:
    """A mutated copy of ``base.packet`` and the mutations' names."""
    ops = MUTATIONS["deep" if family in DEEP else family if family in MUTATIONS else "lossless"]
    buf = base.packet.copy()
    names = []
    for _ in range(r.choice((1, 1, 1, 1, 2, 3))):
        if r.random() < 0.05:
            buf, name = _splice(r, buf, base, r.choice(bases))
        else:
            buf, name = r.choice(ops)(r, buf, base)
        names.append(name)
        if name == "truncate":  # the other mutations address the header and the original's sections
            break
    if family in DEEP and names[-1] not in ("truncate", "flip_header_unsigned") and r.random() < 0.8:
        resign_payload(buf)
    return buf, "+".join(names)


# ---- checking one case -------------------------------------------------------------------------------

class Fence:
    """A buffer between two inaccessible pages: a packet copied to its start or its end sits next to
    a page whose any read or write kills the process (SIGSEGV), so that a decoder reading past its
    packet cannot go unnoticed (bench/fuzz.py runs each family in a child process and names the
    case that killed it; under pytest the run dies). Linux and macOS (mmap + mprotect)."""

    def __init__(self, size: int = 1 << 22):
        import ctypes
        import mmap
        self.page = mmap.PAGESIZE
        self.size = -(-size // self.page) * self.page
        self._map = mmap.mmap(-1, self.size + 2 * self.page)
        self._all = np.frombuffer(self._map, np.uint8)
        base = self._all.ctypes.data
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        for at in (base, base + self.page + self.size):
            if libc.mprotect(at, self.page, 0):  # PROT_NONE
                raise OSError(ctypes.get_errno(), "mprotect failed")
        self.body = self._all[self.page:self.page + self.size]

    def place(self, packet: np.ndarray, at_end: bool) -> np.ndarray:
        """A copy of ``packet`` against the leading (``at_end=False``) or the trailing fence."""
        n = len(packet)
        if n > self.size:
            return packet.copy()
        view = self.body[self.size - n:] if at_end else self.body[:n]
        view[:] = packet
        return view


_FENCE: list = []


def fence() -> Fence | None:
    """The process's fence, made on first use (None where mmap/mprotect are unavailable)."""
    if not _FENCE:
        try:
            _FENCE.append(Fence())
        except (OSError, AttributeError, ValueError):
            _FENCE.append(None)
    return _FENCE[0]


class OverBound(Exception):
    """An allocation above the case's bound (raised instead of allocating)."""


class AllocGuard:
    """Wraps torch.empty/zeros/full and numpy.empty/zeros while active: a call for more elements than
    ``limit`` raises OverBound instead of allocating (and is counted). Decoders allocate through these
    (kernels' scratch buffers, outputs, tables); other allocations are sized by the packet."""

    NAMES = (("torch", "empty"), ("torch", "zeros"), ("torch", "full"), ("numpy", "empty"), ("numpy", "zeros"))

    def __init__(self):
        self.limit: int | None = None
        self._saved = []

    def __enter__(self):
        import numpy
        modules = {"torch": torch, "numpy": numpy}
        for mod, name in self.NAMES:
            real = getattr(modules[mod], name)
            self._saved.append((modules[mod], name, real))
            setattr(modules[mod], name, self._wrap(real, name))
        return self

    def __exit__(self, *exc):
        for mod, name, real in reversed(self._saved):
            setattr(mod, name, real)
        self._saved.clear()

    def _wrap(self, real, name):
        def alloc(*args, **kwargs):
            if self.limit is not None:
                shape = args[0] if args else kwargs.get("size", kwargs.get("shape", ()))
                if not isinstance(shape, (tuple, list, torch.Size)):
                    shape = args if name != "full" and all(isinstance(a, int) for a in args) else (shape,)
                count = 1
                for d in shape:
                    count *= int(d)
                if count > self.limit:
                    raise OverBound(f"{name}({count} elements) above the bound of {self.limit}")
            return real(*args, **kwargs)
        return alloc


class CaseFailure(Exception):
    def __init__(self, category: str, message: str):
        super().__init__(f"{category}: {message}")
        self.category = category


def _header_of(buf: np.ndarray):
    try:
        return F.parse_header(buf[:F.HEADER_SIZE].tobytes(), None, len(buf))
    except FormatError:
        return None


def _reason(e: FormatError) -> str:
    """A FormatError's message without its numbers and quoted bytes: which check fired."""
    return re.sub(r"b'.*'|b\".*\"", "...", re.sub(r"\d+", "N", str(e)))[:80]


TWINS = ("reference", "triton")  # families whose every case numba decodes too: the same outcome, the same bits


def _compare_with_numba(packet: np.ndarray, kwargs: dict, outcome: str, result: torch.Tensor | None) -> None:
    """Invariant 2 on hostile packets: numba accepts exactly what the decoder under test accepts and
    decodes it to the same bits."""
    if "out" in kwargs:
        kwargs = {"out": torch.empty_like(kwargs["out"])}
    try:
        twin = Lossless("numba").decode(torch.from_numpy(packet.copy()), **kwargs)
    except FormatError:
        twin = None
    if (twin is None) != (outcome == "format_error"):
        raise CaseFailure("wrong", f"numba {'rejects' if twin is None else 'decodes'} a packet this decoder "
                                   f"{'decodes' if twin is None else 'rejects'}")
    if twin is not None and not torch.equal(twin.view(torch.uint8), result.view(torch.uint8)):
        raise CaseFailure("wrong", "numba decodes the packet to other bits")


def check_case(family: str, r: random.Random, base: Base, packet: np.ndarray, guard: AllocGuard,
               errors: dict) -> str:
    """Decode a mutated packet one of three ways; returns "format_error" (counting its reason in
    ``errors``) or "ok", or raises CaseFailure."""
    codec = decoder(family)
    h = _header_of(packet)
    mode = r.choice(("out", "out", "max_numel", "unbounded") if family != "topk" else ("out", "max_numel"))
    out = buf = None
    if mode == "out":
        fits = h is not None and h.numel <= OUT_LIMIT and r.random() < 0.85
        dtype, n = (h.dtype, h.numel) if fits else (base.dtype, base.numel)
        buf = torch.from_numpy(np.frombuffer(r.randbytes((n + 2 * GUARD) * 4), np.int32).copy())
        buf = buf.view(INTS[dtype])[:n + 2 * GUARD].clone()
        before = buf.clone()
        out = buf[GUARD:GUARD + n].view(dtype)
        bound = n
        kwargs = {"out": out}
    elif mode == "max_numel":
        bound = r.choice((base.numel, base.numel + 1, OUT_LIMIT))
        kwargs = {"max_numel": bound}
    else:  # out=None, no bound: what the packet itself makes plausible
        bound = 8 * len(packet)
        kwargs = {}
    f = fence()
    tensor = torch.from_numpy(packet if f is None else f.place(packet, at_end=r.random() < 0.75))
    guard.limit = bound + F.MAX_BLOCK_SIZE + 2 * len(packet) + ALLOC_SLACK
    try:
        result = codec.decode(tensor, **kwargs)
        outcome = "ok"
    except FormatError as e:
        outcome = "format_error"
        errors[_reason(e)] = errors.get(_reason(e), 0) + 1
    except OverBound as e:
        raise CaseFailure("alloc", str(e)) from None
    except Exception as e:  # noqa: BLE001 - anything but FormatError is the failure being looked for
        raise CaseFailure("crash", f"{type(e).__name__}: {e}") from None
    finally:
        guard.limit = None
    if buf is not None:
        if not torch.equal(buf[:GUARD], before[:GUARD]) or not torch.equal(buf[GUARD + bound:], before[GUARD + bound:]):
            raise CaseFailure("guard", "a write outside out")
    if family in TWINS:
        _compare_with_numba(packet, kwargs, outcome, result if outcome == "ok" else None)
    if outcome == "format_error":
        return outcome
    if h is None:
        raise CaseFailure("wrong", "decoded a packet whose header does not parse")
    if result.dtype != h.dtype or result.numel() != h.numel:
        raise CaseFailure("wrong", f"decoded {result.numel()} x {result.dtype}, header says {h.numel} x {h.dtype}")
    if out is not None and result.data_ptr() != out.data_ptr():
        raise CaseFailure("wrong", "decoded somewhere other than out")
    size = len(base.packet)
    unchanged = len(packet) >= size and np.array_equal(packet[:size], base.packet)
    if unchanged and not torch.equal(result.reshape(-1).view(INTS[base.dtype]), base.expected):
        raise CaseFailure("wrong", "an unchanged packet (trailing bytes added) decoded to other bits")
    if (base.checksum and not unchanged and np.array_equal(packet[:F.HEADER_SIZE], base.packet[:F.HEADER_SIZE])
            and not torch.equal(result.reshape(-1).view(INTS[base.dtype]), base.expected)):
        raise CaseFailure("wrong", "a corrupt payload passed its checksum")
    return outcome


def case_rng(seed: int, family: str, i: int) -> random.Random:
    return random.Random(f"{seed}:{family}:{i}")


def run_case(family: str, i: int, seed: int, bases: tuple[Base, ...], guard: AllocGuard,
             errors: dict | None = None) -> tuple[str, str]:
    """(outcome, mutation) of case ``i``; raises CaseFailure (with the mutation in its message)."""
    r = case_rng(seed, family, i)
    base = r.choice(bases)
    try:
        packet, what = mutate(family, r, base, bases)
    except Exception as e:  # noqa: BLE001 - a bug of this module, not of a decoder: reported apart
        raise CaseFailure("harness", f"case {i} ({base.label}): mutation failed: {type(e).__name__}: {e}") from None
    try:
        return check_case(family, r, base, packet, guard, {} if errors is None else errors), what
    except CaseFailure as e:
        raise CaseFailure(e.category, f"case {i} ({base.label}, {what}): {e}") from None


@dataclass
class Summary:
    family: str
    cases: int = 0
    format_error: int = 0
    ok: int = 0
    crash: int = 0
    guard: int = 0
    alloc: int = 0
    wrong: int = 0
    harness: int = 0      # this module's own errors (a mutation that failed), not the decoders'
    seconds: float = 0.0
    failures: list = field(default_factory=list)      # the first few messages
    mutations: dict = field(default_factory=dict)     # mutation -> [format_error, ok]
    errors: dict = field(default_factory=dict)        # FormatError reason -> count

    @property
    def failed(self) -> int:
        return self.crash + self.guard + self.alloc + self.wrong + self.harness

    def as_dict(self) -> dict:
        return {"family": self.family, "cases": self.cases, "format_error": self.format_error,
                "decoded_ok": self.ok, "crashes": self.crash, "guard_violations": self.guard,
                "over_bound_allocations": self.alloc, "wrong_decodes": self.wrong, "harness_errors": self.harness,
                "seconds": round(self.seconds, 2), "failures": self.failures,
                "mutations": dict(sorted(self.mutations.items())),
                "format_errors": dict(sorted(self.errors.items(), key=lambda kv: -kv[1]))}


def run(family: str, cases: int, seed: int = 0, grads: np.ndarray | None = None, start: int = 0,
        progress=None, every: float = 5.0, max_failures: int = 20, current=None) -> Summary:
    """Cases start..start+cases-1 of a family; ``progress(summary)`` every ``every`` seconds;
    ``current.value``, if given, is set to each case's number before it runs (so that a process
    watching this one can name the case that killed it)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown fuzz family {family!r}; choose from {', '.join(FAMILIES)}")
    bases = base_packets(family, grads)
    s = Summary(family)
    t0 = last = time.perf_counter()
    with AllocGuard() as guard:
        for i in range(start, start + cases):
            if current is not None:
                current.value = i
            try:
                outcome, what = run_case(family, i, seed, bases, guard, s.errors)
            except CaseFailure as e:
                setattr(s, e.category, getattr(s, e.category) + 1)
                if len(s.failures) < max_failures:
                    s.failures.append(str(e))
            else:
                setattr(s, outcome, getattr(s, outcome) + 1)
                for name in set(what.split("+")):
                    counts = s.mutations.setdefault(name.split(":")[0] if name.startswith("splice") else name, [0, 0])
                    counts[outcome == "ok"] += 1
            s.cases += 1
            now = time.perf_counter()
            if progress is not None and now - last >= every:
                s.seconds = now - t0
                progress(s)
                last = now
    s.seconds = time.perf_counter() - t0
    return s
