"""Transport over any torch.distributed ProcessGroup (gloo in tests, nccl on GPUs)."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import threading
import time

import torch
import torch.distributed as dist

from torch._C._distributed_c10d import AllgatherOptions
from torch.overrides import has_torch_function

from .. import config, lifetime
from ..torch_compat import all_gather_single, reduce_scatter_single
from . import heartbeat
from .base import DeviceMail, Transport, wait_limit
from .strict import Strict


#: The group's own methods that torch.distributed's functions call: torch 2.13's names, else
#: the older ones (torch 2.11, the CUDA image's).
_NEW_NAMES = hasattr(dist.ProcessGroup, "all_gather_single")
ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL = ("all_gather_single", "reduce_scatter_single", "all_to_all_single") \
    if _NEW_NAMES else ("_allgather_base", "_reduce_scatter_base", "alltoall_base")
_ASYNC_FIELD = hasattr(dist.AllreduceOptions(), "asyncOp")  # torch >= 2.8: a blocking call says so (NCCL
# then runs it on the current stream, as torch's own blocking call)


def options(kind, async_op: bool, op=None):
    """``kind`` (torch's options class) as torch.distributed's functions fill it."""
    opts = kind()
    if op is not None:
        opts.reduceOp = op
    if _ASYNC_FIELD:
        opts.asyncOp = async_op
    return opts


def _all_reduce(pg, tensors, op, async_op):
    return pg.allreduce([tensors[0]], options(dist.AllreduceOptions, async_op, dist.ReduceOp.SUM if op is None else op))


def _reduce_scatter(pg, tensors, op, async_op):
    return getattr(pg, REDUCE_SCATTER)(tensors[0], tensors[1], options(
        dist.ReduceScatterOptions, async_op, dist.ReduceOp.SUM if op is None else op))


def _all_gather(pg, tensors, op, async_op):
    return getattr(pg, ALL_GATHER)(tensors[0], tensors[1], options(AllgatherOptions, async_op))


def group_collective(name: str, group, *tensors, op=None, async_op: bool = True):
    """torch.distributed's all_reduce (tensors: the tensor), all_gather_single or
    reduce_scatter_single (output, input) on ``group``; on a group of the drop-in backend, the
    backend underneath's own call: torch.distributed's functions on that group would come back
    into zipccl, and inside torch's coalescing manager on it (``_coalescing_manager``, whose
    state is the group's, not the caller's) they only queue the call and return None, so that
    it never runs. Its Work (None where blocking: done)."""
    inner = underneath(group, tensors[0].device)
    if inner is not None:
        if name == "all_reduce":
            work = inner.allreduce([tensors[0]], options(dist.AllreduceOptions, True,
                                                         dist.ReduceOp.SUM if op is None else op))
        elif name == "reduce_scatter":
            work = inner._reduce_scatter_base(tensors[0], tensors[1], options(
                dist.ReduceScatterOptions, True, dist.ReduceOp.SUM if op is None else op))
        else:
            work = inner._allgather_base(tensors[0], tensors[1], options(AllgatherOptions, True))
        if async_op:
            return work
        work.wait()
        return None
    if name == "all_reduce":
        return dist.all_reduce(tensors[0], op=dist.ReduceOp.SUM if op is None else op, group=group,
                               async_op=async_op)
    if name == "reduce_scatter":
        return reduce_scatter_single(tensors[0], tensors[1], op=dist.ReduceOp.SUM if op is None else op, group=group,
                                     async_op=async_op)
    if name == "all_gather":
        return all_gather_single(tensors[0], tensors[1], group=group, async_op=async_op)
    raise ValueError(f"unknown collective {name!r}")


#: ``TorchTransport.native``'s calls on the group itself, as torch.distributed's Python functions
#: make them after their checks: 4-8 us less host time a call than through those functions (one
#: gloo rank, thread CPU time; docs/PERFORMANCE.md).
_DIRECT = {"all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter, "all_gather": _all_gather}


def direct_group(group):
    """The ProcessGroup that a call on ``group`` (None: the default) can be made on directly:
    torch's own class (a Python subclass may override what torch.distributed calls), else None."""
    pg = group if group is not None else dist.GroupMember.WORLD
    return pg if type(pg) is dist.ProcessGroup else None


def as_they_are(tensors) -> bool:
    """Whether torch.distributed's call would hand ``tensors`` to the group unchanged: plain
    tensors (not a subclass nor under a mode with its own dispatch, not complex, which it views
    as real), outside a coalescing manager (which collects calls instead of issuing them)."""
    for t in tensors:
        if type(t) is not torch.Tensor or t.is_complex():
            return False
    return not has_torch_function(tensors) and not getattr(dist.distributed_c10d._world, "pg_coalesce_state", None)


#: zipccl's own messages travel on tags from here up (its tags, 0-13, plus this): gloo matches a
#: send with a receive by peer and tag alone, so on the tags the user's own sends and receives
#: take (0 and up) the two would cross. torch's own collectives have a slot space of their own.
WIRE_TAGS = 0x7A1C0000

_twins: dict = lifetime.keep({}, on_drop=lifetime.destroy)  # a group destroyed alone takes its twin
_twins_lock = threading.Lock()


def _wire(backend: str) -> str:
    """The torch backend that carries the messages of a group of ``backend``: the drop-in backend
    (zipccl.backend) hands the CPU tensors of its pass-through calls, which are all this transport
    sends on it, to gloo; so its groups get gloo's treatment here (the second lane, early
    receives): without them the drop-in's lossless DDP steps took 10-12% longer than zipccl's hook
    in the 1 Gbit/s lab."""
    return "gloo" if backend == "zipccl" else backend


def wire_device(backend: str) -> torch.device:
    """The device of the tensors that a group of torch backend ``backend`` carries: the current
    GPU on nccl (which moves device memory only), the CPU on every other (gloo; the drop-in
    "zipccl", whose CUDA tensors zipccl's NCCL transport carries: zipccl.transport.select)."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _own_timeout(group, device: torch.device) -> float | None:
    """The group's own timeout in seconds (init_process_group's or new_group's ``timeout``), or
    None where its backend does not say (the drop-in's)."""
    try:
        pg = group if group is not None else dist.GroupMember.WORLD
        return pg._get_backend(device).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - a backend without options
        return None


def timeout_of(group) -> dict:
    """``new_group``'s keyword for a group made for ``group`` (its levels, its twin): the group's
    own timeout, which torch's new_group does not inherit (it takes its backend's default, 30
    minutes), so that a wait there is bounded as on ``group`` itself; none where ``group``'s
    backend does not say (the drop-in's)."""
    seconds = _own_timeout(group, wire_device(dist.get_backend(group)))
    return {} if seconds is None else {"timeout": datetime.timedelta(seconds=seconds)}


def underneath(group, device: torch.device):
    """For a group of zipccl's drop-in backend ("zipccl"), the backend under it for tensors on
    ``device`` (gloo, NCCL), whose calls never come back into zipccl; None for any other group
    (whose torch.distributed calls are the backend's own). zipccl.alltoall and zipccl.p2p run
    their native plans there."""
    pg = group if group is not None else dist.group.WORLD
    return pg._get_backend(device) if dist.get_backend(group) == "zipccl" else None


class _Batched:
    """A send or receive of a group (TorchTransport._batched) until the group ends and issues it:
    then its work."""
    __slots__ = ("work",)

    def __init__(self):
        self.work = None


class _Staged:
    """A receive into ``wire`` (on the group's device) for ``host``, a tensor elsewhere (a CPU
    size or status on an NCCL group), which ``TorchTransport.wait`` fills once it has come."""
    __slots__ = ("work", "host", "wire")

    def __init__(self, work, host: torch.Tensor, wire: torch.Tensor):
        self.work, self.host, self.wire = work, host, wire


def _twin(group):
    """For a group whose messages gloo carries (``_wire``) that spans the whole job: a second
    gloo group over the same ranks that carries the payloads sent to higher ranks, so that each
    connection carries payloads one way only (config.SPLIT_DIRECTIONS says why). None where that
    does not apply. Made on first use, which is a collective call on ``group``, so every rank
    makes it at the same point; creating a group needs every rank of the job, hence the whole-job
    condition."""
    if not config.SPLIT_DIRECTIONS or dist.get_world_size(group) != dist.get_world_size():
        return None
    key = group if group is not None else dist.GroupMember.WORLD
    with _twins_lock:
        if key not in _twins:
            ranks = dist.get_process_group_ranks(key)
            twin = heartbeat.bounded(lambda: dist.new_group(ranks, backend="gloo", **timeout_of(key)), ranks,
                                     "making the group's second gloo group, at its first call")
            _twins[key] = twin if dist.get_process_group_ranks(twin) == ranks else None  # same rank order
        return _twins[key]


_transports: dict = lifetime.keep({})
atexit.register(_transports.clear)  # before the interpreter's teardown (see zipccl.topology)
atexit.register(_twins.clear)


class TorchTransport(Transport):
    """Collectives of ``torch.distributed`` on ``group`` (None: the default group). On gloo it
    declares ``loose_receives`` and ``tags`` (gloo matches by tag and takes a message shorter
    than its receive), except in strict mode (ZIPCCL_STRICT_TRANSPORT=1, zipccl.transport.strict),
    where it keeps NCCL's rules and checks that every call does. On torch's own nccl backend it
    declares neither. A message on another device than the group's (``meta_device``:
    ``wire_device``), such as the pipeline's CPU sizes and statuses on an nccl group, is staged
    onto it: sent from a copy, received into one and copied back when waited for, so that no
    CPU tensor is ever sent on an NCCL group."""

    @classmethod
    def of(cls, group=None, messages: bool = False) -> "TorchTransport":
        """The transport of ``group``, made once (its look-ups cost 25 us a call, a third of what
        zipccl adds to a small call that goes to the backend). ``messages``: the one of
        point-to-point messages (zipccl.p2p), which two ranks of the group use alone, so it has
        no second gloo group (``_twin``), whose making takes every rank of the job."""
        key = group if group is not None else dist.GroupMember.WORLD
        if messages:
            key = (key, "messages")
        t = _transports.get(key)
        if t is None:
            lifetime.sweep()
            t = _transports.setdefault(key, cls(group, twin=not messages))
        return t

    def __init__(self, group: dist.ProcessGroup | None = None, twin: bool = True):
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialised: call zipccl.launch.init() or "
                             "torch.distributed.init_process_group() first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self.backend = dist.get_backend(group)
        self.meta_device = wire_device(self.backend)
        gloo = _wire(self.backend) == "gloo"
        self._upward = _twin(group) if twin and gloo and self.size > 1 else None
        # strict mode's one tag: the messages transport's is another, as its own communicator would be
        # (zipccl.p2p posts its sends on lanes, apart from the collectives issued after them)
        self._wire_tag = 0 if twin else 1
        self._ranks = dist.get_process_group_ranks(group if group is not None else dist.GroupMember.WORLD)
        self.strict = Strict(self.rank, self.meta_device) if config.STRICT_TRANSPORT else None
        self.own_timeout = _own_timeout(group, self.meta_device)
        self.loose_receives = self.tags = gloo and self.strict is None
        self._pg = direct_group(group)  # native's direct calls
        self.batches = self.backend == "nccl"  # grouped() issues its operations together (_batched)
        self._drop_in = self.backend == "zipccl"  # its messages go to the backend under it (_issue)
        self._local = threading.local()  # this thread's open batch: the async calls' thread has its own

    def grouped(self):
        if self.strict is not None:
            return self.strict.grouped()
        return self._batched() if self.batches else super().grouped()

    @contextlib.contextmanager
    def _batched(self):
        """The group's sends and receives collected, then issued at its end as one NCCL group
        (batch_isend_irecv). torch's NCCL runs a lone send or receive on the stream of its pair of
        ranks, in issue order: a rank's receive from a peer would wait behind its own send to that
        peer, which waits for the peer's receive, behind the peer's own send, so two ranks sending
        each other more than NCCL buffers would block each other for good."""
        if getattr(self._local, "batch", None) is not None:
            raise RuntimeError("TorchTransport.grouped() inside another group")
        batch = self._local.batch = []
        try:
            yield
        finally:
            self._local.batch = None
        if batch:
            works = dist.batch_isend_irecv([op for op, _ in batch])
            for i, (_, pending) in enumerate(batch):  # NCCL's coalesced group gives one work for all
                pending.work = works[0] if len(works) == 1 else works[i]

    def _issue(self, send: bool, tensor, peer: int, group, tag: int):
        """A send (``send``) or receive of ``tensor`` now, or into this thread's open batch."""
        batch, tag = getattr(self._local, "batch", None), WIRE_TAGS + tag
        if batch is None:
            if self._drop_in and group is self.group:  # the backend under it, not zipccl again (the twin is gloo's)
                inner = underneath(group, tensor.device)
                return inner.send([tensor], peer, tag) if send else inner.recv([tensor], peer, tag)
            if send:
                return dist.isend(tensor, group=group, group_dst=peer, tag=tag)
            return dist.irecv(tensor, group=group, group_src=peer, tag=tag)
        pending = _Batched()
        c10d = dist.distributed_c10d  # P2POp takes torch's own functions only
        batch.append((dist.P2POp(c10d.isend if send else c10d.irecv, tensor, group=group, tag=tag, group_peer=peer),
                      pending))
        return pending

    def global_rank(self, rank: int) -> int:
        return self._ranks[rank]

    def wait(self, work, timeout: float | None = None) -> None:
        """Wait for ``work`` at most ZIPCCL_TIMEOUT seconds (unset: config.DEFAULT_TIMEOUT, or the
        group's timeout where that is shorter; on torch's NCCL the current stream waits, bounded by
        torch's watchdog), or ``timeout`` where that is shorter; a timeout raises and closes the connection (gloo:
        every connection of the group on this rank), so the peer fails promptly too. The error
        of a wait that ran out says so (``timed_out``, as zipccl.failure reads it): this rank
        gave up, the peer may live."""
        staged = work if isinstance(work, _Staged) else None
        if staged is not None:
            work = staged.work
        if isinstance(work, _Batched):
            if work.work is None:
                raise RuntimeError("TorchTransport: a send or receive waited for inside its group, before it was issued")
            work = work.work
        if self.strict is not None:
            self.strict.wait(work, lambda w: self._wait(w, timeout))
        else:
            self._wait(work, timeout)
        if staged is not None:
            staged.host.copy_(staged.wire)

    def _wait(self, work, timeout: float | None) -> None:
        t0, limit = time.monotonic(), wait_limit(timeout)
        if config.TIMEOUT is None and self.own_timeout:  # a wait's timeout replaces the group's: keep the shorter
            limit = min(limit, self.own_timeout)
        try:
            if self.backend == "nccl" and config.TIMEOUT is None and timeout is None:
                work.wait()  # torch's NCCL: the current stream waits, the host does not; its watchdog bounds it
            else:
                work.wait(datetime.timedelta(seconds=limit))
        except RuntimeError as e:
            text = str(e).lower()
            if "timed out" in text or "timeout" in text or (limit is not None and time.monotonic() - t0 >= limit):
                e.timed_out = True
            raise

    def barrier(self) -> None:
        self.wait(dist.barrier(group=self.group, async_op=True))

    def _lane(self, src: int, dst: int):
        """The group that carries payloads from group rank ``src`` to ``dst``."""
        return self._upward if self._upward is not None and src < dst else self.group

    def all_to_all(self, send, send_splits, recv_splits):
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=send.device)
        if sum(send_splits) or sum(recv_splits):
            self.wait(dist.all_to_all_single(recv, send, output_split_sizes=list(recv_splits),
                                             input_split_sizes=list(send_splits), group=self.group, async_op=True))
        return recv

    def isend(self, send, dst, tag=0):
        if isinstance(send, DeviceMail):
            send = send.tensor
        send = send if send.device == self.meta_device else send.to(self.meta_device)
        if self.strict is not None:  # one tag on the wire: matched in issue order, as NCCL does
            return self.strict.send(lambda x, peer: self._isend(x, peer, self._wire_tag), send, dst, tag)
        return self._isend(send, dst, tag)

    def _isend(self, send, dst, tag):
        return self._issue(True, send, dst, self._lane(self.rank, dst), tag)

    def irecv(self, recv, src, tag=0):
        wire = recv if recv.device == self.meta_device else torch.empty_like(recv, device=self.meta_device)
        if self.strict is not None:
            work = self.strict.recv(lambda x, peer: self._irecv(x, peer, self._wire_tag), wire, src, tag)
        else:
            work = self._irecv(wire, src, tag)
        return work if wire is recv else _Staged(work, recv, wire)

    def _irecv(self, recv, src, tag):
        return self._issue(False, recv, src, self._lane(src, self.rank), tag)

    def native(self, name, *tensors, op=None):
        avg = self.backend == "gloo" and op == dist.ReduceOp.AVG  # (a ReduceOp's == costs a microsecond)
        if avg:  # gloo has no AVG: its SUM, then one division (rounded once more)
            op = dist.ReduceOp.SUM
        direct = _DIRECT.get(name) if self._pg is not None else None
        if direct is not None and as_they_are(tensors):
            work = direct(self._pg, tensors, op, config.TIMEOUT is not None)
            if config.TIMEOUT is None:  # as torch.distributed's own blocking call
                if work is not None:
                    work.wait()
                work = None
        else:
            work = group_collective(name, self.group, *tensors, op=op, async_op=config.TIMEOUT is not None)
        if work is not None:
            self.wait(work)
        if avg:
            tensors[0].div_(self.size)
