#!/usr/bin/env bash
# The GPU checks in one run, on one GPU machine (docs/GPU.md): the stack's versions, the gpu
# test suite, the codec's GPU throughput and where its time goes. Every file lands in OUTDIR.
#   ZIPCCL_DATA=folder-with-the-real-gradients bash bench/gpu_check.sh OUTDIR
set -u
out=${1:-gpu_out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 NCCL_SOCKET_IFNAME=lo
py=${PYTHON:-python3}
data=${ZIPCCL_DATA:-../shared/data}/grads_step050_bucket0_fp32.npy
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv
    $py -c "import sys, torch, triton, cupy; print('python', sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, 'cupy', cupy.__version__, '|', torch.cuda.get_device_name())"
    $py -c "from cupy.cuda import nccl; print('libnccl', nccl.get_version())"
    $py -c "from zipccl.transport import nccl_stack; print(nccl_stack.detect())"
    $py -c "from zipccl.topology import nvml_link; print('NVML link between local GPUs:', nvml_link())"
} 2>&1 | tee "$out/env.txt"
timeout "${SUITE_S:-240}" $py -m pytest -m gpu -rs -v -p no:cacheprovider tests/test_nccl_gpu.py 2>&1 \
    | tee "$out/gpu_suite.txt"
timeout "${CODEC_S:-150}" $py -m zipccl.bench.codec --device cuda --size "${NUMEL:-33554432}" --repeat 10 \
    --json "$out/codec_cuda.json" 2>&1 | tee "$out/codec_cuda.txt"
for case in ${STAGES:-4194304:bf16 33554432:bf16 134217728:bf16 33554432:fp16 16777216:fp32}; do
    timeout "${STAGES_S:-60}" $py bench/gpu_stages.py --numel "${case%:*}" --dtype "${case#*:}" --data "$data" 2>&1
done | tee "$out/stages.txt"
