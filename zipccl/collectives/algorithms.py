"""The dense algorithms: direct and ring reduce-scatter, the all-gather pipeline, reduction in rank order."""

from __future__ import annotations

import time

import torch

from .. import config
from ..errors import FormatError
from ..failure import ENCODE, REDUCE, SIZE, Fate
from ..kernels import reduce
from .metadata import (_TAG_AG_DATA, _TAG_AG_SIZES, _TAG_DATA, _TAG_RS_DATA, _TAG_RS_SIZES, _TAG_SIZE, Call,
                       _meta_bytes, timed)
from .pipeline import (Deferred, _land, _sizes, decode_all, decode_to, defers, encode_all, land_plain, pieces, plain,
                       post, post_plain)
from .resolve import _OPS


def _acc_dtype(dtype):
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _reduce_into(acc: torch.Tensor, x: torch.Tensor, op_code: int) -> None:
    if op_code in (1, 2):
        acc.add_(x)
    elif op_code == 3:
        torch.maximum(acc, x.to(acc.dtype), out=acc)
    else:
        torch.minimum(acc, x.to(acc.dtype), out=acc)


#: Reduce-scatter pieces on the ring at once: one piece's codec work overlaps another's transfer.
RING_DEPTH = 2


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
    if plain(codec):
        return _reduce_scatter_plain(t, chunks, op, call, acc, fate, on_piece, ready)
    n, r = t.size, t.rank
    op_code = _OPS[op]
    m = chunks.shape[1]
    result = torch.empty(m, dtype=chunks.dtype, device=chunks.device)
    cuts = pieces(m, n, chunks.element_size(), cuda=chunks.is_cuda)

    def encode(k):
        """This rank's packets of piece k and a _SizeMail of their sizes (the first piece's
        encoding overlaps the call's metadata exchange: _sizes)."""
        a, b = cuts[k]
        if ready is not None:
            fate.guard(REDUCE, ready, a, b)

        def packets():
            peers = [j for j in range(n) if j != r]
            out, sizes = timed(acc, "codec_seconds", encode_all, codec, [chunks[j, a:b] for j in peers])
            if isinstance(out, Deferred):  # sizes still on the device: the size mail reads them
                out = out.to(r, n)
                return out, out.sizes
            out.insert(r, chunks[r, :0].view(torch.uint8))
            sizes.insert(r, 0)
            return out, sizes

        acc["raw_bytes"] += (n - 1) * (b - a) * chunks.element_size()
        return _sizes(t, None if k else call, _TAG_RS_SIZES, acc, packets, fate)

    def post_piece(k, encoded):
        packets, sizes = encoded
        a, b = cuts[k]
        bound = codec.max_encoded_size(b - a, chunks.dtype)
        return (k, bound, *post(t, packets, sizes, _TAG_RS_DATA, acc, chunks.device, bound), sizes)

    def finish(k, bound, sends, recvs, sizes):
        a, b = cuts[k]
        parts = torch.empty((n, b - a), dtype=chunks.dtype, device=chunks.device)
        # On the GPU every landed packet in one decode_many; elsewhere each as it lands (its decode
        # overlaps the next peer's wait)
        batch = (lambda landed: timed(acc, "codec_seconds", decode_all, codec, landed, parts, fate, t)) \
            if defers(codec, chunks) else None
        _land(t, acc, sends, recvs, sizes, bound,
              lambda j, buf: timed(acc, "codec_seconds", decode_to, codec, buf, parts[j], fate, t, j), batch)
        timed(acc, "codec_seconds", fate.guard, REDUCE, _reduce_piece, chunks, r, op_code, parts, result, a, b)
        if on_piece is not None:
            on_piece(a, b, result[a:b])

    flight, upcoming = None, encode(0)
    for k in range(len(cuts)):
        current = post_piece(k, upcoming)
        if flight is not None:
            finish(*flight)
        upcoming = encode(k + 1) if k + 1 < len(cuts) else None
        flight = current
    finish(*flight)
    return result


def _reduce_piece(chunks, r: int, op_code: int, parts, result, a: int, b: int) -> None:
    """result[a:b] = every rank's columns [a, b) of chunk r reduced in rank order: ``parts[j]``
    rank j's (row r unused: this rank's own is ``chunks[r, a:b]``), rounded once."""
    n = chunks.shape[0]
    if op_code in (1, 2) and chunks.dtype in reduce.DTYPES and chunks.device.type == "cpu":
        reduce.sum_in_rank_order(parts, chunks[r, a:b], r, op_code == 2, result[a:b])
    else:
        total = reduce_in_rank_order([chunks[r, a:b] if j == r else parts[j] for j in range(n)], op_code, n,
                                     chunks.dtype)
        result[a:b].copy_(total)


def _reduce_scatter_plain(t, chunks, op, call: Call, acc: dict, fate: Fate, on_piece=None,
                          ready=None) -> torch.Tensor:
    """The direct reduce-scatter of a codec that moves bytes as they are (pipeline.plain): the
    call's exchange first, then each piece's rows straight from ``chunks`` to their owners and
    from the peers straight into the piece's rows, two pieces deep, each reduced as in
    ``_reduce_scatter_direct`` (the same bits): no packet, size mail or decode."""
    n, r = t.size, t.rank
    op_code, itemsize = _OPS[op], chunks.element_size()
    m = chunks.shape[1]
    result = torch.empty(m, dtype=chunks.dtype, device=chunks.device)
    cuts = pieces(m, n, itemsize, plain=True, cuda=chunks.is_cuda)
    timed(acc, "comm_seconds", call.exchange, t, [], None, fate)
    acc["meta_bytes"] += _meta_bytes(n)
    peers = [j for j in range(n) if j != r]

    def post_piece(k):
        a, b = cuts[k]
        if ready is not None:
            fate.guard(REDUCE, ready, a, b)
        parts = torch.empty((n, b - a), dtype=chunks.dtype, device=chunks.device)
        acc["raw_bytes"] += (n - 1) * (b - a) * itemsize
        return k, parts, *post_plain(t, {j: chunks[j, a:b] for j in peers}, {j: parts[j] for j in peers},
                                     _TAG_RS_DATA, acc, fate)

    def finish(k, parts, sends, recvs):
        a, b = cuts[k]
        land_plain(t, sends, recvs, acc, fate)
        timed(acc, "codec_seconds", fate.guard, REDUCE, _reduce_piece, chunks, r, op_code, parts, result, a, b)
        if on_piece is not None:
            on_piece(a, b, result[a:b])

    flight = post_piece(0)
    for k in range(1, len(cuts)):
        current = post_piece(k)
        finish(*flight)
        flight = current
    finish(*flight)
    return result


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
            return (torch.add, torch.add, torch.maximum, torch.minimum)[op_code - 1](
                decode_to(codec, recv, scratch, fate, t, prv), mine)
        total = decode_to(codec, recv, scratch, fate, t, prv).to(_acc_dtype(chunks.dtype), copy=True)
        _reduce_into(total, mine, op_code)
        return total

    def ring(a: int, b: int):
        scratch = torch.empty(b - a, dtype=chunks.dtype, device=chunks.device)
        bound = codec.max_encoded_size(b - a, chunks.dtype)
        total = chunks[prv, a:b]
        for s in range(1, n):
            packet = timed(acc, "codec_seconds", fate.guard, ENCODE, codec.encode, total)
            # host tensors: a transport with a mail channel (NCCL) carries them apart from the packets
            size_out = torch.tensor([packet.numel() if packet is not None else -fate.code], dtype=torch.int64)
            size_in = torch.empty(1, dtype=torch.int64)
            sends = []  # alive until waited
            with t.grouped():  # the sizes first, so that each packet's receive has its exact size
                if fate.alive(t, nxt):
                    sends.append(fate.send(t, size_out, nxt, _TAG_SIZE))
                got_size = fate.recv(t, size_in, prv, _TAG_SIZE) if fate.alive(t, prv) else None
            acc["meta_bytes"] += 8
            acc["raw_bytes"] += (b - a) * itemsize
            yield
            recv, got, size = None, None, None
            if timed(acc, "comm_seconds", fate.wait, t, got_size, prv):
                size = int(size_in)
                if size < 0:
                    fate.heard(-size)
                    size = None  # a failed sender sends no packet
                elif size > bound:
                    fate.fail(SIZE, FormatError(f"rank {t.global_rank(prv)} announced a packet of {size} bytes, "
                                                f"above the codec's bound of {bound}"), rank=t.global_rank(prv))
            with t.grouped():  # the packet, if there is one, and the predecessor's
                if packet is not None and fate.alive(t, nxt):
                    sends.append(fate.send(t, packet, nxt, _TAG_DATA))
                    acc["wire_bytes"] += packet.numel()
                if size is not None and fate.alive(t, prv):  # gloo: a message longer than the buffer breaks it
                    recv = torch.empty(min(size, bound) if t.loose_receives else size, dtype=torch.uint8,
                                       device=chunks.device)
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

    waiting = [ring(a, b) for a, b in pieces(m, n, itemsize, cuda=chunks.is_cuda)]
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
    peers' sizes (None: a plain piece, whose ``short`` receives land in scratch), and the receives."""
    __slots__ = ("a", "b", "bound", "mine", "sends", "sizes", "recvs", "short")

    def __init__(self, a: int, b: int, bound: int, mine: torch.Tensor, sends: list, sizes, recvs: dict,
                 short: dict | None = None):
        self.a, self.b, self.bound, self.mine = a, b, bound, mine
        self.sends, self.sizes, self.recvs, self.short = sends, sizes, recvs, short


class _Gather:
    """All-gather pipeline: ``push`` this rank's piece [a, b); its packet goes to every peer at
    once, and every peer's packet of the piece is decoded into ``dest(j, a, b)`` (a view that
    may be shorter: the padding of all-reduce). Three pieces deep: pushing piece k sends it,
    posts its receives (see pipeline.post) and completes piece k-2. Direct rather than
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
        if plain(self.codec):
            self._push_plain(a, b, mine)
            return

        def encode():
            packets, sizes = timed(acc, "codec_seconds", encode_all, self.codec, [mine])
            if isinstance(packets, Deferred):  # its size still on the device: the size mail reads it
                packets = packets.to(t.rank, n)
                return packets, packets.sizes
            return packets[0], sizes * n

        packet, sizes = _sizes(t, self.call, _TAG_AG_SIZES, acc, encode, self.fate)
        self.call = None  # checked: later pieces mail their sizes
        bound = self.codec.max_encoded_size(b - a, mine.dtype)
        sends, recvs = post(t, packet, sizes, _TAG_AG_DATA, acc, mine.device, bound)
        acc["raw_bytes"] += (n - 1) * mine.numel() * mine.element_size()
        if not self.fate.failed:
            own = self.dest(t.rank, a, b)
            own.copy_(mine[:own.numel()])
        self.flights.append(_Piece(a, b, bound, mine, sends, sizes, recvs))
        if len(self.flights) >= 3:
            self._complete(self.flights.pop(0))

    def _push_plain(self, a: int, b: int, mine: torch.Tensor) -> None:
        """``push`` for a plain codec (pipeline.plain): the call's exchange before its first
        piece; ``mine`` to every peer as it is, each peer's piece received straight into its
        place where that is whole (else into scratch, copied when it lands)."""
        t, n, acc, fate = self.t, self.t.size, self.acc, self.fate
        if self.call is not None:
            timed(acc, "comm_seconds", self.call.exchange, t, [], None, fate)
            acc["meta_bytes"] += _meta_bytes(n)
            self.call = None
        peers = [j for j in range(n) if j != t.rank]
        into, short = {}, {}
        for j in peers:
            dest = self.dest(j, a, b)
            if dest.numel() == b - a:
                into[j] = dest
            else:  # all-reduce's padding: the last rank's piece is cut short
                into[j] = short[j] = mine.new_empty(b - a)
        sends, recvs = post_plain(t, {j: mine for j in peers}, into, _TAG_AG_DATA, acc, fate)
        acc["raw_bytes"] += (n - 1) * mine.numel() * mine.element_size()
        own = self.dest(t.rank, a, b)
        own.copy_(mine[:own.numel()])
        self.flights.append(_Piece(a, b, 0, mine, sends, None, recvs, short))
        if len(self.flights) >= 3:
            self._complete(self.flights.pop(0))

    def finish(self) -> None:
        """Complete every piece in flight."""
        while self.flights:
            self._complete(self.flights.pop(0))

    def _complete(self, f: _Piece) -> None:
        if f.sizes is None:  # a plain piece (_push_plain)
            land_plain(self.t, f.sends, f.recvs, self.acc, self.fate)
            for j, buf in f.short.items():
                dest = self.dest(j, f.a, f.b)
                dest.copy_(buf[:dest.numel()])
            return
        _land(self.t, self.acc, f.sends, f.recvs, f.sizes, f.bound, lambda j, buf: self._decode(j, buf, f.a, f.b, f.mine))

    def _decode(self, j: int, part: torch.Tensor, a: int, b: int, mine: torch.Tensor) -> None:
        t0 = time.perf_counter()
        try:
            dest = self.dest(j, a, b)
            if dest.numel() == b - a:
                decode_to(self.codec, part, dest, self.fate, self.t, j)  # straight into the caller's buffer
            else:
                if self.scratch is None or self.scratch.numel() < b - a:
                    self.scratch = torch.empty_like(mine)
                dest.copy_(decode_to(self.codec, part, self.scratch[:b - a], self.fate, self.t, j)[:dest.numel()])
        finally:
            self.acc["codec_seconds"] += time.perf_counter() - t0
