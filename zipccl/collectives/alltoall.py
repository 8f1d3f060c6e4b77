"""All-to-all: every rank's chunk for every peer is its own packet, the packets pipelined in rounds.

A call exchanges its signature first (metadata.Call), with every rank's element counts to and
from every peer, so that every rank sees the whole matrix: a count that rank i sends to j
but j does not expect from i raises the same MismatchError on every rank before any data
moves. Each chunk is then cut into pieces (pipeline.pieces, from its own count, so that both
ends cut it alike) and the pieces move in rounds, two deep as in the direct reduce-scatter:
round k+1 is encoded and posted before round k is landed and decoded. Each round starts with a
_SizeMail to every peer (0 where a pair has no piece that round, a poison code once the call
has failed: zipccl.failure), so that a receive has its packet's exact size (DESIGN.md
invariant 12), or is posted at once at the codec's bound where the transport takes larger
receives. Each peer has its own codec (collectives.links): a ``PLAIN`` peer's bytes are sent as
they are and land in the caller's buffer. A rank's own chunk is copied. Zero counts move nothing.
"""

from __future__ import annotations

import torch

from ..errors import MismatchError
from ..failure import Fate
from .links import PLAIN
from .metadata import _TAG_A2A_DATA, _TAG_A2A_SIZES, Call, _meta_bytes, _peers, timed
from .pipeline import _land, _sizes, decode_to, encode_all, on_host, pieces

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
        return pieces(count, n, itemsize) if count else []

    out_cuts = [cut(sends[j].numel()) if j != r else [] for j in range(n)]
    in_cuts = [cut(recvs[j].numel()) if j != r else [] for j in range(n)]
    rounds = max((len(cut(matrix[i][j])) for i in range(n) for j in range(n) if i != j), default=0)

    def encode(k: int):
        peers = [j for j in _peers(t) if k < len(out_cuts[j])]
        for j in peers:
            a, b = out_cuts[j][k]
            acc["raw_bytes"] += (b - a) * itemsize

        def packets():
            out, sizes = [None] * n, [0] * n
            for codec in {id(codecs[j]): codecs[j] for j in peers}.values():
                mine = [j for j in peers if codecs[j] is codec]
                parts = [sends[j][slice(*out_cuts[j][k])] for j in mine]
                if codec is PLAIN:
                    coded = [PLAIN.encode(x) for x in parts], [x.numel() * itemsize for x in parts]
                else:
                    coded = on_host(timed(acc, "codec_seconds", encode_all, codec, parts))
                for j, packet, size in zip(mine, *coded):
                    out[j], sizes[j] = packet, size
            return out, sizes

        return _sizes(t, None, _TAG_A2A_SIZES, acc, packets, fate)

    def post(k: int, encoded):
        packets, mail = encoded
        alive = [j for j in _peers(t) if fate.alive(t, j)]
        bounds = {j: codecs[j].max_encoded_size(in_cuts[j][k][1] - in_cuts[j][k][0], dtype)
                  for j in alive if k < len(in_cuts[j])}
        lengths = dict(bounds) if t.loose_receives else {j: mail.wire_size(j) for j in bounds}
        stand_in = torch.zeros(1, dtype=torch.uint8, device=sends[r].device) if mail.poisoned else None
        sent, posted = [], {}
        with t.grouped():
            for j in alive:
                if k < len(out_cuts[j]) and fate.alive(t, j):
                    packet = stand_in if stand_in is not None else packets[j]
                    sent.append((j, fate.send(t, packet, j, _TAG_A2A_DATA)))
                    acc["wire_bytes"] += packet.numel()
            for j, length in lengths.items():
                if length is None or not fate.alive(t, j):
                    continue
                a, b = in_cuts[j][k]
                place = recvs[j][a:b].view(torch.uint8)
                buf = place if codecs[j] is PLAIN and length == place.numel() else \
                    torch.empty(length, dtype=torch.uint8, device=place.device)
                posted[j] = buf, fate.recv(t, buf, j, _TAG_A2A_DATA)
        return k, sent, posted, mail, bounds

    def land(k: int, sent, posted, mail, bounds):
        for j in _peers(t):
            if j not in posted and fate.alive(t, j):
                mail.get(j)  # a pair without a piece this round (or lost): its value is 0 or a poison code

        def decode(j: int, packet: torch.Tensor) -> None:
            dest = recvs[j][slice(*in_cuts[j][k])]
            if codecs[j] is PLAIN:
                PLAIN.decode(packet, dest)
            else:
                timed(acc, "codec_seconds", decode_to, codecs[j], packet, dest, fate, t, j)

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
