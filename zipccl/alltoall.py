"""The front door of all-to-all: zipccl.all_to_all_single and zipccl.all_to_all.

Shaped like torch.distributed's, plus ``codec`` and ``algorithm``. A call either runs the
backend's own all-to-all ("native"), or zipccl's (zipccl.collectives.alltoall): each rank's chunk
for each peer is one packet, its codec chosen per link. ``algorithm="hierarchical"`` sends the
peers inside this rank's node the plain bytes and the peers in other nodes ``codec``'s packets
(zipccl.topology finds the nodes); a mapping ``{"intra": ..., "inter": ...}`` names both;
``codec="auto"`` learns, per group and class of calls (dtype, the bytes per rank), which of
the backend's all-to-all, lossless on every link, or lossless across nodes only, is fastest
(zipccl.auto). On one node "auto" is the backend's all-to-all, with nothing of zipccl's on the
wire; once a call has found the nodes, later calls there go to the backend at once, as
zipccl.api's small ones do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist

from . import config, executor, topology
from .api import _outside_autograd
from .collectives.alltoall import counts_row, exchange_counts, run_all_to_all
from .collectives.autoplan import among, planned
from .collectives.links import PLAIN, Links, per_peer
from .collectives.metadata import Call, timed
from .collectives.pipeline import plain
from .collectives.resolve import AUTO, NATIVE, resolve_codec
from .collectives.validation import _check_device, _check_tensor, check_carrier, finish, new_acc, overlaps
from .errors import UnsupportedError
from .executor import run as _run
from .failure import Fate
from .format import DTYPE_CODES
from .stats import record_native
from .torch_compat import not_in
from .transport import TorchTransport, transport_for
from .transport.torch_dist import ALL_TO_ALL, as_they_are, direct_group, options, underneath

__all__ = ["all_to_all_single", "all_to_all", "ALGORITHMS", "AUTO_PLANS"]

ALGORITHMS = ("auto", "flat", "hierarchical")
#: What codec="auto" measures where the group spans several nodes: the backend's all-to-all,
#: lossless packets to every peer, lossless packets across nodes and plain bytes inside them.
AUTO_PLANS = ("native", "lossless", "hierarchical/lossless")
_LEVELS = ("intra", "inter")
_NAME = "all_to_all"


def _native_single(group, output, input, out_splits, in_splits) -> None:
    """The backend's all_to_all_single: on the drop-in's backend underneath, else on the group
    itself where dist's checks would pass the tensors as they are (as TorchTransport.native),
    else through dist."""
    if overlaps(output, input):  # in place: the backend would overwrite parts not yet sent
        input = input.clone()
    output, input = _real(output), _real(input)
    inner = underneath(group, input.device)
    pg = direct_group(group) if inner is None and as_they_are((output, input)) else None
    if inner is not None:
        work = inner.alltoall_base(output, input, list(out_splits or []), list(in_splits or []),
                                   dist.AllToAllOptions())
    elif pg is not None:
        work = getattr(pg, ALL_TO_ALL)(output, input, list(out_splits or []), list(in_splits or []),
                                       options(dist.AllToAllOptions, True))
    else:
        work = dist.all_to_all_single(output, input, out_splits, in_splits, group=group, async_op=True)
    work.wait()


def _native_list(group, outputs, inputs) -> None:
    """The backend's list all-to-all on the tensors' flat views; where they differ in size
    (gloo's takes one size only), its all_to_all_single on the tensors put end to end."""
    if len({x.numel() for x in outputs + inputs}) > 1:
        out = outputs[0].new_empty(sum(x.numel() for x in outputs))
        _native_single(group, out, torch.cat([x.reshape(-1) for x in inputs]), [x.numel() for x in outputs],
                       [x.numel() for x in inputs])
        for x, part in zip(outputs, out.split([x.numel() for x in outputs])):
            x.copy_(part.view_as(x))
        return
    inputs = [x.clone() if any(overlaps(x, y) for y in outputs) else x for x in inputs]  # in place, as above
    # flat: gloo's list call takes one shape, not only one size (contiguous here: ``_dense``)
    outputs, inputs = [_real(x).view(-1) for x in outputs], [_real(x).view(-1) for x in inputs]
    inner = underneath(group, inputs[0].device)
    work = dist.all_to_all(outputs, inputs, group=group, async_op=True) if inner is None else \
        inner.alltoall(outputs, inputs, dist.AllToAllOptions())
    work.wait()


def _real(x: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real view (one more dim of 2, the rows' splits unchanged), as
    torch.distributed hands it to a backend: gloo's and NCCL's own calls take no complex type."""
    return torch.view_as_real(x) if x.is_complex() else x


def _level(c, dtype):
    """A link's codec: "native" is the plain bytes (PLAIN); "raw" of a type no codec takes too."""
    if c == "native" or c is NATIVE:
        return PLAIN
    if c == "auto":
        raise ValueError("a per-link codec takes 'native', 'raw', 'lossless' or a codec instance; "
                         "codec='auto' chooses the links' codecs itself")
    r = resolve_codec(c, dtype, 0)
    if r is None or plain(r):  # "raw": the tensor's own bytes, no packet (so no copy at either end)
        return PLAIN
    if not getattr(r, "exact", True):
        raise UnsupportedError(f"lossy codec {r!r} reduces: all_reduce and reduce_scatter only, not all-to-all")
    return r


def _fixed_levels(codec, algorithm: str, dtype):
    """(intra, inter) codecs of a call whose codec is fixed, or NATIVE (the backend's call)."""
    if isinstance(codec, Mapping):
        if set(codec) != set(_LEVELS):
            raise ValueError(f"a per-link codec maps both of {_LEVELS} (got {sorted(codec)})")
        if algorithm == "flat":
            raise ValueError("a per-link codec needs algorithm 'hierarchical' or 'auto'")
        return tuple(_level(codec[k], dtype) for k in _LEVELS)
    if codec == "native" or codec is NATIVE:
        return NATIVE
    c = _level(codec, dtype)
    return (PLAIN, c) if algorithm == "hierarchical" else (c, c)


def _even(x: torch.Tensor, n: int, label: str) -> list[int]:
    if x.dim() == 0 or x.shape[0] % n:
        raise ValueError(f"{label} has {x.shape[0] if x.dim() else 0} rows: without split sizes they must divide "
                         f"evenly among the group's {n} ranks")
    return [x.shape[0] // n] * n


def _split_sizes(x: torch.Tensor, splits, n: int, label: str) -> list[int]:
    """``splits`` checked against ``x``'s rows (None or empty: even, as torch)."""
    splits = [int(s) for s in splits] if splits else _even(x, n, label)
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != (x.shape[0] if x.dim() else 1):
        raise ValueError(f"{label} split sizes {splits} must be {n} counts >= 0 that add up to its "
                         f"{x.shape[0] if x.dim() else 1} rows")
    return splits


def _rows(x: torch.Tensor, splits, n: int, label: str) -> list[torch.Tensor]:
    """``x`` cut along dim 0 by ``splits`` (``_split_sizes``), each part flat."""
    splits = _split_sizes(x, splits, n, label)
    per_row = math.prod(x.shape[1:])
    flat, out, at = x.reshape(-1), [], 0
    for s in splits:
        out.append(flat[at * per_row:(at + s) * per_row])
        at += s
    return out


def goes_native(group, tensors, codec, algorithm: str) -> bool:
    """Whether an all-to-all goes to the backend's call alone, decided without an exchange from
    what every rank of the group shares: codec "native", or codec and algorithm "auto" on a group
    that an earlier call found to be one node, where auto always hands the call to the backend.
    Never from the call's sizes, splits, layouts or ``async_op``, which differ from rank to rank:
    a rank that took zipccl's path (whose first call makes groups) while its peers made the
    backend's call would wait for good. The caller then makes the backend's call, with its own
    checks, after the async calls queued before it (``executor.drain``)."""
    if config.CHECK_NATIVE:
        return False
    for x in tensors:
        if not isinstance(x, torch.Tensor):
            return False
    if codec == "native" or codec is NATIVE:
        return True
    if codec != "auto" or algorithm != "auto":
        return False
    found = topology.found(group)
    return len(found.nodes) == 1 if found is not None else dist.get_world_size(group) == 1  # one rank: no nodes found


def _natively(native, tensors, async_op: bool, after=None):
    """The backend's all-to-all, ``native()``, for ``goes_native``: after the async calls queued
    before it, here or (``async_op``) queued behind them; then ``after()``."""
    def call():
        native()
        record_native(_NAME)
        if after is not None:
            after()
    return _run(call, async_op, tensors)


def _validate(outputs, inputs, device_tensors, t):
    """The local checks of a call (types, layout, device, one dtype)."""
    _tensors(outputs, inputs)
    _check_device(t, *device_tensors)


def _tensors(outputs, inputs) -> None:
    """Tensors, contiguous, of one dtype. On the backend's path too: a check that fails inside the
    backend's call would leave its group out of step (gloo's), so it is raised here first."""
    for label, x in (("output", outputs), ("input", inputs)):
        for y in x:
            _check_tensor(label, y)
    dtypes = {y.dtype for y in outputs + inputs}
    if len(dtypes) > 1:
        raise ValueError(f"all-to-all tensors must have one dtype, got {sorted(map(str, dtypes))}")


def _check_single(group, output, input, out_splits, in_splits) -> None:
    """``_tensors`` and ``_split_sizes`` of an all_to_all_single, the common call (contiguous,
    one dtype, even splits) in about a microsecond."""
    n = dist.get_world_size(group)
    if not (out_splits or in_splits) and output.dtype == input.dtype and output.dim() and input.dim() \
            and not (output.shape[0] % n or input.shape[0] % n) and output.is_contiguous() and input.is_contiguous() \
            and output.numel() == input.numel():
        return
    _tensors([output], [input])
    _own_part(_rows(input, in_splits, n, "input"), _rows(output, out_splits, n, "output"), dist.get_rank(group))


def _own_part(sends: list, recvs: list, rank: int) -> None:
    """What a rank sends itself is what it receives from itself: the one count of the call that a
    rank can check alone (the backend's own check, gloo's "inLengthPerRank[myRank] ==
    outLengthPerRank[myRank]", would raise as a lost connection). ``rank``: its place in the
    call's group; the error names its rank in the job, as its peers' errors do."""
    if sends[rank].numel() != recvs[rank].numel():
        raise ValueError(f"rank {dist.get_rank()} sends itself {sends[rank].numel()} elements but receives "
                         f"{recvs[rank].numel()} from itself: its input and output splits disagree")


def _one_per_rank(outputs, inputs, n: int) -> None:
    if len(outputs) != n or len(inputs) != n:
        raise ValueError(f"all_to_all takes one tensor per rank ({n}), got {len(outputs)} outputs and "
                         f"{len(inputs)} inputs")


def _call(group, make_parts, native, tensors, codec, algorithm: str, async_op: bool, after=None):
    """One all-to-all: ``make_parts(t)`` cuts the caller's tensors into per-peer flat views
    (sends, recvs) or raises; ``native()`` is the backend's call; ``after()`` once it succeeded."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r}: use one of {ALGORITHMS}")
    first = next((x for x in tensors if isinstance(x, torch.Tensor)), None)
    own = TorchTransport.of(group)  # the checks and the backend's call: no communicator of zipccl's
    n, error, sends, recvs = own.size, None, None, None
    dtype = first.dtype if first is not None else None
    try:
        sends, recvs = make_parts(own)
        levels = None if codec == "auto" else _fixed_levels(codec, algorithm, dtype)
    except Exception as e:  # noqa: BLE001 - a local error still joins the exchange, so that no rank hangs
        error, levels = e, None

    def run():
        acc = new_acc()
        alone = codec == "native" or codec is NATIVE  # the backend's call alone, with its own checks
        # the nodes, found on the group's first call (a collective: before any rank's error exchange)
        topo = topology.topology(group) if n > 1 and not alone else None
        nodes = len(topo.nodes) if topo is not None else 1
        # auto on one node: every link outruns the codec
        if alone or (codec == "auto" and (nodes == 1 or dtype not in DTYPE_CODES or not _carried(group, first))):
            fate = Fate.of(_NAME, own)
            if config.CHECK_NATIVE:  # the counts first, on every rank: an invalid call raises on all of them
                row = counts_row(sends, recvs) if error is None else [0] * (2 * n)
                exchange_counts(own, Call(_NAME, dtype, 0, None, NATIVE), row, error, fate, acc)
            elif error is not None:  # the other ranks make the backend's call: fail as it does, here alone
                raise error
            return _native(native, acc, fate, own)
        # zipccl's packets (or auto's choice among them and the backend's call): on CUDA tensors
        # NCCL's communicators, made here, in the same call on every rank
        t = transport_for(group, first.device if first is not None else None)
        fate = Fate.of(_NAME, t)
        row = counts_row(sends, recvs) if error is None else [0] * (2 * n)
        if error is not None:
            Call(_NAME, dtype, 0, None, None).exchange(t, row, error, fate)
        if levels is not None:
            one = levels[0] is levels[1] or topo is None  # a group of one rank: no link but its own
            codecs = [levels[1]] * n if one else per_peer(topo.nodes, t.rank, *levels)
            plan = levels[1] if one else Links(*levels)
            matrix = exchange_counts(t, Call(_NAME, dtype, 0, None, plan), row, None, fate, acc)
            return _pipeline(t, sends, recvs, codecs, matrix, plan, acc, fate)
        local = any(len(node) > 1 for node in topo.nodes)
        plans = {"flat": AUTO_PLANS[:2], "hierarchical": AUTO_PLANS[2:]}.get(algorithm, AUTO_PLANS if local else
                                                                               AUTO_PLANS[:2])
        with among(plans):  # the signature names the candidates: ranks of another algorithm raise
            matrix = exchange_counts(t, Call(_NAME, dtype, 0, None, AUTO), row, None, fate, acc)
        nbytes = sum(sum(r[:n]) for r in matrix) * sends[0].element_size() // n
        if not config.AUTO_LEARN:
            inter = resolve_codec("auto", dtype, nbytes)
            codecs = per_peer(topo.nodes, t.rank, PLAIN, inter)
            return _pipeline(t, sends, recvs, codecs, matrix, Links(PLAIN, inter), acc, fate)
        out = [None]

        def go(plan: str) -> None:
            if plan == "native":
                out[0] = _native(native, acc, fate, t, record_it=False)
                return
            inter = resolve_codec("lossless", dtype, nbytes)
            intra = PLAIN if plan.startswith("hierarchical/") else inter
            codecs = per_peer(topo.nodes, t.rank, intra, inter)
            out[0] = _pipeline(t, sends, recvs, codecs, matrix, Links(intra, inter) if intra is PLAIN else inter,
                               acc, fate, record_it=False)

        planned(t.group, _NAME, dtype, nbytes, plans, go, first.device)
        return finish(_NAME, out[0], acc)

    def then():
        result = run()
        if after is not None:
            after()
        return result
    return _run(then, async_op, tensors)


def _carried(group, first) -> bool:
    """Whether a transport can carry zipccl's packets of the call's tensors (not CUDA tensors on
    gloo without the GPU extra): the same on every rank. Where none can, auto is the backend's."""
    if first is None:  # no tensor: the call's own checks raise
        return True
    try:
        check_carrier(group, first.device)
    except UnsupportedError:
        return False
    return True


def _native(native, acc: dict, fate: Fate, t, record_it: bool = True):
    """The backend's all-to-all, failing as torch.distributed's does (no status round)."""
    try:
        timed(acc, "comm_seconds", native)
    except RuntimeError as e:  # the backend lost a rank, or timed out
        fate.lose(t, -1, e)
    fate.check()
    return finish(_NAME, NATIVE, acc) if record_it else NATIVE


def _pipeline(t, sends, recvs, codecs, matrix, plan, acc: dict, fate: Fate, record_it: bool = True):
    """zipccl's all-to-all after the counts' exchange, then the status round (every rank raises
    if any failed: zipccl.failure)."""
    if any(overlaps(s, r) for s in sends for r in recvs):
        sends = [s.clone() for s in sends]  # in place: the output overwrites input not yet sent
    run_all_to_all(t, sends, recvs, codecs, matrix, acc, fate)
    fate.settled(t, acc)
    return finish(_NAME, plan, acc) if record_it else plan


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False, *, codec="auto", algorithm: str = "auto"):
    """Like ``dist.all_to_all_single``: ``input`` cut along dim 0 by ``input_split_sizes`` (None:
    evenly), part j to rank j; ``output`` receives rank j's part for this rank at its place among
    ``output_split_sizes``. Uneven and zero splits are fine. Where zipccl moves the data, every
    rank checks every rank's counts against its peers' before any data moves; the backend's own
    call (native, auto's plain plan) takes the counts as given, as torch's does, unless
    ``ZIPCCL_CHECK_NATIVE=1`` exchanges them first.

    codec: "auto" (default: the backend's all-to-all, or zipccl's packets where they were
    measured faster: see the module's docstring), "native" (the backend's call alone), "raw",
    "lossless", a codec instance, or a mapping per link ``{"intra": "native", "inter":
    "lossless"}`` ("native" on a link: the plain bytes, through zipccl's transport).
    algorithm: "auto", "flat" (one codec on every link) or "hierarchical" (plain bytes inside
    the node, ``codec`` across nodes)."""
    if not_in(group, "all_to_all_single"):
        return None
    output, input = _outside_autograd(output), _outside_autograd(input)

    def native():
        _native_single(group, output, input, output_split_sizes, input_split_sizes)
    if goes_native(group, (output, input), codec, algorithm):
        _check_single(group, output, input, output_split_sizes, input_split_sizes)
        return _natively(native, (output, input), async_op)

    def parts(t):
        for label, x in (("output", output), ("input", input)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{label} must be a torch.Tensor, got {type(x).__name__}")
        _validate([output], [input], (output, input), t)
        sends, recvs = _rows(input, input_split_sizes, t.size, "input"), _rows(output, output_split_sizes, t.size,
                                                                               "output")
        _own_part(sends, recvs, t.rank)
        return sends, recvs

    return _call(group, parts, native, (output, input), codec, algorithm, async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False, *, codec="auto",
               algorithm: str = "auto"):
    """Like ``dist.all_to_all``: ``input_tensor_list[j]`` goes to rank j, ``output_tensor_list[j]``
    receives rank j's tensor for this rank (any sizes, one dtype). ``codec`` and ``algorithm``
    as in ``all_to_all_single``."""
    if not_in(group, "all_to_all"):
        return None
    outputs = [_outside_autograd(x) for x in output_tensor_list]
    inputs = [_outside_autograd(x) for x in input_tensor_list]
    given, outputs = outputs, [_dense(x) for x in outputs]
    inputs = [x.contiguous() if isinstance(x, torch.Tensor) and not x.is_sparse else x for x in inputs]
    staged = [(x, y) for x, y in zip(given, outputs) if x is not y]

    def back():  # strided outputs, received into contiguous ones
        for x, y in staged:
            x.copy_(y)

    def native():
        _native_list(group, outputs, inputs)
    if outputs and inputs and goes_native(group, outputs + inputs, codec, algorithm):
        _one_per_rank(outputs, inputs, dist.get_world_size(group))
        _tensors(outputs, inputs)
        _own_part(inputs, outputs, dist.get_rank(group))
        return _natively(native, tuple(given + outputs + inputs), async_op, back if staged else None)

    def parts(t):
        _one_per_rank(outputs, inputs, t.size)
        _validate(outputs, inputs, outputs + inputs, t)
        _own_part(inputs, outputs, t.rank)
        return [x.reshape(-1) for x in inputs], [x.reshape(-1) for x in outputs]

    return _call(group, parts, native, tuple(given + outputs + inputs), codec, algorithm, async_op,
                 back if staged else None)


def _dense(x):
    """``x``, or a contiguous tensor of its shape where it is strided (torch's list all-to-all
    takes those; zipccl's packets and gloo's call take flat memory). Not a tensor: as it is,
    for the call's checks to refuse."""
    if not isinstance(x, torch.Tensor) or x.is_contiguous() or x.is_sparse:
        return x
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
