"""All-to-all: every rank's chunk for every peer is its own packet, the packets pipelined in rounds.

A call exchanges its signature first (metadata.Call), with every rank's element counts to and
from every peer, so that every rank sees the whole matrix: a count that rank i sends to j
but j does not expect from i raises the same MismatchError on every rank before any data
moves. Each chunk is then cut into pieces (pipeline.pieces, from its own count, so that both
ends cut it alike) and the pieces move in rounds, two deep as in the direct reduce-scatter:
round k+1 is encoded and posted before round k is landed and decoded. Each peer has its own
codec (collectives.links). Each round starts with a _SizeMail to every peer whose codec codes
(0 where a pair has no piece that round, a poison code once the call has failed:
zipccl.failure), so that a receive has its packet's exact size (DESIGN.md invariant 12), or is
posted at once at the codec's bound where the transport takes larger receives; where one codec
left its packets' sizes on the device (pipeline.Deferred), the mail reads them with the peers'
(one host wait a round). A ``PLAIN`` peer's bytes are sent as they are, whatever the call's
state, and land in the caller's buffer: both ends know their size, so no mail goes between
plain peers, and a call with plain peers alone (raw) waits on the host only for its exchange
and its status round, which settles a failure. A rank's own chunk is copied. Zero counts move
nothing.
"""

from __future__ import annotations

import torch

from ..errors import MismatchError
from ..failure import Fate
from .links import PLAIN
from .metadata import _TAG_A2A_DATA, _TAG_A2A_SIZES, Call, _meta_bytes, _peers, timed
from .pipeline import Deferred, _land, _sizes, decode_to, encode_all, on_host, pieces

__all__ = ["exchange_counts", "check_counts", "run_all_to_all"]


def counts_row(sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> list[int]:
    """This rank's row of the call's matrix: elements to each peer, then from each peer."""
    return [x.numel() for x in sends] + [x.numel() for x in recvs]


def check_counts(matrix: list[list[int]], ranks: list[int]) -> str | None:
    """Where the rows of every rank (``counts_row``) disagree, the first disagreement in words
    (``ranks``: the job's rank of each group rank), else None. The same on every rank."""
    n = len(matrix)
    bad = [(i, j) for i in range(n) for j in range(n) if matrix[i][j] != matrix[j][n + i]]
    if not bad:
        return None
    i, j = bad[0]
    more = f" (and {len(bad) - 1} more pairs)" if len(bad) > 1 else ""
    return (f"rank {ranks[i]} sends {matrix[i][j]} elements to rank {ranks[j]}, which expects "
            f"{matrix[j][n + i]} from it{more}")


def exchange_counts(t, call: Call, row: list[int], error: Exception | None, fate: Fate, acc: dict) -> list[list[int]]:
    """The call's metadata exchange with every rank's ``row``: the (ranks, 2 x ranks) matrix of
    counts; raises on every rank alike where a call is invalid, the signatures differ or the
    counts do not pair up."""
    rows = timed(acc, "comm_seconds", call.exchange, t, row, error, fate)
    acc["meta_bytes"] += _meta_bytes(t.size) + 8 * (t.size - 1) * t.size
    matrix = rows.tolist()
    problem = check_counts(matrix, [t.global_rank(j) for j in range(t.size)])
    if problem is not None:
        raise MismatchError(f"zipccl.{call.name}: {problem}")
    return matrix


class _Round:
    """A round's packets for its coded peers: {peer: packet}, or where ``deferred`` (a
    pipeline.Deferred) holds them, {peer: its place there}, their sizes read with the size mail."""
    __slots__ = ("packets", "deferred")

    def __init__(self, packets: dict, deferred):
        self.packets, self.deferred = packets, deferred

    def packet(self, j: int, own: list[int] | None) -> torch.Tensor:
        """Peer j's packet (``own``: this rank's sizes by rank, read with the size mail)."""
        if self.deferred is None:
            return self.packets[j]
        return self.deferred.packet(self.packets[j], own[j])


def run_all_to_all(t, sends: list[torch.Tensor], recvs: list[torch.Tensor], codecs: list, matrix: list[list[int]],
                   acc: dict, fate: Fate) -> None:
    """Move ``sends[j]`` (1-D, contiguous) to group rank j's ``recvs[this rank]``, with
    ``codecs[j]`` (PLAIN: the bytes as they are), after ``exchange_counts`` gave ``matrix``. The
    caller settles ``fate``."""
    n, r = t.size, t.rank
    itemsize = sends[r].element_size()
    dtype = sends[r].dtype
    if not fate.failed:
        recvs[r].copy_(sends[r])

    def cut(count: int) -> list[tuple[int, int]]:
        return pieces(count, n, itemsize, cuda=sends[r].is_cuda) if count else []

    out_cuts = [cut(sends[j].numel()) if j != r else [] for j in range(n)]
    in_cuts = [cut(recvs[j].numel()) if j != r else [] for j in range(n)]
    rounds = max((len(cut(matrix[i][j])) for i in range(n) for j in range(n) if i != j), default=0)

    coded = [j for j in _peers(t) if codecs[j] is not PLAIN]  # the pairs whose pieces' sizes are mailed

    def encode(k: int):
        peers = [j for j in _peers(t) if k < len(out_cuts[j])]
        for j in peers:
            a, b = out_cuts[j][k]
            acc["raw_bytes"] += (b - a) * itemsize
        return _sizes(t, None, _TAG_A2A_SIZES, acc, lambda: _encode_round(k, [j for j in peers if j in coded]), fate,
                      coded)

    def _encode_round(k: int, mine: list[int]):
        """(the coded peers' packets: ``_Round``, their sizes by rank: a list, or an int64 tensor on
        the device where one codec left them there, which the size mail reads with the peers')."""
        if not mine:
            return _Round({}, None), [0] * n
        kinds = {id(codecs[j]): codecs[j] for j in mine}
        if len(kinds) == 1:  # one codec for every coded peer (per_peer's inter): its packets in one go
            codec = codecs[mine[0]]
            packets, sizes = timed(acc, "codec_seconds", encode_all, codec, [sends[j][slice(*out_cuts[j][k])]
                                                                            for j in mine])
            if isinstance(packets, Deferred):  # the sizes stay on the device until the mail reads them
                zero = sizes.new_zeros(())
                at = {j: i for i, j in enumerate(mine)}
                return _Round(at, packets), torch.stack([sizes[at[j]] if j in at else zero for j in range(n)])
            return _Round(dict(zip(mine, packets)), None), [dict(zip(mine, sizes)).get(j, 0) for j in range(n)]
        out, sizes = {}, [0] * n
        for codec in kinds.values():
            peers = [j for j in mine if codecs[j] is codec]
            packets, got = on_host(timed(acc, "codec_seconds", encode_all, codec,
                                         [sends[j][slice(*out_cuts[j][k])] for j in peers]))
            for j, packet, size in zip(peers, packets, got):
                out[j], sizes[j] = packet, size
        return _Round(out, None), sizes

    def post(k: int, encoded):
        packets, mail = encoded
        packets = packets if packets is not None else _Round({}, None)  # the call failed before encoding: poisoned
        alive = [j for j in _peers(t) if fate.alive(t, j)]
        bounds = {j: codecs[j].max_encoded_size(in_cuts[j][k][1] - in_cuts[j][k][0], dtype)
                  for j in alive if k < len(in_cuts[j]) and j in coded}
        lengths = dict(bounds) if t.loose_receives else {j: mail.wire_size(j) for j in bounds}
        stand_in = torch.zeros(1, dtype=torch.uint8, device=sends[r].device) if mail.poisoned else None
        own = mail.own() if stand_in is None and packets.deferred is not None else None  # with the peers' sizes
        sent, posted, plain = [], {}, {}
        with t.grouped():
            for j in alive:
                if k < len(out_cuts[j]) and fate.alive(t, j):
                    if j not in coded:  # the bytes as they are, whatever the call's state: no size to agree on
                        packet = PLAIN.encode(sends[j][slice(*out_cuts[j][k])])
                    else:
                        packet = stand_in if stand_in is not None else packets.packet(j, own)
                    sent.append((j, fate.send(t, packet, j, _TAG_A2A_DATA)))
                    acc["wire_bytes"] += packet.numel()
            for j in alive:
                if k < len(in_cuts[j]) and j not in coded and fate.alive(t, j):  # lands in place
                    a, b = in_cuts[j][k]
                    plain[j] = fate.recv(t, recvs[j][a:b].view(torch.uint8), j, _TAG_A2A_DATA)
            for j, length in lengths.items():
                if length is None or not fate.alive(t, j):
                    continue
                buf = torch.empty(length, dtype=torch.uint8, device=sends[r].device)
                posted[j] = buf, fate.recv(t, buf, j, _TAG_A2A_DATA)
        return k, sent, posted, plain, mail, bounds

    def land(k: int, sent, posted, plain, mail, bounds):
        for j, work in plain.items():
            timed(acc, "comm_seconds", fate.wait, t, work, j)
        for j in coded:
            if j not in posted and fate.alive(t, j):
                mail.get(j)  # a pair without a piece this round (or lost): its value is 0 or a poison code

        def decode(j: int, packet: torch.Tensor) -> None:
            timed(acc, "codec_seconds", decode_to, codecs[j], packet, recvs[j][slice(*in_cuts[j][k])], fate, t, j)

        _land(t, acc, sent, posted, mail, max(bounds.values(), default=0), decode)

    if rounds == 0:
        return
    flight, upcoming = None, encode(0)
    for k in range(rounds):
        current = post(k, upcoming)
        if flight is not None:
            land(*flight)
        upcoming = encode(k + 1) if k + 1 < rounds else None
        flight = current
    land(*flight)
