"""What zipccl keeps per process group (transports, second groups, levels, topologies, auto's
choices, routes), and when it lets go of it. torch.distributed says nothing when a group is
destroyed, so every cache registered here is swept where one misses (a group's first call, a new
signature): a new world (``destroy_process_group()`` then ``init_process_group()`` in one process)
drops everything kept for the old one, whose groups torch destroyed; a group destroyed alone
drops its entries, and the groups zipccl made for it are destroyed with it. Without this, a
process that makes and destroys groups kept every one alive (about ten open files each), and a
new world read the old one's state (a rank's node never written into the new world's store)."""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch.distributed as dist

from . import executor

__all__ = ["keep", "sweep", "destroy", "destroy_process_group", "wait_on_destroy"]

_kept: list = []  # (cache, group_of or None for a cache of the whole world, on_drop or None)
_lock = threading.Lock()
_world = None  # the world, and its live groups, at the last full sweep
_live: set = set()


def _first(key):
    return key[0] if isinstance(key, tuple) else key


def keep(cache: dict, group_of: Callable | None = _first, on_drop: Callable | None = None) -> dict:
    """Register ``cache``: ``group_of(key)`` is the group an entry belongs to (by default the key,
    or its first item), None for a cache of the whole world (cleared with it); ``on_drop(value)``
    for each entry dropped because its group was destroyed alone. Returns ``cache``."""
    _kept.append((cache, group_of, on_drop))
    return cache


def sweep() -> None:
    """Drop what belongs to a world or group that is gone. Costs a look at torch's group map
    where nothing changed since the last sweep."""
    global _world, _live
    world, live = dist.GroupMember.WORLD, dist.distributed_c10d._world.pg_map
    if world is _world and live.keys() == _live:
        return
    with _lock:
        new_world = world is not _world
        dropped = True
        while dropped:  # a dropped entry's on_drop may destroy groups that other entries belong to
            dropped = False
            for cache, group_of, on_drop in _kept:
                for key in list(cache):
                    if new_world or (group_of is not None and group_of(key) not in live):
                        value = cache.pop(key, None)
                        dropped = dropped or not new_world
                        if on_drop is not None and not new_world:
                            on_drop(value)
            new_world = False
        _world, _live = world, set(live)


def destroy(*groups) -> None:
    """Destroy those of ``groups`` (zipccl's own) that torch still holds (on gloo a local call)."""
    for g in groups:
        if g is not None and g in dist.distributed_c10d._world.pg_map:
            torch_destroy(g)


torch_destroy = dist.distributed_c10d.destroy_process_group  # torch's own, which zipccl's groups use


@functools.wraps(torch_destroy, assigned=("__module__", "__name__", "__qualname__"))  # its own docstring
def destroy_process_group(group=None):
    """torch's ``destroy_process_group``, once zipccl's async calls issued before it have ended,
    as torch destroys a group only after its own pending work: a call still queued would run on
    a destroyed world (``group=None``: on the next one) and leave its peers waiting. A bounded
    wait (executor.END_WAIT): a send that no peer receives does not hold the destroy. What zipccl
    made for the group (its transport, its second gloo group and their sockets) goes with it,
    not at the next call that zipccl has not seen before."""
    executor.wait_to_end("destroy_process_group")
    out = torch_destroy(group)
    sweep()
    return out


def wait_on_destroy() -> None:
    """Make ``destroy_process_group`` torch.distributed's (at import: a process that imported
    zipccl and calls ``dist.destroy_process_group()`` waits for zipccl's calls as for torch's)."""
    for module in (dist, dist.distributed_c10d):
        if module.destroy_process_group is torch_destroy:
            module.destroy_process_group = destroy_process_group
