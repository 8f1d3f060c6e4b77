"""Codec "auto": one zipccl.auto Policy per group, fed by the times that the metadata exchanges carry."""

from __future__ import annotations

import threading
import time
import zlib

import torch
import torch.distributed as dist

from ..auto import Policy


#: Plans that flat codec="auto" measures: the backend's own collective, zipccl's pipeline raw or lossless.
FLAT_PLANS = ("native", "raw", "lossless")
#: Times of finished auto calls that one metadata exchange carries (pending ones wait for the next).
REPORT_SLOTS = 4


class _AutoGroup:
    """A group's auto policy, and this rank's times of its finished auto calls that no metadata
    exchange has reported yet: {(class, plan): microseconds}, the lowest of a plan's calls
    since (native calls carry no exchange: several may wait), in first-call order, which is the
    same on every rank."""
    __slots__ = ("policy", "pending")

    def __init__(self):
        self.policy, self.pending = Policy(), {}

    def done(self, key, plan: str, seconds: float) -> None:
        us = int(seconds * 1e6)
        self.pending[(key, plan)] = min(us, self.pending.get((key, plan), us))

    def take(self) -> list:
        """Up to REPORT_SLOTS pending reports, oldest first, removed from the queue."""
        taken = list(self.pending.items())[:REPORT_SLOTS]
        for entry, _ in taken:
            del self.pending[entry]
        return taken


_autos: dict = {}
_autos_lock = threading.Lock()


def _auto_group(group) -> _AutoGroup:
    with _autos_lock:
        return _autos.setdefault(group or dist.GroupMember.WORLD, _AutoGroup())


def auto_policy(group=None) -> Policy:
    """The policy behind codec="auto" on ``group`` (None: the default group): ``table()`` shows
    what it has measured, ``explain()`` what it chose and why."""
    return _auto_group(group).policy


def plans_for(plans: tuple[str, ...], device: str, link: str, nodes: int) -> tuple[str, ...]:
    """The plans that codec "auto" measures for a call on ``device`` (a device type) in a group
    of ``nodes`` nodes whose GPUs are joined by ``link`` (zipccl.topology.LINKS, the same on every
    rank): on CUDA within one node joined by NVLink, the backend's own collective alone, since
    the codec (about 120 GB/s each way on an H100) cannot beat links of hundreds of GB/s, and
    measuring the others would cost the calls that try them; else ``plans``."""
    if device == "cuda" and link == "nvlink" and nodes == 1:
        return ("native",)
    return plans


def clock(device: torch.device):
    """The clock that times a plan on ``device``: the host's, on CUDA read once the device has
    finished the work queued so far (torch.cuda.synchronize), since a CUDA call returns once its
    work is queued: a native call, queued on torch's NCCL stream, would look free."""
    if device.type != "cuda":
        return time.perf_counter

    def synchronised() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return synchronised


def planned(group, name: str, dtype, nbytes: int, candidates: tuple[str, ...], run,
            device: torch.device = torch.device("cpu")) -> None:
    """``run(plan)`` with the plan that the group's auto policy chooses for this call among
    ``candidates``, in call order on every rank; the call's time on this rank (``clock`` of the
    call's ``device``, where the policy measures this call: the host's clock elsewhere, with no
    synchronisation) goes out with the group's next metadata exchange."""
    key = Policy.key(name, dtype, nbytes)
    auto = _auto_group(group)
    plan = auto.policy.choose(key, nbytes, candidates)
    now = clock(device) if auto.policy.measures(nbytes, candidates) else time.perf_counter
    t0 = now()
    run(plan)
    auto.done(key, plan, now() - t0)


def _report_id(entry) -> int:
    return zlib.crc32(repr(entry).encode()) & 0x7FFFFFFF
