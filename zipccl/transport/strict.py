"""Strict transport mode (ZIPCCL_STRICT_TRANSPORT=1): gloo held to NCCL's rules, so that CPU tests
prove the pipeline would run on NCCL (DESIGN.md invariant 12).

NCCL matches a receive with the next send between the same two ranks, whatever the tag, and
needs the receive to have the send's exact byte count; a send and a receive that wait on each
other must be issued in one group (groupStart/groupEnd) or both ranks block. gloo forgives all
three. In strict mode a TorchTransport declares NCCL's capabilities (no loose receives, no
tags), sends every message on one tag, so that gloo matches in issue order as NCCL does, and
puts a small header before each payload: its byte count, the tag the sender meant, the
sender's group call and issue order, and the group calls of the receiver's two messages that
the sender waited for last. The receiving rank checks the header against its own
receive: a different size breaks the exact-size rule, a different tag means the two ranks
issued their messages in different orders (they would pair up wrongly without tags), and a
receive posted only after this rank had waited for another message of the same group call of
the sender breaks the fifth rule: NCCL may hold every message of a group until all of their
receives are posted (a group's end connects its channels with the peer's, and its messages may
wait for each other), so a receiver that waits for one of them before it posts the receive of
another waits for good (a framed send's size and packet, sent as one group, hung so on an H200;
NCCL's maintainers: "send() is allowed to block until the corresponding recv() is called");
likewise a send posted after its rank waited for a message of the group call that holds its
receive. Every send and receive must be issued inside ``grouped()``, and nothing may be waited for inside a
group (NCCL launches a group's operations at its end). Every message, header included, is on
the device that the group's backend carries (``device``: the CPU on gloo, the GPU on nccl):
NCCL cannot send a CPU tensor, so a host tensor on an NCCL group is the fourth broken rule
(DESIGN.md invariant 9); a test gives another device (``meta``) to check, on gloo's machines,
that every message of a path is staged onto it. A violation raises TransportRuleError.
Each rank keeps its last LOG_LENGTH operations (``log``) for the error messages and tests.

This costs one 48-byte message per payload: a checking mode for tests, not for production.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import NamedTuple

import torch

from ..errors import ZipcclError

__all__ = ["TransportRuleError", "Strict", "Op", "LOG_LENGTH", "HEADER"]

LOG_LENGTH = 4096
HEADER = 6  # int64s: bytes, the tag meant, the sender's group call, its issue order to this peer, and the
# receiver's group calls of the two messages from it that the sender waited for last (-1: none)


class TransportRuleError(ZipcclError):
    """A send or receive broke NCCL's rules in strict mode (ZIPCCL_STRICT_TRANSPORT=1)."""

    breaks_rule = True  # zipccl.failure: the call fails on this rank, and the connection is unusable


class Op(NamedTuple):
    """One send or receive as this rank issued it."""
    kind: str   # "send" or "recv"
    peer: int   # group rank
    order: int  # issue order among this rank's operations of the same kind with this peer
    nbytes: int
    group: int  # this rank's group call that issued it (1, 2, ...)
    tag: int    # the tag the caller meant (not used on the wire)


class _Checked:
    """A receive with its header: ``wait`` checks the header before the payload is awaited."""
    __slots__ = ("strict", "op", "header", "head", "body", "posted")

    def __init__(self, strict: "Strict", op: Op, header: torch.Tensor, head, body, posted: int):
        self.strict, self.op, self.header, self.head, self.body = strict, op, header, head, body
        self.posted = posted  # the receives this rank had waited for when it posted this one

    def wait(self, waiter) -> None:
        waiter(self.head)
        nbytes, tag, group, order, *theirs = self.header.tolist()
        op, here = self.op, f"rank {self.strict.rank}"
        if tag != op.tag:
            raise TransportRuleError(
                f"strict transport: {here}'s receive #{op.order} from rank {op.peer} (tag {op.tag}, {op.nbytes} bytes, "
                f"group call {op.group}) met that rank's send #{order} (tag {tag}, {nbytes} bytes, group call "
                f"{group}): the two ranks issue their messages in different orders, which only tags keep apart")
        if nbytes != op.nbytes:
            raise TransportRuleError(
                f"strict transport: {here}'s receive #{op.order} from rank {op.peer} (tag {op.tag}) has {op.nbytes} "
                f"bytes, but the send it matches has {nbytes}: NCCL needs exact sizes")
        if (done := self.strict.waited_before(op.peer, group, self.posted)) is not None:
            raise TransportRuleError(
                f"strict transport: {here}'s receive #{op.order} from rank {op.peer} (tag {op.tag}, {op.nbytes} bytes) "
                f"was posted after this rank had waited for that rank's message #{done}, sent in the same group call "
                f"({group}): NCCL may hold a group's messages until all their receives are posted, so the two ranks "
                "would wait for each other (send those messages in separate group calls)")
        if op.group in theirs:
            raise TransportRuleError(
                f"strict transport: {here}'s receive #{op.order} from rank {op.peer} (tag {op.tag}, {op.nbytes} bytes) "
                f"is in this rank's group call {op.group}, a message of which rank {op.peer} had waited for before it "
                f"posted the send: NCCL may hold a group's messages until all their receives' sends are posted, so "
                "the two ranks would wait for each other (post that receive in a group call of its own)")
        waiter(self.body)
        self.strict.received(op.peer, group, order)


class _Sent:
    __slots__ = ("head", "body")

    def __init__(self, head, body):
        self.head, self.body = head, body

    def wait(self, waiter) -> None:
        waiter(self.head)
        waiter(self.body)


class Strict:
    """One transport's record and checks on this rank (``rank``: its group rank)."""

    def __init__(self, rank: int, device: torch.device = torch.device("cpu")):
        self.rank, self.device = rank, device
        self.log: deque[Op] = deque(maxlen=LOG_LENGTH)
        self.group = 0          # group calls opened so far
        self._thread = threading.local()  # open: a group call of this thread is open
        self._lock = threading.Lock()
        self._orders: dict = {}  # (kind, peer) -> operations issued
        self._waited = 0  # receives waited for so far
        self._groups: dict = {}  # peer -> deque of (its group call, its send's order, self._waited then)

    @property
    def open(self) -> bool:
        """Whether this thread is inside a group call. Per thread: a send of zipccl.p2p is
        posted on the caller's thread while a receive waits on zipccl's async thread (they never
        share a peer's messages in one direction, so their orders stay apart)."""
        return getattr(self._thread, "open", False)

    @contextlib.contextmanager
    def grouped(self):
        if self.open:
            raise TransportRuleError("strict transport: a group call inside a group call")
        with self._lock:
            self.group += 1
            self._thread.group = self.group  # this thread's messages carry its own call's number
        self._thread.open = True
        try:
            yield
        finally:
            self._thread.open = False

    def _op(self, kind: str, tensor: torch.Tensor, peer: int, tag: int) -> Op:
        nbytes = tensor.numel() * tensor.element_size()
        if not self.open:
            raise TransportRuleError(f"strict transport: rank {self.rank}'s {kind} of {nbytes} bytes with rank {peer} "
                                     f"(tag {tag}) is outside a group call: NCCL would block it until the peer's "
                                     "matching operation starts, which may wait on this rank (use grouped())")
        if tensor.device != self.device:
            raise TransportRuleError(f"strict transport: rank {self.rank}'s {kind} of {nbytes} bytes with rank {peer} "
                                     f"(tag {tag}) is a tensor on {tensor.device}, but this group carries tensors on "
                                     f"{self.device} (NCCL moves device memory only)")
        with self._lock:
            order = self._orders.get((kind, peer), 0)
            self._orders[(kind, peer)] = order + 1
            op = Op(kind, peer, order, nbytes, self._thread.group, tag)
            self.log.append(op)
        return op

    def received(self, peer: int, group: int, order: int) -> None:
        """A receive from ``peer`` of its send #``order``, issued in its group call ``group``, waited for."""
        with self._lock:
            self._waited += 1
            self._groups.setdefault(peer, deque(maxlen=64)).append((group, order, self._waited))

    def waited_before(self, peer: int, group: int, posted: int) -> int | None:
        """The order of a send of ``peer``'s group call ``group`` that this rank had waited for
        before it had waited ``posted`` receives in all (when it posted a receive): None if none."""
        with self._lock:
            return next((order for g, order, at in self._groups.get(peer, ()) if g == group and at <= posted), None)

    def send(self, post, tensor: torch.Tensor, peer: int, tag: int) -> _Sent:
        """``post(tensor, peer)`` (one tag on the wire) of the header, then of ``tensor``."""
        op = self._op("send", tensor, peer, tag)
        with self._lock:
            last = [g for g, _, _ in self._groups.get(peer, ())][-2:]
        last = [-1] * (2 - len(last)) + last
        header = torch.tensor([op.nbytes, tag, op.group, op.order, *last], dtype=torch.int64, device=self.device)
        return _Sent(post(header, peer), post(tensor, peer))

    def recv(self, post, tensor: torch.Tensor, peer: int, tag: int) -> _Checked:
        op = self._op("recv", tensor, peer, tag)
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        with self._lock:
            posted = self._waited
        return _Checked(self, op, header, post(header, peer), post(tensor, peer), posted)

    def wait(self, work, waiter) -> None:
        """Wait for ``work`` (``waiter`` waits for one gloo handle), checking a receive's header."""
        if self.open:
            raise TransportRuleError("strict transport: an operation waited for inside a group call, before the "
                                     "group was issued (NCCL starts a group's operations at its end)")
        if isinstance(work, (_Checked, _Sent)):
            work.wait(waiter)
        else:
            waiter(work)
