"""A fixed bank of exponent codes per float layout, from the Gaussian model, against the encoder's packets.

    python bench/bank_design.py [--sizes 8,16,32] [--block 4096] [--json out.json]

A GPU encoder that picks each block's code from a bank fixed ahead of time needs no
host round trip to build tables. This script measures, offline, what the bank costs in ratio:

1. The model. A block's exponents, taken relative to its most common exponent (``ref``, the
   format's symbols 2..31), have a shape set by where log2 of the spread falls between two
   powers of two (the phase), the share of exact zeros (symbol 0) and the weight of the tail
   (a Gaussian scale mixture: sigma * exp(s * N(0, 1)), s = 0 is the plain Gaussian). fp16 adds
   the absolute scale: near 2^-14 values turn subnormal (exponent 0) or underflow to zero;
   its coded field (format version 3) is the exponent with the top mantissa bit, half-octave
   steps, whose symbols reach 15 steps above ``ref``. Each grid point gives a symbol histogram of a 4096-element model block.
2. The bank: the model histograms clustered into K codes by the format's own rule (a 12-bit
   limited Huffman code per group, each histogram moved to the code that costs it fewest bits,
   repeated until stable), grown one code at a time from the histogram served worst. A model
   block's +0.0 share is the grid's (the zeros of fp16's underflow are replaced by it).
3. The check: real tensors coded with the bank (each block its cheapest entry by exact cost from
   its whole histogram, raw where coding does not pay) against the numba encoder's actual
   packets (when the record was made, format version 1's: up to 8 tables per packet; since
   version 2, the bank with each entry chosen from the block's sample). The bank's packets (versions 2 and 3) carry no section 0; the
   index keeps 8 bytes per block (ref, entry id, words, zeros).

Tensors: the gradient bucket of ../shared/data (bf16, fp16, fp32) on which nothing here is
tuned, and a small GPT (6 blocks, d 192, a different size and data order from the bucket's)
trained here for a few steps on the standard library's source: gradients of two steps,
activations and weights.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from zipccl.bench.common import DEFAULT_DATA
from zipccl.codecs import Lossless
from zipccl.format import (HEADER_SIZE, INDEX_ENTRY, LAYOUTS, MAXLEN, NSYM, RAW_BLOCK, SAMPLE_STRIDE, SYM_ESC, SYM_ZERO)
from zipccl.reference import tables as T
from zipccl.reference.packet import parse_lossless

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODEL_BLOCK = 4096


# ---- symbols of blocks (the format's rules: ref from every 8th element, sizes from all) ----

def block_hists(x: torch.Tensor, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """(whole histograms (nb, 32), elements per block) of a tensor in ``x.dtype``."""
    lay = LAYOUTS[x.dtype]
    ints = x.reshape(-1).view(torch.int32 if lay.itemsize == 4 else torch.int16).numpy()
    bits = ints.astype(np.int64) & ((1 << (8 * lay.itemsize)) - 1)
    n = bits.size
    nb = -(-n // bs)
    pad = np.zeros(nb * bs, np.int64)
    pad[:n] = bits
    valid = (np.arange(nb * bs) < n).reshape(nb, bs)
    b2 = pad.reshape(nb, bs)
    exp, zero = (b2 >> lay.mbits) & lay.emax, b2 == 0
    sample = valid & ~zero & (np.arange(bs) % SAMPLE_STRIDE == 0)[None, :]
    rows = np.broadcast_to(np.arange(nb)[:, None], (nb, bs))
    counts = np.zeros((nb, lay.emax + 1), np.int64)
    np.add.at(counts, (rows[sample], exp[sample]), 1)
    d = exp - counts.argmax(axis=1)[:, None]
    sym = np.where((d >= lay.min_offset) & (d <= lay.max_offset), d + lay.offset_bias, SYM_ESC)
    sym = np.where(zero, SYM_ZERO, sym)
    hist = np.zeros((nb, NSYM), np.int64)
    np.add.at(hist, (rows[valid], sym[valid]), 1)
    return hist, valid.sum(axis=1)


def check_accounting(hist: np.ndarray, packet: torch.Tensor) -> None:
    """The symbols and sizes modelled here are the encoder's: each coded block of today's packet
    has the words and zeros that its histogram gives with its table."""
    p = parse_lossless(packet)
    coded = p.table != RAW_BLOCK
    bits = (hist[coded] * (p.lengths + T.extra_bits(p.layout))[p.table[coded]]).sum(axis=1)
    assert np.array_equal(-(-bits // 32), p.nwords[coded]), "block_hists no longer models the encoder"
    assert np.array_equal(hist[coded, SYM_ZERO], p.nzero[coded])


def packet_bytes(bits: np.ndarray, hist: np.ndarray, nvalid: np.ndarray, lay) -> tuple[int, np.ndarray]:
    """Bytes of a packet whose blocks code in ``bits`` bits each (raw where that does not pay),
    without section 0 (versions 2 and 3), and which blocks are raw."""
    coded = 4 * -(-bits // 32) + lay.rest_len(nvalid - hist[:, SYM_ZERO])
    raw = coded >= nvalid * lay.itemsize
    return HEADER_SIZE + INDEX_ENTRY * len(hist) + int(np.where(raw, nvalid * lay.itemsize, coded).sum()), raw


def bank_size(hist: np.ndarray, nvalid: np.ndarray, lengths: np.ndarray, lay) -> tuple[int, np.ndarray]:
    """Packet bytes with each block on its cheapest bank entry by exact cost, and each block's
    entry (-1: raw)."""
    cost = hist @ (lengths + T.extra_bits(lay)).T            # (nb, K) exact bits
    best = cost.argmin(axis=1)
    size, raw = packet_bytes(cost[np.arange(len(hist)), best], hist, nvalid, lay)
    return size, np.where(raw, -1, best)


def own_code_size(hist: np.ndarray, nvalid: np.ndarray, lay) -> int:
    """Packet bytes if every block had its own code for free: the bound of any choice of codes."""
    bits = np.array([(h * (T.limited_lengths(h, MAXLEN) + T.extra_bits(lay))).sum() for h in hist])
    return packet_bytes(bits, hist, nvalid, lay)[0]


# ---- the model and the bank ----

def model_hists(dtype: torch.dtype, seed: int = 0) -> np.ndarray:
    """Symbol histograms of model blocks over the grid (phase, tail, zeros[, fp16 scale])."""
    g = torch.Generator().manual_seed(seed)
    phases = np.arange(16) / 16
    tails = (0.0, 0.35, 0.7, 1.1, 1.6)
    zeros = (0.0, 0.02, 0.15, 0.5, 0.9)
    scales = np.arange(-24, 2, 1.0) if dtype == torch.float16 else np.array([-10.0])
    out = []
    n = MODEL_BLOCK * 4
    for scale in scales:
        for ph in phases:
            for s in tails:
                z = torch.randn(n, generator=g, dtype=torch.float64)
                mix = torch.exp(s * torch.randn(n, generator=g, dtype=torch.float64))
                x = (z * mix * 2.0 ** (scale + ph)).to(dtype)
                h, _ = block_hists(x, n)
                h = h[0].astype(np.float64)
                nonzero = h.copy()
                nonzero[SYM_ZERO] = 0
                for zs in zeros:
                    row = nonzero / nonzero.sum() * (1 - zs)
                    row[SYM_ZERO] += zs
                    out.append(np.round(row * MODEL_BLOCK).astype(np.int64))
    return np.array(out)


def derive_bank(hists: np.ndarray, k: int, lay, rounds: int = 8) -> np.ndarray:
    """K code-length rows clustering ``hists`` by exact Huffman cost (the format's rule: a 12-bit
    limited code per group, each histogram to its cheapest code). Grown one code at a time: the
    next group starts from the histogram that the codes so far serve worst (bits lost against
    its own code), so that rare but distinct shapes (fp16's subnormal blocks) get a code."""
    extra = T.extra_bits(lay)
    own = np.array([(h * (T.limited_lengths(h + 1, MAXLEN) + extra)).sum() for h in hists])

    def code(members):
        return T.limited_lengths(np.ones(NSYM, np.int64) + members.sum(axis=0), MAXLEN)

    lengths = np.array([code(hists)])
    while True:
        for _ in range(rounds):  # Lloyd: assign, rebuild
            assign = (hists @ (lengths + extra).T).argmin(axis=1)
            new = np.array([code(hists[assign == g]) if (assign == g).any() else lengths[g]
                            for g in range(len(lengths))])
            if np.array_equal(new, lengths):
                break
            lengths = new
        if len(lengths) == k:
            return lengths
        lost = (hists @ (lengths + extra).T).min(axis=1) - own
        lengths = np.vstack([lengths, code(hists[lost.argmax()][None])])


# ---- real tensors ----

def small_gpt_tensors(steps: int = 12, d: int = 192, layers: int = 6, seed: int = 1) -> dict[str, np.ndarray]:
    """fp32 tensors of a small GPT trained here: gradients at steps 3 and ``steps``, activations
    of the last step (each block's input and MLP hidden), and the weights after training."""
    torch.manual_seed(seed)
    src = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = np.frombuffer(b"".join(p.read_bytes() for p in src[::-1][:200]), dtype=np.uint8)
    ctx, batch = 128, 12

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.attn = torch.nn.MultiheadAttention(d, 4, batch_first=True)
            self.fc, self.proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x, mask, acts):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            acts.append(x.detach())
            hidden = torch.nn.functional.gelu(self.fc(self.ln2(x)))
            acts.append(hidden.detach())
            return x + self.proj(hidden)

    tok, pos = torch.nn.Embedding(256, d), torch.nn.Embedding(ctx, d)
    blocks = torch.nn.ModuleList(Block() for _ in range(layers))
    head = torch.nn.Linear(d, 256)
    model = torch.nn.ModuleList([tok, pos, blocks, head, torch.nn.LayerNorm(d)])
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, 0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    mask = torch.triu(torch.full((ctx, ctx), float("-inf")), 1)
    out = {}
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(text) - ctx - 1, (batch,))
        chunk = torch.from_numpy(np.stack([text[s:s + ctx + 1] for s in starts.tolist()]).astype(np.int64))
        acts: list[torch.Tensor] = []
        x = tok(chunk[:, :-1]) + pos(torch.arange(ctx))
        for blk in blocks:
            x = blk(x, mask, acts)
        loss = torch.nn.functional.cross_entropy(head(model[4](x)).reshape(-1, 256), chunk[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if step in (3, steps):
            out[f"gpt_grads_step{step}"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    out["gpt_activations"] = torch.cat([a.reshape(-1) for a in acts]).numpy()
    out["gpt_weights"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    return out


def cases(data: Path, cache: Path | None, steps: int, width: int, layers: int) -> list[tuple[str, torch.Tensor]]:
    if cache and cache.exists():
        extra = dict(np.load(cache))
    else:
        extra = small_gpt_tensors(steps, width, layers)
        if cache:
            np.savez(cache, **extra)
    bucket = torch.from_numpy(np.load(data))
    rows = [(f"bucket {k}", bucket.to(dt)) for k, dt in DTYPES.items()]
    for name, arr in extra.items():
        t = torch.from_numpy(arr)
        kinds = ("bf16", "fp32", "fp16") if "grads" in name else ("bf16",)
        rows += [(f"{name} {k}", t.to(DTYPES[k])) for k in kinds]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4,8,16,32")
    ap.add_argument("--block", type=int, default=4096)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the fp32 gradient bucket (.npy)")
    ap.add_argument("--cache", type=Path, help="keep the small GPT's tensors in this .npz")
    ap.add_argument("--steps", type=int, default=12, help="training steps of the small GPT")
    ap.add_argument("--width", type=int, default=192, help="the small GPT's d_model")
    ap.add_argument("--layers", type=int, default=6, help="the small GPT's blocks")
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    banks = {}
    for key, dt in DTYPES.items():
        model = model_hists(dt)
        banks[key] = {k: derive_bank(model, k, LAYOUTS[dt]) for k in sizes}
        print(f"# {key}: {len(model)} model histograms", file=sys.stderr)
    results = []
    header = "| tensor | elements | encoder's packets (numba) | " + " | ".join(f"bank {k}" for k in sizes)
    print(header + " | own code per block (bound) |")
    print("|" + "---|" * (4 + len(sizes)))
    for name, x in cases(args.data, args.cache, args.steps, args.width, args.layers):
        dt = name.rsplit(" ", 1)[1]
        lay = LAYOUTS[x.dtype]
        raw = x.numel() * lay.itemsize
        packet = Lossless("numba", block_size=args.block).encode(x)
        today = packet.numel() / raw
        hist, nvalid = block_hists(x, args.block)
        check_accounting(hist, packet)
        ratios = {k: bank_size(hist, nvalid, banks[dt][k], lay)[0] / raw for k in sizes}
        bound = own_code_size(hist, nvalid, lay) / raw
        results.append({"tensor": name, "numel": x.numel(), "today": today, "bank": ratios, "own_code": bound})
        print(f"| {name} | {x.numel():,} | {today:.4f} | " + " | ".join(f"{ratios[k]:.4f}" for k in sizes)
              + f" | {bound:.4f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"block": args.block, "results": results,
                                               "banks": {d: {k: v.tolist() for k, v in b.items()}
                                                         for d, b in banks.items()}}, indent=1))


if __name__ == "__main__":
    main()
