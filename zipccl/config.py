"""Settings read from ZIPCCL_* environment variables: parsed here and nowhere else."""

from __future__ import annotations

import os


def _bytes(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be an integer number of bytes") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


#: codec="auto" sends messages smaller than this raw (bytes of the input): the measured break-even of
#: lossless vs raw all-reduce at 1 Gbit/s per rank, 4 ranks on 2 cores (docs/PERFORMANCE.md).
#: On faster links compression pays later or never.
AUTO_MIN_BYTES = _bytes("ZIPCCL_AUTO_MIN_BYTES", 8 << 20)
