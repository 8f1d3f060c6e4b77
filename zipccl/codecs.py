"""Codecs: one protocol (encode, decode, max_encoded_size) over 1-D uint8 packets.

Every packet starts with the header of zipccl/format.py, so any codec's
decoder can reject a packet of another codec, dtype or size with FormatError.
"""

from __future__ import annotations

from typing import Protocol

import torch

from . import format as F
from .format import check_input
from .errors import FormatError, UnsupportedError
from .kernels import IMPLS, resolve
from .reference.packet import Verdict, assemble, host_bytes, parse_lossless, read_index
from .topk import TopK

__all__ = ["Codec", "Raw", "Lossless", "TopK", "packet_size", "check_input"]


class Codec(Protocol):
    name: str

    def encode(self, x: torch.Tensor) -> torch.Tensor: ...

    def decode(self, packet: torch.Tensor, out: torch.Tensor | None = None, *,
               max_numel: int | None = None) -> torch.Tensor: ...

    def max_encoded_size(self, numel: int, dtype: torch.dtype) -> int: ...


def _check_packet(packet: torch.Tensor) -> torch.Tensor:
    """The packet as a contiguous 1-D uint8 tensor (kernels address its bytes directly)."""
    if not isinstance(packet, torch.Tensor) or packet.dtype != torch.uint8 or packet.dim() != 1:
        raise FormatError("a packet is a 1-D torch.uint8 tensor")
    return packet if packet.is_contiguous() else packet.contiguous()


def _output(header: F.Header, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The decoder's output: ``out`` checked, or a new tensor of the header's size (call only once
    the packet has been found to hold that many elements and the caller's bound allows them)."""
    if out is None:
        return torch.empty(header.numel, dtype=header.dtype, device=device)
    return F.check_out(header, out)


def packet_size(packet: torch.Tensor) -> int:
    """Total bytes of the packet at the start of ``packet`` (trailing bytes are ignored by decoders)."""
    _check_packet(packet)
    return F.parse_header(host_bytes(packet, 0, F.HEADER_SIZE).tobytes(), None, packet.numel()).total_size


class Raw:
    """No compression: the header followed by the tensor's bytes."""
    name = "raw"

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x)
        flat = x.reshape(-1)
        data = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)  # stride 0 won't view
        empty = data[:0]
        return assemble(F.Header(F.CODEC_RAW, x.dtype, x.numel()), [empty, empty, empty, data])

    def decode(self, packet: torch.Tensor, out: torch.Tensor | None = None, *,
               max_numel: int | None = None) -> torch.Tensor:
        """The tensor (1-D) a raw packet holds, into ``out`` if given. ``max_numel``: FormatError
        for a packet that claims more elements (before anything of its claimed size is allocated)."""
        packet = _check_packet(packet)
        h = F.parse_header(host_bytes(packet, 0, F.HEADER_SIZE).tobytes(), F.CODEC_RAW, packet.numel())
        F.check_numel(h, max_numel)
        itemsize = F.LAYOUTS[h.dtype].itemsize
        if h.sections != (0, 0, 0, h.numel * itemsize):
            raise FormatError(f"raw packet sections {h.sections} do not match its {h.numel} elements "
                              f"of {itemsize} bytes")
        if h.flags:
            F.check_payload_crc(host_bytes(packet, 0, h.total_size).tobytes(), h)
        out = _output(h, out, packet.device)
        out.view(torch.uint8).copy_(packet[F.HEADER_SIZE:h.total_size])
        return out

    def max_encoded_size(self, numel: int, dtype: torch.dtype) -> int:
        return F.HEADER_SIZE + numel * F.LAYOUTS[_dtype(dtype)].itemsize

    def __repr__(self) -> str:
        return "Raw()"


def _dtype(dtype: torch.dtype) -> torch.dtype:
    F.dtype_code(dtype)
    return dtype


class Lossless:
    """Bit-exact exponent coding (docs/FORMAT.md): bf16 shrinks to about two thirds.

    impl: "auto" (numba on CPU, Triton on CUDA), "reference", "numba" or "triton".
    block_size: elements per independently coded block, a power of two in [256, 32768]; by default
        4096 (the Triton decoder runs one lane per 256-element sub-stream, whatever the block size).
        Any implementation decodes any block size; the Triton encoder takes up to 16384
        (kernels/gpu.py's MAX_ENCODE_BLOCK: its shared memory).
    checksum: store a CRC32 of the payload and verify it on decode (costs a host pass).
    """
    name = "lossless"

    def __init__(self, impl: str = "auto", block_size: int | None = None, checksum: bool = False):
        if block_size is not None and (not isinstance(block_size, int) or block_size & (block_size - 1)
                                       or not F.MIN_BLOCK_SIZE <= block_size <= F.MAX_BLOCK_SIZE):
            raise ValueError(f"block_size must be a power of two in [{F.MIN_BLOCK_SIZE}, {F.MAX_BLOCK_SIZE}], "
                             f"got {block_size!r}")
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")
        self.impl, self.block_size, self.checksum = impl, block_size, checksum

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x)
        kernels = resolve(self.impl, x.device)
        block_size = self.block_size or getattr(kernels, "BLOCK_SIZE", F.DEFAULT_BLOCK_SIZE)
        return kernels.encode(x.reshape(-1), block_size, self.checksum)

    def encode_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``encode(x)``'s packet written to the front of ``out``, a contiguous 1-D uint8 tensor on
        x's device of at least ``max_encoded_size(x.numel(), x.dtype)`` bytes, 4-byte aligned; its
        size is returned as a 0-d int64 tensor on that device. With the Triton kernels the host
        reads nothing (no checksum): a pipeline can read sizes in batches, and a CUDA graph can
        capture the call. Elsewhere, ``encode`` and a copy."""
        check_input(x)
        bound = self.max_encoded_size(x.numel(), x.dtype)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1 \
                or not out.is_contiguous() or out.device != x.device or out.numel() < bound or out.data_ptr() % 4:
            got = (f"{out.dtype} {tuple(out.shape)} on {out.device}, contiguous {out.is_contiguous()}, address "
                   f"{out.data_ptr()}" if isinstance(out, torch.Tensor) else type(out).__name__)
            raise ValueError(f"encode_into needs a contiguous 1-D uint8 tensor on {x.device} of at least {bound} "
                             f"bytes at a 4-byte aligned address; got {got}")
        kernels = resolve(self.impl, x.device)
        if hasattr(kernels, "encode_into") and not self.checksum:
            block_size = self.block_size or kernels.BLOCK_SIZE
            return kernels.encode_into(x.reshape(-1), out, block_size)
        packet = self.encode(x)
        out[:packet.numel()] = packet
        return torch.tensor(packet.numel(), dtype=torch.int64, device=x.device)

    def slot(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes between two packets of ``encode_many``: the bound, rounded up to 16."""
        return -(-self.max_encoded_size(numel, dtype) // 16) * 16

    def encode_many(self, parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``encode_into`` of each of ``parts`` (tensors of one dtype, numel and device), packet k
        at ``out[k * slot:]`` (``slot(numel, dtype)``; ``out`` contiguous 1-D uint8 of at least
        ``len(parts) * slot`` bytes on their device, 16-byte aligned); their sizes as an int64
        tensor there. With the Triton kernels, contiguous parts of one storage (the rows or
        chunks a collective sends its peers) take one launch sequence for them all, as one
        encode_into does for one; otherwise one encode_into each."""
        if not parts:
            raise ValueError("encode_many needs at least one tensor")
        for x in parts:
            check_input(x)
        first = parts[0]
        if any(x.dtype != first.dtype or x.numel() != first.numel() or x.device != first.device for x in parts):
            raise ValueError("encode_many takes tensors of one dtype, numel and device; got "
                             + ", ".join(f"{x.dtype} {x.numel()} on {x.device}" for x in parts))
        slot = self.slot(first.numel(), first.dtype)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1 \
                or not out.is_contiguous() or out.device != first.device or out.numel() < len(parts) * slot \
                or out.data_ptr() % 16:
            raise ValueError(f"encode_many needs a contiguous 1-D uint8 tensor on {first.device} of at least "
                             f"{len(parts)} x {slot} bytes at a 16-byte aligned address")
        kernels = resolve(self.impl, first.device)
        storage = first.untyped_storage().data_ptr()
        if hasattr(kernels, "encode_many") and not self.checksum and all(
                x.is_contiguous() and x.untyped_storage().data_ptr() == storage
                and (x.data_ptr() - first.data_ptr()) % x.element_size() == 0 for x in parts):
            return kernels.encode_many([x.reshape(-1) for x in parts], out, slot,
                                       self.block_size or kernels.BLOCK_SIZE)
        return torch.stack([self.encode_into(x, out[k * slot:(k + 1) * slot]) for k, x in enumerate(parts)])

    def decode(self, packet: torch.Tensor, out: torch.Tensor | None = None, *,
               max_numel: int | None = None) -> torch.Tensor:
        """The tensor (1-D) a lossless packet holds, into ``out`` if given. The header is
        validated against the packet and ``max_numel`` (FormatError for a packet that claims
        more elements) before the output is allocated or a kernel runs; so is the block index on
        the host. On the GPU the index is checked where it is, and no kernel reads through it
        until it is known good: a bad one raises at the call's end with ``out`` untouched. A
        bad stream behind a good index is found as it decodes: ``out`` is then partly written."""
        packet = _check_packet(packet)
        kernels = resolve(self.impl, packet.device)
        h = F.parse_header(host_bytes(packet, 0, F.HEADER_SIZE).tobytes(), F.CODEC_LOSSLESS, packet.numel())
        F.check_numel(h, max_numel)
        parsed = parse_lossless(packet, h, getattr(kernels, "read_index", read_index))  # GPU: on the device
        out = _output(h, out, packet.device)
        if out.device != packet.device:
            raise UnsupportedError(f"out is on {out.device}, the packet on {packet.device}")
        return kernels.decode(packet, out, parsed)

    def decode_into(self, packet: torch.Tensor, out: torch.Tensor) -> Verdict:
        """Decode a packet that must hold ``out.numel()`` elements of ``out.dtype`` into ``out``,
        the mirror of ``encode_into``: with the Triton kernels the host reads nothing (the header
        and index are checked on the device, and nothing is decoded unless they hold), and the
        returned Verdict tells later, in one read (``check()``, ``problem()``, or
        ``zipccl.reference.packet.read_all`` for many), what was wrong, in ``decode``'s words
        wherever ``decode`` refuses the packet too. A CUDA graph can capture it. There the
        packet's blocks must be this codec's block size (Triton's default where unset), and it
        must carry no payload checksum. Elsewhere ``decode``, its FormatError kept in the verdict."""
        packet = _check_packet(packet)
        if not isinstance(out, torch.Tensor) or not out.is_contiguous() or out.device != packet.device:
            raise ValueError(f"decode_into needs a contiguous out on the packet's device ({packet.device})")
        F.dtype_code(out.dtype)
        kernels = resolve(self.impl, packet.device)
        block_size = self.block_size or getattr(kernels, "BLOCK_SIZE", F.DEFAULT_BLOCK_SIZE)
        if hasattr(kernels, "decode_into"):
            return kernels.decode_into(packet, out.view(-1), block_size)
        try:
            self.decode(packet, out, max_numel=out.numel())
            known = None
        except FormatError as e:
            known = str(e)
        return Verdict(None, packet.numel(), out.numel(), out.dtype, block_size, known)

    def decode_many(self, packets: list[torch.Tensor], outs: list[torch.Tensor]) -> list[Verdict]:
        """``decode_into`` of each packet into its out (outs of one dtype, numel and device): their
        Verdicts. With the Triton kernels, packets in one buffer at 4-byte aligned places (the
        slots of a piece's receives) and contiguous outs of one storage take one launch
        sequence for them all, as one decode_into does for one; otherwise one decode_into each."""
        if len(packets) != len(outs) or not packets:
            raise ValueError(f"decode_many needs as many outs as packets, at least one; got {len(packets)} packets "
                             f"and {len(outs)} outs")
        packets = [_check_packet(p) for p in packets]
        first, device = outs[0], packets[0].device
        for out in outs:
            if not isinstance(out, torch.Tensor) or not out.is_contiguous() or out.device != device \
                    or out.dtype != first.dtype or out.numel() != first.numel():
                raise ValueError(f"decode_many needs contiguous outs of one dtype and numel on the packets' device "
                                 f"({device})")
        F.dtype_code(first.dtype)
        kernels = resolve(self.impl, device)
        same = [p.untyped_storage().data_ptr() == packets[0].untyped_storage().data_ptr() and p.data_ptr() % 4 == 0
                and p.device == device for p in packets]
        same += [o.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                 and (o.data_ptr() - first.data_ptr()) % o.element_size() == 0 for o in outs]
        if hasattr(kernels, "decode_many") and all(same):
            return kernels.decode_many(packets, [o.view(-1) for o in outs],
                                       self.block_size or getattr(kernels, "BLOCK_SIZE", F.DEFAULT_BLOCK_SIZE))
        return [self.decode_into(p, o) for p, o in zip(packets, outs)]

    def max_encoded_size(self, numel: int, dtype: torch.dtype) -> int:
        prefix = F.prefix_sizes(numel, self.block_size or F.MIN_DEFAULT_BLOCK_SIZE)
        return F.HEADER_SIZE + sum(prefix) + numel * F.LAYOUTS[_dtype(dtype)].itemsize

    def __repr__(self) -> str:
        return f"Lossless(impl={self.impl!r}, block_size={self.block_size}, checksum={self.checksum})"


