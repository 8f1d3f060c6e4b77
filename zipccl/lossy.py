"""Lossy all-reduce with error feedback and a density policy, kept across training steps.

``Compressor`` is what ``codec="topk"`` / ``"entropy"`` mean when a tensor is
sent again and again: residuals per tensor (what was not sent is added to the
next gradient), the density (fixed, or driven by the gradient entropy), and the
layer rules that keep small tensors lossless. The DDP hook (zipccl.ddp) uses it
per bucket; ``zipccl.all_reduce(t, codec="entropy", name="layer.weight")`` uses a
process-wide one per codec.

    comp = zipccl.lossy.Compressor("entropy")
    for name, p in model.named_parameters():          # every step, same order on every rank
        comp.all_reduce(p.grad, name, op=dist.ReduceOp.AVG)
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from . import collectives
from .collectives.resolve import sums
from .entropy import EntropyRate
from .errors import UnsupportedError
from .feedback import Residuals
from .kernels import sparse
from .rules import LayerRules
from .stats import stats as _snapshot
from .topk import TopK, check_addressable
from .transport import transport_for
from .transport.torch_dist import wire_device

__all__ = ["Compressor", "default"]

_DEFAULTS: dict = {}


class Compressor:
    """codec: "topk" (``density`` fixed), "entropy" (density from ``rate``, an EntropyRate) or a
    TopK instance. residual_dtype: float32, or bfloat16 for half the memory. rules: which
    tensors may go lossy (None: all); the others are sent lossless. sampled: select by a
    sampled threshold (TopK(sampled=True): about k entries, several times faster).
    value_dtype: send the values in this dtype (torch.bfloat16 for fp32 gradients: 6 instead
    of 8 bytes per entry); error feedback keeps the rounding, the sum is rounded once more."""

    def __init__(self, codec="topk", density: float = 0.01, rate: EntropyRate | None = None,
                 residual_dtype: torch.dtype = torch.float32, rules: LayerRules | None = LayerRules(),
                 sampled: bool = False, value_dtype: torch.dtype | None = None):
        if not (codec in ("topk", "entropy") or isinstance(codec, TopK)):
            raise ValueError(f"lossy codec must be 'topk', 'entropy' or a TopK instance, got {codec!r}")
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density}")
        if value_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"value_dtype must be None, float32, bfloat16 or float16, got {value_dtype}")
        self.codec, self.density, self.rules, self.sampled = codec, density, rules, sampled
        self.value_dtype = value_dtype
        self.rate = rate if rate is not None else (EntropyRate() if codec == "entropy" else None)
        self.residuals = Residuals(residual_dtype)
        self.densities: list = []   # per step: the density used (None: lossless warm-up)
        self.step = -1              # begin's step counter (the DDP hook passes its own)
        self.order: dict = {}       # lossy tensor's name -> its place in a step, as first begun
        self.last = -1              # the place of the tensor begun last
        self.marked = None          # ``mark``'s: the next tensor begins a step (None: never marked)

    def __setstate__(self, state: dict) -> None:
        """A Compressor pickled before ``begin`` (its step's first tensor named ``anchor``) goes on."""
        anchor = state.pop("anchor", None)
        state.setdefault("order", {} if anchor is None else {anchor: 0})
        state.setdefault("last", len(state["order"]) - 1)
        state.setdefault("marked", None)
        self.__dict__.update(state)

    def mark(self) -> None:
        """The next tensor begins a step, wherever its place: for a caller that knows where steps
        start (zipccl.fsdp: the model's forward ran). Once marked, steps follow the marks alone."""
        self.marked = True

    def begin(self, name) -> tuple[int, bool]:
        """(the step of the lossy tensor ``name``, whether it is the step's first), the same on
        every rank. Marked (``mark``): the first tensor after a mark. Else by place: tensors
        come in one order each step, and one that comes at or before the place of the last
        begins the next step, so that a step counts when the tensor that began the last one has
        no gradient this time (a frozen layer, a branch not taken)."""
        place = self.order.setdefault(name, len(self.order))
        first = bool(self.marked) if self.marked is not None else place <= self.last
        first = first or self.step < 0
        if first:
            self.step += 1
        if self.marked:
            self.marked = False
        self.last = place
        return self.step, first

    def choose(self, step: int, first: bool, grad: torch.Tensor, group) -> float | None:
        """This step's density; the first tensor of a step decides (identically on every rank)."""
        if isinstance(self.codec, TopK):
            density = self.codec.density
        elif self.codec == "topk":
            density = self.density
        elif first:
            density = self.rate.update(step, grad, _sum_across(group))
        else:
            density = self.rate.density
        if first:
            self.densities.append(density)
        return density

    def reduce(self, flat: torch.Tensor, key, step: int, first: bool, group, op=dist.ReduceOp.AVG,
               exact=None) -> dict:
        """Average (or sum) ``flat`` in place: residual added, top-k sent, the rest kept for later.

        exact: (bucket, lossy ranges, exact ranges) when ``flat`` holds the lossy ranges of
        ``bucket`` back to back (zipccl.ddp): the exact ranges then travel whole in the same
        packet and the one collective reduces the whole bucket, where the kernels of
        zipccl.kernels.sparse apply and the values keep the bucket's dtype. (Their elements
        are summed in rank order in fp32 and rounded once, as by the lossless codec, but from
        +0.0, so a sum of -0.0 comes back +0.0.) Returns the call's counters, or None when
        ``exact`` was given but not used (other value dtypes, float16, other devices): the caller
        then reduces the exact ranges itself."""
        _sums_only("all_reduce", flat, group, op)
        density = self.choose(step, first, flat, group)
        if density is None:  # entropy warm-up: lossless (all of the bucket, if given)
            collectives.all_reduce(flat if exact is None else exact[0], op=op, group=group, codec="lossless")
            return _snapshot()["last"]
        codec = self._codec(density)
        pairs, numel = codec.k(flat.numel()), flat.numel()
        if self._merges(flat, exact):  # the exact ranges ride in the packet, every element a pair
            pairs, numel = pairs + exact[0].numel() - numel, exact[0].numel()
            if codec.algorithm == "auto":  # chosen for what is sent, not for the lossy part alone
                algorithm = collectives.sparse_algorithm(dist.get_world_size(group), pairs / max(numel, 1),
                                                         self._value_size(flat))
                codec = TopK(codec.density, algorithm=algorithm, sampled=codec.sampled)
        if not self._pays("all_reduce", flat, pairs / max(numel, 1), codec, group):
            return self._dense("all_reduce", flat, None, key, group, op, exact)
        wire, after, unsent = self._selected("all_reduce", flat, key, codec, exact, group, op)
        with unsent:
            collectives.all_reduce(wire, op=op, group=group, codec=codec)
        return after()

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor, key, step: int, first: bool, group,
                       op=dist.ReduceOp.AVG) -> dict:
        """Reduce-scatter ``flat`` (world size x ``out``) into ``out``: residual added, top-k
        sent, each chunk's pairs to its owner only, the rest of ``flat`` kept for later. The
        residual covers this rank's whole contribution, every chunk of it. Returns the call's
        counters."""
        _sums_only("reduce_scatter", flat, group, op)
        density = self.choose(step, first, flat, group)
        if density is None:  # entropy warm-up: lossless
            collectives.reduce_scatter(out, flat, op=op, group=group, codec="lossless")
            return _snapshot()["last"]
        codec = self._codec(density)
        if not self._pays("reduce_scatter", flat, codec.k(flat.numel()) / max(flat.numel(), 1), codec, group):
            return self._dense("reduce_scatter", flat, out, key, group, op, None)
        wire, _, unsent = self._selected("reduce_scatter", flat, key, codec, None, group, op)
        result = out if wire.dtype == out.dtype else torch.empty_like(out, dtype=wire.dtype)
        with unsent:
            collectives.reduce_scatter(result, wire, op=op, group=group, codec=codec)
        if result is not out:
            out.copy_(result)
        return _snapshot()["last"]

    def _codec(self, density: float) -> TopK:
        return self.codec if isinstance(self.codec, TopK) else TopK(density, sampled=self.sampled)

    def _value_size(self, flat: torch.Tensor) -> int:
        return (self.value_dtype or flat.dtype).itemsize

    def _merges(self, flat: torch.Tensor, exact) -> bool:
        """Whether ``exact``'s ranges travel in the top-k packet (``reduce``'s docstring)."""
        value_dtype = self.value_dtype or flat.dtype
        return (exact is not None and value_dtype == exact[0].dtype
                and sparse.supports(flat, value_dtype, self.residuals.dtype))

    def _pays(self, name: str, flat: torch.Tensor, density: float, codec: TopK, group) -> bool:
        """Whether top-k at ``density`` (pairs per element of what is sent) moves no more bytes per
        rank than the plain collective of ``flat``'s dtype: not at high densities, nor for a bucket
        mostly of ranges the rules keep exact. Sizes alone decide, the same on every rank. A sampled
        selection counts at its most, twice the density (``TopK``'s sampled threshold)."""
        value_size, dense_size, n = self._value_size(flat), flat.element_size(), dist.get_world_size(group)
        if codec.samples(flat.numel()):
            density = min(1.0, 2 * density)
        if name == "reduce_scatter":  # both move (n-1)/n of their bytes
            return density * (4 + value_size) <= dense_size
        moved = collectives.sparse_bytes(n, density, value_size)
        sparse_moved = min(moved.values()) if codec.algorithm == "auto" else moved[codec.algorithm]
        return sparse_moved <= 2 * (n - 1) / n * dense_size

    def _dense(self, name: str, flat: torch.Tensor, out, key, group, op, exact) -> dict:
        """The call sent whole, lossless, where top-k would not pay (``_pays``): as if every entry
        were selected, so the residual keeps only the rounding of ``grad + residual`` to
        ``flat``'s dtype. With ``exact``, the whole bucket goes in the one call."""
        try:
            compensated = self.residuals.compensate(key, flat)
            flat.copy_(_in_range(compensated, flat.dtype))
            self.residuals.update(key, compensated, flat)
            if exact is not None:  # the compensated lossy ranges back into the bucket
                _place(flat, exact[0], exact[1])
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            collectives.refuse(name, transport_for(group, flat.device), flat, op, e)  # raises e here
        try:
            if name == "all_reduce":
                collectives.all_reduce(flat if exact is None else exact[0], op=op, group=group, codec="lossless")
            else:
                collectives.reduce_scatter(out, flat, op=op, group=group, codec="lossless")
        except BaseException:  # nothing was sent: the residual keeps the whole of it
            self.residuals.update(key, compensated, torch.zeros_like(compensated))
            raise
        return _snapshot()["last"]

    def _selected(self, name: str, flat, key, codec: TopK, exact, group, op):
        """``_select``'s three. A failure here is refused on every rank of the collective ``name``:
        no message of the call has left, the peers wait in its exchange, on the transport that
        the call's tensors choose (NCCL's for CUDA tensors)."""
        try:
            return self._select(flat, key, codec, exact)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            collectives.refuse(name, transport_for(group, flat.device), flat, op, e)  # raises e here

    def _select(self, flat, key, codec, exact):
        """Select with error feedback: (the tensor the top-k all-reduce sends, with the selection
        remembered by ``codec``; what to do after it, which returns ``reduce``'s result; a context
        for the collective that, if it fails, gives the residual back what the call was to send,
        so that a failed step's gradient is kept for the next, as any unsent part is)."""
        check_addressable(flat.numel())
        value_dtype = self.value_dtype or flat.dtype
        wire = flat if value_dtype == flat.dtype else torch.empty_like(flat, dtype=value_dtype)
        fast = sparse.supports(flat, value_dtype, self.residuals.dtype)
        if fast:
            # The same selection and residual as below, in a few passes instead of about fifteen.
            idx, values, residual = sparse.compensated_topk(
                flat, self.residuals.get(key, flat.numel(), flat.device), codec.k(flat.numel()), value_dtype,
                self.residuals.dtype, codec.sample_positions(flat.numel()), codec.sample_k())
            self.residuals.store[key] = residual
            unsent = _unsent(self.residuals, key, idx, values)
            if self._merges(flat, exact):
                bucket, lossy_ranges, exact_ranges = exact
                idx, values = _with_exact_ranges(idx, values, bucket, lossy_ranges, exact_ranges)
                codec.remember(bucket, idx, values)
                return bucket, lambda: _snapshot()["last"], unsent
            codec.remember(wire, idx, values)  # the collective sends it
        else:
            compensated = self.residuals.compensate(key, flat)
            wire.copy_(_in_range(compensated, wire.dtype))
            idx, values = codec.select(wire, remember=True)  # the collective reuses it
            sent = torch.zeros_like(compensated)
            sent[idx.long()] = values.float()
            self.residuals.update(key, compensated, sent)
            unsent = _unsent(self.residuals, key, idx, values)

        def after():
            if wire is not flat:
                flat.copy_(wire)
            if exact is not None:
                return None
            last = _snapshot()["last"]
            if wire is not flat:  # what the plain collective of the gradients' own dtype would send
                last = dict(last, raw_bytes=last["raw_bytes"] // wire.element_size() * flat.element_size())
            return last
        return wire, after, unsent

    def all_reduce(self, tensor: torch.Tensor, name: str, op=dist.ReduceOp.AVG, group=None) -> dict:
        """All-reduce one named tensor in place (same names, same order on every rank); returns the
        call's counters. Tensors the rules keep exact go lossless."""
        if self.rules is not None and not self.rules.lossy(name, tensor):
            collectives.all_reduce(tensor, op=op, group=group, codec="lossless")
            return _snapshot()["last"]
        step, first = self.begin(name)
        if not tensor.is_contiguous():  # reduced in a contiguous copy, then written back
            work = tensor.contiguous()
            out = self.reduce(work.view(-1), name, step, first, group, op)
            tensor.copy_(work)
            return out
        return self.reduce(tensor.view(-1), name, step, first, group, op)

    def stats(self) -> dict:
        return dict(densities=list(self.densities), residual_bytes=self.residuals.memory_bytes(),
                    decisions=list(self.rate.decisions) if self.rate else [])


def _sums_only(name: str, flat, group, op) -> None:
    """Top-k sums: another op is refused from the first call, the entropy warm-up's lossless
    calls too, on every rank (zipccl.collectives.refuse), before the step counts."""
    if not sums(op):
        collectives.refuse(name, transport_for(group, flat.device), flat, op,
                           UnsupportedError(f"lossy all-reduce and reduce-scatter sum (SUM or AVG), not {op}"))


def _in_range(compensated: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad + residual`` (fp32) as ``dtype`` can carry it: a finite value beyond its range (fp16's
    65504) sent at the range's end, the rest kept in the residual, not sent as Inf, which would
    make the scaler skip a step the plain collective would not have, and lose the carried mass;
    an Inf or NaN of the gradient itself is sent as it is."""
    top = torch.finfo(dtype).max
    if top >= torch.finfo(torch.float32).max:
        return compensated
    return torch.where(torch.isfinite(compensated), compensated.clamp(-top, top), compensated)


@contextlib.contextmanager
def _unsent(residuals, key, idx: torch.Tensor, values: torch.Tensor):
    """Around a lossy call's collective: if it raises, the selection (``idx``, ``values``) goes
    back into ``key``'s residual, which then holds the call's whole compensated gradient."""
    try:
        yield
    except BaseException:
        residuals.restore(key, idx, values)
        raise


def _with_exact_ranges(idx: torch.Tensor, values: torch.Tensor, bucket: torch.Tensor, lossy_ranges: list,
                       exact_ranges: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection of the lossy ranges (positions counted across them back to back) in bucket
    positions, merged with every element of the exact ranges: (int32 ascending, values)."""
    pieces, at = [], 0
    for a, b in lossy_ranges:
        span = torch.tensor([at, at + b - a], dtype=idx.dtype, device=idx.device)
        lo, hi = torch.searchsorted(idx, span).tolist()
        pieces.append((a, idx[lo:hi] + (a - at), values[lo:hi]))
        at += b - a
    pieces += [(a, torch.arange(a, b, dtype=idx.dtype, device=idx.device), bucket[a:b]) for a, b in exact_ranges]
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p[1] for p in pieces]), torch.cat([p[2] for p in pieces])


def _place(flat: torch.Tensor, bucket: torch.Tensor, ranges: list) -> None:
    """``flat`` (``bucket``'s ``ranges`` back to back) written into those ranges, unless it is them."""
    at = 0
    for a, b in ranges:
        if flat[at:at + b - a].data_ptr() != bucket[a:b].data_ptr():
            bucket[a:b].copy_(flat[at:at + b - a])
        at += b - a


def _sum_across(group):
    """The in-place int64 sum across ``group``'s ranks that the entropy estimate makes
    (zipccl.entropy), on the device that the group carries (the GPU on nccl, whose groups
    cannot send a CPU tensor)."""
    device = wire_device(dist.get_backend(group))

    def allreduce(t: torch.Tensor) -> None:
        wire = t if t.device == device else t.to(device)
        dist.all_reduce(wire, group=group)
        if wire is not t:
            t.copy_(wire)
    return allreduce


def default(codec: str) -> Compressor:
    """The process-wide compressor behind ``zipccl.all_reduce(..., codec=codec, name=...)``."""
    if codec not in _DEFAULTS:
        _DEFAULTS[codec] = Compressor(codec)
    return _DEFAULTS[codec]
