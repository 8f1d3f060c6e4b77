"""A call's local checks (tensors, devices, sizes, op, codec) and its accounting; an invalid call still
joins the metadata exchange (``refuse``) so that no rank hangs."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import config
from ..errors import UnsupportedError
from ..stats import record as _record
from ..transport import TorchTransport, transport_for
from ..transport.select import choose
from ..transport import nccl_stack
from .metadata import Call
from .resolve import _OPS, AUTO, NATIVE, check_op, resolve_codec, sums


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_contiguous():
        raise UnsupportedError(f"{name} must be contiguous")
    if x.is_conj() or x.is_neg():  # its memory holds other values than it reads as: resolved, as torch's calls want
        raise UnsupportedError(f"{name} is a conjugated (or negated) view: pass x.resolve_conj() (resolve_neg())")


def _check_device(t, *tensors: torch.Tensor) -> None:
    """The tensors on one device that the group ``t`` (its TorchTransport) takes: its messages'
    device, or CUDA (its own collective, or zipccl's NCCL transport: ``carrier``)."""
    devices = {x.device for x in tensors}
    if len(devices) > 1:
        raise UnsupportedError(f"tensors are on different devices: {sorted(map(str, devices))}")
    dev = devices.pop()
    if dev.type != t.meta_device.type and dev.type != "cuda":
        raise UnsupportedError(f"the process group's backend ({t.backend}) takes {t.meta_device.type.upper()} "
                               f"tensors here, got a tensor on {dev}")


def check_carrier(group, device) -> None:
    """UnsupportedError where no transport can carry the packets of a plan that compresses
    tensors on ``device`` (zipccl.transport.select.choose), without making one."""
    if device.type == "cuda":
        choose("cuda", dist.get_backend(group), config.TRANSPORT, nccl_stack.extra_installed())


def carrier(group, device, codec):
    """The transport of a plan with ``codec`` (resolved) on ``group``'s tensors on ``device``: the
    group's own (TorchTransport: its own collective and, on CPU, the pipeline) where the plan does
    not compress (NATIVE, or None: the backend's collective after zipccl's metadata exchange),
    else transport_for's (on CUDA NcclTransport, whose communicators are made on its first use:
    the first plan that compresses, in the same call on every rank)."""
    if codec is NATIVE or codec is None or device is None or device.type != "cuda":
        return TorchTransport.of(group)
    return transport_for(group, device)


def refusal_carrier(group, device, inter):
    """Where an invalid call joins its peers' exchange: the transport of their plan, as
    ``carrier`` gives theirs. ``inter``: that plan's codec (between the nodes, for a hierarchical
    one), or where no policy chose it, what the caller asked for (a name, an instance). On CUDA a
    plan that compresses exchanges on the transport made for that, not on the group's own."""
    if inter is NATIVE or (isinstance(inter, str) and inter == "native") or device is None or device.type != "cuda":
        return carrier(group, device, NATIVE)
    try:
        check_carrier(group, device)
    except UnsupportedError:
        return carrier(group, device, NATIVE)  # nothing compresses here: the peers' calls neither
    return transport_for(group, device)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors may share memory (an in-place call's input and output): their byte
    ranges where both are contiguous, else their storage alone."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if not (a.is_contiguous() and b.is_contiguous()):
        return True
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def input_size(x) -> tuple[int, int]:
    """(numel, bytes) of a call's input; -1 elements for a non-tensor (the call fails validation)."""
    if not isinstance(x, torch.Tensor):
        return -1, 0
    return x.numel(), x.numel() * x.element_size()


def _world_multiple(name, big_label, big, small_label, small):
    """The size check of reduce-scatter and all-gather: one buffer holds world-size x the other."""
    def check(t):
        if big.dtype != small.dtype:
            raise ValueError(f"{big_label} is {big.dtype} but {small_label} is {small.dtype}")
        if big.numel() != t.size * small.numel():
            raise ValueError(f"{name} {big_label} has {big.numel()} elements; it must have world size ({t.size}) "
                             f"x {small_label} ({small.numel()}) = {t.size * small.numel()}")
    return check


def prepare(name, group, tensors, op, codec, numel, nbytes, check):
    """Validate locally: (the group's own transport (TorchTransport, made once; a plan that
    compresses runs on ``carrier``'s), the resolved codec (AUTO where "auto" learns), the error
    or None). A call with an error must still join the metadata exchange (``refuse``), in its
    place in the order of calls, so that no rank hangs. "auto" where nothing could carry
    compressed packets (CUDA tensors on a group of gloo without the GPU extra) is the group's
    own collective."""
    dtype = tensors[-1].dtype if isinstance(tensors[-1], torch.Tensor) else None
    t = TorchTransport.of(group)
    error, resolved = None, None
    try:
        for label, x in zip(("tensor",) if len(tensors) == 1 else ("output", "input"), tensors):
            _check_tensor(label, x)
        _check_device(t, *tensors)
        if op is not None or name != "all_gather":  # a reduction's op=None: refused on every rank, as torch's
            check_op(op)
            if _OPS[op] == 2 and not (dtype.is_floating_point or dtype.is_complex):
                raise UnsupportedError("AVG of integer tensors is not supported; use SUM and divide")
        resolved = codec if codec is AUTO else resolve_codec(codec, dtype, nbytes)
        if codec == "auto" and resolved is not NATIVE and config.AUTO_LEARN:
            resolved = AUTO
        if resolved is not NATIVE and resolved is not None:
            try:
                check_carrier(group, tensors[-1].device)
            except UnsupportedError:
                if resolved is not AUTO and codec != "auto":
                    raise
                resolved = NATIVE
        if not getattr(resolved, "exact", True):
            if name == "all_gather":
                raise UnsupportedError(f"lossy codec {resolved!r} reduces: all_reduce and reduce_scatter only, "
                                       f"not {name}")
            if not sums(op):
                raise UnsupportedError(f"lossy codec {resolved!r} reduces with SUM or AVG only")
        check(t)
    except (TypeError, ValueError, UnsupportedError) as e:
        error = e
    return t, resolved, error


def only_layout(name, group, tensors, op, codec, numel, nbytes, check) -> bool:
    """Whether a call that ``prepare`` refused is refused for its layout alone (a strided tensor,
    which the group's own collective takes as torch's call does): its contiguous copies pass."""
    if not all(isinstance(x, torch.Tensor) for x in tensors) or all(x.is_contiguous() for x in tensors):
        return False
    return prepare(name, group, tuple(x.contiguous() for x in tensors), op, codec, numel, nbytes, check)[2] is None


def refuse(name: str, t, input, op, error: Exception) -> None:
    """Raise ``error`` here, and MismatchError on the group's other ranks, whose calls are in
    their metadata exchange (an invalid call's only message)."""
    numel, _ = input_size(input)
    Call(name, input.dtype if isinstance(input, torch.Tensor) else None, numel, op, None).exchange(t, [], error)


def check_shapes(name: str, output, input):
    """The size check of a call: all-reduce has one tensor; reduce-scatter's input and
    all-gather's output hold world-size x the other."""
    if name == "all_reduce":
        return lambda t: None
    if name == "reduce_scatter":
        return _world_multiple(name, "input", input, "output", output)
    return _world_multiple(name, "output", output, "input", input)


def finish(name, codec, acc) -> dict:
    _record(name, getattr(codec, "name", "native") if codec is not None else "native", **acc)
    return acc


def new_acc():
    return dict(raw_bytes=0, wire_bytes=0, meta_bytes=0, codec_seconds=0.0, comm_seconds=0.0)
