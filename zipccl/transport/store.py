"""The job's store (torch.distributed's default group's) through a connection of this thread's own.

A store client serves one request at a time: a thread that waits on a key through a shared
connection holds back every other thread of the rank, so that a sender waiting for its verdict on
one thread would hold back the verdict that another thread of the same rank gives (in a ring of
sends, every rank would wait for ever), and a receiver waiting for its communicator's id would
hold back the id its own sends publish."""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist

__all__ = ["own", "wait"]

_connections = threading.local()


def own():
    """This thread's connection to the job's store (a clone; the store itself where it has no clone())."""
    store = dist.distributed_c10d._get_default_store()
    mine = getattr(_connections, "own", None)
    if mine is None or mine[0] is not store:
        try:
            clone = store.clone()
        except Exception:  # noqa: BLE001 - a store without clone() (in-process)
            clone = store
        _connections.own = mine = (store, clone)
    return mine[1]


def wait(key: str, timeout: float | None) -> bytes:
    """The value of ``key`` once set, waiting at most ``timeout`` seconds (None: the store's own
    timeout); TimeoutError past it."""
    store = own()
    try:
        if timeout is None:
            store.wait([key])
        else:
            store.wait([key], datetime.timedelta(seconds=max(timeout, 1e-3)))  # 0 would mean no limit
    except dist.DistStoreError as e:  # the store's timeout (a store that is gone raises DistNetworkError)
        raise TimeoutError(str(e)) from e
    return store.get(key)
