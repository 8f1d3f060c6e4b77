"""Which CuPy/NCCL stack is installed (the ``cuda12`` or ``cuda13`` extra), and NCCL's type and op codes.

The two extras are mutually exclusive: cupy-cuda12x and cupy-cuda13x, nvidia-nccl-cu12 and
nvidia-nccl-cu13 install the same files, so having both breaks both. ``detect()`` reads the
installed distributions without importing CuPy (``import zipccl`` never imports it);
``load()`` imports ``cupy.cuda.nccl`` and checks the NCCL version (>= 2.10.3: bfloat16 and
ncclAvg) with a clear error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata

import torch
import torch.distributed as dist

from ..errors import UnsupportedError

__all__ = ["Stack", "detect", "load", "DTYPES", "OPS", "MIN_VERSION", "version_text"]

#: NCCL 2.10.3: the first with ncclBfloat16 and ncclAvg (NCCL_VERSION_CODE = major*10000 + minor*100 + patch).
MIN_VERSION = 21003

#: torch dtype -> (the name of CuPy's constant, ncclDataType_t's value in nccl.h).
DTYPES = {
    torch.int8: ("NCCL_INT8", 0), torch.uint8: ("NCCL_UINT8", 1), torch.int32: ("NCCL_INT32", 2),
    torch.int64: ("NCCL_INT64", 4), torch.float16: ("NCCL_FLOAT16", 6), torch.float32: ("NCCL_FLOAT32", 7),
    torch.float64: ("NCCL_FLOAT64", 8), torch.bfloat16: ("NCCL_BFLOAT16", 9),
}
#: torch reduce op -> (the name of CuPy's constant, ncclRedOp_t's value in nccl.h).
OPS = {
    dist.ReduceOp.SUM: ("NCCL_SUM", 0), dist.ReduceOp.PRODUCT: ("NCCL_PROD", 1), dist.ReduceOp.MAX: ("NCCL_MAX", 2),
    dist.ReduceOp.MIN: ("NCCL_MIN", 3), dist.ReduceOp.AVG: ("NCCL_AVG", 4),
}

_EXTRAS = {"cuda12": ("cupy-cuda12x", "nvidia-nccl-cu12"), "cuda13": ("cupy-cuda13x", "nvidia-nccl-cu13")}


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Stack:
    """What is installed: ``extra`` ("cuda12", "cuda13" or None), the versions found, and
    ``problem``: why NCCL cannot be used from here (None where it can be tried)."""
    extra: str | None
    versions: dict
    problem: str | None

    def __str__(self) -> str:
        found = ", ".join(f"{k} {v}" for k, v in self.versions.items()) or "no CuPy or NCCL wheel"
        return f"{self.extra or 'no GPU extra'} ({found})" + (f": {self.problem}" if self.problem else "")


def detect() -> Stack:
    """The installed GPU extra, from the distributions' metadata (CuPy is not imported)."""
    versions = {name: v for names in _EXTRAS.values() for name in names if (v := _installed(name)) is not None}
    full = [extra for extra, names in _EXTRAS.items() if all(n in versions for n in names)]
    partial = [extra for extra, names in _EXTRAS.items() if any(n in versions for n in names)]
    if len(partial) > 1:
        return Stack(None, versions, "both the cuda12 and the cuda13 stacks are installed, and they overwrite each "
                                     "other's files: uninstall one (pip uninstall cupy-cuda13x nvidia-nccl-cu13, or "
                                     "the -12 ones) and reinstall the other")
    if not full:
        return Stack(None, versions, "the GPU extra is not installed: pip install 'zipccl[cuda12]' (or [cuda13], "
                                     "matching your torch's CUDA)")
    return Stack(full[0], versions, None)


@functools.cache
def extra_installed() -> bool:
    """Whether a GPU extra is installed, read once per process: the routing of every CUDA call
    asks, and distribution metadata takes milliseconds to read."""
    return detect().extra is not None


def version_text(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def load():
    """``cupy.cuda.nccl``, checked: the module and NCCL's version; UnsupportedError saying what to do."""
    stack = detect()
    if stack.problem is not None and stack.extra is None and "both" in stack.problem:
        raise UnsupportedError(f"zipccl's NCCL transport: {stack.problem}")
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise UnsupportedError(f"zipccl's NCCL transport needs CuPy with NCCL ({e}); {stack}") from e
    if not getattr(nccl, "available", True):
        raise UnsupportedError(f"CuPy was built without NCCL; {stack}")
    code = nccl.get_version()
    if code < MIN_VERSION:
        raise UnsupportedError(f"NCCL {version_text(code)} is too old: zipccl needs >= {version_text(MIN_VERSION)} "
                               "(bfloat16, ncclAvg); upgrade nvidia-nccl-cu12/-cu13")
    return nccl
