"""The front door of point-to-point: zipccl.send, recv, isend, irecv, batch_isend_irecv, P2POp.

Shaped like torch.distributed's, plus ``codec``. Each message either goes to the backend's own
send and receive ("native"), or is framed by zipccl (zipccl.collectives.p2p: a header with the
sender's signature, then pipelined packets, the receiver's verdict back through the job's
store). Both ends decide alike, from what both know: the codec argument, the dtype, the size,
the kind of device (both ends' tensors on CPU, or both on CUDA) and the link
(zipccl.topology.same_node). codec="auto" is native for small messages (below
zipccl.auto.PROBE_MIN_BYTES), for types no codec takes and inside a node, and lossless across
nodes: a send cannot learn from its times as the collectives do, since its two ends would have
to agree on them without talking (see docs/USAGE.md). Where the backend cannot carry the tensor
(CUDA on gloo, whose send would read device memory as the host's), auto frames the plain bytes
on zipccl's NCCL transport instead of going native (and needs the GPU extra, as any framing of
CUDA tensors does).

Order and progress, as NCCL's: a rank's messages to a peer match the peer's receives in issue
order. A framed receive runs on its direction's receive lane (a thread of its own,
zipccl.executor.on_lane), after the collectives issued before it and the direction's earlier
receives, so that one waiting for its peer holds up neither the receives from other peers nor
the calls issued after it; a native one is posted at once where nothing is queued, else by
zipccl's async thread in issue order, and waited for on a lane of its peer's native receives,
so that it holds up nothing but the completion of that peer's later ones. A send never
waits for its peer: it is encoded and posted on its direction's lane, after the collectives
issued before it and the direction's earlier sends, and completes in ``wait()``.
So framed messages between ranks that send to each other never block each other, whether in
one ``batch_isend_irecv`` (whatever the list's order) or as separate isend and irecv calls. The
backend's own messages follow the backend's rules: on NCCL a batch's go in one batch of
torch's (``batch_isend_irecv``), while separate isend and irecv calls to one peer share torch's
NCCL stream, as with torch alone. What does block: a blocking ``recv`` before the send its peer
waits for (on any backend), a blocking ``send`` of a framed message before the receive its peer
waits for (it returns with the receiver's verdict).

A framed message's transport is its direction's (``transport_for(..., pair=...)``), made by
its two ranks alone with the first message in that direction, on the threads that issue it (the
sender's lane, the receiver's): on CUDA an NcclPair, whose communicators no other
rank and no other thread of these ranks uses.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist

from . import auto, config, executor, lifetime, topology
from .collectives.links import PLAIN
from .collectives.p2p import Signature, Verdict, mismatch_text, receive_message, send_message
from .collectives.pipeline import plain
from .collectives.resolve import NATIVE, resolve_codec
from .collectives.validation import finish, new_acc, overlaps
from .errors import MismatchError, RankFailure, UnsupportedError
from .errors import TimeoutError as ZipcclTimeout
from .failure import LOST, Fate, code as poison
from .format import DTYPE_CODES
from .stats import record_native
from .torch_compat import not_in
from .transport import transport_for
from .transport.select import frames_messages, framing_refused
from .transport.torch_dist import underneath

__all__ = ["send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp"]


class P2POp:
    """One operation of ``batch_isend_irecv``, as ``torch.distributed.P2POp`` (which it takes too):
    ``op`` is ``isend`` or ``irecv`` (zipccl's or torch's), plus ``codec``."""

    def __init__(self, op, tensor: torch.Tensor, peer: int | None = None, group=None, tag: int = 0,
                 group_peer: int | None = None, codec="auto"):
        if _kind(op) is None:
            raise ValueError(f"P2POp's op must be isend or irecv (zipccl's or torch.distributed's), got {op!r}")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag
        self.group_peer, self.codec = group_peer, codec


def _kind(op) -> str | None:
    return "send" if op in (isend, dist.isend) else "recv" if op in (irecv, dist.irecv) else None


class _Op:
    """One resolved message end: its transport, peer (group rank; ``peer_job``: in the job), this
    rank in the group (``me``), codec decision and signature."""
    __slots__ = ("kind", "tensor", "group", "t", "peer", "peer_job", "me", "tag", "codec", "plan", "sig", "seq",
                 "staged")

    def __init__(self, kind: str, tensor, peer, group, tag: int, group_peer, codec):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{kind}'s tensor must be a torch.Tensor, got {type(tensor).__name__}")
        self.kind, self.tag, self.codec, self.group = kind, int(tag), codec, group
        self.tensor = tensor.data if tensor.requires_grad else tensor
        pg = group if group is not None else dist.group.WORLD
        if (peer is None) == (group_peer is None):
            raise ValueError(f"{kind}: give exactly one of the peer's rank in the job and its rank in the group")
        self.peer = group_peer if group_peer is not None else dist.get_group_rank(pg, peer)
        if not 0 <= self.peer < dist.get_world_size(pg):  # the world's ranks map to themselves, unchecked
            raise ValueError(f"{kind}: rank {peer if peer is not None else group_peer} is not a rank of the group "
                             f"({dist.get_world_size(pg)} ranks)")
        self.peer_job = peer if peer is not None else dist.get_global_rank(pg, group_peer)
        topology.publish_node()  # before anything here may wait on a peer that looks ours up
        self.me = dist.get_rank(pg)
        if self.peer == self.me:
            raise ValueError(f"{kind}: rank {dist.get_rank()} cannot {kind} to itself with zipccl")
        self.plan = _decide(codec, self.tensor, group, self.peer)
        self.t = None  # zipccl's transport, for a framed message only: ``transport()``
        self.staged = None  # a framed receive's strided tensor, filled from ``tensor`` once its message lands
        if self.plan is not NATIVE and not self.tensor.is_contiguous():  # framed: through a contiguous copy
            if kind == "send":
                self.tensor = self.tensor.contiguous()
            else:
                self.staged, self.tensor = self.tensor, torch.empty_like(self.tensor,
                                                                          memory_format=torch.contiguous_format)
        self.sig = None if self.plan is NATIVE else Signature.of(self.tensor, codec, self.tag)  # framed only
        self.seq = None

    def landing(self) -> torch.Tensor:
        """The memory a receive's message ends in: the caller's tensor, not the contiguous copy
        that a strided one is received through first."""
        return self.tensor if self.staged is None else self.staged

    def transport(self):
        """The transport of this framed message's direction, made on first use: on CUDA the
        NcclPair of its two ranks (zipccl.transport.nccl_pair), so it is asked for on the thread
        that issues the message (a send's lane, a receive's), never by the caller's
        call, which must not wait for the other end."""
        if self.t is None:
            pair = (self.me, self.peer) if self.kind == "send" else (self.peer, self.me)
            self.t = transport_for(self.group, self.tensor.device, pair=pair)
        return self.t


def _backend_takes(group, device: torch.device) -> bool:
    """Whether the backend's own send and receive take tensors on ``device``: gloo's would send a
    CUDA tensor's device memory as if it were the host's (EFAULT, or a crash at the receiver)."""
    if device.type != "cuda":
        return True
    inner = underneath(group, device)
    return (type(inner).__name__ != "ProcessGroupGloo") if inner is not None else dist.get_backend(group) != "gloo"


def _one_by_one(group, device: torch.device) -> bool:
    """Whether the backend's own messages of ``device`` would reach a backend that batches them
    (NCCL) one at a time: the drop-in's group, whose ``dist.batch_isend_irecv`` torch hands to
    zipccl a message at a time (it batches for its own ProcessGroup class only). Issued singly
    on NCCL, a receive and a send to one peer queue on one stream, and two ranks that each
    receive first wait for good."""
    if device.type != "cuda":
        return False
    inner = underneath(group, device)
    return inner is not None and bool(getattr(inner, "supports_coalescing", False))


def _can_frame(group, device: torch.device) -> bool:
    """``frames_messages``, False where no transport could (its error is for a call that must)."""
    try:
        return frames_messages(group, device)
    except UnsupportedError:
        return False


def _no_native(group, device: torch.device) -> UnsupportedError:
    return UnsupportedError(f"the group's backend ({dist.get_backend(group)}) cannot send or receive tensors on "
                            f"{device}: use a group of backend nccl, or codec 'auto' or 'raw' from a given peer "
                            "(zipccl's NCCL transport, with the GPU extra installed)")


def _decide(codec, x: torch.Tensor, group, peer: int):
    """NATIVE (the backend's send/recv) or the codec that frames the message, from what both ends
    know alike (module docstring). "auto" frames the plain bytes (PLAIN) where the backend cannot
    carry the tensor (CUDA on gloo), and where its messages would reach NCCL one at a time (the
    drop-in's group: ``_one_by_one``) and zipccl's NCCL pair can frame them."""
    if isinstance(codec, Mapping):
        if set(codec) != {"intra", "inter"}:
            raise ValueError(f"a per-link codec maps both of ('intra', 'inter') (got {sorted(codec)})")
        codec = codec["intra" if topology.same_node(group, peer) else "inter"]
    if codec == "native" or codec is NATIVE:
        if not _backend_takes(group, x.device):
            raise _no_native(group, x.device)
        return NATIVE
    nbytes = x.numel() * x.element_size()
    if codec == "auto":
        if not _backend_takes(group, x.device):
            if not frames_messages(group, x.device):
                raise framing_refused()
            framed = True
        else:
            framed = _one_by_one(group, x.device) and _can_frame(group, x.device)
        if framed:
            if x.dtype not in DTYPE_CODES or nbytes < auto.PROBE_MIN_BYTES or topology.same_node(group, peer):
                return PLAIN
        elif x.dtype not in DTYPE_CODES or nbytes < auto.PROBE_MIN_BYTES or topology.same_node(group, peer) \
                or not frames_messages(group, x.device):
            return NATIVE
        r = resolve_codec("lossless" if config.AUTO_LEARN else "auto", x.dtype, nbytes)
        return PLAIN if plain(r) else r  # auto's fixed rule below its floor: raw, as codec "raw" sends it
    r = resolve_codec(codec, x.dtype, nbytes)
    if r is not None and not plain(r) and not getattr(r, "exact", True):
        raise UnsupportedError(f"lossy codec {r!r} reduces: all_reduce and reduce_scatter only, not send/recv")
    if not frames_messages(group, x.device):
        raise framing_refused()
    return PLAIN if r is None or plain(r) else r  # "raw": the tensor's own bytes, no packet (no copy at either end)


# ---- ordering -------------------------------------------------------------------------------------------------

#: receive task -> (the task queued before it, its source: (group, peer's job rank), None for any)
_receives: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_receives_lock = threading.Lock()
_seq_lock = threading.Lock()
_seqs: dict = lifetime.keep({}, group_of=None)  # (group name, kind, peer's job rank) -> framed messages so far


def _next_seq(op: _Op) -> int:
    key = (_group_name(op.group), op.kind, op.peer_job)
    if key not in _seqs:
        lifetime.sweep()
    with _seq_lock:
        n = _seqs.get(key, 0)
        _seqs[key] = n + 1
    return n


def _group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def after_collectives() -> None:
    """Wait for the async calls queued before now, except receives: a send may pass those
    (they only post receives, so no peer's order of messages changes), never a collective; nor
    may a collective that the drop-in passes to the backend underneath (zipccl.backend). At once
    on the thread that runs the async calls in order (waiting there would wait for itself)."""
    h = collective_before()
    if h is not None:
        h._ended().wait()


def collective_before() -> executor.Handle | None:
    """What ``after_collectives`` waits for, taken now: the last async call queued before now that
    is not a receive and has not ended, its future's callbacks included (the calls before it end
    first), or None. A framed send
    takes it where it is issued and waits for it on its lane, so that the caller's thread does not."""
    if executor.running_queue():
        return None
    h = executor.last()
    while h is not None and not h._ended().is_set():  # its future's callbacks, which may issue calls, too
        entry = _receives.get(h)
        if entry is None:  # not a receive
            return h
        h = entry[0]
    return None


#: Held while a native message or a coalesced batch is posted to a backend that batches (NCCL):
#: a batch opens a coalescing window on its process group, whose state is the group's, not the
#: thread's, and a native receive that zipccl's async thread posted to that group inside the
#: window would join it, on one rank only. A post takes microseconds, except a pair's or a
#: group's first, in which NCCL makes a communicator and waits for the peers: one post waits
#: for another at most POSTING_S, then goes on (as before this lock), so that two such first
#: uses never wait for each other through it.
_POSTING = threading.Lock()
POSTING_S = 1.0


@contextlib.contextmanager
def _posting_window():
    held = _POSTING.acquire(timeout=POSTING_S)
    try:
        yield
    finally:
        if held:
            _POSTING.release()


def _posting(op: _Op):
    return _posting_window() if _batches(op.group, op.tensor.device) else contextlib.nullcontext()


def _native_send(op: _Op):
    inner = underneath(op.group, op.tensor.device)
    if inner is not None:
        return inner.send([op.tensor], op.peer, op.tag)
    with _posting(op):
        return dist.isend(op.tensor, group=op.group, group_dst=op.peer, tag=op.tag)


def _native_recv(op: _Op):
    inner = underneath(op.group, op.tensor.device)
    if inner is not None:
        return inner.recv([op.tensor], op.peer, op.tag)
    with _posting(op):
        return dist.irecv(op.tensor, group=op.group, group_src=op.peer, tag=op.tag)


def _native_recv_any(tensor: torch.Tensor, group, tag: int):
    """A receive from any source on the backend's own: on a drop-in group, the backend under it
    (whose own check would judge the message by the group's codec, not the call's)."""
    inner = underneath(group, tensor.device)
    if inner is not None:
        return inner.recv_anysource([tensor], tag)
    return dist.irecv(tensor, group=group, tag=tag)


# ---- handles --------------------------------------------------------------------------------------------------

def _complete_send(future: torch.futures.Future, complete, lock: threading.Lock, stream=None) -> None:
    """Complete a framed send on this thread (once), its device waits queued on ``stream``
    (default: this thread's current one), its result or error into ``future``."""
    with lock:
        if future.done():
            return
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                future.set_result(complete())
        except BaseException as e:  # raised by wait()
            future.set_exception(e)


#: (lane, completion) of the sends whose handles were collected unwaited, for ``_pass_dropped``.
_dropped_sends: queue.SimpleQueue = queue.SimpleQueue()
_passer: list = []  # its thread, once started
_passer_lock = threading.Lock()


def _dropped(lane, future: torch.futures.Future, complete, lock: threading.Lock) -> None:
    """A send's handle collected unwaited: the send completes on its lane all the same, so that
    its tensor is freed and the receiver's verdict taken from the store (its error reaches nobody).
    The collector runs this on whichever thread allocated, holding whatever lock that thread holds
    (the executor's too): it only puts the send on a SimpleQueue, whose put is safe there, and
    ``_pass_dropped``'s thread queues it on its lane."""
    if not future.done():
        _dropped_sends.put((lane, functools.partial(_complete_send, future, complete, lock)))


def _pass_dropped() -> None:
    """Each dropped send to its lane, from this thread of its own, which may take the executor's lock."""
    while True:
        lane, fn = _dropped_sends.get()
        executor.on_lane(lane, fn)
        del lane, fn  # nothing of a passed send kept while waiting for the next


def _start_passing_dropped() -> None:
    """The thread of ``_pass_dropped``, started with the first framed send (never by the collector)."""
    if not _passer:
        with _passer_lock:
            if not _passer:
                _passer.append(threading.Thread(target=_pass_dropped, daemon=True, name="zipccl-dropped-sends"))
                _passer[0].start()


class _SendHandle(executor.Handle):
    """A framed send: posted, completed by ``wait()`` (its sends, then the receiver's verdict),
    which raises what went wrong on either end, or in the background (its direction's completion
    lane) once ``get_future()`` or ``is_completed()`` was asked for, or once the handle is dropped."""

    def __init__(self, complete, verdict: Verdict, unposted, lane, device: torch.device | None = None):
        """``unposted()``: whether posting the message failed (then no verdict comes); ``lane``:
        the executor lane that completes its direction's sends in the background (one thread, and
        one store connection, for all of them); ``device``: the tensor's CUDA device, where it has one."""
        super().__init__()
        # reentrant: the future's callbacks run inside completing, and one may call wait()
        self._complete, self._verdict, self._lock = complete, verdict, threading.RLock()
        self._unposted, self._lane, self._device = unposted, lane, device
        self._behind, self._behind_lock = False, threading.Lock()
        _start_passing_dropped()
        weakref.finalize(self, _dropped, lane, self._future, complete, self._lock).atexit = False

    def _finish(self, stream=None) -> None:
        """Complete the send on this thread, its device waits queued on ``stream`` (default: this
        thread's current one), so that the stream of the caller that waits comes after the send."""
        _complete_send(self._future, self._complete, self._lock, stream)

    def wait(self, timeout=None) -> bool:
        """Complete the send (its sends, the receiver's verdict, every wait within zipccl's bound)
        and raise what went wrong on either end. ``timeout`` (seconds or a timedelta): as
        ``Handle.wait``'s, zipccl.errors.TimeoutError past it, while the send completes in the
        background (a dead receiver is still named there, and by the next ``wait()``),
        which orders the caller's current CUDA stream after the send as ``wait()`` does. On the
        lane's own thread (a callback of an earlier send's future) the send completes there and
        then, within zipccl's bound but not ``timeout``: queued, it would wait for that callback."""
        if timeout is None:
            self._finish()
        else:
            self._in_background()
        return super().wait(timeout)

    def _in_background(self) -> None:
        """Complete the send on its direction's completion lane (once), its device waits on the
        current stream."""
        if executor.on_its_lane(self._lane):  # a callback of an earlier send's future, which the lane runs:
            if not self._future.done():  # queued behind it, the send would wait for it, which may wait for the send
                self._finish()
            return
        with self._behind_lock:  # not _lock, which completing holds
            if not self._behind and not self._future.done():
                stream = torch.cuda.current_stream(self._device) if self._device is not None else None
                self._behind = True
                executor.on_lane(self._lane, functools.partial(self._finish, stream))

    def get_future(self) -> torch.futures.Future:
        """The send's future, which completes by itself, as the backend's does (without a
        ``wait()``: the send completes in the background)."""
        self._in_background()
        return super().get_future()

    def is_completed(self) -> bool:
        """Once the verdict is there, or posting failed (no verdict comes then), or the send
        failed: the first call that finds none of these completes the send in the background, so
        that a loop that only polls sees a dead receiver within zipccl's bound, as ``wait()``
        would."""
        if not self._future.done():
            if self._verdict.ready() or self._unposted():
                self._finish()
            else:
                self._in_background()
        return self._future.done()


def _send(op: _Op):
    """Post ``op``'s message on its direction's lane (executor.on_lane), in issue order with the
    direction's other sends, once the collectives queued before it have ended (waited for there):
    making the pair's transport with the first message waits for the receiver, which must never
    block this thread (two ranks that each isend before they irecv would wait for each other for
    good). A native message is posted here, once those collectives have ended. Its handle."""
    if op.plan is NATIVE:
        after_collectives()
        record_native("send")
        return _native_send(op)
    before = collective_before()
    op.seq = _next_seq(op)
    verdict = Verdict(_group_name(op.group), dist.get_rank(), op.peer_job, op.seq)

    state = []  # (fate, acc, sends), kept here: a CUDA-aware future would pickle its value, and c10d's works cannot be
    sent = []  # True once posting ended without an error

    def post() -> None:
        if before is not None:
            before.join()
        fate, acc, sends = Fate.of("send", op.transport(), (dist.get_rank(), op.peer_job)), new_acc(), []
        state.append((fate, acc, sends))  # before posting, which may wait for the receiver (_not_posted)
        sends += send_message(op.t, op.tensor.reshape(-1), op.peer, op.plan, op.sig, acc, fate, op.seq)
        sent.append(True)

    posted = executor.on_lane(("send", _group_name(op.group), op.peer_job), post, (op.tensor,))

    def complete():
        if before is not None:  # the calls queued before, each waiting within its own bound: the posting's counts after them
            before.join()
        _wait_posted(op, posted, state)
        fate, acc, sends = state[0]
        for w in sends:
            fate.wait(op.t, w, op.peer)
        if not fate.lost:
            try:
                status, theirs = verdict.take(config.wait_bound())
            except TimeoutError as e:
                fate.lose(op.t, op.peer, e)
            else:
                if status == 1:
                    raise MismatchError(mismatch_text(dist.get_rank(), op.peer_job, op.sig, theirs))
                if status and not fate.failed:
                    fate.heard(status)
        fate.check()
        return finish("send", op.plan, acc)

    return _SendHandle(complete, verdict, lambda: posted.is_completed() and not sent,
                       ("sent", _group_name(op.group), op.peer_job), op.tensor.device if op.tensor.is_cuda else None)


def _wait_posted(op: _Op, posted: executor.Handle, state: list) -> None:
    """Wait for ``op``'s posting (raising where it failed: the pair's transport could not be
    made), zipccl's bound at a time while it makes progress: it encodes each piece as the one
    before leaves, so a large message may take longer than the bound to post on a live pair.
    Only a bound's wait in which no piece was posted counts as the receiver's (_not_posted)."""
    def progress() -> tuple:
        return (state[0][1]["meta_bytes"], state[0][1]["raw_bytes"]) if state else (0, 0)

    seen = progress()
    while True:
        try:
            posted.wait(config.wait_bound())
            return
        except ZipcclTimeout:
            now = progress()
            if now == seen:
                _not_posted(op, state)
            seen = now


def _not_posted(op: _Op, state: list):
    """A send whose posting posted nothing for zipccl's bound: NCCL's group end, which connects
    the pair's channels, waits for the receiver to post its side (or the pair's transport is
    still being made), and a receiver that never does would hold the sender for good. Its peer is lost:
    RankFailure naming the rank the heartbeats name, the pair's communicators aborted so that
    the lane's group call ends."""
    if not state:
        raise RankFailure(f"zipccl.send: the message to rank {op.peer_job} was not posted within "
                          f"{config.wait_bound():g} s (making the pair's transport)", rank=op.peer_job, kind="lost",
                          broken=True)
    fate = state[0][0]
    fate.lose(op.t, op.peer, TimeoutError(f"posting the message waited {config.wait_bound():g} s for rank "
                                          f"{op.peer_job}'s receive"))
    op.t.abort()
    fate.check()


def _receive(op: _Op):
    """The body of ``op``'s receive task."""
    if op.plan is NATIVE:
        record_native("recv")
        work = _native_recv(op)
        work.wait()
        return None
    fate, acc = Fate.of("recv", op.transport(), (op.peer_job, dist.get_rank())), new_acc()
    me, peer = op.t.global_rank(op.t.rank), op.t.global_rank(op.peer)
    problem, seq = receive_message(op.t, op.tensor.reshape(-1), op.peer, op.plan, op.sig, acc, fate)
    verdict = Verdict(_group_name(op.group), peer, me, op.seq if seq is None else seq)  # the sender's number
    try:
        fate.check()
        status = 1 if problem else 0
    except Exception:
        status = fate.code or poison(me, LOST)
        if problem is None and fate.lost:  # the sender is gone: nobody reads a verdict
            raise
        verdict.give(op.sig, status)
        raise
    verdict.give(op.sig, status)
    if problem:
        raise MismatchError(problem)
    if op.staged is not None:
        op.staged.copy_(op.tensor)
    return finish("recv", op.plan, acc)


def _forget(receive: weakref.ref, _future=None) -> None:
    """A receive done: nothing walks past it (``after_collectives``), so it no longer holds the
    task queued before it, and a rank that only receives does not keep every receive alive."""
    if (handle := receive()) is not None:
        with _receives_lock:
            _receives.pop(handle, None)


def _post_receive(op: _Op, async_op: bool):
    """``op``'s receive: its handle (``async_op``), or None once it has come. A framed one runs on
    its direction's receive lane (``_framed_receive``); a native one is posted in issue order
    (_posted_in_order)."""
    if op.plan is not NATIVE:
        op.seq = _next_seq(op)
        handle = _framed_receive(op, async_op)
        if async_op:
            return handle
        handle.wait()
        return None
    _refuse_passing((_group_name(op.group), op.peer_job))
    if async_op and executor.idle():
        record_native("recv")
        return _native_recv(op)  # nothing queued before it: the backend's receive, posted at once
    if not async_op:
        return executor.run(lambda: _receive(op), False)
    record_native("recv")
    source = (_group_name(op.group), op.peer_job)
    return _posted_in_order(lambda: _native_recv(op), source, ("native recv", *source), op.tensor)


def _posted_in_order(post, source: tuple | None, lane, tensor: torch.Tensor) -> executor.Handle:
    """A native receive behind queued async calls, ``post()`` (the backend's: its Work): posted by
    zipccl's async thread in issue order (after the collectives issued before it, as on every
    rank), then waited for on ``lane``, so that the async thread goes on at once. Held there until
    its message came, the queue would hold up every call issued after it: a collective issued
    before the send that the receive's peer waits for, on both ranks, waited for good, and so did
    receives from other peers or by other tags. Sends pass it until it is posted (``_a_receive``:
    from ``source``, None for any). Its handle completes once the message has come, the lane's
    receives in issue order; from any source, its value is the Work's ``_source_rank()``."""
    work = []

    def posting() -> None:
        work.append(post())  # kept here: a CUDA-aware future would pickle its value

    before = executor.last()
    posted = _a_receive(executor.run(posting, True, [tensor]), before, source)

    def arrive():
        posted.wait()  # the posting's error, if any
        work[0].wait()
        return work[0]._source_rank() if source is None else None

    if executor.on_its_lane(lane):  # a callback of an earlier receive's future, which the lane runs
        return executor.inline(arrive)
    return executor.on_lane(lane, arrive, [tensor])


def _framed_receive(op: _Op, async_op: bool) -> executor.Handle:
    """Run ``op``'s framed receive on its direction's receive lane (executor.on_lane), in issue
    order with the direction's other receives, once the collectives queued before it have ended:
    so a receive waiting for one peer never holds up a receive from another, nor the async calls
    issued after it (three ranks whose blocking sends each wait for a receive issued behind
    another peer's would wait for each other for good, where torch's receives are all posted at
    once). A receive issued on the lane itself (a callback of a receive's future from the same
    peer) runs there at once, where no receive issued before it waits on the lane (queued, a
    wait for it there would wait for good)."""
    before = collective_before()
    key = ("recv", _group_name(op.group), op.peer_job)

    def receive():
        if before is not None:
            before.join()
        return _receive(op)

    if executor.on_its_lane(key):
        if not executor.lane_empty(key):
            raise UnsupportedError(
                f"zipccl: a receive from rank {op.peer_job} issued from a callback of a receive's future, while a "
                "receive from that rank issued before it still waits, would take the message meant for that one "
                "or wait behind it for good; issue it outside the callback, or once that receive has been waited for")
        return executor.inline(receive)
    return executor.on_lane(key, receive, [t for t in (op.tensor, op.staged) if t is not None])


def _refuse_passing(source: tuple | None) -> None:
    """Raise UnsupportedError where a native receive from ``source`` ((group, peer's job rank);
    None: any source), issued on the async calls' thread (a future's callback, which runs it at
    once: a wait for it queued would wait for good), would run ahead of a receive queued before
    it that may take the same message (from the same peer or from any source; for one from any
    source, every queued receive)."""
    if not executor.running_queue():
        return
    with _receives_lock:
        ahead = any(not h.is_completed() and (source is None or mine in (source, None))
                    for h, (_, mine) in list(_receives.items()))
    if ahead:
        whom = "any source" if source is None else f"rank {source[1]}"
        raise UnsupportedError(
            f"zipccl: a receive from {whom} issued from a callback of an async call's future, while a receive "
            "issued before it still waits in zipccl's queue, would take the message meant for that one; issue it "
            "outside the callback, or once that receive has been waited for")


def _a_receive(handle: executor.Handle, before, source: tuple | None = None) -> executor.Handle:
    """``handle``, queued after ``before``, is a receive (from ``source``: (group, peer's job rank),
    None: any): later sends pass it (after_collectives) until it is done."""
    with _receives_lock:
        _receives[handle] = before, source
    handle.get_future().add_done_callback(functools.partial(_forget, weakref.ref(handle)))
    return handle


def after_queued(post, tensor: torch.Tensor):
    """A receive from any source, ``post()`` (the backend's: a Work whose ``_source_rank()`` names
    the sender in its group): posted at once where no receive or collective is queued, else behind
    them in issue order, so that it never takes a message meant for a receive issued before it,
    and then waited for on a lane of its own (the async thread goes on at once).
    The Work, or a handle whose ``_source_rank()`` names the sender alike. On zipccl's async
    thread (the drop-in's receive under zipccl's, or a future's callback) at once, where no
    receive queued before it is waiting (else UnsupportedError); on a lane's thread (a callback
    of a send's future) it is queued as on the caller's."""
    _refuse_passing(None)
    if executor.running_queue() or executor.idle():
        return post()

    handle = _posted_in_order(post, None, ("native recv", "any source"), tensor)
    handle._source_rank = lambda: handle.get_future().value()
    return handle


# ---- the calls ------------------------------------------------------------------------------------------------

def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None,
          *, codec="auto"):
    """Like ``dist.isend``: send ``tensor`` to rank ``dst`` (of the job; or ``group_dst`` of
    ``group``); a handle with ``wait()`` and ``is_completed()``. ``codec``: "auto" (default),
    "native", "raw", "lossless", a codec instance, or a mapping per link {"intra": ...,
    "inter": ...}; the receiver must pass the same. ``wait()`` raises where the receiver
    disagrees (dtype, elements, codec, tag: MismatchError on both ends) or failed. Under "auto"
    the two ends decide from their own dtype and size: ends that disagree there may not both
    frame the message, and then fail (or wait) as the backend's own send and receive would."""
    if not_in(group, "isend"):
        return None
    return _send(_Op("send", tensor, dst, group, tag, group_dst, codec))


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None,
          *, codec="auto"):
    """Like ``dist.irecv``: receive into ``tensor`` from rank ``src`` (of the job; or ``group_src``
    of ``group``); a handle with ``wait()`` and ``is_completed()``. Any source (``src`` None) is
    the backend's own receive: codec "auto" or "native" only."""
    if not_in(group, "irecv"):
        return None
    if src is None and group_src is None:
        if codec not in ("auto", "native"):
            raise UnsupportedError("a receive from any source is the backend's own: codec 'auto' or 'native'")
        if not _backend_takes(group, tensor.device):
            raise _no_native(group, tensor.device)
        check_any_source(tensor, group, codec)
        record_native("recv")
        return after_queued(lambda: _native_recv_any(tensor, group, tag), tensor)
    return _post_receive(_Op("recv", tensor, src, group, tag, group_src, codec), True)


def check_any_source(tensor: torch.Tensor, group, codec) -> None:
    """Raise where a receive from any source could not meet its message: the receive is the
    backend's own, and a sender that frames its message (a float tensor of this size from a peer
    across the nodes under "auto", or any peer under a codec that frames) would wait for a framed
    receive that never comes, while this end waits for a message that never comes. Under "auto"
    a peer whose node this rank cannot learn without waiting (it has sent no message yet) is not
    counted."""
    pg = group if group is not None else dist.group.WORLD
    me = dist.get_rank(pg)
    # auto (or a mapping per link) decides by the peer's node, which a peer tells before it frames
    # anything: where it is not known yet, that peer has framed nothing yet
    by_link = codec == "auto" or isinstance(codec, Mapping)
    framed = [dist.get_global_rank(pg, r) for r in range(dist.get_world_size(pg))
              if r != me and (not by_link or topology.same_node(group, r, wait=False) is not None)
              and _decide(codec, tensor, group, r) is not NATIVE]
    if framed:
        raise UnsupportedError(
            f"a receive from any source is the backend's own, but zipccl frames a message of {tensor.numel()} "
            f"{str(tensor.dtype).replace('torch.', '')} elements from rank{'s' * (len(framed) > 1)} "
            f"{', '.join(map(str, framed))} (codec {codec!r}): name the sender, or use codec 'native'")


def send(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None,
         *, codec="auto") -> None:
    """Like ``dist.send``: ``isend(...).wait()``."""
    if not_in(group, "send"):
        return None
    isend(tensor, dst, group, tag, codec=codec, group_dst=group_dst).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None,
         *, codec="auto") -> int:
    """Like ``dist.recv``: receive into ``tensor`` and return the sender's rank in the job (-1 on a
    rank outside ``group``, as torch's)."""
    if not_in(group, "recv"):
        return -1
    if src is None and group_src is None:
        handle = irecv(tensor, group=group, tag=tag, codec=codec)
        handle.wait()
        return dist.get_global_rank(group if group is not None else dist.group.WORLD, handle._source_rank())
    op = _Op("recv", tensor, src, group, tag, group_src, codec)
    _post_receive(op, False)
    return op.peer_job


def batch_isend_irecv(p2p_op_list: list) -> list:
    """Like ``dist.batch_isend_irecv``: the receives queued (a framed one on its direction's
    receive lane), the sends posted on their lanes, so the list's order never blocks it (two
    ranks may send to each other in one batch, from a callback of an async call's future too).
    Takes zipccl's or torch's P2POp; returns one handle per operation (none for one on a group
    that this rank is not in, as torch's). On a backend that batches
    (NCCL), the messages that go to it are one batch of torch's, as torch's call would make them,
    issued once zipccl's collectives before them have ended (``_coalesced``)."""
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv needs at least one operation")
    ops = []
    for p in p2p_op_list:
        if not_in(getattr(p, "group", None), "batch_isend_irecv"):  # as torch's: warned, no operation, no handle
            continue
        kind = _kind(getattr(p, "op", None))
        if kind is None:
            raise ValueError(f"batch_isend_irecv takes P2POp (zipccl's or torch's) of isend or irecv, got {p!r}")
        group_peer = getattr(p, "group_peer", None)  # torch's P2POp sets both ranks
        ops.append(_Op(kind, p.tensor, p.peer if group_peer is None else None, p.group, getattr(p, "tag", 0),
                       group_peer, getattr(p, "codec", "auto")))
    if not ops:
        return []
    receives = [op for op in ops if op.kind == "recv"]
    for s in ops:  # a send from memory that a receive of the batch lands in sends what it held at the call
        if s.kind == "send" and any(overlaps(s.tensor, r.landing()) for r in receives):
            s.tensor = s.tensor.clone()
    together = _coalesced(ops)
    batched = {id(op) for batch in together for op in batch}
    sends = [op for op in ops if op.kind == "send" and id(op) not in batched]
    # the receives first (a native one queued on the async thread: the sends pass it), the sends then
    # posted on their lanes; but on that thread (a callback of an async call's future) a native
    # receive runs at once, so the sends first
    sends_first = executor.running_queue()
    for op in receives:  # refused before anything is posted: no send of the batch left unmatched
        if op.plan is NATIVE:
            _refuse_passing((_group_name(op.group), op.peer_job))
    handles = {id(op): _send(op) for op in sends} if sends_first else {}
    handles.update({id(op): _post_receive(op, True) for op in receives if id(op) not in batched})
    if together:
        after_collectives()
    if not sends_first:
        handles.update({id(op): _send(op) for op in sends})
    for batch in together:  # after the collectives queued before (after_collectives), as the sends
        for op in batch:
            record_native(op.kind)
        with _posting_window():
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor,
                                                       group=op.group, tag=op.tag, group_peer=op.peer)
                                            for op in batch])
        if len(works) != len(batch):  # a coalesced batch: one work for all of them
            works = [works[0]] * len(batch)
        handles.update({id(op): work for op, work in zip(batch, works)})
    return [handles[id(op)] for op in ops]


def _coalesced(ops: list[_Op]) -> list[list[_Op]]:
    """The batch's messages that go to the backend's own send and receive where its backend
    batches them (NCCL's group call: ``batch_isend_irecv``'s coalescing), one batch of torch's
    per group and device, as torch's call would batch them: decided per message, on its two ends
    alike, whatever else the batch holds or zipccl's queue. Issued one by one instead, a rank's
    receive and send to one peer would queue on one NCCL stream, where two ranks that each
    receive first wait for good; and a batched message never matches one issued alone (torch
    runs them on different communicators). None on the drop-in's group (its batch would come
    back here) or on gloo. In an order every rank shares (group name, device), not the list's:
    two ranks that list two groups' messages in different orders would each wait in a different
    group's first use, whose making needs every rank."""
    batches: dict = {}
    for op in ops:
        if op.plan is NATIVE and dist.get_backend(op.group) != "zipccl" and _batches(op.group, op.tensor.device):
            key = (_group_name(op.group), op.tensor.device.type, op.tensor.device.index or 0)
            batches.setdefault(key, []).append(op)
    return [batches[key] for key in sorted(batches)]


def _batches(group, device: torch.device) -> bool:
    """Whether the group's backend for ``device`` batches point-to-point messages (NCCL does)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return type(pg) is dist.ProcessGroup and bool(pg._get_backend(device).supports_coalescing)
    except (AttributeError, RuntimeError):  # no backend for that device
        return False
