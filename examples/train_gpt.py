"""Train a small GPT-style byte-level language model with DDP, with or without zipccl.

    python examples/train_gpt.py --comm lossless --steps 50          # 2 local ranks over gloo
    python examples/train_gpt.py --nranks 4 --comm torch --netlab 1gbit --json out.json
    ZIPCCL_CODEC=lossless python examples/train_gpt.py --backend zipccl --comm torch   # the drop-in
    torchrun --nproc-per-node 2 examples/train_gpt.py --comm raw

--comm torch is DDP's own all-reduce (compressed by zipccl's drop-in backend with
--backend zipccl: no other change to the training code; ZIPCCL_CODEC sets its policy); auto, native, raw and lossless use zipccl's DDP
hook (with --algorithm, and --nodes N for N emulated nodes: the lab's shape with --netlab); topk
(--density) and entropy (density from the gradient-entropy trend) are zipccl's
lossy, error-feedback codecs; none skips the averaging (the ranks drift apart) to
time the step's compute alone.
--dtype bf16 sends bf16 gradients (zipccl.ddp.bf16_hook; PyTorch's bf16 wrapper
for torch). The text is the Python standard library's own source, which exists
on every machine. The JSON summary holds the losses, the evaluation loss on 32
fixed windows, the median step time (all steps, and the second half: past the learning
calls of --comm auto), communication time and bytes, and a hash
of the final parameters (bit-identical for raw and lossless).
"""

# No "from __future__ import annotations": DDP checks a hook's annotations as real types.

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import zipccl.ddp
import zipccl.entropy
import zipccl.rules
from zipccl import launch


def stdlib_text(limit: int) -> torch.Tensor:
    """The standard library's .py files, sorted by path and concatenated, as bytes (first ``limit``)."""
    paths = []
    for top, dirs, files in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = [d for d in dirs if d != "site-packages"]  # not walked: it can hold far more than the library
        paths += [Path(top, f) for f in files if f.endswith(".py")]
    chunks, total = [], 0
    for path in sorted(paths):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """Decoder-only, pre-LayerNorm, byte vocabulary, learned positions, untied head."""

    def __init__(self, d: int = 256, layers: int = 4, heads: int = 4, ctx: int = 128):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(256, d), torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, 256)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                torch.nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def batches(text: torch.Tensor, n: int, ctx: int, gen: torch.Generator):
    starts = torch.randint(0, text.numel() - ctx - 1, (n,), generator=gen)
    idx = starts[:, None] + torch.arange(ctx + 1)
    window = text[idx]
    return window[:, :-1], window[:, 1:]


def register(ddp: DDP, comm: str, dtype: str, group, timing: dict, density: float = 0.01, options=None):
    """The communication of --comm/--dtype (``options``: --algorithm and the lossy flags); returns
    the zipccl state (None for torch)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    if comm.startswith("powersgd"):  # PyTorch's PowerSGD hook, for comparison (rank from the name)
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=int(comm[len("powersgd"):]),
                                       start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        return None
    if comm == "none":  # no averaging at all (the ranks drift apart): the step's compute floor

        def skip(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        ddp.register_comm_hook(None, skip)
        return None
    if comm == "torch":
        base = default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook) if dtype == "bf16" \
            else default_hooks.allreduce_hook

        def timed(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            t0 = time.perf_counter()

            def stop(fut):
                timing["comm_seconds"] += time.perf_counter() - t0
                return fut.value()
            return base(state, bucket).then(stop)
        ddp.register_comm_hook(group, timed)
        return None
    opts = dict(options or {})
    rate = None
    if comm == "entropy":
        rate = zipccl.entropy.EntropyRate(**{k: opts[k] for k in ("start", "warmup", "min_density", "max_density")
                                             if opts.get(k) is not None})
    rules = zipccl.rules.LayerRules() if opts.get("rules", True) else None
    state = zipccl.ddp.State(group=group, codec=comm, density=density, rate=rate, rules=rules, model=ddp.module,
                             algorithm=opts.get("algorithm", "auto"),
                             sampled=opts.get("sampled", False),
                             value_dtype=torch.bfloat16 if opts.get("bf16_values") else None)
    ddp.register_comm_hook(state, zipccl.ddp.bf16_hook if dtype == "bf16" else zipccl.ddp.hook)
    return state


def optimizer(model: torch.nn.Module, lr: float):
    """AdamW with weight decay on the weight matrices only, and 20 steps of linear warm-up."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)],
                            lr=lr, betas=(0.9, 0.95))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))


def run_steps(forward, model: torch.nn.Module, opt, sched, text: torch.Tensor, split: int, args, rank: int,
              logits=lambda out: out) -> tuple[list, list, float]:
    """``args.steps`` steps on ``text[:split]`` (``forward``: the wrapped model), each timed from a
    barrier; then the loss of ``model`` on 32 held-out windows. ``logits`` maps the model's output
    to what the loss takes. Returns (losses, seconds per step, eval loss)."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    losses, times = [], []
    for step in range(args.steps):
        x, y = batches(text[:split], args.batch, args.ctx, gen)
        dist.barrier()
        t0 = time.perf_counter()
        loss = F.cross_entropy(logits(forward(x)).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  {times[-1] * 1e3:.0f} ms", flush=True)
    gen_eval = torch.Generator().manual_seed(12345)
    with torch.no_grad():
        x, y = batches(text[split:], 32, args.ctx, gen_eval)
        eval_loss = F.cross_entropy(logits(model(x)).reshape(-1, 256), y.reshape(-1)).item()
    return losses, times, eval_loss


def train(rank: int, nranks: int, args) -> dict:
    torch.manual_seed(args.seed)
    text = stdlib_text(args.text_bytes)
    split = int(text.numel() * 0.95)
    model = GPT(args.d_model, args.layers, args.heads, args.ctx)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
    timing = dict(comm_seconds=0.0)
    state = register(ddp, args.comm, args.dtype, None, timing, args.density,
                     dict(start=args.start_density, warmup=args.warmup, min_density=args.min_density,
                          max_density=args.max_density, rules=not args.no_rules, sampled=args.sampled,
                          bf16_values=args.bf16_values, algorithm=args.algorithm))
    opt, sched = optimizer(model, args.lr)
    nparams = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"# {nranks} ranks, backend {dist.get_backend()}, comm {args.comm}, dtype {args.dtype}, {nparams / 1e6:.2f}M parameters, "
              f"{nparams * (2 if args.dtype == 'bf16' else 4) / 1e6:.1f} MB of gradients per step", flush=True)
    losses, times, eval_loss = run_steps(ddp, model, opt, sched, text, split, args, rank)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    later = times[len(times) // 2:]  # past the learning calls of --comm auto (12 per bucket size)
    st = state.stats() if state else dict(timing, raw_bytes=None, wire_bytes=None)
    if state is None and dist.get_backend() == "zipccl":  # the drop-in's own counters
        moved = zipccl.stats().get("all_reduce", {})
        st.update(raw_bytes=moved.get("raw_bytes"), wire_bytes=moved.get("wire_bytes"))
    return dict(comm=args.comm, backend=dist.get_backend(), dtype=args.dtype, nranks=nranks, steps=args.steps, losses=losses,
                eval_loss=eval_loss, median_step_seconds=sorted(times)[len(times) // 2],
                later_median_step_seconds=sorted(later)[len(later) // 2],
                comm_seconds=st["comm_seconds"], raw_bytes=st.get("raw_bytes"), wire_bytes=st.get("wire_bytes"),
                params=nparams, param_sha256=hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
                densities=st.get("densities"), plans=zipccl.collectives.auto_policy().explain())


def _spawned(rank, nranks, args):
    return train(rank, nranks, args)


def finish(result: dict, args) -> None:
    print(f"# eval loss {result['eval_loss']:.4f}, median step {result['median_step_seconds'] * 1e3:.1f} ms "
          f"(second half {result['later_median_step_seconds'] * 1e3:.1f} ms), "
          f"params sha256 {result['param_sha256'][:16]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def add_run_args(ap) -> None:
    """The model, data and schedule flags this example shares with fsdp_gpt.py."""
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--d-model", dest="d_model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--text-bytes", dest="text_bytes", type=int, default=8 << 20)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comm", default="lossless",
                    choices=["torch", "auto", "native", "raw", "lossless", "topk", "entropy", "powersgd1", "powersgd4",
                             "none"])
    ap.add_argument("--algorithm", default="auto", choices=["auto", "flat", "hierarchical"],
                    help="zipccl's algorithm for exact codecs (hierarchical: raw/lossless on both levels; auto with "
                         "--comm auto: learned)")
    ap.add_argument("--nodes", type=int, help="the ranks form this many nodes: the lab's shape with --netlab (default "
                    "one rank per node), else ZIPCCL_TOPOLOGY for the spawned ranks")
    ap.add_argument("--density", type=float, default=0.01, help="top-k density for --comm topk")
    ap.add_argument("--start-density", dest="start_density", type=float,
                    help="--comm entropy: density after warm-up (default 0.1)")
    ap.add_argument("--warmup", type=int, help="--comm entropy: lossless warm-up steps (default 20)")
    ap.add_argument("--min-density", dest="min_density", type=float, help="--comm entropy: lower bound (0.01)")
    ap.add_argument("--max-density", dest="max_density", type=float, help="--comm entropy: upper bound (0.25)")
    ap.add_argument("--sampled", action="store_true", help="lossy: top-k by a sampled threshold (faster)")
    ap.add_argument("--bf16-values", dest="bf16_values", action="store_true",
                    help="lossy: send top-k values as bf16 (6 instead of 8 bytes per entry with fp32 gradients)")
    ap.add_argument("--no-rules", dest="no_rules", action="store_true",
                    help="lossy: sparsify whole buckets (default: biases, norms, small tensors stay lossless)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="gradient dtype on the wire")
    ap.add_argument("--nranks", type=int, default=2, help="local ranks when not under a launcher")
    ap.add_argument("--bucket-mb", dest="bucket_mb", type=float, default=25.0)
    add_run_args(ap)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "zipccl"],
                    help="init_process_group's backend: zipccl compresses DDP's own all-reduce (--comm torch)")
    ap.add_argument("--netlab", metavar="RATE", help="run the ranks in the network lab (root)")
    ap.add_argument("--json", help="write the summary of rank 0 here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.nranks < 1:
        ap.error("--steps and --nranks must be >= 1")
    if args.nodes is not None and (args.nodes < 1 or args.nranks % args.nodes):
        ap.error(f"--nodes ({args.nodes}) must divide --nranks ({args.nranks})")
    if args.netlab:
        from zipccl.bench.netlab import NetLab, worst
        rest = [a for i, a in enumerate(sys.argv[1:]) if a != "--netlab" and sys.argv[i] != "--netlab"]
        with NetLab(args.nranks, args.netlab, args.nodes) as lab:
            return worst(lab.run_ranks([sys.executable, str(Path(__file__).resolve()), *rest], timeout=3600))
    if args.nodes is not None and args.nodes > 1 and "GROUP_RANK" not in os.environ:  # emulated nodes, spawned here
        os.environ["ZIPCCL_TOPOLOGY"] = f"{args.nodes}x{args.nranks // args.nodes}"
        zipccl.config.TOPOLOGY = os.environ["ZIPCCL_TOPOLOGY"]
    world = launch.detect()
    if world is not None:
        launch.init(args.backend)
        result = train(world.rank, world.size, args)
        if world.rank == 0:
            finish(result, args)
        launch.shutdown()
        return 0
    results = launch.spawn(_spawned, args.nranks, args, backend=args.backend)
    finish(results[0], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
