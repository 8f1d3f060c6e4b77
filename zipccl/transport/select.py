"""Which transport carries a call: ZIPCCL_TRANSPORT (config.TRANSPORT) and the call's device.

"torch": torch.distributed on the group (TorchTransport). "nccl": CuPy's NCCL (NcclTransport)
for CUDA tensors; its errors are raised, never hidden. "auto" (default): NCCL for CUDA tensors
on a group whose torch backend is nccl when a GPU extra is installed, else torch; where the
communicator cannot be made, every rank of the group says why once and stays on torch (the
failure is agreed by all ranks, so they choose alike). CPU tensors always go through torch:
NCCL moves device memory only.
"""

from __future__ import annotations

import threading
import warnings

import torch.distributed as dist

from .. import config
from ..errors import ZipcclError
from . import nccl_stack
from .base import Transport
from .cupy_nccl import NcclTransport
from .torch_dist import TorchTransport

__all__ = ["transport_for"]

_refused: dict = {}
_lock = threading.Lock()


def transport_for(group, device) -> Transport:
    """The transport of a call on ``group`` with tensors on ``device`` (None: not a tensor)."""
    if device is None or device.type != "cuda" or config.TRANSPORT == "torch":
        return TorchTransport.of(group)
    if config.TRANSPORT == "nccl":
        return NcclTransport.of(group)
    key = group if group is not None else dist.GroupMember.WORLD
    if key in _refused or dist.get_backend(group) != "nccl" or nccl_stack.detect().extra is None:
        return TorchTransport.of(group)
    with _lock:
        try:
            return NcclTransport.of(group)
        except ZipcclError as e:
            _refused[key] = str(e)
            warnings.warn(f"zipccl: CUDA tensors on this group go through torch.distributed, not CuPy's NCCL: {e}",
                          RuntimeWarning, stacklevel=3)
            return TorchTransport.of(group)
