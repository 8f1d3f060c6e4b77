"""NcclPair: the framed messages from one rank of a group to another on CUDA (zipccl.p2p).

Why not the group's NcclTransport: its communicators are made by every rank of the group
together, which a message between two of them is not (a pipeline stage's first send would wait
for ever for ranks that never send); and point-to-point issues from two threads of a rank (sends
on the caller's, receives on zipccl's async thread), while NCCL wants each communicator's
operations issued in one order by each of its ranks. So each ordered pair (sender, receiver) of
a group has its own two communicators (bulk and mail, as NcclTransport's), of those two ranks
alone: on it the sender only sends, from its caller's thread, and the receiver only receives,
from its async thread, each on streams of their own, so two ranks that send to each other never
queue one's send behind the other's (one communicator per pair, as torch's point-to-point has,
needs both directions in one group call).

Made by the first message in that direction, by its two ends alone: the sender's ids reach the
receiver through the job's store, and each end then tells the other through the store whether it
succeeded, so both raise the same NcclError or neither does; every wait for the other end takes
at most config.wait_bound(). As NCCL's own making of a communicator (and torch's for its first
message between two ranks), the sender's first message waits until the receiver posts its
receive.

Ranks stay the group's (the peer of ``isend``/``irecv``, ``global_rank``), so zipccl's framing and
failure protocol see the same transport as elsewhere; only NCCL sees the pair's numbering.
"""

from __future__ import annotations

import atexit
import threading

import torch.distributed as dist

from .. import config
from ..errors import ZipcclError
from . import nccl_stack, store
from .cupy_nccl import NcclError, NcclTransport

__all__ = ["NcclPair"]

_pairs: dict = {}
_making: dict = {}
_lock = threading.Lock()
atexit.register(_pairs.clear)


class NcclPair(NcclTransport):
    """Messages from group rank ``src`` to group rank ``dst`` of ``group``, made on either end."""

    @classmethod
    def of(cls, group, src: int, dst: int) -> "NcclPair":
        key = (group if group is not None else dist.GroupMember.WORLD, src, dst)
        t = _pairs.get(key)
        if t is None:
            with _lock:
                making = _making.setdefault(key, threading.Lock())
            with making:  # one making per pair, and none waits for another pair's
                t = _pairs.get(key)
                if t is None:
                    t = _pairs[key] = cls(group, src, dst)
        return t

    def __init__(self, group, src: int, dst: int):
        self.pair = (src, dst)
        super().__init__(group)
        if self.rank not in self.pair:
            raise ValueError(f"rank {self.rank} of the group is neither end of the pair {self.pair}")

    def _comm_rank(self, rank: int) -> int:
        return self.pair.index(rank)

    def _key(self, what: str) -> str:
        src, dst = (self._ranks[r] for r in self.pair)
        name = (self.group if self.group is not None else dist.GroupMember.WORLD).group_name
        return f"zipccl/nccl-pair/{name}/{src}>{dst}/{what}"

    def _share_id(self) -> bytes:
        """The sender's two unique ids (zeros where it has no NCCL), through the store; the sender
        goes on to NCCL once the receiver has them, so that neither waits in NCCL for an end that
        never comes."""
        self._members = [self._ranks[r] for r in self.pair]
        if self.rank == self.pair[0]:
            ids = b"".join(self.nccl.get_unique_id() for _ in range(2)) if self.nccl else bytes(256)
            store.own().set(self._key("id"), ids)
            self._hear("joined")
        else:
            ids = self._hear("id")
            store.own().set(self._key("joined"), "")
        self.unique_id = bytes(ids)
        return self.unique_id

    def _hear(self, what: str) -> bytes:
        """The other end's word ``what`` (then deleted), waited for at most config.wait_bound()."""
        key = self._key(what)
        try:
            value = store.wait(key, config.wait_bound())
        except TimeoutError as e:
            peer = self._members[1 - self._comm_rank(self.rank)]
            raise NcclError(f"zipccl: rank {peer} did not join the NCCL communicators of its messages with rank "
                            f"{self._members[self._comm_rank(self.rank)]} within {config.wait_bound():g} s") from e
        store.own().delete_key(key)
        return value

    def _agree(self, error: Exception | None) -> None:
        """Each end writes its outcome and reads the other's: the same error on both where either failed."""
        me = self._comm_rank(self.rank)
        texts = [""] * 2
        texts[me] = "" if error is None else f"{type(error).__name__}: {error}"
        store.own().set(self._key(f"made{me}"), texts[me])
        try:
            texts[1 - me] = self._hear(f"made{1 - me}").decode()
        except NcclError:
            self._abort()
            raise
        failed = [k for k in (0, 1) if texts[k]]
        if failed:
            self._abort()
            raise NcclError(f"zipccl: no NCCL communicator for the messages from rank {self._members[0]} to rank "
                            f"{self._members[1]}: rank(s) {[self._members[k] for k in failed]} failed; rank "
                            f"{self._members[failed[0]]}: {texts[failed[0]]} ({nccl_stack.detect()})")

    def all_to_all(self, send, send_splits, recv_splits):
        raise ZipcclError("NcclPair carries one direction's messages only")

    def native(self, name, *tensors, op=None):
        raise ZipcclError("NcclPair carries one direction's messages only")
