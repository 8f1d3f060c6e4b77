"""numba CPU kernels of the lossy path: error feedback with top-k selection, and the rank-order
sum of the ranks' (index, value) pairs, in a few passes over the tensor.

The torch path (zipccl.lossy, zipccl.topk, zipccl.collectives) is their specification and
stays in use where these do not apply (float16, other devices); both give the same bits
(tests/test_sparse.py). In torch a 7.3M-element fp32 bucket at density 0.1 took about 70 ms of
selection, feedback and summing per rank and step with a sampled threshold, and 240 ms with
an exact one (torch.kthvalue alone: 115-180 ms), which made lossy steps slower than
uncompressed ones on these machines.

Every pass works through the tensor a span at a time: the compensated gradient (gradient +
residual), the value sent (itself, or rounded to bfloat16) and its key are computed for
SPAN elements into small buffers that stay in L1, by loops simple enough to vectorize. (With
the same arithmetic per element in one loop, some of these passes ran 3-5x slower, depending
on which dtypes and branches LLVM saw.) A key is the magnitude's float32 bits as an integer,
an order-preserving map of |v|, and format.TOPK_NAN_KEY for NaN, above Inf, as in the torch
path. Rounding to bfloat16 is to nearest even, as torch's scalar conversion (NaN: 0x7FC0)."""

from __future__ import annotations

import threading

import numpy as np
import torch
from numba import njit

from ..errors import FormatError
from ..format import HEADER_SIZE, TOPK_NAN_KEY
from .bits import load_u16 as _load_u16, load_u32 as _load_u32

_NOGIL = dict(cache=True, nogil=True, boundscheck=False)
DTYPES = (torch.float32, torch.bfloat16)  # gradient, value and residual dtypes these kernels take
SPAN = 2048  # elements per span
_NAN_BF16 = np.uint32(0x7FC0)


@njit(inline="always")
def _round_bf16(bits):
    """float32 bits (uint32) -> bfloat16 bits (uint32), to nearest even; NaN -> 0x7FC0."""
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return _NAN_BF16 if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else rounded


@njit(inline="always")
def _widen(src, lo, k, dst):
    """dst[:k] = float32 bits of src[lo:lo+k], a float32 array or bfloat16 bits (uint16)."""
    if src.itemsize == 2:
        for i in range(k):
            dst[i] = np.uint32(src[lo + i]) << np.uint32(16)
    else:
        s = src[lo:lo + k].view(np.uint32)
        for i in range(k):
            dst[i] = s[i]


@njit(inline="always")
def _span(grad, res, has_res, bf16_values, lo, k, c, tmp, w, key):
    """For elements lo..lo+k: c = gradient + residual and w = the value sent (float32 bits in
    uint32 buffers), key = the order-preserving key of |w| (NaN: TOPK_NAN_KEY, above Inf)."""
    _widen(grad, lo, k, c)
    if has_res:
        _widen(res, lo, k, tmp)
        cf, tf = c.view(np.float32), tmp.view(np.float32)
        for i in range(k):
            cf[i] += tf[i]
    if bf16_values:
        for i in range(k):
            w[i] = _round_bf16(c[i]) << np.uint32(16)
    else:
        for i in range(k):
            w[i] = c[i]
    for i in range(k):
        a = np.int64(w[i] & np.uint32(0x7FFFFFFF))
        key[i] = TOPK_NAN_KEY if a > 0x7F800000 else a


@njit(inline="always")
def _buffers():
    return (np.empty(SPAN, np.uint32), np.empty(SPAN, np.uint32), np.empty(SPAN, np.uint32),
            np.empty(SPAN, np.int64))


@njit(**_NOGIL)
def _keys_at(grad, res, has_res, bf16_values, pos, out):
    """out[j] = the key of the value sent at position pos[j] (the sampled threshold's input)."""
    c, tmp, w, key = _buffers()
    g = np.empty(SPAN, grad.dtype)
    r = np.empty(SPAN, res.dtype)
    for lo in range(0, pos.shape[0], SPAN):
        k = min(SPAN, pos.shape[0] - lo)
        for i in range(k):  # gather the sample, then treat it as a span
            g[i] = grad[pos[lo + i]]
            r[i] = res[pos[lo + i]]
        _span(g, r, has_res, bf16_values, 0, k, c, tmp, w, key)
        out[lo:lo + k] = key[:k]


@njit(**_NOGIL)
def _count_from(grad, res, has_res, bf16_values, threshold):
    """How many values have a key >= ``threshold``."""
    c, tmp, w, key = _buffers()
    count = 0
    n = grad.shape[0]
    for lo in range(0, n, SPAN):
        k = min(SPAN, n - lo)
        _span(grad, res, has_res, bf16_values, lo, k, c, tmp, w, key)
        for i in range(k):
            count += key[i] >= threshold
    return count


@njit(**_NOGIL)
def _top_bins(grad, res, has_res, bf16_values, hist):
    """hist[b] = how many keys have b as their top 11 bits."""
    c, tmp, w, key = _buffers()
    rows = np.zeros((4, 2048), np.int64)  # interleaved, so that equal bins don't wait on each other
    n = grad.shape[0]
    for lo in range(0, n, SPAN):
        k = min(SPAN, n - lo)
        _span(grad, res, has_res, bf16_values, lo, k, c, tmp, w, key)
        for i in range(k):
            rows[i & 3, key[i] >> 20] += 1
    for b in range(2048):
        hist[b] = rows[0, b] + rows[1, b] + rows[2, b] + rows[3, b]


@njit(**_NOGIL)
def _collect(grad, res, has_res, bf16_values, top, out):
    """The keys whose top 11 bits are ``top``, into ``out`` (as many as the histogram counted)."""
    c, tmp, w, key = _buffers()
    j = 0
    n = grad.shape[0]
    for lo in range(0, n, SPAN):
        k = min(SPAN, n - lo)
        _span(grad, res, has_res, bf16_values, lo, k, c, tmp, w, key)
        for i in range(k):
            if key[i] >> 20 == top:
                out[j] = key[i]
                j += 1


@njit(cache=True)
def _find_bin(hist, need):
    """The highest bin at which the counts from the top reach ``need``: (bin, count above it),
    or (-1, total) if they never do."""
    above = 0
    for b in range(hist.shape[0] - 1, -1, -1):
        if hist[b] >= need - above:
            return b, above
        above += hist[b]
    return -1, above


@njit(cache=True)
def _refine(cand, prefix, need):
    """(key, count above it among ``cand``) of the ``need``-th largest of ``cand``, whose top
    11 bits are ``prefix``: two histograms of 10 bits each."""
    above = 0
    for shift in (10, 0):
        low = np.zeros(1024, np.int64)
        for key in cand:
            if key >> (shift + 10) == prefix:
                low[(key >> shift) & 1023] += 1
        b, more = _find_bin(low, need - above)
        above += more
        prefix = (prefix << 10) | b
    return prefix, above


@njit(inline="always")
def _subtract_sent(c, w, take, k):
    """c -= the value sent where taken: the residual. A value that is not finite (an overflowed
    step's, which GradScaler skips) is not carried: 0, or it would stay NaN for good (Inf - Inf)."""
    cf, wf = c.view(np.float32), w.view(np.float32)
    for i in range(k):
        cf[i] -= wf[i] if take[i] else np.float32(0.0)  # c - 0.0 is c, -0.0 included
        if (c[i] & np.uint32(0x7F800000)) == np.uint32(0x7F800000):
            c[i] = np.uint32(0)


def _kth_key(g, res, has_res: bool, bf16_values: bool, k: int) -> tuple[int, int]:
    """(key of the k-th largest value, how many keys exceed it), by an exact radix selection:
    a histogram of the keys' top 11 bits over the whole tensor, then the keys of the bin that
    holds the k-th largest are collected and their lower 20 bits histogrammed (1 <= k <= the
    tensor's elements)."""
    hist = np.zeros(2048, np.int64)
    _top_bins(g, res, has_res, bf16_values, hist)
    top, above = _find_bin(hist, k)
    cand = np.empty(hist[top], np.int64)
    _collect(g, res, has_res, bf16_values, top, cand)
    key, more = _refine(cand, np.int64(top), k - above)
    return int(key), int(above + more)


@njit(**_NOGIL)
def _select(grad, res, has_res, bf16_values, threshold, ties, idx, values, out):
    """The positions whose key exceeds ``threshold``, and the first ``ties`` whose key equals it,
    into idx, with the values sent (float32 bits, or bfloat16 bits in ``values``); and out =
    compensated - sent (0 where nothing is sent), float32 or rounded to bfloat16. Returns the
    count selected."""
    c, tmp, w, key = _buffers()
    take = np.empty(SPAN, np.uint8)
    j = 0
    n = grad.shape[0]
    for lo in range(0, n, SPAN):
        k = min(SPAN, n - lo)
        _span(grad, res, has_res, bf16_values, lo, k, c, tmp, w, key)
        for i in range(k):
            take[i] = key[i] > threshold
        if ties > 0:
            for i in range(k):
                if key[i] == threshold and ties > 0:
                    take[i] = 1
                    ties -= 1
        for i in range(k):
            if take[i]:
                idx[j] = lo + i
                values[j] = w[i] >> np.uint32(16) if values.itemsize == 2 else w[i]
                j += 1
        _subtract_sent(c, w, take, k)
        if out.itemsize == 2:
            for i in range(k):
                out[lo + i] = _round_bf16(c[i])
        else:
            o = out[lo:lo + k].view(np.uint32)
            for i in range(k):
                o[i] = c[i]
    return j


@njit(**_NOGIL)
def _select_at_least(grad, res, has_res, bf16_values, threshold, idx, values, kept, out):
    """A sampled threshold's selection in one pass (no count first): the positions whose key
    is at least ``threshold`` into idx, with the values sent into ``values`` (as _select) and
    their compensated values' bits into ``kept``; out = compensated - sent, float32. Returns
    how many, or -1 if more than idx holds: out then holds every compensated value (those
    already replaced are restored from ``kept``), for the exact selection to start from."""
    c, tmp, w, key = _buffers()
    take = np.empty(SPAN, np.uint8)
    o = out.view(np.uint32)
    j = 0
    n = grad.shape[0]
    for lo in range(0, n, SPAN):
        k = min(SPAN, n - lo)
        _span(grad, res, has_res, bf16_values, lo, k, c, tmp, w, key)
        taken = 0
        for i in range(k):
            take[i] = key[i] >= threshold
            taken += take[i]
        if j + taken > idx.shape[0]:
            for q in range(j):
                o[idx[q]] = kept[q]
            for rest in range(lo, n, SPAN):  # out[lo:] is still the old residual where res is out
                m = min(SPAN, n - rest)
                _span(grad, res, has_res, bf16_values, rest, m, c, tmp, w, key)
                for i in range(m):
                    o[rest + i] = c[i]
            return -1
        for i in range(k):
            if take[i]:
                idx[j] = lo + i
                values[j] = w[i] >> np.uint32(16) if values.itemsize == 2 else w[i]
                kept[j] = c[i]
                j += 1
        _subtract_sent(c, w, take, k)
        for i in range(k):
            o[lo + i] = c[i]
    return j


def _bits(x: torch.Tensor) -> np.ndarray:
    """A tensor's memory as numpy: float32, or bfloat16 as uint16 bits."""
    return x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()


def supports(grad: torch.Tensor, value_dtype: torch.dtype, residual_dtype: torch.dtype) -> bool:
    """Whether these kernels take this combination (else the torch path runs)."""
    return (grad.device.type == "cpu" and grad.is_contiguous() and grad.dtype in DTYPES and value_dtype in DTYPES
            and residual_dtype in DTYPES and not (grad.dtype == torch.bfloat16 and value_dtype == torch.float32))


def compensated_topk(grad: torch.Tensor, residual: torch.Tensor | None, k: int, value_dtype: torch.dtype,
                     residual_dtype: torch.dtype, sample: torch.Tensor | None = None, sample_k: int = 0):
    """Error feedback and top-k in one: the k largest |grad + residual| (rounded to
    ``value_dtype``), ties to the lower index; or, given ``sample`` (positions), everything at
    or above the ``sample_k``-th largest of the sample, if that is between 1 and 2k entries.
    Returns (indices int32 ascending, values in value_dtype, the new residual), the residual
    being grad + residual - sent in ``residual_dtype``, written over ``residual`` when it has
    that dtype. ``residual`` None: the first step, no residual yet."""
    g = _bits(grad.reshape(-1))
    n = g.shape[0]
    has_res = residual is not None
    res = _bits(residual) if has_res else g
    bf16_values = value_dtype == torch.bfloat16
    out = residual if has_res and residual.dtype == residual_dtype else torch.empty(n, dtype=residual_dtype)
    threshold = None
    if sample is not None:
        keys = np.empty(sample.numel(), np.int64)
        _keys_at(g, res, has_res, bf16_values, sample.numpy(), keys)
        threshold = int(torch.kthvalue(torch.from_numpy(keys), sample.numel() - sample_k + 1).values)
        if out.dtype == torch.float32:  # one pass; out can hold the compensated values if it misjudged
            cap = min(n, 2 * k)
            idx, values = np.empty(cap, np.int32), torch.empty(cap, dtype=value_dtype)
            count = _select_at_least(g, res, has_res, bf16_values, threshold, idx, _bits(values).view(
                np.uint16 if bf16_values else np.uint32), np.empty(cap, np.uint32), _bits(out))
            if count > 0:
                return torch.from_numpy(idx[:count]), values[:count], out
            g = res = _bits(out)  # the sample misjudged: exact selection, from the compensated values
            has_res, threshold = False, None
        else:
            count = _count_from(g, res, has_res, bf16_values, threshold)
            if not 0 < count <= 2 * k:  # the sample misjudged: exact selection
                threshold = None
            ties = count
    if threshold is None:
        if k:
            threshold, above = _kth_key(g, res, has_res, bf16_values, k)
        else:
            threshold, above = 1 << 40, 0
        count, ties = k, k - above
    idx = np.empty(count, np.int32)
    values = torch.empty(count, dtype=value_dtype)
    taken = _select(g, res, has_res, bf16_values, threshold, ties, idx, _bits(values).view(
        np.uint16 if bf16_values else np.uint32), _bits(out))
    assert taken == count, (taken, count)
    # torch.from_numpy of an empty array has a stride of 0, which the packet's byte view refuses
    return (torch.from_numpy(idx) if count else torch.zeros(0, dtype=torch.int32)), values, out


@njit(**_NOGIL)
def _unpack(packets, offsets, counts, itemsize, numel, idx, val):
    """Each rank's pairs as arrays: idx[r, :counts[r]] and val[r, :counts[r]] as float32.
    Returns 0, or -1 for an index out of range or not strictly ascending."""
    for r in range(counts.shape[0]):
        last = -1
        for j in range(counts[r]):
            i = np.int64(_load_u32(packets, offsets[r] + 4 * j))
            if i <= last or i >= numel:
                return -1
            idx[r, j] = i
            last = i
        at = offsets[r] + 4 * counts[r]
        bits = val[r].view(np.uint32)
        if itemsize == 2:
            for j in range(counts[r]):
                bits[j] = np.uint32(_load_u16(packets, at + 2 * j)) << np.uint32(16)
        else:
            for j in range(counts[r]):
                bits[j] = np.uint32(_load_u32(packets, at + 4 * j))
    return 0


@njit(**_NOGIL)
def _add_pairs(idx, val, counts, acc):
    """acc[idx[r, j]] += val[r, j], rank by rank: each position's values in rank order. (A merge
    of the sorted lists, which would write the output in order, ran 2-4x slower: which ranks
    hold the next index is random, so its loop either branched at random or carried its
    positions through memory.)"""
    for r in range(idx.shape[0]):
        for j in range(counts[r]):
            acc[idx[r, j]] += val[r, j]


@njit(**_NOGIL)
def _average(acc, nranks):
    for i in range(acc.shape[0]):
        acc[i] /= np.float32(nranks)


@njit(**_NOGIL)
def _round_into(acc, bf16_values, out):
    """out = acc rounded to bfloat16 if the values are, as float32 bits (uint32) or bfloat16 bits."""
    bits = acc.view(np.uint32)
    if out.itemsize == 2:
        for i in range(acc.shape[0]):
            out[i] = _round_bf16(bits[i])
    elif bf16_values:
        for i in range(acc.shape[0]):
            out[i] = _round_bf16(bits[i]) << np.uint32(16)
    else:
        for i in range(acc.shape[0]):
            out[i] = bits[i]


def sum_pairs_into(parts: list[torch.Tensor], value_dtype: torch.dtype, average: bool, nranks: int,
                   out: torch.Tensor) -> None:
    """out (float32 or bfloat16) = the dense sum of the ranks' top-k packets (``parts``, in rank
    order, headers already validated by the caller), in rank order in float32 from +0.0,
    averaged if ``average``, rounded to the values' dtype, and zero where no rank sent a value.
    Out-of-range or unordered indices raise FormatError."""
    buf = torch.cat([p.reshape(-1) for p in parts]).numpy()
    sizes = [p.numel() for p in parts]
    offsets = np.cumsum([0] + sizes[:-1]).astype(np.int64) + HEADER_SIZE
    itemsize = 2 if value_dtype == torch.bfloat16 else 4
    counts = np.array([(s - HEADER_SIZE) // (4 + itemsize) for s in sizes], np.int64)
    flat = out.reshape(-1)
    idx = np.empty((len(parts), int(counts.max(initial=0))), np.int64)
    val = np.empty((len(parts), int(counts.max(initial=0))), np.float32)
    if _unpack(buf, offsets, counts, itemsize, flat.numel(), idx, val):
        raise FormatError("top-k indices must be in range and strictly ascending (no duplicates)")
    view = _bits(flat)
    if flat.dtype == torch.float32 and itemsize == 4:
        acc = view  # sums in place: no rounding to do
    else:
        acc = _scratch_f32(flat.numel())
    acc[:] = 0
    _add_pairs(idx, val, counts, acc)
    if average:
        _average(acc, nranks)
    if acc is not view:
        _round_into(acc, itemsize == 2, view if view.dtype == np.uint16 else view.view(np.uint32))


_local = threading.local()


def _scratch_f32(n: int) -> np.ndarray:
    """A float32 buffer of ``n`` elements this thread reuses (a fresh one faults in page by page)."""
    buf = getattr(_local, "acc", None)
    if buf is None or buf.size < n:
        buf = _local.acc = np.empty(n, np.float32)
    return buf[:n]
