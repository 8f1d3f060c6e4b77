"""FSDP2 (and FSDP1) communication through zipccl, with layer rules deciding per module (after TAGC).

    from torch.distributed.fsdp import fully_shard
    import zipccl.fsdp
    for block in model.blocks: fully_shard(block)
    fully_shard(model)
    comms = zipccl.fsdp.compress(model)                    # lossless or raw, as codec="auto" measures
    comms = zipccl.fsdp.compress(model, lossy="entropy")   # opt-in: MLP and embedding gradients top-k

FSDP2 calls a module's comms with its flat buffers: the all-gather of the parameters
(forward, and again in backward) and the reduce-scatter of the gradients. zipccl runs both
lossless or raw (the planner's choice; bit-identical results either way). With ``lossy``,
the modules the rules put in a lossy group ("mlp", "embedding") reduce their gradients by
top-k with error feedback instead, one density policy per group; the rest stays exact.
TAGC (per-layer compression of FSDP's reduce-scatter) is the idea; FSDP2's custom-comm
hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) are the door.

FSDP1: ``model.register_comm_hook(zipccl.fsdp.State1(group), zipccl.fsdp.hook1)`` (lossless).
"""

from __future__ import annotations

import copy
import warnings
import weakref
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherABC
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterABC

from . import api, executor
from .backend import _Work
from .entropy import EntropyRate
from .errors import UnsupportedError
from .feedback import check_saved_by, rank_in
from .format import DTYPE_CODES
from .lossy import Compressor
from .stats import stats as _snapshot

__all__ = ["Rule", "TAGC_RULES", "MIN_NUMEL", "group_of", "AllGather", "ReduceScatter", "Comms", "compress",
           "State1", "hook1"]

EXACT_CODECS = ("auto", "native", "raw", "lossless")
EXACT = "exact"
#: A module whose own parameters hold fewer elements than this stays exact, whatever its name:
#: its bytes are a sliver of the step's, and sparsifying it saves nothing worth its error.
MIN_NUMEL = 1 << 16
_MARKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the step-marking hook compress installed


@dataclass(frozen=True)
class Rule:
    """Modules of ``group``: those with a dotted-name component in ``names`` (case-insensitive,
    whole components: "fc" matches "blocks.0.fc", not "fc_out") or an instance of one of
    ``types``. Group "exact" stays lossless; any other group may go lossy when the user opts in,
    with a density policy of its own."""
    group: str
    names: tuple = ()
    types: tuple = ()

    def matches(self, name: str, module: torch.nn.Module) -> bool:
        parts = {p.lower() for p in name.split(".")}
        return any(n.lower() in parts for n in self.names) or (bool(self.types) and isinstance(module, self.types))


_NORMS = tuple(t for t in (getattr(torch.nn, n, None) for n in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d",
                                                                  "BatchNorm2d")) if t is not None)
#: TAGC's choice as data: attention and normalisation exact (sparsified, they cost the most
#: quality), embeddings and MLPs may go lossy. The first rule that matches decides; a module no
#: rule matches stays exact. Extend or replace: ``TAGC_RULES + (Rule("mlp", names=("out",)),)``.
TAGC_RULES = (
    Rule(EXACT, names=("attn", "attention", "self_attn", "qkv", "q_proj", "k_proj", "v_proj", "o_proj", "proj",
                       "norm", "ln", "layernorm", "bias"),
         types=(torch.nn.MultiheadAttention, *_NORMS)),
    Rule("embedding", names=("embed", "embedding", "embeddings", "emb", "wte", "wpe", "tok", "pos"),
         types=(torch.nn.Embedding, torch.nn.EmbeddingBag)),
    Rule("mlp", names=("mlp", "ffn", "feed_forward", "fc", "fc1", "fc2", "c_fc", "up_proj", "down_proj", "gate_proj",
                       "w1", "w2", "w3")),
)


def _own_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters FSDP manages for ``module``: its own, not those of nested FSDP modules."""
    out, stack = list(module.parameters(recurse=False)), list(module.children())
    while stack:
        m = stack.pop()
        if isinstance(m, FSDPModule):
            continue
        out += list(m.parameters(recurse=False))
        stack += list(m.children())
    return out


def group_of(name: str, module: torch.nn.Module, rules=TAGC_RULES, min_numel: int = MIN_NUMEL) -> str:
    """The rule group of an FSDP module: "exact" for small or all-1-D modules and for modules no
    rule matches, else the first matching rule's group."""
    params = _own_parameters(module)
    if sum(p.numel() for p in params) < min_numel or all(p.dim() < 2 for p in params):
        return EXACT
    for rule in rules:
        if rule.matches(name, module):
            return rule.group
    return EXACT


def _exact_codec(codec, dtype: torch.dtype):
    """FSDP all-gathers uint8 views when a module mixes dtypes: those travel natively."""
    return codec if dtype in DTYPE_CODES else "native"


class _Counters:
    """Bytes and seconds of one comm object's calls (this rank's sends)."""
    __slots__ = ("calls", "raw_bytes", "wire_bytes", "codec_seconds", "comm_seconds")

    def __init__(self):
        self.calls = self.raw_bytes = self.wire_bytes = 0
        self.codec_seconds = self.comm_seconds = 0.0

    def add(self, call: dict, raw_bytes: int) -> None:
        self.calls += 1
        self.raw_bytes += raw_bytes  # what the same collective sends uncompressed
        # The backend's own collective (codec "native", auto's choice for small calls) sends raw
        # bytes but zipccl's counters record none for it.
        self.wire_bytes += raw_bytes if call.get("codec") == "native" else call.get("wire_bytes", 0)
        self.codec_seconds += call.get("codec_seconds", 0.0)
        self.comm_seconds += call.get("comm_seconds", 0.0)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


def _ring_bytes(numel_out: int, n: int, itemsize: int) -> int:
    """What an uncompressed all-gather or reduce-scatter sends per rank: (n-1) chunks."""
    return (n - 1) * numel_out * itemsize


def _issue(fn, tensors, group, codec) -> dist.Work:
    """``fn()`` on zipccl's async thread (zipccl.executor: after the caller's stream on CUDA, in
    issue order with every other zipccl call), as a torch ``Work`` whose ``wait()`` raises its
    error and orders the waiting stream after it; the groups zipccl makes for ``group`` made
    here first (api.make_groups)."""
    api.make_groups(group, codec)
    return _Work(executor.run(fn, True, tensors))


class AllGather(_AllGatherABC):
    """FSDP2's parameter all-gather through ``zipccl.all_gather`` (``codec`` exact: "auto",
    "native", "raw", "lossless"), issued asynchronously as FSDP2's own is: the call returns a
    torch ``Work`` at once, whatever ``async_op`` says, and FSDP waits for it before it copies the
    parameters out (``foreach_all_gather_copy_out`` waits for any Work it was given), so that
    the gather overlaps the compute issued meanwhile, on CPU too. Do not issue other collectives
    on the FSDP group from another thread while the forward or backward pass runs."""

    def __init__(self, codec="auto", name: str = ""):
        if codec not in EXACT_CODECS:
            raise ValueError(f"all-gather codec must be one of {EXACT_CODECS} (parameters travel exact), got {codec!r}")
        self.codec, self.name, self.counters = codec, name, _Counters()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False) -> dist.Work:
        raw = _ring_bytes(input_tensor.numel(), dist.get_world_size(group), input_tensor.element_size())
        codec = _exact_codec(self.codec, input_tensor.dtype)

        def gather():
            api.all_gather(output_tensor, input_tensor, group=group, codec=codec)
            self.counters.add(_snapshot()["last"], raw)  # on the async thread: no other call in between
        return _issue(gather, (output_tensor, input_tensor), group, codec)


def _plain_op(op):
    """FSDP's op as (zipccl op, factor to multiply the input by first, or None). PREMUL_SUM(f)
    (FSDP's ``set_gradient_divide_factor``) is a multiplication by f then a SUM."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if not isinstance(factor, (int, float)):
            raise UnsupportedError(f"PREMUL_SUM with a tensor factor ({factor!r}) is not supported")
        return dist.ReduceOp.SUM, float(factor)
    if kind in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        return kind, None
    raise UnsupportedError(f"FSDP reduce op {op} is not supported: AVG, SUM or PREMUL_SUM")


class ReduceScatter(_ReduceScatterABC):
    """FSDP2's gradient reduce-scatter through zipccl, for every op FSDP passes: AVG, SUM, and
    PREMUL_SUM(f) as f times the input, then SUM. Exact (``codec``: "auto", "native", "raw",
    "lossless") unless ``lossy`` (a rule group's Compressor, from ``compress``): then the module's
    padded gradient goes through top-k with error feedback (zipccl.lossy.Compressor: a sparse
    reduce-scatter of this rank's residual-compensated gradient, each chunk's pairs to its
    owner). The residual covers this rank's whole contribution to the module (the unsharded
    size): error feedback must remember what *this rank* did not send, for every chunk.

    ``async_op=True``: issued on zipccl's async thread, a torch ``Work`` returned. FSDP2 (torch
    2.13) passes no ``async_op`` here and ignores what the call returns: it reads the output on
    its reduce-scatter stream right after the call, so the call runs on the calling thread (on
    CUDA: its device work queued on that stream's order before it returns)."""

    def __init__(self, codec="auto", name: str = "", lossy: Compressor | None = None):
        if codec not in EXACT_CODECS:
            raise ValueError(f"reduce-scatter codec must be one of {EXACT_CODECS}, got {codec!r}")
        self.codec, self.name, self.lossy, self.counters = codec, name, lossy, _Counters()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> dist.Work | None:
        plain, factor = _plain_op(op)
        n = dist.get_world_size(group)
        raw = _ring_bytes(output_tensor.numel(), n, output_tensor.element_size())

        def reduce():
            if factor is not None:
                input_tensor.mul_(factor)  # FSDP's scratch copy of the gradients: ours to change
            if self.lossy is not None and input_tensor.dtype in DTYPE_CODES:
                _warn_if_restarting(self.lossy, self.name, input_tensor.numel())
                step, first = self.lossy.begin(self.name)  # FSDP's backward order: the same on every rank
                call = self.lossy.reduce_scatter(input_tensor.view(-1), output_tensor.view(-1), self.name,
                                                            step, first, group, plain)
            else:
                api.reduce_scatter(output_tensor, input_tensor, op=plain, group=group,
                                   codec=_exact_codec(self.codec, input_tensor.dtype))
                call = _snapshot()["last"]
            self.counters.add(call, raw)
        if async_op:
            return _issue(reduce, (output_tensor, input_tensor), group, _exact_codec(self.codec, input_tensor.dtype))
        executor.run(reduce, False)  # after the async calls issued before it (the all-gathers)
        return None


def _warn_if_restarting(lossy: Compressor, name: str, numel: int) -> None:
    """FSDP2 reduce-scatters a module's parameters that have a gradient this step, so a parameter
    frozen (or without a gradient) changes the size of what comes: the module's residual, kept
    by its name, restarts from zeros then, the unsent gradient of its other parameters with it.
    Said, not silent."""
    old = lossy.residuals.store.get(name)
    if old is not None and old.numel() != numel:
        warnings.warn(f"zipccl.fsdp: module {name!r} reduce-scatters {numel} elements where its residual holds "
                      f"{old.numel()} (a parameter frozen, or without a gradient this step): its residual restarts "
                      "from zeros, what its other parameters had not sent yet lost; keep such a parameter exact "
                      "(rules) or in a module of its own", RuntimeWarning, stacklevel=2)


def _dropped_on_reset(module: FSDPModule, held: dict) -> None:
    """``reset_iter_state()`` (after an exception mid-step) discards the microbatches' partial
    reduction that native HSDP keeps; so does it with ``_replicate``'s ``held``, the one of the
    comms installed last (compress again: another dict)."""
    group_state = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
    if group_state is None or not hasattr(group_state, "_reset_iter_state"):
        return
    if not hasattr(group_state, "_zipccl_held"):
        reset = group_state._reset_iter_state

        def reset_and_drop() -> None:
            group_state._zipccl_held.clear()
            reset()
        group_state._reset_iter_state = reset_and_drop
    group_state._zipccl_held = held


def _replicate(module: FSDPModule, group, codec, held: dict, output: torch.Tensor) -> None:
    """HSDP's replicate all-reduce, as FSDP's all-reduce hook of a 1-D FSDP on the shard group,
    which divides by the shard size alone (or by the module's divide factor). Native HSDP sums
    the replicate group where a divide factor is set (the factor is then the whole division,
    whatever the reduce-scatter's op: AVG where it equals the shard size, PREMUL_SUM, or SUM with
    forced sums or fp16), and averages it otherwise; so does this hook, reading the module's
    factor at each call (``set_gradient_divide_factor`` may come after ``compress``). Where
    ``set_requires_all_reduce(False)`` holds (gradient accumulation), native HSDP keeps each
    microbatch's shard and adds them into the next one it all-reduces; so does this hook, in
    ``held``, leaving zeros for FSDP to add to the gradient meanwhile."""
    group_state = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)  # torch 2.13: what the setters write
    if not getattr(group_state, "all_reduce_grads", True):
        if "partial" in held:
            held["partial"] += output
        else:
            held["partial"] = output.clone()
        output.zero_()
        return
    partial = held.pop("partial", None)
    if partial is not None:
        output += partial
    factor = getattr(group_state, "gradient_divide_factor", None)
    op = dist.ReduceOp.SUM if factor is not None else dist.ReduceOp.AVG
    if output.is_cuda:  # made on FSDP's reduce-scatter stream, which may drop it (a cast to the parameters'
        output.record_stream(torch.cuda.current_stream(output.device))  # dtype) while this stream still reduces it
    api.all_reduce(output, op=op, group=group, codec=_exact_codec(codec, output.dtype))


class Comms:
    """What ``compress`` installed: per FSDP module its name, rule group and comms; per lossy
    group its compressor. ``stats()`` sums bytes and seconds; ``state_dict()`` /
    ``load_state_dict()`` carry the residuals, steps and density policies (rank-local: save one
    per rank)."""

    def __init__(self, modules: dict, lossy: dict, hook=None):
        self.modules = modules  # name -> (group, AllGather, ReduceScatter)
        self.lossy = lossy      # group -> its Compressor
        self.hook = hook        # the model's forward pre-hook that marks each lossy step's start

    def groups(self) -> dict:
        return {name: g for name, (g, _, _) in self.modules.items()}

    def stats(self) -> dict:
        out = {}
        for kind, idx in (("all_gather", 1), ("reduce_scatter", 2)):
            tot = _Counters()
            for entry in self.modules.values():
                c = entry[idx].counters
                for k in tot.__slots__:
                    setattr(tot, k, getattr(tot, k) + getattr(c, k))
            out[kind] = tot.as_dict()
        out["raw_bytes"] = sum(out[k]["raw_bytes"] for k in ("all_gather", "reduce_scatter"))
        out["wire_bytes"] = sum(out[k]["wire_bytes"] for k in ("all_gather", "reduce_scatter"))
        out["densities"] = {g: list(c.densities) for g, c in self.lossy.items()}
        out["residual_bytes"] = sum(c.residuals.memory_bytes() for c in self.lossy.values())
        return out

    def state_dict(self) -> dict:
        """A snapshot: copies of the residuals and the entropy rate, which later steps update in place,
        and the rank and world size that saved them (residuals are laid out by this rank's shards)."""
        return {g: dict(residuals={k: v.clone() for k, v in c.residuals.store.items()}, step=c.step,
                        order=dict(c.order), last=c.last, densities=list(c.densities), rate=copy.deepcopy(c.rate),
                        saved_by=rank_in())
                for g, c in self.lossy.items()}

    def load_state_dict(self, state: dict) -> None:
        """Refuses a state of other lossy groups, or one whose residuals another rank or world size saved."""
        if set(state) != set(self.lossy):
            raise ValueError(f"state has lossy groups {sorted(state)}, these comms {sorted(self.lossy)}")
        for s in state.values():  # all checked before any is loaded
            check_saved_by(s.get("saved_by"), rank_in(), bool(s["residuals"]))
        for g, s in state.items():
            c = self.lossy[g]
            c.residuals.store = {k: v.clone() for k, v in s["residuals"].items()}
            c.step, c.densities = s["step"], list(s["densities"])
            c.order = dict(s.get("order", {}))  # a state saved before the steps were marked has none
            c.last = s.get("last", -1)
            c.rate = copy.deepcopy(s["rate"])


def compress(model: torch.nn.Module, *, codec="auto", lossy: str | None = None, rules=TAGC_RULES,
             min_numel: int = MIN_NUMEL, density: float = 0.01, rate: EntropyRate | None = None,
             sampled: bool = True, value_dtype: torch.dtype | None = None,
             residual_dtype: torch.dtype = torch.float32, replicate_group=None) -> Comms:
    """Install zipccl's comms on every FSDP module of ``model`` (after ``fully_shard``).

    codec: the exact codec of parameters and exact gradients ("auto": raw, lossless or the
    backend's as measured; never lossy). lossy: None (default: nothing lossy), "topk" (fixed
    ``density``) or "entropy" (density from the gradient-entropy trend, one policy per rule
    group; ``rate`` is copied per group) for the modules whose rule group is not "exact"
    (``rules``, ``min_numel``: group_of). sampled, value_dtype, residual_dtype: as in
    zipccl.lossy.Compressor. replicate_group: for HSDP, the replicate dimension's group
    (``mesh["replicate"].get_group()`` with FSDP sharding on ``mesh["shard"]``): its all-reduce
    runs through zipccl as each module's all-reduce hook."""
    if codec not in EXACT_CODECS:
        raise ValueError(f"codec must be one of {EXACT_CODECS} (lossy compression is the opt-in `lossy`), "
                         f"got {codec!r}")
    if lossy not in (None, "topk", "entropy"):
        raise ValueError(f"lossy must be None, 'topk' or 'entropy', got {lossy!r}")
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("the model has no FSDP modules: call fully_shard on it (and its layers) first")
    installed, groups = {}, {}
    for name, module in modules:
        group = group_of(name, module, rules, min_numel)
        state = None
        if lossy is not None and group != EXACT:
            if group not in groups:
                per_group = EntropyRate(**{k: getattr(rate, k) for k in (
                    "min_density", "max_density", "warmup", "every", "sample", "bins", "window", "max_step", "seed",
                    "start")}) if rate is not None else None
                groups[group] = Compressor(lossy, density, per_group, residual_dtype, rules=None, sampled=sampled,
                                           value_dtype=value_dtype)
            state = groups[group]
        ag, rs = AllGather(codec, name), ReduceScatter(codec, name, state)
        module.set_custom_all_gather(ag)
        module.set_custom_reduce_scatter(rs)
        if replicate_group is not None:
            held = {}
            module.set_all_reduce_hook(partial(_replicate, module, replicate_group, codec, held))
            _dropped_on_reset(module, held)
        installed[name] = (group, ag, rs)
    earlier = _MARKS.pop(model, None)  # compress called again: the earlier comms' marks (and residuals) go
    if earlier is not None:
        earlier.remove()
    hook = None
    if groups:  # each forward of the model starts a step: a group's first reduce-scatter after it decides its density
        def mark_step(module, args) -> None:
            for c in groups.values():
                c.mark()
        mark_step(model, ())
        hook = _MARKS[model] = model.register_forward_pre_hook(mark_step)
    return Comms(installed, groups, hook)


class State1:
    """FSDP1 hook state: the group, the exact codec, and FSDP1's default pre- and post-division
    (a power of two near sqrt(world) before the sum, the rest after: the same factors as
    PyTorch's default hook, so that raw gives its bits)."""
    __slots__ = ("group", "codec", "predivide", "postdivide", "counters")

    def __init__(self, group=None, codec="lossless"):
        if codec not in EXACT_CODECS:
            raise ValueError(f"FSDP1 hook codec must be one of {EXACT_CODECS}, got {codec!r}")
        n = dist.get_world_size(group)
        pre = 1
        while n % pre == 0 and n / pre > pre:
            pre *= 2
        self.group, self.codec, self.predivide, self.postdivide = group, codec, float(pre), n / pre
        self.counters = _Counters()


def hook1(state: State1, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
    """FSDP1 comm hook: sharded strategies pass (grad, output) and get the averaged shard in
    ``output`` (reduce-scatter); NO_SHARD passes grad alone, averaged in place (all-reduce)."""
    if state.predivide > 1:
        grad.div_(state.predivide)
    n = dist.get_world_size(state.group)
    codec = _exact_codec(state.codec, grad.dtype)
    if output is None:
        api.all_reduce(grad, op=dist.ReduceOp.SUM, group=state.group, codec=codec)
        target, raw = grad, 2 * _ring_bytes(-(-grad.numel() // n), n, grad.element_size())  # chunks padded alike
    else:
        api.reduce_scatter(output, grad, op=dist.ReduceOp.SUM, group=state.group, codec=codec)
        target, raw = output, _ring_bytes(output.numel(), n, output.element_size())
    state.counters.add(_snapshot()["last"], raw)
    if state.postdivide > 1:
        target.div_(state.postdivide)
