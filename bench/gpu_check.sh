#!/usr/bin/env bash
# The GPU checks in one run, on one GPU machine (docs/GPU.md): the stack's versions, the gpu
# test suite (its multi-rank tests on the one-GPU lab), the one-GPU NCCL lab's tables (zipccl-perf
# --device cuda --share-gpu, 4 ranks on loopback: NCCL's own collective, raw, lossless and auto),
# the all-reduce again under MPS, the codec's GPU throughput and where its time goes. Every file
# lands in OUTDIR ($OUT if set).
#   ZIPCCL_DATA=folder-with-the-real-gradients bash bench/gpu_check.sh [OUTDIR]
# Each step is bounded by `timeout` (480 s in all by default: 8 minutes; SKIP="name ..." leaves
# steps out, by default the time-sliced lab's three tables, which add 120 s; NAME_S variables set
# the limits) and the run goes on after a failed step; OUTDIR/steps.txt lists every step's exit
# code (124: its time ran out) and seconds.
set -u
out=${1:-${OUT:-gpu_out}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 NCCL_SOCKET_IFNAME=lo
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
py=${PYTHON:-python3}
data=${ZIPCCL_DATA:-../shared/data}/grads_step050_bucket0_fp32.npy
: > "$out/steps.txt"

# step NAME SECONDS COMMAND...: run COMMAND for at most SECONDS, its output to OUTDIR/NAME.txt
# (and here), its exit code and time to OUTDIR/steps.txt.
step() {
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    local cmd="$*"
    if [[ " ${SKIP-lab_all_reduce lab_reduce_scatter lab_all_gather} " == *" $name "* ]]; then
        echo "$name skipped (SKIP)" | tee -a "$out/steps.txt"
        return
    fi
    echo "### $name (at most ${limit} s): ${cmd%%$'\n'*}" | tee -a "$out/$name.txt"
    timeout -k 2 "$limit" "$@" 2>&1 | tee -a "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$out/steps.txt"
}

# The stack: date, commit, the card (nvidia-smi), torch, torch's NCCL, Triton, CuPy's NCCL, NVML.
env_py=$(cat <<'PY'
import datetime
import os
import subprocess
import sys


def torch_version():
    import torch
    return f"{torch.__version__}, CUDA {torch.version.cuda}"


def gpu():
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else \
        "no CUDA device (torch.cuda.is_available() is False)"


def torch_nccl():
    import torch
    return ".".join(map(str, torch.cuda.nccl.version()))


def triton_version():
    import triton
    return triton.__version__


def cupy_nccl():
    import cupy
    from cupy.cuda import nccl
    return f"cupy {cupy.__version__}, libnccl {nccl.get_version()}"


def stack():
    from zipccl.transport import nccl_stack
    return nccl_stack.detect()


def link():
    from zipccl.topology import nvml_link
    return nvml_link()


def run(*argv):
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        return (r.stdout or r.stderr).strip() or f"exit code {r.returncode}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable ({type(e).__name__}: {e})"


print("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
print("commit", os.environ.get("ZIPCCL_COMMIT") or run("git", "rev-parse", "HEAD"))
print("nvidia-smi:", run("nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total",
                         "--format=csv"))
print("python", sys.version.split()[0])
for what, get in [("torch", torch_version), ("GPU", gpu), ("torch's NCCL", torch_nccl), ("triton", triton_version),
                  ("CuPy", cupy_nccl), ("zipccl's GPU stack", stack), ("NVML link between local GPUs", link)]:
    try:
        print(f"{what}: {get()}")
    except Exception as e:  # the next line still prints
        print(f"{what}: unavailable ({type(e).__name__}: {e})")
PY
)

# mps step NAME SECONDS COMMAND...: the step with NVIDIA's MPS daemon running, so that the ranks'
# kernels run side by side on the GPU instead of taking turns; the daemon is stopped afterwards.
mps() {
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/zipccl-mps CUDA_MPS_LOG_DIRECTORY=/tmp/zipccl-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
        "$@"
    else
        echo "$2 not run: the MPS daemon did not start" | tee -a "$out/steps.txt"
    fi
    echo quit | nvidia-cuda-mps-control
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

step env "${ENV_S:-10}" $py -c "$env_py"
# The gpu suite in steps, so that a hang in one part costs the others' results nothing; the
# killed-rank test comes last, since the ranks it leaves behind could slow what follows.
gpu_suite="$py -m pytest -m gpu -q -rfEsxXp -p no:cacheprovider"  # -q: no banner; -r...p names every test
step suite_kernels "${SUITE_KERNELS_S:-90}" $gpu_suite tests/test_nccl_gpu.py -k "not transport and not dropin"
step codec_cuda "${CODEC_S:-15}" $py -m zipccl.bench.codec --device cuda --size "${NUMEL:-33554432}" --repeat 10 \
    --json "$out/codec_cuda.json"
for case in ${STAGES:-33554432:bf16 4194304:bf16}; do
    step "stages_${case/:/_}" "${STAGES_S:-15}" $py bench/gpu_stages.py --numel "${case%:*}" --dtype "${case#*:}" \
        --data "$data"
done
step codec_ab "${AB_S:-15}" $py bench/gpu_ab.py --data "$data" --label "$(git rev-parse --short HEAD 2>/dev/null \
    || echo checkout)" --cases "${AB_CASES:-33554432:bf16}" --json "$out/codec_ab.json"
step suite_ranks "${SUITE_RANKS_S:-125}" $gpu_suite tests/test_nccl_gpu.py tests/test_gpu_lab.py \
    -k "(transport or dropin or collectives or clock or perf_lab) and not mail"
step suite_entry "${SUITE_ENTRY_S:-45}" $gpu_suite -s tests/test_gpu_lab.py -k entry_point
# The pipeline's host synchronisations per piece, and the mail channel: sizes pass pending packets.
step suite_syncs "${SUITE_SYNCS_S:-45}" $gpu_suite -s tests/test_gpu_lab.py tests/test_nccl_gpu.py \
    -k "synchronisations or mail"
# The one-GPU NCCL lab: 4 ranks on cuda:0, each its own NCCL host, NCCL's socket transport on
# loopback (no namespaces here); bf16 at 1, 8 and 64 MiB, one table per variant; then the
# all-reduce again with MPS.
lab="$py -m zipccl.bench.perf --device cuda --share-gpu --nranks 4 -b 1M -e 64M -f 8 -d bfloat16 --codec all -n 3 -w 1"
for coll in all_reduce reduce_scatter all_gather; do
    step "lab_$coll" "${LAB_S:-40}" $lab --collective "$coll" -J "$out/lab_$coll.json"
done
mps step lab_all_reduce_mps "${LAB_MPS_S:-45}" $lab --collective all_reduce -J "$out/lab_all_reduce_mps.json"
step suite_killed "${SUITE_KILLED_S:-60}" $gpu_suite -s tests/test_gpu_lab.py -k killed
echo "### done: $out/steps.txt"
