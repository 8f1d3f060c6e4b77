"""How bytes move: a small Transport interface and its torch.distributed implementation."""

from .base import Transport
from .cupy_nccl import NcclTransport  # imports CuPy only when one is made
from .select import transport_for
from .torch_dist import TorchTransport

__all__ = ["Transport", "TorchTransport", "NcclTransport", "transport_for"]
