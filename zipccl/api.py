"""The front door: zipccl.all_reduce, reduce_scatter and all_gather.

Each call gets a plan: an algorithm (flat, or hierarchical over the group's nodes:
zipccl.topology) and each level's codec (the backend's own collective, zipccl's pipeline raw
or lossless, or an opt-in lossy codec), fixed by the caller or, with codec="auto", learned per
group and size class from the calls' own times (zipccl.auto). A named tensor with a lossy
codec goes to the lossy layer (zipccl.lossy), which keeps error feedback across calls. This
module sits above collectives, hierarchical and lossy and dispatches to them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import auto, config, hierarchical, lifetime, lossy, topology
from . import collectives as C
from .collectives.metadata import _meta_bytes
from .collectives.resolve import Composite
from .errors import RankFailure, UnsupportedError
from .executor import drain as _drain, run as _run
from .failure import Fate
from .format import DTYPE_CODES
from .stats import record_native
from .torch_compat import not_in
from .transport import TorchTransport

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "goes_native", "ALGORITHMS", "HIERARCHICAL_PLANS"]

ALGORITHMS = ("auto", "flat", "hierarchical")
#: Plans that codec="auto" adds where the group has two levels: inside the nodes shared memory
#: (else, and for CUDA tensors, the backend's collective), between nodes the backend's
#: collective, raw or lossless.
HIERARCHICAL_PLANS = ("hierarchical/native", "hierarchical/raw", "hierarchical/lossless")
LEVELS = ("intra", "inter")
_FLOATS = frozenset(DTYPE_CODES)
_NATIVE_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN, None)


def _level_codecs(codec, dtype, nbytes: int) -> tuple:
    """(intra, inter) resolved: a mapping names each level; a single codec serves both."""
    if isinstance(codec, Mapping):
        if set(codec) != set(LEVELS):
            raise ValueError(f"a per-level codec maps both of {LEVELS} (got {sorted(codec)})")
        wanted = tuple(codec[k] for k in LEVELS)
    else:
        wanted = (codec, codec)
    out = []
    for level, c in zip(LEVELS, wanted):
        if c == "shm" or c is hierarchical.SHM:
            if level != "intra":
                raise ValueError("'shm' (shared memory) serves only the intra-node level")
            out.append(hierarchical.SHM)
            continue
        if c == "auto":
            raise ValueError("a hierarchical call's levels take explicit codecs ('native', 'raw', 'lossless' or an "
                             "exact codec instance); codec='auto' with algorithm='auto' chooses them")
        r = C.resolve_codec(c, dtype, nbytes)
        if not getattr(r, "exact", True):
            raise UnsupportedError(f"lossy codec {r!r} is not available per level; use the flat all_reduce")
        out.append(r)
    return tuple(out)


def _one_level(group, codecs: tuple):
    """Which of (intra, inter) serves a group of one level: a single node's "intra", else (nodes
    of one rank each) "inter"."""
    return codecs[0] if len(topology.topology(group).nodes) == 1 else codecs[1]


def _intra(levels, device: torch.device) -> object:
    """The intra-node level of auto's hierarchical plans: for CPU tensors the node's shared
    memory where it has one and no call's area failed to grow in it (a /dev/shm too small: every
    rank knows alike, from that call's RankFailure), else (and always for CUDA tensors: NCCL's
    own) the backend's collective."""
    memory = levels.memory
    return hierarchical.SHM if memory is not None and not memory.failed and device.type == "cpu" else C.NATIVE


#: How each call signature runs (``_route``), decided once: (collective, group (the world's object
#: for None, so that a new world decides anew), op, codec, algorithm, input and output dtypes,
#: input numel, output numel, on CUDA, on the CPU) -> True (the group's own collective, always), an
#: _Auto (auto chooses per call) or False (the full path). At most MAX_ROUTES, then forgotten; all
#: forgotten when a setting changes (config.refresh) or a topology is found again.
_routes: dict = lifetime.keep({}, group_of=lambda key: key[1])
MAX_ROUTES = 4096
topology.on_forget(_routes.clear)
config.on_refresh(_routes.clear)


class _Auto(NamedTuple):
    """A valid codec="auto" call above the probe floor on a group whose topology is known: the
    policy's class of the call, its bytes and its candidate plans (zipccl.auto)."""
    key: tuple
    nbytes: int
    plans: tuple


def _decide(name: str, group, output, input, op, codec, algorithm: str):
    """How every call of this signature runs, whichever calls came before it, from what every
    rank knows alike. True: the group's own collective (codec "native"; codec "auto" below the
    policy's probe floor, for dtypes no codec takes, where nothing could carry compressed
    packets, and on CUDA inside one node joined by NVLink: autoplan.plans_for). An _Auto: a
    valid auto call whose plan the policy chooses each time. False where the full path is
    needed (it also explains a bad call). None where that may change (the group's topology is
    not known yet)."""
    if op not in _NATIVE_OPS or (op is None and name != "all_gather") or algorithm not in ("auto", "flat") \
            or codec not in ("native", "auto"):
        return False
    dtype, device = input.dtype, input.device
    try:
        t = TorchTransport.of(group)
    except (ValueError, RuntimeError):
        return False
    if (op == dist.ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex)) \
            or device.type not in (t.meta_device.type, "cuda"):
        return False
    if name != "all_reduce":
        big, small = (input, output) if name == "reduce_scatter" else (output, input)
        if output.dtype != dtype or big.numel() != t.size * small.numel():
            return False
    if codec == "native":
        return True
    if dtype not in _FLOATS or not config.AUTO_LEARN:
        return dtype not in _FLOATS
    nbytes = input.numel() * input.element_size()
    if nbytes < auto.PROBE_MIN_BYTES:
        return True
    if device.type == "cuda":
        try:
            C.check_carrier(group, device)
        except UnsupportedError:
            return True  # nothing carries compressed packets here: "auto" is the group's own collective
    if algorithm != "auto" or not dist.is_initialized():
        return False
    if not topology.known(group):
        return None
    topo, levels = topology.topology(group), topology.levels(group)
    plans = C.plans_for(C.FLAT_PLANS + (HIERARCHICAL_PLANS if levels is not None else ()), device.type, topo.link,
                        len(topo.nodes))
    return True if plans == ("native",) else _Auto(auto.Policy.key(name, dtype, nbytes, device), nbytes, plans)


def _route(name: str, group, output, input, op, codec, algorithm: str):
    """``_decide``'s answer for this call's signature (a dictionary look-up after the first,
    every part of whose key is cheap to read), where ZIPCCL_CHECK_NATIVE is unset; else False.
    A call whose tensors zipccl's own path refuses (strided, or on two devices) takes the same
    route as its peers' calls of the same signature: the group's own collective then takes or
    refuses it as torch's does, and where auto chooses a plan of zipccl's, every rank takes the
    policy's step and the exchange makes every rank raise (no rank waits in an exchange that
    its peers, gone to the backend, never join, nor learns out of step)."""
    try:
        key = (name, group if group is not None else dist.GroupMember.WORLD, _NATIVE_OPS.index(op), codec,
               algorithm, input.dtype, output.dtype, input.numel(), output.numel(), input.is_cuda, input.is_cpu)
        route = _routes.get(key)
    except (ValueError, AttributeError, TypeError):  # an op zipccl does not take, not tensors, a codec mapping
        return False
    if route is None:
        lifetime.sweep()
        route = _decide(name, group, output, input, op, codec, algorithm)
        if route is None:
            return False
        if len(_routes) >= MAX_ROUTES:  # many sizes (variable all-gathers): decided again, as the first time
            _routes.clear()
        _routes[key] = route
    if not route or config.CHECK_NATIVE:
        return False
    return route


def goes_native(name: str, group, output, input, op, codec, algorithm: str = "auto") -> bool:
    """Whether this call runs the group's own collective alone, whatever came before it
    (``_route``). The drop-in backend asks this, and then calls its backend underneath itself."""
    return _route(name, group, output, input, op, codec, algorithm) is True


def _direct(name: str, group, output, input, op, codec, algorithm: str):
    """The call's fast path, after the async calls issued before it (as every call): where it
    always runs the group's own collective, that collective and the statistics (True); where
    auto chooses its plan (an _Auto route), the policy's choice, and if that is native, the
    collective, timed for the policy (True), else the plan (the full path runs it). Else None:
    the full path checks, plans and explains, at 50-100 us of Python a call (on 4 loopback
    ranks sharing 2 cores it made a 64 KiB all-reduce 0.4-0.6 ms, 10-14%, slower than the
    backend's)."""
    route = _route(name, group, output, input, op, codec, algorithm)
    if not route:
        return None
    _drain()
    if route is not True:
        plan = C.auto_policy(group).choose(route.key, route.nbytes, route.plans)
        if plan != "native":
            return plan
        C.planned(group, name, input.dtype, route.nbytes, route.plans,
                  lambda plan: C.native(name, group, output, input, op), input.device, plan)
    else:
        C.native(name, group, output, input, op)
    record_native(name)
    return True


def _native_alone(name: str, group, output, input, op) -> None:
    """An async call whose route is the group's own collective alone (``_direct``'s, queued)."""
    C.native(name, group, output, input, op)
    record_native(name)


def make_groups(group, codec="auto", algorithm: str = "auto") -> None:
    """Make on this thread the groups that a zipccl collective on ``group`` makes on its first
    call: its transport's (on gloo a second group, zipccl.transport.torch_dist._twin) and, where
    the call may go hierarchical, the topology's levels. Making a group is a collective of the
    whole job that every rank must reach in the same order as the caller's own ``new_group``
    calls: on zipccl's async thread the two would race (crossed groups, a hang). What runs
    zipccl's calls on that thread (the drop-in, the lossy all-reduce, DDP's lossy hook, FSDP2's
    comms) calls this before queuing."""
    if not dist.is_initialized() or dist.get_rank(group) < 0:  # not a member: the call itself says so
        return
    TorchTransport.of(group)
    hierarchical = algorithm == "hierarchical" or (algorithm == "auto"
                                                   and (codec == "auto" or isinstance(codec, Mapping)))
    if hierarchical and codec != "native" and not topology.known(group):
        _drain()  # after the calls queued before it, on every rank alike (at once on zipccl's thread)
        topology.levels(group)


def _outside_autograd(x):
    """A tensor that requires grad, as its ``.data`` (same storage): reduced outside autograd,
    as torch.distributed's backends do (no graph recorded, no version bump)."""
    return x.data if isinstance(x, torch.Tensor) and x.requires_grad else x


def _call(name: str, group, output, input, op, codec, algorithm: str, async_op: bool):
    output, input = _outside_autograd(output), _outside_autograd(input)
    if dist.is_initialized():
        topology.publish_node()  # a peer's first message under auto may wait for this rank's node
    if async_op:  # the route a sync call of this signature takes: the group's own collective alone
        chosen = None  # makes no group (a peer's sync call, which torch lets it make, makes none either)
        if _route(name, group, output, input, op, codec, algorithm) is True:
            return _run(lambda: _native_alone(name, group, output, input, op), True, (output, input))
    else:
        chosen = _direct(name, group, output, input, op, codec, algorithm)
    if chosen is True:
        return None
    if dist.is_initialized() and dist.get_rank(group) < 0:  # before the topology's look-ups, which say less
        raise ValueError("this process is not a member of the given process group")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r}: use one of {ALGORITHMS}")
    per_level = isinstance(codec, Mapping)
    if algorithm == "flat" or (algorithm == "auto" and not per_level and codec != "auto"):
        if per_level:
            raise ValueError("a per-level codec needs algorithm 'hierarchical' or 'auto'")
        return C.flat_collective(name, group, output, input, op, codec, async_op)
    if dist.is_initialized() and not topology.known(group):  # collective: before any rank's error exchange
        if async_op:  # after the calls queued before this one, on every rank alike
            _run(lambda: None, True).wait()
        else:
            _drain()
        TorchTransport.of(group)  # the groups that a first call makes, in _decide's order (and make_groups'):
        topology.levels(group)  # the same on every rank, whichever ranks' calls are async
    numel, nbytes = C.input_size(input)
    tensors = (input,) if name == "all_reduce" else (output, input)
    t, c, error = C.prepare(name, group, tensors, op, "raw" if per_level else codec, numel, nbytes,
                            C.check_shapes(name, output, input))
    dtype, device = (input.dtype, input.device) if isinstance(input, torch.Tensor) else (None, None)
    try:
        fixed = None if codec == "auto" else _level_codecs(codec, dtype, nbytes)
    except Exception as e:  # noqa: BLE001 - a local error still joins the exchange, so that no rank hangs
        fixed, error = None, error if error is not None else e

    def hier(levels, codecs, acc):
        whole = C.carrier(group, device, codecs[1])  # the group's own, or the nodes' level's carrier
        plan, fate = Composite("hierarchical", codecs), Fate.of(name, whole)
        # signature and auto reports, whole group, whatever the levels' codecs: an invalid call on
        # one rank refuses through this exchange (its peers would wait in the levels for good)
        C.Call(name, dtype, numel, op, plan).exchange(whole, [], None, fate)
        acc["meta_bytes"] += _meta_bytes(whole.size)
        used = hierarchical.run(name, levels, output, input, op, codecs, acc, fate)
        try:
            fate.settled(whole, acc, used)  # a failure on any level, in any node, reaches every rank
        except RankFailure as e:
            if e.kind == "memory" and levels.memory is not None:  # raised on every rank of the group alike:
                levels.memory.failed = True  # auto's later calls keep the node level to the backend's (_intra)
            raise
        return plan

    def flat(codec, acc):
        C.run_flat(name, C.carrier(group, device, codec), output, input, op, codec, acc)
        return codec

    def auto_plans(levels) -> tuple[str, ...]:
        plans = HIERARCHICAL_PLANS if algorithm == "hierarchical" else \
            C.FLAT_PLANS + (HIERARCHICAL_PLANS if levels is not None else ())
        topo = topology.topology(group)
        return C.plans_for(plans, device.type, topo.link, len(topo.nodes))

    def run():
        if algorithm == "hierarchical" and dist.is_initialized() and topology.levels(group) is None:
            if error is not None:  # every rank raises here, with no exchange: this rank's own error first
                raise error
            raise UnsupportedError(f"algorithm 'hierarchical' needs a group of several nodes with several ranks "
                                   f"each that spans the job, each local rank's ranks across the nodes in node "
                                   f"order; this one is {topology.topology(group)}")
        if error is not None:
            def refusal(plan=None):  # the peers' plan where auto's policy chose it, else the caller's codecs
                if plan:
                    inter = C.PLAN_CODECS[plan.split("/")[-1]]
                elif per_level and topology.levels(group) is None:  # one level: its codec, run flat
                    inter = _one_level(group, (codec.get("intra"), codec.get("inter")))
                    if inter in ("native", "shm") or inter is C.NATIVE or inter is hierarchical.SHM:
                        raise error  # the peers run the group's own collective, with no exchange: as torch's call
                else:
                    inter = codec.get("inter") if per_level else codec
                C.refuse(name, C.refusal_carrier(group, device, inter), input, op, error)
            if chosen is None and not per_level and dist.is_initialized():  # the fast path took the step already
                return C.refuse_in_step(name, group, group, output, input, op, codec, numel, nbytes,
                                        lambda: auto_plans(topology.levels(group)), refusal, error)
            with C.undone(C.auto_policy(group), chosen) if chosen is not None else contextlib.nullcontext():
                refusal()  # where the fast path took the policy's step (zipccl's plan): its peers raise too
        acc, used = C.new_acc(), [None]
        levels = topology.levels(group)  # made above
        if fixed is not None:  # the caller's codecs: hierarchical where there are two levels
            if levels is not None:
                used[0] = hier(levels, fixed, acc)
            else:  # one level: a single node's codec is "intra" ("shm": the backend's collective), single-rank
                one = _one_level(group, fixed)
                used[0] = flat(C.NATIVE if one is hierarchical.SHM else one, acc)
        elif c is not C.AUTO:  # not a float type, or ZIPCCL_AUTO_LEARN=0: what "auto" resolved to
            used[0] = hier(levels, (_intra(levels, device), c), acc) if algorithm == "hierarchical" \
                else flat(c, acc)
        else:
            plans = auto_plans(levels)

            def go(plan: str) -> None:
                if plan.startswith("hierarchical/"):
                    used[0] = hier(levels, (_intra(levels, device), C.PLAN_CODECS[plan.split("/", 1)[1]]), acc)
                else:
                    used[0] = flat(C.PLAN_CODECS[plan], acc)

            C.planned(t.group, name, dtype, nbytes, plans, go, device, chosen)
        return C.finish(name, used[0], acc)

    return _run(run, async_op, (output, input))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                   async_op: bool = False, *, codec="auto", algorithm: str = "auto"):
    """Like ``dist.reduce_scatter_single``: ``input`` holds world-size chunks of ``output.numel()``;
    rank r receives the reduction of every rank's chunk r in ``output``. ``codec`` and
    ``algorithm`` as in ``all_reduce``."""
    if not_in(group, "reduce_scatter"):
        return None
    return _call("reduce_scatter", group, output, input, op, codec, algorithm, async_op)


def all_gather(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None, async_op: bool = False, *,
               codec="auto", algorithm: str = "auto"):
    """Like ``dist.all_gather_single``: ``output_tensor`` receives every rank's ``input_tensor`` in
    rank order. ``codec`` and ``algorithm`` as in ``all_reduce``."""
    if not_in(group, "all_gather"):
        return None
    return _call("all_gather", group, output_tensor, input_tensor, None, codec, algorithm, async_op)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False, *,
               codec="auto", algorithm: str = "auto", name: str | None = None):
    """Like ``dist.all_reduce``, in place; every rank ends with bit-identical results.

    codec: "auto" (default: the plan learned per group and size class, zipccl.auto; never
    lossy), "native" (the backend's own collective), "raw", "lossless", a mapping per level
    ({"intra": "native", "inter": "lossless"}), or opt-in lossy: "topk" (TopK(0.01)) or a TopK
    instance. algorithm: "auto" (with codec="auto": flat or hierarchical, learned; with a
    fixed codec: flat), "flat" or "hierarchical" (zipccl.hierarchical; needs several nodes of
    several ranks: zipccl.topology). With ``name`` (the tensor's name, the same on every rank),
    "topk" and "entropy" keep error feedback and, for "entropy", the entropy-driven density
    across calls (zipccl.lossy.default(codec)); the layer rules send small tensors, biases and
    norms lossless."""
    if not_in(group, "all_reduce"):
        return None
    if name is not None and codec in ("topk", "entropy"):
        compressor = lossy.default(codec)
        if async_op:
            make_groups(group, "lossless", "flat")  # what the compressor's flat collectives make, as a sync call does
        return _run(lambda: compressor.all_reduce(tensor, name, op=op, group=group), async_op, (tensor,))
    return _call("all_reduce", group, tensor, tensor, op, codec, algorithm, async_op)
