"""Point-to-point: one tensor from one rank to another as a framed message, pipelined in pieces.

The receiver knows only its tensor's shape and dtype, so the sender's packet sizes must come
first. A message is, on the sender's connection to the receiver and in this order: a header
(the sender's signature, its status and the number of pieces), then per piece its size and its
packet. Every receive has its message's exact size (DESIGN.md invariant 12): the receiver posts
a piece's packet once its size has come, and the next piece's size with it, so that piece k is
decoded while piece k+1 is on the wire. A transport with ``loose_receives`` (gloo) gets every
piece's size and packet posted at once instead, each packet at the codec's bound. The sender
encodes piece k+1 while piece k travels.

Messages between two ranks match in issue order (no tags on the wire, as NCCL); the caller's
tag is part of the signature. The receiver checks the sender's signature (dtype, elements,
codec argument, tag) against its own; a receiver that disagrees still takes the sender's pieces
(into scratch), so the connection stays in step, and both ends raise MismatchError with the same
words. The receiver's verdict (its signature and status) goes back through the job's store
(``Verdict``), a channel beside the group's connections, so that a send never waits for the
receiver inside the group's order of messages: two ranks that send to each other cannot block
each other. A sender that fails mid-message poisons its remaining sizes (zipccl.failure's code)
and sends one-byte stand-ins, as the collectives do.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch

from .. import config
from .. import format as F
from ..errors import FormatError, MismatchError
from ..failure import ENCODE, OTHER, SIZE, Fate
from ..transport import store
from .links import PLAIN
from .metadata import _TAG_P2P, dtype_code, timed
from .pipeline import MOST_PIECES, decode_to, pieces
from .resolve import _codec_id

__all__ = ["Signature", "send_message", "receive_message", "Verdict"]

_MAGIC = 0x7A703270  # "zp2p"
_HEADER = 9  # magic, status, dtype, numel, codec argument, codec used, tag, pieces, the message's number
_CODEC_NAMES = ("auto", "native", "raw", "lossless")


def codec_argument_id(codec) -> int:
    """A codec argument as a number both ends compute alike: the known names, else the codec's
    own identity (an instance's name; a per-link mapping's links and theirs), never a repr that
    may name an address of this process."""
    if isinstance(codec, str) and codec in _CODEC_NAMES:
        return _CODEC_NAMES.index(codec)
    key = repr(sorted((k, codec_argument_id(v)) for k, v in codec.items())) if isinstance(codec, Mapping) else \
        str(getattr(codec, "name", type(codec).__name__))
    return 16 + zlib.crc32(key.encode()) % 1_000_000


def _codec_text(value: int) -> str:
    return _CODEC_NAMES[value] if 0 <= value < len(_CODEC_NAMES) else f"#{value}"


class Signature:
    """What one end of a message says of it: dtype code, elements, codec argument, tag."""
    __slots__ = ("dtype", "numel", "codec", "tag")

    def __init__(self, dtype: int, numel: int, codec: int, tag: int):
        self.dtype, self.numel, self.codec, self.tag = dtype, numel, codec, tag

    @classmethod
    def of(cls, x: torch.Tensor, codec, tag: int) -> "Signature":
        return cls(dtype_code(x.dtype), x.numel(), codec_argument_id(codec), tag)

    def values(self) -> list[int]:
        return [self.dtype, self.numel, self.codec, self.tag]

    def __eq__(self, other) -> bool:
        return self.values() == other.values()

    def __str__(self) -> str:
        dtype = next((str(d).replace("torch.", "") for d in _NAMED if dtype_code(d) == self.dtype),
                     f"dtype #{self.dtype}")
        return f"{self.numel} x {dtype} (codec {_codec_text(self.codec)}, tag {self.tag})"


#: The dtypes a mismatch's words name (others by their code).
_NAMED = (*F.DTYPE_CODES, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
          torch.bool, torch.complex64, torch.complex128)


def itemsize_of(code: int) -> int | None:
    """The element size of a ``dtype_code``; None for a number no dtype gives."""
    size = next((torch.empty(0, dtype=d).element_size() for d, c in F.DTYPE_CODES.items() if c == code), None)
    return size if size is not None or code < 1000 else code // 1000


def mismatch_text(src: int, dst: int, sent: Signature, expected: Signature) -> str:
    """The words both ends raise for a send and a receive that disagree (job ranks)."""
    return f"zipccl send/recv: rank {src} sends {sent}, but rank {dst} receives {expected}"


def _codec_used_id(codec) -> int:
    """The codec that encoded a message, as both ends compute it (resolve's identity of a codec,
    from its attributes: a user's codec has no repr of its own, and its default names an address)."""
    return 0 if codec is PLAIN else 1 + _codec_id(codec) % 1_000_000


def _cuts(numel: int, itemsize: int, plain: bool, cuda: bool) -> list[tuple[int, int]]:
    """A message's pieces: pipeline.pieces of one rank's chunk (both ends cut alike; ``plain``:
    the sender's codec is PLAIN, whose pieces are few and large; ``cuda``: on a GPU, where both
    ends' tensors are)."""
    return pieces(numel, 1, itemsize, plain, cuda) if numel else []


def _encode(codec, piece: torch.Tensor, acc: dict) -> torch.Tensor:
    return codec.encode(piece) if codec is PLAIN else timed(acc, "codec_seconds", codec.encode, piece)


def send_message(t, x: torch.Tensor, peer: int, codec, sig: Signature, acc: dict, fate: Fate, seq: int) -> list:
    """Post the message of ``x`` (flat, contiguous) to group rank ``peer``, each piece encoded with
    ``codec`` (PLAIN: its bytes) as the previous one leaves: the handles of its sends, to be waited
    for later. ``seq``: the message's number on the pair, which its header carries and under
    which the receiver's verdict comes. Nothing here waits for the peer's data, but on NCCL a
    group call may wait for the peer to post its receive (the caller posts on a lane of its own:
    zipccl.p2p)."""
    itemsize = x.element_size()
    cuts = _cuts(x.numel(), itemsize, codec is PLAIN, x.is_cuda)
    header = torch.tensor([_MAGIC, fate.code, sig.dtype, sig.numel, sig.codec, _codec_used_id(codec), sig.tag,
                           len(cuts), seq], dtype=torch.int64)
    sends = []
    with t.grouped():
        sends.append(fate.send(t, header, peer, _TAG_P2P))
    acc["meta_bytes"] += 8 * _HEADER
    for a, b in cuts:
        packet = fate.guard(ENCODE, _encode, codec, x[a:b], acc)
        if packet is None:
            packet = torch.zeros(1, dtype=torch.uint8, device=x.device)
        size = torch.tensor([packet.numel() if not fate.failed else -fate.code], dtype=torch.int64)
        # two groups: the receiver posts the packet's receive once its size has come, and NCCL may
        # hold a group's messages until all their receives are posted (transport.strict)
        with t.grouped():
            sends.append(fate.send(t, size, peer, _TAG_P2P))
        with t.grouped():
            sends.append(fate.send(t, packet, peer, _TAG_P2P))
        acc["raw_bytes"] += (b - a) * itemsize
        acc["wire_bytes"] += packet.numel()
        acc["meta_bytes"] += 8
    return sends


def receive_message(t, out: torch.Tensor, peer: int, codec, sig: Signature, acc: dict,
                    fate: Fate) -> tuple[str | None, int | None]:
    """Receive group rank ``peer``'s message into ``out`` (flat, contiguous), waiting for each part
    (this blocks until the sender has posted it), decoded with ``codec`` (the one this end's
    signature and link choose: the sender's must be the same). Returns the mismatch's words where
    the two signatures differ (the pieces were drained), else None, and the message's number on
    the pair as its sender counted it (None where no header came), under which the verdict goes
    back; failures go to ``fate``."""
    header = torch.zeros(_HEADER, dtype=torch.int64)
    with t.grouped():
        work = fate.recv(t, header, peer, _TAG_P2P)
    if not timed(acc, "comm_seconds", fate.wait, t, work, peer):
        return None, None
    magic, status, *values, used, tag, count, seq = header.tolist()
    if magic != _MAGIC:
        fate.fail(OTHER, FormatError(f"rank {t.global_rank(peer)} sent no zipccl message header (a send and a "
                                     f"receive with different codecs, one native?)"), rank=t.global_rank(peer))
        return None, None
    if status:
        fate.heard(status)
    theirs = Signature(*values[:3], tag)
    problem = None if theirs == sig else mismatch_text(t.global_rank(peer), t.global_rank(t.rank), theirs, sig)
    if problem is None and used != _codec_used_id(codec):
        fate.fail(OTHER, MismatchError(f"rank {t.global_rank(peer)} encoded with another codec than {codec!r}, "
                                       "which this end's codec argument and link choose"), rank=t.global_rank(peer))
    codec = codec if problem is None else None
    itemsize = out.element_size()
    cuts = _cuts(theirs.numel, itemsize_of(theirs.dtype) or itemsize, used == _codec_used_id(PLAIN), out.is_cuda)
    if len(cuts) != count:
        fate.fail(OTHER, FormatError(f"rank {t.global_rank(peer)} announced {count} pieces for {theirs.numel} "
                                     f"elements, not {len(cuts)} (ZIPCCL_PIECE_BYTES differs?)"),
                  rank=t.global_rank(peer))
        if not 0 <= count <= MOST_PIECES:  # no sender cuts so many: nothing to drain by
            return problem, seq
        cuts = [(0, 0)] * count  # the sender's pieces drained into scratch: the pair stays in step

    sizes = [torch.zeros(1, dtype=torch.int64) for _ in cuts]
    size_works, flights = {}, []  # flights: (k, size, buffer, work), oldest first

    def landing(k: int, size: int) -> torch.Tensor:
        """Where piece k's packet of ``size`` bytes lands: in place for plain bytes, else scratch
        (a poisoned sender's stand-in is one byte)."""
        a, b = cuts[k]
        if codec is PLAIN and size == (b - a) * itemsize:
            return out[a:b].view(torch.uint8)
        return torch.empty(max(1, size), dtype=torch.uint8, device=out.device)

    def size_of(k: int) -> int | None:
        """Piece k's announced size, once it has come (a poison code heard); None: the peer is lost."""
        if not timed(acc, "comm_seconds", fate.wait, t, size_works.pop(k), peer):
            return None
        size = int(sizes[k])
        if size < 0:
            fate.heard(-size)
        return size

    def land(k: int, size: int, buf: torch.Tensor, work) -> None:
        landed = timed(acc, "comm_seconds", fate.wait, t, work, peer)
        if not landed or problem is not None or size <= 0 or fate.failed:
            return
        a, b = cuts[k]
        if size > codec.max_encoded_size(b - a, out.dtype):
            fate.fail(SIZE, FormatError(f"rank {t.global_rank(peer)} announced a packet of {size} bytes, above the "
                                        "codec's bound"), rank=t.global_rank(peer))
            return
        fate.decode(t, peer, _decode, codec, buf[:size], out[a:b], fate, t, peer, acc)

    if t.loose_receives and problem is None and not fate.failed:
        # Every piece's size and packet posted now, each packet at the codec's bound: the sender's
        # pieces then never wait for this end to post (gloo sends once the receive is posted, a
        # round trip that a loaded link's queue lengthens, between every two pieces otherwise).
        # Not where the sender's codec is another (failed above): its packets may be larger.
        posted = []
        with t.grouped():
            for k, (a, b) in enumerate(cuts):
                size_works[k] = fate.recv(t, sizes[k], peer, _TAG_P2P)
                buf = out[a:b].view(torch.uint8) if codec is PLAIN else \
                    torch.empty(codec.max_encoded_size(b - a, out.dtype), dtype=torch.uint8, device=out.device)
                posted.append((k, buf, fate.recv(t, buf, peer, _TAG_P2P)))
        for k, buf, work in posted:
            size = size_of(k)
            if size is None:
                return problem, seq
            land(k, size, buf, work)
        return problem, seq
    if cuts:
        with t.grouped():
            size_works[0] = fate.recv(t, sizes[0], peer, _TAG_P2P)
    for k in range(len(cuts)):
        size = size_of(k)
        if size is None:
            return problem, seq
        buf = landing(k, size)
        with t.grouped():  # this piece's packet, and the next piece's size behind it
            flights.append((k, size, buf, fate.recv(t, buf, peer, _TAG_P2P)))
            if k + 1 < len(cuts):
                size_works[k + 1] = fate.recv(t, sizes[k + 1], peer, _TAG_P2P)
        if len(flights) > 1:
            land(*flights.pop(0))
    while flights:
        land(*flights.pop(0))
    return problem, seq


def _decode(codec, packet: torch.Tensor, out: torch.Tensor, fate: Fate, t, peer: int, acc: dict) -> None:
    if codec is PLAIN:
        PLAIN.decode(packet, out)
    else:
        timed(acc, "codec_seconds", decode_to, codec, packet, out, fate, t, peer)


class Verdict:
    """The receiver's word on one message, through the job's store (on this thread's own
    connection: zipccl.transport.store): its signature and status (0, 1 for a mismatch, else a
    poison code of zipccl.failure). Key: the group, the pair (job ranks) and the message's number
    on that pair, as its sender counted it and its header says (a send that failed before its
    header left, or messages on two transports of one pair, never shift the receiver's verdicts)."""

    def __init__(self, group_name: str, src: int, dst: int, seq: int):
        self.key = f"zipccl/p2p/{group_name}/{src}>{dst}/{seq}"

    def give(self, sig: Signature, status: int) -> None:
        store.own().set(self.key, ",".join(map(str, [status, *sig.values()])))

    def ready(self) -> bool:
        return store.own().check([self.key])

    def take(self, timeout: float | None) -> tuple[int, Signature]:
        """(status, the receiver's signature), waiting at most ``timeout`` seconds (None: the
        store's own); raises TimeoutError past it."""
        status, *values = (int(v) for v in store.wait(self.key, timeout).decode().split(","))
        store.own().delete_key(self.key)
        return status, Signature(*values)
