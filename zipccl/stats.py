"""Counters of what zipccl's collectives moved and where their time went.

Per process and cumulative; ``zipccl.stats()`` returns a snapshot,
``zipccl.reset_stats()`` starts over. Bytes are what this rank sent:
``raw_bytes`` is what the same algorithm would send uncompressed, ``wire_bytes``
what it did send (packets), ``meta_bytes`` the size/signature exchanges.
"""

from __future__ import annotations

import threading
from collections import defaultdict

_FIELDS = ("calls", "raw_bytes", "wire_bytes", "meta_bytes", "codec_seconds", "comm_seconds")
_lock = threading.Lock()
_totals: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(_FIELDS, 0))
_last: dict = {}


def record(collective: str, codec: str, **values: float) -> None:
    """Add one call's numbers (called by the collectives)."""
    global _last
    with _lock:
        for key in (collective, "total"):
            row = _totals[key]
            row["calls"] += 1
            for k, v in values.items():
                row[k] += v
        _last = dict(collective=collective, codec=codec, **values)


_NATIVE_LAST: dict = {}  # collective -> the "last" entry of a native call (shared: stats() copies it)


def record_native(collective: str) -> None:
    """``record`` of a call that ran the backend's own collective alone (nothing of zipccl's
    moved), with less work: such calls are the small ones, where a microsecond shows."""
    global _last
    last = _NATIVE_LAST.get(collective)
    if last is None:
        last = _NATIVE_LAST[collective] = dict(collective=collective, codec="native", **dict.fromkeys(_FIELDS[1:], 0))
    with _lock:
        _totals[collective]["calls"] += 1
        _totals["total"]["calls"] += 1
        _last = last


def stats() -> dict:
    """Snapshot: {'total': {...}, '<collective>': {...}, 'last': {...}}; ratio = wire / raw."""
    with _lock:
        out = {k: dict(v, ratio=(v["wire_bytes"] / v["raw_bytes"]) if v["raw_bytes"] else 1.0)
               for k, v in _totals.items()}
        out["last"] = dict(_last)
    out.setdefault("total", dict.fromkeys(_FIELDS, 0) | {"ratio": 1.0})
    return out


def reset_stats() -> None:
    global _last
    with _lock:
        _totals.clear()
        _last = {}
