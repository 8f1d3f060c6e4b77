"""The Transport interface: the only operations zipccl's algorithms need.

Payloads are 1-D ``torch.uint8`` tensors (NCCL and cupyx lack bfloat16 in some
paths, gloo rejects float8); metadata are small int64 vectors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


class Transport(ABC):
    """One process group seen from one rank."""

    rank: int
    size: int

    @abstractmethod
    def start_exchange(self, meta: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start all-gathering a small int64 vector; the returned function waits and returns
        (size, len(meta)), row r from rank r."""

    def exchange(self, meta: torch.Tensor) -> torch.Tensor:
        return self.start_exchange(meta)()

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
