"""Codec resolution: which codec object (or the backend's own collective) a call's codec argument means."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .. import config
from .. import format as F
from ..codecs import Lossless, Raw, TopK
from ..errors import UnsupportedError


_OPS = {dist.ReduceOp.SUM: 1, dist.ReduceOp.AVG: 2, dist.ReduceOp.MAX: 3, dist.ReduceOp.MIN: 4}

_RAW, _LOSSLESS = Raw(), Lossless()
AUTO = object()  # codec "auto" on float data: the plan is decided when the call runs (zipccl.auto)


class _Native:
    """codec="native": the backend's own collective (torch.distributed), with no zipccl metadata:
    such a call has torch.distributed's semantics, checks and failure modes."""
    name = "native"

    def __repr__(self) -> str:
        return "native"


NATIVE = _Native()


def resolve_codec(codec, dtype: torch.dtype, nbytes: int):
    """The codec object for a call; NATIVE for the backend's own collective; None for the
    backend's collective after zipccl's metadata exchange (non-float dtypes with "raw")."""
    if isinstance(codec, str):
        if codec == "topk":
            codec = TopK()
        elif codec == "entropy":
            raise ValueError("codec 'entropy' keeps state per tensor: pass name=... to zipccl.all_reduce "
                             "(or use zipccl.lossy.Compressor / zipccl.ddp.State)")
        elif codec not in ("auto", "raw", "lossless", "native"):
            raise ValueError(f"unknown codec {codec!r}: use 'native', 'raw', 'lossless', 'auto' (never lossy), "
                             "the lossy 'topk' or 'entropy', or a codec instance")
    if isinstance(codec, str):
        if codec == "native":
            return NATIVE
        if dtype not in F.DTYPE_CODES:
            if codec == "lossless":
                raise UnsupportedError(f"codec 'lossless' takes {F.SUPPORTED}, not {dtype}")
            return NATIVE if codec == "auto" else None
        if codec == "raw" or (codec == "auto" and nbytes < config.AUTO_MIN_BYTES):
            return _RAW
        return _LOSSLESS
    if isinstance(codec, _Native):
        return codec
    if not all(hasattr(codec, m) for m in ("encode", "decode", "max_encoded_size")):
        raise ValueError(f"codec {codec!r} lacks encode/decode/max_encoded_size")
    if dtype not in F.DTYPE_CODES:
        raise UnsupportedError(f"codec {codec!r} takes {F.SUPPORTED}, not {dtype}")
    return codec


class Composite:
    """A plan of several codecs (a hierarchical call's levels, an all-to-all's links):
    ``levels`` for the signature check (``_codec_id``: each codec as its own calls check it,
    settings such as a checksum included), ``name`` for the statistics ("links/plain+lossless").
    None (the backend's collective after zipccl's exchange: "raw" on a dtype no codec takes)
    is named "raw", not "native" (the backend's collective alone)."""
    __slots__ = ("name", "levels")

    def __init__(self, kind: str, codecs):
        self.levels = tuple(codecs)
        self.name = f"{kind}/" + "+".join("raw" if c is None else getattr(c, "name", type(c).__name__)
                                          for c in self.levels)

    def __repr__(self) -> str:
        return self.name


def _codec_id(codec) -> int:
    if codec is None:
        return 0
    if isinstance(codec, Composite):
        return zlib.crc32(":".join(str(_codec_id(c)) for c in codec.levels).encode()) & 0x7FFFFFFF
    # impl and checksum too: a receiver on CUDA decodes with decode_into, which takes the packets
    # of its own implementation's block size and no payload checksum (collectives.pipeline.defers)
    key = f"{getattr(codec, 'name', type(codec).__name__)}:{getattr(codec, 'block_size', 0)}:" \
          f"{getattr(codec, 'density', 0)}:{getattr(codec, 'algorithm', '')}:{getattr(codec, 'sampled', '')}:" \
          f"{getattr(codec, 'impl', '')}:{getattr(codec, 'checksum', False)}"
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def check_op(op) -> int:
    try:
        return _OPS[op]
    except (KeyError, TypeError):
        named = "PREMUL_SUM" if isinstance(op, dist.ReduceOp) and op == dist.ReduceOp.PREMUL_SUM else op
        raise UnsupportedError(f"reduce op {named} is not supported; zipccl reduces with SUM, AVG, MAX, MIN") from None


def sums(op) -> bool:
    """Whether ``op`` sums (SUM or AVG), the one kind of reduction a lossy codec makes."""
    return _OPS.get(op) in (1, 2)


PLAN_CODECS = {"native": NATIVE, "raw": _RAW, "lossless": _LOSSLESS}
