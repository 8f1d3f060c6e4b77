"""Rank-consistent metadata: one exchange per call (status, signature, auto reports, first sizes),
then pairwise size mails for the later pipeline pieces; the tags of a call's messages."""

from __future__ import annotations

import time
import zlib

import torch

from .. import config
from .. import format as F
from ..errors import MismatchError
from ..failure import Fate
from ..transport.base import DeviceMail
from .autoplan import REPORT_SLOTS, _auto_group, _report_id, among_id
from .resolve import _OPS, _codec_id


_COLLECTIVES = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "all_reduce/gather": 4, "all_to_all": 5}
_FIELDS = ("collective", "dtype", "numel", "op", "codec", "reduce-scatter algorithm", "ZIPCCL_PIECE_BYTES")
_ALGORITHMS = {"direct": 1, "ring": 2}


def timed(acc: dict, key: str, fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    acc[key] += time.perf_counter() - t0
    return out


_TAG_SIZE, _TAG_DATA = 1, 2  # the ring: a partial sum's packet follows its size, each in order on its own tag
_TAG_RS_SIZES, _TAG_AG_SIZES = 3, 4  # _SizeMail of the direct reduce-scatter's and the all-gather's later pieces
_TAG_RS_DATA, _TAG_AG_DATA = 5, 6  # their packets
_TAG_META = 7  # the metadata exchange (a call's failure status: zipccl.failure.TAG_STATUS)
_TAG_A2A_SIZES, _TAG_A2A_DATA = 11, 12  # all-to-all: each round's _SizeMail, its packets (collectives.alltoall)
_TAG_P2P = 13  # a send's header, sizes and packets (collectives.p2p)
_TAG_SPARSE = 10  # the top-k packets' exchange (collectives.sparse_reduce)


def _shown(field: str, value: int) -> str:
    """A signature's field as the caller named it (a dtype, an op, a collective), where it is
    one of a known set; else its code (a codec's is a hash of its settings)."""
    names = {"collective": _COLLECTIVES, "reduce-scatter algorithm": _ALGORITHMS, "ZIPCCL_PIECE_BYTES": {"unset": 0},
             "dtype": {str(d).removeprefix("torch."): c for d, c in F.DTYPE_CODES.items()},
             "op": {str(op).rsplit(".", 1)[-1]: c for op, c in _OPS.items()}}.get(field, {})
    return next((name for name, code in names.items() if code == value), str(value))


def _peers(t) -> list[int]:
    """Every other rank, nearest successor first."""
    return [(t.rank + s) % t.size for s in range(1, t.size)]


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype as a number, the same on every rank: the format's code of a float type, else its
    element size in the thousands (a message's receiver cuts the sender's pieces by it, to drain
    them, whatever the types: collectives.p2p) and a checksum of its name below."""
    code = F.DTYPE_CODES.get(dtype)
    if code is not None:
        return code
    return 1000 * torch.empty(0, dtype=dtype).element_size() + zlib.crc32(str(dtype).encode()) % 1000


def _signed_codec(codec) -> int:
    """The codec's id, and whether auto chose it and among which plans (autoplan.among)."""
    candidates = among_id()
    if candidates is None:
        return _codec_id(codec)
    return zlib.crc32(f"{_codec_id(codec)}/auto:{candidates}".encode()) & 0x7FFFFFFF


class Call:
    """The signature of one phase of a call, checked against every rank's."""

    def __init__(self, name: str, dtype: torch.dtype, numel: int, op, codec):
        self.name = name
        self.values = [_COLLECTIVES[name], dtype_code(dtype), numel, _OPS.get(op, 0), _signed_codec(codec),
                       _ALGORITHMS[config.REDUCE_SCATTER], config.PIECE_BYTES]

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
        with t.grouped():  # every rank sends to and receives from every other: one group
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
            bad = [t.global_rank(r) for r in range(t.size) if rows[r, 0] == 1]  # named as the job names them
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
                        groups.setdefault(int(col[r]), []).append(t.global_rank(r))
                    shown = "; ".join(f"ranks {rs}: {_shown(field, v)}" for v, rs in groups.items())
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
    1.09-1.22 s -> 1.00-1.03 s). On gloo receives do not wait for it (see pipeline.post); a piece is
    landed only once every peer's value has come, which says how much of each packet is the
    packet. Once the call has failed on this rank (zipccl.failure) every value is the poison
    code, negated, and the piece's packets are one-byte stand-ins (``poisoned``)."""

    def __init__(self, t, values, tag: int, acc: dict, fate: Fate, peers: list[int] | None = None):
        """``values``: this rank's value for each rank, a list, or an int64 tensor on the device
        that the host has not read (pipeline.Deferred's sizes): each goes out as a DeviceMail,
        and the host learns them (``own``) with the peers' values, in one wait. ``peers``: the
        ranks that mail each other on this tag (both ends name each other), all others if None."""
        self.t, self.acc, self.fate = t, acc, fate
        self.poisoned = fate.failed
        if self.poisoned:
            values = [-fate.code] * t.size
        device = isinstance(values, torch.Tensor)
        # values[j] goes to rank j (alive until sent)
        self.out = values if device else torch.tensor(values, dtype=torch.int64)
        self.got = torch.zeros(t.size, dtype=torch.int64)
        self.mine = torch.empty(t.size, dtype=torch.int64) if device else self.out
        peers = [j for j in (_peers(t) if peers is None else peers) if fate.alive(t, j)]
        self.sends, self.read, self.recvs = [], None, {}
        if not peers and not device:
            return
        with t.grouped():
            self.sends = [(j, fate.send(t, DeviceMail(self.out[j:j + 1]) if device else self.out[j:j + 1], j, tag))
                          for j in peers]
            self.read = t.read_back(self.out, self.mine) if device else None
            self.recvs = {j: fate.recv(t, self.got[j:j + 1], j, tag) for j in peers}
        acc["meta_bytes"] += 8 * len(peers)

    def own(self) -> list[int]:
        """This rank's values on the host (read with the peers' where they were on the device)."""
        if self.read is not None:  # a failure here breaks the group (-1): the call fails on every rank
            timed(self.acc, "comm_seconds", self.fate.wait, self.t, self.read, -1)
            self.read = None
        return self.mine.tolist()

    def get(self, src: int) -> int | None:
        """``src``'s value; None where ``src`` failed (its poison code goes to the call's fate) or is lost."""
        value = self.announced(src)
        if value is None:
            return None
        if value < 0:
            self.fate.heard(-value)
            return None
        return value

    def announced(self, src: int) -> int | None:
        """``src``'s value as sent (negative: poisoned); None where ``src`` is lost."""
        work = self.recvs.pop(src, None)
        if work is not None and not timed(self.acc, "comm_seconds", self.fate.wait, self.t, work, src):
            return None
        if not self.fate.alive(self.t, src):
            return None
        return int(self.got[src])

    def wire_size(self, src: int) -> int | None:
        """The bytes ``src``'s packet of this piece has on the wire: its size, or the one-byte
        stand-in of a poisoned sender (see ``poisoned``); None where ``src`` is lost. What a
        transport without ``loose_receives`` needs before it can post the receive."""
        value = self.announced(src)
        return None if value is None else 1 if value < 0 else value

    def close(self) -> None:
        for j, w in self.sends:
            timed(self.acc, "comm_seconds", self.fate.wait, self.t, w, j)
        self.sends = []
