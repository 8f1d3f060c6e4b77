"""The drop-in backend: ``dist.init_process_group(backend="zipccl")``.

One word in the user's code, and every ``dist.all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor`` (and DDP, FSDP2, HSDP, DeviceMesh, which call them),
``all_to_all_single``, ``all_to_all`` and point-to-point call goes through zipccl's planner,
while every other call passes straight to the backend underneath.

``ProcessGroupZipccl`` is a ``torch.distributed.ProcessGroup`` with gloo registered on it as
its backend for CPU tensors (NCCL for CUDA tensors where torch has it), so that torch's own
machinery (group names, DeviceMesh, FSDP2, functional collectives) finds a backend. The
collectives zipccl compresses (``allreduce``, ``allreduce_coalesced``, ``all_gather_single``,
``reduce_scatter_single``, the list forms ``allgather`` and ``reduce_scatter`` and their
coalesced variants) go to zipccl when it can take the call: a dense CPU or CUDA
bf16/fp16/fp32 tensor (CUDA: over zipccl's NCCL transport where the GPU extra is installed;
``takes_device``) reduced with SUM,
AVG, MAX, MIN or PREMUL_SUM (the factor applied, then SUM). All-to-all (``all_to_all_single``,
``alltoall``: zipccl.alltoall) and point-to-point (``send``, ``recv``, which ``dist.isend``,
``dist.irecv`` and ``dist.batch_isend_irecv`` call: zipccl.p2p) take dense float tensors the
same way, and point-to-point other dense CUDA tensors too (``_message``: their bytes framed
where NCCL would get a batch's messages one at a time). Everything else (integer, complex and
sparse tensors, PRODUCT and bitwise ops, CUDA tensors with ZIPCCL_TRANSPORT=torch, a receive
from any source, and broadcast, gather, scatter, reduce, barrier) goes to the backend
underneath through its own binding (``_inner_for`` says why not through ``super()``).
zipccl's own traffic runs on the same group: its messages are uint8 and int64 tensors, which
pass through, and the collectives it issues from inside a call (the backend's collective
chosen by the planner) are marked by a thread-local flag and go to the backend underneath,
never back into zipccl (zipccl.alltoall and zipccl.p2p call the backend under a drop-in group
directly).

The codec policy: ``Options(codec=...)`` through ``pg_options``, else ``ZIPCCL_CODEC``
(``auto``, the default: the backend's own collective wherever compression cannot pay, so the
drop-in never makes a job slower; ``raw``, ``lossless`` or ``native`` force it for every
float tensor, however small). Lossy compression only with ``Options(lossy=...)``.

Limits (docs/USAGE.md's): ``monitored_barrier`` accepts only groups whose backend is named gloo;
functional collectives reach zipccl only where torch dispatches them to the group's methods
(DTensor's ``full_tensor()`` on CPU does).
"""

from __future__ import annotations

import functools
import threading
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from . import alltoall, api, config, executor, p2p, topology
from .collectives.validation import overlaps
from .format import DTYPE_CODES
from .lossy import Compressor
from .stats import record_native
from .transport import nccl_stack

__all__ = ["NAME", "Options", "ProcessGroupZipccl", "register", "takes_device"]

NAME = "zipccl"
_FLOATS = frozenset(DTYPE_CODES)
_RED = dist.ReduceOp.RedOpType
_ZIPCCL_OPS = {_RED.SUM: dist.ReduceOp.SUM, _RED.AVG: dist.ReduceOp.AVG, _RED.MAX: dist.ReduceOp.MAX,
               _RED.MIN: dist.ReduceOp.MIN, _RED.PREMUL_SUM: dist.ReduceOp.SUM}
_CODECS = ("auto", "native", "raw", "lossless")


@dataclass(frozen=True)
class Options:
    """What the zipccl backend does with the calls it can take; passed as ``pg_options`` to
    ``init_process_group`` or ``new_group``. ``codec``: "auto", "native", "raw" or "lossless"
    (None: ``ZIPCCL_CODEC``, default "auto"). ``algorithm``: as in ``zipccl.all_reduce``.
    ``lossy``: None (never), or "topk"/"entropy" (zipccl.lossy, with error feedback) for
    all-reduces (SUM or AVG) of float tensors with at least ``lossy_min_numel`` elements. A
    residual belongs to a tensor's size, dtype and place among the step's tensors of that size:
    a step ends at ``zipccl.backend.step(group)`` or, until the first such call, with each
    backward pass (DDP's buckets), and outside one when the step's first size comes again. The
    first backward pass that makes such calls is sent exact: DDP rebuilds its buckets after it,
    and the backend, which sees flat buckets, could not move their residuals with their
    parameters. For per-parameter rules, use zipccl.ddp's hook or zipccl.fsdp instead."""
    codec: str | None = None
    algorithm: str = "auto"
    lossy: str | None = None
    lossy_min_numel: int = 1 << 16

    def __post_init__(self):
        if self.codec is not None and self.codec not in _CODECS:
            raise ValueError(f"zipccl backend codec {self.codec!r}: use one of {_CODECS}")
        if self.algorithm not in api.ALGORITHMS:
            raise ValueError(f"zipccl backend algorithm {self.algorithm!r}: use one of {api.ALGORITHMS}")
        if self.lossy not in (None, "topk", "entropy"):
            raise ValueError(f"zipccl backend lossy {self.lossy!r}: use None, 'topk' or 'entropy'")
        if self.lossy_min_numel < 1:
            raise ValueError(f"lossy_min_numel must be >= 1, got {self.lossy_min_numel}")


def takes_device(device: str, setting: str | None = None, extra: bool | None = None) -> bool:
    """Whether the drop-in hands the compressible calls of tensors on ``device`` (a device type)
    to zipccl's planner: CPU tensors always; CUDA tensors over zipccl's NCCL transport where the
    GPU extra is installed (``extra``, None: nccl_stack.extra_installed()) or ZIPCCL_TRANSPORT (``setting``,
    None: config.TRANSPORT) is "nccl" (then a missing extra raises, naming it). Otherwise, with
    "auto" and no extra, or with "torch", torch's NCCL backend underneath carries them as they
    are, uncompressed: changing one word must not break a job on a machine without the extra
    (warned once per process)."""
    setting = config.TRANSPORT if setting is None else setting
    if device == "cpu":
        return True
    if device != "cuda" or setting == "torch":
        return False
    if setting == "nccl":
        return True
    if extra is None:
        extra = nccl_stack.extra_installed()
    if not extra:
        _warn_uncompressed()
    return extra


@functools.cache
def _warn_uncompressed() -> None:
    warnings.warn("zipccl: CUDA tensors pass to torch's NCCL uncompressed: zipccl's NCCL transport needs the GPU "
                  "extra (pip install 'zipccl[cuda12]' or 'zipccl[cuda13]', matching torch's CUDA)", stacklevel=3)


_inside = threading.local()


class _Inside:
    """Marks this thread as inside a zipccl call: the group's overrides then hand every call to
    the inner backend (zipccl's own collectives must not come back into zipccl)."""

    def __enter__(self):
        self.was = getattr(_inside, "on", False)
        _inside.on = True

    def __exit__(self, *exc):
        _inside.on = self.was


class _Work(dist.Work):
    """torch's Work over a future: ``wait()`` raises the call's error (a Work that torch makes
    from a failed future does not), ``get_future().value()`` is the list of result tensors.

    ``get_future()`` is what torch's C++ reads (DDP's reducer takes the first tensor of its
    value), so it must fail as a C++ future fails. A Python future's ``set_exception`` only
    stores the exception as the future's value, raised by Python's ``wait()``: C++ sees a
    success whose value holds no tensor, and the reducer read past the end of that empty list
    (SIGSEGV in ``parseCppCommHookResult``). A future made by ``then`` whose callback raises
    is failed in C++ itself, so the reducer raises a RuntimeError naming the error instead."""

    def __init__(self, handle: executor.Handle, value: list | None = None):
        """``handle``: the call's (its CUDA stream rules with it: zipccl.executor); ``value``: the
        future's value where the handle's is not the call's tensors (a message's: its statistics)."""
        super().__init__()
        self._handle = handle
        self._future = handle.get_future().then(lambda future: _result(handle, future, value))

    def wait(self, timeout=None) -> bool:
        """Wait for the call and raise its error; ``timeout`` (a timedelta or seconds; zero or
        None, as torch's C++ callers pass: none): zipccl.errors.TimeoutError past it. Then for
        ``get_future()``'s value too, which torch sets after waking the call's waiters, and for
        the callbacks chained on it, which gloo runs before its Work completes: a call that they
        issue (one the drop-in passes to the backend too) comes before the caller's next, and what
        they write is there to read."""
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        self._handle.wait(timeout if seconds and seconds > 0 else None)
        self._future.wait()
        if not executor.ours():  # a callback waiting on its own call: its thread runs the callbacks
            self._handle._ended().wait()
        return True

    def is_completed(self) -> bool:
        """Once ``get_future()`` is done and the callbacks chained on it have run, as gloo's: what
        they issue or write comes before what the caller does next."""
        return self._future.done() and self._handle._ended().is_set()

    def get_future(self) -> torch.futures.Future:
        return self._future

    def _source_rank(self) -> int:
        """A receive from any source's sender, its rank in the group (zipccl.p2p.after_queued)."""
        return self._handle._source_rank()

    def result(self) -> list[torch.Tensor]:
        """The call's output tensors, as gloo's Work gives them, once the call is done (its
        error raised)."""
        self.wait()
        return self._future.wait()


def _result(handle: executor.Handle, future: torch.futures.Future, value: list | None = None):
    """The call's value (``value`` where given), or its error raised (``_Work``: a failure C++
    sees); on CUDA after the call's device work, so that the CUDA-aware future's consumer (DDP's
    reducer) is ordered after it."""
    got = future.wait()
    handle.join_stream()
    return got if value is None else value


def _p2p_work(handle, tensors: list) -> dist.Work:
    """A message's Work: the backend's own where zipccl handed it to the backend, else one over
    zipccl's handle whose value is ``tensors``, as the backend's (a send completes by itself:
    zipccl.p2p)."""
    return _Work(handle, tensors) if isinstance(handle, executor.Handle) else handle


def _finished(result=None, error: BaseException | None = None) -> _Work:
    future = torch.futures.Future()
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
    return _Work(executor.Handle(future))


def _op_of(opts):
    """The ReduceOp of an options object, a ReduceOp, a RedOpType or None (SUM)."""
    op = getattr(opts, "reduceOp", opts)
    return dist.ReduceOp.SUM if op is None else op


def _red_type(op):
    return getattr(op, "op", op)


def _options(kind, opts, op=None):
    """``opts`` where it is already a ``kind`` (torch's options object), else a new one with
    ``op`` (direct calls such as ``pg.allreduce(t)`` pass a tensor and maybe an op)."""
    if isinstance(opts, kind):
        return opts
    out = kind()
    if op is not None:
        out.reduceOp = op
    return out


def _first(tensors):
    """The first tensor of a call's argument (a tensor, a list, or a list of lists), or None."""
    while isinstance(tensors, (list, tuple)):
        if not tensors:
            return None
        tensors = tensors[0]
    return tensors if isinstance(tensors, torch.Tensor) else None


def _chunks_as_gloo(whole: torch.Tensor, part: torch.Tensor, group) -> bool:
    """Whether ``whole`` is one chunk per rank of ``group`` of ``part``'s shape along dim 0, as
    gloo's all-gather into one tensor and reduce-scatter of one tensor ask. A CPU call of other
    shapes goes to gloo, to be refused there as with gloo, whatever its size and codec (zipccl
    itself needs only the element counts, as NCCL does: CUDA calls are not held to it)."""
    if whole.device.type != "cpu":
        return True
    return part.dim() >= 1 and tuple(whole.shape) == (group.size() * part.shape[0], *part.shape[1:])


def _data(tensors) -> list:
    """The tensors as a C++ backend sees them: their storage, outside autograd (``.data``: no
    op recorded, no version bump, numpy() allowed). gloo and NCCL write results so; DDP with
    ``create_graph=True`` hands buckets that require grad, which zipccl's numpy() kernels and
    in-place writes would otherwise refuse (a leaf) or record into the graph."""
    return [t.data for t in tensors]


def _factor(op) -> float | None:
    """PREMUL_SUM's factor (zipccl multiplies each input by it, in its dtype, then sums), or None."""
    if _red_type(op) != _RED.PREMUL_SUM:
        return None
    factor = op.factor
    return factor.item() if isinstance(factor, torch.Tensor) else float(factor)


class ProcessGroupZipccl(dist.ProcessGroup):
    """A process group whose compressible collectives go through zipccl (module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout, options: Options | None = None,
                 global_ranks=None, group_name: str = ""):
        super().__init__(rank, size)
        _read_settings_again()  # a group made otherwise than through torch's helper (_making_group)
        self.options = options or Options()
        self.codec = self.options.codec or config.CODEC
        gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        if global_ranks is not None:
            gloo.options.global_ranks_in_group = list(global_ranks)
        gloo.options.group_name = group_name
        gloo._set_sequence_number_for_group()
        self._inner = {"cpu": gloo}
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        if torch.cuda.is_available() and dist.is_nccl_available():
            nccl_options = dist.ProcessGroupNCCL.Options()
            nccl_options._timeout = timeout
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, nccl_options)
            self._inner["cuda"] = nccl
            self._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self._compressor = None if self.options.lossy is None else Compressor(self.options.lossy, rules=None)
        self._seen: dict = {}  # (numel, dtype) -> lossy calls this step
        self._anchor, self._stepped, self._task, self._first_pass = None, False, None, None

    # ---- what torch asks of a Python process group --------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return NAME

    # ---- the decision ---------------------------------------------------------------------------------------

    def _inner_for(self, tensor: torch.Tensor):
        """The backend underneath for ``tensor``'s device. Calls that zipccl does not take go to
        it directly: through ``super()`` they would enter torch's C++ with the GIL held, and
        deadlock with gloo's worker thread, which needs the GIL to free a finished call's
        tensors while it holds the lock that a new call waits for (seen under load)."""
        return self._inner.get(tensor.device.type if tensor is not None else "cpu", self._inner["cpu"])

    def _passed(self, tensor: torch.Tensor | None):
        """``_inner_for``, for a collective that zipccl passes through: outside zipccl's own calls,
        after zipccl's queued calls (but receives, as a send: zipccl.p2p), whose collectives run on
        zipccl's thread; one issued here meanwhile would meet the backend in another order on each
        rank (a broadcast against a queued all-reduce: a hang; DDP's unused-parameter map against
        a bucket: gloo aborts on the sizes)."""
        if not (getattr(_inside, "on", False) or executor.ours()):
            topology.publish_node()  # a peer's first message under auto may wait for this rank's node
            p2p.after_collectives()
        return self._inner_for(tensor)

    def _takes(self, tensors, op=None, contiguous: bool = True) -> bool:
        """zipccl takes the call: not from inside zipccl, a codec other than native, dense float
        tensors of one dtype on a device zipccl takes (``takes_device``), an op zipccl reduces with;
        contiguous ones, but for a message or a list all-to-all (``contiguous=False``), which
        zipccl.p2p and zipccl.all_to_all take in any layout: ranks whose layouts may differ must
        decide alike."""
        if getattr(_inside, "on", False) or self.codec == "native":
            return False
        if op is not None and _red_type(op) not in _ZIPCCL_OPS:
            return False
        dtype = None
        for x in tensors:
            if not (isinstance(x, torch.Tensor) and x.layout == torch.strided and takes_device(x.device.type)
                    and x.dtype in _FLOATS and (x.is_contiguous() or not contiguous)):
                return False
            if dtype is not None and x.dtype != dtype:
                return False
            dtype = x.dtype
        return True

    def _own(self, name: str, output: torch.Tensor, input: torch.Tensor, op=None) -> bool | None:
        """Whether zipccl runs this call as the group's own collective (api.goes_native, decided
        once per signature, alike on every rank). True where no zipccl call is queued before it:
        the backend underneath takes it here, directly, and its Work is the call's, as with
        torch's own backend (through zipccl's queue and back into this group a call cost several
        times what the backend's own took). None where calls are queued: it runs behind them,
        still the backend's alone (no group made for it, as its idle peers make none). False:
        zipccl's path; always for lossy calls and PREMUL_SUM for gloo (which lacks it: zipccl
        applies the factor)."""
        if self._compressor is not None or \
                (op is not None and _red_type(op) == _RED.PREMUL_SUM and input.device.type != "cuda"):
            return False
        if not api.goes_native(name, self, output, input, None if op is None else _ZIPCCL_OPS[_red_type(op)],
                               self.codec, self.options.algorithm):
            return False
        if not executor.idle():
            return None
        record_native(name)  # in zipccl.stats, as zipccl's own native calls are
        return True

    def _run(self, fn, result, async_op: bool, inputs=(), groups: bool = True) -> dist.Work:
        """``fn()`` through zipccl's queue (after every async call issued before it), inside
        zipccl; a Work whose future's value is ``result`` (DDP reads its first tensor). An async
        call's tensors, ``inputs`` too, are recorded on the stream it runs on: the caller may drop
        an input while the call still reads it. ``groups``: first make the groups the call may
        need (api.make_groups); not for a call that is the backend's alone, whose peers with
        nothing queued take it directly and make none (a topology's all-gather here would meet
        their collective)."""
        def call():
            with _Inside():
                fn()
            return result

        topology.publish_node()  # a peer's first message under auto may wait for this rank's node
        if not async_op:
            try:
                executor.run(call, False)
            except Exception as e:  # raised by wait(), which torch calls at once
                return _finished(error=e)
            return _finished(result)
        if groups:
            api.make_groups(self, self.codec, self.options.algorithm)
        return _Work(executor.run(call, True, [*result, *inputs]))


    # ---- the overrides --------------------------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        op, async_op = _op_of(opts), getattr(opts, "asyncOp", True)
        if len(tensors) != 1 or not self._takes(tensors, op) or (own := self._own("all_reduce", tensors[0], tensors[0],
                                                                                    op)):
            return self._passed(_first(tensors)).allreduce(tensors, _options(dist.AllreduceOptions, opts, op))
        zop, factor, x = _ZIPCCL_OPS[_red_type(op)], _factor(op), tensors[0].data
        lossy, options = self._lossy_name(x, zop), _options(dist.AllreduceOptions, opts, op)

        def fn():
            if own is None:  # the backend's, as an idle rank's (NCCL's PREMUL_SUM too), behind the queued calls
                record_native("all_reduce")
                self._passed(x).allreduce(tensors, options).wait()
                return
            if factor is not None:
                x.mul_(factor)
            if lossy is not None:
                self._compressor.all_reduce(x, lossy, op=zop, group=self)
            else:
                api.all_reduce(x, zop, group=self, codec=self.codec, algorithm=self.options.algorithm)
        return self._run(fn, tensors, async_op, groups=own is False)

    def allreduce_coalesced(self, tensors, opts=None):
        tensors = list(tensors)
        op, async_op = _op_of(opts), getattr(opts, "asyncOp", True)
        if not tensors or not self._takes(tensors, op):
            return self._passed(_first(tensors)).allreduce_coalesced(
                tensors, _options(dist.AllreduceCoalescedOptions, opts, op))
        zop, factor, data = _ZIPCCL_OPS[_red_type(op)], _factor(op), _data(tensors)

        def fn():  # one call for all of them: a flat copy, reduced, copied back
            flat = torch.cat([x.reshape(-1) for x in data])
            if factor is not None:
                flat.mul_(factor)
            api.all_reduce(flat, zop, group=self, codec=self.codec, algorithm=self.options.algorithm)
            offset = 0
            for x in data:
                x.copy_(flat[offset:offset + x.numel()].view_as(x))
                offset += x.numel()
        return self._run(fn, tensors, async_op)

    def all_gather_single(self, output, input, opts=None):
        async_op = getattr(opts, "asyncOp", True)
        if (not self._takes([output, input]) or not _chunks_as_gloo(output, input, self)
                or (own := self._own("all_gather", output, input))):
            return self._passed(input)._allgather_base(output, input, _options(AllgatherOptions, opts))
        out, src = _data([output, input])
        # the future's value as the backend's own: gloo's is the output's chunk per rank, NCCL's the output
        result = list(output.chunk(self.size())) if output.device.type == "cpu" else [output]
        return self._run(lambda: api.all_gather(out, src, group=self, codec=self.codec,
                                                algorithm=self.options.algorithm), result, async_op, [input],
                         groups=own is False)

    def reduce_scatter_single(self, output, input, opts=None):
        op, async_op = _op_of(opts), getattr(opts, "asyncOp", True)
        if (not self._takes([output, input], op) or not _chunks_as_gloo(input, output, self)
                or (own := self._own("reduce_scatter", output, input, op))):
            if output.dim() == 0 and output.device.type == "cpu":  # gloo ends the process (SIGSEGV)
                raise RuntimeError("reduce_scatter_tensor into a 0-d tensor: gloo cannot (it crashes); give the "
                                   "output one dimension")
            return self._passed(input)._reduce_scatter_base(
                output, input, _options(dist.ReduceScatterOptions, opts, op))
        zop, factor = _ZIPCCL_OPS[_red_type(op)], _factor(op)
        out, data = _data([output, input])
        options = _options(dist.ReduceScatterOptions, opts, op)

        def fn():
            if own is None:  # the backend's, as an idle rank's (NCCL's PREMUL_SUM too), behind the queued calls
                record_native("reduce_scatter")
                self._passed(input)._reduce_scatter_base(output, input, options).wait()
                return
            src = data if factor is None else data * factor
            api.reduce_scatter(out, src, zop, group=self, codec=self.codec, algorithm=self.options.algorithm)
        return self._run(fn, [output], async_op, [input], groups=own is False)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """The list form (``dist.all_gather``): zipccl where every rank's tensor has the input's
        shape, through one flat buffer."""
        async_op = getattr(opts, "asyncOp", True)
        if isinstance(input_tensors, torch.Tensor):  # pg.allgather(list, tensor): one tensor per rank
            inputs, outputs = [input_tensors], [output_tensors]
        else:
            inputs, outputs = list(input_tensors), list(output_tensors)
        if not (len(inputs) == 1 and len(outputs) == 1 and len(outputs[0]) == self.size()
                and self._takes(list(outputs[0]) + inputs)
                and all(o.shape == inputs[0].shape for o in outputs[0])):
            return self._passed(_first(inputs)).allgather(outputs, inputs, _options(AllgatherOptions, opts))
        x, outs = inputs[0].data, list(outputs[0])

        def fn():
            flat = x.new_empty((self.size(), x.numel()))
            api.all_gather(flat, x, group=self, codec=self.codec, algorithm=self.options.algorithm)
            for j, o in enumerate(_data(outs)):
                o.copy_(flat[j].view_as(o))
        return self._run(fn, outs, async_op, inputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """The list form (``dist.reduce_scatter``): zipccl where every chunk has the output's
        shape, through one flat buffer; where auto keeps the backend's collective, the backend's
        list form (gloo sums it in another order than its tensor form)."""
        op, async_op = _op_of(opts), getattr(opts, "asyncOp", True)
        outputs = [output_tensors] if isinstance(output_tensors, torch.Tensor) else list(output_tensors)
        inputs = [input_tensors] if isinstance(output_tensors, torch.Tensor) else list(input_tensors)
        if not (len(outputs) == 1 and len(inputs) == 1 and len(inputs[0]) == self.size()
                and self._takes(outputs + list(inputs[0]), op)
                and all(i.shape == outputs[0].shape for i in inputs[0])):
            return self._passed(_first(outputs)).reduce_scatter(
                outputs, inputs, _options(dist.ReduceScatterOptions, opts, op))
        out, chunks = outputs[0].data, _data(inputs[0])
        signature = out.new_empty(1).expand(out.numel() * len(chunks))  # the flat input's, nothing allocated
        own, options = self._own("reduce_scatter", out, signature, op), _options(dist.ReduceScatterOptions, opts, op)
        if own:
            return self._passed(out).reduce_scatter(outputs, inputs, options)
        zop, factor = _ZIPCCL_OPS[_red_type(op)], _factor(op)

        def fn():
            if own is None:  # the backend's, behind the calls queued before it
                self._passed(out).reduce_scatter(outputs, inputs, options).wait()
                return
            flat = torch.cat([c.reshape(-1) for c in chunks])
            if factor is not None:
                flat.mul_(factor)
            api.reduce_scatter(out, flat, zop, group=self, codec=self.codec, algorithm=self.options.algorithm)
        return self._run(fn, outputs, async_op, inputs[0], groups=own is False)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        async_op = getattr(opts, "asyncOp", True)
        if not self._takes(list(outputs) + list(inputs)):
            return self._each(outputs, inputs,
                              lambda b, o, i: b._allgather_base(o, i, _options(AllgatherOptions, opts)))

        def fn():
            for o, i in zip(_data(outputs), _data(inputs)):
                api.all_gather(o, i, group=self, codec=self.codec, algorithm=self.options.algorithm)
        return self._run(fn, list(outputs), async_op, list(inputs))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op, async_op = _op_of(opts), getattr(opts, "asyncOp", True)
        if not self._takes(list(outputs) + list(inputs), op):
            return self._each(outputs, inputs, lambda b, o, i: b._reduce_scatter_base(
                o, i, _options(dist.ReduceScatterOptions, opts, op)))
        zop, factor = _ZIPCCL_OPS[_red_type(op)], _factor(op)

        def fn():
            for o, i in zip(_data(outputs), _data(inputs)):
                api.reduce_scatter(o, i if factor is None else i * factor, zop, group=self, codec=self.codec,
                                   algorithm=self.options.algorithm)
        return self._run(fn, list(outputs), async_op, list(inputs))

    # ---- every other call: to the backend underneath, directly (see _inner_for) ----------------------------

    def _forward(self, name: str, tensor, *args, **kwargs):
        backend = self._passed(tensor if isinstance(tensor, torch.Tensor) else None)
        return getattr(backend, name)(*args, **kwargs)

    def broadcast(self, tensors, *args, **kwargs):
        return self._forward("broadcast", _first(tensors), tensors, *args, **kwargs)

    def reduce(self, tensors, *args, **kwargs):
        return self._forward("reduce", _first(tensors), tensors, *args, **kwargs)

    def gather(self, outputs, inputs, *args, **kwargs):
        return self._forward("gather", _first(inputs), outputs, inputs, *args, **kwargs)

    def scatter(self, outputs, inputs, *args, **kwargs):
        return self._forward("scatter", _first(outputs), outputs, inputs, *args, **kwargs)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        """``dist.all_to_all_single`` (torch 2.13's name; ``alltoall_base`` before): zipccl's
        all-to-all (zipccl.alltoall) for dense float tensors, uneven splits included."""
        async_op = getattr(opts, "asyncOp", True)
        if not self._takes([output, input]):
            return self._passed(input).alltoall_base(output, input, list(output_split_sizes or []),
                                                        list(input_split_sizes or []),
                                                        _options(dist.AllToAllOptions, opts))
        out, src = _data([output, input])
        outs, ins = (list(s) if s else None for s in (output_split_sizes, input_split_sizes))
        native = self._compressor is None and alltoall.goes_native(self, (out, src), self.codec, self.options.algorithm)
        if native and executor.idle() and not overlaps(out, src):  # in place: zipccl's, which keeps the input
            record_native("all_to_all")  # the backend's own, directly, as _own hands the collectives
            return self._passed(input).alltoall_base(output, input, list(output_split_sizes or []),
                                                        list(input_split_sizes or []),
                                                        _options(dist.AllToAllOptions, opts))
        return self._run(lambda: alltoall.all_to_all_single(out, src, outs, ins, group=self, codec=self.codec,
                                                            algorithm=self.options.algorithm), [output], async_op,
                         [input], groups=not native)

    alltoall_base = all_to_all_single
    # torch before 2.13 calls these two by their old names (dist.all_gather_into_tensor, reduce_scatter_tensor)
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single

    def alltoall(self, outputs, inputs, opts=None):
        """``dist.all_to_all`` (list form): zipccl's all-to-all for dense float tensors."""
        async_op = getattr(opts, "asyncOp", True)
        if not (len(outputs) == len(inputs) == self.size()
                and self._takes(list(outputs) + list(inputs), contiguous=False)):
            return self._passed(_first(inputs)).alltoall(outputs, inputs, _options(dist.AllToAllOptions, opts))
        outs, ins = _data(outputs), _data(inputs)
        native = self._compressor is None and alltoall.goes_native(self, outs + ins, self.codec,
                                                                   self.options.algorithm)
        if native and executor.idle() and len({x.numel() for x in outs + ins}) == 1 \
                and not any(overlaps(x, y) for x in outs for y in ins):  # uneven or in place: zipccl's way round
            record_native("all_to_all")  # gloo's list form, which takes one size only
            return self._passed(_first(inputs)).alltoall(outputs, inputs, _options(dist.AllToAllOptions, opts))
        return self._run(lambda: alltoall.all_to_all(outs, ins, group=self, codec=self.codec,
                                                     algorithm=self.options.algorithm), list(outputs), async_op,
                         list(inputs), groups=not native)

    def allgather_coalesced(self, outputs, inputs, *args, **kwargs):
        return self._forward("allgather_coalesced", _first(inputs), outputs, inputs, *args, **kwargs)

    def send(self, tensors, dst: int, tag: int = 0):
        """``dist.send``, ``isend`` and ``batch_isend_irecv``'s sends: zipccl's (zipccl.p2p) where
        ``_message`` gives a codec; its receiver's ``recv`` decides alike."""
        codec = self._message(tensors)
        if codec is None:
            return self._inner_for(_first(tensors)).send(tensors, dst, tag)
        return _p2p_work(p2p.isend(tensors[0], group=self, tag=tag, codec=codec, group_dst=dst), tensors)

    def recv(self, tensors, src: int, tag: int = 0):
        """``dist.recv`` and ``irecv``: zipccl's where ``_message`` gives a codec; a caller's
        tensor that the backend underneath takes alone goes there through zipccl.p2p's order all
        the same (codec "native"): posted at once where nothing is queued, else behind the
        receives queued before it, whose messages it would otherwise take (same peer, same tag).
        zipccl's own messages (inside a call, or on its threads) go straight to it."""
        codec = self._message(tensors)
        if codec is None:
            if len(tensors) != 1 or getattr(_inside, "on", False) or executor.ours():
                return self._inner_for(_first(tensors)).recv(tensors, src, tag)
            codec = "native"
        return _p2p_work(p2p.irecv(tensors[0], group=self, tag=tag, codec=codec, group_src=src), tensors)

    def _message(self, tensors) -> str | None:
        """The codec zipccl.p2p carries a message with, or None where the backend underneath takes
        it: a dense float tensor zipccl takes, with the group's codec; any other dense CUDA tensor
        that zipccl takes the device of, with "auto" (but under ``codec="native"``), which frames
        its plain bytes where the backend would get a batch's messages one at a time (NCCL, whose
        single sends and receives to one peer queue on one stream) and otherwise hands them to it."""
        if len(tensors) != 1:
            return None
        if self._takes(tensors, contiguous=False):
            return self.codec
        x = tensors[0]
        if self.codec != "native" and not getattr(_inside, "on", False) and isinstance(x, torch.Tensor) \
                and x.layout == torch.strided and x.device.type == "cuda" and takes_device("cuda"):
            return "auto"
        return None

    def recv_anysource(self, tensors, tag: int = 0):
        """The backend's own receive from any source, after the receives queued before it
        (zipccl.p2p); refused where a sender would frame the message (p2p.check_any_source)."""
        codec = self._message(tensors)
        if codec is not None:
            p2p.check_any_source(tensors[0], self, codec)
        inner = self._inner_for(_first(tensors))
        return _p2p_work(p2p.after_queued(lambda: inner.recv_anysource(tensors, tag), _first(tensors)), tensors)

    def barrier(self, *args, **kwargs):
        return self._passed(None).barrier(*args, **kwargs)

    # ---- internals --------------------------------------------------------------------------------------------

    def _each(self, outputs, inputs, call) -> dist.Work:
        """A coalesced call that zipccl does not take: one backend call per pair (the backends'
        Python bindings have no coalesced form), waited for here."""
        try:
            for o, i in zip(outputs, inputs):
                call(self._passed(i), o, i).wait()
        except Exception as e:  # raised by wait(), as the backend's would be
            return _finished(error=e)
        return _finished(list(outputs))

    def _lossy_name(self, x: torch.Tensor, op) -> str | None:
        """The error-feedback key of a lossy all-reduce (Options' docstring), or None where this
        call stays exact."""
        if self._compressor is None or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) \
                or x.numel() < self.options.lossy_min_numel:
            return None
        task = _graph_task()
        if task != -1 and self._first_pass in (None, task):  # DDP's buckets before its rebuild, which would
            self._first_pass = task  # put their residuals at other parameters' positions: sent exact
            return None
        sig = (x.numel(), str(x.dtype).replace("torch.", ""))
        if not self._stepped and self._begins(sig, task):
            self._seen.clear()
            self._compressor.mark()
        k = self._seen.get(sig, 0)
        self._seen[sig] = k + 1
        return f"{sig[0]}:{sig[1]}:{k}"

    def _begins(self, sig, task: int) -> bool:
        """Whether a lossy call of signature ``sig`` begins a step, where ``step()`` is not called:
        inside autograd's backward pass ``task`` (DDP's comm hook), the first call of each backward
        pass, so that DDP's buckets, rebuilt after its first step, keep their keys; elsewhere (-1),
        the step's first signature again (the first call's)."""
        if task != -1:
            begins, self._task = task != self._task, task
            return begins
        if self._anchor is None:
            self._anchor = sig
            return True
        return sig == self._anchor

    def step(self) -> None:
        """A training step ended: the lossy calls' keys restart (zipccl.backend.step)."""
        self._stepped = True
        self._seen.clear()
        if self._compressor is not None:
            self._compressor.mark()


def _graph_task() -> int:
    """The backward pass that this thread runs now (autograd's graph task), or -1 outside one."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else -1


def _create(opts, pg_options) -> ProcessGroupZipccl:
    """The creator torch calls for every group with backend "zipccl" (the default group,
    ``new_group``, DeviceMesh's dimensions)."""
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f"pg_options of a zipccl group must be zipccl.backend.Options, got {type(pg_options).__name__}")
    return ProcessGroupZipccl(opts.store, opts.group_rank, opts.group_size, opts.timeout, pg_options,
                              opts.global_ranks_in_group, opts.group_id)


def _read_settings_again() -> None:
    """ZIPCCL_* variables set after zipccl's import take effect at a zipccl group's making, as
    torch's own do, after the calls issued before, which keep the settings they were issued under;
    on zipccl's own threads (a queued call making its levels' groups) at once: the queue they would
    wait for is waiting for them."""
    if config.changed():
        if not executor.ours():
            executor.drain()
        config.refresh()


_torch_makes_group = dist.distributed_c10d._new_process_group_helper


def _making_group(*args, **kwargs):
    """torch's helper that every rank of the world runs for a new group (``init_process_group``,
    ``new_group``), its members and the others alike: a zipccl group's making reads the settings
    again on all of them, not only where torch makes the backend (its members), so that those
    which every rank must share (config.SHARED) stay alike on the groups made before."""
    backend = kwargs.get("backend", args[3] if len(args) > 3 else "")  # (size, rank, ranks, backend, ...)
    if NAME in str(backend).lower():
        _read_settings_again()
    return _torch_makes_group(*args, **kwargs)


def register() -> None:
    """Register the "zipccl" backend with torch.distributed, and read the settings again where
    any rank makes a zipccl group (``import zipccl`` does it; again is a no-op)."""
    if dist.distributed_c10d._new_process_group_helper is _torch_makes_group:
        dist.distributed_c10d._new_process_group_helper = _making_group
    if NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def step(group=None) -> None:
    """Tell the backend that a training step ended (only lossy compression needs it)."""
    pg = group if group is not None else dist.group.WORLD
    if isinstance(pg, ProcessGroupZipccl):
        pg.step()
