"""The Transport interface: the only operations zipccl's algorithms need.

Payloads are 1-D ``torch.uint8`` tensors (NCCL and cupyx lack bfloat16 in some
paths, gloo rejects float8); metadata are small int64 vectors, exchanged pairwise.

The rules are NCCL's (DESIGN.md invariant 12) unless a transport declares more: each receive
has the exact size of its send, messages between two ranks match in issue order (tags are
ignored), and sends and receives that must progress together are issued in one ``grouped()``
block. A transport that tolerates more says so with ``loose_receives`` (a receive may be
larger than its message) and ``tags`` (messages match by tag); zipccl's pipeline uses those
only where they are declared.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch

from .. import config


def wait_limit(timeout: float | None) -> float:
    """The longest one wait may take, in seconds: ZIPCCL_TIMEOUT (unset: config.DEFAULT_TIMEOUT),
    or ``timeout`` where that is shorter. Never None: no wait of zipccl's is unbounded."""
    bound = config.wait_bound()
    return bound if timeout is None else min(bound, timeout)


class DeviceMail:
    """A small device tensor (a piece's packet sizes, not yet read by the host) to ``isend`` as a
    mail: where a transport has a mail channel (NcclTransport), it goes there, after the work
    queued so far on torch's current stream, not behind the bulk data; elsewhere as the tensor."""
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _Done:
    """A handle whose operation has completed."""

    def wait(self, *args) -> bool:
        return True


class Transport(ABC):
    """One process group seen from one rank."""

    rank: int
    size: int
    #: A receive's buffer may be larger than its message (gloo): the pipeline then posts its
    #: receives at the codec's bound before the packet's size has come.
    loose_receives: bool = False
    #: Messages between two ranks match by tag (gloo); False: in issue order, whatever the tag (NCCL).
    tags: bool = False

    def grouped(self):
        """A block whose sends and receives are issued as one group (NCCL's groupStart/groupEnd):
        none of them is waited for inside it. A no-op where the transport needs none."""
        return contextlib.nullcontext()

    def global_rank(self, rank: int) -> int:
        """The job's rank of this group's ``rank`` (errors name ranks of the job)."""
        return rank

    def members(self) -> list[int]:
        """The job ranks that this transport's operations involve, whose heartbeats speak for its
        failures (zipccl.failure, zipccl.transport.heartbeat): the group's."""
        return [self.global_rank(r) for r in range(self.size)]

    def fence(self, *others: "Transport") -> None:
        """Order what is sent from now on after every operation issued so far, here and on
        ``others`` (the call's other transports: a hierarchical call's levels): the call's status
        round (zipccl.failure.Fate.settle) then tells a peer that this rank's messages have all
        left and arrived. A no-op where messages already go in issue order (gloo)."""

    def unfence(self) -> None:
        """End ``fence``'s tie to the call's other transports once the status round is over, so
        that a failure in a later call on this transport concerns this transport alone."""

    def abort(self) -> None:
        """End this group's connections after a failure that broke it, so that no operation stays
        pending (NCCL: ncclCommAbort). A no-op where a failed operation ends by itself (gloo)."""

    def read_back(self, values: torch.Tensor, host: torch.Tensor):
        """Copy ``values`` (on the device) into ``host`` (a CPU tensor) by the time ``wait`` of the
        handle returned has returned. Inside ``grouped()``, a transport with a mail channel copies
        there, so that one host wait covers this and the group's mails (NcclTransport); here at
        once (a host read)."""
        host.copy_(values)
        return _Done()

    def watch(self):
        """For a host wait on the device that involves this group (a read of results that follow
        its receives), a function to call at each poll (reference.packet.passed): it raises, or
        returns why to give up (its ranks' heartbeats say one is silent), else None. None: nothing
        to watch (a transport whose own waits end a dead peer's operations: gloo's)."""
        return None

    def wait(self, work, timeout: float | None = None) -> None:
        """Wait for a handle that ``isend``, ``irecv`` or a collective returned (a transport may
        bound the wait: zipccl.failure counts a peer whose operation fails or times out as lost).
        ``timeout`` (seconds): where the transport bounds its waits, this one runs out after at
        most that long."""
        work.wait()

    @abstractmethod
    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Send ``send_splits[j]`` bytes of ``send`` (in order) to rank j; return the bytes
        received, ``recv_splits[j]`` from rank j, concatenated in rank order."""

    @abstractmethod
    def isend(self, send: torch.Tensor, dst: int, tag: int = 0):
        """Start sending ``send`` to rank ``dst``: a handle with ``wait()``. Messages with one
        tag between two ranks arrive in the order they were sent."""

    @abstractmethod
    def irecv(self, recv: torch.Tensor, src: int, tag: int = 0):
        """Start receiving into ``recv`` (exactly its size) from rank ``src``: a handle with ``wait()``."""

    @abstractmethod
    def native(self, name: str, *tensors: torch.Tensor, op=None) -> None:
        """The backend's own collective (for dtypes no codec handles): ``all_reduce``,
        ``reduce_scatter`` (output, input) or ``all_gather`` (output, input)."""
