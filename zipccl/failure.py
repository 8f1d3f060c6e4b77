"""How one rank's failure inside a collective reaches every rank of its group, in bounded time.

The ranks of a call follow one schedule of messages: the same pieces, peers and tags on
every rank. A rank that fails (its encoder, decoder or reduction raises, a peer announces a
packet larger than the codec's bound) does not leave the schedule, or its peers would wait
for it until the group's timeout. It goes on *poisoned*: no more codec work, a poison code
(the failing rank and the kind of failure) in place of every size it has yet to send, a
one-byte message in place of every packet, and it still receives what its peers send. A
peer that reads a poison code goes poisoned too. Every rank so reaches the end of the
schedule, every message matched, in about one round of pieces, and the group stays usable.
At the end of the call the ranks tell each other their status, pairwise (``settle``): any
failure anywhere makes every rank raise ``RankFailure`` naming the rank that failed and why.

A rank that dies breaks its connections: operations with it fail at once (gloo sees the
socket close) or, where it hangs instead, after ``ZIPCCL_TIMEOUT`` seconds (unset:
``config.DEFAULT_TIMEOUT``), which closes them. The survivors skip it, finish poisoned, and raise
``RankFailure`` naming it, with ``broken=True``: the group must be rebuilt. Which rank a loss is
blamed on comes from evidence (``Fate.lose``): the ranks' heartbeats in the job's store
(zipccl.transport.heartbeat) name a rank that went silent, or one that never reached the call;
only where they name none is it the peer whose operation failed, and then only where the
transport's error identifies that peer (gloo's closed connection; not a wait that ran out, nor
any NCCL error: all operations of an NCCL group complete together). A rank that dies
in the status round itself may have told some survivors its status and not others; those
that see its connection break there have all the call's messages and do not raise for it
(``settle``; one that gave up waiting on it does), so no survivor leaves the group's
schedule alone: every one of them loses it at the first exchange of the group's next call,
and raises there (a call that goes to the backend's own collective fails as
torch.distributed does).
"""

from __future__ import annotations

import time

import torch

from . import config
from .errors import FormatError, RankFailure, ZipcclError
from .reference.packet import read_all
from .transport import heartbeat
from .transport.cupy_nccl import abort_together

__all__ = ["Fate", "CORRUPT", "ENCODE", "DECODE", "SIZE", "REDUCE", "LOST", "MEMORY", "describe"]

CORRUPT, ENCODE, DECODE, SIZE, REDUCE, LOST, MEMORY, OTHER = range(8)
_KINDS = 8
NAMES = ("corrupt", "encode", "decode", "size", "reduce", "lost", "memory", "other")
_WHAT = {CORRUPT: "it sent a packet that failed validation", ENCODE: "encoding failed",
         DECODE: "decoding failed",
         SIZE: "a peer announced a packet larger than the codec's bound", REDUCE: "the reduction failed",
         LOST: "it stopped answering (died, or no answer within ZIPCCL_TIMEOUT)",
         MEMORY: "the node's shared memory could not grow", OTHER: "an unexpected error"}


def code(rank: int, kind: int) -> int:
    """The poison code of ``kind`` on ``rank`` (-1: a rank not known); sizes carry it negated.
    Above 1 for every rank from -1 up: a size must be negative, and a point-to-point verdict's
    0 and 1 mean well and a mismatch."""
    return 1 + kind + _KINDS * (rank + 2)


def timed_out(error: BaseException | None) -> bool:
    """Whether ``error`` is a wait that ran out (this rank gave up on its peer), not a broken
    connection: a TimeoutError, or an error its transport marked ``timed_out``."""
    return isinstance(error, TimeoutError) or bool(getattr(error, "timed_out", False))


def identifies(error: BaseException | None) -> bool:
    """Whether ``error`` of an operation with one peer says that *that* peer is gone (gloo's
    closed connection), rather than that this rank gave up waiting (``timed_out``) or that its
    transport cannot tell which peer of the group failed (``anonymous``: NCCL's errors)."""
    return error is not None and not timed_out(error) and not getattr(error, "anonymous", False)


def describe(value: int) -> tuple[int, int]:
    """(rank, kind) of a poison code."""
    value -= 1
    return value // _KINDS - 2, value % _KINDS


class Fate:
    """One call's outcome on this rank, shared by the phases and levels of the call. Ranks are
    the job's (as dist.get_rank()): the levels of a hierarchical call are other groups."""

    __slots__ = ("name", "rank", "first", "error", "lost", "hurry", "gave_up", "verdicts", "began", "evidence",
                 "members")

    def __init__(self, name: str, rank: int, members=None):
        """``rank``: this rank in the job; ``members``: as in ``of``."""
        self.name, self.rank = name, rank
        self.first: tuple[int, int] | None = None  # (rank, kind) of the first failure known here
        self.error: BaseException | None = None    # this rank's own exception, if it failed
        self.lost: set = set()                      # (transport id, peer) whose connections broke
        self.hurry: float | None = None             # seconds each later wait may take, once a rank is lost (_hurry)
        self.gave_up = False                        # a wait of this call ran out (this rank closed its connections)
        self.verdicts: list = []                    # (job rank of the sender, Verdict) of packets decoded, unread
        self.began = time.time()                    # wall time: a peer's heartbeat after it has seen the call begin
        self.evidence = ""                          # why a lost rank is the one named (heartbeat.Board.culprit)
        self.members = None if members is None else tuple(members)  # the call's job ranks, where not its group's

    @classmethod
    def of(cls, name: str, t, members=None) -> "Fate":
        """A call on transport ``t``'s group begins here (counted in this rank's heartbeat);
        ``members``: the job ranks of a call that involves only them (a message: its two ends),
        counted apart and alone asked about a loss, so that the other ranks of its group, which
        never make it, are neither counted behind nor named for it."""
        heartbeat.entered(t, members)
        return cls(name, t.global_rank(t.rank), members)

    @property
    def failed(self) -> bool:
        return self.first is not None

    @property
    def code(self) -> int:
        return 0 if self.first is None else code(*self.first)

    def fail(self, kind: int, error: BaseException, rank: int | None = None) -> None:
        """A failure found here (``rank``: the rank it is blamed on, in the group of the call's
        transport that reports it, where that is another: the sender of a corrupt packet)."""
        if self.first is None:
            self.first, self.error = (self.rank if rank is None else rank, kind), error

    def heard(self, value: int) -> None:
        """A poison code from a peer."""
        rank, kind = describe(value)
        if self.first is None:
            self.first = rank, kind
        if kind == LOST:
            self._hurry()

    def _hurry(self) -> None:
        """A rank is lost (here, or a peer says so): the group is broken, and each of the call's
        later waits may take GRACE of ZIPCCL_TIMEOUT, not all of it. A rank that gives up on a
        hung peer closes its connections, and a rank that was waiting on *it* (not on the hung
        one) learns of the loss only then, a full timeout in; a full timeout for its next wait,
        on the hung rank, would double its time (a survivor of a SIGSTOP raised 10.06 s after
        it, not 5.03, in about 1 run of 6). What remains is the poisoned end of the schedule
        and the status round, where live peers answer at once; a live peer busier than that
        in one stretch is given up on (and named only where the heartbeats show nothing
        else). Without ZIPCCL_TIMEOUT it is GRACE of config.DEFAULT_TIMEOUT."""
        if self.hurry is None:
            self.hurry = GRACE * config.wait_bound()

    def blame(self, t, peer: int, error: BaseException) -> None:
        """A packet from ``peer`` of transport ``t`` failed validation: a corrupt packet is its sender's failure."""
        self.fail(CORRUPT, error, rank=t.global_rank(peer))

    def guard(self, kind: int, fn, *args):
        """``fn(*args)``, or None with the failure recorded (nothing runs once poisoned)."""
        if self.first is not None:
            return None
        try:
            return fn(*args)
        except TimeoutError as e:
            self._ran_out(e)
        except Exception as e:  # noqa: BLE001 - every failure must reach the peers
            self.fail(kind, e)
        return None

    def _ran_out(self, error: TimeoutError) -> None:
        """A read of the device ran out (reference.packet.passed): its stream waits on a peer that
        stopped, which is no failure of this rank's codec; this rank gave up on the group."""
        self.gave_up = True
        self.fail(LOST, error, rank=-1)

    def decode(self, t, peer: int, fn, *args):
        """``guard`` for decoding ``peer``'s packet: a FormatError (the packet failed validation)
        is blamed on its sender, anything else on this rank's decoder."""
        if self.first is not None:
            return None
        try:
            return fn(*args)
        except FormatError as e:
            self.blame(t, peer, e)
        except TimeoutError as e:
            self._ran_out(e)
        except Exception as e:  # noqa: BLE001 - every failure must reach the peers
            self.fail(DECODE, e)
        return None

    def expect(self, t, peer: int, verdict) -> None:
        """A packet from ``peer`` of transport ``t`` decoded without a host read (decode_into):
        its verdict is read with the call's others before the call settles (``_read_verdicts``)."""
        self.verdicts.append((t.global_rank(peer), verdict))

    def _read_verdicts(self, t=None) -> None:
        """The unread verdicts, in one read: a bad packet is its sender's failure (CORRUPT). The
        read waits for the device, whose stream may wait on a receive from a peer that stopped:
        at most config.wait_bound(), or, with ``t`` (the call's group) given, until its transport's
        watch (Transport.watch: NCCL's errors, the ranks' heartbeats) finds a reason to give up:
        then this rank gave up on the group."""
        if not self.verdicts:
            return
        pending, self.verdicts = self.verdicts, []
        try:
            problems = read_all([v for _, v in pending], t.watch() if t is not None else None)
        except (TimeoutError, ZipcclError) as e:  # the wait ran out, or NCCL failed (NcclError: aborted)
            self.gave_up |= isinstance(e, TimeoutError)
            if t is not None:
                self.lose(t, -1, e)
            else:
                self.fail(LOST, e, rank=-1)
            return
        for (rank, _), problem in zip(pending, problems):
            if problem is not None:
                self.fail(CORRUPT, FormatError(problem), rank=rank)

    def lose(self, t, peer: int, error: BaseException) -> None:
        """An operation with ``peer`` of transport ``t`` (-1: a collective of its group) failed:
        its connection is gone. The first loss of the call is blamed on the rank that the
        heartbeats name (``_culprit``)."""
        self.lost.add((id(t), peer))
        if self.first is None:
            culprit = self._culprit(t, peer, error)
            self.fail(LOST, error, rank=culprit)
            b = heartbeat.board()
            if b is not None and culprit >= 0:
                b.report(culprit)
        self._hurry()

    def _culprit(self, t, peer: int, error: BaseException) -> int:
        """The job rank to blame for a loss on ``t``: the one the group's heartbeats name
        (silent, or never in the call), else ``peer`` (where ``error`` is not NCCL's, or ``t`` is a
        pair), else -1;
        but where ``peer`` reported a loss of its own during this call, the rank it lost.
        An error that identifies its peer is taken at once where no rank is silent yet (a
        killed rank's beat is fresh when its sockets close); one that does not waits up to
        ``stale_after()`` and a beat for a rank to fall silent (NCCL learns of a killed peer before
        its beat is stale)."""
        # NCCL's errors (``anonymous``): every operation of the group ends together, so the peer
        # waited on is the first in this rank's order, not the one that failed: none is named, but
        # on a pair (a message's two ends), whose one peer it is
        guess = peer >= 0 and (not getattr(error, "anonymous", False) or t.size == 2)
        named = t.global_rank(peer) if guess else -1
        b = heartbeat.board()
        if b is None:
            return named
        known = peer >= 0 and identifies(error)  # a collective's error names no peer
        if known and named >= 0:  # the peer may be a survivor, closing after a loss of its own
            first = b.reported(named, self.began)
            if first is not None:
                self.evidence = f"rank {named}, whose connection closed, had lost it first"
                return first
        patience = 0.0 if known else heartbeat.stale_after() + heartbeat.period()
        found = b.culprit(self.members if self.members is not None else heartbeat.members(t), self.began, patience)
        if found is None:
            if not known and named >= 0:
                self.evidence = "the peer whose operation ran out: no heartbeat names another rank"
            return named
        self.evidence = found[1]
        return found[0]

    def alive(self, t, peer: int) -> bool:
        return (id(t), peer) not in self.lost and not self.broken(t)

    def broken(self, t) -> bool:
        """A collective operation on ``t``'s group failed (peer unknown): the group is unusable."""
        return (id(t), -1) in self.lost

    def send(self, t, tensor, peer: int, tag: int):
        """``t.isend``, or None with the peer lost where posting fails (a connection closed)."""
        return self._post(t, t.isend, tensor, peer, tag)

    def recv(self, t, tensor, peer: int, tag: int):
        """``t.irecv``, or None with the peer lost where posting fails."""
        return self._post(t, t.irecv, tensor, peer, tag)

    def _post(self, t, post, tensor, peer: int, tag: int):
        try:
            return post(tensor, peer, tag)
        except RuntimeError as e:
            self.lose(t, peer, e)
            return None

    def wait(self, t, work, peer: int) -> bool:
        """Wait for ``work`` with ``peer`` (at most ``hurry`` seconds once a rank is lost: see
        ``_hurry``); False (and the peer lost) if it failed or timed out."""
        if work is None or not self.alive(t, peer):  # a lost peer's other operations are not waited for
            return False
        try:
            t.wait(work, timeout=self.hurry)
            return True
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError for a closed pair or a timeout
            self.gave_up |= timed_out(e)
            if getattr(e, "breaks_rule", False):  # strict mode (zipccl.transport.strict): this rank's call is
                self.lost.add((id(t), peer))      # wrong, and the connection's messages are out of step
                self.fail(OTHER, e)
            else:
                self.lose(t, peer, e)
            return False

    def settled(self, t, acc: dict, others: tuple = ()) -> None:
        """``settle``, its seconds and its status messages (8 bytes to each peer) counted in the
        call's ``acc`` (comm_seconds, meta_bytes), as the call's other exchanges are."""
        t0 = time.perf_counter()
        try:
            self.settle(t, others)
        finally:
            acc["comm_seconds"] += time.perf_counter() - t0
            acc["meta_bytes"] += 8 * (t.size - 1)

    def settle(self, t, others: tuple = ()) -> None:
        """The call's end on ``t``'s group: every rank's status to every other, pairwise; raises
        RankFailure on every rank if any failed. ``others``: the call's other transports (a
        hierarchical call's levels), which the round is fenced after and, where the group broke,
        aborted with ``t``.

        A peer lost in the round itself, where nothing had failed here before, does not fail
        the call on this rank: its status (well) had gone out already, and the peers that had
        the lost rank's status in time return from the call. Raising here would leave them
        waiting on this rank in the group's next call, to name it once they gave up on it.
        Every message of the call has come here, so its result is whole; the group's next call
        loses that rank at its first exchange, on every survivor alike, and raises there
        naming it. A failure heard in the round is raised all the same, ahead of the loss. Not
        where this rank gave up waiting on any peer of the call (``gave_up``): the transport has
        closed this rank's connections then (gloo: all of the group's), so it could not name
        the peer in a next call; it raises here, as every survivor that waits on a hung rank does.
        Nor where the loss is NCCL's (an ``anonymous`` error): there the call's data waits are the
        device's, and the abort that ends a receive pending on a dead peer ends it as if it had
        come, so nothing says that every message came; it raises here. The verdicts of packets
        decoded without a host read are read first, so that a corrupt one goes out in this rank's
        status."""
        self._read_verdicts(t)
        if t.size > 1:
            known = self.first
            mine = torch.tensor([self.code], dtype=torch.int64)
            got = torch.zeros(t.size, dtype=torch.int64)
            peers = [j for j in range(t.size) if j != t.rank and self.alive(t, j)]
            t.fence(*others)
            try:
                with t.grouped():
                    sends = [(j, self.send(t, mine, j, TAG_STATUS)) for j in peers]
                    recvs = [(j, self.recv(t, got[j:j + 1], j, TAG_STATUS)) for j in peers]
                heard = [int(got[j]) for j, w in recvs if self.wait(t, w, j) and int(got[j])]
                for j, w in sends:
                    self.wait(t, w, j)
            finally:
                t.unfence()  # the round is over: a later failure on t aborts no level of this call
            lost_here = known is None and self.first is not None and self.first[1] == LOST
            # only where the loss is a closed connection (gloo's): the host then waited for every
            # message before the round; NCCL's data waits are the device's, confirmed by nothing
            if lost_here and not self.gave_up and identifies(self.error):
                self.first, self.error, self.evidence = None, None, ""  # lost in the round: see above (self.lost keeps it)
            for value in heard:
                self.heard(value)
        if self.first is not None and (self.lost or self.first[1] == LOST):
            abort_together((t, *others))  # the group is broken: no operation of the call stays pending (NCCL)
        self.check()

    def check(self) -> None:
        """Raise RankFailure if this call failed anywhere this rank knows of."""
        self._read_verdicts()
        if self.first is None:
            return
        rank, kind = self.first
        broken = bool(self.lost) or kind == LOST
        who = f"rank {rank}" if rank >= 0 else "a rank the backend could not name"
        text = f"zipccl.{self.name}: {who} failed: {_WHAT.get(kind, _WHAT[OTHER])}"
        if self.evidence and kind == LOST:
            text += f" [{self.evidence}]"
        if self.error is not None:
            text += f" ({type(self.error).__name__}: {self.error})"
        elif kind in (CORRUPT, SIZE):
            text += " (its receiver's error says more)"
        elif rank != self.rank:
            text += " (its own error says more)"
        text += ("; the process group must be rebuilt" if broken else "; every rank raised, the group is usable")
        raise RankFailure(text, rank=rank, kind=NAMES[kind], broken=broken) from self.error


#: Once a call has lost a rank, each of its later waits may take this share of ZIPCCL_TIMEOUT.
GRACE = 0.25

#: The tag of the status exchange at the end of a call (the pipeline's tags are below it).
TAG_STATUS = 9
