#!/usr/bin/env bash
# The GPU checks in two phases, on one GPU machine (docs/GPU.md, "How to run the GPU suite"):
#   ZIPCCL_COMMIT=<commit> bash bench/gpu_check.sh [--phase 1|2|all] [--dry-run|--plan] [OUTDIR]    # OUTDIR: gpu_out
# Phase 1, at most 4 minutes, correctness: the stack's versions; Triton's kernels compiled (so
# that no rank pays a cold compile inside a step's limit); every entry point on CUDA tensors on 4
# ranks of the one-GPU lab; a rank killed mid-call; the three collectives on 4 ranks against
# plain torch. Phase 2, at most 4 more, speed: the lab's all-reduce tables under MPS against
# torch's NCCL, 64 KiB to 256 MiB; (as root) the lab shaped to 10 Gbit/s per rank
# (zipccl-netlab: one network namespace per rank, NCCL's sockets on its veth; iproute2 from
# gpu_tools/, `make gpu-tools`, where the machine has none) against torch's NCCL on the same
# ranks under MPS; and the codec's checks last (its gpu tests, then bytes, bits and GB/s at 1, 8
# and 64 MiB of each dtype: numba's kernels, which it compares with and which compile in the
# background from each phase's start, have compiled by then). Phase 2 expects phase 1's Triton
# cache (~/.triton): run it right after phase 1 on the same machine, or its ranks compile cold.
# Left out by default, for a second call: the host waits per piece, memcheck, ncu, the call
# profile, the other collectives' labs, the transport's tests (each passed on an H200 at 41adf7a).
#
# Every step is bounded by `timeout` (its limit: the variable its line in `steps` below names,
# e.g. ENTRY_S=90) and by what is left of its phase (240 s each, PHASE_S, so that both end
# within 8 minutes); the run goes on after a failed step. OUTDIR/plan.txt lists the steps
# first; each step writes OUTDIR/NAME.txt as it runs
# and a line to OUTDIR/steps.txt as it ends (exit code, 124: its time ran out; seconds; limit).
# SKIP="name ..." adds steps to leave out to DEFAULT_SKIP (what does not fit the 8 minutes; set
# DEFAULT_SKIP= to run it). The real gradients are read from ZIPCCL_DATA, else data/ in this
# checkout (`make gpu-data` copies them there: an ignored folder, copied with the checkout),
# else ../shared/data; without them the steps use synthetic values and say so. ZIPCCL_COMMIT
# names the commit in every record where the checkout has no .git (a warning if none is known).
# BUNDLE (default: $OUT/gpu_check.tgz where OUT is set) gets the output folder as one archive,
# rewritten after each step.
# --dry-run: the same steps, bookkeeping, limits and files without CUDA: the pytest steps run
# (every gpu test skips, naming CUDA; a selection that matches no test fails), the tables run on
# 2 CPU ranks over gloo at 64 KiB, the shaped lab on gloo ranks (as root), no MPS daemon starts.
# --plan: OUTDIR/plan.txt alone (the steps, their limits and each phase's sum), nothing run.
set -u
phase=all dry=0 out= plan_only=0
while (($#)); do
    case $1 in
        --phase) phase=$2; shift 2 ;;
        --phase=*) phase=${1#*=}; shift ;;
        --dry-run) dry=1; shift ;;
        --plan) plan_only=1; shift ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d'; exit 0 ;;
        -*) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
        *) out=$1; shift ;;
    esac
done
case $phase in 1|2|all) ;; *) echo "gpu_check.sh: --phase takes 1, 2 or all" >&2; exit 2 ;; esac
out=${out:-gpu_out}
# The whole output folder as one archive, rewritten after each step (a machine that returns only
# a few files from $OUT gets it all): BUNDLE, else $OUT/gpu_check.tgz where OUT is set.
bundle=${BUNDLE-${OUT:+$OUT/gpu_check.tgz}}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TRITON_INTERPRET=$dry  # compiled on the GPU; the dry run's Triton codec on CPU tensors, interpreted
py=${PYTHON:-python3}
phase_s=${PHASE_S:-240}
default_skip=${DEFAULT_SKIP-syncs lab_reduce_scatter lab_all_gather shaped_reduce_scatter shaped_all_gather transport call_profile memcheck ncu}
skip=" $default_skip ${SKIP-} "
# iproute2 for the shaped lab where the machine has none: the carried gpu_tools/ (bench/gpu_tools.sh)
if ! command -v ip > /dev/null && [[ -x $PWD/gpu_tools/bin/ip ]]; then export PATH=$PWD/gpu_tools/bin:$PATH; fi
data=
for d in ${ZIPCCL_DATA:-} "$PWD/data" "$PWD/../shared/data"; do
    if [[ -f $d/grads_step050_bucket0_fp32.npy ]]; then data=$d/grads_step050_bucket0_fp32.npy; break; fi
done
[[ -n $data ]] && export ZIPCCL_DATA=${data%/*}
# The commit every record names: ZIPCCL_COMMIT, else git's (a copied checkout may have no .git).
commit=${ZIPCCL_COMMIT:-$(git rev-parse HEAD 2>/dev/null)}
if [[ -z $commit ]]; then
    commit=unknown
    echo "# WARNING: no commit known (no git here): run with ZIPCCL_COMMIT=<commit> so that the records name it" >&2
fi
export ZIPCCL_COMMIT=$commit
# steps.txt keeps the other phase's lines: --phase 2 into phase 1's folder adds to its record
if [[ $phase == all ]]; then : > "$out/steps.txt"; else touch "$out/steps.txt"; sed -i "/ phase=$phase /d" "$out/steps.txt"; fi

# The steps: name, phase, limit (seconds), what runs (a function below). Each phase's limits, with
# 10 s for each MPS step's daemon to start and stop, add up to at most 238 s of its 240 (2 s for
# a step killed at its limit), so that a step gets its whole limit where the ones before it end
# within theirs. The limits are what each step took on an H200 at 41adf7a, plus a margin.
steps=(
    "env 1 ${ENV_S:-12} run_env"
    "compile 1 ${COMPILE_S:-30} run_compile"
    "entry 1 ${ENTRY_S:-100} run_entry"
    "killed 1 ${KILLED_S:-34} run_killed"
    "collectives 1 ${COLLECTIVES_S:-61} run_collectives"
    "lab_all_reduce_mps 2 ${LAB_MPS_S:-58} mps run_lab all_reduce _mps"
    "shaped_all_reduce 2 ${SHAPED_S:-80} mps run_shaped all_reduce"
    "codec 2 ${CODEC_S:-78} run_codec"
    "syncs 2 ${SYNCS_S:-36} run_syncs"
    "shaped_reduce_scatter 2 ${SHAPED_S:-60} mps run_shaped reduce_scatter"
    "shaped_all_gather 2 ${SHAPED_S:-60} mps run_shaped all_gather"
    "lab_reduce_scatter 2 ${LAB_S:-40} run_lab reduce_scatter"
    "lab_all_gather 2 ${LAB_S:-40} run_lab all_gather"
    "transport 2 ${TRANSPORT_S:-60} run_transport"
    "call_profile 2 ${CALL_PROFILE_S:-45} mps run_call_profile"
    "memcheck 2 ${MEMCHECK_S:-30} run_memcheck"
    "ncu 2 ${NCU_S:-60} run_ncu"
)

# Phase 2 alone on a machine whose Triton cache holds none of zipccl's kernels (a fresh one, not
# phase 1's) first compiles the lab's (bf16, 10 s on an H200) once, rather than in each rank
# inside the timed lab; the codec step compiles the other dtypes itself. Later steps get what is
# left. (A dry run compiles nothing: Triton's interpreter.)
triton_cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [[ $phase == 2 ]] && ((!dry)) && ! find "$triton_cache" -name '_decode_symbols*' -print -quit 2>/dev/null | grep -q .; then
    steps=("warm 2 ${WARM_S:-15} run_compile bfloat16" "${steps[@]}")
fi

# The steps pick their tests (-m gpu, -k): CI's rule that nothing is deselected is for the
# whole suite, not for these picks, so CI is unset in them.
# -v: each test's name and outcome as it ends, so that a step cut short still says which passed
gpu_suite="env -u CI $py -m pytest -m gpu -v -rfEsxX -p no:cacheprovider"
lab_sizes=(-b 64K -e 256M -f "${LAB_FACTOR:-16}" -n 3 -w 1)  # 64 KiB, 1, 16 and 256 MiB (LAB_FACTOR=4: seven sizes)
((dry)) && lab_sizes=(-b 64K -e 64K -n 1 -w 0)

# The one-GPU lab's zipccl-perf (4 ranks on cuda:0, each its own NCCL host; torch's NCCL table
# first, then auto, lossless and raw: LAB_CODECS, the one its question is about first, where the
# step's limit may cut the last short), or in a dry run 2 CPU ranks over gloo.
perf() {
    if ((dry)); then
        $py -m zipccl.bench.perf --nranks 2 -d bfloat16 --codec raw "${lab_sizes[@]}" "$@"
    else
        # zipccl's waits bounded inside the step: a rank that hangs is named before the step's kill
        ZIPCCL_TIMEOUT=${ZIPCCL_TIMEOUT:-30} $py -m zipccl.bench.perf --device cuda --share-gpu --nranks 4 -d bfloat16 \
            --codec "${LAB_CODECS:-auto,lossless,raw}" \
            "${lab_sizes[@]}" ${data:+--data "$data"} "$@"
    fi
}

# The steps marked "mps" run with NVIDIA's MPS daemon, so that the ranks' kernels run side by
# side on the GPU instead of taking turns: started before the step's limit begins, stopped after
# it ends (also when it ran out), within 5 s each. A dry run starts none.
mps_start() {
    if ((dry)); then echo "# dry run: the MPS daemon is not started"; return; fi
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/zipccl-mps CUDA_MPS_LOG_DIRECTORY=/tmp/zipccl-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    # a daemon left up by a run killed from outside (its own process group outlives the step): quit first,
    # or this start fails and the step runs time-sliced beside it
    [[ -p $CUDA_MPS_PIPE_DIRECTORY/control ]] && { echo quit | timeout 5 nvidia-cuda-mps-control > /dev/null 2>&1; sleep 1; }
    if ! timeout 5 nvidia-cuda-mps-control -d; then
        echo "# the MPS daemon did not start: the step runs time-sliced"
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY  # the tables' JSON (env) then names no MPS
    fi
}
mps_stop() {
    ((dry)) && return
    # its own pipe, named: a start that timed out may have left the daemon up with the variables unset
    echo quit | CUDA_MPS_PIPE_DIRECTORY=/tmp/zipccl-mps timeout 5 nvidia-cuda-mps-control \
        || echo "# the MPS daemon did not stop within 5 s"
    # what the daemon said (clients served, errors): whether MPS ran the step's ranks
    [[ -f /tmp/zipccl-mps-log/control.log ]] && { echo "# MPS control log, last lines:"; tail -n 8 /tmp/zipccl-mps-log/control.log; }
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

run_env() {
    $py - <<'PY'
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


def numpy_numba():
    import numba
    import numpy
    return f"numpy {numpy.__version__}, numba {numba.__version__}"


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


def cuda_tools():
    import glob
    import shutil
    found = {t: shutil.which(t) or next(iter(sorted(glob.glob(f"/usr/local/cuda*/bin/{t}"))), None)
             for t in ("ncu", "compute-sanitizer", "nsys")}
    return ", ".join(f"{t} {p or 'not found'}" for t, p in found.items())


def run(*argv):
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=5)
        return (r.stdout or r.stderr).strip() or f"exit code {r.returncode}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable ({type(e).__name__}: {e})"


print("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
print("commit", os.environ["ZIPCCL_COMMIT"])
print("nvidia-smi:", run("nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total",
                         "--format=csv"))
print("python", sys.version.split()[0], "| cores", os.cpu_count())
print("real gradients:", os.environ.get("ZIPCCL_DATA") or "not found (synthetic values instead)")
for what, get in [("torch", torch_version), ("GPU", gpu), ("torch's NCCL", torch_nccl), ("triton", triton_version),
                  ("numpy, numba", numpy_numba), ("CuPy", cupy_nccl), ("zipccl's GPU stack", stack), ("NVML link between local GPUs", link),
                  ("CUDA tools", cuda_tools)]:
    try:
        print(f"{what}: {get()}")
    except Exception as e:  # the next line still prints
        print(f"{what}: unavailable ({type(e).__name__}: {e})")
PY
}

# Triton's kernels: one small encode and decode of each dtype named (default: all three) on the
# GPU (its cache, ~/.triton, serves every rank after).
run_compile() {
    $py - "${@:-bfloat16 float16 float32}" <<'PY'
import sys
import time

import torch

dtypes = [getattr(torch, name) for name in " ".join(sys.argv[1:]).split()]
if not torch.cuda.is_available():
    print("Triton: no CUDA device, nothing to compile (its kernels compile at the first GPU call)")
else:
    from zipccl.codecs import Lossless
    t0 = time.perf_counter()
    codec = Lossless("triton")
    for dtype in dtypes:
        x = (torch.randn(1 << 16, device="cuda") * 0.02).to(dtype)
        out = torch.empty_like(x)
        assert codec.decode_into(codec.encode(x), out).problem() is None
        assert torch.equal(out.view(torch.uint8), x.view(torch.uint8)), dtype
        # the collectives' variants (packets at slots, several per launch; sizes on the device)
        rows, slot = x.view(4, -1), codec.slot(x.numel() // 4, dtype)
        buf = torch.empty(4 * slot, dtype=torch.uint8, device="cuda")
        sizes = codec.encode_many(list(rows), buf)
        one = torch.empty(slot, dtype=torch.uint8, device="cuda")
        codec.encode_into(rows[0], one)
        outs = torch.empty_like(rows)
        packets = [buf[k * slot:(k + 1) * slot] for k in range(4)]
        assert all(v.problem() is None for v in codec.decode_many(packets, list(outs))), dtype
        assert torch.equal(outs.view(-1).view(torch.uint8), x.view(torch.uint8)) and int(sizes.max()) <= slot, dtype
    torch.cuda.synchronize()
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    print(f"Triton: encode, encode_into, encode_many, decode_into and decode_many of {names} "
          f"compiled and checked in {time.perf_counter() - t0:.1f} s")
PY
}

# numba's kernels (the CPU codec per dtype, top-k, the sums) into their on-disk cache, side by
# side, in the background from the start: cold they take minutes on one core. A step that needs
# them waits for OUTDIR/numba.done (within its own limit).
numba_compile() {
    local t0=$SECONDS dtype a pids=() ra=0
    for dtype in fp32 bf16 fp16; do
        $py tests/compile_kernels.py lossless $dtype >> "$out/numba.txt" 2>&1 & pids+=($!)
    done
    $py tests/compile_kernels.py sparse >> "$out/numba.txt" 2>&1 & local b=$!
    for a in "${pids[@]}"; do wait "$a" || ra=$?; done
    wait $b; local rb=$?
    echo "numba_compile rc=$((ra || rb)) seconds=$((SECONDS - t0)) (lossless rc=$ra, sparse rc=$rb; background)" \
        > "$out/numba.done"
}
wait_numba() {
    while [[ ! -f $out/numba.done ]]; do sleep 1; done
    cat "$out/numba.done"
}

run_entry() { $gpu_suite -s tests/test_gpu_lab.py -k entry_point; }
run_killed() { $gpu_suite -s tests/test_gpu_lab.py -k killed; }
run_lab() { perf --collective "$1" -J "$out/lab_$1${2:-}.json"; }

# The codec's checks: the gpu suite's codec tests (a cold first call under sync-debug "error", a
# CUDA graph's round trip, no synchronising call), then bench/gpu_ab.py: bytes
# against the numba encoder, bits back, wall and kernel time of encode and decode at 1, 8 and 64
# MiB of bf16, fp16 and fp32 real gradients in Triton's 4096-element blocks, and at 8 MiB of bf16
# in blocks of 256 and 1024 too (a lane walks a 256-symbol sub-stream at every size; the sizes of
# the programs and of the index differ); then the device operations and wall time of one 8 MiB
# call (bench/gpu_stages.py). The cases that matter most go first: each prints its line as it
# ends, so a step out of time keeps them.
AB_GRID=33554432:bf16,4194304:bf16,33554432:fp16,4194304:fp16,16777216:fp32,2097152:fp32
AB_GRID+=,524288:bf16,524288:fp16,262144:fp32,4194304:bf16:256,4194304:bf16:1024
run_codec() {
    wait_numba
    # 4 processes, so that Triton compiles the tests' other block sizes side by side (61 s cold
    # in one on an H200, 10 s warm)
    local workers=(-n 4)
    ((dry)) && workers=()
    $gpu_suite "${workers[@]}" tests/test_nccl_gpu.py -k "not transport and not dropin"
    local rc=$?
    # Device operations per encode_into and decode_into, and each call's wall time (8 MiB of bf16),
    # before the A/B, whose last cases are the first a short step loses
    ((dry)) || timeout 20 $py bench/gpu_stages.py --numel 4194304 --repeat 3 ${data:+--data "$data"} | head -90
    ((dry)) && echo "# dry run: two small cases on CPU; on a GPU: --cases ${AB_CASES:-$AB_GRID}"
    rm -f "$out/codec_ab.json"  # gpu_ab.py appends: a rerun into this folder starts it afresh
    $py bench/gpu_ab.py ${data:+--data "$data"} --label "$ZIPCCL_COMMIT" \
        --json "$out/codec_ab.json" \
        $( ((dry)) && echo --device cpu --cases 512:bf16,512:bf16:256 --repeat 1 || echo --cases "${AB_CASES:-$AB_GRID}")
    local rc2=$?
    return $((rc || rc2))
}

# compute-sanitizer's memcheck (a step of its own, left out by default: about 25 s, beside the
# codec's 72) over the Triton decoder's decode_into of hostile packets (seeded
# mutations of valid ones, zipccl.bench.fuzz), where the tool is installed; the dry run decodes
# three on CPU, without it.
hostile_py='
import sys

import torch

from zipccl.bench import fuzz
from zipccl.codecs import Lossless

count, device = int(sys.argv[1]), sys.argv[2]
bases = tuple(b for b in fuzz.base_packets("reference", None) if not b.checksum and b.numel)  # blocks of 256
codec, refused = Lossless("triton", block_size=256), 0
for i in range(count):
    r = fuzz.case_rng(11, "memcheck", i)
    base = r.choice(bases)
    packet = torch.from_numpy(fuzz.mutate("triton", r, base, bases)[0]).to(device)
    out = torch.empty(base.numel, dtype=base.dtype, device=device)
    refused += codec.decode_into(packet, out).problem() is not None
print(f"{count} hostile packets into decode_into on {device}: {refused} refused, {count - refused} decoded")
'
run_memcheck() {
    local tool
    tool=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    if ((dry)); then
        $py -c "$hostile_py" 3 cpu
    elif [[ -z $tool ]]; then
        echo "# compute-sanitizer not found (PATH, /usr/local/cuda*/bin): no memcheck"
    else
        # without torch's caching allocator, which carves small tensors out of larger blocks that
        # memcheck sees as one: an overrun into a neighbour would go unseen
        local left=$((ZIPCCL_STEP_END - $(date +%s) - 4))  # the step's end: its limit may have been cut
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(( left > 1 ? left : 1 ))" "$tool" --tool memcheck \
            --error-exitcode 9 $py -c "$hostile_py" 40 cuda
        local rc=$?
        ((rc == 124)) && echo "# memcheck ran out of time: not run to the end (no finding either way)"
        return $rc
    fi
}

# Nsight Compute on the codec's kernels (a step of its own, left out by default): one encode and
# one decode of 64 MiB of bf16 real gradients inside the CUDA profiler's window (bench/gpu_ab.py
# --ncu-window, after its byte and bit checks), each launch's speed-of-light, memory, occupancy
# and launch sections into OUTDIR/ncu.csv, then bench/ncu_table.py's table of them; where ncu is
# installed (PATH, /usr/local/cuda*/bin) and may read the counters. A dry run: the window on CPU.
run_ncu() {
    local tool
    tool=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    wait_numba
    if ((dry)); then
        echo "# dry run: the window's workload on CPU, no ncu"
        $py bench/gpu_ab.py --device cpu --cases 512:bf16 --ncu-window ${data:+--data "$data"}
        return
    elif [[ -z $tool ]]; then
        echo "# ncu not found (PATH, /usr/local/cuda*/bin): no kernel profile"
        return 3
    fi
    local left=$((ZIPCCL_STEP_END - $(date +%s) - 6))  # the step's end: its limit may have been cut
    timeout "$(( left > 1 ? left : 1 ))" "$tool" --profile-from-start off --csv --page details \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --log-file "$out/ncu.csv" $py bench/gpu_ab.py --cases "${NCU_CASES:-33554432:bf16}" --ncu-window \
        ${data:+--data "$data"}
    local rc=$?
    ((rc == 124)) && echo "# ncu ran out of time: the table holds the launches profiled by then"
    $py bench/ncu_table.py "$out/ncu.csv"
    return $rc
}

# Where a small call's host time goes (bench/call_profile.py): 64 KiB lossless and raw all-reduce
# on the 4 ranks of the one-GPU lab, each rank's median and rank 0's cProfile; a dry run: 2 gloo ranks.
run_call_profile() {
    if ((dry)); then
        $py bench/call_profile.py --nranks 2 --calls 3 --rows 10
        return
    fi
    local codec
    for codec in lossless raw; do
        $py bench/call_profile.py --device cuda --nranks 4 --codec $codec --calls 20 --rows 30 || return
    done
}

run_syncs() { $gpu_suite -s tests/test_gpu_lab.py tests/test_nccl_gpu.py -k "host_wait or mail"; }
# 4 ranks (COLLECTIVES_K=collectives_match: 2 ranks too, about 35 s more)
run_collectives() { $gpu_suite tests/test_gpu_lab.py -k "${COLLECTIVES_K:-collectives_match and 4}"; }
run_transport() {
    wait_numba
    $gpu_suite tests/test_nccl_gpu.py tests/test_gpu_lab.py -k "transport_matches or dropin or clock or perf_lab"
}

# The lab shaped to 10 Gbit/s per rank: 4 network namespaces (zipccl-netlab), NCCL's sockets on
# each rank's veth, 64 and 256 MiB; root only (a dry run: gloo ranks in the same lab at 64 KiB).
run_shaped() {
    local why
    # a lab left up by a step killed at its limit (its namespaces, veths): down first (not in a
    # dry run, which may share its host with the suite's own lab tests)
    ((dry)) || $py -m zipccl.bench.netlab down > /dev/null 2>&1
    why=$($py -c "from zipccl.bench import netlab; print(netlab.unavailable() or '')")
    if [[ -n $why ]]; then
        echo "# the shaped lab cannot run here: $why"
        return 3
    fi
    if ((dry)); then
        $py -m zipccl.bench.perf --nranks 4 --netlab "${SHAPED_RATE:-10gbit}" -d bfloat16 --codec raw \
            "${lab_sizes[@]}" --collective "$1" -J "$out/shaped_$1.json"
    else
        ZIPCCL_TIMEOUT=${ZIPCCL_TIMEOUT:-30} $py -m zipccl.bench.perf --device cuda --share-gpu --nranks 4 \
            --netlab "${SHAPED_RATE:-10gbit}" \
            -d bfloat16 --codec "${SHAPED_CODECS:-lossless,auto,raw}" -b 64M -e 256M -f 4 -n 3 -w 1 ${data:+--data "$data"} --collective "$1" \
            -J "$out/shaped_$1.json"
    fi
}

# The plan: what runs, in which phase, with which limits.
declare -A spent=([1]=0 [2]=0)
{
    echo "# gpu_check.sh: phase $phase$( ((dry)) && echo ', dry run'), output in $out, $(date -u +%FT%TZ)"
    echo "# skipped: $(echo $skip)"
    for s in "${steps[@]}"; do
        read -r name p limit how _ <<<"$s"
        [[ $phase != all && $phase != "$p" ]] && continue
        if [[ $skip == *" $name "* ]]; then echo "$name phase=$p skip"; continue; fi
        spent[$p]=$((spent[$p] + limit + $([[ $how == mps ]] && echo 10 || echo 0)))
        echo "$name phase=$p limit=$limit"
    done
    for p in 1 2; do
        [[ $phase != all && $phase != "$p" ]] && continue
        over=$( ((spent[$p] > phase_s - 2)) && echo ": OVER, later steps get what is left")
        echo "# phase $p: limits add up to ${spent[$p]} s of its $phase_s s, MPS's 10 s a step included$over"
    done
} | tee "$out/plan.txt"
((plan_only)) && exit 0

# step NAME PHASE LIMIT [mps] FUNCTION ARGS...: FUNCTION within LIMIT and what is left of the
# phase, its output to OUTDIR/NAME.txt (and here) as it goes, its exit code and seconds to
# OUTDIR/steps.txt. `timeout` ends the step's whole process group (the ranks it spawned too).
phase_end=0 current=0
# The checkout's and $OUT's paths as relative names in the logs: a record keeps no machine's paths.
tidy=(-e "s#$PWD/##g")
[[ -n ${OUT:-} ]] && tidy+=(-e "s#$OUT#\$OUT#g")
step() {
    local name=$1 p=$2 limit=$3 t0=$SECONDS mps=0
    shift 3
    [[ $1 == mps ]] && { mps=1; shift; }
    if [[ $p != "$current" ]]; then current=$p phase_end=$((SECONDS + phase_s)); fi
    if [[ $skip == *" $name "* ]]; then
        echo "$name phase=$p skipped (SKIP)" | tee -a "$out/steps.txt"
        return
    fi
    local left=$((phase_end - SECONDS - 2 - 10 * mps))  # the kill's grace, MPS's start and stop
    if ((left < 5)); then
        echo "$name phase=$p skipped (no time left in phase $p)" | tee -a "$out/steps.txt"
        return
    fi
    ((limit > left)) && limit=$left
    echo "### $name (phase $p, at most $limit s): $*" | tee "$out/$name.txt"
    ((mps)) && mps_start > >(tee -a "$out/$name.txt") 2>&1  # in this shell: its variables reach the step
    local defs="$(declare -f "$1" perf wait_numba run_memcheck); $(declare -p py dry out data gpu_suite lab_sizes AB_GRID hostile_py)"
    # ZIPCCL_STEP_END: the tests' spawned ranks give up before the step ends (tests/workers.py)
    ZIPCCL_STEP_END=$(($(date +%s) + limit)) timeout -k 2 "$limit" bash -c "$defs; $*" \
        2>&1 | sed -u "${tidy[@]}" | tee -a "$out/$name.txt"
    local rc=${PIPESTATUS[0]}
    ((mps)) && mps_stop > >(tee -a "$out/$name.txt") 2>&1
    echo "$name phase=$p rc=$rc seconds=$((SECONDS - t0)) limit=$limit" | tee -a "$out/steps.txt"
    pack
}
pack() {
    [[ -z $bundle ]] && return
    # tar's exit code 1: a file changed while read (numba's log, written in the background): packed all the same
    tar czf "$bundle.part" --exclude="${bundle##*/}*" -C "$out" . 2>/dev/null
    (($? <= 1)) && mv -f "$bundle.part" "$bundle"
}

rm -f "$out/numba.done"
# From the start of either phase, bounded like the rest and ended with the script: phase 1's
# correctness steps leave phase 2 a warm cache (8 s to load), so that it does not compile beside
# phase 2's timed labs (65 s cold on an H200's host).
timeout -k 2 $((2 * phase_s)) bash -c "$(declare -f numba_compile); $(declare -p py out); numba_compile" &
numba_pid=$!
for s in "${steps[@]}"; do
    read -r name p limit rest <<<"$s"
    [[ $phase != all && $phase != "$p" ]] && continue
    step "$name" "$p" "$limit" $rest
done
if [[ ! -f $out/numba.done ]]; then
    kill "$numba_pid" 2>/dev/null
    echo "numba_compile ended unfinished (no step waited for it)" | tee -a "$out/steps.txt"
fi
wait "$numba_pid" 2>/dev/null
[[ -f $out/numba.done ]] && tee -a "$out/steps.txt" < "$out/numba.done"
echo "### done in $SECONDS s: $out/steps.txt" | tee -a "$out/steps.txt"
pack
