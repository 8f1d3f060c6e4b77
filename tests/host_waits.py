"""Every time the host waits for a device, recorded: the one counter of host waits that the gpu
suite (real CUDA) and the CPU stand-ins share.

``torch.cuda.set_sync_debug_mode`` sees only torch operations that synchronise; zipccl also
waits on events (``Event.synchronize``, or a loop on ``Event.query``) and reads tensors through
pinned copies, which it does not see. ``recording()`` wraps, for its duration, what the host can
wait on:

==================  ===========================================================================
kind                what was called (a host wait unless said otherwise)
==================  ===========================================================================
event.synchronize   ``Event.synchronize`` (torch.cuda's, CuPy's)
event.poll          ``Event.query`` / ``Stream.query``: counted once per event or stream polled,
                    however often (zipccl polls in a loop until it passes, with a deadline)
stream.synchronize  ``Stream.synchronize`` (torch.cuda's, CuPy's)
device.synchronize  ``torch.cuda.synchronize``, CuPy's ``Device.synchronize`` and
                    ``runtime.deviceSynchronize``
host_copy           a device tensor's values read by the host: ``.cpu()``, ``.item()``,
                    ``.tolist()``, ``.nonzero()``, ``int()``/``float()``/``bool()``/``index()``,
                    ``.to(cpu)`` and ``copy_`` into a CPU tensor unless ``non_blocking``;
                    ``cupy.asnumpy``
device_wait         ``Event.wait(stream)``, ``Stream.wait_event``, ``Stream.wait_stream``: a
                    stream waits, the host does not (recorded, never counted as a host wait)
==================  ===========================================================================

Only calls made while a frame of ``scope`` (default: the zipccl package) is on the stack are
recorded, each at the innermost such frame (``file:line``), so that a test's own reads of its
results do not count but torch's reads on zipccl's behalf do. Stand-ins (fake events, streams
and copies on a machine without a GPU) either are the classes that ``torch.cuda.Event`` and
``torch.cuda.Stream`` name when ``recording()`` starts (their methods of the names above are
wrapped the same way), or call ``Recorder.record`` themselves. Which tensors count as on a device
is ``is_device`` (default: CUDA tensors; a stand-in passes its own rule).

    with recording() as rec:
        rec.mark("all_reduce")
        zipccl.all_reduce(x, codec="lossless")
    assert rec.host_waits("all_reduce") <= pieces, rec.table()
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

import zipccl

__all__ = ["HOST_KINDS", "Recorder", "Wait", "recording"]

PACKAGE = str(Path(zipccl.__file__).resolve().parent)

#: The kinds that are host waits (``device_wait`` is not).
HOST_KINDS = ("event.synchronize", "event.poll", "stream.synchronize", "device.synchronize", "host_copy")

#: Tensor methods that read a device tensor's values on the host.
_READS = ("cpu", "item", "tolist", "nonzero", "__int__", "__float__", "__bool__", "__index__")


@dataclass(frozen=True)
class Wait:
    kind: str      # one of HOST_KINDS, or "device_wait"
    what: str      # the call: "torch.cuda.Event.synchronize", "Tensor.item", ...
    where: str     # file:line of the innermost frame of the scope
    thread: str    # the thread's name (zipccl's async calls run on "zipccl-async")
    label: str     # the last mark() before it
    key: int       # id of the event or stream polled (event.poll), else 0


class Recorder:
    """The waits recorded so far, in order (``waits``), each under the label of the last ``mark``."""

    def __init__(self, scope=PACKAGE, is_device=None):
        self.scope = None if scope is None else tuple(str(Path(s).resolve()) for s in
                                                      ((scope,) if isinstance(scope, (str, Path)) else scope))
        self.is_device = is_device or (lambda t: t.device.type == "cuda")
        self.waits: list[Wait] = []
        self.label = ""
        self.patched: list[str] = []   # what recording() wrapped
        self.missed: list[str] = []    # what it could not wrap (CuPy's extension types)
        self._lock = threading.Lock()
        self._polled: list = []        # the objects polled, kept alive so that their ids stay theirs
        self._inside = threading.local()

    def mark(self, label: str) -> None:
        """The label of the waits recorded from now on (a call, a piece)."""
        self.label = label

    def _where(self) -> str | None:
        """file:line of the innermost frame inside the scope, or None where none is on the stack."""
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name != __file__ and (self.scope is None or name.startswith(self.scope)):
                return f"{Path(name).name}:{frame.f_lineno}"
            frame = frame.f_back
        return None

    def record(self, kind: str, what: str, obj=None) -> None:
        """One wait of ``kind`` by ``what`` (``obj``: the event or stream polled, for event.poll):
        for stand-ins that do not go through the wrapped classes."""
        if getattr(self._inside, "busy", False):  # a wrapped call made by another wrapped call
            return
        where = self._where()
        if where is None:
            return
        with self._lock:
            if obj is not None:
                self._polled.append(obj)
            self.waits.append(Wait(kind, what, where, threading.current_thread().name, self.label,
                                   id(obj) if obj is not None else 0))

    def host_waits(self, label: str | None = None) -> int:
        """Host waits (label: under that mark only); the polls of one event or stream count once."""
        seen, count = set(), 0
        for w in self.waits:
            if w.kind not in HOST_KINDS or (label is not None and w.label != label):
                continue
            if w.kind == "event.poll":
                if (w.label, w.key) in seen:
                    continue
                seen.add((w.label, w.key))
            count += 1
        return count

    def counts(self, label: str | None = None) -> Counter:
        """{(kind, what, where): calls} (label: under that mark only)."""
        return Counter((w.kind, w.what, w.where) for w in self.waits if label is None or w.label == label)

    def table(self, label: str | None = None) -> str:
        """The counts as lines, for an assertion's message."""
        return "\n".join(f"{n:5d}  {kind:18s} {what:40s} {where}"
                         for (kind, what, where), n in sorted(self.counts(label).items()))

    # ---- the wrappers ---------------------------------------------------------------------------------------------

    def _wrap(self, kind: str, what: str, original, poll: bool = False):
        recorder = self

        def wrapped(*args, **kwargs):
            recorder.record(kind, what, args[0] if poll and args else None)
            inside = recorder._inside
            busy, inside.busy = getattr(inside, "busy", False), True
            try:
                return original(*args, **kwargs)
            finally:
                inside.busy = busy
        wrapped.__wrapped__ = original
        return wrapped

    def _read(self, what: str, original):
        """A Tensor method that reads the values on the host: a host copy where the tensor is on a device."""
        recorder = self

        def read(tensor, *args, **kwargs):
            if recorder.is_device(tensor):
                recorder.record("host_copy", what)
            return original(tensor, *args, **kwargs)
        read.__wrapped__ = original
        return read

    def _to(self, original):
        recorder = self

        def to(tensor, *args, **kwargs):
            blocking = not kwargs.get("non_blocking", len(args) > 2 and args[2] is True)
            if blocking and _to_cpu(args, kwargs) and recorder.is_device(tensor):
                recorder.record("host_copy", "Tensor.to")
            return original(tensor, *args, **kwargs)
        to.__wrapped__ = original
        return to

    def _copy(self, original):
        recorder = self

        def copy_(dst, src, non_blocking=False):
            if dst.device.type == "cpu" and not non_blocking and isinstance(src, torch.Tensor) and \
                    recorder.is_device(src):
                recorder.record("host_copy", "Tensor.copy_")
            return original(dst, src, non_blocking)
        copy_.__wrapped__ = original
        return copy_


def _to_cpu(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names the CPU as its device."""
    for a in (*args[:1], kwargs.get("device"), kwargs.get("other")):
        if isinstance(a, torch.Tensor):
            a = a.device
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


def _setattr(target, name: str, value, undo: list) -> bool:
    """``target.name = value``, remembered for undoing; False where the target refuses (an
    extension type's method)."""
    try:
        saved = target.__dict__.get(name, _ABSENT) if isinstance(target, type) else getattr(target, name)
        setattr(target, name, value)
    except (AttributeError, TypeError):
        return False
    undo.append((target, name, saved))
    return True


_ABSENT = object()


def _patch(rec: Recorder, target, name: str, value, label: str, undo: list) -> None:
    if not hasattr(target, name):
        return
    (rec.patched if _setattr(target, name, value, undo) else rec.missed).append(label)


def _patch_class(rec: Recorder, cls, prefix: str, methods: dict, undo: list) -> None:
    """Wrap ``methods`` ({name: (kind, poll)}) of ``cls`` where it is a class that has them."""
    if not isinstance(cls, type):
        return
    for name, (kind, poll) in methods.items():
        if callable(getattr(cls, name, None)):
            what = f"{prefix}.{name}"
            _patch(rec, cls, name, rec._wrap(kind, what, getattr(cls, name), poll), what, undo)


_EVENT = {"synchronize": ("event.synchronize", False), "query": ("event.poll", True),
          "wait": ("device_wait", False)}
_STREAM = {"synchronize": ("stream.synchronize", False), "query": ("event.poll", True),
           "wait_event": ("device_wait", False), "wait_stream": ("device_wait", False)}


@contextmanager
def recording(scope=PACKAGE, is_device=None, cupy: bool = True):
    """A Recorder of every host wait made inside ``scope`` while the block runs (see the module's
    docstring); everything wrapped is restored on exit. ``cupy``: wrap CuPy's too, where it has
    been imported."""
    rec, undo = Recorder(scope, is_device), []
    try:
        _patch_class(rec, torch.cuda.Event, "torch.cuda.Event", _EVENT, undo)
        _patch_class(rec, torch.cuda.Stream, "torch.cuda.Stream", _STREAM, undo)
        _patch(rec, torch.cuda, "synchronize",
               rec._wrap("device.synchronize", "torch.cuda.synchronize", torch.cuda.synchronize),
               "torch.cuda.synchronize", undo)
        for name in _READS:
            _patch(rec, torch.Tensor, name, rec._read(f"Tensor.{name}", getattr(torch.Tensor, name)),
                   f"Tensor.{name}", undo)
        _patch(rec, torch.Tensor, "to", rec._to(torch.Tensor.to), "Tensor.to", undo)
        _patch(rec, torch.Tensor, "copy_", rec._copy(torch.Tensor.copy_), "Tensor.copy_", undo)
        if cupy:
            _patch_cupy(rec, undo)
        yield rec
    finally:
        for target, name, saved in reversed(undo):
            if saved is _ABSENT:
                delattr(target, name)
            else:
                setattr(target, name, saved)


def _patch_cupy(rec: Recorder, undo: list) -> None:
    """CuPy's waits, where CuPy has been imported (zipccl imports it once it makes a communicator:
    warm the call up before recording it)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return
    _patch_class(rec, cp.cuda.Event, "cupy.cuda.Event", _EVENT, undo)
    _patch_class(rec, cp.cuda.Stream, "cupy.cuda.Stream", _STREAM, undo)
    _patch_class(rec, cp.cuda.Device, "cupy.cuda.Device", {"synchronize": ("device.synchronize", False)}, undo)
    for name, kind in (("deviceSynchronize", "device.synchronize"), ("streamSynchronize", "stream.synchronize"),
                       ("eventSynchronize", "event.synchronize")):
        original = getattr(cp.cuda.runtime, name, None)
        if original is not None:
            _patch(rec, cp.cuda.runtime, name, rec._wrap(kind, f"cupy.cuda.runtime.{name}", original),
                   f"cupy.cuda.runtime.{name}", undo)
    _patch(rec, cp, "asnumpy", rec._wrap("host_copy", "cupy.asnumpy", cp.asnumpy), "cupy.asnumpy", undo)
