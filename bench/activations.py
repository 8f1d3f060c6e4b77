"""Real activations and their gradients: the hidden states of examples/train_gpt.py's GPT.

    python bench/activations.py --out activations.npy [--numel 8388608] [--seed 0]
    zipccl-perf --collective alltoall --data activations.npy ...

What a mixture-of-experts layer dispatches with all-to-all and a pipeline stage sends to the
next are a transformer's hidden states, and in the backward pass their gradients. This runs a
small seeded GPT (untrained: seeded weights, as at the start of training) on windows of the
standard library's source, keeps the residual stream after every block (fp32, concatenated)
and the gradients of the loss with respect to them, as many elements of each as asked. The
tests take their activations from here too (tests/test_alltoall.py, tests/test_p2p.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def _gpt_module():
    spec = importlib.util.spec_from_file_location("train_gpt_example", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def hidden_states(numel: int, seed: int = 0, d: int = 128, layers: int = 4, ctx: int = 64,
                  grads: bool = False) -> torch.Tensor:
    """``numel`` fp32 values of the GPT's residual stream (after each block), or with ``grads``
    the loss's gradients with respect to them: as many forward passes (8 windows each) as needed."""
    gpt = _gpt_module()
    torch.manual_seed(seed)
    model = gpt.GPT(d=d, layers=layers, heads=4, ctx=ctx)
    text = gpt.stdlib_text(1 << 20)
    gen = torch.Generator().manual_seed(seed)
    out, have = [], 0
    while have < numel:
        x, y = gpt.batches(text, 8, ctx, gen)
        states = []
        h = model.tok(x) + model.pos(torch.arange(ctx))
        for block in model.blocks:
            h = block(h)
            h.retain_grad()
            states.append(h)
        loss = F.cross_entropy(model.head(model.ln(h)).reshape(-1, 256), y.reshape(-1))
        if grads:
            loss.backward()
        part = torch.cat([(s.grad if grads else s).detach().reshape(-1) for s in states])
        out.append(part)
        have += part.numel()
    return torch.cat(out)[:numel].contiguous()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the .npy file to write (fp32)")
    ap.add_argument("--numel", type=int, default=8 << 20, help="elements (default 8M: 16 MiB of bf16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grads", action="store_true", help="the gradients instead of the activations")
    args = ap.parse_args(argv)
    np.save(args.out, hidden_states(args.numel, args.seed, grads=args.grads).numpy())
    print(f"wrote {args.numel} fp32 {'gradients' if args.grads else 'activations'} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
