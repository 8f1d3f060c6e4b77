"""Tables that the GPU kernels read (the bank, its decode lookups, header templates), uploaded to
each device once and kept there.

An upload is asynchronous, on the stream current at the first call (reference.packet.to_device:
no host wait, so a cold call is no synchronising call). A later call may run on another stream
(zipccl's async stream, a transport's, the caller's next one): until the upload is seen done, such
a call's stream waits for it by an event, a wait on the device and not on the host.

Inside a CUDA-graph capture a missing table is uploaded as part of the graph and not kept: a
tensor made there lives in the graph's memory and holds the data only while the graph replays, so
an eager call must never read it. A kept table that a capture reads is kept for good (a replay
reads it by its address), even where the cache evicts.
"""

from __future__ import annotations

import torch

__all__ = ["Constants"]


class _Kept:
    __slots__ = ("value", "event", "stream", "captured")

    def __init__(self, value, event, stream):
        self.value, self.event, self.stream, self.captured = value, event, stream, False


class Constants:
    """Per key (which names the device), a value of device tensors made by ``make()``; at most
    ``limit`` kept (None: all), the oldest not captured evicted first."""

    def __init__(self, limit: int | None = None):
        self.limit, self._kept = limit, {}

    def get(self, key, device: torch.device, make):
        if device.type != "cuda":
            kept = self._kept.get(key)
            if kept is None:
                kept = self._kept[key] = _Kept(make(), None, None)
                self._evict()
            return kept.value
        capturing = torch.cuda.is_current_stream_capturing()
        kept = self._kept.get(key)
        if kept is None:
            value = make()
            if capturing:  # the graph's own copy: valid only in its replays
                return value
            event = torch.cuda.Event()
            event.record()
            self._kept[key] = _Kept(value, event, torch.cuda.current_stream(device))
            self._evict()
            return value
        if kept.event is not None:
            if kept.event.query():
                kept.event = None
            elif not capturing and torch.cuda.current_stream(device) != kept.stream:
                torch.cuda.current_stream(device).wait_event(kept.event)
        kept.captured |= capturing
        return kept.value

    def _evict(self) -> None:
        if self.limit is None or len(self._kept) <= self.limit:
            return
        for key, kept in self._kept.items():
            if not kept.captured:
                del self._kept[key]
                return

    def __len__(self) -> int:
        return len(self._kept)
