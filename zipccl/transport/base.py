"""The Transport interface: the only operations zipccl's algorithms need.

Payloads are 1-D ``torch.uint8`` tensors (NCCL and cupyx lack bfloat16 in some
paths, gloo rejects float8); metadata are small int64 vectors, exchanged pairwise.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Transport(ABC):
    """One process group seen from one rank."""

    rank: int
    size: int

    def global_rank(self, rank: int) -> int:
        """The job's rank of this group's ``rank`` (errors name ranks of the job)."""
        return rank

    def wait(self, work) -> None:
        """Wait for a handle that ``isend``, ``irecv`` or a collective returned (a transport may
        bound the wait: zipccl.failure counts a peer whose operation fails or times out as lost)."""
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
