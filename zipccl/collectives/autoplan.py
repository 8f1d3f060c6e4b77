"""Codec "auto": one zipccl.auto Policy per group, fed by the times that the metadata exchanges carry."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import zlib

import torch
import torch.distributed as dist

from .. import config, lifetime
from ..auto import Policy
from ..format import DTYPE_CODES


#: Plans that flat codec="auto" measures: the backend's own collective, zipccl's pipeline raw or lossless.
FLAT_PLANS = ("native", "raw", "lossless")
#: Times of finished auto calls that one metadata exchange carries (pending ones wait for the next).
REPORT_SLOTS = 4


class DeviceSpan:
    """A call's start and end on the caller's CUDA stream, as timing events: its time on the
    device, known once the end has passed, with no host wait before that."""
    __slots__ = ("start", "end")

    def __init__(self, stream):
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.start.record(stream)

    def close(self, stream) -> "DeviceSpan":
        self.end.record(stream)
        return self

    def passed(self) -> bool:
        return self.end.query()

    def microseconds(self) -> int | None:
        """The span's time, waiting for its end where that has not passed: for at most
        ZIPCCL_TIMEOUT, unset config.DEFAULT_TIMEOUT (None after it: a call whose peer died never
        ends)."""
        if not self.end.query():
            deadline = time.monotonic() + config.wait_bound()
            while not self.end.query():
                if time.monotonic() > deadline:
                    return None
                time.sleep(1e-4)
        return int(self.start.elapsed_time(self.end) * 1000)


class _AutoGroup:
    """A group's auto policy, and this rank's times of its finished auto calls that no metadata
    exchange has reported yet: {(class, plan): [lowest microseconds so far or None, the
    DeviceSpans of CUDA calls whose end has not passed]}; a plan's report is the lowest of its
    calls since the last (native calls carry no exchange: several may wait), in first-call
    order, which is the same on every rank."""
    __slots__ = ("policy", "pending")

    def __init__(self):
        self.policy, self.pending = Policy(), {}

    def done(self, key, plan: str, time_taken) -> None:
        """A measured call's time: seconds, or a DeviceSpan (read when it has passed)."""
        entry = self.pending.setdefault((key, plan), [None, []])
        if isinstance(time_taken, DeviceSpan):
            entry[1].append(time_taken)
            self._fold(entry, wait=False)
        else:
            entry[0] = _lowest(entry[0], int(time_taken * 1e6))

    @staticmethod
    def _fold(entry: list, wait: bool) -> None:
        """Spans whose end has passed (``wait``: every span, waiting for each) into the lowest time."""
        open_spans = []
        for span in entry[1]:
            if wait or span.passed():
                us = span.microseconds()
                entry[0] = entry[0] if us is None else _lowest(entry[0], us)
            else:
                open_spans.append(span)
        entry[1] = open_spans

    def take(self) -> list:
        """Up to REPORT_SLOTS pending reports, oldest first, removed from the queue: [(entry,
        microseconds, or -1 where none is known: no rank learns from a report that one rank
        lacks)]. A CUDA call's end not yet passed is waited for here, at a later call's metadata
        exchange."""
        taken = list(self.pending.items())[:REPORT_SLOTS]
        for key, entry in taken:
            del self.pending[key]
            self._fold(entry, wait=True)
        return [(key, -1 if entry[0] is None else entry[0]) for key, entry in taken]


def _lowest(a: int | None, b: int) -> int:
    return b if a is None else min(a, b)


_autos: dict = lifetime.keep({})
_autos_lock = threading.Lock()


def _auto_group(group) -> _AutoGroup:
    key = group or dist.GroupMember.WORLD
    found = _autos.get(key)
    if found is not None:
        return found
    lifetime.sweep()
    with _autos_lock:
        return _autos.setdefault(key, _AutoGroup())


def auto_policy(group=None) -> Policy:
    """The policy behind codec="auto" on ``group`` (None: the default group): ``table()`` shows
    what it has measured, ``explain()`` what it chose and why."""
    return _auto_group(group).policy


def plans_for(plans: tuple[str, ...], device: str, link: str = "unknown", nodes: int = 1) -> tuple[str, ...]:
    """The plans that codec "auto" measures for a call on ``device`` (a device type) in a group
    of ``nodes`` nodes whose GPUs are joined by ``link`` (zipccl.topology.LINKS, the same on every
    rank), the first of ``plans`` (the backend's own collective) first. On CPU ``plans``. On CUDA
    only the plans that can pay against NCCL's own collective: within one node joined by NVLink,
    NCCL's alone, since the codec (about 120 GB/s each way on an H100) cannot beat links of
    hundreds of GB/s; elsewhere NCCL's and lossless compression on the slowest level alone (between
    the nodes, hierarchical/lossless, where ``plans`` hold it; else flat). Raw moves NCCL's bytes
    through zipccl's pipeline, and compressing across the fast links inside a node costs more
    than it saves: measuring them cost six plans tried twice each before auto settled."""
    if device != "cuda":
        return plans
    if link == "nvlink" and nodes == 1:
        return plans[:1]
    slow = "hierarchical/lossless" if "hierarchical/lossless" in plans else "lossless"
    return (plans[0], slow) if slow in plans else plans[:1]


#: The candidates of the auto step that the calls made now on this thread belong to, which their
#: signatures carry (metadata.Call): a rank whose codec was fixed and one whose auto chose that
#: codec run the same wire, but only the latter's policy steps, and the next call in which both
#: are auto would run different plans, each waiting for good; so would ranks whose candidates
#: differ (another ``algorithm``).
_among: contextvars.ContextVar = contextvars.ContextVar("zipccl_auto_among", default=None)


@contextlib.contextmanager
def among(candidates: tuple[str, ...]):
    """The calls made inside are steps of auto among ``candidates`` (their signature says so)."""
    token = _among.set("|".join(candidates))
    try:
        yield
    finally:
        _among.reset(token)


def among_id() -> str | None:
    return _among.get()


def planned(group, name: str, dtype, nbytes: int, candidates: tuple[str, ...], run,
            device: torch.device = torch.device("cpu"), plan: str | None = None) -> None:
    """``run(plan)`` with the plan that the group's auto policy chooses for this call among
    ``candidates`` (``plan``: chosen already, by the caller's fast path), in call order on every
    rank; the call's time on this rank goes out with the
    group's next metadata exchange. On CUDA, where the policy measures the call, that is its span
    on the caller's stream (DeviceSpan), not the host's: a CUDA call returns once its work is
    queued (a native call, queued on NCCL's stream, would look free), and waiting for the device
    at each end of every call, as this did before, added two host synchronisations per call."""
    key = Policy.key(name, dtype, nbytes, device)
    auto = _auto_group(group)
    if plan is None:
        plan = auto.policy.choose(key, nbytes, candidates)
    with undone(auto.policy, plan), among(candidates):
        if device.type == "cuda" and auto.policy.measures(nbytes, candidates):
            stream = torch.cuda.current_stream(device)
            span = DeviceSpan(stream)
            run(plan)
            auto.done(key, plan, span.close(stream))
            return
        t0 = time.perf_counter()
        run(plan)
    auto.done(key, plan, time.perf_counter() - t0)


@contextlib.contextmanager
def undone(policy: Policy, plan: str):
    """The policy's last step taken back where the call raises in a plan of zipccl's (or the
    group's own after ZIPCCL_CHECK_NATIVE's exchange): every rank raises there, each having
    stepped the class of its own call, which a mismatch makes differ (MismatchError on every
    rank), so every rank takes its step back. Not where the plan is the group's own collective
    alone, which its peers may have finished."""
    try:
        yield
    except BaseException:
        if plan != "native" or config.CHECK_NATIVE:
            policy.undo()
        raise


def learns(codec, input) -> bool:
    """Whether a call with ``codec`` on ``input`` takes a step of its group's auto policy where
    it is valid (codec "auto" learning, a float tensor): so must an invalid one (``refused``)."""
    return codec == "auto" and config.AUTO_LEARN and isinstance(input, torch.Tensor) and input.dtype in DTYPE_CODES


def refused(group, name: str, dtype, nbytes: int, candidates: tuple[str, ...], refuse, native,
            device: torch.device, error: BaseException) -> None:
    """An invalid call where its peers' valid calls learn: the policy's step that theirs take (or
    every later choice of the ranks would differ). Where that step's plan is zipccl's, ``refuse(plan)``
    (its peers wait in the plan's exchange: every rank raises); where it is the group's own
    collective, which its peers run without an exchange, ``native()`` (given where the call is
    refused for its layout alone), timed as theirs: the backend takes the tensors as they are
    or refuses them, as torch's call does; else the call's own ``error``, at once, as torch's
    call raises it (an exchange that no peer joins would wait out the bound first)."""
    policy = _auto_group(group).policy
    plan = policy.choose(Policy.key(name, dtype, nbytes, device), nbytes, candidates)
    if plan != "native" or config.CHECK_NATIVE:
        with undone(policy, plan):
            refuse(plan)  # raises, here and on every peer
    if native is None:
        raise error
    planned(group, name, dtype, nbytes, candidates, lambda _: native(), device, plan)


def _report_id(entry) -> int:
    return zlib.crc32(repr(entry).encode()) & 0x7FFFFFFF
