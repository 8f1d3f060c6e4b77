"""Codec benchmark: zipccl lossless against ZipNN, zstd and memcpy, in one run.

    python -m zipccl.bench.codec [--size N] [--repeat R] [--json FILE] [--device cuda]

Every codec sees the same bytes: bf16, fp16 and fp32 views of the real
gradient bucket in ../shared/data, gradients of a small model this script
trains for a few steps, and Gaussian and Laplace data. Throughput is the
median of R runs on one thread, in GB/s of uncompressed bytes (GB = 1e9); the
single-threaded codecs take turns within each run, so that the load of a shared
machine falls on all of them alike. With ``--device cuda`` the Triton kernels run on the GPU
against a device-to-device copy, timed from call to a synchronised result (host planning and
the encoder's one histogram read included), and the card's name heads the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..codecs import Lossless
from .common import DEFAULT_DATA

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ZIPNN_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def train_small_model_grads(steps: int = 6, seed: int = 0) -> torch.Tensor:
    """Gradients (fp32, one flat bucket) of a small byte-level transformer after a few Adam steps
    on the Python standard library's own source, which exists on every machine."""
    import inspect
    import json as _json
    torch.manual_seed(seed)
    text = (inspect.getsource(_json) + inspect.getsource(argparse) + inspect.getsource(inspect)).encode()
    data = torch.tensor(list(text), dtype=torch.long)
    d, ctx, vocab = 128, 64, 256
    layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.ModuleDict(dict(emb=torch.nn.Embedding(vocab, d), pos=torch.nn.Embedding(ctx, d),
                                     body=torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                                     head=torch.nn.Linear(d, vocab)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(ctx)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - ctx - 1, (8,), generator=g)
        x = torch.stack([data[s:s + ctx] for s in starts])
        y = torch.stack([data[s + 1:s + ctx + 1] for s in starts])
        h = model["emb"](x) + model["pos"](torch.arange(ctx))
        logits = model["head"](model["body"](h, mask=mask, is_causal=True))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def datasets(size: int | None, data_file: Path | None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Named fp32 tensors; each is cut (or tiled) to ``size`` elements when given."""
    g = torch.Generator().manual_seed(seed)
    n = size or 4 * 1024 * 1024
    out = {}
    if data_file and data_file.exists():
        out["grads_step050"] = torch.from_numpy(np.load(data_file))
    out["small_gpt_grads"] = train_small_model_grads()
    out["gaussian"] = torch.randn(n, generator=g) * 0.02
    out["laplace"] = torch.distributions.Laplace(0.0, 0.01).sample((n,))
    if size:
        out = {k: v.repeat(-(-size // v.numel()))[:size] for k, v in out.items()}
    return out


def _timed(fn, arg):
    t = time.perf_counter()
    result = fn(arg)
    return time.perf_counter() - t, result


def codecs(dtype_name: str, include_zipnn: bool, include_zstd: bool) -> list:
    """[(name, encode, decode, needs_fresh_copy)], ZipNN's multi-threaded default last: its worker
    threads outlive a call and would slow whatever is measured after them."""
    z = Lossless()
    out = [("zipccl-lossless", z.encode, (lambda p, out=None: z.decode(p, out=out)), False),
           ("memcpy", (lambda b: bytearray(b)), (lambda p: bytearray(p)), False)]
    if include_zstd:
        try:
            import zstandard
        except ImportError:
            print("# zstandard not installed: skipped", file=sys.stderr)
        else:
            for level in (1, 3):
                c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
                out.append((f"zstd-{level}", c.compress, d.decompress, False))
    if include_zipnn:
        try:
            import zipnn
        except ImportError:
            print("# zipnn not installed: skipped (pip install zipnn)", file=sys.stderr)
        else:
            for threads, label in ((1, "zipnn-1thread"), (0, "zipnn-default")):
                zn = zipnn.ZipNN(input_format="byte", bytearray_dtype=ZIPNN_DTYPE[dtype_name], threads=threads)
                out.append((label, zn.compress, zn.decompress, True))
    return out


def _case(x: torch.Tensor, entries: list, repeat: int) -> list[tuple]:
    """Time ``entries`` (codecs from ``codecs``) on one tensor, round-robin: each round runs
    one encode and one decode of every codec in turn, so a noisy neighbour slows them
    alike and the ratios between codecs hold. Returns (name, packet size, median encode
    seconds, median decode seconds, round trip ok) per codec."""
    raw = x.view(torch.uint8).numpy().tobytes()
    state = []
    for name, enc, dec, fresh in entries:
        if name == "zipccl-lossless":
            # Into a caller's buffer, as the collectives decode (ZipNN's API has no such
            # option): a fresh 10 MB output per call cost 1-4 ms of page faults here, by run.
            arg, dec = x, (lambda p, out=torch.empty_like(x), dec=dec: dec(p, out))
            check = (lambda y: torch.equal(y.view(torch.uint8), x.view(torch.uint8)))
        else:
            arg, check = raw, (lambda y: bytes(y) == raw)
        dec(enc(bytearray(raw) if fresh else arg))  # warm-up: JIT compilation, allocator
        state.append((name, enc, dec, fresh, arg, check, [], []))
    results = {}
    for _ in range(repeat):
        for name, enc, dec, fresh, arg, check, t_enc, t_dec in state:
            # ZipNN modifies a bytes input in place for bf16/fp32: a fresh copy per run, untimed.
            t, packet = _timed(enc, bytearray(raw) if fresh else arg)
            t_enc.append(t)
            t, decoded = _timed(dec, packet)
            t_dec.append(t)
            results[name] = (packet, decoded)
    out = []
    for name, enc, dec, fresh, arg, check, t_enc, t_dec in state:
        packet, decoded = results[name]
        size = packet.numel() if isinstance(packet, torch.Tensor) else len(packet)
        out.append((name, size, float(np.median(t_enc)), float(np.median(t_dec)), bool(check(decoded))))
    return out


def _cuda_case(x: torch.Tensor, repeat: int) -> list[tuple]:
    """The Triton codec and a device copy on one CUDA tensor, round-robin as in _case; each time
    runs from the call to its synchronised result."""
    z = Lossless("triton")
    out = torch.empty_like(x)
    entries = [("zipccl-lossless", z.encode, lambda p: z.decode(p, out)), ("copy", torch.clone, torch.clone)]

    def timed(fn, arg):
        torch.cuda.synchronize()
        t = time.perf_counter()
        result = fn(arg)
        torch.cuda.synchronize()
        return time.perf_counter() - t, result

    for _, enc, dec in entries:  # warm-up: Triton's compilation, the caching allocator
        dec(enc(x))
    times = {name: ([], []) for name, _, _ in entries}
    results = {}
    for _ in range(repeat):
        for name, enc, dec in entries:
            t, packet = timed(enc, x)
            times[name][0].append(t)
            t, decoded = timed(dec, packet)
            times[name][1].append(t)
            results[name] = (packet, decoded)
    rows = []
    for name, _, _ in entries:
        packet, decoded = results[name]
        size = packet.numel() * packet.element_size()
        ok = torch.equal(decoded.view(torch.uint8), x.view(torch.uint8))
        rows.append((name, size, float(np.median(times[name][0])), float(np.median(times[name][1])), bool(ok)))
    return rows


def run_cuda(size: int | None, repeat: int, data_file: Path | None, dtypes: list[str]) -> list[dict]:
    """The codec's GPU throughput per dataset and dtype (rows as ``run``'s, with the card's name)."""
    name = torch.cuda.get_device_name()
    rows = []
    for data_name, base in datasets(size, data_file).items():
        for dt in dtypes:
            x = base.to(DTYPES[dt]).contiguous().cuda()
            print(f"# {name}: {data_name} {dt} ...", file=sys.stderr, flush=True)
            nbytes = x.numel() * x.element_size()
            for codec, size_out, t_enc, t_dec, ok in _cuda_case(x, repeat):
                rows.append(dict(data=data_name, dtype=dt, codec=codec, bytes=nbytes, ratio=size_out / nbytes,
                                 encode_GBps=nbytes / t_enc / 1e9, decode_GBps=nbytes / t_dec / 1e9,
                                 roundtrip_ok=ok, device=name))
    return rows


def run(size: int | None, repeat: int, data_file: Path | None, dtypes: list[str], zipnn: bool = True,
        zstd: bool = True) -> list[dict]:
    """Single-threaded codecs round-robin per tensor (see _case); ZipNN's multi-threaded
    default after all of them. Rows sorted for display."""
    torch.set_num_threads(1)
    cases = [(name, dt, base.to(DTYPES[dt]).contiguous())
             for name, base in datasets(size, data_file).items() for dt in dtypes]
    table = {dt: codecs(dt, zipnn, zstd) for dt in dtypes}
    rows = []
    for last in (False, True):
        for data_name, dt, x in cases:
            entries = [e for e in table[dt] if (e[0] == "zipnn-default") == last]
            if not entries:
                continue
            print(f"# {data_name} {dt} {', '.join(e[0] for e in entries)} ...", file=sys.stderr, flush=True)
            nbytes = x.numel() * x.element_size()
            for name, size_out, t_enc, t_dec, ok in _case(x, entries, repeat):
                rows.append(dict(data=data_name, dtype=dt, codec=name, bytes=nbytes, ratio=size_out / nbytes,
                                 encode_GBps=nbytes / t_enc / 1e9, decode_GBps=nbytes / t_dec / 1e9,
                                 roundtrip_ok=ok))
    order = {name: i for i, (name, *_rest) in enumerate(table[dtypes[0]])}
    data_order = {name: i for i, (name, _, _) in enumerate(cases)}
    return sorted(rows, key=lambda r: (data_order[r["data"]], dtypes.index(r["dtype"]), order.get(r["codec"], 99)))


def format_table(rows: list[dict]) -> str:
    lines = [f"{'data':<16} {'dtype':<5} {'codec':<16} {'MB':>7} {'ratio':>7} {'enc GB/s':>9} {'dec GB/s':>9} ok"]
    for r in rows:
        lines.append(f"{r['data']:<16} {r['dtype']:<5} {r['codec']:<16} {r['bytes'] / 1e6:7.2f} {r['ratio']:7.4f} "
                     f"{r['encode_GBps']:9.3f} {r['decode_GBps']:9.3f} {'yes' if r['roundtrip_ok'] else 'NO'}")
    return "\n".join(lines)


def speedups(rows: list[dict], baseline: str = "zipnn-1thread") -> str:
    """zipccl lossless relative to ``baseline`` on the same data and dtype, from the same run."""
    out = []
    for r in rows:
        if r["codec"] != "zipccl-lossless":
            continue
        b = next((s for s in rows
                  if s["codec"] == baseline and (s["data"], s["dtype"]) == (r["data"], r["dtype"])), None)
        if b:
            out.append(f"# {r['data']} {r['dtype']}: ratio {r['ratio']:.4f} vs {b['ratio']:.4f}, encode "
                       f"{r['encode_GBps'] / b['encode_GBps']:.2f}x, decode {r['decode_GBps'] / b['decode_GBps']:.2f}x "
                       f"{baseline}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zipccl-codec-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=None, help="elements per dataset (default: each dataset's own size)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per measurement; the median is reported")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA,
                    help="a .npy of fp32 gradients (default: ../shared/data/grads_step050_bucket0_fp32.npy)")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--no-zipnn", action="store_true")
    ap.add_argument("--no-zstd", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the Triton kernels on the GPU against a device copy (no ZipNN or zstd there)")
    args = ap.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if any(d not in DTYPES for d in dtypes) or args.repeat < 1:
        ap.error(f"--dtypes takes a comma list of {', '.join(DTYPES)}; --repeat >= 1")
    if not args.data.exists():
        print(f"# {args.data} not found: benchmarking without the real gradient bucket", file=sys.stderr)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA device here")
        rows = run_cuda(args.size, args.repeat, args.data, dtypes)
        print(f"# {rows[0]['device']}, torch {torch.__version__}")
        print(format_table(rows))
        for r in rows:
            if r["codec"] != "copy":
                copy = next(c for c in rows
                            if c["codec"] == "copy" and (c["data"], c["dtype"]) == (r["data"], r["dtype"]))
                print(f"# {r['data']} {r['dtype']}: encode {r['encode_GBps'] / copy['encode_GBps']:.3f}x, "
                      f"decode {r['decode_GBps'] / copy['decode_GBps']:.3f}x a device copy")
    else:
        rows = run(args.size, args.repeat, args.data, dtypes, not args.no_zipnn, not args.no_zstd)
        print(format_table(rows))
        print(speedups(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["roundtrip_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
