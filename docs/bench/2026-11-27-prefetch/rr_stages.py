"""Each stage of bench/codec_stages.py timed right after ZipNN's compress and decompress (1 thread
and default): the data as the codec benchmark's round-robin leaves it.

    ZIPCCL_DATA=/work/shared/data PYTHONPATH=/tmp/old python rr_stages.py bf16 /tmp/old
"""
import sys, time, numpy as np, torch, zipnn
sys.path.insert(0, sys.argv[2] + "/bench")
from codec_stages import stages
torch.set_num_threads(1)
dt, zname = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16"), "fp16": (torch.float16, "float16")}[sys.argv[1]]
x = torch.from_numpy(np.load("/work/shared/data/grads_step050_bucket0_fp32.npy")).reshape(-1).to(dt)
raw = x.view(torch.uint8).numpy().tobytes()
z1 = zipnn.ZipNN(input_format="byte", bytearray_dtype=zname, threads=1)
z0 = zipnn.ZipNN(input_format="byte", bytearray_dtype=zname, threads=0)
st = stages(x)
res = {k: [] for k in st}
for f in st.values(): f()
for _ in range(9):
    for k, f in st.items():
        z1.decompress(z1.compress(bytearray(raw)))
        z0.decompress(z0.compress(bytearray(raw)))
        t0 = time.perf_counter(); f(); res[k].append(time.perf_counter() - t0)
print(sys.argv[1], " | ".join(f"{k} {np.median(v)*1e3:.2f}" for k, v in res.items() if k not in ("tables", "plan")))
