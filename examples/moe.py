"""A mixture-of-experts layer with expert parallelism, trained through plain torch.distributed calls.

    python examples/moe.py --nranks 4 --steps 5                                 # gloo
    ZIPCCL_CODEC=lossless python examples/moe.py --nranks 4 --backend zipccl    # the drop-in
    ZIPCCL_TOPOLOGY=2x2 python examples/moe.py --nranks 4 --backend zipccl --json out.json

Each rank holds one expert (an MLP) and a replica of the rest (embeddings, the router, the
head). Every token is routed to its best expert (top-1, scaled by the router's probability):
the ranks first tell each other how many tokens go where (an all-to-all of counts), then
dispatch the tokens with ``all_to_all_single`` and uneven splits, run their expert on what
arrived, and send the results back the same way; the backward pass runs the two all-to-alls
in reverse (``torch.distributed.nn.functional.all_to_all_single``). The replicated
parameters' gradients are averaged with an all-gather and a sum in rank order, so a step is
data movement plus local arithmetic: with ``backend="zipccl"`` and ZIPCCL_CODEC=lossless the
parameters come out bit-identical to gloo's (the JSON's hash), with the activations and their
gradients compressed on the wire.
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import batches, stdlib_text  # noqa: E402

import zipccl  # noqa: E402,F401 - registers backend="zipccl"
from zipccl import launch  # noqa: E402


class Expert(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class MoELM(torch.nn.Module):
    """Byte embeddings, one MoE feed-forward layer (this rank's expert), a head."""

    def __init__(self, d: int, ctx: int, experts: int, rank: int):
        super().__init__()
        torch.manual_seed(0)  # the replicated parameters: the same on every rank
        self.tok, self.pos = torch.nn.Embedding(256, d), torch.nn.Embedding(ctx, d)
        self.router, self.ln, self.head = torch.nn.Linear(d, experts), torch.nn.LayerNorm(d), torch.nn.Linear(d, 256)
        torch.manual_seed(1 + rank)  # each rank's own expert
        self.expert = Expert(d)

    def replicated(self) -> list[torch.nn.Parameter]:
        return [p for name, p in self.named_parameters() if not name.startswith("expert.")]

    def forward(self, x, group=None):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        tokens = h.reshape(-1, h.shape[-1])
        probs = self.router(tokens).softmax(-1)
        weight, choice = probs.max(-1)
        order = choice.argsort(stable=True)  # tokens grouped by expert (= rank)
        counts = torch.bincount(choice, minlength=probs.shape[-1])
        arriving = torch.empty_like(counts)
        dist.all_to_all_single(arriving, counts, group=group)  # how many tokens each rank sends here
        send, recv = counts.tolist(), arriving.tolist()
        mine = dnn.all_to_all_single(tokens.new_empty(sum(recv), tokens.shape[-1]), tokens[order], recv, send,
                                     group=group)
        done = dnn.all_to_all_single(tokens.new_empty(tokens.shape), self.expert(mine), send, recv, group=group)
        moe = torch.empty_like(done).index_copy(0, order, done) * weight[:, None]
        return self.head(self.ln(h + moe.view_as(h)))


def average_exactly(params: list[torch.Tensor], group=None) -> None:
    """Every rank's gradients gathered, summed in rank order and divided: the same bits on any backend."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    world = dist.get_world_size(group)
    every = flat.new_empty(world * flat.numel())
    dist.all_gather_into_tensor(every, flat, group=group)
    total = every.view(world, -1).sum(0) / world
    at = 0
    for p in params:
        p.grad.copy_(total[at:at + p.numel()].view_as(p))
        at += p.numel()


def train(rank: int, world: int, steps: int = 5, d: int = 64, ctx: int = 32, batch: int = 8, group=None,
          text_bytes: int = 1 << 20) -> dict:
    """``steps`` steps of the MoE model on ``group`` (None: the default group); its losses, the
    hash of this rank's parameters and what zipccl moved."""
    zipccl.reset_stats()
    text = stdlib_text(text_bytes)
    model = MoELM(d, ctx, world, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    losses = []
    for _ in range(steps):
        x, y = batches(text, batch, ctx, gen)
        loss = F.cross_entropy(model(x, group).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        average_exactly(model.replicated(), group)
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    moved = zipccl.stats().get("all_to_all", {})
    return dict(losses=losses, param_sha256=hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
                backend=dist.get_backend(group), all_to_all_calls=moved.get("calls", 0),
                raw_bytes=moved.get("raw_bytes", 0), wire_bytes=moved.get("wire_bytes", 0))


def _spawned(rank, world, args):
    return train(rank, world, args.steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nranks", type=int, default=4, help="local ranks when started without a launcher")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "zipccl"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", help="write rank 0's summary here")
    args = ap.parse_args(argv)
    if launch.detect():
        world = launch.init(backend=args.backend)
        mine = train(world.rank, world.size, args.steps)
        results = [mine] if world.rank == 0 else []  # rank 0 alone prints and writes
        launch.shutdown()
    else:
        results = launch.spawn(_spawned, args.nranks, args, backend=args.backend)
    if results and results[0] is not None:
        r = results[0]
        print(f"backend {r['backend']}: losses {' '.join(f'{v:.4f}' for v in r['losses'])}; all-to-all sent "
              f"{r['wire_bytes'] / 1e6:.2f} MB for {r['raw_bytes'] / 1e6:.2f} MB; "
              f"params sha256 {r['param_sha256'][:16]}")
        if args.json:
            Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
