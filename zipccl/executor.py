"""async_op=True: zipccl's calls run in issue order on one background thread per process.

All ranks must issue async calls in the same order, as with torch.distributed; every call of
a process, async or not, that may be queued behind one goes through ``run`` so that the order
of the collectives underneath is the order of issue on every rank.

On CUDA, as with torch's NCCL backend: a call starts after the work queued on the caller's current
stream when it was issued, and ``wait()`` makes the waiting thread's current stream wait for the
call's device work; the host does not wait for the device. The worker thread runs the call on the
caller's device and current stream (captured at issue): a thread's CUDA device and stream are its
own, and the worker's defaults (cuda:0, its default stream) would put a rank's transport on
another rank's GPU and leave the call unordered with the caller's stream.
"""

from __future__ import annotations

import queue
import threading

import torch

from .errors import TimeoutError  # noqa: A004 - zipccl's, a subclass of the builtin

__all__ = ["Handle", "run", "submit"]


class Handle:
    """What ``async_op=True`` returns: ``wait()``, ``is_completed()`` and ``get_future()``
    (whose value is the call's statistics: raw_bytes, wire_bytes, codec_seconds, ...).

    Do not issue other collectives on the same group until you have waited for the handle."""

    def __init__(self, future: torch.futures.Future | None = None):
        self._future = future if future is not None else torch.futures.Future()
        self._done = threading.Event()
        self._future.add_done_callback(lambda _: self._done.set())
        self._device_end = None  # (device, CUDA event after the call's device work), set by the worker

    def wait(self, timeout=None) -> bool:
        """Wait for the call (and raise its error). ``timeout`` (seconds or a timedelta):
        raise zipccl.errors.TimeoutError if the call has not finished by then; the call goes
        on (the collectives underneath cannot be interrupted on one rank alone)."""
        if timeout is not None:
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            if not self._done.wait(seconds):
                raise TimeoutError(f"zipccl: the async call did not finish within {seconds:g} s "
                                   "(it is still running; wait again, or rebuild the group)")
        self._future.wait()
        if self._device_end is not None:
            device, event = self._device_end
            torch.cuda.current_stream(device).wait_event(event)
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        return self._future


_queue: queue.Queue | None = None
_queue_lock = threading.Lock()
_worker_thread: threading.Thread | None = None
_last: Handle | None = None  # the async call issued last


def _worker(q: queue.Queue) -> None:
    while True:
        fn, handle, stream = q.get()
        try:
            if stream is None:
                result = fn()
            else:
                with torch.cuda.device(stream.device), torch.cuda.stream(stream):
                    result = fn()
                    end = torch.cuda.Event()
                    end.record(stream)
                handle._device_end = stream.device, end
            handle._future.set_result(result)
        except BaseException as e:  # surfaced by wait()
            handle._future.set_exception(e)


def _callers_stream():
    """The issuing thread's current CUDA stream (on its current device), or None where this
    process has not touched CUDA (then no call of it has CUDA tensors)."""
    if not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream(torch.cuda.current_device())


def submit(fn) -> Handle:
    """Run ``fn()`` on zipccl's background thread, after every async call issued before it;
    its return value becomes the handle's future value. For work that issues collectives in
    the middle of async traffic (the DDP hook's lossy path) without racing it."""
    return run(fn, True)


def run(fn, async_op: bool):
    """``fn()`` on this thread once the async calls issued before it have finished (returns
    None; their errors stay with their handles), or queued behind them (returns a Handle)."""
    global _queue, _worker_thread, _last
    if not async_op:
        last = _last
        if last is not None and threading.current_thread() is not _worker_thread:
            last._done.wait()  # the collectives underneath must run in the order of issue
        fn()
        return None
    with _queue_lock:
        if _queue is None:
            _queue = queue.Queue()
            _worker_thread = threading.Thread(target=_worker, args=(_queue,), daemon=True, name="zipccl-async")
            _worker_thread.start()
        handle = Handle()
        _last = handle
        _queue.put((fn, handle, _callers_stream()))
    return handle
