"""How bytes move: a small Transport interface and its torch.distributed implementation."""

from .base import Transport
from .torch_dist import TorchTransport

__all__ = ["Transport", "TorchTransport"]
