"""Top-k (lossy) all-reduce and reduce-scatter: gather every rank's pairs, or scatter them to chunk owners
(and, for the all-reduce, gather the reduced chunks back)."""

from __future__ import annotations

import time

import torch

from .. import format as F
from ..errors import FormatError, MismatchError
from ..failure import DECODE, ENCODE, Fate
from ..kernels import sparse
from ..reference.packet import headers_of, to_host
from .algorithms import _acc_dtype
from .metadata import _TAG_SPARSE, Call, _meta_bytes, timed
from .pipeline import land_plain, post_plain
from .resolve import _OPS, _RAW


def sparse_bytes(n: int, density: float, itemsize: int) -> dict[str, float]:
    """Bytes per element N of the tensor that each algorithm of a top-k all-reduce of ``n`` ranks
    moves per rank. Gather: every rank receives every other rank's k pairs, (n-1)·k·(4+s).
    Scatter: pairs go to the owner of their chunk, k·(4+s)·(n-1)/n, then each owner's reduced
    chunk goes to everyone, sparse or dense, (n-1)/n·N·min(u·(4+s), s), with u = 1-(1-d)^n the
    union's density if ranks chose independently (an upper bound: gradients' top-k overlap)."""
    pair = 4 + itemsize
    union = 1 - (1 - density) ** n
    return {"gather": (n - 1) * density * pair,
            "scatter": density * pair * (n - 1) / n + (n - 1) / n * min(union * pair, itemsize)}


def sparse_algorithm(n: int, density: float, itemsize: int) -> str:
    """"gather" or "scatter": whichever moves fewer bytes per rank (sparse_bytes)."""
    moved = sparse_bytes(n, density, itemsize)
    return "scatter" if moved["scatter"] < moved["gather"] else "gather"


def _sparse_all_reduce(t, flat: torch.Tensor, op, codec, call: Call, acc: dict, fate: Fate) -> None:
    """Top-k all-reduce. Both algorithms add the ranks' pairs in rank order into an fp32 (or
    the dtype's) accumulator and round once, so they give the same bits on every rank. Each
    metadata exchange carries the ranks' status: a failure before it (selection, encoding,
    the owners' reduction) makes every rank raise there (zipccl.failure)."""
    algorithm = getattr(codec, "algorithm", "auto")
    if algorithm == "auto":
        algorithm = sparse_algorithm(t.size, codec.density, flat.element_size())
    acc["raw_bytes"] += 2 * (t.size - 1) * -(-flat.numel() // t.size) * flat.element_size()  # a dense all-reduce
    selected = timed(acc, "codec_seconds", fate.guard, ENCODE, codec.select, flat)
    if algorithm == "gather":
        packet = timed(acc, "codec_seconds", fate.guard, ENCODE, lambda: codec.encode_selected(*selected, flat.numel()))
        parts = _sparse_all_gather(t, packet, call, acc, fate)
        t0 = time.perf_counter()
        headers = _validate(t, fate, parts, codec, flat.numel())
        fate.guard(DECODE, _sum_gathered, parts, headers, codec, flat, op, t.size)
        acc["codec_seconds"] += time.perf_counter() - t0
        return
    # scatter: each owner reduces its chunk, then everyone gathers the reduced chunks
    n, r, numel = t.size, t.rank, flat.numel()
    m = -(-numel // n)
    bounds = [min(numel, j * m) for j in range(n + 1)]
    mine = flat[bounds[r]:bounds[r + 1]]
    summed = _to_owners(t, flat, selected, bounds, op, codec, call, acc, fate)  # None once poisoned
    own = timed(acc, "codec_seconds", fate.guard, DECODE,
                lambda: (summed[0].to(flat.dtype), torch.nonzero(summed[1]).reshape(-1).to(torch.int32)))

    def encode_own(reduced, where):
        as_pairs = where.numel() * (4 + flat.element_size()) < mine.numel() * flat.element_size()
        return codec.encode_selected(where, reduced[where.long()], mine.numel()) if as_pairs else _RAW.encode(reduced)

    packet = timed(acc, "codec_seconds", fate.guard, ENCODE, lambda: encode_own(*own))
    gather = Call("all_reduce/gather", flat.dtype, numel, op, codec)

    def unpack(parts, headers):
        """Each owner's chunk into place: raw ones copied, top-k ones parsed together (one read)."""
        sparse_parts = [j for j, h in enumerate(headers) if h.codec != F.CODEC_RAW]
        for j, h in enumerate(headers):
            if h.codec == F.CODEC_RAW:
                _RAW.decode(parts[j], out=flat[bounds[j]:bounds[j + 1]])
        pairs = codec.parse_many([parts[j] for j in sparse_parts], m, [headers[j] for j in sparse_parts])
        for j, (h, i, v) in zip(sparse_parts, pairs):
            chunk = F.check_out(h, flat[bounds[j]:bounds[j + 1]])
            chunk.zero_()
            chunk[i] = v

    gathered = _sparse_all_gather(t, packet, gather, acc, fate)
    headers = _validate(t, fate, gathered, None, m)
    timed(acc, "codec_seconds", fate.guard, DECODE, unpack, gathered, headers)


def _sparse_reduce_scatter(t, flat: torch.Tensor, out: torch.Tensor, op, codec, call: Call, acc: dict,
                           fate: Fate) -> None:
    """Top-k reduce-scatter: each rank's pairs go only to the owner of their chunk, which adds
    them in rank order (fp32 for 16-bit types), rounds once and keeps the result: (n-1)/n of the
    pairs cross the network, against the all-reduce's (n-1) times all of them."""
    n, m = t.size, out.numel()
    acc["raw_bytes"] += (n - 1) * m * flat.element_size()  # a dense reduce-scatter
    selected = timed(acc, "codec_seconds", fate.guard, ENCODE, codec.select, flat)
    summed = _to_owners(t, flat, selected, [j * m for j in range(n + 1)], op, codec, call, acc, fate)
    timed(acc, "codec_seconds", fate.guard, DECODE, lambda: out.view(-1).copy_(summed[0]))  # rounded once


def _to_owners(t, flat: torch.Tensor, selected, bounds: list, op, codec, call: Call, acc: dict, fate: Fate):
    """Send each chunk's pairs (chunk j: flat[bounds[j]:bounds[j + 1]]) to its owner, rank j;
    return this rank's reduced chunk (the accumulator dtype) and the mask of its positions that
    any rank named. Every rank raises in the size exchange if any rank's selection failed."""
    n, r = t.size, t.rank

    def split():
        idx, values = selected
        cut = to_host(_cuts(idx, bounds)).tolist()  # on CUDA a bounded read
        return [codec.encode_selected(idx[cut[j]:cut[j + 1]] - bounds[j], values[cut[j]:cut[j + 1]],
                                      bounds[j + 1] - bounds[j]) for j in range(n)]

    parts = timed(acc, "codec_seconds", fate.guard, ENCODE, split)
    sizes = timed(acc, "comm_seconds", call.exchange, t, [p.numel() for p in parts] if parts else [], None, fate)
    acc["meta_bytes"] += _meta_bytes(n)
    fate.check()  # every rank knows every rank's status: all raise here, or none
    send_splits = [0 if j == r else parts[j].numel() for j in range(n)]
    recv_splits = [0 if j == r else int(sizes[j, r]) for j in range(n)]
    send = torch.cat([parts[j] for j in range(n) if j != r])
    recv = _all_to_all(t, fate, acc, send, send_splits, recv_splits)
    mine = flat[bounds[r]:bounds[r + 1]]
    received = _in_rank_order(recv, recv_splits, parts[r], r)
    headers = _validate(t, fate, received, codec, mine.numel())
    return timed(acc, "codec_seconds", fate.guard, DECODE, _sum_pairs, received, codec, mine, op, n, headers)


def _cuts(idx: torch.Tensor, bounds: list) -> torch.Tensor:
    """Where each of ``bounds`` falls in the ascending indices ``idx``: the bounds made on the
    indices' device (a CUDA index searched with CPU bounds fails)."""
    return torch.searchsorted(idx.to(torch.int64), torch.tensor(bounds, dtype=torch.int64, device=idx.device))


def _validate(t, fate: Fate, parts: list, codec, max_numel: int) -> list:
    """Every rank's packet header (``codec.header``, or the common header where None), read in
    one read of the device, checked to claim at most ``max_numel`` elements; one that fails is
    blamed on its sender (zipccl.failure) and is None in the list."""
    def common(p, bound, head):
        h = F.parse_header(head, None, p.numel())
        if h.numel > bound:
            raise FormatError(f"packet claims {h.numel} elements, more than the {bound} expected")
        return h
    heads = fate.guard(DECODE, headers_of, parts)
    if heads is None:
        return [None] * len(parts)
    return [fate.decode(t, j, codec.header if codec is not None else common, part, max_numel, head)
            for j, (part, head) in enumerate(zip(parts, heads))]


def _sum_gathered(parts, headers, codec, flat: torch.Tensor, op, n: int) -> None:
    """flat = the sum of every rank's top-k packet (``parts``, in rank order, with their
    validated ``headers``), AVG divided."""
    values_dtype = headers[0].dtype
    if flat.device.type == "cpu" and flat.dtype in sparse.DTYPES and values_dtype in sparse.DTYPES:
        if any((h.dtype, h.numel) != (values_dtype, flat.numel()) for h in headers):
            raise MismatchError("top-k packets of the ranks differ in dtype or element count")
        sparse.sum_pairs_into(parts, values_dtype, _OPS[op] == 2, n, flat)  # one pass, no fp32 copy
    else:
        total, _ = _sum_pairs(parts, codec, flat, op, n, headers)
        flat.copy_(total)


def _sparse_all_gather(t, packet: torch.Tensor | None, call: Call, acc: dict, fate: Fate) -> list[torch.Tensor]:
    """Every rank's packet, in rank order (this rank's own included), by one all-to-all; raises
    on every rank instead if any rank's call has failed (``packet`` None here)."""
    n, r = t.size, t.rank
    sizes = timed(acc, "comm_seconds", lambda: call.exchange(t, [packet.numel()] if packet is not None else [],
                                                             None, fate)[:, 0].tolist())
    acc["meta_bytes"] += _meta_bytes(n)
    fate.check()
    send_splits = [0 if j == r else packet.numel() for j in range(n)]
    recv_splits = [0 if j == r else sizes[j] for j in range(n)]
    recv = _all_to_all(t, fate, acc, packet.repeat(n - 1), send_splits, recv_splits)
    return _in_rank_order(recv, recv_splits, packet, r)


def _all_to_all(t, fate: Fate, acc: dict, send, send_splits, recv_splits) -> torch.Tensor:
    """``send`` cut by ``send_splits``, one part to each rank, and the parts the ranks send here,
    concatenated in rank order: point-to-point messages on zipccl's own tag (the pipeline's plain
    piece, its bytes counted there), never the group's own all-to-all, a collective that zipccl's
    thread would issue beside the caller's own collectives on that group (DDP's all-reduce of its
    unused parameters' map, from autograd's thread) in another order on each rank. A rank lost in
    it makes this rank raise RankFailure."""
    recv = torch.empty(sum(recv_splits), dtype=torch.uint8, device=send.device)
    sends = {j: part for j, part in enumerate(send.split(list(send_splits))) if send_splits[j]}
    recvs = {j: part for j, part in enumerate(recv.split(list(recv_splits))) if recv_splits[j]}
    posted, works = timed(acc, "comm_seconds", post_plain, t, sends, recvs, _TAG_SPARSE, acc, fate)
    land_plain(t, posted, works, acc, fate)
    fate.check()
    return recv


def _in_rank_order(recv: torch.Tensor, recv_splits: list[int], own: torch.Tensor, r: int) -> list[torch.Tensor]:
    """An all-to-all's received bytes cut per sender, with this rank's own packet in its place."""
    out, offset = [], 0
    for j, size in enumerate(recv_splits):
        out.append(own if j == r else recv[offset:offset + size])
        offset += size
    return out


def _sum_pairs(parts, codec, like: torch.Tensor, op, n: int, headers: list | None = None):
    """(sum of the packets' pairs in rank order, averaged for AVG, in fp32 for 16-bit types; mask of
    the positions any packet named). Indices are unique within a packet, so each add is exact.
    ``headers``: the packets' headers, where _validate has read them."""
    total = torch.zeros(like.numel(), dtype=_acc_dtype(like.dtype), device=like.device)
    named = torch.zeros(like.numel(), dtype=torch.bool, device=like.device)
    for _, i, v in codec.parse_many(parts, like.numel(), headers):  # one read of the device in all
        total.index_add_(0, i, v.to(total.dtype))
        named[i] = True
    if _OPS[op] == 2:
        total.div_(n)
    return total, named
