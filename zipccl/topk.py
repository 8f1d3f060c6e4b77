"""Lossy top-k sparsification as a codec: the k largest-magnitude entries as (int32 index, value).

Packets use the common header (codec 2): section 2 holds the indices (int32,
strictly ascending), section 3 the values in the tensor's dtype; sections 0 and
1 are empty. Selection is deterministic: the k largest |x| (NaN above Inf), ties to
the lower index, so every rank given the same tensor sends the same packet. Error feedback
(keeping what was not sent) lives in zipccl/feedback.py; collectives with a TopK
codec all-gather the packets and add them in rank order (zipccl.collectives).
"""

from __future__ import annotations

import functools
import math

import torch

from . import format as F
from .format import check_input
from .errors import FormatError, UnsupportedError
from .reference.packet import assemble, headers_of, host_bytes, to_host

__all__ = ["TopK"]

SAMPLE = 65536  # entries a sampled selection estimates its threshold from
MAX_NUMEL = 1 << 31  # indices are int32: larger tensors cannot be addressed


def check_addressable(numel: int) -> None:
    """Raise where a tensor has more elements than int32 indices address, before anything is
    selected: a wrapped index would count from the end, into another entry of the residual."""
    if numel > MAX_NUMEL:
        raise UnsupportedError(f"top-k addresses at most {MAX_NUMEL} elements (int32 indices), got {numel}")


def kth_largest(keys: torch.Tensor, k: int, spread: bool) -> torch.Tensor:
    """The k-th largest of the 1-D ``keys`` (a 0-d tensor where they are): torch.kthvalue, or with
    ``spread`` (CUDA) the least of torch.topk's k, the same value: CUDA's kthvalue selects with
    one thread block per slice, one SM for a whole bucket, where topk's radix select spans the GPU."""
    if spread:
        return torch.topk(keys, k, sorted=False).values.min()
    return torch.kthvalue(keys, keys.numel() - k + 1).values


def magnitude_keys(flat: torch.Tensor) -> torch.Tensor:
    """Each value's rank key (format.TOPK_NAN_KEY): |x|'s float32 bits as int32, NaN above Inf."""
    bits = flat.float().view(torch.int32) & 0x7FFFFFFF
    return torch.where(bits > 0x7F800000, F.TOPK_NAN_KEY, bits)


@functools.lru_cache(maxsize=32)
def _sample(numel: int, device: torch.device) -> torch.Tensor:
    """``SAMPLE`` positions below ``numel``, drawn and placed on ``device`` once: drawn for each
    call, they cost a draw on the host and, for a GPU, a copy from pageable memory, which waits
    for it, before every selection."""
    return torch.randint(0, numel, (SAMPLE,), generator=torch.Generator().manual_seed(numel)).to(device)


def _check_packet(packet) -> None:
    if not isinstance(packet, torch.Tensor) or packet.dtype != torch.uint8 or packet.dim() != 1:
        raise FormatError("a packet is a 1-D torch.uint8 tensor")


def _checked(h: F.Header, packet: torch.Tensor, max_numel: int | None) -> F.Header:
    """A top-k packet's parsed header ``h``, its codec and section sizes checked against each other
    and ``max_numel``; its payload CRC, where it has one, read from ``packet`` and checked."""
    if h.codec != F.CODEC_TOPK:
        raise FormatError(f"packet holds codec {h.codec}, expected codec {F.CODEC_TOPK}")
    F.check_numel(h, max_numel)
    if h.numel > MAX_NUMEL:
        raise FormatError(f"top-k packet claims {h.numel} elements; int32 indices address at most {MAX_NUMEL}")
    s0, s1, s2, s3 = h.sections
    itemsize = F.LAYOUTS[h.dtype].itemsize
    if s0 or s1 or s2 % 4 or s3 != s2 // 4 * itemsize or s2 // 4 > h.numel:
        raise FormatError(f"top-k sections do not match: {s2} index bytes and {s3} value bytes "
                          f"must pair up, at most one pair per element of {h.numel}")
    if h.flags:
        F.check_payload_crc(host_bytes(packet, 0, h.total_size).tobytes(), h)
    return h


class TopK:
    """Keep ``density`` of the entries (at least one): ``TopK(density=0.01)``.

    algorithm: how zipccl.all_reduce combines the ranks' packets: "gather" (everyone gets every
    rank's pairs), "scatter" (owners reduce their chunk, then share it) or "auto" (the one that
    moves fewer bytes: zipccl.collectives.sparse_algorithm). All give the same bits.
    sampled: estimate the magnitude threshold from a fixed sample of SAMPLE entries and send
    everything at or above it (about k entries, at most 2k; DGC's trick): one pass instead
    of an exact selection, 4x faster on a 7M-element bucket. Deterministic, but not exactly k."""
    name = "topk"
    exact = False

    def __init__(self, density: float = 0.01, algorithm: str = "auto", sampled: bool = False):
        if not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if algorithm not in ("auto", "gather", "scatter"):
            raise ValueError(f"algorithm must be 'auto', 'gather' or 'scatter', got {algorithm!r}")
        self.density = float(density)
        self.algorithm, self.sampled = algorithm, bool(sampled)
        self._last = None

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.density * numel))) if numel else 0

    def sample_k(self) -> int:
        """How many of the sample's largest magnitudes the sampled threshold keeps."""
        return min(SAMPLE, max(1, math.ceil(self.density * SAMPLE)))

    def select(self, x: torch.Tensor, remember: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices int32 ascending, values) of the k largest |x|, ties to the lower index.

        ``remember=True`` keeps the result (and a reference to ``x``, so its memory cannot be
        reused) for the next call on the same unmodified tensor or a view of it, which takes it:
        error feedback and the collective that follows then select once."""
        check_input(x)
        check_addressable(x.numel())
        last, self._last = self._last, None
        if last is not None:
            held, version, result = last
            if held.data_ptr() == x.data_ptr() and held.numel() == x.numel() and x._version == version:
                return result
        result = self._select(x.reshape(-1))
        if remember:
            self._last = (x, x._version, result)
        return result

    def remember(self, x: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Make (idx, values), chosen elsewhere (zipccl.kernels.sparse), the next ``select`` of the
        unmodified ``x``, as ``select(x, remember=True)`` would."""
        self._last = (x, x._version, (idx, values))

    def samples(self, numel: int) -> bool:
        """Whether a selection of ``numel`` elements is sampled (about k entries, at most 2k), not exact."""
        return self.sampled and numel > 4 * SAMPLE

    def sample_positions(self, numel: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The positions a sampled selection estimates its threshold from (the same for every
        tensor of ``numel`` elements), on ``device``, or None where it selects exactly. Not to be
        written: one tensor per size and device serves every call."""
        if not self.samples(numel):
            return None
        return _sample(numel, torch.device(device))

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_last"}

    def __setstate__(self, state):
        self.__dict__.update(state, _last=None)

    def _select(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = flat.numel(), self.k(flat.numel())
        if k == n:
            idx = torch.arange(n, device=flat.device)
            return idx.to(torch.int32), flat[idx]
        mag = magnitude_keys(flat)
        pos = self.sample_positions(n, flat.device)
        if pos is not None:
            kth = SAMPLE - self.sample_k() + 1
            idx = torch.nonzero(mag >= torch.kthvalue(mag[pos], kth).values).reshape(-1)
            if 0 < idx.numel() <= 2 * k:
                return idx.to(torch.int32), flat[idx]
        # O(n): the k-th largest magnitude, everything above it, then ties by index.
        threshold = kth_largest(mag, k, mag.is_cuda)
        above = torch.nonzero(mag > threshold).reshape(-1)
        ties = torch.nonzero(mag == threshold).reshape(-1)[:k - above.numel()]
        idx = torch.sort(torch.cat([above, ties])).values
        return idx.to(torch.int32), flat[idx]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        idx, values = self.select(x)
        return self.encode_selected(idx, values, x.numel())

    def encode_selected(self, idx: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
        """A packet of already chosen entries (indices int32 strictly ascending)."""
        check_addressable(numel)
        empty = idx.new_zeros(0, dtype=torch.uint8)
        header = F.Header(F.CODEC_TOPK, values.dtype, numel)
        return assemble(header, [empty, empty, idx.contiguous().view(torch.uint8),
                                 values.contiguous().view(torch.uint8)])

    def header(self, packet: torch.Tensor, max_numel: int | None = None, head: bytes | None = None) -> F.Header:
        """Validate a packet's header and section sizes (not its indices: ``parse`` does).
        ``max_numel``: FormatError for a packet that claims more elements (a sparse packet's size
        does not bound its numel: pass a bound, or ``out``, for packets from elsewhere). ``head``:
        the packet's header bytes where the caller has read them (reference.packet.headers_of)."""
        _check_packet(packet)
        if head is None:
            head = host_bytes(packet, 0, F.HEADER_SIZE).tobytes()
        return _checked(F.parse_header(head, F.CODEC_TOPK, packet.numel()), packet, max_numel)

    def parse(self, packet: torch.Tensor,
              max_numel: int | None = None) -> tuple[F.Header, torch.Tensor, torch.Tensor]:
        """Validate a packet: (header, indices int64, values); ``max_numel`` as in ``header``."""
        return self.parse_many([packet], max_numel)[0]

    def parse_many(self, packets: list[torch.Tensor], max_numel: int | None = None,
                   headers: list[F.Header] | None = None) -> list[tuple[F.Header, torch.Tensor, torch.Tensor]]:
        """``parse`` of each packet (all on one device), in two reads of the device in all (their
        headers, then their indices' checks), not two each: a sparse collective's packets from n
        ranks wait for a GPU twice, not 2n times. ``headers``: the packets' headers where the
        caller has read them already (parse_header; checked here as top-k's): one read. FormatError
        for the first bad header, else the first packet whose indices are out of range or not
        strictly ascending."""
        for p in packets:
            _check_packet(p)
        if headers is None:
            headers = [F.parse_header(head, F.CODEC_TOPK, p.numel()) for p, head in zip(packets, headers_of(packets))]
        found = []
        for p, h in zip(packets, headers):
            h = _checked(h, p, max_numel)
            s2, s3 = h.sections[2], h.sections[3]
            start = F.HEADER_SIZE
            idx = p[start:start + s2].clone().view(torch.int32).to(torch.int64)
            values = p[start + s2:start + s2 + s3].clone().view(h.dtype)
            found.append((h, idx, values))
        checked = [(h, idx) for h, idx, _ in found if idx.numel()]
        if checked:  # the checks of every packet in one read (bounded: reference.packet.to_host)
            flags = to_host(torch.stack([torch.stack([idx[0] < 0, idx[-1] >= h.numel, (idx[1:] <= idx[:-1]).any()])
                                         for h, idx in checked]))
            for (h, _), (below, beyond, unordered) in zip(checked, flags.tolist()):
                if below or beyond:
                    raise FormatError(f"top-k index out of range [0, {h.numel})")
                if unordered:
                    raise FormatError("top-k indices must be strictly ascending (no duplicates)")
        return found

    def decode(self, packet: torch.Tensor, out: torch.Tensor | None = None, *,
               max_numel: int | None = None) -> torch.Tensor:
        """The dense tensor: the sent entries, zeros elsewhere. Without ``out``, pass ``max_numel``
        for packets from elsewhere: a top-k packet of a few bytes may claim 2**31 elements."""
        h, idx, values = self.parse(packet, max_numel)
        if out is None:
            out = torch.zeros(h.numel, dtype=h.dtype, device=packet.device)
        else:
            out = F.check_out(h, out)
            out.zero_()
        out[idx] = values
        return out

    def max_encoded_size(self, numel: int, dtype: torch.dtype) -> int:
        k = min(numel, 2 * self.k(numel)) if self.sampled else self.k(numel)
        return F.HEADER_SIZE + k * (4 + F.LAYOUTS[dtype].itemsize)

    def __repr__(self) -> str:
        return f"TopK(density={self.density}, algorithm={self.algorithm!r}, sampled={self.sampled})"
