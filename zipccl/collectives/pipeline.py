"""Pipeline pieces: how a phase is cut, and how one piece's packets are sized, sent, received and landed."""

from __future__ import annotations

import itertools

import torch

from .. import config
from ..codecs import Lossless, Raw
from ..errors import FormatError
from ..failure import DECODE, ENCODE, SIZE, Fate
from ..reference.packet import to_host
from .metadata import Call, _SizeMail, _meta_bytes, _peers, timed


#: Pipelining: each phase moves in pieces of about this many input bytes (all ranks' chunks
#: together), so that encoding piece k+1 and decoding piece k-1 overlap piece k on the wire.
PIECE_BYTES = 8 << 20
MAX_PIECES = 16
MOST_PIECES = MAX_PIECES + 4  # a phase's, its first and last pieces cut again into three (pieces)
MIN_RAMP = 4096  # elements: the smallest piece that pieces() cuts off the first or last
#: A plain codec's pieces (see ``plain``): with nothing to overlap but the reduction, fewer and
#: larger messages cost less of the host.
PLAIN_PIECE_BYTES = 16 << 20
#: On GPUs a piece costs the host more than its coding costs the GPU: its launch sequences (about
#: 0.3 ms to encode and 0.45 ms to decode on an H200's host) and NCCL groups (its sizes, its
#: packets), against about 0.12 ms of kernels to encode or decode 8 MiB of bf16 (docs/GPU.md). In
#: the one-GPU lab shaped to 10 Gbit/s per rank, at 41adf7a, a lossless all-reduce of 64 MiB in 24
#: pieces of up to 8 MiB took 119 ms against NCCL's 85, and one of 256 MiB in 40 of up to 16 MiB 257
#: against 340.
CUDA_PIECE_BYTES = 32 << 20


def piece_bytes(cuda: bool, plain: bool = False) -> int:
    """A piece's input bytes: ZIPCCL_PIECE_BYTES where set, else the device's; a plain codec's
    PLAIN_PIECE_BYTES, or a coded piece's where that is set or on CUDA and larger."""
    if plain:
        return max(PLAIN_PIECE_BYTES, config.PIECE_BYTES or (CUDA_PIECE_BYTES if cuda else 0))
    return config.PIECE_BYTES or (CUDA_PIECE_BYTES if cuda else PIECE_BYTES)


def pieces(m: int, n: int, itemsize: int, plain: bool = False, cuda: bool = False) -> list[tuple[int, int]]:
    """Element ranges [a, b) that cut a chunk of ``m`` elements into pipeline pieces of
    ``piece_bytes`` (``cuda``: the tensors are on a GPU). On CPU, where there are several, the
    first is cut again into a quarter, a quarter and a half, and the last into a half, a quarter
    and a quarter: the links idle while the first piece is encoded and while the last is
    decoded, so those pieces are small (see _sizes). On a GPU, which codes a piece in less time
    than the host takes to launch it, and for a plain codec's pieces (``plain``: nothing to
    encode or decode), they are not cut again."""
    count = max(1, min(MAX_PIECES, -(-m * n * itemsize // piece_bytes(cuda, plain)), m))
    step = max(1, -(-m // count))
    cuts = [(a, min(m, a + step)) for a in range(0, m, step)] or [(0, 0)]
    if plain or cuda or len(cuts) < 2 or step < 4 * MIN_RAMP:
        return cuts
    return _split(*cuts[0], (1, 1, 2)) + cuts[1:-1] + _split(*cuts[-1], (2, 1, 1))


def _split(a: int, b: int, weights: tuple[int, ...]) -> list[tuple[int, int]]:
    """[a, b) cut in proportion to ``weights``; a part that would be shorter than MIN_RAMP
    elements joins its neighbour."""
    total, bounds, done = sum(weights), [a], 0
    for w in weights[:-1]:
        done += w
        edge = a + (b - a) * done // total
        if edge - bounds[-1] >= MIN_RAMP and b - edge >= MIN_RAMP:
            bounds.append(edge)
    return list(zip(bounds, bounds[1:] + [b]))


def _sizes(t, call: Call | None, tag: int, acc: dict, encode, fate: Fate, peers: list[int] | None = None):
    """(packets, sizes) from ``encode()``, which returns the packets and their sizes by
    destination, and a _SizeMail on ``tag`` of those sizes. With ``call`` (a call's first
    piece) the call's metadata exchange runs while the piece is encoded: nothing is on the
    wire until the first piece is, so the exchange's round trip would add to the call's time
    (with the smaller first and last pieces of ``pieces``, the 64 MiB all-reduce in the
    1 Gbit/s lab took 3-21 ms less, paired medians of four alternations: about 1%). Once
    the call has failed (here, or heard of), nothing is encoded: packets is None and the
    sizes carry the poison code (zipccl.failure). ``peers``: the ranks the mail goes to (_SizeMail)."""
    finish = call.start(t, fate=fate) if call is not None else None
    packets, sizes = None, [0] * t.size
    if not fate.failed:
        try:
            packets, sizes = encode()
        except Exception as e:  # noqa: BLE001 - every failure reaches the peers
            fate.fail(ENCODE, e)
    if finish is not None:
        timed(acc, "comm_seconds", finish)
        acc["meta_bytes"] += _meta_bytes(t.size)
    return packets, _SizeMail(t, sizes, tag, acc, fate, peers)


def post(t, packets, mail: _SizeMail, tag: int, acc: dict, device, bound: int) -> tuple[list, dict]:
    """Post a piece's packets and receives, as one group: (sends, {peer: (buffer, work)}).
    ``packets[j]`` goes to peer j (or one packet to every peer), or one byte each if the
    piece's sizes went out poisoned. Where the transport takes receives larger than their
    message (``loose_receives``: gloo), each receive is posted at once at ``bound``, the
    codec's bound, and the size mail says later how much of it is the packet: posting only
    once a peer's size had come (behind the peer's previous piece on the same connection)
    held its data back, the 64 MiB all-reduce in the 1 Gbit/s lab, alternating five times,
    675-762 ms -> 625-693 ms (median 712 -> 653). Elsewhere (NCCL) each receive has its
    packet's exact size, so the host waits for the peers' sizes first (invariant 12)."""
    fate = mail.fate
    peers = [j for j in _peers(t) if fate.alive(t, j)]
    lengths = {j: max(1, bound) for j in peers} if t.loose_receives else \
        {j: min(n, max(1, bound)) for j in peers if (n := mail.wire_size(j)) is not None}  # _land fails a larger one
    stand_in = torch.zeros(1, dtype=torch.uint8, device=device) if mail.poisoned else None
    own = mail.own() if isinstance(packets, Deferred) and stand_in is None else None  # with the peers' sizes
    sends, recvs = [], {}
    slot = -(-max(lengths.values(), default=0) // 16) * 16  # the receives: places of one buffer (decode_all)
    pool = torch.empty(len(lengths) * slot, dtype=torch.uint8, device=device)
    with t.grouped():
        for j in peers:
            if fate.alive(t, j):
                packet = stand_in if stand_in is not None else packets if isinstance(packets, torch.Tensor) \
                    else packets.packet(j, own[j]) if own is not None else packets[j]
                sends.append((j, fate.send(t, packet, j, tag)))
                acc["wire_bytes"] += packet.numel()
        for i, (j, n) in enumerate(lengths.items()):
            if fate.alive(t, j):
                buf = pool[i * slot:i * slot + n]
                recvs[j] = buf, fate.recv(t, buf, j, tag)
    return sends, recvs


def plain(codec) -> bool:
    """Whether ``codec`` moves a piece's bytes as they are: zipccl's Raw (not a subclass, which
    may code). Its pieces need no packet (no header, no copy: the tensor's own bytes go), no size
    mail (each message's size is the piece's, known to both ends) and no decode (each peer's
    bytes are received where they belong): nothing for the host to wait for before posting, or
    to read. In a failed call its messages keep their sizes (the status round tells the peers)."""
    return type(codec) is Raw


def post_plain(t, sends: dict, recvs: dict, tag: int, acc: dict, fate: Fate) -> tuple[list, dict]:
    """Post a plain piece as one group: ``sends`` {peer: tensor}, ``recvs`` {peer: buffer}, each
    as its bytes; (sends, {peer: work}) as ``post`` returns them, for the peers still alive."""
    posted, works = [], {}
    with t.grouped():
        for j, x in sends.items():
            if fate.alive(t, j):
                posted.append((j, fate.send(t, x.view(torch.uint8), j, tag)))
                acc["wire_bytes"] += x.numel() * x.element_size()
        for j, buf in recvs.items():
            if fate.alive(t, j):
                works[j] = fate.recv(t, buf.view(torch.uint8), j, tag)
    return posted, works


def land_plain(t, sends: list, recvs: dict, acc: dict, fate: Fate) -> None:
    """Wait for a plain piece's messages (its receives first)."""
    for j, w in recvs.items():
        timed(acc, "comm_seconds", fate.wait, t, w, j)
    for j, w in sends:
        timed(acc, "comm_seconds", fate.wait, t, w, j)


def _without_host_reads(codec, x: torch.Tensor, method: str) -> bool:
    """Whether ``codec`` codes ``x`` (a tensor or packet) without a host read through its
    ``*_into`` twin of ``method``: on CUDA (the Triton kernels), zipccl's Lossless with its own
    ``method`` (a subclass's is kept), no payload checksum."""
    return (x.is_cuda and isinstance(codec, Lossless) and getattr(type(codec), method) is getattr(Lossless, method)
            and not codec.checksum)


def batches(codec, x: torch.Tensor) -> bool:
    """Whether ``encode_all`` encodes ``x``'s kind of parts into one buffer (``encode_into``) and
    reads their sizes at once."""
    return _without_host_reads(codec, x, "encode")


class Deferred:
    """Packets in one buffer whose sizes the host has not read: ``sizes`` (int64, on the device)
    go to the peers in a size mail, which brings them to the host with the peers' (one host
    wait: metadata._SizeMail), and ``packet(j, size)`` is then packet j."""
    __slots__ = ("buf", "starts", "sizes")

    def __init__(self, buf: torch.Tensor, starts: list[int], sizes: torch.Tensor):
        self.buf, self.starts, self.sizes = buf, starts, sizes

    def packet(self, j: int, size: int) -> torch.Tensor:
        return self.buf[self.starts[j]:self.starts[j] + size]

    def to(self, r: int, n: int) -> "Deferred":
        """Packet k for each of the ``n`` ranks but ``r`` (their packets in rank order, this
        rank's own left out), and an empty one for ``r``; one packet (n = 1 part) for every rank."""
        if len(self.starts) == 1:
            return Deferred(self.buf, self.starts * n, self.sizes.reshape(1).repeat(n))
        zero = self.sizes.new_zeros(1)
        return Deferred(self.buf, self.starts[:r] + [0] + self.starts[r:],
                        torch.cat([self.sizes[:r], zero, self.sizes[r:]]))


def encode_all(codec, parts: list) -> tuple[list | Deferred, list[int] | torch.Tensor]:
    """Each part's packet, and their sizes. Where the codec ``batches``, the packets go into one
    buffer (each at a 16-byte aligned slot of the codec's bound; parts of one size in one
    ``encode_many``) as a Deferred, their sizes left
    on the device: the size mail reads them with the peers' (one host wait for a piece, which
    each read here would double: it waits for the device to finish the encodes before it)."""
    if not parts or not batches(codec, parts[0]):
        packets = [codec.encode(x) for x in parts]
        return packets, [p.numel() for p in packets]
    slots = [-(-codec.max_encoded_size(x.numel(), x.dtype) // 16) * 16 for x in parts]  # Lossless.slot's
    starts = [0, *itertools.accumulate(slots)]
    buf = torch.empty(starts.pop(), dtype=torch.uint8, device=parts[0].device)
    if len(set(slots)) == 1 and hasattr(codec, "encode_many"):  # one launch sequence for them all (Lossless)
        sizes = codec.encode_many(parts, buf)
    else:
        sizes = torch.stack([codec.encode_into(x, buf[s:s + slot]) for x, s, slot in zip(parts, starts, slots)])
    return Deferred(buf, starts, sizes), sizes


def on_host(coded: tuple) -> tuple[list, list[int]]:
    """``encode_all``'s packets and sizes as a list of packets and their sizes on the host (a
    Deferred's sizes read, one host wait), for a caller that mixes packets of several codecs."""
    packets, sizes = coded
    if not isinstance(packets, Deferred):
        return packets, sizes
    sizes = to_host(sizes).tolist()
    return [packets.packet(j, size) for j, size in enumerate(sizes)], sizes


def defers(codec, packet: torch.Tensor) -> bool:
    """Whether ``decode_to`` decodes ``packet`` with ``decode_into`` and leaves its verdict for
    later. Every rank's codec has the same implementation and block size (the call's signature:
    collectives.resolve._codec_id), as decode_into needs."""
    return _without_host_reads(codec, packet, "decode")


def decode_to(codec, packet: torch.Tensor, out: torch.Tensor, fate: Fate, t, peer: int) -> torch.Tensor:
    """``codec.decode(packet, out=out)``, or where it ``defers``, ``decode_into``, its verdict
    left with the call's ``fate``, which reads every piece's at once before the call settles: a
    read per packet made the host wait for each decode in turn. A bad packet then fails the call
    at its end, not at once; the call raises all the same, on every rank (zipccl.failure)."""
    if defers(codec, packet):
        fate.expect(t, peer, codec.decode_into(packet, out))
        return out
    return codec.decode(packet, out=out)


def decode_all(codec, landed: list, outs, fate: Fate, t) -> None:
    """``decode_to`` of each (peer, packet) of ``landed`` into ``outs[peer]``; where the codec
    ``defers`` and the outs are of one size, in one ``decode_many`` (on the GPU one launch
    sequence for them all), each verdict left with the call's ``fate``."""
    if len(landed) > 1 and hasattr(codec, "decode_many") and defers(codec, landed[0][1]) \
            and len({outs[j].numel() for j, _ in landed}) == 1:
        for (j, _), verdict in zip(landed, codec.decode_many([p for _, p in landed], [outs[j] for j, _ in landed])):
            fate.expect(t, j, verdict)
        return
    for j, packet in landed:
        fate.decode(t, j, decode_to, codec, packet, outs[j], fate, t, j)


def _land(t, acc: dict, sends: list, recvs: dict, sizes: _SizeMail, bound: int, decode, batch=None) -> None:
    """Finish a piece: for each peer, its size (a poison code makes the call failed here),
    its packet, and ``decode(peer, packet)`` while the call has not failed, or, given ``batch``,
    ``batch(arrived)`` once with every (peer, packet) that arrived; then this rank's sends and
    size mails. Every message of the piece is waited for, failed or not."""
    fate = sizes.fate
    arrived = []
    for j, (buf, work) in recvs.items():
        size = sizes.get(j)
        landed = timed(acc, "comm_seconds", fate.wait, t, work, j)
        if size is None or not landed or fate.failed:
            continue
        if size > bound or size > buf.numel():
            fate.fail(SIZE, FormatError(f"rank {t.global_rank(j)} announced a packet of {size} bytes, above the "
                                        f"codec's bound of {bound}"), rank=t.global_rank(j))
            continue
        if batch is not None:
            arrived.append((j, buf[:size]))
        else:
            fate.decode(t, j, decode, j, buf[:size])
    if arrived and not fate.failed:
        fate.guard(DECODE, batch, arrived)
    for j, w in sends:
        timed(acc, "comm_seconds", fate.wait, t, w, j)
    sizes.close()
