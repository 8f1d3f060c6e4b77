"""Implementation registry: the reference is the specification, kernels override it per device.

An implementation is a module with ``encode(x, block_size, checksum) -> uint8
tensor`` and ``decode(packet, out, header=None) -> out`` for the lossless format (``header``:
the packet's parsed header, or the packet validated by reference.packet.parse_lossless, where
the caller has it). A module whose decoder wants the block index where the packet is also
exports ``read_index`` (reference.packet.read_index's signature), which the caller's
validation then uses.
"""

from __future__ import annotations

import importlib
import os

import torch

from ..errors import UnsupportedError

IMPLS = ("auto", "reference", "numba", "triton")
_MODULES = {"reference": "zipccl.reference.lossless", "numba": "zipccl.kernels.cpu", "triton": "zipccl.kernels.gpu"}
_loaded: dict = {}  # impl -> module, once imported (encoders and decoders resolve on every call)


def _check_available(impl: str, device: torch.device) -> None:
    if impl == "numba" and device.type != "cpu":
        raise UnsupportedError(f"impl='numba' runs on CPU tensors, got a tensor on {device}; "
                               "use impl='auto' or 'reference'")
    if impl == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UnsupportedError(f"impl='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 for CPU "
                               f"tensors), got a tensor on {device}")


def resolve(impl: str, device: torch.device):
    """The implementation module for ``impl`` on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; choose one of {', '.join(IMPLS)}")
    if impl == "auto":
        impl = {"cpu": "numba", "cuda": "triton"}.get(device.type, "reference")
    _check_available(impl, device)
    module = _loaded.get(impl)
    if module is None:
        try:
            module = _loaded[impl] = importlib.import_module(_MODULES[impl])
        except ImportError as e:
            raise UnsupportedError(f"impl={impl!r} is not available: {e}") from e
    return module
