"""Pack stage alone, timed in a round-robin with ZipNN (1 thread and default) between calls.

    PYTHONPATH=/tmp/old python rr_pack.py bf16|fp16|fp32
"""
import inspect, sys, time, numpy as np, torch, zipnn
from zipccl.codecs import Lossless
from zipccl.kernels import cpu as C
from zipccl.format import DEFAULT_BLOCK_SIZE, LAYOUTS, NSYM, num_blocks
from zipccl.reference.plan import choose
torch.set_num_threads(1)
dt, zname = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16"), "fp16": (torch.float16, "float16")}[sys.argv[1]]
x = torch.from_numpy(np.load("/work/shared/data/grads_step050_bucket0_fp32.npy")).reshape(-1).to(dt)
raw = x.view(torch.uint8).numpy().tobytes()
lay, bs, n = LAYOUTS[dt], DEFAULT_BLOCK_SIZE, x.numel()
bits, nb = C._int_view(x), num_blocks(n, bs)
ref, hist, nzero = np.zeros(nb, np.int64), np.zeros((nb, NSYM), np.int64), np.zeros(nb, np.int64)
C._analyse(bits, bs, lay.mbits, ref, hist, nzero)
t = choose(hist, dt)
cost = np.zeros(nb, np.int64); out = np.zeros(4 * nb * bs + 8, np.uint8)
args = (t.codes, t.lengths, out, cost, C._pair_tables())
if len(inspect.signature(C._pack.py_func).parameters) == 12:  # from ccfabfe: the sample's escapes
    args = (hist[:, 1].copy(), *args)
f = lambda: C._pack(bits, bs, lay.mbits, ref, t.assign, nzero, *args)
z = Lossless(); o = torch.empty_like(x)
z1 = zipnn.ZipNN(input_format="byte", bytearray_dtype=zname, threads=1)
z0 = zipnn.ZipNN(input_format="byte", bytearray_dtype=zname, threads=0)
f(); z.decode(z.encode(x), o)
pk, en = [], []
for _ in range(15):
    t0 = time.perf_counter(); f(); pk.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); p = z.encode(x); en.append(time.perf_counter() - t0)
    z.decode(p, o)
    z1.decompress(z1.compress(bytearray(raw)))
    z0.decompress(z0.compress(bytearray(raw)))
print(sys.argv[1], f"pack med {np.median(pk)*1e3:.2f} min {min(pk)*1e3:.2f} | encode med {np.median(en)*1e3:.2f} min {min(en)*1e3:.2f}")
