"""Compressed all-reduce, reduce-scatter and all-gather: the only place that knows how bytes move.

Algorithms (DESIGN.md):
- reduce-scatter (ZIPCCL_REDUCE_SCATTER): "direct" (default) sends each chunk's
  packet to its owner, to every peer at once, and the owner decodes and reduces
  them in rank order (fp32 accumulation for 16-bit types, rounded once); "ring"
  passes re-encoded partial sums around a ring, rounded per hop as in NCCL;
- all-gather: the local shard encoded once and sent to every peer, every peer's
  packet decoded;
- all-reduce = reduce-scatter + all-gather of each owner's reduced chunk,
  encoded once by its owner, so every rank ends with the owner's exact bits;
- top-k (lossy) all-reduce: every rank's (index, value) packet to everyone, or
  to the owner of each chunk and back (sparse_algorithm), added in rank order.

Each phase moves in pipeline pieces, several in flight: a piece's packets are
posted before the previous piece is awaited, so the links never wait for a
piece boundary, and the codec works on one piece while others are on the wire.

Before any payload moves, the ranks exchange one small int64 vector, pairwise: a status
(0, an invalid call, or a failure's poison code), the call's signature (collective, dtype,
numel, op, codec, algorithm), this rank's times of the group's earlier "auto" calls (which
zipccl.auto learns from, the same way on every rank) and the first piece's packet sizes. A
rank whose call is invalid, or ranks that disagree, make every rank raise (MismatchError, or
the local error on the offending rank) instead of hanging in a mismatched collective. Later
pipeline pieces send their sizes pairwise (_SizeMail): an all-gather in mid-pipeline would
wait for the slowest rank and, on a shaped link, behind queued bulk data. A failure in
mid-call goes on poisoned to the end of the schedule and a status round ends the call, so
that every rank raises RankFailure (zipccl.failure).
"""

from __future__ import annotations

import threading
import time
import zlib

import torch
import torch.distributed as dist

from . import config
from . import format as F
from .auto import Policy
from .stats import record as _record
from .codecs import Lossless, Raw, TopK
from .executor import Handle, run as _run, submit
from .errors import FormatError, MismatchError, UnsupportedError
from .failure import DECODE, ENCODE, REDUCE, SIZE, Fate
from .kernels import reduce, sparse
from .reference.packet import host_bytes
from .transport import TorchTransport

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "resolve_codec", "auto_policy", "sparse_algorithm",
           "submit", "AUTO_MIN_BYTES", "Handle", "NATIVE", "FLAT_PLANS", "run_flat", "planned"]

AUTO_MIN_BYTES = config.AUTO_MIN_BYTES

_OPS = {dist.ReduceOp.SUM: 1, dist.ReduceOp.AVG: 2, dist.ReduceOp.MAX: 3, dist.ReduceOp.MIN: 4}
_COLLECTIVES = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "all_reduce/gather": 4}
_FIELDS = ("collective", "dtype", "numel", "op", "codec", "reduce-scatter algorithm")
_ALGORITHMS = {"direct": 1, "ring": 2}
_RAW, _LOSSLESS = Raw(), Lossless()
AUTO = object()  # codec "auto" on float data: the plan is decided when the call runs (zipccl.auto)


class _Native:
    """codec="native": the backend's own collective (torch.distributed), with no zipccl metadata:
    such a call has torch.distributed's semantics, checks and failure modes."""
    name = "native"

    def __repr__(self) -> str:
        return "native"


NATIVE = _Native()


def resolve_codec(codec, dtype: torch.dtype, nbytes: int):
    """The codec object for a call; NATIVE for the backend's own collective; None for the
    backend's collective after zipccl's metadata exchange (non-float dtypes with "raw")."""
    if isinstance(codec, str):
        if codec == "topk":
            codec = TopK()
        elif codec == "entropy":
            raise ValueError("codec 'entropy' keeps state per tensor: pass name=... to zipccl.all_reduce "
                             "(or use zipccl.lossy.Compressor / zipccl.ddp.State)")
        elif codec not in ("auto", "raw", "lossless", "native"):
            raise ValueError(f"unknown codec {codec!r}: use 'native', 'raw', 'lossless', 'auto' (never lossy), "
                             "the lossy 'topk' or 'entropy', or a codec instance")
    if isinstance(codec, str):
        if codec == "native":
            return NATIVE
        if dtype not in F.DTYPE_CODES:
            if codec == "lossless":
                raise UnsupportedError(f"codec 'lossless' takes {F.SUPPORTED}, not {dtype}")
            return NATIVE if codec == "auto" else None
        if codec == "raw" or (codec == "auto" and nbytes < AUTO_MIN_BYTES):
            return _RAW
        return _LOSSLESS
    if isinstance(codec, _Native):
        return codec
    if not all(hasattr(codec, m) for m in ("encode", "decode", "max_encoded_size")):
        raise ValueError(f"codec {codec!r} lacks encode/decode/max_encoded_size")
    if dtype not in F.DTYPE_CODES:
        raise UnsupportedError(f"codec {codec!r} takes {F.SUPPORTED}, not {dtype}")
    return codec


def _codec_id(codec) -> int:
    if codec is None:
        return 0
    key = f"{getattr(codec, 'name', type(codec).__name__)}:{getattr(codec, 'block_size', 0)}:" \
          f"{getattr(codec, 'density', 0)}:{getattr(codec, 'algorithm', '')}:{getattr(codec, 'sampled', '')}"
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def check_op(op) -> int:
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        raise UnsupportedError(f"reduce op {op} is not supported; zipccl reduces with SUM, AVG, MAX, MIN") from None


# ---- codec "auto": a policy per group, fed by the metadata exchanges ------------------------------------------

#: Plans that flat codec="auto" measures: the backend's own collective, zipccl's pipeline raw or lossless.
FLAT_PLANS = ("native", "raw", "lossless")
#: Times of finished auto calls that one metadata exchange carries (pending ones wait for the next).
REPORT_SLOTS = 4


class _AutoGroup:
    """A group's auto policy, and this rank's times of its finished auto calls that no metadata
    exchange has reported yet: {(class, plan): microseconds}, the lowest of a plan's calls
    since (native calls carry no exchange: several may wait), in first-call order, which is the
    same on every rank."""
    __slots__ = ("policy", "pending")

    def __init__(self):
        self.policy, self.pending = Policy(), {}

    def done(self, key, plan: str, seconds: float) -> None:
        us = int(seconds * 1e6)
        self.pending[(key, plan)] = min(us, self.pending.get((key, plan), us))

    def take(self) -> list:
        """Up to REPORT_SLOTS pending reports, oldest first, removed from the queue."""
        taken = list(self.pending.items())[:REPORT_SLOTS]
        for entry, _ in taken:
            del self.pending[entry]
        return taken


_autos: dict = {}
_autos_lock = threading.Lock()


def _auto_group(group) -> _AutoGroup:
    with _autos_lock:
        return _autos.setdefault(group or dist.GroupMember.WORLD, _AutoGroup())


def auto_policy(group=None) -> Policy:
    """The policy behind codec="auto" on ``group`` (None: the default group): ``table()`` shows
    what it has measured, ``explain()`` what it chose and why."""
    return _auto_group(group).policy


def planned(group, name: str, dtype, nbytes: int, candidates: tuple[str, ...], run) -> None:
    """``run(plan)`` with the plan that the group's auto policy chooses for this call among
    ``candidates``, in call order on every rank; the call's time on this rank goes out with the
    group's next metadata exchange."""
    key = Policy.key(name, dtype, nbytes)
    auto = _auto_group(group)
    plan = auto.policy.choose(key, nbytes, candidates)
    t0 = time.perf_counter()
    run(plan)
    auto.done(key, plan, time.perf_counter() - t0)


def _report_id(entry) -> int:
    return zlib.crc32(repr(entry).encode()) & 0x7FFFFFFF


# ---- rank-consistent metadata: one exchange per call, then pairwise sizes ------------------------------------

class Call:
    """The signature of one phase of a call, checked against every rank's."""

    def __init__(self, name: str, dtype: torch.dtype, numel: int, op, codec):
        self.name = name
        self.values = [_COLLECTIVES[name], F.DTYPE_CODES.get(dtype, 100 + zlib.crc32(str(dtype).encode()) % 1000),
                       numel, _OPS.get(op, 0), _codec_id(codec), _ALGORITHMS[config.REDUCE_SCATTER]]

    def exchange(self, t, sizes: list[int], error: Exception | None = None, fate: Fate | None = None) -> torch.Tensor:
        """Exchange [status, signature, auto reports, sizes] with every rank; raise the same way
        on every rank if the call is invalid anywhere or the ranks disagree. Returns the
        (ranks, ranks) sizes every rank announced (padded with zeros: every rank's vector has
        the same length, whatever phase it is in). The auto reports are this rank's times of
        the group's earlier auto calls (zipccl.auto), each learned from once every rank has
        reported it. ``fate``: the call's outcome, which learns of the peers' failures here."""
        return self.start(t, sizes, error, fate)()

    def start(self, t, sizes: list[int] = (), error: Exception | None = None, fate: Fate | None = None):
        """``exchange`` in two halves: this starts it, the function it returns finishes it
        (and raises). A pipeline's first piece is encoded in between. Pairwise (each rank's
        vector to every other), so that a lost peer is named, and every message has a fixed size."""
        fate = fate if fate is not None else Fate.of(self.name, t)
        sizes = list(sizes) + [0] * (t.size - len(sizes))
        auto = _auto_group(t.group)
        reports = auto.take()
        slots = [v for entry, us in reports for v in (_report_id(entry), us)]
        slots += [-1] * (2 * REPORT_SLOTS - len(slots))
        status = 1 if error is not None else (1 + fate.code if fate.failed else 0)
        mine = torch.tensor([status, *self.values, *slots, *sizes], dtype=torch.int64)
        rows = mine.repeat(t.size, 1)
        peers = [j for j in _peers(t) if fate.alive(t, j)]
        sends = [(j, fate.send(t, mine, j, _TAG_META)) for j in peers]
        recvs = [(j, fate.recv(t, rows[j], j, _TAG_META)) for j in peers]

        def finish() -> torch.Tensor:
            for j, w in recvs:  # a lost peer's row stays a copy of this rank's: the call goes on poisoned
                fate.wait(t, w, j)
            for j, w in sends:
                fate.wait(t, w, j)
            first = 1 + len(_FIELDS)
            for k, ((key, plan), _) in enumerate(reports if not fate.lost else ()):
                ids, times = rows[:, first + 2 * k], rows[:, first + 2 * k + 1]
                if bool((ids == ids[0]).all()) and bool((times >= 0).all()):
                    auto.policy.learn(key, plan, int(times.max()) / 1e6)
            bad = [r for r in range(t.size) if rows[r, 0] == 1]
            if error is not None:
                raise error
            if bad:
                raise MismatchError(f"zipccl.{self.name}: rank(s) {bad} made an invalid call (see their error)")
            for r in range(t.size):
                if rows[r, 0] > 1:
                    fate.heard(int(rows[r, 0]) - 1)
            for k, field in enumerate(_FIELDS):
                col = rows[:, 1 + k]
                if not bool((col == col[0]).all()):
                    groups = {}
                    for r in range(t.size):
                        groups.setdefault(int(col[r]), []).append(r)
                    shown = "; ".join(f"ranks {rs}: {v}" for v, rs in groups.items())
                    raise MismatchError(f"zipccl.{self.name}: ranks disagree on {field} ({shown})")
            return rows[:, first + 2 * REPORT_SLOTS:]
        return finish


def _meta_bytes(n: int) -> int:
    """Bytes this rank sends in one metadata exchange of ``n`` ranks."""
    return (n - 1) * 8 * (1 + len(_FIELDS) + 2 * REPORT_SLOTS + n)


class _SizeMail:
    """One int64 from this rank to every other rank and one back from each, pairwise on
    ``tag``: the packet sizes of a pipeline piece (the call's metadata exchange checks every
    rank's signature alongside the first piece). Unlike that exchange it waits on no third
    rank, so it adds no barrier mid-pipeline (the 64 MiB all-reduce in the 1 Gbit/s lab:
    1.09-1.22 s -> 1.00-1.03 s). Receives do not wait for it (see _post_recvs); a piece is
    landed only once every peer's value has come, which says how much of each packet is the
    packet. Once the call has failed on this rank (zipccl.failure) every value is the poison
    code, negated, and the piece's packets are one-byte stand-ins (``poisoned``)."""

    def __init__(self, t, values: list[int], tag: int, acc: dict, fate: Fate):
        self.t, self.acc, self.fate = t, acc, fate
        self.poisoned = fate.failed
        if self.poisoned:
            values = [-fate.code] * t.size
        self.out = torch.tensor(values, dtype=torch.int64)  # values[j] goes to rank j (alive until sent)
        self.got = torch.zeros(t.size, dtype=torch.int64)
        peers = [j for j in _peers(t) if fate.alive(t, j)]
        self.sends = [(j, fate.send(t, self.out[j:j + 1], j, tag)) for j in peers]
        self.recvs = {j: fate.recv(t, self.got[j:j + 1], j, tag) for j in peers}
        acc["meta_bytes"] += 8 * len(peers)

    def get(self, src: int) -> int | None:
        """``src``'s value; None where ``src`` failed (its poison code goes to the call's fate) or is lost."""
        work = self.recvs.pop(src, None)
        if work is not None and not timed(self.acc, "comm_seconds", self.fate.wait, self.t, work, src):
            return None
        if not self.fate.alive(self.t, src):
            return None
        value = int(self.got[src])
        if value < 0:
            self.fate.heard(-value)
            return None
        return value

    def close(self) -> None:
        for j, w in self.sends:
            timed(self.acc, "comm_seconds", self.fate.wait, self.t, w, j)
        self.sends = []


def _sizes(t, call: Call | None, tag: int, acc: dict, encode, fate: Fate):
    """(packets, sizes) from ``encode()``, which returns the packets and their sizes by
    destination, and a _SizeMail on ``tag`` of those sizes. With ``call`` (a call's first
    piece) the call's metadata exchange runs while the piece is encoded: nothing is on the
    wire until the first piece is, so the exchange's round trip would add to the call's time
    (with the smaller first and last pieces of ``pieces``, the 64 MiB all-reduce in the
    1 Gbit/s lab took 3-21 ms less, paired medians of four alternations: about 1%). Once
    the call has failed (here, or heard of), nothing is encoded: packets is None and the
    sizes carry the poison code (zipccl.failure)."""
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
    return packets, _SizeMail(t, sizes, tag, acc, fate)


def _send(t, packets, mail: _SizeMail, tag: int, acc: dict, device) -> list:
    """Post a piece's packets (``packets[j]`` to peer j, or one packet to every peer): the
    packets themselves, or one byte each if the piece's sizes went out poisoned."""
    fate = mail.fate
    stand_in = torch.zeros(1, dtype=torch.uint8, device=device) if mail.poisoned else None
    sends = []
    for j in _peers(t):
        if fate.alive(t, j):
            packet = stand_in if stand_in is not None else packets if isinstance(packets, torch.Tensor) \
                else packets[j]
            sends.append((j, fate.send(t, packet, j, tag)))
            acc["wire_bytes"] += packet.numel()
    return sends


# ---- the algorithms ------------------------------------------------------------------------------------------

def _acc_dtype(dtype):
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _reduce_into(acc: torch.Tensor, x: torch.Tensor, op_code: int) -> None:
    if op_code in (1, 2):
        acc.add_(x)
    elif op_code == 3:
        torch.maximum(acc, x.to(acc.dtype), out=acc)
    else:
        torch.minimum(acc, x.to(acc.dtype), out=acc)


#: Pipelining: each phase moves in pieces of about this many input bytes (all ranks' chunks
#: together), so that encoding piece k+1 and decoding piece k-1 overlap piece k on the wire.
PIECE_BYTES = 8 << 20
MAX_PIECES = 16
MIN_RAMP = 4096  # elements: the smallest piece that pieces() cuts off the first or last


def pieces(m: int, n: int, itemsize: int) -> list[tuple[int, int]]:
    """Element ranges [a, b) that cut a chunk of ``m`` elements into pipeline pieces. Where
    there are several, the first is cut again into a quarter, a quarter and a half, and the
    last into a half, a quarter and a quarter: the links idle while the first piece is
    encoded and while the last is decoded, so those pieces are small (see _sizes)."""
    count = max(1, min(MAX_PIECES, -(-m * n * itemsize // PIECE_BYTES), m))
    step = max(1, -(-m // count))
    cuts = [(a, min(m, a + step)) for a in range(0, m, step)] or [(0, 0)]
    if len(cuts) < 2 or step < 4 * MIN_RAMP:
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


def timed(acc: dict, key: str, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    acc[key] += time.perf_counter() - t0
    return out


#: Reduce-scatter pieces on the ring at once: one piece's codec work overlaps another's transfer.
RING_DEPTH = 2
_TAG_SIZE, _TAG_DATA = 1, 2  # the ring: a partial sum's packet follows its size, each in order on its own tag
_TAG_RS_SIZES, _TAG_AG_SIZES = 3, 4  # _SizeMail of the direct reduce-scatter's and the all-gather's later pieces
_TAG_RS_DATA, _TAG_AG_DATA = 5, 6  # their packets
_TAG_META = 7  # the metadata exchange (a call's failure status: zipccl.failure.TAG_STATUS)
_DONE = object()


def _reduce_scatter_chunks(t, chunks: torch.Tensor, op, codec, call: Call, acc: dict, fate: Fate, on_piece=None,
                           ready=None) -> torch.Tensor:
    """chunks: (ranks, m). Returns this rank's reduced chunk (m elements, chunks' dtype), by the
    algorithm ``config.REDUCE_SCATTER`` names; ``on_piece(a, b, reduced)`` hears of each finished
    range (all-reduce starts gathering it at once; it is called in a failed call too, so that
    the schedule goes on: zipccl.failure); ``ready(a, b)``, where given, fills columns [a, b) of
    every chunk just before they are first needed (the hierarchical all-reduce sums them within
    the node there, while earlier pieces are on the wire)."""
    if config.REDUCE_SCATTER == "ring":
        if ready is not None:
            fate.guard(REDUCE, ready, 0, chunks.shape[1])
        return _reduce_scatter_ring(t, chunks, op, codec, call, acc, fate, on_piece)
    return _reduce_scatter_direct(t, chunks, op, codec, call, acc, fate, on_piece, ready)


def reduce_in_rank_order(parts, op_code: int, n: int, dtype) -> torch.Tensor:
    """Reduce ``parts`` (one per rank, in rank order) with fp32 accumulation for 16-bit types."""
    total = parts[0].to(_acc_dtype(dtype), copy=True)
    for part in parts[1:]:
        _reduce_into(total, part, op_code)
    if op_code == 2:
        total.div_(n)
    return total


def _reduce_scatter_direct(t, chunks, op, codec, call: Call, acc: dict, fate: Fate, on_piece=None,
                           ready=None) -> torch.Tensor:
    """Each rank's packet of chunk j goes straight to rank j, which decodes all of them and
    reduces them in rank order, rounded once (the same sum on every owner, whatever arrives
    first). Piece by piece, to every peer at once, two pieces deep: piece k+1's packets are
    posted before piece k is awaited, decoded and reduced, and piece k+2 is encoded while
    piece k+1 is on the wire. Waiting for a whole piece before posting the next left the
    links idle at every piece boundary: 48 MiB per rank in 2 MiB messages took 690 ms in the
    1 Gbit/s lab one piece at a time and 438 ms two deep (line rate 403 ms)."""
    n, r = t.size, t.rank
    op_code = _OPS[op]
    m = chunks.shape[1]
    result = torch.empty(m, dtype=chunks.dtype, device=chunks.device)
    cuts = pieces(m, n, chunks.element_size())

    def encode(k):
        """This rank's packets of piece k and a _SizeMail of their sizes (the first piece's
        encoding overlaps the call's metadata exchange: _sizes)."""
        a, b = cuts[k]
        if ready is not None:
            fate.guard(REDUCE, ready, a, b)

        def packets():
            out = timed(acc, "codec_seconds", lambda: [
                codec.encode(chunks[j, a:b]) if j != r else chunks[j, :0].view(torch.uint8) for j in range(n)])
            return out, [p.numel() for p in out]

        acc["raw_bytes"] += (n - 1) * (b - a) * chunks.element_size()
        return _sizes(t, None if k else call, _TAG_RS_SIZES, acc, packets, fate)

    def post(k, encoded):
        packets, sizes = encoded
        sends = _send(t, packets, sizes, _TAG_RS_DATA, acc, chunks.device)
        a, b = cuts[k]
        return k, sends, _post_recvs(t, fate, codec.max_encoded_size(b - a, chunks.dtype), _TAG_RS_DATA,
                                     chunks.device), sizes

    def reduce_piece(a, b, parts):
        if op_code in (1, 2) and chunks.dtype in reduce.DTYPES and chunks.device.type == "cpu":
            reduce.sum_in_rank_order(parts, chunks[r, a:b], r, op_code == 2, result[a:b])
        else:
            total = reduce_in_rank_order([chunks[r, a:b] if j == r else parts[j] for j in range(n)], op_code, n,
                                         chunks.dtype)
            result[a:b].copy_(total)

    def finish(k, sends, recvs, sizes):
        a, b = cuts[k]
        parts = torch.empty((n, b - a), dtype=chunks.dtype, device=chunks.device)
        _land(t, acc, sends, recvs, sizes, lambda j, buf: timed(acc, "codec_seconds", codec.decode, buf, parts[j]))
        timed(acc, "codec_seconds", fate.guard, REDUCE, reduce_piece, a, b, parts)
        if on_piece is not None:
            on_piece(a, b, result[a:b])

    flight, upcoming = None, encode(0)
    for k in range(len(cuts)):
        current = post(k, upcoming)
        if flight is not None:
            finish(*flight)
        upcoming = encode(k + 1) if k + 1 < len(cuts) else None
        flight = current
    finish(*flight)
    return result


def _peers(t) -> list[int]:
    """Every other rank, nearest successor first."""
    return [(t.rank + s) % t.size for s in range(1, t.size)]


def _post_recvs(t, fate: Fate, nbytes: int, tag: int, device) -> dict:
    """{peer: (buffer, work)}: a receive of each live peer's packet into a buffer of ``nbytes``,
    the codec's bound, posted at once: gloo takes a message shorter than the buffer, and the
    piece's size mail says how long the packet is. Posting only once a peer's size had come
    (behind the peer's previous piece on the same connection) held its data back: the 64 MiB
    all-reduce in the 1 Gbit/s lab, alternating five times, 675-762 ms -> 625-693 ms (median
    712 -> 653)."""
    recvs = {}
    for j in _peers(t):
        if fate.alive(t, j):
            buf = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)
            recvs[j] = buf, fate.recv(t, buf, j, tag)
    return recvs


def _land(t, acc: dict, sends: list, recvs: dict, sizes: _SizeMail, decode) -> None:
    """Finish a piece: for each peer, its size (a poison code makes the call failed here),
    its packet, and ``decode(peer, packet)`` while the call has not failed; then this rank's
    sends and size mails. Every message of the piece is waited for, failed or not."""
    fate = sizes.fate
    for j, (buf, work) in recvs.items():
        size = sizes.get(j)
        landed = timed(acc, "comm_seconds", fate.wait, t, work, j)
        if size is None or not landed or fate.failed:
            continue
        if size > buf.numel():
            fate.fail(SIZE, FormatError(f"rank {t.global_rank(j)} announced a packet of {size} bytes, above the "
                                        f"codec's bound of {buf.numel()}"), rank=t.global_rank(j))
            continue
        fate.decode(t, j, decode, j, buf[:size])
    for j, w in sends:
        timed(acc, "comm_seconds", fate.wait, t, w, j)
    sizes.close()


def _reduce_scatter_ring(t, chunks, op, codec, call: Call, acc: dict, fate: Fate, on_piece=None) -> torch.Tensor:
    """A ring: in step s (1..n-1) rank r sends its partial sum of chunk r-s to rank r+1 and
    receives rank r-1's partial sum of chunk r-s-1, adds its own part (fp32 for 16-bit
    types), and encodes the sum, rounded to the dtype, for the next step. After n-1 steps it
    holds chunk r summed over every rank (in the order r+1, r+2, ..., r); only the owner
    finishes a chunk, so all-gather hands every rank the same bits. A ring as in NCCL: each
    link carries one flow and each pair of ranks talks one way. Partial sums are encoded anew
    at every step, so each packet is preceded by its size (negative: the sender has failed,
    and no packet follows). RING_DEPTH pieces travel at once, interleaved identically on
    every rank. Rounding at each hop departs from DESIGN.md's invariant 3 (rounded once),
    which is why this is opt-in (ZIPCCL_REDUCE_SCATTER=ring)."""
    n, r = t.size, t.rank
    timed(acc, "comm_seconds", call.exchange, t, [], None, fate)  # every rank's signature and status first
    acc["meta_bytes"] += _meta_bytes(n)
    op_code = _OPS[op]
    m, itemsize = chunks.shape[1], chunks.element_size()
    result = torch.empty(m, dtype=chunks.dtype, device=chunks.device)
    nxt, prv = (r + 1) % n, (r - 1) % n

    def add(recv, scratch, mine, last):
        if not last:
            # A hop's result is rounded to the dtype anyway; torch adds 16-bit tensors in
            # fp32 and rounds once, so this is the fp32 sum, rounded, in one pass.
            return (torch.add, torch.add, torch.maximum, torch.minimum)[op_code - 1](codec.decode(recv, out=scratch),
                                                                                    mine)
        total = codec.decode(recv, out=scratch).to(_acc_dtype(chunks.dtype), copy=True)
        _reduce_into(total, mine, op_code)
        return total

    def ring(a: int, b: int):
        scratch = torch.empty(b - a, dtype=chunks.dtype, device=chunks.device)
        bound = codec.max_encoded_size(b - a, chunks.dtype)
        total = chunks[prv, a:b]
        for s in range(1, n):
            packet = timed(acc, "codec_seconds", fate.guard, ENCODE, codec.encode, total)
            size_out = torch.tensor([packet.numel() if packet is not None else -fate.code], dtype=torch.int64,
                                    device=chunks.device)
            size_in = torch.empty(1, dtype=torch.int64, device=chunks.device)
            sends = []
            if fate.alive(t, nxt):  # the size, then the packet if there is one; both alive until waited
                sends = [fate.send(t, size_out, nxt, _TAG_SIZE)]
                if packet is not None:
                    sends.append(fate.send(t, packet, nxt, _TAG_DATA))
                acc["wire_bytes"] += packet.numel() if packet is not None else 0
            got_size = fate.recv(t, size_in, prv, _TAG_SIZE) if fate.alive(t, prv) else None
            acc["meta_bytes"] += 8
            acc["raw_bytes"] += (b - a) * itemsize
            yield
            recv, got = None, None
            if timed(acc, "comm_seconds", fate.wait, t, got_size, prv):
                size = int(size_in)
                if size < 0:
                    fate.heard(-size)
                else:
                    if size > bound:  # received at the bound: a longer message breaks the connection
                        fate.fail(SIZE, FormatError(f"rank {t.global_rank(prv)} announced a packet of {size} bytes, "
                                                    f"above the codec's bound of {bound}"), rank=t.global_rank(prv))
                    recv = torch.empty(min(size, bound), dtype=torch.uint8, device=chunks.device)
                    got = fate.recv(t, recv, prv, _TAG_DATA)
            yield
            landed = timed(acc, "comm_seconds", fate.wait, t, got, prv)
            for w in sends:
                timed(acc, "comm_seconds", fate.wait, t, w, nxt)
            if landed and not fate.failed:
                t0 = time.perf_counter()
                total = fate.decode(t, prv, add, recv, scratch, chunks[(r - s - 1) % n, a:b], s == n - 1)
                acc["codec_seconds"] += time.perf_counter() - t0

        def finish(total):
            if n == 1:
                total = total.to(_acc_dtype(chunks.dtype), copy=True)
            if op_code == 2:
                total.div_(n)
            result[a:b].copy_(total)
        fate.guard(REDUCE, finish, total)
        if on_piece is not None:
            on_piece(a, b, result[a:b])

    waiting = [ring(a, b) for a, b in pieces(m, n, itemsize)]
    active = []
    while waiting or active:
        while waiting and len(active) < RING_DEPTH:
            active.append(waiting.pop(0))
        for g in list(active):
            if next(g, _DONE) is _DONE:
                active.remove(g)
    return result


class _Piece:
    """An all-gather piece in flight: its range, this rank's data, its sends, how to learn the
    peers' sizes, and the receives."""
    __slots__ = ("a", "b", "mine", "sends", "sizes", "recvs")

    def __init__(self, a: int, b: int, mine: torch.Tensor, sends: list, sizes, recvs: dict):
        self.a, self.b, self.mine, self.sends, self.sizes, self.recvs = a, b, mine, sends, sizes, recvs


class _Gather:
    """All-gather pipeline: ``push`` this rank's piece [a, b); its packet goes to every peer at
    once, and every peer's packet of the piece is decoded into ``dest(j, a, b)`` (a view that
    may be shorter: the padding of all-reduce). Three pieces deep: pushing piece k sends it,
    posts its receives (see _post_recvs) and completes piece k-2. Direct rather than
    a ring: each packet crosses one link, not n-1 one after another, and no step waits for
    the previous one's arrival (the same bytes leave each rank either way)."""

    def __init__(self, t, codec, call: Call | None, acc: dict, dest, fate: Fate):
        """``call``: the signature its first piece's metadata exchange checks; None where the
        caller's reduce-scatter has checked it already (all-reduce)."""
        self.t, self.codec, self.call, self.acc, self.dest, self.fate = t, codec, call, acc, dest, fate
        self.scratch = None
        self.flights: list[_Piece] = []  # oldest first

    def push(self, a: int, b: int, mine: torch.Tensor) -> None:
        t, n, acc = self.t, self.t.size, self.acc

        def encode():
            packet = timed(acc, "codec_seconds", self.codec.encode, mine)
            return packet, [packet.numel()] * n

        packet, sizes = _sizes(t, self.call, _TAG_AG_SIZES, acc, encode, self.fate)
        self.call = None  # checked: later pieces mail their sizes
        sends = _send(t, packet, sizes, _TAG_AG_DATA, acc, mine.device)
        acc["raw_bytes"] += (n - 1) * mine.numel() * mine.element_size()
        if not self.fate.failed:
            own = self.dest(t.rank, a, b)
            own.copy_(mine[:own.numel()])
        recvs = _post_recvs(t, self.fate, self.codec.max_encoded_size(b - a, mine.dtype), _TAG_AG_DATA, mine.device)
        self.flights.append(_Piece(a, b, mine, sends, sizes, recvs))
        if len(self.flights) >= 3:
            self._complete(self.flights.pop(0))

    def finish(self) -> None:
        """Complete every piece in flight."""
        while self.flights:
            self._complete(self.flights.pop(0))

    def _complete(self, f: _Piece) -> None:
        _land(self.t, self.acc, f.sends, f.recvs, f.sizes, lambda j, buf: self._decode(j, buf, f.a, f.b, f.mine))

    def _decode(self, j: int, part: torch.Tensor, a: int, b: int, mine: torch.Tensor) -> None:
        t0 = time.perf_counter()
        try:
            dest = self.dest(j, a, b)
            if dest.numel() == b - a:
                self.codec.decode(part, out=dest)  # straight into the caller's buffer
            else:
                if self.scratch is None or self.scratch.numel() < b - a:
                    self.scratch = torch.empty_like(mine)
                dest.copy_(self.codec.decode(part, out=self.scratch[:b - a])[:dest.numel()])
        finally:
            self.acc["codec_seconds"] += time.perf_counter() - t0


def sparse_algorithm(n: int, density: float, itemsize: int) -> str:
    """"gather" or "scatter": whichever moves fewer bytes per rank for a top-k all-reduce of
    ``n`` ranks. Gather: every rank receives every other rank's k pairs, (n-1)·k·(4+s). Scatter:
    pairs go to the owner of their chunk, k·(4+s)·(n-1)/n, then each owner's reduced chunk goes
    to everyone, sparse or dense, (n-1)/n·N·min(u·(4+s), s), with u = 1-(1-d)^n the union's
    density if ranks chose independently (an upper bound: gradients' top-k overlap). Both in
    bytes per element N of the tensor."""
    pair = 4 + itemsize
    gather = (n - 1) * density * pair
    union = 1 - (1 - density) ** n
    scatter = density * pair * (n - 1) / n + (n - 1) / n * min(union * pair, itemsize)
    return "scatter" if scatter < gather else "gather"


def _sparse_all_reduce(t, flat: torch.Tensor, op, codec, call: Call, acc: dict, fate: Fate) -> None:
    """Top-k all-reduce. Both algorithms add the ranks' pairs in rank order into an fp32 (or
    the dtype's) accumulator and round once, so they give the same bits on every rank. Each
    metadata exchange carries the ranks' status: a failure before it (selection, encoding,
    the owners' reduction) makes every rank raise there (zipccl.failure)."""
    algorithm = getattr(codec, "algorithm", "auto")
    if algorithm == "auto":
        algorithm = sparse_algorithm(t.size, codec.density, flat.element_size())
    acc["raw_bytes"] += 2 * (t.size - 1) * -(-flat.numel() // t.size) * flat.element_size()  # a dense all-reduce
    selected = timed(acc, "codec_seconds", fate.guard, ENCODE, codec.select, flat)
    if algorithm == "gather":
        packet = timed(acc, "codec_seconds", fate.guard, ENCODE, lambda: codec.encode_selected(*selected, flat.numel()))
        parts = _sparse_all_gather(t, packet, call, acc, fate)
        t0 = time.perf_counter()
        headers = _validate(t, fate, parts, codec, flat.numel())
        fate.guard(DECODE, _sum_gathered, parts, headers, codec, flat, op, t.size)
        acc["codec_seconds"] += time.perf_counter() - t0
        return
    # scatter: each owner reduces its chunk, then everyone gathers the reduced chunks
    n, r, numel = t.size, t.rank, flat.numel()
    m = -(-numel // n)
    bounds = [min(numel, j * m) for j in range(n + 1)]

    def split():
        idx, values = selected
        cut = torch.searchsorted(idx.to(torch.int64), torch.tensor(bounds, dtype=torch.int64)).tolist()
        return [codec.encode_selected(idx[cut[j]:cut[j + 1]] - bounds[j], values[cut[j]:cut[j + 1]],
                                      bounds[j + 1] - bounds[j]) for j in range(n)]

    parts = timed(acc, "codec_seconds", fate.guard, ENCODE, split)
    sizes = timed(acc, "comm_seconds", call.exchange, t, [p.numel() for p in parts] if parts else [], None, fate)
    acc["meta_bytes"] += _meta_bytes(n)
    fate.check()  # every rank knows every rank's status: all raise here, or none
    send_splits = [0 if j == r else parts[j].numel() for j in range(n)]
    recv_splits = [0 if j == r else int(sizes[j, r]) for j in range(n)]
    send = torch.cat([parts[j] for j in range(n) if j != r])
    recv = _all_to_all(t, fate, acc, send, send_splits, recv_splits)
    acc["wire_bytes"] += int(send.numel())
    mine = flat[bounds[r]:bounds[r + 1]]
    received = _in_rank_order(recv, recv_splits, parts[r], r)
    _validate(t, fate, received, codec, mine.numel())

    def reduce_own():
        total, sent = _sum_pairs(received, codec, mine, op, n)
        return total.to(flat.dtype), torch.nonzero(sent).reshape(-1).to(torch.int32)

    def encode_own(reduced, where):
        as_pairs = where.numel() * (4 + flat.element_size()) < mine.numel() * flat.element_size()
        return codec.encode_selected(where, reduced[where.long()], mine.numel()) if as_pairs else _RAW.encode(reduced)

    own = timed(acc, "codec_seconds", fate.guard, DECODE, reduce_own)
    packet = timed(acc, "codec_seconds", fate.guard, ENCODE, lambda: encode_own(*own))
    gather = Call("all_reduce/gather", flat.dtype, numel, op, codec)

    def unpack(parts):
        for j, part in enumerate(parts):
            chunk = flat[bounds[j]:bounds[j + 1]]
            h = F.parse_header(host_bytes(part, 0, F.HEADER_SIZE).tobytes(), None, part.numel())
            (_RAW if h.codec == F.CODEC_RAW else codec).decode(part, out=chunk)

    gathered = _sparse_all_gather(t, packet, gather, acc, fate)
    _validate(t, fate, gathered, None, m)
    timed(acc, "codec_seconds", fate.guard, DECODE, unpack, gathered)


def _validate(t, fate: Fate, parts: list, codec, max_numel: int) -> list:
    """Every rank's packet header (``codec.header``, or the common header where None), checked
    to claim at most ``max_numel`` elements; one that fails is blamed on its sender
    (zipccl.failure) and is None in the list."""
    def common(p, bound):
        h = F.parse_header(host_bytes(p, 0, F.HEADER_SIZE).tobytes(), None, p.numel())
        if h.numel > bound:
            raise FormatError(f"packet claims {h.numel} elements, more than the {bound} expected")
        return h
    return [fate.decode(t, j, codec.header if codec is not None else common, part, max_numel)
            for j, part in enumerate(parts)]


def _sum_gathered(parts, headers, codec, flat: torch.Tensor, op, n: int) -> None:
    """flat = the sum of every rank's top-k packet (``parts``, in rank order, with their
    validated ``headers``), AVG divided."""
    values_dtype = headers[0].dtype
    if flat.device.type == "cpu" and flat.dtype in sparse.DTYPES and values_dtype in sparse.DTYPES:
        if any((h.dtype, h.numel) != (values_dtype, flat.numel()) for h in headers):
            raise MismatchError("top-k packets of the ranks differ in dtype or element count")
        sparse.sum_pairs_into(parts, values_dtype, _OPS[op] == 2, n, flat)  # one pass, no fp32 copy
    else:
        total, _ = _sum_pairs(parts, codec, flat, op, n)
        flat.copy_(total)


def _sparse_all_gather(t, packet: torch.Tensor | None, call: Call, acc: dict, fate: Fate) -> list[torch.Tensor]:
    """Every rank's packet, in rank order (this rank's own included), by one all-to-all; raises
    on every rank instead if any rank's call has failed (``packet`` None here)."""
    n, r = t.size, t.rank
    sizes = timed(acc, "comm_seconds", lambda: call.exchange(t, [packet.numel()] if packet is not None else [],
                                                             None, fate)[:, 0].tolist())
    acc["meta_bytes"] += _meta_bytes(n)
    fate.check()
    send_splits = [0 if j == r else packet.numel() for j in range(n)]
    recv_splits = [0 if j == r else sizes[j] for j in range(n)]
    recv = _all_to_all(t, fate, acc, packet.repeat(n - 1), send_splits, recv_splits)
    acc["wire_bytes"] += (n - 1) * packet.numel()
    return _in_rank_order(recv, recv_splits, packet, r)


def _all_to_all(t, fate: Fate, acc: dict, send, send_splits, recv_splits) -> torch.Tensor:
    """The backend's all-to-all; a rank lost in it makes this rank raise RankFailure."""
    try:
        return timed(acc, "comm_seconds", t.all_to_all, send, send_splits, recv_splits)
    except RuntimeError as e:
        fate.lose(t, -1, e)
        fate.check()


def _in_rank_order(recv: torch.Tensor, recv_splits: list[int], own: torch.Tensor, r: int) -> list[torch.Tensor]:
    """An all-to-all's received bytes cut per sender, with this rank's own packet in its place."""
    out, offset = [], 0
    for j, size in enumerate(recv_splits):
        out.append(own if j == r else recv[offset:offset + size])
        offset += size
    return out


def _sum_pairs(parts, codec, like: torch.Tensor, op, n: int):
    """(sum of the packets' pairs in rank order, averaged for AVG, in fp32 for 16-bit types; mask of
    the positions any packet named). Indices are unique within a packet, so each add is exact."""
    total = torch.zeros(like.numel(), dtype=_acc_dtype(like.dtype), device=like.device)
    named = torch.zeros(like.numel(), dtype=torch.bool, device=like.device)
    for part in parts:
        _, i, v = codec.parse(part, like.numel())
        total.index_add_(0, i, v.to(total.dtype))
        named[i] = True
    if _OPS[op] == 2:
        total.div_(n)
    return total, named


# ---- validation ----------------------------------------------------------------------------------------------

def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_contiguous():
        raise UnsupportedError(f"{name} must be contiguous")


def _check_device(t, *tensors: torch.Tensor) -> None:
    devices = {x.device for x in tensors}
    if len(devices) > 1:
        raise UnsupportedError(f"tensors are on different devices: {sorted(map(str, devices))}")
    dev = devices.pop()
    if isinstance(t, TorchTransport) and t.meta_device.type == "cpu" and dev.type != "cpu":
        raise UnsupportedError(f"the process group's backend (gloo) takes CPU tensors here, got a tensor on {dev}")


def input_size(x) -> tuple[int, int]:
    """(numel, bytes) of a call's input; -1 elements for a non-tensor (the call fails validation)."""
    if not isinstance(x, torch.Tensor):
        return -1, 0
    return x.numel(), x.numel() * x.element_size()


def _world_multiple(name, big_label, big, small_label, small):
    """The size check of reduce-scatter and all-gather: one buffer holds world-size x the other."""
    def check(t):
        if big.dtype != small.dtype:
            raise ValueError(f"{big_label} is {big.dtype} but {small_label} is {small.dtype}")
        if big.numel() != t.size * small.numel():
            raise ValueError(f"{name} {big_label} has {big.numel()} elements; it must have world size ({t.size}) "
                             f"x {small_label} ({small.numel()}) = {t.size * small.numel()}")
    return check


def prepare(name, group, tensors, op, codec, numel, nbytes, check):
    """Validate locally: (transport, the resolved codec (AUTO where "auto" learns), the error or
    None). A call with an error must still join the metadata exchange (``refuse``), in its
    place in the order of calls, so that no rank hangs."""
    t = TorchTransport.of(group)
    dtype = tensors[-1].dtype if isinstance(tensors[-1], torch.Tensor) else None
    error, resolved = None, None
    try:
        for label, x in zip(("tensor",) if len(tensors) == 1 else ("output", "input"), tensors):
            _check_tensor(label, x)
        _check_device(t, *tensors)
        if op is not None:
            check_op(op)
            if _OPS[op] == 2 and not dtype.is_floating_point:
                raise UnsupportedError("AVG of integer tensors is not supported; use SUM and divide")
        resolved = codec if codec is AUTO else resolve_codec(codec, dtype, nbytes)
        if codec == "auto" and resolved is not NATIVE and config.AUTO_LEARN:
            resolved = AUTO
        if not getattr(resolved, "exact", True):
            if name != "all_reduce":
                raise UnsupportedError(f"lossy codec {resolved!r} works with all_reduce only, not {name}")
            if _OPS.get(op) not in (1, 2):
                raise UnsupportedError(f"lossy codec {resolved!r} reduces with SUM or AVG only")
        check(t)
    except (TypeError, ValueError, UnsupportedError) as e:
        error = e
    return t, resolved, error


def refuse(name: str, t, input, op, error: Exception) -> None:
    """Raise ``error`` here, and MismatchError on the group's other ranks, whose calls are in
    their metadata exchange (an invalid call's only message)."""
    numel, _ = input_size(input)
    Call(name, input.dtype if isinstance(input, torch.Tensor) else None, numel, op, None).exchange(t, [], error)


def check_shapes(name: str, output, input):
    """The size check of a call: all-reduce has one tensor; reduce-scatter's input and
    all-gather's output hold world-size x the other."""
    if name == "all_reduce":
        return lambda t: None
    if name == "reduce_scatter":
        return _world_multiple(name, "input", input, "output", output)
    return _world_multiple(name, "output", output, "input", input)


def finish(name, codec, acc) -> dict:
    _record(name, getattr(codec, "name", "native") if codec is not None else "native", **acc)
    return acc


def new_acc():
    return dict(raw_bytes=0, wire_bytes=0, meta_bytes=0, codec_seconds=0.0, comm_seconds=0.0)


# ---- one flat collective with a decided codec ----------------------------------------------------------------

def run_flat(name: str, t, output: torch.Tensor, input: torch.Tensor, op, codec, acc: dict, ready=None,
             fate: Fate | None = None) -> None:
    """``name`` on ``t``'s group with ``codec`` (NATIVE, None or a codec object), on this thread.
    all_reduce works in place on ``input`` (``output`` is the same tensor); there ``ready(a, b)``
    may fill columns [a, b) of the input's world-size chunks just before the pipeline needs them
    (the input's length must then be a multiple of the group's size). ``fate``: the outcome of
    the call this is part of (zipccl.failure), which the caller settles; None: this call's own,
    settled here (every rank raises RankFailure if any failed)."""
    own = fate is None
    if own:
        fate = Fate.of(name, t)
    numel = input.numel()
    if ready is not None and (name != "all_reduce" or numel % t.size or codec in (NATIVE, None)
                              or not getattr(codec, "exact", True)):
        if name != "all_reduce" or numel % t.size:
            raise ValueError("ready() takes an all-reduce whose length is a multiple of the group's size")
        fate.guard(REDUCE, ready, 0, numel // t.size)
        ready = None
    if codec is NATIVE or codec is None:
        t0 = time.perf_counter()
        if codec is None or config.CHECK_NATIVE:
            Call(name, input.dtype, numel, op, None).exchange(t, [], None, fate)
        tensors = (input.view(-1),) if name == "all_reduce" else (output.view(-1), input.view(-1))
        try:  # in a failed call too: the peers are in it
            if not fate.broken(t):
                t.native(name, *tensors, op=op)
        except RuntimeError as e:  # the backend lost a rank, or timed out (ZIPCCL_TIMEOUT)
            fate.lose(t, -1, e)
        acc["comm_seconds"] += time.perf_counter() - t0
    elif name == "reduce_scatter":
        call = Call(name, input.dtype, numel, op, codec)
        result = _reduce_scatter_chunks(t, input.view(t.size, -1), op, codec, call, acc, fate)
        if not fate.failed:
            output.view(-1).copy_(result)
    elif name == "all_gather":
        mine, outs = input.view(-1), output.view(t.size, -1)
        gather = _Gather(t, codec, Call(name, input.dtype, numel, None, codec), acc, lambda j, a, b: outs[j, a:b],
                         fate)
        for a, b in pieces(numel, t.size, input.element_size()):
            gather.push(a, b, mine[a:b])
        gather.finish()
    elif not getattr(codec, "exact", True):
        _sparse_all_reduce(t, input.view(-1), op, codec, Call(name, input.dtype, numel, op, codec), acc, fate)
    else:
        flat, n = input.view(-1), t.size
        m = -(-numel // n)
        padded = flat if m * n == numel else torch.cat([flat, flat.new_zeros(m * n - numel)])
        gather = _Gather(t, codec, None, acc, lambda j, a, b: flat[min(numel, j * m + a):min(numel, j * m + b)], fate)
        call = Call(name, input.dtype, numel, op, codec)
        _reduce_scatter_chunks(t, padded.view(n, m), op, codec, call, acc, fate,
                               on_piece=gather.push, ready=ready)  # gather each reduced piece as soon as it exists
        gather.finish()
    if own:
        timed(acc, "comm_seconds", fate.settle, t)


PLAN_CODECS = {"native": NATIVE, "raw": _RAW, "lossless": _LOSSLESS}


def flat_collective(name: str, group, output, input, op, codec, async_op: bool):
    """One flat collective (the public all_reduce, reduce_scatter and all_gather of this module):
    validated, its codec decided ("auto": among FLAT_PLANS), run now or queued (async_op)."""
    numel, nbytes = input_size(input)
    t, c, error = prepare(name, group, (input,) if name == "all_reduce" else (output, input), op, codec, numel,
                          nbytes, check_shapes(name, output, input))

    def run():
        if error is not None:
            refuse(name, t, input, op, error)
        acc, used = new_acc(), [c]
        if c is AUTO:
            def go(plan):
                used[0] = PLAN_CODECS[plan]
                run_flat(name, t, output, input, op, used[0], acc)
            planned(t.group, name, input.dtype, nbytes, FLAT_PLANS, go)
        else:
            run_flat(name, t, output, input, op, c, acc)
        return finish(name, used[0], acc)

    return _run(run, async_op)


# ---- public API: the flat collectives (zipccl.all_reduce & co. add topology and lossy state on top) -----------

def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                   async_op: bool = False, *, codec="auto"):
    """Like ``dist.reduce_scatter_single``: ``input`` holds world-size chunks of ``output.numel()``;
    rank r receives the reduction of every rank's chunk r in ``output``."""
    return flat_collective("reduce_scatter", group, output, input, op, codec, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False, *, codec="auto"):
    """Like ``dist.all_gather_single``: ``output`` receives every rank's ``input`` in rank order."""
    return flat_collective("all_gather", group, output, input, None, codec, async_op)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False, *, codec="auto"):
    """Like ``dist.all_reduce``, in place; every rank ends with bit-identical results.

    codec: "auto" (the backend's own collective, raw or lossless, learned per group:
    zipccl.auto; never lossy), "native", "raw", "lossless", or opt-in lossy: "topk"
    (TopK(0.01)) or a TopK instance."""
    return flat_collective("all_reduce", group, tensor, tensor, op, codec, async_op)
