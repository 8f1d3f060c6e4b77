"""Transport over an NCCL communicator of CuPy (``cupy.cuda.nccl``): the GPU path of zipccl.

Two communicators per process group, made once (``NcclTransport.of(group)``) on the device of
``torch.cuda.current_device()``: rank 0's unique ids reach the group's other ranks through the
job's store (torch.distributed's default one), so no start method of CuPy's own is needed. Making
them is collective: every rank first says whether it can load NCCL (where one cannot, none enters
NCCL), then tells every other, through the store, whether it succeeded: where any failed, every
rank raises the same ZipcclError carrying the reason (NCCL's message). A failed communicator is
aborted. NCCL's making waits for every rank without a bound, so it runs
on a thread of its own, which the rank waits for as for a mail, as it waits for the store's
words: where a rank never joins (dead, hung), the others raise RankFailure (``broken``) instead
of waiting for good, naming the rank the heartbeats name (silent, or behind), else -1; one that
gives up tells the others, which raise its failure with it. Nothing here waits on the group's
own backend, whose timeout is torch's.

Two channels, each a communicator with its own stream. The bulk channel carries device tensors
(packets, native collectives) on a stream ordered after torch's current stream by an event, so
the host does not wait for the device. The mail channel carries host tensors: the small int64
messages (metadata, a piece's sizes, the status round) that the host must read to schedule the
bulk. They are staged through pinned memory on the mail stream, which waits for nothing else, and
read back when waited for: a size never queues behind a packet, and reading it never waits for the
codec or the bulk stream (one channel made each size mail wait until every earlier packet had
left, so about one piece was on the wire at a time). NCCL's rules hold on each channel (DESIGN.md
invariant 12): exact-size receives, no tags (messages between two ranks match in issue order),
sends and receives issued inside ``grouped()`` (groupStart/End). Strict mode checks a schedule
on one channel, which is stricter: an order that matches on one matches on each of two.
Codec "native" is never run here: it is the group's own collective (``native`` hands it to
the group: torch's ProcessGroupNCCL on an nccl group, the drop-in's NCCL backend underneath), so
these communicators exist only for the packets of plans that compress (zipccl.transport.select).

GPU-only beyond construction: what runs without a GPU (the bootstrap, its agreed error, the type
and op tables) is tested in CI (tests/test_nccl.py); the rest is covered by the ``gpu`` suite
(tests/test_nccl_gpu.py, tests/test_gpu_lab.py, docs/GPU.md), which needs a CUDA device: its
collectives passed on 1, 2 and 4 ranks of one H100 (2026-11-26) and, with the mail channel, of
one H200 (2026-11-30), several ranks sharing the GPU in the one-GPU lab
(zipccl.launch.spawn(..., share_gpu=True), docs/GPU.md). NCCL connects two ranks on a channel at
their first send or receive, inside the host's group call, which returns once the peer has
posted its side, and may hold a group's messages until all their receives are posted: the
collectives post both sides in one group, and a message whose receive waits for an earlier
one (a point-to-point packet, behind its size) goes in a group call of its own (strict mode
checks both, zipccl.transport.strict). A killed rank's survivors named it on an H200 at 41adf7a,
aborts all at once (``_abort_all``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import threading
import time

import torch
import torch.distributed as dist

from .. import config, lifetime
from ..errors import RankFailure, UnsupportedError, ZipcclError
from . import heartbeat, nccl_stack, store
from .base import DeviceMail, Transport, wait_limit
from .torch_dist import TorchTransport

__all__ = ["NcclTransport", "NcclError", "abort_together"]

_transports: dict = lifetime.keep({})

#: The shortest wait for NCCL to make a group's communicators: ZIPCCL_TIMEOUT may be a few
#: seconds, and a first making (CUDA's and NCCL's start-up, several ranks on one GPU) can take
#: that long; a dead rank is still named once its heartbeat is stale (half of ZIPCCL_TIMEOUT).
MAKING_S = 60.0

#: group name -> the makings of its NcclTransport so far (their keys in the store); None -> whose world
_makings: dict = {}
_makings_lock = threading.Lock()


class NcclError(ZipcclError, RuntimeError):
    """NCCL failed (its own message is in the text); the communicator has been aborted."""

    #: NCCL's errors and a wait that runs out do not say which peer failed: every operation of a
    #: group completes together (one event), so zipccl.failure asks the heartbeats which rank it was.
    anonymous = True


#: How long an abort waits for NCCL's ncclCommAbort calls before it goes on without them.
ABORT_S = 30.0

def _abort_all(comms) -> None:
    """ncclCommAbort on each communicator of ``comms`` (None: none made), whatever NCCL says, all
    at once, one thread each, waiting at most ABORT_S for them. One after another could wait for
    good: NCCL frees a communicator's device memory as it aborts it, CUDA's free waits for every
    kernel of the process on the device, and a kernel of a communicator not yet aborted that
    waits on a dead peer never ends; each abort sets its own communicator's flag, which ends its
    kernels, before it frees. At the interpreter's exit, where Python 3.12 starts no thread, each
    on this thread, one after another (``ended_at_exit``: the best left there)."""
    threads = []
    for comm in comms:
        if comm is None:
            continue
        thread = threading.Thread(target=_abort_one, args=(comm,), name="zipccl-nccl-abort", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # "can't create new thread at interpreter shutdown"
            _abort_one(comm)
        else:
            threads.append(thread)
    deadline = time.monotonic() + ABORT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))


_DETACH = threading.Lock()  # NcclTransport._detach's

#: How long an abort from another thread waits for an open group call of the transport to end
#: (``NcclTransport._detach``); a group's end that waits on a dead peer ends only by the abort.
GROUP_END_S = 2.0


#: A host wait on NCCL polls back to back for this long before it naps between polls: a mail
#: or a read is often about to come, and a nap (about 100 us on Linux) would add to each.
SPIN_S = 2e-3


def _silent(members) -> str | None:
    """Why a wait on the job ranks ``members`` gives up: those whose heartbeats are silent (None
    where none is, or there is no board)."""
    board = heartbeat.board()
    silent = board.silent(members) if board is not None else {}
    if not silent:
        return None
    return "no heartbeat from rank(s) " + ", ".join(f"{r} for {age:.1f} s" for r, age in sorted(silent.items()))


class _Ends:
    """The group calls whose end (ncclGroupEnd) is under way, and a thread that aborts the
    transport of one that waits too long. NCCL connects two ranks inside the first group end that
    involves them, and returns once the peer has posted its side: a peer stopped or dead before
    it does would hold this rank there for good, out of reach of every wait's bound. The thread,
    started at the first end, looks four times a second: an end that has lasted past
    ``heartbeat.stale_after()`` while a rank of the group is silent, or past a making's bound
    (config.wait_bound(), at least MAKING_S: connecting is the rest of NCCL's making), has its
    transport aborted, which ends it (NCCL's connecting checks the abort flag), and ``grouped``
    ends that group as one with a failed post."""

    def __init__(self):
        self._open, self._why, self._lock, self._thread = {}, {}, threading.Lock(), None

    def begin(self, t) -> None:
        with self._lock:
            self._open[t] = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zipccl-nccl-ends", daemon=True)
                self._thread.start()

    def end(self, t) -> str | None:
        """Why ``t``'s end was given up (its communicators aborted or about to be), else None."""
        with self._lock:
            self._open.pop(t, None)
            return self._why.pop(t, None)

    def _run(self) -> None:
        while True:
            time.sleep(min(heartbeat.period(), 0.25))
            with self._lock:
                ending = list(self._open.items())
            for t, since in ending:
                waited = time.monotonic() - since
                if waited > max(config.wait_bound(), MAKING_S):
                    why = f"NCCL's group end made no progress within {waited:.1f} s (ZIPCCL_TIMEOUT=" \
                          f"{config.TIMEOUT}, default {config.DEFAULT_TIMEOUT:g} s)"
                else:
                    why = _silent(t._members) if waited > heartbeat.stale_after() else None
                if why is None:
                    continue
                with self._lock:
                    if self._open.pop(t, None) is None:  # it ended meanwhile
                        continue
                    self._why[t] = why
                threading.Thread(target=t._abort, name="zipccl-nccl-abort", daemon=True).start()


_ENDS = _Ends()


def _abort_one(comm) -> None:
    with contextlib.suppress(Exception):
        comm.abort()


def ended_at_exit(cache: dict):
    """For atexit: the communicators of ``cache``'s transports ended by ncclCommAbort (all at once,
    within ABORT_S), then ``cache`` cleared. Left to CuPy's garbage collection, each would end by
    ncclCommDestroy, which waits for the operations still pending on it: on a peer that died (a
    level or a pair that the failed call did not abort), for good. torch aborts its own NCCL
    communicators that were not destroyed, alike."""
    def end() -> None:
        comms = []
        for t in list(cache.values()):
            comms += t._detach()
        cache.clear()
        _abort_all(comms)
    return end


atexit.register(ended_at_exit(_transports))


def abort_together(transports) -> None:
    """Abort the communicators of every NcclTransport of ``transports`` (a call's levels) in one
    ``_abort_all``, and the others' ``abort()``: a level's kernels pending on a dead peer end only
    when its own communicator is aborted, which one level after another would never reach."""
    comms = []
    for t in transports:
        if isinstance(t, NcclTransport):
            comms += t._detach()
        else:
            t.abort()
    _abort_all(comms)


def _made_word(error: Exception | None = None, lost: RankFailure | None = None) -> str:
    """A rank's word, in the store, on its making of communicators: its error ("" for none), or
    the RankFailure it gave up with (``lost``), which the ranks that read it raise too."""
    if lost is not None:
        return json.dumps({"error": str(lost), "lost": lost.rank})
    return json.dumps({"error": "" if error is None else f"{type(error).__name__}: {error}"})


def _error_of(word: bytes) -> str:
    """The error in a rank's word (``_made_word``; "" for none); raises the RankFailure it gave up with."""
    said = json.loads(word)
    if "lost" in said:
        raise RankFailure(said["error"], said["lost"], "lost", True)
    return said["error"]


def _aborted() -> NcclError:
    return NcclError("the NCCL communicator was aborted after an earlier failure: rebuild the group")


class _Work:
    """An operation issued in a group: done when the event recorded after the group's end on its
    channel's stream has passed. ``host``: a CPU tensor to fill from ``staged`` once done (a
    received size), ``pinned`` the host copy of ``staged`` that the mail stream makes; ``broken``:
    its group never ran (a post in it failed), so waiting for it raises."""
    __slots__ = ("event", "keep", "host", "staged", "pinned", "mail", "broken")

    def __init__(self, keep, host=None, staged=None, mail=False):
        self.event, self.keep, self.host, self.staged, self.mail = None, keep, host, staged, mail
        self.pinned, self.broken = None, False


class NcclTransport(Transport):
    """``group``'s ranks over one NCCL communicator of CuPy. Raises ZipcclError, the same on every
    rank, where it cannot be made (no GPU, NCCL's own failure); never falls back to another transport."""

    loose_receives = False
    tags = False
    _without_ids = "rank 0 could not load NCCL"  # why the shared ids are zeros
    _fenced: tuple = ()  # the other transports the call's status round waits for (``fence``)
    _failed_in_group: Exception | None = None  # an operation that failed inside the open group (``_p2p``)

    @classmethod
    def of(cls, group=None) -> "NcclTransport":
        key = group if group is not None else dist.GroupMember.WORLD
        t = _transports.get(key)
        if t is None:
            lifetime.sweep()
            t = _transports.setdefault(key, cls(group))
        return t

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: call zipccl.launch.init() or "
                               "torch.distributed.init_process_group() first")
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self._ranks = dist.get_process_group_ranks(group if group is not None else dist.GroupMember.WORLD)
        self._members = self._ranks  # the job ranks its communicators join, whose heartbeats a long wait reads
        self._open: list | None = None
        self.comm, self.mail_comm, error = None, None, None
        try:
            self.nccl = nccl_stack.load()
        except UnsupportedError as e:
            self.nccl, error = None, e
        heartbeat.start()  # the evidence that names a rank that never comes to the making
        uid = self._share_id(error)
        if error is None:
            error = self._connect(uid)
        self._agree(error)

    # ---- bootstrap ------------------------------------------------------------------------------------------

    def _share_id(self, error: Exception | None = None) -> bytes:
        """Rank 0's two unique ids (128 bytes each: the bulk channel's, then the mail channel's),
        through the job's store under this making's keys (``_key``), once every rank has said it
        can load NCCL (``error``: why not); each word waited for as for a mail (``_heard``).
        Zeros, and why (``_without_ids``), where a rank cannot or rank 0's NCCL gives no id: then
        no rank enters NCCL, and every rank raises the same NcclError (``_agree``)."""
        name = (self.group if self.group is not None else dist.GroupMember.WORLD).group_name
        with _makings_lock:  # a group's makings, counted alike on its ranks (one that failed everywhere runs again)
            if _makings.get(None) is not dist.GroupMember.WORLD:  # a new job's world: its own store, counted anew
                _makings.clear()
                _makings[None] = dist.GroupMember.WORLD
            n = _makings[name] = _makings.get(name, -1) + 1
        self._prefix, since = f"zipccl/nccl/{name}/{n}/", time.time()
        store.own().set(self._key(f"ready/{self.rank}"), "" if error is None else f"{type(error).__name__}: {error}")
        if self.rank == 0:
            deadline = time.monotonic() + self._bound()
            words = [self._heard(f"ready/{r}", since, deadline).decode() for r in range(self.size)]
            why = "; ".join(f"rank {self.global_rank(r)} could not load NCCL ({w})" for r, w in enumerate(words) if w)
            ids = b""
            if not why:
                try:
                    ids = b"".join(bytes(self.nccl.get_unique_id()) for _ in range(2))
                except Exception as e:  # noqa: BLE001 - every rank must hear of it
                    why = f"rank {self.global_rank(0)}'s NCCL gave no unique id ({type(e).__name__}: {e})"
            store.own().set(self._key("ids"), ids.ljust(256, b"\0") + why.encode())
        said = self._heard("ids", since, time.monotonic() + self._bound())
        self.unique_id, why = bytes(said[:256]), bytes(said[256:]).decode()
        if why:
            self._without_ids = why
        return self.unique_id

    def _key(self, what: str) -> str:
        return self._prefix + what

    @staticmethod
    def _bound() -> float:
        """How long a making may take: ZIPCCL_TIMEOUT, but at least MAKING_S."""
        return max(config.wait_bound(), MAKING_S)

    def _heard(self, what: str, since: float, deadline: float) -> bytes:
        """The value of this making's key ``what`` once set, waited for as for a mail (``_until``)
        until ``deadline`` (monotonic), in waits of the store's own of half a heartbeat each (one
        request each, not a poll): RankFailure where it never comes, or the store fails (its host,
        job rank 0, gone): ``_not_joined``."""
        key = self._key(what)

        def came() -> bool:
            try:
                store.wait(key, heartbeat.period() / 2)
            except TimeoutError:
                return False
            return True
        try:
            why = self._until(came, max(0.0, deadline - time.monotonic()), nap=0.0)
            value = store.own().get(key) if why is None else None
        except Exception as e:  # noqa: BLE001 - the store's host is gone
            why = f"the job's store failed ({type(e).__name__}: {e})"
        if why is not None:
            self._abort()
            raise self._not_joined(why, since)
        return value

    def _comm_rank(self, rank: int) -> int:
        """``rank`` of the group as its communicators number it (the same here; NcclPair's differ)."""
        return rank

    def _connect(self, uid: bytes) -> Exception | None:
        """This rank's two communicators (``uid``: their ids, one after the other); the exception
        where NCCL or CUDA refused them. Raises RankFailure where a rank never joined (``_made``)."""
        if not any(uid):
            return UnsupportedError(self._without_ids)
        bulk, mail = uid[:128], uid[128:]
        try:
            if not torch.cuda.is_available():  # NCCL is still asked, so that its own error is the one reported
                self.comm, = self._made(None, bulk)
                raise UnsupportedError("torch has no CUDA device here: NcclTransport takes torch CUDA tensors")
            self.device = torch.cuda.current_device()
            self.comm, self.mail_comm = self._made(self.device, bulk, mail)
            self.stream = torch.cuda.Stream(self.device)
            self.mail_stream = torch.cuda.Stream(self.device)
        except RankFailure:
            raise
        except Exception as e:  # noqa: BLE001 - NcclError, CUDARuntimeError: every rank must hear of it
            self._abort()
            return e
        return None

    def _made(self, device: int | None, *ids: bytes) -> list:
        """The communicators of ``ids`` (on CUDA ``device``), made by NCCL on a thread of its own:
        NCCL's making waits for every rank of the communicator without a bound (and without the
        GIL), so a rank that died or hangs before joining would keep this one there for good. This
        rank waits for it as for a mail (``_until``), but at least MAKING_S seconds; where it gives
        up, it raises RankFailure (``broken``) naming the rank the heartbeats name, and aborts the
        communicators made so far (NCCL's thread, left blocked, aborts any it makes later), and
        tells the ranks whose making finished meanwhile (``_say_lost``)."""
        made, state, lock = [], {}, threading.Lock()
        size, rank = len(self._members), self._comm_rank(self.rank)

        def make() -> None:
            try:
                with contextlib.ExitStack() as scope:
                    if device is not None:
                        import cupy
                        scope.enter_context(cupy.cuda.Device(device))  # the device is the thread's own
                    for uid in ids:
                        made.append(self.nccl.NcclCommunicator(size, uid, rank))
            except Exception as e:  # noqa: BLE001 - raised on the caller's thread
                state["error"] = e
            with lock:
                state["done"] = True
                if state.get("abandoned"):
                    _abort_all(made)

        since, limit = time.time(), self._bound()
        thread = threading.Thread(target=make, name="zipccl-nccl-init", daemon=True)
        thread.start()
        why = self._until(lambda: not thread.is_alive(), limit, nap=0.005)
        with lock:
            if why is not None and not state.get("done"):
                state["abandoned"] = True
                taken = made[:]  # those made already; NCCL's thread aborts any it makes later, not these again
                del made[:len(taken)]
                _abort_all(taken)
                failure = self._not_joined(why, since)
                self._say_lost(failure)
                raise failure
        if "error" in state:
            _abort_all(made)
            raise state["error"]
        return made

    def _not_joined(self, why: str, since: float) -> RankFailure:
        """The error of a communicator that NCCL did not make: the rank the heartbeats name (-1 where
        they name none) did not join it."""
        board = heartbeat.board()
        found = board.culprit(self._members, since) if board is not None else None
        me, what = self.global_rank(self.rank), self._what()
        if found is None:
            return RankFailure(f"zipccl: NCCL did not make the communicators of {what} on rank {me}: a rank did "
                               f"not join ({why}; no heartbeat names one); rebuild the group", -1, "lost", True)
        rank, evidence = found
        return RankFailure(f"zipccl: rank {rank} failed: it did not join the NCCL communicators of {what} "
                           f"[{evidence}]; rank {me} gave up ({why}); rebuild the group", rank, "lost", True)

    def _what(self) -> str:
        """What these communicators carry, in words."""
        return f"this group of {self.size} ranks"

    def _made_key(self, rank: int) -> str:
        """The store's key of ``rank``'s word on this making (``_made_word``)."""
        return self._key(f"made/{rank}")

    def _say_lost(self, failure: RankFailure) -> None:
        """Tell the ranks waiting in ``_agree`` that this one gave up (``failure``), so that they
        raise it too, at once, rather than wait for its word until the bound."""
        with contextlib.suppress(Exception):  # the store's host may be the rank that is gone
            store.own().set(self._made_key(self.rank), _made_word(lost=failure))

    def _agree(self, error: Exception | None) -> None:
        """Every rank learns whether every rank has a communicator, through the job's store (each
        rank's word waited for as for a mail): the same error everywhere if not; RankFailure where a
        rank gave up on one that never joined (``_say_lost``) or never says."""
        store.own().set(self._made_key(self.rank), _made_word(error))
        # one deadline for every word, later than any rank's own making gives up (its word then comes)
        since, deadline = time.time(), time.monotonic() + self._bound() + heartbeat.stale_after()
        words = [self._heard(f"made/{r}", since, deadline) for r in range(self.size)]
        try:
            texts = [_error_of(w) for w in words]
        except RankFailure:
            self._abort()
            raise
        failed = [r for r, t in enumerate(texts) if t]
        if failed:
            self._abort()
            first = texts[failed[0]]
            raise NcclError(f"zipccl: no NCCL communicator for this group of {self.size} ranks: rank(s) "
                            f"{[self.global_rank(r) for r in failed]} failed; rank {self.global_rank(failed[0])}: "
                            f"{first} ({nccl_stack.detect()})")

    def _abort(self) -> None:
        _abort_all(self._detach())

    def _detach(self) -> list:
        """This transport's communicators, taken off it (its next use raises NcclError); once: two
        threads that fail at once (an NcclPair's send lane and its completion's) abort them once.
        After the group call another thread has open on it, if that ends within GROUP_END_S: NCCL's
        open group lists the communicator, and an abort frees it under the group's end."""
        guard = self._guard()
        held = guard.acquire(timeout=GROUP_END_S)
        try:
            with _DETACH:
                comms, self.comm, self.mail_comm = [self.comm, self.mail_comm], None, None
        finally:
            if held:
                guard.release()
        return comms

    def _guard(self) -> threading.RLock:
        """Held by a thread from its group call's start to its end (``grouped``), and by an abort."""
        with _DETACH:
            guard = self.__dict__.get("_group_guard")
            if guard is None:
                guard = self._group_guard = threading.RLock()
        return guard

    def _fail(self, e: Exception) -> NcclError:
        abort_together((self, *self._fenced))  # with the levels its mails wait for (``fence``)
        return NcclError(f"NCCL failed on rank {self.global_rank(self.rank)}: {e}; the communicator is aborted")

    # ---- Transport --------------------------------------------------------------------------------------------

    def global_rank(self, rank: int) -> int:
        return self._ranks[rank]

    def members(self) -> list[int]:
        return list(self._members)  # an NcclPair's: its two ranks

    def _ready(self) -> int:
        """This transport's stream, after torch's current stream's work so far."""
        if self.comm is None:
            raise _aborted()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return self.stream.cuda_stream

    @contextlib.contextmanager
    def grouped(self):
        """NCCL's group call. On an aborted communicator an empty one, whose every operation raises
        NcclError: zipccl.failure counts those peers lost, and the call still ends in RankFailure
        on this rank (the status round included) rather than in this transport's error."""
        if self._open is not None:
            raise ZipcclError("NcclTransport.grouped() inside another group")
        with self._guard():  # an abort on another thread waits for the group's end (``_detach``)
            if self.comm is None:
                self._open = []
                try:
                    yield
                finally:
                    self._open = None
                return
            self._ready()
            self._open = []
            self.nccl.groupStart()
            try:
                yield
            finally:
                works, self._open = self._open, None
                failed, self._failed_in_group = self._failed_in_group, None
                _ENDS.begin(self)
                try:
                    self.nccl.groupEnd()  # after a failed post NCCL ends the group with its error, launching nothing
                except Exception as e:  # noqa: BLE001 - a peer lost as it connected, or the abort of a stuck end
                    failed = failed or e
                finally:
                    why = _ENDS.end(self)
                if failed is None and (why is not None or self.comm is None):  # aborted as its end waited
                    failed = TimeoutError(why or "the communicators were aborted while NCCL's group end waited")
                if failed is not None:  # a failed post raised to its caller, who counted that peer lost
                    self._fail(failed)
                    for w in works:  # never ran: their waits raise, as a lost peer's do (zipccl.failure)
                        w.broken = True
                else:
                    self._landed(works)

    def _landed(self, works: list) -> None:
        """After a group's end: each work's event, on its channel's stream; the mail channel's
        receives first copied to pinned host memory there, so that waiting for one reads no other
        stream."""
        events = {}
        received = [w for w in works if w.mail and w.host is not None]
        if received:
            with torch.cuda.stream(self.mail_stream):
                for w in received:
                    w.pinned = torch.empty(w.staged.shape, dtype=w.staged.dtype, pin_memory=True)
                    w.pinned.copy_(w.staged, non_blocking=True)
        for w in works:
            stream = self.mail_stream if w.mail else self.stream
            if stream not in events:
                events[stream] = torch.cuda.Event()
                events[stream].record(stream)
            w.event = events[stream]

    def _p2p(self, tensor: torch.Tensor, peer: int, send: bool) -> _Work:
        """A send or receive: a host tensor (a mail) on the mail channel, staged through pinned
        memory on its stream; a DeviceMail on the mail channel too, sent from the device once
        torch's current stream has made it; a device tensor on the bulk channel."""
        if self._open is None:
            raise ZipcclError("NcclTransport: sends and receives are issued inside grouped() (NCCL's group call)")
        if self.comm is None:
            raise _aborted()
        if self._failed_in_group is not None:
            raise NcclError("an earlier post of this NCCL group failed: the communicator is aborted at the end of "
                            "its group")
        on = (tensor.tensor if isinstance(tensor, DeviceMail) else tensor).device
        if on.type == "cuda" and on.index != self.device:
            raise UnsupportedError(f"NcclTransport: a tensor on {on}, but this group's communicators are on "
                                   f"cuda:{self.device}, the device that was current when they were made: call "
                                   "torch.cuda.set_device() on every rank before its first zipccl call")
        from_device = isinstance(tensor, DeviceMail)
        if from_device:
            tensor = tensor.tensor
            self.mail_stream.wait_stream(torch.cuda.current_stream(self.device))
        host, keep, mail = None, None, from_device or tensor.device.type == "cpu"
        comm, stream = (self.mail_comm, self.mail_stream) if mail else (self.comm, self.stream)
        if mail and not from_device:
            with torch.cuda.stream(stream):
                host, staged = tensor, torch.empty(tensor.shape, dtype=tensor.dtype, device=f"cuda:{self.device}")
                if send:  # the host's values, final now: no other stream is waited for
                    keep = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)
                    staged.copy_(keep, non_blocking=True)
                tensor = staged
        if host is None and tensor.is_cuda:  # the caller's memory: not handed out again before NCCL's use of
            tensor.record_stream(stream)  # it ends, even where the caller drops it with a handle never waited for
        flat, peer = tensor.view(-1).view(torch.uint8), self._comm_rank(peer)
        name, _ = nccl_stack.DTYPES[torch.uint8]
        try:
            if send:
                comm.send(flat.data_ptr(), flat.numel(), getattr(self.nccl, name), peer, stream.cuda_stream)
            else:
                comm.recv(flat.data_ptr(), flat.numel(), getattr(self.nccl, name), peer, stream.cuda_stream)
        except Exception as e:  # noqa: BLE001
            # Aborted at the group's end (``grouped``), not now: NCCL's open group is this thread's
            # and lists the communicator, which an abort on another thread (``_abort_all``) would
            # free under it; the group's end then returns this error without launching anything.
            self._failed_in_group = e
            raise NcclError(f"NCCL failed on rank {self.global_rank(self.rank)}: {e}; the communicator is aborted "
                            "at the end of its group") from e
        work = _Work((tensor, keep), None if send else host, None if send else tensor, mail=mail)
        self._open.append(work)
        return work

    def isend(self, send, dst, tag=0):
        return self._p2p(send, dst, True)

    def read_back(self, values, host):
        """``values`` copied to pinned memory on the mail stream, after torch's current stream's
        work (inside a group: it completes at the group's mail event, so that waiting for the
        group's mails and for this is one host wait), then into ``host`` when waited for."""
        if self._open is None:
            return super().read_back(values, host)
        self.mail_stream.wait_stream(torch.cuda.current_stream(self.device))
        work = _Work(values, host, values, mail=True)
        self._open.append(work)
        return work

    def irecv(self, recv, src, tag=0):
        return self._p2p(recv, src, False)

    def wait(self, work, timeout: float | None = None) -> None:
        """Device tensors: torch's current stream waits for the operation, the host does not. A
        peer that died leaves a receive pending for ever; the call's status round finds it, since
        its mails go after every device operation of the call (``fence``), and the abort that
        follows ends the pending kernels, so that no later host read hangs. Host tensors (mails):
        the host waits for the mail stream alone, then copies from pinned memory. A host wait
        takes at most ZIPCCL_TIMEOUT seconds (unset: config.DEFAULT_TIMEOUT; or ``timeout`` where
        that is shorter), checking NCCL's async errors (both communicators') and, once it has
        lasted ``heartbeat.stale_after()``, the group's heartbeats; a timeout, an error or a
        silent rank aborts the communicator (ncclCommAbort), and the error of a timeout says so
        (``timed_out``, as for TorchTransport)."""
        if work.broken or self.comm is None:  # aborted since: its event passes as the abort ends the kernels,
            raise _aborted()  # whether or not the data came (a mail would copy stale staging memory)
        if work.event is None:
            raise ZipcclError("NcclTransport: an operation waited for inside its group, before NCCL issued it")
        if not work.mail:
            torch.cuda.current_stream(self.device).wait_event(work.event)
            return
        self._host_wait(work, wait_limit(timeout))
        if work.host is not None:
            work.host.copy_(work.pinned)

    def _host_wait(self, work, limit: float) -> None:
        why = self._until(work.event.query, limit, self._check)
        if why is not None:
            self._give_up(why)

    def _check(self) -> None:
        """Raise where the communicators were aborted or NCCL reports an error of its own. Asked
        under _DETACH, under which an abort takes the communicators off (``_detach``): NCCL is never
        asked about a communicator that another thread is aborting, which frees it."""
        error = None
        with _DETACH:
            if self.comm is None:  # aborted by another wait of the call
                error = _aborted()
            else:
                try:
                    self.comm.check_async_error()
                    self.mail_comm.check_async_error()
                except Exception as e:  # noqa: BLE001
                    error = e
        if isinstance(error, NcclError):
            raise error
        if error is not None:
            raise self._fail(error) from error

    def _until(self, done, limit: float, check=None, nap: float = 1e-4) -> str | None:
        """Poll ``done()`` (back to back for the first SPIN_S, a mail that is about to come; then
        every ``nap`` seconds, or back to back where ``done`` waits itself; ``check()`` each time,
        which may raise) for at most ``limit`` seconds: None once it is done, else why this rank
        gives up: the time ran out, or the heartbeats say a rank is silent (``watch``)."""
        start = time.monotonic()
        deadline, watch = start + limit, self._watch(check)
        while not done():
            why = watch()
            now = time.monotonic()
            if now > deadline:
                return f"no progress within {limit:g} s (ZIPCCL_TIMEOUT={config.TIMEOUT}, " \
                       f"default {config.DEFAULT_TIMEOUT:g} s)"
            if why is not None:
                return why
            if nap and now - start > SPIN_S:
                time.sleep(nap)
        return None

    def watch(self):
        """(Transport.watch) NCCL's errors (``_check``) and the group's heartbeats."""
        return self._watch(self._check)

    def _watch(self, check=None):
        """For a wait on this group's ranks that starts now, a function to call at each poll:
        ``check()`` (which may raise), then, once the wait has lasted ``heartbeat.stale_after()``,
        every ``heartbeat.period()`` a look at the heartbeats of the ranks waited for
        (``_members``): why this rank gives up where some are silent, else None."""
        look = time.monotonic() + heartbeat.stale_after()

        def watch() -> str | None:
            nonlocal look
            if check is not None:
                check()
            now = time.monotonic()
            if now <= look:
                return None
            look = now + heartbeat.period()
            return _silent(self._members)
        return watch

    def _give_up(self, why: str):
        """Abort and raise: this rank gave up waiting (``timed_out``); the peer waited on may live."""
        error = self._fail(TimeoutError(why))
        error.timed_out = True
        raise error

    def fence(self, *others) -> None:
        """The mail stream waits for the bulk stream's operations so far, and for those of the
        ``others`` that have streams (a hierarchical call's levels): the status round's mails leave
        after the call's packets (a peer that has this rank's status has its packets). A mail that
        never comes then aborts those levels with this transport (``_fail``): a level's kernel
        pending on a dead peer would hold this one's abort for good."""
        self._fenced = tuple(other for other in others if other is not self)
        if self.comm is not None:
            self.mail_stream.wait_stream(self.stream)
            for other in others:
                stream = getattr(other, "stream", None)
                if other is not self and stream is not None:
                    self.mail_stream.wait_stream(stream)

    def unfence(self) -> None:
        self._fenced = ()

    def abort(self) -> None:
        """End the communicators (ncclCommAbort): after a failure that broke the group, no operation
        of the call stays pending on the device."""
        self._abort()

    def all_to_all(self, send, send_splits, recv_splits):
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=send.device)
        so = ro = 0
        with self.grouped():
            works = []
            for j in range(self.size):
                if send_splits[j]:
                    works.append(self.isend(send[so:so + send_splits[j]], j))
                if recv_splits[j]:
                    works.append(self.irecv(recv[ro:ro + recv_splits[j]], j))
                so, ro = so + send_splits[j], ro + recv_splits[j]
        for w in works:
            self.wait(w)
        return recv

    def native(self, name, *tensors, op=None):
        """The group's own collective (TorchTransport.native), never one on these communicators."""
        TorchTransport.of(self.group).native(name, *tensors, op=op)
