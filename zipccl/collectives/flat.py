"""One flat collective: run with a decided codec (``run_flat``), or validated, planned and queued
(``flat_collective``); the public all_reduce, reduce_scatter and all_gather of zipccl.collectives."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import config
from ..executor import run as _run
from ..failure import REDUCE, Fate
from ..transport.torch_dist import TorchTransport
from .algorithms import _Gather, _reduce_scatter_chunks
from .autoplan import FLAT_PLANS, learns, planned, plans_for, refused
from .metadata import Call, _meta_bytes
from .pipeline import pieces, plain
from .resolve import AUTO, NATIVE, PLAN_CODECS
from .sparse_reduce import _sparse_all_reduce, _sparse_reduce_scatter
from .validation import (carrier, check_shapes, finish, input_size, new_acc, only_layout, prepare, refusal_carrier,
                         refuse)

# ---- one flat collective with a decided codec ----------------------------------------------------------------


class _Rows:
    """``flat`` as the (n, m) chunks of an all-reduce whose length is not a multiple of n, where
    the reduce-scatter reads them, a piece at a time (``rows[j, a:b]``): a view of ``flat``, or
    where the piece reaches past its end, a copy with zeros after it. Padding the whole tensor
    instead copied all of it (a 256 MiB all-reduce of one element more held 256 MiB more)."""

    def __init__(self, flat: torch.Tensor, n: int, m: int):
        self.flat, self.shape, self.dtype, self.device, self.is_cuda = flat, (n, m), flat.dtype, flat.device, flat.is_cuda

    def element_size(self) -> int:
        return self.flat.element_size()

    def __getitem__(self, key) -> torch.Tensor:
        j, columns = key
        a, b, _ = columns.indices(self.shape[1])
        start, end, numel = j * self.shape[1] + a, j * self.shape[1] + max(a, b), self.flat.numel()
        if end <= numel:
            return self.flat[start:end]
        inside = self.flat[min(start, numel):]
        return torch.cat([inside, self.flat.new_zeros(end - start - inside.numel())])


def run_flat(name: str, t, output: torch.Tensor, input: torch.Tensor, op, codec, acc: dict, ready=None,
             fate: Fate | None = None) -> None:
    """``name`` on ``t``'s group with ``codec`` (NATIVE, None or a codec object), on this thread.
    all_reduce works in place on ``input`` (``output`` is the same tensor); there ``ready(a, b)``
    may fill columns [a, b) of the input's world-size chunks just before the pipeline needs them
    (the input's length must then be a multiple of the group's size). ``fate``: the outcome of
    the call this is part of (zipccl.failure), which the caller settles; None: this call's own,
    settled here (every rank raises RankFailure if any failed)."""
    own = fate is None
    alone = own and codec is NATIVE and ready is None and not config.CHECK_NATIVE  # the same on every rank
    if own:
        fate = Fate.of(name, t)
    numel = input.numel()
    if ready is not None and (name != "all_reduce" or numel % t.size or codec in (NATIVE, None)
                              or not getattr(codec, "exact", True)):
        if name != "all_reduce" or numel % t.size:
            raise ValueError("ready() takes an all-reduce whose length is a multiple of the group's size")
        fate.guard(REDUCE, ready, 0, numel // t.size)
        ready = None
    if codec is NATIVE or codec is None:
        t0 = time.perf_counter()
        if codec is None or config.CHECK_NATIVE:
            Call(name, input.dtype, numel, op, None).exchange(t, [], None, fate)
            acc["meta_bytes"] += _meta_bytes(t.size)
        tensors = (input.view(-1),) if name == "all_reduce" else (output.view(-1), input.view(-1))
        try:  # in a failed call too: the peers are in it
            if not fate.broken(t):
                t.native(name, *tensors, op=op)
        except RuntimeError as e:  # the backend lost a rank, or timed out (ZIPCCL_TIMEOUT)
            fate.lose(t, -1, e)
        acc["comm_seconds"] += time.perf_counter() - t0
    elif name == "reduce_scatter" and not getattr(codec, "exact", True):
        _sparse_reduce_scatter(t, input.view(-1), output, op, codec, Call(name, input.dtype, numel, op, codec), acc,
                               fate)
    elif name == "reduce_scatter":
        call = Call(name, input.dtype, numel, op, codec)
        result = _reduce_scatter_chunks(t, input.view(t.size, -1), op, codec, call, acc, fate)
        if not fate.failed:
            output.view(-1).copy_(result)
    elif name == "all_gather":
        mine, outs = input.view(-1), output.view(t.size, -1)
        gather = _Gather(t, codec, Call(name, input.dtype, numel, None, codec), acc, lambda j, a, b: outs[j, a:b],
                         fate)
        for a, b in pieces(numel, t.size, input.element_size(), plain(codec), input.is_cuda):
            gather.push(a, b, mine[a:b])
        gather.finish()
    elif not getattr(codec, "exact", True):
        _sparse_all_reduce(t, input.view(-1), op, codec, Call(name, input.dtype, numel, op, codec), acc, fate)
    else:
        flat, n = input.view(-1), t.size
        m = -(-numel // n)
        chunks = flat.view(n, m) if m * n == numel else _Rows(flat, n, m)
        gather = _Gather(t, codec, None, acc, lambda j, a, b: flat[min(numel, j * m + a):min(numel, j * m + b)], fate)
        call = Call(name, input.dtype, numel, op, codec)
        _reduce_scatter_chunks(t, chunks, op, codec, call, acc, fate,
                               on_piece=gather.push, ready=ready)  # gather each reduced piece as soon as it exists
        gather.finish()
    if alone:
        fate.check()  # the backend's collective alone: it fails as torch.distributed's does, no status round
    elif own:
        fate.settled(t, acc)


def native(name: str, group, output, input, op) -> None:
    """The group's own collective (TorchTransport.native) on the call's tensors as they are:
    a strided one too, which the backend then takes or refuses as torch's call does."""
    if name == "all_reduce":
        TorchTransport.of(group).native(name, input, op=op)
    else:
        TorchTransport.of(group).native(name, _flat(output), _flat(input), op=op)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """One dimension, as the backend's single-tensor calls take it; strided, as it is."""
    return x if x.dim() == 1 or not x.is_contiguous() else x.view(-1)


def refuse_in_step(name: str, group, policy_group, output, input, op, codec, numel: int, nbytes: int, candidates,
                   refusal, error: BaseException) -> dict:
    """An invalid call (its local ``error``). Where its peers' valid calls take a step of
    ``policy_group``'s auto policy (``learns``), the same step among ``candidates()``
    (autoplan.refused: where that step is the group's own collective, a call refused for its
    layout alone goes there, as on its peers, and returns its counters); else ``refusal()``,
    which raises here and on every peer."""
    if learns(codec, input):
        tensors = (input,) if name == "all_reduce" else (output, input)
        as_they_are = only_layout(name, group, tensors, op, codec, numel, nbytes, check_shapes(name, output, input))
        refused(policy_group, name, input.dtype, nbytes, candidates(), refusal,
                (lambda: native(name, group, output, input, op)) if as_they_are else None, input.device, error)
        return finish(name, None, new_acc())
    refusal()


def flat_collective(name: str, group, output, input, op, codec, async_op: bool):
    """One flat collective (the public all_reduce, reduce_scatter and all_gather of this module):
    validated, its codec decided ("auto": among FLAT_PLANS), run now or queued (async_op)."""
    numel, nbytes = input_size(input)
    t, c, error = prepare(name, group, (input,) if name == "all_reduce" else (output, input), op, codec, numel,
                          nbytes, check_shapes(name, output, input))
    device = input.device if isinstance(input, torch.Tensor) else None

    def run():
        if error is not None:
            def refusal(plan=None):  # the peers' plan where auto's policy chose it, else the caller's codec
                refuse(name, refusal_carrier(group, device, PLAN_CODECS[plan] if plan else codec), input, op, error)
            return refuse_in_step(name, group, t.group, output, input, op, codec, numel, nbytes,
                                  lambda: plans_for(FLAT_PLANS, device.type), refusal, error)
        acc, used = new_acc(), [c]
        if c is AUTO:
            def go(plan):
                used[0] = PLAN_CODECS[plan]
                run_flat(name, carrier(group, device, used[0]), output, input, op, used[0], acc)
            planned(t.group, name, input.dtype, nbytes, plans_for(FLAT_PLANS, device.type), go, device)
        else:
            run_flat(name, carrier(group, device, c), output, input, op, c, acc)
        return finish(name, used[0], acc)

    return _run(run, async_op, (output, input))


# ---- public API: the flat collectives (zipccl.all_reduce & co. add topology and lossy state on top) -----------


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                   async_op: bool = False, *, codec="auto"):
    """Like ``dist.reduce_scatter_single``: ``input`` holds world-size chunks of ``output.numel()``;
    rank r receives the reduction of every rank's chunk r in ``output``."""
    return flat_collective("reduce_scatter", group, output, input, op, codec, async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False, *, codec="auto"):
    """Like ``dist.all_gather_single``: ``output`` receives every rank's ``input`` in rank order."""
    return flat_collective("all_gather", group, output, input, None, codec, async_op)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False, *, codec="auto"):
    """Like ``dist.all_reduce``, in place; every rank ends with bit-identical results.

    codec: "auto" (the backend's own collective, raw or lossless, learned per group:
    zipccl.auto; never lossy), "native", "raw", "lossless", or opt-in lossy: "topk"
    (TopK(0.01)) or a TopK instance."""
    return flat_collective("all_reduce", group, tensor, tensor, op, codec, async_op)
