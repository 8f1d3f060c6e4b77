"""async_op=True: zipccl's calls run in issue order on one background thread per process.

All ranks must issue async calls in the same order, as with torch.distributed; every call of
a process, async or not, that may be queued behind one goes through ``run`` so that the order
of the collectives underneath is the order of issue on every rank.
"""

from __future__ import annotations

import queue
import threading

import torch

__all__ = ["Handle", "run", "submit"]


class Handle:
    """What ``async_op=True`` returns: ``wait()``, ``is_completed()`` and ``get_future()``
    (whose value is the call's statistics: raw_bytes, wire_bytes, codec_seconds, ...).

    Do not issue other collectives on the same group until you have waited for the handle."""

    def __init__(self):
        self._future = torch.futures.Future()

    def wait(self, timeout=None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


_queue: queue.Queue | None = None
_queue_lock = threading.Lock()


def _worker(q: queue.Queue) -> None:
    while True:
        fn, handle = q.get()
        try:
            handle._future.set_result(fn())
        except BaseException as e:  # surfaced by wait()
            handle._future.set_exception(e)


def submit(fn) -> Handle:
    """Run ``fn()`` on zipccl's background thread, after every async call issued before it;
    its return value becomes the handle's future value. For work that issues collectives in
    the middle of async traffic (the DDP hook's lossy path) without racing it."""
    return run(fn, True)


def run(fn, async_op: bool):
    """``fn()`` now (returns None), or queued behind earlier async calls (returns a Handle)."""
    if not async_op:
        fn()
        return None
    global _queue
    with _queue_lock:
        if _queue is None:
            _queue = queue.Queue()
            threading.Thread(target=_worker, args=(_queue,), daemon=True, name="zipccl-async").start()
    handle = Handle()
    _queue.put((fn, handle))
    return handle
