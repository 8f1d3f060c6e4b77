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


#: codec="auto" starts messages smaller than this raw and larger ones lossless (bytes of the input):
#: the measured break-even of lossless vs raw all-reduce at 1 Gbit/s per rank, 4 ranks on 2 cores
#: (docs/PERFORMANCE.md). On faster links compression pays later or never, which is why "auto" then
#: learns from the calls' times (zipccl.auto) unless ZIPCCL_AUTO_LEARN=0 keeps this threshold fixed.
AUTO_MIN_BYTES = _bytes("ZIPCCL_AUTO_MIN_BYTES", 8 << 20)


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} must be one of {', '.join(allowed)}")
    return value


#: "1": codec="auto" measures raw and lossless per group and size class and keeps the faster
#: (zipccl.auto); "0": the fixed AUTO_MIN_BYTES threshold. The same on every rank.
AUTO_LEARN = _choice("ZIPCCL_AUTO_LEARN", "1", ("0", "1")) == "1"


#: Reduce-scatter algorithm (every rank must use the same; the metadata exchange checks it):
#: "direct" sends each rank's packet of each chunk to its owner, which decodes them all and
#: reduces them in rank order with fp32 accumulation, rounded once (DESIGN.md invariant 3);
#: "ring" passes re-encoded partial sums around a ring, rounding each hop to the dtype as NCCL
#: does: one flow per link and one direction per pair of ranks, for n-1 encodes per chunk instead of 1.
REDUCE_SCATTER = _choice("ZIPCCL_REDUCE_SCATTER", "direct", ("direct", "ring"))


#: Gloo point-to-point payloads travel on two connections per pair of ranks, one per direction
#: (a second gloo group over the same ranks, made on first use: every rank of the job must be in
#: the group). gloo sends a payload only when the receiver's "ready" note arrives, and that note
#: waits behind whatever payload the receiver is itself sending on the shared connection; the
#: 64 MiB all-reduce in the 1 Gbit/s lab: raw 1.17-1.33 s -> 0.88-0.93 s (docs/PERFORMANCE.md).
#: "0" keeps one connection per pair (the group's own).
SPLIT_DIRECTIONS = _choice("ZIPCCL_SPLIT_DIRECTIONS", "1", ("0", "1")) == "1"
