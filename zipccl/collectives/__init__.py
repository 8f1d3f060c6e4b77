"""Compressed all-reduce, reduce-scatter and all-gather: the only place that knows how bytes move.

Algorithms (DESIGN.md):
- reduce-scatter (ZIPCCL_REDUCE_SCATTER): "direct" (default) sends each chunk's
  packet to its owner, to every peer at once, and the owner decodes and reduces
  them in rank order (fp32 accumulation for 16-bit types, rounded once); "ring"
  passes re-encoded partial sums around a ring, rounded per hop as in NCCL;
- all-gather: the local shard encoded once and sent to every peer, every peer's
  packet decoded;
- all-reduce = reduce-scatter + all-gather of each owner's reduced chunk,
  encoded once by its owner, so every rank ends with the owner's exact bits;
- top-k (lossy) all-reduce: every rank's (index, value) packet to everyone, or
  to the owner of each chunk and back (sparse_algorithm), added in rank order;
  top-k reduce-scatter: the pairs of each chunk to its owner only.

Each phase moves in pipeline pieces, several in flight: a piece's packets are
posted before the previous piece is awaited, so the links never wait for a
piece boundary, and the codec works on one piece while others are on the wire.

Before any payload moves, the ranks exchange one small int64 vector, pairwise: a status
(0, an invalid call, or a failure's poison code), the call's signature (collective, dtype,
numel, op, codec, algorithm), this rank's times of the group's earlier "auto" calls (which
zipccl.auto learns from, the same way on every rank) and the first piece's packet sizes. A
rank whose call is invalid, or ranks that disagree, make every rank raise (MismatchError, or
the local error on the offending rank) instead of hanging in a mismatched collective. Later
pipeline pieces send their sizes pairwise (_SizeMail): an all-gather in mid-pipeline would
wait for the slowest rank and, on a shaped link, behind queued bulk data. A failure in
mid-call goes on poisoned to the end of the schedule and a status round ends the call, so
that every rank raises RankFailure (zipccl.failure).

Every message keeps NCCL's rules (DESIGN.md invariant 12): the sends and receives of one
exchange are issued in one group call (``Transport.grouped``), both ranks of a pair issue their
messages in the same order, so that they match without tags, and a receive has its packet's
exact size, so it is posted once the piece's size mail has come; only a transport that declares
``loose_receives`` (gloo) gets its receives posted early at the codec's bound (pipeline.post).
The test suite runs under ZIPCCL_STRICT_TRANSPORT=1, which checks all three on gloo.

One module per idea, imports pointing down this list:
- resolve: which codec a call's codec argument means (NATIVE, AUTO, Raw, Lossless, TopK);
- autoplan: codec "auto"'s policy per group, fed by the metadata exchanges;
- metadata: the per-call exchange (Call), the pairwise size mails, the messages' tags;
- pipeline: pipeline pieces, and how one piece's packets are sized, posted and landed;
- algorithms: the dense reduce-scatters (direct, ring) and the all-gather pipeline;
- sparse_reduce: the top-k all-reduce and reduce-scatter;
- validation: a call's local checks and accounting;
- flat: one flat collective, run (run_flat) or validated, planned and queued (async: zipccl.executor),
  and the public all_reduce, reduce_scatter and all_gather.
"""

from ..executor import Handle, submit
from .algorithms import reduce_in_rank_order
from .autoplan import FLAT_PLANS, auto_policy, planned, plans_for, undone
from .flat import all_gather, all_reduce, flat_collective, native, reduce_scatter, refuse_in_step, run_flat
from .metadata import Call, timed
from .pipeline import pieces
from .resolve import AUTO, NATIVE, PLAN_CODECS, check_op, resolve_codec
from .sparse_reduce import _sum_pairs, sparse_algorithm, sparse_bytes
from .validation import (carrier, check_carrier, check_shapes, finish, input_size, new_acc, prepare, refusal_carrier,
                         refuse)

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "resolve_codec", "auto_policy", "sparse_algorithm",
           "sparse_bytes", "submit", "Handle", "NATIVE", "FLAT_PLANS", "run_flat", "planned", "undone", "native",
           "refuse_in_step"]
