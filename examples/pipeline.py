"""A two-stage pipeline: activations sent forward, their gradients sent back, with plain send and recv.

    python examples/pipeline.py --nranks 2 --steps 5                                 # gloo
    ZIPCCL_CODEC=lossless python examples/pipeline.py --nranks 2 --backend zipccl    # the drop-in

examples/train_gpt.py's GPT cut in two: stage 0 (even ranks) runs the embeddings and the first
half of the blocks, stage 1 (the next rank) the second half and the head. Each step runs its
micro-batches forward (stage 0 sends each micro-batch's activations with ``dist.send``, stage 1
receives them with ``dist.recv``), then backward (stage 1 sends the gradients of those
activations back, stage 0 receives them and finishes the backward pass): GPipe's schedule. The
model runs in bf16 (--dtype), so what travels are bf16 activations and gradients; with
``backend="zipccl"`` and ZIPCCL_CODEC=lossless they travel compressed and the parameters come
out bit-identical to gloo's (the JSON's hash). With 4 ranks, ranks 2 and 3 are a second pipeline.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import GPT, batches, stdlib_text  # noqa: E402

import zipccl  # noqa: E402,F401 - registers backend="zipccl"
from zipccl import launch  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Stage(torch.nn.Module):
    """Stage 0: embeddings and the first blocks; stage 1: the other blocks, the norm and the head."""

    def __init__(self, gpt: GPT, stage: int):
        super().__init__()
        half = len(gpt.blocks) // 2
        self.stage = stage
        if stage == 0:
            self.tok, self.pos, self.blocks = gpt.tok, gpt.pos, gpt.blocks[:half]
        else:
            self.blocks, self.ln, self.head = gpt.blocks[half:], gpt.ln, gpt.head

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1])) if self.stage == 0 else x
        for block in self.blocks:
            h = block(h)
        return h if self.stage == 0 else self.head(self.ln(h))


def train(rank: int, world: int, steps: int = 5, micro: int = 4, d: int = 64, layers: int = 4, ctx: int = 32,
          batch: int = 4, dtype: str = "bf16", group=None, text_bytes: int = 1 << 20) -> dict:
    """``steps`` steps of this rank's stage (ranks 2k and 2k+1 are one pipeline, talking on
    ``group``); the losses (stage 1), the hash of this stage's parameters and what zipccl moved."""
    if world % 2:
        raise ValueError(f"the pipeline needs an even number of ranks (two per pipeline), got {world}")
    zipccl.reset_stats()
    stage, peer = rank % 2, rank ^ 1  # group ranks: the other stage of this pipeline
    torch.manual_seed(rank // 2)  # both stages of a pipeline cut the same model
    model = Stage(GPT(d, layers, 4, ctx), stage).to(DTYPES[dtype])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    text = stdlib_text(text_bytes)
    gen = torch.Generator().manual_seed(rank // 2)
    shape = (batch, ctx, d)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        micro_batches = [batches(text, batch, ctx, gen) for _ in range(micro)]
        kept = []
        for x, y in micro_batches:  # forward: activations to stage 1
            if stage == 0:
                h = model(x)
                dist.send(h.detach(), group=group, group_dst=peer)
                kept.append(h)
            else:
                h = torch.empty(shape, dtype=DTYPES[dtype])
                dist.recv(h, group=group, group_src=peer)
                h.requires_grad_()
                loss = F.cross_entropy(model(h).float().reshape(-1, 256), y.reshape(-1)) / micro
                kept.append((h, loss))
                losses.append(loss.item() * micro)
        for item in kept:  # backward: the activations' gradients to stage 0
            if stage == 1:
                h, loss = item
                loss.backward()
                dist.send(h.grad, group=group, group_dst=peer)
            else:
                grad = torch.empty(shape, dtype=DTYPES[dtype])
                dist.recv(grad, group=group, group_src=peer)
                item.backward(grad)
        opt.step()
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    s = zipccl.stats()
    moved = {k: {f: s[k][f] for f in ("calls", "raw_bytes", "wire_bytes")} for k in ("send", "recv") if k in s}
    return dict(stage=stage, losses=losses, param_sha256=hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
                backend=dist.get_backend(group), moved=moved)


def _spawned(rank, world, args):
    return train(rank, world, args.steps, dtype=args.dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nranks", type=int, default=2, help="local ranks when started without a launcher (even)")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "zipccl"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--json", help="write the summaries of ranks 0 and 1 here")
    args = ap.parse_args(argv)
    if launch.detect():
        world = launch.init(backend=args.backend)
        mine = train(world.rank, world.size, args.steps, dtype=args.dtype)
        every = [None] * world.size
        dist.all_gather_object(every, mine)
        results = every if world.rank == 0 else []  # rank 0 alone prints and writes, for ranks 0 and 1
        launch.shutdown()
    else:
        results = launch.spawn(_spawned, args.nranks, args, backend=args.backend)
    for r in results[:2]:
        if r is not None and r["stage"] == 1:
            print(f"backend {r['backend']}: losses {' '.join(f'{v:.4f}' for v in r['losses'][::4])} ...", flush=True)
        if r is not None:
            print(f"stage {r['stage']}: zipccl moved {r['moved'] or 'nothing (the backend carried it)'}; params "
                  f"sha256 {r['param_sha256'][:16]}", flush=True)
    if args.json and results:
        Path(args.json).write_text(json.dumps(results[:2], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
