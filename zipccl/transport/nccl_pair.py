"""NcclPair: the framed messages from one rank of a group to another on CUDA (zipccl.p2p).

Why not the group's NcclTransport: its communicators are made by every rank of the group
together, which a message between two of them is not (a pipeline stage's first send would wait
for ever for ranks that never send); and point-to-point issues from several threads of a rank
(sends on a lane per direction, receives on zipccl's async thread), while NCCL wants each
communicator's operations issued in one order by each of its ranks. So each ordered pair (sender,
receiver) of a group has its own two communicators (bulk and mail, as NcclTransport's), of those
two ranks alone: on it the sender only sends, from its lane, and the receiver only receives,
from its async thread, each on streams of their own, so two ranks that send to each other never
queue one's send behind the other's (one communicator per pair, as torch's point-to-point has,
needs both directions in one group call).

Made by the first message in that direction, by its two ends alone: the sender's ids reach the
receiver through the job's store, and each end then tells the other through the store whether it
succeeded, so both raise the same NcclError or neither does; every wait for the other end in the
store takes at most config.wait_bound(), and neither end enters NCCL before both have said they
will (NCCL's own making of a communicator waits for the other end without a bound: zipccl
waits for it as NcclTransport does, and an end that dies in that moment is named, RankFailure).
As NCCL's own making of a communicator (and torch's for its first message between two ranks),
the first message leaves once the receiver has posted its receive; the sender's thread is its
direction's lane (zipccl.p2p), not the caller's.

Ranks stay the group's (the peer of ``isend``/``irecv``, ``global_rank``), so zipccl's framing and
failure protocol see the same transport as elsewhere; only NCCL sees the pair's numbering.
"""

from __future__ import annotations

import atexit
import secrets
import threading
import time

import torch.distributed as dist

from .. import config, lifetime
from ..errors import RankFailure, ZipcclError
from . import heartbeat, nccl_stack, store
from .cupy_nccl import NcclError, NcclTransport, _error_of, _made_word, ended_at_exit

__all__ = ["NcclPair"]

_pairs: dict = lifetime.keep({})
_making: dict = lifetime.keep({})
_lock = threading.Lock()
atexit.register(ended_at_exit(_pairs))


class NcclPair(NcclTransport):
    """Messages from group rank ``src`` to group rank ``dst`` of ``group``, made on either end."""

    _without_ids = "an end of the pair could not load NCCL"

    @classmethod
    def of(cls, group, src: int, dst: int) -> "NcclPair":
        key = (group if group is not None else dist.GroupMember.WORLD, src, dst)
        t = _pairs.get(key)
        if t is None:
            lifetime.sweep()
            with _lock:
                making = _making.setdefault(key, threading.Lock())
            with making:  # one making per pair, and none waits for another pair's
                t = _pairs.get(key)
                if t is None:
                    t = _pairs[key] = cls(group, src, dst)
        return t

    def __init__(self, group, src: int, dst: int):
        if dist.get_rank(group) not in (src, dst):
            raise ValueError(f"rank {dist.get_rank(group)} of the group is neither end of the pair {(src, dst)}")
        self.pair, self._nonce = (src, dst), ""
        super().__init__(group)

    def _comm_rank(self, rank: int) -> int:
        return self.pair.index(rank)

    def _key(self, what: str) -> str:
        src, dst = (self._ranks[r] for r in self.pair)
        name = (self.group if self.group is not None else dist.GroupMember.WORLD).group_name
        return f"zipccl/nccl-pair/{name}/{src}>{dst}/{what}"

    def _share_id(self, error=None) -> bytes:
        """The sender's two unique ids, through the store, in a handshake that both ends finish
        before either enters NCCL (whose making of a communicator waits without a bound): the
        sender offers its ids under a fresh nonce ("id"), the receiver answers with the nonce and
        whether it has NCCL ("joined"), the sender confirms ("go/<nonce>"). Zeros where either
        end has no NCCL, so that neither enters it. A sender that gives up withdraws its offer."""
        self._members = [self._ranks[r] for r in self.pair]
        ready = "" if self.nccl is not None else "NCCL could not be loaded"
        if self.rank == self.pair[0]:
            self._nonce = secrets.token_hex(8)
            ids = b"".join(self.nccl.get_unique_id() for _ in range(2)) if self.nccl is not None else b""
            store.own().set(self._key("id"), self._nonce.encode() + b"|" + ids)
            try:
                theirs = self._hear("joined", self._nonce)
            except NcclError:
                store.own().delete_key(self._key("id"))
                raise
            store.own().set(self._key(f"go/{self._nonce}"), "")
        else:
            offer = self._hear("id")
            nonce, _, ids = offer.partition(b"|")
            self._nonce = nonce.decode()
            store.own().set(self._key("joined"), f"{self._nonce}|{ready}")
            theirs = b"" if ids else b"NCCL could not be loaded"
            self._hear(f"go/{self._nonce}")
        self.unique_id = bytes(ids) if ids and not theirs and not ready else bytes(256)
        return self.unique_id

    def _hear(self, what: str, nonce: str | None = None, limit: float | None = None) -> bytes:
        """The other end's word ``what`` (then deleted), waited for at most ``limit`` seconds
        (default config.wait_bound()) in all; with ``nonce``, a word of another attempt (a stale
        one) is dropped and waited past, and the nonce taken off the value returned."""
        limit = config.wait_bound() if limit is None else limit
        key, deadline = self._key(what), time.monotonic() + limit
        while True:
            try:
                value = store.wait(key, max(0.0, deadline - time.monotonic()))
            except TimeoutError as e:
                peer = self._members[1 - self._comm_rank(self.rank)]
                raise NcclError(f"zipccl: rank {peer} did not join the NCCL communicators of its messages with "
                                f"rank {self._members[self._comm_rank(self.rank)]} within {limit:g} s") \
                    from e
            store.own().delete_key(key)
            if nonce is None:
                return value
            theirs, _, value = value.partition(b"|")
            if theirs.decode() == nonce:
                return value

    def _agree(self, error: Exception | None) -> None:
        """Each end writes its outcome and reads the other's: the same error on both where either failed."""
        me = self._comm_rank(self.rank)
        texts, word = [""] * 2, _made_word(error)
        store.own().set(self._made_key(self.rank), word)
        texts[me] = _error_of(word)
        limit = self._bound() + heartbeat.stale_after()  # later than the other end's making gives up
        try:  # RankFailure: the other end gave up on NCCL's making
            texts[1 - me] = _error_of(self._hear(f"made{1 - me}/{self._nonce}", limit=limit))
        except (NcclError, RankFailure):
            self._abort()
            raise
        failed = [k for k in (0, 1) if texts[k]]
        if failed:
            self._abort()
            said = "; ".join(f"rank {self._members[k]}: {texts[k]}" for k in failed)
            raise NcclError(f"zipccl: no NCCL communicator for the messages from rank {self._members[0]} to rank "
                            f"{self._members[1]}: {said} ({nccl_stack.detect()})")

    def _what(self) -> str:
        return f"the messages from rank {self._members[0]} to rank {self._members[1]}"

    def _made_key(self, rank: int) -> str:
        return self._key(f"made{self._comm_rank(rank)}/{self._nonce}")

    def all_to_all(self, send, send_splits, recv_splits):
        raise ZipcclError("NcclPair carries one direction's messages only")

    def native(self, name, *tensors, op=None):
        raise ZipcclError("NcclPair carries one direction's messages only")
