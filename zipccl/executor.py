"""async_op=True: zipccl's calls run in issue order on one background thread per process.

All ranks must issue async calls in the same order, as with torch.distributed; every call of
a process, async or not, that may be queued behind one goes through ``run`` so that the order
of the collectives underneath is the order of issue on every rank.

On CUDA, as torch's NCCL backend does: a call waits for the work queued on the caller's current
stream when it was issued (an event recorded then), runs on a stream of zipccl's for the
caller's device, and ``wait()`` makes the waiting thread's current stream wait for the call's
device work; the host never waits for the device. The call's tensors are recorded on that stream
(``record_stream``), so that memory freed while it runs is not handed out again before it ends.
The handle's future is CUDA-aware: a consumer that waits on it, or on a future chained with
``then`` whose callback calls ``join_stream()`` (DDP's reducer, zipccl.ddp, zipccl.backend), is
ordered after the call. A thread's CUDA device and stream are its own: running the call with the
worker thread's defaults (cuda:0, its default stream) put a rank's transport on another rank's
GPU; running it on the caller's stream queued it behind whatever the caller issued meanwhile
(the rest of a backward pass), and made its order against other communicators' work differ
between ranks.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time

import torch

from .errors import TimeoutError  # noqa: A004 - zipccl's, a subclass of the builtin

__all__ = ["Handle", "drain", "idle", "inline", "lane_empty", "last", "run", "submit", "on_lane", "wait_all",
           "wait_to_end"]


class Handle:
    """What ``async_op=True`` returns: ``wait()``, ``is_completed()`` and ``get_future()``
    (whose value is the call's statistics: raw_bytes, wire_bytes, codec_seconds, ...).

    Do not issue other collectives on the same group until you have waited for the handle."""

    def __init__(self, future: torch.futures.Future | None = None, device: torch.device | None = None):
        """``device``: the CUDA device of a call issued there (its future is CUDA-aware)."""
        if future is None:
            future = torch.futures.Future(devices=[device]) if device is not None else torch.futures.Future()
        self._future = future
        self._done = threading.Event()
        done = self._done  # not self: the future's callback lives in C++, where the collector cannot
        self._future.add_done_callback(lambda _: done.set())  # see a cycle back to this handle
        self._device_end = None  # (device, CUDA event after the call's device work), set by the worker
        self._settled = None  # a worker's task: set once its future's callbacks have run too (``_ended``)

    def _ended(self) -> threading.Event:
        """Set once the call has ended and, for a call that a worker thread ran, its future's
        callbacks have returned: torch wakes a future's waiters before it runs the callbacks, and a
        callback may issue calls of its own (a DDP hook's ``then``), which must come before any
        call that a caller issues once the queue is idle (``idle``, ``drain``)."""
        return self._settled or self._done

    def wait(self, timeout=None) -> bool:
        """Wait for the call (and raise its error); the current CUDA stream then waits for its
        device work (``join_stream``). ``timeout`` (seconds or a timedelta): raise
        zipccl.errors.TimeoutError if the call has not finished by then; the call goes on (the
        collectives underneath cannot be interrupted on one rank alone)."""
        if timeout is not None:
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            if not self._done.wait(seconds):
                raise TimeoutError(f"zipccl: the async call did not finish within {seconds:g} s "
                                   "(it is still running; wait again, or rebuild the group)")
        self._future.wait()
        self.join_stream()
        return True

    def join_stream(self) -> None:
        """Make this thread's current CUDA stream wait for the finished call's device work (no
        host wait; nothing for a call without CUDA work). For callbacks chained on the future."""
        if self._device_end is not None:
            device, event = self._device_end
            torch.cuda.current_stream(device).wait_event(event)

    def is_completed(self) -> bool:
        return self._future.done()

    def join(self) -> None:
        """Wait for the call to end without raising its error (which stays with the handle)."""
        self._done.wait()

    def get_future(self) -> torch.futures.Future:
        return self._future


_queue: queue.Queue | None = None
_queue_lock = threading.Lock()
_worker_thread: threading.Thread | None = None
_last: Handle | None = None  # the async call issued last
_lanes: dict = {}  # key -> (the queue of a lane's thread, the thread) (on_lane)
_lane_last: dict = {}  # key -> the handle of the task queued last on that lane
#: Seconds a lane's thread waits for its next task before it ends (a later task makes a new one):
#: a process that sends to many peers in turn keeps no thread per peer it no longer talks to.
LANE_IDLE = 60.0
_streams: dict = {}  # (thread's queue, CUDA device) -> the stream the thread's calls run on there
_threads = threading.local()  # ``ours``: set on the worker's and the lanes' threads


def _worker(q: queue.Queue, lane=None) -> None:
    """Run ``q``'s tasks in order, for good; a ``lane``'s (its key) ends once idle for ``LANE_IDLE``
    seconds, its key and streams dropped under the lock that posting takes, so that a task is
    never put on a queue whose thread has ended."""
    _threads.ours, _threads.lane = True, lane
    while True:
        try:
            task = q.get(timeout=None if lane is None else LANE_IDLE)
        except queue.Empty:
            with _queue_lock:
                if q.empty():
                    del _lanes[lane]
                    _lane_last.pop(lane, None)
                    for key in [k for k in _streams if k[0] == id(q)]:
                        del _streams[key]
                    return
            continue
        if task is None:  # _stop
            return
        fn, handle, start, tensors = task
        try:
            if start is None:
                handle._future.set_result(fn())
                continue
            device, ready = start
            stream = _streams.get((id(q), device))
            if stream is None:
                stream = _streams[id(q), device] = torch.cuda.Stream(device)
            stream.wait_event(ready)
            for t in tensors:
                t.record_stream(stream)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                result = fn()
                end = torch.cuda.Event()
                end.record(stream)
                handle._device_end = device, end
                handle._future.set_result(result)  # a CUDA-aware future records its tensors' events here
        except BaseException as e:  # surfaced by wait()
            handle._future.set_exception(e)
        finally:  # nothing of a finished task kept while this thread waits for the next (its tensors)
            if lane is not None:  # an ended task (its future's callbacks returned) is nothing to wait for
                with _queue_lock:
                    if _lane_last.get(lane) is handle:
                        del _lane_last[lane]
            handle._settled.set()  # the future's callbacks, run inside set_result, have returned
            fn = handle = start = tensors = result = task = None


def _issued_on(tensors: list) -> tuple | None:
    """(device, event on the issuing thread's current stream there now): the device of the call's
    CUDA ``tensors``, else the current one; None where this process has not touched CUDA (then
    no call of it has CUDA tensors)."""
    if not torch.cuda.is_initialized():
        return None
    device = tensors[0].device if tensors else torch.device("cuda", torch.cuda.current_device())
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    return device, ready


def ours() -> bool:
    """Whether this thread is zipccl's (the async calls' or a lane's): it runs what is queued, so
    it never waits for the queue."""
    return getattr(_threads, "ours", False)


def acting_for_this_thread(fn):
    """``fn``, to run on a helper thread that acts for this one: zipccl's (``ours``) where this
    thread is, so that what it runs for a queued call (a set-up step's collective) never waits
    for the queue that this thread is running."""
    mine = ours()

    def run(*args, **kwargs):
        _threads.ours = mine
        return fn(*args, **kwargs)
    return run


def last() -> Handle | None:
    """The handle of the async call issued last (None before the first): every call issued
    before it has ended once it has (zipccl.p2p waits for the collectives queued before a send)."""
    return _last


def submit(fn) -> Handle:
    """Run ``fn()`` on zipccl's background thread, after every async call issued before it;
    its return value becomes the handle's future value. For work that issues collectives in
    the middle of async traffic (the DDP hook's lossy path) without racing it."""
    return run(fn, True)


def drain() -> None:
    """Return once the async calls issued before have finished (their errors stay with their
    handles): the collectives underneath must run in the order of issue. At once on the worker
    thread, which runs them."""
    last = _last
    if last is not None and not running_queue():
        last._ended().wait()


def running_queue() -> bool:
    """Whether this thread is the one that runs the async calls in order (not a lane's)."""
    return threading.current_thread() is _worker_thread


def on_its_lane(key) -> bool:
    """Whether this thread is lane ``key``'s: a task queued there now would wait for what runs."""
    return getattr(_threads, "lane", None) == key


def lane_empty(key) -> bool:
    """Whether nothing waits on lane ``key`` behind the task that runs there."""
    with _queue_lock:
        entry = _lanes.get(key)
        return entry is None or entry[0].empty()


def idle() -> bool:
    """Whether no async call is queued or running: a call issued now is next on the group."""
    last = _last
    return last is None or last._ended().is_set()


def on_lane(key, fn, tensors=()) -> Handle:
    """``fn()`` on the thread of lane ``key`` (made on first use), after the work queued there
    before it, with the CUDA semantics of an async call (its own stream per device, the caller's
    stream's work before it, ``wait()`` ordering the waiting stream after it); apart from the async
    calls' queue (``last`` is not changed); a lane idle for ``LANE_IDLE`` seconds ends. zipccl.p2p
    posts each direction's framed sends, and runs its framed receives, on a lane of its own, so
    that making a pair's communicators never blocks the caller, nor a receive another peer's."""
    if _exiting:  # after _stop: at once, on the exit handler's thread
        return inline(fn)
    task = _task(fn, tensors)
    with _queue_lock:
        if key not in _lanes:
            q = queue.Queue()
            thread = threading.Thread(target=_worker, args=(q, key), daemon=True, name=f"zipccl-lane {key}")
            _lanes[key] = q, thread
            _wait_at_exit()
            thread.start()
        _lane_last[key] = task[1]
        _lanes[key][0].put(task)
    return task[1]


def _task(fn, tensors) -> tuple:
    """What a worker thread runs: (fn, its handle, (device, the caller's stream's event) or None,
    its CUDA tensors)."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda]
    start = _issued_on(tensors)
    handle = Handle(device=None if start is None else start[0])
    handle._settled = threading.Event()
    return fn, handle, start, tensors


def inline(fn) -> Handle:
    """``fn()`` now, on this thread (the async calls' own, as the call that is running there; a
    lane's, as the task that runs there; or an exit handler's after ``_stop``): its handle,
    finished (its device work, if any, on this thread's current stream)."""
    handle = Handle()
    try:
        result = fn()
    except BaseException as e:  # surfaced by wait()
        handle._future.set_exception(e)
        return handle
    if torch.cuda.is_initialized():
        end = torch.cuda.Event()
        end.record()
        handle._device_end = torch.cuda.current_device(), end
    handle._future.set_result(result)
    return handle


def run(fn, async_op: bool, tensors=()):
    """``fn()`` on this thread once the async calls issued before it have finished (returns
    None; their errors stay with their handles), or queued behind them (returns a Handle).
    ``tensors``: the call's tensors (recorded on the stream an async CUDA call runs on)."""
    global _queue, _worker_thread, _last
    if not async_op:
        drain()
        fn()
        return None
    if running_queue() or _exiting:  # issued by a queued call (a future's callback, which torch runs on the
        return inline(fn)  # thread that finished the future): queued behind that call, a wait for it would wait
    #                         for good; or by an exit handler after _stop: no thread is left to end it
    task = _task(fn, tensors)
    with _queue_lock:
        if _queue is None:
            _queue = queue.Queue()
            _wait_at_exit()
            _worker_thread = threading.Thread(target=_worker, args=(_queue,), daemon=True, name="zipccl-async")
            _worker_thread.start()
        _last = task[1]
        _queue.put(task)
    return task[1]


def wait_all(timeout: float | None = None) -> bool:
    """Wait until every async call and lane task issued so far has ended (their errors stay with
    their handles); False if ``timeout`` seconds passed first. At once on zipccl's own threads,
    which run them. torch destroys a process group only after its pending work, and so does
    zipccl (lifetime.destroy_process_group)."""
    if ours():
        return True
    with _queue_lock:
        handles = [h for h in (_last, *_lane_last.values()) if h is not None]
    deadline = None if timeout is None else time.monotonic() + timeout
    for handle in handles:
        if not handle._ended().wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
            return False
    return True


#: Seconds that the interpreter's exit and ``destroy_process_group`` wait for zipccl's calls still
#: running (a peer may never join them), then go on without them.
END_WAIT = 60.0
_exit_registered = False
_exiting = False  # set by _stop: calls issued later (by other exit handlers) run at once


def _wait_at_exit() -> None:
    """Registered with the first worker thread, so that it runs before the handlers registered
    earlier (the heartbeat's, which the calls may still need): a daemon thread still inside a
    collective's C++ code when the interpreter finalizes is ended by an exception that aborts the
    process ("terminate called without an active exception"), so exit waits for the calls, a
    bounded time. Called under ``_queue_lock``."""
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_at_exit)


def wait_to_end(what: str) -> bool:
    """``wait_all(END_WAIT)``, saying so on stderr where the calls did not end."""
    if wait_all(END_WAIT):
        return True
    print(f"zipccl: async calls still running after {END_WAIT:g} s at {what} (a peer that never joined "
          "them?); going on without them", file=sys.stderr, flush=True)
    return False


def _at_exit() -> None:
    if wait_to_end("exit"):
        _stop(END_WAIT)


def _stop(timeout: float) -> None:
    """End zipccl's threads once their queued work is done, and join them (``timeout`` seconds in
    all): a call's handle is done inside its future's callbacks, while the thread that ran it is
    still in torch's C++ code, where a finalizing interpreter ends it with that abort. A later
    call, from an exit handler that runs after this one, runs at once on its caller's thread."""
    global _queue, _worker_thread, _exiting
    with _queue_lock:
        _exiting = True
        ending = [(q, t) for q, t in _lanes.values()]
        if _queue is not None:
            ending.append((_queue, _worker_thread))
        _queue = _worker_thread = None
        _lanes.clear()
        _lane_last.clear()
        _streams.clear()
        for q, _ in ending:
            q.put(None)
    deadline = time.monotonic() + timeout
    for _, thread in ending:
        thread.join(max(0.0, deadline - time.monotonic()))
