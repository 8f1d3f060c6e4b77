"""Which transport carries a call that compresses (zipccl's pipeline): the call's device, the
group's backend, ZIPCCL_TRANSPORT (config.TRANSPORT) and whether the GPU extra (CuPy with NCCL)
is installed. A call that does not compress (codec "native", auto's native plan, every fallback)
is the group's own collective, on the group the user passed (TorchTransport.native: torch's
ProcessGroupNCCL for CUDA tensors, gloo for CPU ones, the drop-in's backend underneath), and
never asks for a transport here: so NcclTransport (CuPy's communicators) is made only when a
plan that compresses CUDA tensors first runs, inside that call, in the same place on every rank.

``choose`` is the decision, pure, so that it is tested on machines without a GPU; its table:

- CPU tensors (or no tensor): "torch", always (NCCL moves device memory only).
- CUDA tensors, ZIPCCL_TRANSPORT "auto" (default) or "nccl": "nccl" (NcclTransport) whatever
  the group's backend name (nccl, the drop-in "zipccl", gloo). Without the extra: "torch" on
  an nccl group (torch's NCCL carries everything, the metadata staged on the GPU), an error
  naming the extra on any other group, where nothing could carry a CUDA tensor's packets.
- CUDA tensors, ZIPCCL_TRANSPORT=torch: "torch" on an nccl group; an error on any other
  group (its torch backend takes CPU tensors).

With "auto", where the communicator cannot be made on an nccl group, every rank of the group
says why once and stays on torch (the failure is agreed by all ranks, so they choose alike);
on any other group, and with "nccl", NCCL's error is raised, never hidden.
"""

from __future__ import annotations

import threading
import warnings

import torch.distributed as dist

from .. import config, lifetime
from ..errors import RankFailure, UnsupportedError, ZipcclError
from . import nccl_stack
from .base import Transport
from .cupy_nccl import NcclTransport
from .nccl_pair import NcclPair
from .torch_dist import TorchTransport

__all__ = ["transport_for", "choose", "frames_messages", "framing_refused"]

_refused: dict = lifetime.keep({})
_lock = threading.Lock()

_EXTRA = "pip install 'zipccl[cuda12]' (or 'zipccl[cuda13]', matching torch's CUDA)"


def choose(device: str | None, backend: str, setting: str, extra: bool) -> str:
    """"torch" or "nccl": the transport of a call with tensors on ``device`` (a device type, None:
    not a tensor) on a group of torch backend ``backend``, ZIPCCL_TRANSPORT ``setting``, with
    (``extra``) or without the GPU extra; UnsupportedError where no transport can carry it."""
    if device != "cuda":
        return "torch"
    if setting == "torch":
        if backend == "nccl":
            return "torch"
        raise UnsupportedError(f"ZIPCCL_TRANSPORT=torch carries CUDA tensors only on a group whose backend is nccl; "
                               f"this group's is {backend!r}: unset ZIPCCL_TRANSPORT for zipccl's NCCL transport "
                               f"({_EXTRA})")
    if extra or setting == "nccl":
        return "nccl"
    if backend == "nccl":
        return "torch"
    raise UnsupportedError(f"CUDA tensors on a group of backend {backend!r} need zipccl's NCCL transport, which "
                           f"needs CuPy with NCCL: {_EXTRA}")


def frames_messages(group, device) -> bool:
    """Whether zipccl can frame point-to-point messages of tensors on ``device`` on ``group``:
    always for CPU tensors; for CUDA ones only where ``choose`` says "nccl" (an NcclPair per
    direction). torch's NCCL runs both directions of a pair on one stream in issue order, and a
    framed message's sends and receives are issued apart (sizes, then packets, from two threads):
    two ranks sending each other more than NCCL buffers would block each other for good."""
    if device is None or device.type != "cuda":
        return True
    return choose(device.type, dist.get_backend(group), config.TRANSPORT, nccl_stack.extra_installed()) == "nccl"


def framing_refused() -> UnsupportedError:
    """The error of a framed message of CUDA tensors where ``frames_messages`` is False."""
    return UnsupportedError(f"compressed point-to-point messages of CUDA tensors need zipccl's NCCL transport "
                            f"({_EXTRA}; ZIPCCL_TRANSPORT not 'torch'): torch's NCCL would run a pair's two "
                            "directions on one stream, where two ranks sending each other block each other; "
                            "use codec='native' for the backend's own send and receive")


def transport_for(group, device, pair: tuple[int, int] | None = None) -> Transport:
    """The transport of a call that compresses on ``group`` with tensors on ``device`` (None: not
    a tensor): TorchTransport.of(group) for CPU tensors, NcclTransport (made here on first use)
    or TorchTransport for CUDA ones, as ``choose`` says. ``pair`` (sender, receiver: group ranks):
    the transport of point-to-point messages in that direction, which those two ranks make alone:
    the group's TorchTransport for messages on CPU, an NcclPair (zipccl.transport.nccl_pair) on
    CUDA, where nothing else may carry them (``frames_messages``): NCCL's errors are raised."""
    messages = pair is not None
    if device is None or device.type != "cuda":
        return TorchTransport.of(group, messages)
    if messages:
        if not frames_messages(group, device):
            raise framing_refused()
        return NcclPair.of(group, *pair)
    backend = dist.get_backend(group)
    if choose(device.type, backend, config.TRANSPORT, nccl_stack.extra_installed()) == "torch":
        return TorchTransport.of(group)
    if config.TRANSPORT == "nccl" or backend != "nccl":
        return NcclTransport.of(group)
    key = group if group is not None else dist.GroupMember.WORLD
    if key in _refused:
        return TorchTransport.of(group)
    with _lock:
        try:
            return NcclTransport.of(group)
        except RankFailure:  # a rank never joined: the group is broken, not without NCCL
            raise
        except ZipcclError as e:
            _refused[key] = str(e)
            warnings.warn(f"zipccl: CUDA tensors on this group go through torch.distributed, not CuPy's NCCL: {e}",
                          RuntimeWarning, stacklevel=3)
            return TorchTransport.of(group)
