"""Each rank's heartbeat in the job's store: the evidence that names a dead or hung rank.

A survivor's own view cannot: on NCCL all operations of a group complete together (one event),
so a wait that runs out says only that *some* peer of the group is missing, and on gloo a rank
that gave up on a hung peer closes all its connections, so that its own peers see *it* go. So
every process that makes a zipccl call beats: a daemon thread ("zipccl-heartbeat"), started by
its first call after ``init_process_group``, writes every ``period()`` seconds its wall-clock
time and its count of zipccl calls per group under ``zipccl/heartbeat/<job rank>`` in the
default group's store, through a connection of its own (a clone of the store whose operations
give up after ``STORE_TIMEOUT`` s: a store that stops answering never blocks a caller). Reading
the group's beats (``Board.culprit``) names, in this order:

1. a rank *silent* for longer than ``stale_after()``: killed, stopped (SIGSTOP), its host gone;
2. a rank alive but *behind*: its beat, written at least ``stale_after()`` after this rank
   entered the call, counts fewer calls on the group than this rank has entered (it never
   reached the call: stuck elsewhere). A rank a moment behind, still ending the call before
   (losing a rank there too), is not stuck: a closed connection names its peer then.

Where neither holds (every rank beats and has reached the call), or the store cannot be read,
there is no evidence and the caller names what its transport saw. Wall-clock times are compared
across hosts, as torch's elastic rendezvous compares its keep-alives: the hosts' clocks must
agree to well within ``stale_after()`` (NTP does). Nothing here runs on a call's path but a
counter's increment (``Board.entered``); the store is read only once a call has failed.
"""

from __future__ import annotations

import atexit
import datetime
import json
import threading
import time
import weakref

import torch
import torch.distributed as dist

from .. import config, executor
from ..errors import RankFailure, ZipcclError

__all__ = ["Board", "board", "bounded", "entered", "own_connection", "period", "stale_after", "start"]

KEY = "zipccl/heartbeat/{}"
#: Where a rank writes down the rank it lost (``Board.report``).
LOST_KEY = "zipccl/lost/{}"

#: Seconds at most between two looks of the beating thread at its period.
WAKE = 0.5

#: Seconds a store operation of the heartbeat may take (the store's host may be the dead rank).
STORE_TIMEOUT = 2.0


def stale_after() -> float:
    """Seconds without a beat after which a rank counts as silent: half of a wait's bound
    (ZIPCCL_TIMEOUT or DEFAULT_TIMEOUT), at least 1 s and at most 10 s, so that a rank silent
    for a whole timeout is always named, and a live one, beating every ``period()``, never is."""
    return min(10.0, max(1.0, config.wait_bound() / 2))


def period() -> float:
    """Seconds between two beats: a fifth of ``stale_after()``."""
    return stale_after() / 5


def _group_key(ranks) -> str:
    return ",".join(map(str, ranks))


class Board:
    """The heartbeats of one job as this process sees them: its own, written by ``start_beating``'s
    thread, and every rank's, read on demand. ``world``: the default process group it belongs
    to (the thread stops once that is destroyed); ``store``: the job's store; ``clock``: wall time."""

    def __init__(self, world, store, rank: int, clock=time.time):
        self.world, self.rank, self.clock = world, rank, clock
        self.writer, self.reader = own_connection(store, STORE_TIMEOUT), own_connection(store, STORE_TIMEOUT)
        self.began = clock()
        self.calls: dict[str, int] = {}  # group key -> zipccl calls entered here
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    # ---- this process ----------------------------------------------------------------------------------------------

    def entered(self, ranks) -> None:
        """A zipccl call on the group of job ranks ``ranks`` begins here."""
        key = _group_key(ranks)
        self.calls[key] = self.calls.get(key, 0) + 1

    def beat(self) -> None:
        """Write this process's beat once. A store that does not answer in time is tried again at
        the next beat; one whose connection is gone (its host exited: the job is ending, or its
        rank died) ends the beating, which has no reader left."""
        value = json.dumps({"t": self.clock(), "calls": dict(self.calls)})
        try:
            self.writer.set(KEY.format(self.rank), value)
        except dist.DistNetworkError:
            self.stop.set()
        except Exception:  # noqa: BLE001 - a store that times out
            pass

    def report(self, lost: int) -> None:
        """Write down that this process lost rank ``lost``, before it raises: a survivor whose
        connection to this rank closes next (this rank ending after its failure) reads it there
        (``reported``) and names ``lost``, not this rank."""
        try:
            self.writer.set(LOST_KEY.format(self.rank), json.dumps({"rank": lost, "t": self.clock()}))
        except Exception:  # noqa: BLE001 - a store that does not answer: no report, as before
            pass

    def reported(self, rank: int, since: float) -> int | None:
        """The rank that ``rank`` reported lost after the wall time ``since``, or None."""
        key = LOST_KEY.format(rank)
        try:
            if not self.reader.check([key]):
                return None
            found = json.loads(bytes(self.reader.get(key)))
        except Exception:  # noqa: BLE001 - the store's host is gone or does not answer
            return None
        return found["rank"] if found["t"] > since and found["rank"] != self.rank else None

    def start_beating(self) -> None:
        self.beat()  # at once: a peer that fails in this first call finds this rank's beat
        self.thread = threading.Thread(target=self._run, name="zipccl-heartbeat", daemon=True)
        self.thread.start()
        _threads.add(self.thread)

    def _run(self) -> None:
        """Beat every ``period()``, read anew at least every ``WAKE`` s: where the bound shrinks
        (ZIPCCL_TIMEOUT set after the first call), the next beat does not wait out the old period
        while peers already read this rank by the new one."""
        last = time.monotonic()
        while not self.stop.wait(min(WAKE, period())):
            if dist.GroupMember.WORLD is not self.world:  # destroyed, or another init since
                return
            if time.monotonic() - last >= 0.9 * period():  # a wait may end a little early
                self.beat()
                last = time.monotonic()

    # ---- the group's ranks -----------------------------------------------------------------------------------------

    def read(self, ranks) -> dict | None:
        """{job rank: its last beat ({"t": wall time, "calls": {group: count}}), or None where it
        has not beaten yet}; None where the store cannot be read."""
        keys = [KEY.format(r) for r in ranks]
        try:
            present = [self.reader.check([k]) for k in keys]
            values = self.reader.multi_get([k for k, p in zip(keys, present) if p]) if any(present) else []
        except Exception:  # noqa: BLE001 - the store's host is gone or does not answer
            return None
        found = iter(json.loads(bytes(v)) for v in values)
        return {r: next(found) if p else None for r, p in zip(ranks, present)}

    def silent(self, ranks, beats: dict | None = None) -> dict[int, float]:
        """{rank: seconds since its last beat} for each other rank of ``ranks`` silent longer than
        ``stale_after()`` (one that never beat counts from when this process began beating)."""
        beats = self.read(ranks) if beats is None else beats
        if beats is None:
            return {}
        now, limit = self.clock(), stale_after()
        ages = {r: now - (b["t"] if b is not None else self.began) for r, b in beats.items() if r != self.rank}
        return {r: age for r, age in ages.items() if age > limit}

    def culprit(self, ranks, since: float, patience: float = 0.0) -> tuple[int, str] | None:
        """(the rank of ``ranks`` that the beats name, the evidence in words), or None: the one
        silent longest, waiting up to ``patience`` seconds for one to fall silent; else one behind
        (fewer calls on this group than here, in a beat written ``stale_after()`` or more after
        ``since``, the wall time this rank entered the failing call)."""
        deadline = time.monotonic() + patience
        while True:
            beats = self.read(ranks)
            if beats is None:
                return None
            silent = self.silent(ranks, beats)
            if silent:
                rank = max(silent, key=lambda r: (silent[r], -r))
                if beats.get(rank) is None:  # its first zipccl call has not come
                    return rank, (f"it has written no heartbeat to the job's store (it has made no zipccl call) "
                                  f"in the {silent[rank]:.1f} s since this rank's first")
                return rank, f"its heartbeat in the job's store stopped {silent[rank]:.1f} s ago"
            if time.monotonic() >= deadline:
                break
            time.sleep(min(period() / 2, max(0.0, deadline - time.monotonic())))
        key, mine = _group_key(ranks), self.calls.get(_group_key(ranks), 0)
        behind = [(b["calls"].get(key, 0), r) for r, b in beats.items()
                  if r != self.rank and b is not None and b["t"] > since + stale_after() and b["calls"].get(key, 0) < mine]
        if behind:
            calls, rank = min(behind)
            return rank, f"it is alive but has not reached this call ({calls} calls on the group there, {mine} here)"
        return None


def own_connection(store, seconds: float):
    """A connection of its own to ``store`` whose operations give up after ``seconds``
    (TCPStore.clone): one that waits does not hold the job's; or the store itself where it
    cannot be cloned (an in-process store)."""
    try:
        own = store.clone()
        own.set_timeout(datetime.timedelta(seconds=seconds))
        return own
    except Exception:  # noqa: BLE001 - a store without clone()
        return store


_board: Board | None = None
_lock = threading.Lock()
_threads: weakref.WeakSet = weakref.WeakSet()  # every board's thread (joined at exit)


@atexit.register
def _end() -> None:
    """No beat while the interpreter shuts down (the store's host may be gone already), and none
    under way: a daemon thread that comes back from the store's C++ call to a finalizing
    interpreter is ended by an exception that aborts the process ("terminate called without an
    active exception"), so the beat in flight is waited for, a bounded time."""
    if _board is not None:
        _board.stop.set()
    deadline = time.monotonic() + STORE_TIMEOUT + 1.0
    for thread in _threads:  # a board replaced by a later group's may still be writing its last beat
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # transport -> the job ranks of its group


def board() -> Board | None:
    """This process's board, where it beats for the current default group."""
    b = _board
    return b if b is not None and b.world is dist.GroupMember.WORLD and b.world is not None else None


def start() -> Board | None:
    """Begin beating for the current default group, once (a call's cost after that: one
    comparison); None where torch.distributed is not initialised or has no store."""
    global _board
    b = _board
    world = dist.GroupMember.WORLD
    if b is not None and b.world is world:
        return b
    if world is None or not dist.is_initialized():
        return None
    with _lock:
        if _board is None or _board.world is not world:
            if _board is not None:
                _board.stop.set()
            try:
                _board = Board(world, dist.distributed_c10d._get_default_store(), dist.get_rank())
            except Exception:  # noqa: BLE001 - a group without a store: no evidence, as before
                _board = None
                return None
            _board.start_beating()
        return _board


def members(t) -> list[int]:
    """The job ranks of transport ``t`` whose heartbeats speak for its failures (Transport.members;
    every rank of its group where it does not say)."""
    own = getattr(t, "members", None)
    return own() if own is not None else [t.global_rank(r) for r in range(t.size)]


def entered(t, ranks=None) -> None:
    """A zipccl call on transport ``t``'s group (``ranks``: of those job ranks alone, as a
    message between two) begins on this rank (starts the heartbeat)."""
    b = start()
    if b is None:
        return
    if ranks is not None:
        b.entered(tuple(ranks))
        return
    try:
        ranks = _keys.get(t)
    except TypeError:  # a transport that takes no weak reference
        ranks = None
    if ranks is None:
        ranks = tuple(members(t))
        try:
            _keys[t] = ranks
        except TypeError:
            pass
    b.entered(ranks)


def bounded(fn, ranks, what: str):
    """``fn()``, a set-up step that every rank of ``ranks`` (job ranks) must join (making a
    group, the nodes' claims), waited for at most config.wait_bound() on a thread of its own:
    it runs before any of the call's bounded waits, and a rank lost before it would keep it
    waiting for the backend's own timeout, naming no one. Past the bound, RankFailure names the
    rank the heartbeats name (the step's thread is left behind: the group must be rebuilt)."""
    b = start()
    since, box = time.time(), {}
    # a thread's CUDA device and stream are its own: the step's (an nccl group's all-gather) are the caller's
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    stream = torch.cuda.current_stream(device) if device is not None else None

    def run() -> None:
        try:
            if device is None:
                box["value"] = fn()
            else:
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            box["error"] = e

    thread = threading.Thread(target=executor.acting_for_this_thread(run), daemon=True,
                              name=f"zipccl-setup<-{threading.current_thread().name}")
    thread.start()
    thread.join(config.wait_bound())
    error = box.get("error")
    if thread.is_alive() or (isinstance(error, RuntimeError) and not isinstance(error, ZipcclError)):
        # out of time, or the backend's error (a connection closed by a lost peer): the rank the beats name
        found = b.culprit(ranks, since, stale_after() + period()) if b is not None else None
        rank, evidence = found if found is not None else (-1, "no heartbeat names a rank")
        what_happened = f"did not join within {config.wait_bound():g} s" if error is None else "was lost"
        raise RankFailure(f"zipccl: {what}: {f'rank {rank}' if rank >= 0 else 'a rank'} {what_happened} "
                          f"[{evidence}]; the process group must be rebuilt", rank=rank, kind="lost",
                          broken=True) from error
    if error is not None:
        raise error
    return box.get("value")
