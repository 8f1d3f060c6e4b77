"""Tables that the GPU kernels read (the bank, its decode lookups, header templates), uploaded to
each device once and kept there.

An upload is asynchronous, on the stream current at the first call (reference.packet.to_device:
no host wait, so a cold call is no synchronising call). A later call may run on another stream
(zipccl's async stream, a transport's, the caller's next one): until the upload is seen done, such
a call's stream waits for it by an event, a wait on the device and not on the host.

Inside a CUDA-graph capture a missing table is uploaded as part of the graph and not kept: a
tensor made there lives in the graph's memory and holds the data only while the graph replays, so
an eager call must never read it. A kept table that a capture reads is kept for good (a replay
reads it by its address), even where the cache evicts; the capture neither asks whether its
upload is done nor waits for it (both illegal while capturing), so the upload must be done before
the capture begins: torch.cuda.graph() synchronises the device first; a capture begun by hand
(CUDAGraph.capture_begin) must follow a torch.cuda.synchronize() after the first eager call.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["Constants"]


class _Kept:
    __slots__ = ("value", "event", "streams", "captured")

    def __init__(self, value, event, stream):
        self.value, self.event, self.streams, self.captured = value, event, {stream}, False


def _tensors(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


class Constants:
    """Per key (which names the device), a value of device tensors made by ``make()``; at most
    ``limit`` kept besides those a capture read (None: all), the oldest evicted first. A table
    read on another stream than its upload's is recorded there (``record_stream``), so that its
    memory, once evicted, is not handed out again before that stream's work on it has run."""

    def __init__(self, limit: int | None = None):
        self.limit, self._kept, self._lock = limit, {}, threading.Lock()

    def get(self, key, device: torch.device, make):
        with self._lock:  # the caller's thread and zipccl's async and lane threads
            kept = self._kept.get(key)
            if device.type != "cuda":
                if kept is None:
                    kept = self._kept[key] = _Kept(make(), None, None)
                    self._evict()
                return kept.value
            stream = torch.cuda.current_stream(device)
            if torch.cuda.is_current_stream_capturing():  # no query, no wait: illegal while capturing
                if kept is None:
                    return make()  # the graph's own copy: valid only in its replays
                kept.captured = True
                return kept.value
            if kept is None:
                value = make()
                event = torch.cuda.Event()
                event.record(stream)
                self._kept[key] = _Kept(value, event, stream)
                self._evict()
                return value
            if kept.event is not None and kept.event.query():
                kept.event = None
            if stream not in kept.streams:
                if kept.event is not None:
                    stream.wait_event(kept.event)
                for t in _tensors(kept.value):
                    t.record_stream(stream)
                kept.streams.add(stream)
            return kept.value

    def _evict(self) -> None:
        if self.limit is None:
            return
        free = [key for key, kept in self._kept.items() if not kept.captured]
        for key in free[:max(0, len(free) - self.limit)]:
            del self._kept[key]

    def __len__(self) -> int:
        return len(self._kept)
