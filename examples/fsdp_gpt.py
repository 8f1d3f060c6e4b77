"""Train the reference GPT of examples/train_gpt.py under FSDP2, with FSDP2's own comms or zipccl's.

    python examples/fsdp_gpt.py --mesh 2 --comm lossless --steps 20      # 2 local ranks over gloo
    python examples/fsdp_gpt.py --mesh 4 --comm tagc --mp bf16 --netlab 1gbit --json out.json
    python examples/fsdp_gpt.py --mesh 2x2 --comm lossless                # HSDP: 2 replicas of 2 shards
    torchrun --nproc-per-node 4 examples/fsdp_gpt.py --mesh 4 --comm raw

--comm torch is FSDP2's default (torch.distributed's all-gather and reduce-scatter; native
HSDP for --mesh RxS); raw, lossless and auto install zipccl.fsdp's comms on every FSDP module
(exact: bit-identical parameters for raw and lossless); tagc adds the opt-in lossy gradients
of zipccl.fsdp.compress (MLP and embedding modules top-k with error feedback, --lossy entropy
or topk; attention, norms and small modules stay lossless). Each Linear and Embedding is its
own FSDP module (the layer rules decide per module), then each block, then the model.
--mp bf16 computes and all-gathers in bf16 (MixedPrecisionPolicy, --reduce-dtype fp32|bf16).
The JSON summary (rank 0) holds the losses, the evaluation loss, the median step time (all
steps and the second half), bytes per step and a hash of the final parameters.
"""

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the same model, data, flags and steps as DDP's example
from train_gpt import GPT, add_run_args, optimizer, run_steps, stdlib_text  # noqa: E402

import zipccl.collectives  # noqa: E402
import zipccl.entropy  # noqa: E402
import zipccl.fsdp  # noqa: E402
from zipccl import launch  # noqa: E402

#: The reference GPT names its MLP's second Linear "out": add it to TAGC's MLP group.
RULES = zipccl.fsdp.TAGC_RULES + (zipccl.fsdp.Rule("mlp", names=("out",)),)


def parse_mesh(text: str) -> tuple[int, int]:
    """"4" -> (1 replica, 4 shards); "2x2" -> (2 replicas, 2 shards: HSDP)."""
    parts = text.lower().split("x")
    if len(parts) == 1:
        return 1, int(parts[0])
    if len(parts) == 2:
        return int(parts[0]), int(parts[1])
    raise ValueError(f"--mesh {text!r}: use N or RxS")


def shard(model: GPT, args, replicas: int, shards: int):
    """fully_shard per Linear/Embedding, per block, then the model; returns zipccl's Comms or None."""
    if replicas > 1:
        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
        fsdp_mesh = mesh if args.comm == "torch" else mesh["shard"]  # zipccl: 1-D FSDP + replicate hook
    else:
        mesh = fsdp_mesh = init_device_mesh("cpu", (shards,))
    mp = MixedPrecisionPolicy()
    if args.mp == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                  reduce_dtype=torch.bfloat16 if args.reduce_dtype == "bf16" else torch.float32)
    kw = dict(mesh=fsdp_mesh, mp_policy=mp, reshard_after_forward=not args.no_reshard)
    layers = [m for blk in model.blocks for m in (blk.qkv, blk.proj, blk.fc, blk.out)]
    for m in [model.tok, model.pos, model.head] + layers:
        fully_shard(m, **kw)
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    if args.comm == "torch":
        return None
    codec = "lossless" if args.comm == "tagc" else args.comm
    lossy = args.lossy if args.comm == "tagc" else None
    rate = None
    if lossy == "entropy":
        rate = zipccl.entropy.EntropyRate(**{k: v for k, v in dict(warmup=args.warmup, start=args.start_density,
                                                                     min_density=args.min_density,
                                                                     max_density=args.max_density).items()
                                             if v is not None})
    return zipccl.fsdp.compress(model, codec=codec, lossy=lossy, rules=RULES, min_numel=args.min_numel,
                                density=args.density, rate=rate,
                                value_dtype=torch.bfloat16 if args.bf16_values else None,
                                replicate_group=mesh["replicate"].get_group() if replicas > 1 else None)


def train(rank: int, nranks: int, args) -> dict:
    replicas, shards = parse_mesh(args.mesh)
    torch.manual_seed(args.seed)
    text = stdlib_text(args.text_bytes)
    split = int(text.numel() * 0.95)
    model = GPT(args.d_model, args.layers, args.heads, args.ctx)
    nparams = sum(p.numel() for p in model.parameters())
    comms = shard(model, args, replicas, shards)
    opt, sched = optimizer(model, args.lr)
    if rank == 0:
        print(f"# {nranks} ranks, mesh {args.mesh}, comm {args.comm}, mp {args.mp}, {nparams / 1e6:.2f}M parameters",
              flush=True)
        if comms is not None:
            print(f"# rule groups: {comms.groups()}", flush=True)
    losses, times, eval_loss = run_steps(model, model, opt, sched, text, split, args, rank,
                                         logits=lambda out: out.float())
    st = comms.stats() if comms is not None else {}
    if comms is None and dist.get_backend() == "zipccl":  # the drop-in's own counters (before full_tensor's)
        moved = zipccl.stats()
        st = dict(raw_bytes=moved.get("total", {}).get("raw_bytes", 0), wire_bytes=moved.get("total", {}).get(
            "wire_bytes", 0), **{k: moved.get(k, dict(wire_bytes=0)) for k in ("all_gather", "reduce_scatter")})
    # collective on all ranks; --no-reshard leaves the evaluation's parameters unsharded (full already)
    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()])
    later = times[len(times) // 2:]
    return dict(comm=args.comm, backend=dist.get_backend(), mesh=args.mesh, mp=args.mp, reduce_dtype=args.reduce_dtype, nranks=nranks,
                steps=args.steps, losses=losses, eval_loss=eval_loss,
                median_step_seconds=sorted(times)[len(times) // 2],
                later_median_step_seconds=sorted(later)[len(later) // 2],
                raw_bytes_per_step=st["raw_bytes"] / args.steps if st else None,
                wire_bytes_per_step=st["wire_bytes"] / args.steps if st else None,
                all_gather_wire_bytes_per_step=st["all_gather"]["wire_bytes"] / args.steps if st else None,
                reduce_scatter_wire_bytes_per_step=st["reduce_scatter"]["wire_bytes"] / args.steps if st else None,
                densities=st.get("densities"), residual_bytes=st.get("residual_bytes"),
                groups=comms.groups() if comms is not None else None, params=nparams,
                param_sha256=hashlib.sha256(flat.float().numpy().tobytes()).hexdigest(),
                plans=zipccl.collectives.auto_policy().explain())


def _spawned(rank, nranks, args):
    return train(rank, nranks, args)


def finish(result: dict, args) -> None:
    wire = result["wire_bytes_per_step"]
    print(f"# eval loss {result['eval_loss']:.4f}, median step {result['median_step_seconds'] * 1e3:.1f} ms "
          f"(second half {result['later_median_step_seconds'] * 1e3:.1f} ms), "
          + (f"{wire / 1e6:.2f} MB sent per step per rank, " if wire is not None else "")
          + f"params sha256 {result['param_sha256'][:16]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mesh", default="2", help="N ranks sharding (FSDP), or RxS: R replicas of S shards (HSDP)")
    ap.add_argument("--comm", default="lossless", choices=["torch", "raw", "lossless", "auto", "tagc"])
    ap.add_argument("--lossy", default="entropy", choices=["entropy", "topk"], help="--comm tagc's lossy codec")
    ap.add_argument("--density", type=float, default=0.01, help="--lossy topk: density")
    ap.add_argument("--start-density", dest="start_density", type=float, help="--lossy entropy: after warm-up (0.1)")
    ap.add_argument("--warmup", type=int, help="--lossy entropy: lossless warm-up steps (20)")
    ap.add_argument("--min-density", dest="min_density", type=float, help="--lossy entropy: lower bound (0.01)")
    ap.add_argument("--max-density", dest="max_density", type=float, help="--lossy entropy: upper bound (0.25)")
    ap.add_argument("--min-numel", dest="min_numel", type=int, default=zipccl.fsdp.MIN_NUMEL,
                    help="--comm tagc: modules with fewer parameter elements stay lossless")
    ap.add_argument("--bf16-values", dest="bf16_values", action="store_true",
                    help="lossy: send fp32 gradients' top-k values as bf16")
    ap.add_argument("--mp", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: MixedPrecisionPolicy(param_dtype=bf16)")
    ap.add_argument("--reduce-dtype", dest="reduce_dtype", choices=["fp32", "bf16"], default="fp32",
                    help="--mp bf16: the gradients' reduce dtype")
    ap.add_argument("--no-reshard", dest="no_reshard", action="store_true",
                    help="reshard_after_forward=False (one all-gather per step instead of two)")
    ap.add_argument("--backend", default="gloo", help="torch.distributed backend for init_process_group")
    add_run_args(ap)
    ap.add_argument("--netlab", metavar="RATE", help="run the ranks in the network lab (root); HSDP: one node per "
                    "replica, its shards inside it")
    ap.add_argument("--json", help="write the summary of rank 0 here")
    args = ap.parse_args(argv)
    try:
        replicas, shards = parse_mesh(args.mesh)
    except ValueError as e:
        ap.error(str(e))
    nranks = replicas * shards
    if args.steps < 1 or replicas < 1 or shards < 1:
        ap.error("--steps and the mesh's sizes must be >= 1")
    if args.netlab:
        from zipccl.bench.netlab import NetLab, worst
        argv = sys.argv[1:] if argv is None else list(argv)
        rest = [a for i, a in enumerate(argv) if a != "--netlab" and (i == 0 or argv[i - 1] != "--netlab")]
        with NetLab(nranks, args.netlab, replicas if replicas > 1 else None) as lab:
            return worst(lab.run_ranks([sys.executable, str(Path(__file__).resolve()), *rest], timeout=3600))
    world = launch.detect()
    if world is not None:
        if world.size != nranks:
            raise SystemExit(f"--mesh {args.mesh} needs {nranks} ranks, the launcher started {world.size}")
        launch.init(args.backend)
        result = train(world.rank, world.size, args)
        if world.rank == 0:
            finish(result, args)
        launch.shutdown()
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = launch.spawn(_spawned, nranks, args, backend=args.backend)
    finish(results[0], args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
