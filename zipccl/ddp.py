"""DDP communication hook: compressed gradient all-reduce with PyTorch's hook contract.

    import zipccl.ddp
    state = zipccl.ddp.State(codec="lossless")
    model.register_comm_hook(state, zipccl.ddp.hook)

To send bf16 gradients (half the bytes before compression), register
``zipccl.ddp.bf16_hook``. PyTorch's own ``default_hooks.bf16_compress_wrapper(zipccl.ddp.hook)``
composes too on CUDA with NCCL; on CPU, DDP refuses any hook *named*
``bf16_compress_wrapper_hook``, which is why zipccl ships its own.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as real types.
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from . import api, collectives
from .stats import stats as _snapshot
from .entropy import EntropyRate
from .errors import UnsupportedError
from .feedback import check_saved_by, rank_in
from .lossy import Compressor
from .rules import LayerRules, segments
from .topk import TopK

__all__ = ["State", "hook", "bf16_hook"]


class State:
    """Hook state: the group, the codec, and counters of what the hook moved.

    group: process group to reduce over (None: the default group; the process
        must be a member).
    codec: "lossless" (default: bit-exact, bf16 gradients shrink to ~0.67),
        "raw", "native" (the backend's all-reduce), "auto" (the plan the group's calls
        measured fastest: native, raw, lossless, or hierarchical ones: zipccl.auto; never
        lossy), a per-level mapping ({"intra": "shm", "inter": "lossless"}),
        a codec instance, or the lossy, opt-in "topk" (fixed ``density``) and
        "entropy" (density from the gradient-entropy trend, ``rate``), both with
        error feedback: what a step does not send is added to the next step's
        gradient (``residual_dtype`` float32, or bfloat16 for half the memory).
    rules: for lossy codecs, which parameters stay lossless (``zipccl.rules.LayerRules``:
        by default 1-D tensors, tensors under 4096 elements, and names with "bias", "norm"
        or "ln"; names are known when ``model`` is given). ``rules=None`` sends whole
        buckets lossy. ``sampled=True``: top-k by a sampled threshold (zipccl.codecs.TopK).
        ``value_dtype=torch.bfloat16``: lossy values travel as bf16 (zipccl.lossy.Compressor).
    algorithm: "auto", "flat" or "hierarchical", as in zipccl.all_reduce (exact codecs only).
    Gradients are averaged over the group, reduced in rank order with fp32
    accumulation for 16-bit buckets (per hop under ZIPCCL_REDUCE_SCATTER=ring),
    so every rank gets identical bits. The
    state pickles for checkpoints: the counters and residuals are kept, the group
    and the parameter names dropped (they belong to the process: ``attach`` them
    again after loading).
    """

    __slots__ = ("group", "codec", "algorithm", "iterations", "raw_bytes", "wire_bytes", "codec_seconds", "comm_seconds",
                 "density", "compressor", "rate", "residuals", "densities", "rules", "names", "layouts", "members",
                 "used", "first_lossy", "parts", "saved_by", "last_index")

    def __init__(self, group: Optional[dist.ProcessGroup] = None, codec="lossless", density: float = 0.01,
                 rate: Optional[EntropyRate] = None, residual_dtype: torch.dtype = torch.float32,
                 rules: Optional[LayerRules] = LayerRules(), model: Optional[torch.nn.Module] = None,
                 sampled: bool = False, value_dtype: Optional[torch.dtype] = None, algorithm: str = "auto"):
        if isinstance(codec, str):
            if codec not in ("raw", "lossless", "native", "auto", "topk", "entropy"):
                raise ValueError(f"unknown codec {codec!r}: use 'native', 'raw', 'lossless', 'auto', 'topk', "
                                 "'entropy', a per-level mapping or a codec instance")
        elif isinstance(codec, dict):
            pass  # checked by zipccl.api on the first bucket, the same way on every rank
        elif not all(hasattr(codec, m) for m in ("encode", "decode", "max_encoded_size")):
            raise ValueError(f"codec {codec!r} lacks encode/decode/max_encoded_size")
        _check_member(group)
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if algorithm not in api.ALGORITHMS:
            raise ValueError(f"algorithm {algorithm!r}: use one of {api.ALGORITHMS}")
        self.group, self.codec, self.algorithm = group, codec, algorithm
        self.density = density
        self.compressor = Compressor(codec, density, rate, residual_dtype, rules, sampled, value_dtype) \
            if self.lossy else None
        self.rate = self.compressor.rate if self.lossy else None          # shared with the compressor,
        self.residuals = self.compressor.residuals if self.lossy else None  # for stats and checkpoints
        self.densities: list = self.compressor.densities if self.lossy else []
        self.rules = rules
        self.names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self.layouts: dict = {}  # bucket key -> (lossy index, exact index) or None
        self.members: dict = {}  # bucket key -> the ids of its parameters, in order (this process's)
        self.used: set = set()  # the keys of this step's buckets so far
        self.last_index = -1  # the index of this step's latest bucket so far (DDP runs them in order)
        self.parts: dict = {}  # bucket key -> its residual's parameters in order, as (name, numel); None: taken
        self.saved_by = None  # (rank, world size) of the group that pickled this state, for attach's check
        self.first_lossy = -1  # the step whose first bucket with a lossy part has been seen
        self.iterations = 0
        self.raw_bytes = self.wire_bytes = 0
        self.codec_seconds = self.comm_seconds = 0.0

    def _add(self, call: dict) -> None:
        self.raw_bytes += call["raw_bytes"]
        self.wire_bytes += call["wire_bytes"]
        self.codec_seconds += call["codec_seconds"]
        self.comm_seconds += call["comm_seconds"]

    @property
    def lossy(self) -> bool:
        return isinstance(self.codec, TopK) or (isinstance(self.codec, str) and self.codec in ("topk", "entropy"))

    def stats(self) -> dict:
        """Bytes this rank would send uncompressed and did send, seconds in codec vs communication;
        for lossy codecs also the density per step, the entropy decisions and the residuals' memory."""
        out = dict(iterations=self.iterations, raw_bytes=self.raw_bytes, wire_bytes=self.wire_bytes,
                   ratio=self.wire_bytes / self.raw_bytes if self.raw_bytes else 1.0,
                   codec_seconds=self.codec_seconds, comm_seconds=self.comm_seconds)
        if self.lossy:
            out.update(densities=list(self.densities), residual_bytes=self.residuals.memory_bytes(),
                       decisions=list(self.rate.decisions) if self.rate else [])
        return out

    def attach(self, group: Optional[dist.ProcessGroup] = None, model: Optional[torch.nn.Module] = None) -> "State":
        """Give a state loaded from a checkpoint this process's group and ``model``'s parameter
        names (the layer rules' names), which pickling drops; returns the state. Residuals are
        rank-local: a state that holds some, saved by another rank or world size, is refused; so
        is one whose residuals are held by parameter name, attached without ``model``."""
        _check_member(group)
        held = self.residuals is not None and bool(self.residuals.store)
        check_saved_by(self.saved_by, rank_in(group), held)
        if held and model is None and not self.names and any(_by_name(v) for v in self.parts.values()):
            raise ValueError("these error-feedback residuals are held by parameter name (the state was made with "
                             "model=...): attach(group, model=model), or they would be dropped, not applied")
        self.group = group
        if model is not None:
            self.names = {id(p): n for n, p in model.named_parameters()}
            self.layouts, self.members = {}, {}
            _match_model(self, model)
        return self

    def __getstate__(self):  # parameter ids and bucket layouts belong to this process: rebuilt on use
        local = ("group", "names", "layouts", "members", "used", "last_index")
        parts = {k: v for k, v in self.parts.items() if not v or _by_name(v)}  # not by ids, which are this process's
        return {**{k: getattr(self, k) for k in self.__slots__ if k not in local}, "parts": parts,
                "saved_by": rank_in(self.group)}

    def __setstate__(self, state):
        self.group, self.names, self.layouts, self.algorithm = None, {}, {}, "auto"  # older checkpoints: no algorithm
        self.parts = {}  # nor parts
        self.members, self.used, self.first_lossy, self.saved_by, self.last_index = {}, set(), -1, None, -1
        for k, v in state.items():
            setattr(self, k, v)


def _match_model(state: State, model: torch.nn.Module) -> None:
    """Name the residuals' parameters by ``model`` (those held by this process's ids, made
    without it), and drop those of parameters it does not have at their size (removed, reshaped,
    or an id not the model's), which no bucket would ever take, saying so."""
    numels = {n: p.numel() for n, p in model.named_parameters()}
    store, dropped = state.residuals.store if state.residuals is not None else {}, []
    for k, parts in list(state.parts.items()):
        if not parts or k not in store:
            continue
        at, kept = 0, []
        for name, numel in parts:
            if isinstance(name, tuple):  # ("id", id(p))
                name = state.names.get(name[1], name)
            if name is not None and numels.get(name) != numel:
                store[k][at:at + numel].zero_()
                dropped.append(str(name))
                name = None
            kept.append((name, numel))
            at += numel
        state.parts[k] = tuple(kept)
        if all(name is None for name, _ in kept):
            del store[k], state.parts[k]
    if dropped:
        warnings.warn(f"zipccl.ddp: error-feedback residuals of {', '.join(sorted(dropped))} dropped: the model has no "
                      "such parameter of that size", RuntimeWarning, stacklevel=3)


def _by_name(parts) -> bool:
    """Whether a residual's ``parts`` name parameters by the model's names (not by ids)."""
    return bool(parts) and any(isinstance(n, str) for n, _ in parts)


def _check_member(group) -> None:
    if group is not None and dist.is_initialized() and dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of the given process group")


def hook(state: State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s gradients over ``state.group``, compressed; decodes in place into the
    bucket's buffer (no second gradient-sized buffer). Works across DDP's bucket rebuild: every
    call takes the bucket as it is."""
    buffer = bucket.buffer()
    if not buffer.is_floating_point():
        raise UnsupportedError(f"gradient bucket of dtype {buffer.dtype}")
    if buffer.layout != torch.strided:  # sparse gradients (nn.Embedding(sparse=True)): not coded
        return allreduce_hook(state.group, bucket)  # torch's own hook: averaged by the group's backend
    index, stale = bucket.index(), []
    if index <= state.last_index:  # a new step whose last bucket did not come (DDP's
        stale = _step_ended(state)  # skip_all_reduce_unused_params skips a bucket of unused parameters)
    if state.last_index < 0:  # a step's first bucket: the step counts from here
        state.iterations += 1
    step = state.iterations - 1  # read now: the lossy work runs later, on another thread
    state.last_index = index
    if state.lossy:
        key, changed = _key(state, index, bucket.parameters())
        if state.rules is not None and key not in state.layouts:
            state.layouts[key] = segments(state.rules, bucket.parameters(), state.names, buffer.numel())
        layout = state.layouts.get(key)
        parts = _parts(state, bucket.parameters(), buffer.numel())
        # the entropy rate decides on the step's first bucket with a lossy part (the same on every
        # rank: the same model, the same layouts), not on bucket 0, which the rules may keep exact
        first = (layout is None or bool(layout[0])) and state.first_lossy != step
        if first:
            state.first_lossy = step
        state.used.add(key)
    if bucket.is_last():
        stale += _step_ended(state)
    if state.lossy:
        api.make_groups(state.group, "lossless", "flat")  # what _split's flat collectives make, made here
        handle = collectives.submit(lambda: _split(state, step, key, buffer, layout, first, stale, parts, changed))
    else:
        handle = api.all_reduce(buffer, op=dist.ReduceOp.AVG, group=state.group, async_op=True,
                                codec=state.codec, algorithm=state.algorithm)

    def done(fut: torch.futures.Future) -> torch.Tensor:
        state._add(fut.value())
        handle.join_stream()  # on CUDA: the bucket is read after the call's device work (zipccl.executor)
        return buffer

    return handle.get_future().then(done)


def _step_ended(state: State) -> list:
    """The keys of buckets that the step that ended did not have and whose parameters its buckets
    now hold (DDP's rebuild regrouped them), dropped here and returned (their residuals go on
    zipccl's thread). Not a bucket that DDP skipped this step (skip_all_reduce_unused_params: its
    parameters unused), whose residual waits for its next step, nor a checkpoint's, kept for the
    buckets after the rebuild (this process has not seen them)."""
    state.last_index = -1
    if not state.lossy:
        return []
    held = {p for k in state.used for p in state.members.get(k, ())}
    stale = [k for k in state.members if k not in state.used and not held.isdisjoint(state.members[k])]
    state.used = set()
    for k in stale:
        del state.members[k]
        state.layouts.pop(k, None)
    return stale


def _key(state: State, index: int, params: list) -> tuple[tuple, bool]:
    """A bucket's key for its layout and residual: its index and its parameters' shapes in order,
    which DDP's rebuild after the first step changes (the order in which gradients became ready:
    a bias before its weight), so that neither is applied at another parameter's positions (a new
    key's residual is made of the old one's: ``_take_residual``), and which a checkpoint's
    residuals keep; and whether the same shapes now hold other parameters (this process's ids:
    DDP's rebuild of a bucket of like shapes), whose layout is then made afresh and whose
    residual moves to them by name (``_relayout``)."""
    key = (index, tuple(tuple(p.shape) for p in params))
    members = tuple(id(p) for p in params)
    changed = state.members.get(key, members) != members
    if changed:
        state.layouts.pop(key, None)
    state.members[key] = members
    return key, changed


def _relayout(state: State, key, parts, changed: bool) -> None:
    """Bucket ``key``'s parameters as this step has them, ``parts`` (``_parts``): where they are
    not those its residual holds, in that order (DDP's rebuild of a bucket of like shapes; a
    checkpoint's bucket restored into a DDP before its rebuild), the residual moves aside, under
    its parameters' names, for ``_take_residual`` to take by name; without names (no ``model``
    given), where ``changed`` says the parameters changed, it is dropped. On zipccl's thread,
    which alone touches the residuals while the step's buckets run."""
    held = state.parts.get(key, parts)
    if held != parts or (parts is None and changed):
        residual = state.residuals.store.pop(key, None)
        if residual is not None and held:
            n = 0
            while ("moved", key, n) in state.parts:
                n += 1
            state.residuals.store["moved", key, n], state.parts["moved", key, n] = residual, held
    state.parts[key] = parts


def _split(state: State, step: int, key, buffer: torch.Tensor, layout, first: bool, stale: list, parts,
           changed: bool) -> dict:
    """On zipccl's thread (so the entropy estimate's small all-reduces cannot race the traffic):
    the bucket's residual where its parameters are (``_relayout``, ``_take_residual``); the lossy
    ranges of the bucket through top-k, the exact ones lossless (in the same packet where
    zipccl.lossy can: one collective per bucket instead of two), counters summed; then the
    residuals of ``stale`` keys (buckets the step no longer has) are dropped."""
    try:
        _relayout(state, key, parts, changed)
        _take_residual(state, key)
        return _split_one(state, step, key, buffer, layout, first)
    finally:
        for k in stale:
            state.residuals.store.pop(k, None)
            state.parts.pop(k, None)


def _parts(state: State, params: list, numel: int) -> tuple | None:
    """The parameters whose gradients a bucket's residual holds, in order, as (name, numel): the
    lossy ones (all, without rules); without ``model``, named by this process's ids (("id", n),
    which a checkpoint does not keep), so that DDP's rebuild moves the residual all the same;
    None where a name is unknown or the parameters do not tile the bucket."""
    names = [state.names.get(id(p)) for p in params] if state.names else [("id", id(p)) for p in params]
    if None in names or sum(p.numel() for p in params) != numel:
        return None
    return tuple((n, p.numel()) for n, p in zip(names, params)
                 if state.rules is None or state.rules.lossy(state.names.get(id(p), ""), p))


def _take_residual(state: State, key) -> None:
    """Where bucket ``key`` has no residual yet but other buckets' residuals hold its parameters'
    (DDP's rebuild after the first step regroups them; a checkpoint saved after the rebuild is
    restored into a DDP before it), its residual is made of theirs, parameter by parameter, and
    taken from them: zeros for a parameter that none holds (one trained only since: unfrozen); a
    source whose parameters have all been taken goes, the rest of one keeps zeros where it gave.
    No unsent gradient is lost to a new bucket layout, nor sent twice."""
    store, mine = state.residuals.store, state.parts.get(key)
    if not mine or key in store:
        return
    where = {}  # name -> (source key, start, numel)
    for k, theirs in list(state.parts.items()):
        if k != key and theirs and k in store:
            at = 0
            for name, numel in theirs:
                if name is not None:  # None: taken already
                    where[name] = (k, at, numel)
                at += numel
    found = {name for name, numel in mine if where.get(name, (None, 0, -1))[2] == numel}
    if not found:
        return
    like = store[where[next(iter(found))][0]]
    store[key] = torch.cat([store[where[name][0]][where[name][1]:where[name][1] + numel] if name in found
                            else like.new_zeros(numel) for name, numel in mine])
    for k in {where[name][0] for name in found}:
        taken = {name for name in found if where[name][0] == k}
        for name in taken:
            _, at, numel = where[name]
            store[k][at:at + numel].zero_()
        state.parts[k] = tuple((None if name in taken else name, numel) for name, numel in state.parts[k])
        if all(name is None for name, _ in state.parts[k]):
            del store[k]
            del state.parts[k]


def _split_one(state: State, step: int, key, buffer: torch.Tensor, layout, first: bool) -> dict:
    if layout is None:
        return _lossy(state, step, key, buffer, first)
    lossy_ranges, exact_ranges = layout
    if not lossy_ranges:  # the same model on every rank: the same parts are empty everywhere
        return _exact(state, buffer)
    # One range is a view of the bucket, reduced in place; several are copied out (slices:
    # gathering by an index tensor cost several ms per bucket).
    one = len(lossy_ranges) == 1
    lossy = buffer[lossy_ranges[0][0]:lossy_ranges[0][1]] if one else _gather(buffer, lossy_ranges)
    call = state.compressor.reduce(lossy.view(-1), key, step, first, state.group,
                                   exact=(buffer, lossy_ranges, exact_ranges) if exact_ranges else None)
    if call is not None and exact_ranges:  # the whole bucket is reduced
        return call
    total = dict(call or _snapshot()["last"])
    if not one:
        _scatter(lossy, buffer, lossy_ranges)
    if exact_ranges:
        exact = _gather(buffer, exact_ranges)
        more = _exact(state, exact)
        _scatter(exact, buffer, exact_ranges)
        for k in ("raw_bytes", "wire_bytes", "codec_seconds", "comm_seconds"):
            total[k] += more[k]
    return total


def _gather(buffer: torch.Tensor, ranges: list) -> torch.Tensor:
    """``buffer``'s ranges back to back, in a new tensor."""
    return torch.cat([buffer[a:b] for a, b in ranges])


def _scatter(part: torch.Tensor, buffer: torch.Tensor, ranges: list) -> None:
    """The inverse of _gather: ``part`` back into ``buffer``'s ranges."""
    done = 0
    for a, b in ranges:
        buffer[a:b].copy_(part[done:done + b - a])
        done += b - a


def _exact(state: State, part: torch.Tensor) -> dict:
    collectives.all_reduce(part, op=dist.ReduceOp.AVG, group=state.group, codec="lossless")
    return _snapshot()["last"]


def _lossy(state: State, step: int, key, buffer: torch.Tensor, first: bool) -> dict:
    """Top-k with error feedback; the step's first lossy bucket decides the density."""
    return state.compressor.reduce(buffer.view(-1), key, step, first, state.group)


def bf16_hook(state: State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``hook`` on a bfloat16 copy of the bucket, cast back into the bucket's own buffer."""
    original = bucket.buffer()
    bucket.set_buffer(original.to(torch.bfloat16))

    def back(fut: torch.futures.Future) -> torch.Tensor:
        original.copy_(fut.value())
        return original

    return hook(state, bucket).then(back)
