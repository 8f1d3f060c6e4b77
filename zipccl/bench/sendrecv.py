"""zipccl-perf spec of send/recv (nccl-tests' sendrecv_perf): every rank sends count elements to
the next rank and receives as many from the previous one, both in one batch (a ring shift);
size = count elements, busbw = algbw (factor 1); redop names the op (-o) as nccl-tests prints
it, though nothing is reduced; in place, one buffer is sent and received into, timed and not
checked (as nccl-tests)."""

import torch
import torch.distributed as dist

import zipccl

from .common import Spec


def _run(out, inp, op, group, codec, algorithm="auto"):
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    nxt, prv = (me + 1) % n, (me - 1) % n
    if codec is None:
        ops = [dist.P2POp(dist.isend, inp, group=group, group_peer=nxt),
               dist.P2POp(dist.irecv, out, group=group, group_peer=prv)]
        works = dist.batch_isend_irecv(ops)
    else:
        works = zipccl.batch_isend_irecv([zipccl.P2POp(zipccl.isend, inp, group=group, group_peer=nxt, codec=codec),
                                          zipccl.P2POp(zipccl.irecv, out, group=group, group_peer=prv, codec=codec)])
    for w in works:
        w.wait()


def expect(inputs, op, rank, nranks):
    return inputs[(rank - 1) % nranks].double()


def _in_place(numel_in, numel_out, rank, nranks, dtype):
    buf = torch.empty(numel_in, dtype=dtype)
    return buf, buf


SPEC = Spec("sendrecv", True, lambda n: 1.0, lambda count, n: (count, count), _run, expect, _in_place,
            checks_in_place=False, reduces=False, policy_name="send")
