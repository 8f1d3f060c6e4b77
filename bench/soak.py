"""Soak: does a long run of collectives or DDP steps grow memory or open files?

    python bench/soak.py [--calls 2000] [--steps 1000] [--nranks 4] [--every 10] [--warmup 0.2]
                         [--json PATH] [--plot PATH.png] [--max-slope BYTES] [--leak BYTES] [--as-is]

Four local ranks (spawned processes, gloo on loopback: zipccl.launch.spawn) run three phases:

- ``collectives``: ``--calls`` in-place all-reduces over every combination of 7 sizes (4 KiB to
  8 MiB, some with odd element counts), 3 dtypes (float32, bfloat16, float16) and 5 codecs
  (native, raw, lossless, auto, and top-k with a name, which keeps error feedback across
  calls: zipccl.lossy.default), with SUM or AVG, a quarter of them async. One round holds each
  of the 105 combinations once, in an order drawn once from a fixed seed (the same on every
  rank), and repeats; a first round runs unsampled, so that what is made once (zipccl's groups
  and plans, numba's kernels, top-k residuals) is made there.
- ``ddp-lossless`` and ``ddp-entropy``: ``--steps`` DDP steps each of a small model (about
  100K parameters in four buckets), with ``zipccl.ddp.hook`` and State(codec="lossless"), then
  State(codec="entropy", model=model) (lossless warm-up, then top-k with error feedback).

Every ``--every`` calls (steps) each rank samples its resident memory (/proc/self/statm, after
glibc's malloc_trim) and its open file descriptors (/proc/self/fd), and for diagnosis the C
allocator's bytes in use and Python's allocated blocks. Per phase and rank the report gives
the memory slope after warm-up, in bytes per 1,000 calls (steps): a least-squares line through
the samples past the first ``--warmup`` share of the phase (collectives: its first, unsampled
round included, and the line through each round's mean over the whole rounds past it), and the
fd count's range there. Each rank hashes the result of every
call (the model's parameters at the end of a DDP phase); the ranks all-gather their hashes and
compare them. Targets: slope under 1 MiB per 1,000 (``--max-slope``), fds flat (one
value after warm-up), every rank's hash equal; the exit status is 1 if any is missed.

The ranks run with glibc's mmap threshold fixed and torch's flight recorder off (ENVIRONMENT,
below, says why; ``--as-is`` leaves both as they are). ``--leak BYTES`` is the self-test of the
verdict: it wraps zipccl's all-reduce so that each call keeps BYTES alive, as a leaking library
would.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import zipccl
import zipccl.api
import zipccl.collectives
import zipccl.ddp
from zipccl import launch

SIZES = (4 << 10, (20 << 10) + 12, 128 << 10, (500 << 10) + 4, 1 << 20, (3 << 20) + 36, 8 << 20)  # bytes
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CODECS = ("native", "raw", "lossless", "auto", "topk")
OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
ROUND = len(SIZES) * len(DTYPES) * len(CODECS)  # calls in one round of the schedule: every combination once
PHASES = ("collectives", "ddp-lossless", "ddp-entropy")
WARMUP = 0.2          # share of each phase's calls (steps) left out of the fit, at least
MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
PROGRESS_S = 5.0      # seconds between progress lines
#: One sample: calls (steps) done, resident bytes (after malloc_trim), open fds, seconds into the
#: phase, resident bytes before the trim, the C allocator's bytes in use, the blocks Python's own
#: allocator has handed out (small objects: sys.getallocatedblocks).
FIELDS = ("call", "rss", "fds", "seconds", "rss_untrimmed", "heap", "py_blocks")
#: The ranks' environment, so that resident memory follows what zipccl keeps alive (each is set
#: unless already set; --as-is sets neither):
#: - glibc serves allocations of 64 KiB and more with their own mmap, given back on free. By
#:   default its threshold follows the largest block freed (up to 32 MiB): this mix of tensor
#:   sizes then fragments the heaps, and a rank's RSS wanders by about +-50 MiB with no trend.
#: - torch's flight recorder is off. It keeps the last 2,000 collectives of the process (gloo's
#:   too) with their stacks, about 1 KiB each: a bounded ring, but it fills over the first
#:   2,000 operations and its size drifts while a new phase's entries replace the last one's
#:   (seen as 2-3 MiB per 1,000 DDP steps of heap growth that stops with it off).
ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10), "TORCH_FR_BUFFER_SIZE": "0"}

_leaked: list = []    # --leak: what the wrapped collectives keep alive


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


try:  # glibc: malloc_trim always, mallinfo2 from 2.33
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018
except (OSError, AttributeError):
    _LIBC = None
_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _Mallinfo2


# ---- sampling and the verdict --------------------------------------------------------------------

def rss_bytes() -> int:
    """This process's resident memory (the second field of /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def trim() -> None:
    """Hand the allocator's free pages back to the system (glibc's malloc_trim), so that resident
    memory follows what is alive rather than the heaps' free space."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def heap_bytes() -> int:
    """Bytes the C allocator has handed out and not had back (glibc's mallinfo2: every arena's
    chunks in use plus the mmapped ones; tensors' storage included, Python's small objects not);
    -1 where unknown."""
    if _MALLINFO2 is None:
        return -1
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def fd_count() -> int:
    """Open file descriptors of this process (the listing's own descriptor included: a constant)."""
    return len(os.listdir("/proc/self/fd"))


def slope(xs: list, ys: list) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def fit_start(last: int, warmup: float, period: int = 1, unsampled: int = 0) -> int:
    """The sampled call (step) after which samples are fitted: past the first ``warmup`` share of
    the phase's ``unsampled + last`` calls, moved later where needed so that the fit spans whole
    periods of the schedule (with less than one period left, simply the share)."""
    whole = int((1 - warmup) * (unsampled + last)) // period
    return max(0, last - whole * period) if whole else max(0, int(warmup * (unsampled + last)) - unsampled)


def trend(samples: list, field: int, start: int = 0, period: int = 1) -> float:
    """Least-squares slope of a field over calls, through the mean of each period after ``start``
    where there are two periods or more. What is alive at a sample depends on the calls just before it, which repeat
    every round of the collectives' schedule: a rank's RSS moves by +-3 MiB within a round. Fitted
    sample by sample over one round, that pattern alone reads -50 MiB per 1,000 calls (over k
    rounds, 1/k^2 of it); a round's mean has it exactly once."""
    xs, ys = [s[0] for s in samples], [s[field] for s in samples]
    groups: dict = {}
    for x, y in zip(xs, ys):
        groups.setdefault((x - start - 1) // period, []).append((x, y))
    if period > 1 and len(groups) > 1:
        xs = [sum(x for x, _ in g) / len(g) for g in groups.values()]
        ys = [sum(y for _, y in g) / len(g) for g in groups.values()]
    return slope(xs, ys)


def summarize(samples: list, warmup: float, period: int = 1, unsampled: int = 0) -> dict:
    """One rank's phase: samples as in FIELDS; the fits take those past ``fit_start``. The
    verdict takes resident memory; the C allocator's bytes and Python's blocks in use are there
    to tell a leak's kind."""
    start = fit_start(samples[-1][0], warmup, period, unsampled) if samples else 0
    after = [s for s in samples if s[0] > start]
    rss, fds = [s[1] for s in after], [s[2] for s in after]
    per_1000 = {f: 1000 * trend(after, FIELDS.index(f), start, period) for f in FIELDS[4:] + ("rss",)}
    return dict(samples=len(samples), fit_after=start, fitted=len(after),
                slope_bytes_per_1000=round(per_1000["rss"]),
                untrimmed_slope_bytes_per_1000=round(per_1000["rss_untrimmed"]),
                heap_slope_bytes_per_1000=round(per_1000["heap"]),
                py_blocks_slope_per_1000=round(per_1000["py_blocks"], 1),
                rss_start=samples[0][1] if samples else 0, rss_end=samples[-1][1] if samples else 0,
                rss_min=min(rss, default=0), rss_max=max(rss, default=0),
                fd_min=min(fds, default=0), fd_max=max(fds, default=0))


def verdict(phase: dict, max_slope: float) -> list:
    """What a phase (every rank's summary and hash) misses of the targets, as sentences."""
    missed = []
    for r, s in enumerate(phase["ranks"]):
        if s["slope_bytes_per_1000"] >= max_slope:
            missed.append(f"rank {r}: memory grows {s['slope_bytes_per_1000'] / MIB:.2f} MiB per 1,000 "
                          f"(target < {max_slope / MIB:.2f})")
        if s["fd_max"] != s["fd_min"]:
            missed.append(f"rank {r}: open fds {s['fd_min']}..{s['fd_max']} after warm-up (target: flat)")
    if len(set(phase["hashes"])) != 1:
        missed.append(f"ranks end with different results: {phase['hashes']}")
    return missed


class Sampler:
    """Samples every ``every`` calls; rank 0 prints progress every few seconds."""

    def __init__(self, phase: str, total: int, every: int, rank: int, trim: bool):
        self.phase, self.total, self.every, self.rank, self.trim = phase, total, every, rank, trim
        self.samples: list = []
        self.start = self.printed = time.monotonic()

    def __call__(self, done: int) -> None:
        if done % self.every and done != self.total:
            return
        now = time.monotonic()
        untrimmed = rss_bytes()
        if self.trim:
            trim()
        self.samples.append((done, rss_bytes(), fd_count(), round(now - self.start, 3), untrimmed, heap_bytes(),
                             sys.getallocatedblocks()))
        if self.rank == 0 and (now - self.printed >= PROGRESS_S or done == self.total):
            self.printed = now
            _, rss, fds, t, _, heap, _ = self.samples[-1]
            print(f"[soak] {self.phase}: {done}/{self.total} in {t:.0f} s; rank 0: rss {rss / MIB:.1f} MiB, "
                  f"heap {heap / MIB:.1f} MiB, fds {fds}", flush=True)


def _same_everywhere(digest: bytes) -> list:
    """Every rank's digest (hex), all-gathered with the backend's own collective."""
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [bytes(t.tolist()).hex() for t in out]


def _bytes(t: torch.Tensor):
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy()


# ---- phase 1: all-reduces -------------------------------------------------------------------------

def schedule(calls: int, seed: int = 20) -> list:
    """(size, dtype, codec, op, async) per call, the same on every rank: rounds of every
    combination once, in an order (with ops and async calls) drawn once; the first round is the
    unsampled warm-up. Repeating one round, rather than drawing every call, makes what is alive
    at a sample (the last calls' buffers) repeat too, so it averages out of the fit instead of
    wandering: sampled every 10 calls, a rank's RSS then moves by about +-3 MiB."""
    rng = random.Random(seed)
    combos = [(s, d, c) for s in SIZES for d in DTYPES for c in CODECS]
    rng.shuffle(combos)
    round_ = [(*combo, rng.choice(OPS), rng.random() < 0.25) for combo in combos]
    return round_ + [round_[i % len(round_)] for i in range(calls)]


def collectives(rank: int, calls: int, every: int, trim: bool) -> dict:
    plan = schedule(calls)
    gen = torch.Generator().manual_seed(1000 + rank)
    bufs, srcs = {}, {}
    for size in SIZES:
        for dtype in DTYPES:
            numel = size // torch.tensor([], dtype=dtype).element_size()
            srcs[size, dtype] = (torch.randn(numel, generator=gen) * 1e-3).to(dtype)
            bufs[size, dtype] = torch.empty(numel, dtype=dtype)
    sample = Sampler("collectives", calls, every, rank, trim)
    digest = hashlib.blake2b(digest_size=16)
    warm = len(plan) - calls
    for i, (size, dtype, codec, op, async_op) in enumerate(plan):
        buf = bufs[size, dtype]
        buf.copy_(srcs[size, dtype])
        if codec == "topk":  # 2-D, so that the layer rules let tensors of 4096+ elements go lossy
            work = zipccl.all_reduce(buf.view(-1, 1), op=op, async_op=async_op, codec="topk",
                                     name=f"soak{size}.{str(dtype)[6:]}.weight")
        else:
            work = zipccl.all_reduce(buf, op=op, async_op=async_op, codec=codec)
        if async_op:
            work.wait()
        digest.update(_bytes(buf))
        if i >= warm:
            sample(i - warm + 1)
    return dict(samples=sample.samples, hashes=_same_everywhere(digest.digest()))


# ---- phases 2 and 3: DDP ---------------------------------------------------------------------------

VOCAB, WIDTH, BATCH, SEQ = 512, 64, 8, 16


class TinyLM(torch.nn.Module):
    """Next-token model of a fixed rule: about 100K parameters, every kind the layer rules sort."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.up = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.down = torch.nn.Linear(4 * WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(self.norm(h))


def ddp(rank: int, codec: str, steps: int, every: int, trim: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyLM(), bucket_cap_mb=0.1)  # about four buckets
    state = zipccl.ddp.State(codec=codec, model=model.module)
    model.register_comm_hook(state, zipccl.ddp.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(2000 + rank)
    sample = Sampler(f"ddp-{codec}", steps, every, rank, trim)
    loss = None
    for step in range(steps):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, VOCAB), ((x * 7 + 3) % VOCAB).view(-1))
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        sample(step + 1)
    digest = hashlib.blake2b(digest_size=16)
    for p in model.module.parameters():
        digest.update(_bytes(p))
    return dict(samples=sample.samples, hashes=_same_everywhere(digest.digest()), loss=float(loss.detach()),
                wire_ratio=state.stats()["ratio"])


# ---- the ranks and the report ----------------------------------------------------------------------

def _leaking(fn, nbytes: int):
    def wrapper(*args, **kwargs):
        _leaked.append(torch.ones(nbytes // 4))  # touched, so resident
        return fn(*args, **kwargs)
    return wrapper


def worker(rank: int, nranks: int, args) -> dict:
    if args.leak:  # the front door (collectives phase, lossless DDP) and the lossy layer's calls
        zipccl.all_reduce = _leaking(zipccl.all_reduce, args.leak)
        zipccl.api.all_reduce = _leaking(zipccl.api.all_reduce, args.leak)
        zipccl.collectives.all_reduce = _leaking(zipccl.collectives.all_reduce, args.leak)
    out = {}
    if args.calls:
        out["collectives"] = collectives(rank, args.calls, args.every, args.trim)
    for codec in ("lossless", "entropy") if args.steps else ():
        out[f"ddp-{codec}"] = ddp(rank, codec, args.steps, args.every, args.trim)
    return out


def report(per_rank: list, args) -> dict:
    phases = {}
    for name in PHASES:
        if name not in per_rank[0]:
            continue
        ranks = [r[name] for r in per_rank]
        period, unsampled = (ROUND, ROUND) if name == "collectives" else (1, 0)  # the first round is unsampled
        phase = dict(ranks=[summarize(r["samples"], args.warmup, period, unsampled) for r in ranks],
                     hashes=ranks[0]["hashes"],
                     samples=[r["samples"] for r in ranks])
        phase["hashes_agree_across_reports"] = all(r["hashes"] == ranks[0]["hashes"] for r in ranks)
        for k in ("loss", "wire_ratio"):
            if k in ranks[0]:
                phase[k] = ranks[0][k]
        phase["missed"] = verdict(phase, args.max_slope)
        phases[name] = phase
    return dict(nranks=args.nranks, calls=args.calls, steps=args.steps, every=args.every, warmup_share=args.warmup,
                max_slope_bytes_per_1000=args.max_slope, leak_bytes=args.leak,
                trimmed=args.trim and _LIBC is not None, environment={k: os.environ.get(k) for k in ENVIRONMENT},
                zipccl=_source(), torch=torch.__version__, fields=FIELDS,
                phases=phases, ok=not any(p["missed"] for p in phases.values()))


def _source() -> dict:
    """Where zipccl was imported from, and its git commit there (with uncommitted changes or not)."""
    where = os.path.dirname(os.path.dirname(os.path.abspath(zipccl.__file__)))
    out = dict(path=where, commit=None, modified=None)
    try:
        git = ["git", "-C", where]
        out["commit"] = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                                       check=True).stdout.strip()
        out["modified"] = bool(subprocess.run(git + ["status", "--porcelain", "--", "zipccl"], capture_output=True,
                                              text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def print_report(res: dict) -> None:
    print(f"\n# soak: {res['nranks']} ranks, {res['calls']} calls, {res['steps']} DDP steps per hook; slopes per "
          f"1,000 calls (steps), fitted past the first {res['warmup_share']:.0%} (collectives: of its calls with "
          f"the unsampled round, then whole rounds of {ROUND} calls)")
    print(f"# {'phase':<13} {'rank':>4} {'rss start':>9} {'rss end':>9} {'rss MiB':>8} {'heap MiB':>8} "
          f"{'py blocks':>9} {'fds':>7}  same bits")
    for name, phase in res["phases"].items():
        same = "yes" if len(set(phase["hashes"])) == 1 else "NO"
        for r, s in enumerate(phase["ranks"]):
            print(f"  {name:<13} {r:>4} {s['rss_start'] / MIB:>9.1f} {s['rss_end'] / MIB:>9.1f} "
                  f"{s['slope_bytes_per_1000'] / MIB:>+8.3f} {s['heap_slope_bytes_per_1000'] / MIB:>+8.3f} "
                  f"{s['py_blocks_slope_per_1000']:>+9.0f} {s['fd_min']:>3}..{s['fd_max']:<3}  {same}")
    missed = [f"{n}: {m}" for n, p in res["phases"].items() for m in p["missed"]]
    print("# targets met" if res["ok"] else "# targets missed:\n" + "\n".join(f"#   {m}" for m in missed))


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    phases = res["phases"]
    fig, axes = plt.subplots(2, len(phases), figsize=(5 * len(phases), 6.5), squeeze=False, sharex="col")
    for col, (name, phase) in enumerate(phases.items()):
        top, bottom = axes[0][col], axes[1][col]
        for r, samples in enumerate(phase["samples"]):
            xs = [s[0] for s in samples]
            top.plot(xs, [s[1] / MIB for s in samples], label=f"rank {r}", lw=1)
            bottom.plot(xs, [s[2] for s in samples], label=f"rank {r}", lw=1)
        for ax in (top, bottom):
            ax.axvspan(0, phase["ranks"][0]["fit_after"], color="0.9", zorder=0)
        worst = max(s["slope_bytes_per_1000"] for s in phase["ranks"]) / MIB
        top.set_title(f"{name}: worst slope {worst:+.3f} MiB/1000")
        top.set_ylabel("resident memory (MiB)")
        bottom.set_ylabel("open fds")
        bottom.set_xlabel("steps" if name.startswith("ddp") else "calls")
        top.legend(fontsize=7)
    fig.suptitle(f"zipccl soak, {res['nranks']} gloo ranks on loopback (grey: warm-up, left out of the fit)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="all-reduces in the first phase (0: skip it)")
    p.add_argument("--steps", type=int, default=1000, help="DDP steps per hook (0: skip DDP)")
    p.add_argument("--nranks", type=int, default=4)
    p.add_argument("--every", type=int, default=10, help="sample every this many calls or steps")
    p.add_argument("--warmup", type=float, default=WARMUP,
                   help="share of each phase's calls (steps) left out of the fit, at least")
    p.add_argument("--max-slope", type=float, default=MIB, help="bytes per 1,000 calls (steps) allowed after warm-up")
    p.add_argument("--leak", type=int, default=0, help="self-test: keep this many bytes alive per all-reduce")
    p.add_argument("--no-trim", dest="trim", action="store_false",
                   help="sample resident memory as it stands, without malloc_trim first")
    p.add_argument("--as-is", action="store_true",
                   help="leave glibc's mmap threshold dynamic and torch's flight recorder on (default: "
                        + ", ".join(f"{k}={v}" for k, v in ENVIRONMENT.items()) + ")")
    p.add_argument("--json", help="write the summary and every sample here")
    p.add_argument("--plot", help="PNG of resident memory and fds against calls, per rank and phase")
    args = p.parse_args(argv)
    if args.calls < 0 or args.steps < 0 or args.every < 1 or args.nranks < 2 or not 0 <= args.warmup < 1:
        p.error("need --calls >= 0, --steps >= 0, --every >= 1, --nranks >= 2, 0 <= --warmup < 1")
    if not args.as_is:  # read by each rank's C library and torch at start (spawn starts fresh interpreters)
        for k, v in ENVIRONMENT.items():
            os.environ.setdefault(k, v)
    start = time.monotonic()
    res = report(launch.spawn(worker, args.nranks, args), args)
    res["seconds"] = round(time.monotonic() - start, 1)
    print_report(res)
    print(f"# {res['seconds']:.0f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        text = json.dumps(res, indent=1)  # below: each sample (a list of numbers) on one line
        text = re.sub(r"\[\s*(-?[\d.e+-]+(?:,\s*-?[\d.e+-]+)*)\s*\]",
                      lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text)
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        plot(res, args.plot)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
