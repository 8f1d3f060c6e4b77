"""bench/gpu_check.sh --dry-run on a machine without a GPU: its own logic (the steps and phases,
SKIP added to the defaults, the limits within each phase's 4 minutes, a file per step written
as it runs, the tables' JSON, the gradients found in the checkout's data/) with every CUDA part
replaced by what runs on CPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[1]
PHASE1 = ["env", "compile", "entry", "killed", "collectives"]
PHASE2 = ["lab_all_reduce_mps", "shaped_all_reduce", "codec", "syncs", "shaped_reduce_scatter", "shaped_all_gather",
          "lab_reduce_scatter", "lab_all_gather", "transport", "call_profile", "memcheck", "ncu"]
DEFAULT_SKIP = {"syncs", "lab_reduce_scatter", "lab_all_gather", "shaped_reduce_scatter", "shaped_all_gather", "transport",
                "call_profile", "memcheck", "ncu"}
RUN_DRY = {"syncs", "memcheck", "ncu"}  # default skips that the dry run of both phases runs: a few packets, one test


def _run(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("SKIP", "DEFAULT_SKIP", "PHASE_S", "OUT", "BUNDLE", "ZIPCCL_COMMIT",
                                                     "TRITON_INTERPRET")}
    environ.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run", *args, str(out)], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=800)


def _steps(out: Path) -> dict:
    """steps.txt: {name: (phase, exit code, or "skip" (SKIP) or "late" (no time left), limit)} in order."""
    got = {}
    for line in (out / "steps.txt").read_text().splitlines():
        if m := re.fullmatch(r"(\w+) phase=(\d) rc=(\d+) seconds=\d+ limit=(\d+)", line):
            got[m[1]] = (int(m[2]), int(m[3]), int(m[4]))
        elif m := re.fullmatch(r"(\w+) phase=(\d) skipped \((SKIP|no time left in phase \d)\)", line):
            got[m[1]] = (int(m[2]), "skip" if m[3] == "SKIP" else "late", None)
    return got


def _plan(out: Path) -> dict:
    """plan.txt: {phase: sum of its limits}, and the steps in order."""
    text = (out / "plan.txt").read_text()
    sums = {int(p): int(s) for p, s in re.findall(r"# phase (\d): limits add up to (\d+) s", text)}
    return sums, re.findall(r"^(\w+) phase=\d", text, re.M)


def test_dry_run_of_both_phases(tmp_path, lab_lock):
    """Every step in its phase and order, the default skips skipped, every other step run (on
    CPU its gpu tests skip, naming CUDA) with exit code 0, each within a limit that fits its
    phase; the all-reduce table's JSON and the stack's lines written; the shaped lab run on gloo
    ranks where this machine can build it (root), else its reason said."""
    out, bundle = tmp_path / "out", tmp_path / "all.tgz"
    # A 2-core host imports the stack slower than a GPU machine, numba compiling beside it, and
    # interprets the Triton codec, all beside the rest of the suite: the limits are the GPU's, the
    # interpreted steps' and the phases' widened (the codec step past 78 s in one CI run on a
    # 2-core Xeon, 2026-12-02, its decode_into 6.5x slower than on the same host idle). The default
    # limits' fit in each phase is test_the_default_plan_leaves_room_for_the_mps_daemon's.
    r = _run(out, BUNDLE=str(bundle), ZIPCCL_COMMIT="c0ffee1", ENV_S="25", COMPILE_S="45", CODEC_S="200",
             MEMCHECK_S="90", NCU_S="120", PHASE_S="600", DEFAULT_SKIP=" ".join(sorted(DEFAULT_SKIP - RUN_DRY)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = _steps(out)
    assert list(steps) == PHASE1 + PHASE2, steps
    with tarfile.open(bundle) as tar:  # the whole folder, as it was at the end
        packed = {Path(n).name: tar.extractfile(n).read() for n in tar.getnames() if tar.getmember(n).isfile()}
    assert packed == {f.name: f.read_bytes() for f in out.iterdir()}, sorted(packed)
    assert "commit c0ffee1" in (out / "env.txt").read_text()
    assert json.loads((out / "codec_ab.json").read_text().splitlines()[0])["label"] == "c0ffee1"
    _, planned = _plan(out)
    assert planned == PHASE1 + PHASE2, planned
    for name, (phase, rc, limit) in steps.items():
        assert phase == (1 if name in PHASE1 else 2), name
        if name in DEFAULT_SKIP - RUN_DRY:
            assert rc == "skip", name
            continue
        text = (out / f"{name}.txt").read_text()
        assert text.startswith(f"### {name} (phase {phase}, at most {limit} s)"), text[:200]
        if name == "shaped_all_reduce" and rc == 3:
            assert "the shaped lab cannot run here" in text, text
            continue
        assert rc == 0, (name, text[-3000:])
    assert "GPU: no CUDA device" in (out / "env.txt").read_text()
    assert f"real gradients: {ROOT / 'data'}" in (out / "env.txt").read_text() or not (ROOT / "data").exists()
    for name in ("entry", "killed", "syncs", "collectives"):  # the selection matched tests, which skipped on CPU
        assert re.search(r"\d+ skipped", (out / f"{name}.txt").read_text()), name
    assert "no CUDA device" in (out / "entry.txt").read_text()
    codec = (out / "codec.txt").read_text()  # what the step would run on a GPU reached its shell
    assert "on a GPU: --cases 33554432:bf16,4194304:bf16," in codec
    assert "3 hostile packets into decode_into on cpu" in (out / "memcheck.txt").read_text()
    ncu = (out / "ncu.txt").read_text()  # the profiler's window around a checked encode and decode
    assert "# dry run: the window's workload on CPU, no ncu" in ncu and '"same_bits": true' in ncu, ncu
    table = json.loads((out / "lab_all_reduce_mps.json").read_text())
    assert table["results"] and all(row["out_of_place"]["nwrong"] == 0 for row in table["results"])
    assert "dry run: the MPS daemon is not started" in (out / "lab_all_reduce_mps.txt").read_text()
    if steps["shaped_all_reduce"][1] == 0:
        assert "# netlab: 4 ranks, 10gbit per rank" in (out / "shaped_all_reduce.txt").read_text()
        assert (out / "shaped_all_reduce.json").exists()


def test_the_default_plan_leaves_room_for_the_mps_daemon(tmp_path):
    """--plan writes the plan alone: each phase's default limits, with 10 s for each MPS step's
    daemon to start and stop, add up to at most 238 s of its 240 (2 s for a step killed at its
    limit), so that a step gets its whole limit where the ones before it end within theirs;
    nothing runs (no steps.txt line, no step's file)."""
    out = tmp_path / "plan"
    r = subprocess.run(["bash", "bench/gpu_check.sh", "--plan", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items() if not k.endswith("_S")})
    assert r.returncode == 0, r.stderr
    sums, planned = _plan(out)
    assert planned == PHASE1 + PHASE2 and sums[1] <= 238 and sums[2] <= 238, sums
    assert sorted(f.name for f in out.iterdir()) == ["plan.txt", "steps.txt"] and not (out / "steps.txt").read_text()


def test_phase_two_alone_on_a_cold_triton_cache_compiles_the_labs_kernels_first(tmp_path):
    """--phase 2 where Triton's cache holds no zipccl kernel (a fresh machine, not phase 1's)
    plans a `warm` step first, compiling bf16's kernels once rather than in every rank inside the
    timed lab; with phase 1's cache it plans none."""
    cache = tmp_path / "cache"
    cache.mkdir()
    planned = {}
    for state in ("cold", "warm"):
        out = tmp_path / state
        env = {k: v for k, v in os.environ.items() if not k.endswith("_S")}
        r = subprocess.run(["bash", "bench/gpu_check.sh", "--plan", "--phase", "2", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env=dict(env, TRITON_CACHE_DIR=str(cache)))
        assert r.returncode == 0, r.stderr
        planned[state] = _plan(out)[1]
        (cache / "0a1b").mkdir(exist_ok=True)
        (cache / "0a1b" / "_decode_symbols.cubin").write_bytes(b"")  # what Triton writes beside its other files
    assert planned == {"cold": ["warm"] + PHASE2, "warm": PHASE2}, planned


def test_phase_one_alone_and_skip_adds_to_the_defaults(tmp_path):
    """--phase 1 runs phase 1's steps only; SKIP adds to DEFAULT_SKIP (here it skips all of
    phase 1 but the stack's versions); a phase's steps get no more than what is left of it;
    --phase 2 into phase 1's folder keeps phase 1's lines of steps.txt."""
    out, device_out = tmp_path / "out", tmp_path / "device_out"
    device_out.mkdir()
    # a 2-core host imports the stack slower than a GPU machine, numba compiling beside it (a slow
    # 2-core Xeon, 2026-12-02: past 25 s in one CI run of two)
    r = _run(out, "--phase", "1", SKIP="compile entry killed collectives", OUT=str(device_out), ENV_S="60")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = _steps(out)
    assert list(steps) == PHASE1 and steps["env"][1] == 0, steps
    assert [f.name for f in device_out.iterdir()] == ["gpu_check.tgz"]  # where OUT is set: one archive there
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert f"commit {head}" in (out / "env.txt").read_text()  # without ZIPCCL_COMMIT: git's
    assert all(steps[n][1] == "skip" for n in PHASE1[1:]), steps
    assert "# skipped: syncs lab_reduce_scatter lab_all_gather" in (out / "plan.txt").read_text()
    out2 = tmp_path / "short"
    r = _run(out2, "--phase", "2", PHASE_S="12", DEFAULT_SKIP="",  # the default skips run now, 12 s cut them short
             SKIP="lab_all_reduce_mps shaped_all_reduce codec syncs shaped_reduce_scatter shaped_all_gather")
    steps = _steps(out2)
    assert list(steps) == PHASE2, steps
    assert all(steps[n][1] == "skip" for n in PHASE2[:6]), steps
    _, rc, limit = steps["lab_reduce_scatter"]
    assert rc in (0, 124) and 8 <= limit <= 12 - 2, steps  # what is left of the phase, less the kill's grace
    assert all(v[1] == "late" or v[2] < 10 for n, v in steps.items() if n in PHASE2[7:]), steps
    r = _run(out, "--phase", "2", DEFAULT_SKIP="", SKIP=" ".join(PHASE2))  # into phase 1's folder: added to its record
    steps = _steps(out)
    assert list(steps) == PHASE1 + PHASE2 and steps["env"][1] == 0 and steps["ncu"][1] == "skip", steps


def _never_answers(rank: int, results) -> None:
    import time
    time.sleep(600)


def test_spawned_ranks_give_up_before_the_step_ends(monkeypatch):
    """Inside a step (ZIPCCL_STEP_END 20 s ahead) a test's spawned ranks that never answer are
    given up 7 s before the step ends, and killed by 3 s before, not after the test's own 300 s:
    the test has its answer before the step ends (on a loaded 2-core host, the ranks' exit took
    seconds more than on an idle one)."""
    import time

    from workers import spawn
    monkeypatch.setenv("ZIPCCL_STEP_END", str(time.time() + 20))
    t0 = time.monotonic()
    got, procs = spawn(_never_answers, 2, (), seconds=300)
    assert got == {} and not any(p.is_alive() for p in procs)
    assert 12 <= time.monotonic() - t0 < 20, time.monotonic() - t0


# ncu's --csv --page details, as Nsight Compute 2025 writes it (its lines and the program's around it).
_NCU_CSV = """==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "_analyse": 0%....50%....100% - 9 passes
{"numel": 33554432, "dtype": "bf16", "same_bits": true}
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3.12","127.0.0.1","_analyse","1","7","(128, 1, 1)","(8192, 1, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","61.32"
"0","4242","python3.12","127.0.0.1","_analyse","1","7","(128, 1, 1)","(8192, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","usecond","263.10"
"0","4242","python3.12","127.0.0.1","_analyse","1","7","(128, 1, 1)","(8192, 1, 1)","0","9.0","Occupancy","Achieved Occupancy","%","88.5"
"1","4242","python3.12","127.0.0.1","_decode_join(int, int)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","usecond","240.00"
"1","4242","python3.12","127.0.0.1","_decode_join(int, int)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Memory Workload Analysis","L1/TEX Hit Rate","%","12.5"
"1","4242","python3.12","127.0.0.1","_decode_join(int, int)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","40"
==PROF== Disconnected from process 4242
"""


def test_ncu_table_reads_ncus_csv_among_other_lines(tmp_path, capsys):
    """bench/ncu_table.py: one row per launch in the order of IDs, each metric in its column with
    its unit, "-" where a section did not report it; ncu's lines and the program's skipped."""
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import ncu_table
    finally:
        sys.path.remove(str(ROOT / "bench"))
    lines = ncu_table.table(_NCU_CSV).splitlines()
    assert lines[0].startswith("| kernel | time | DRAM |") and len(lines) == 4, lines
    columns = [c for c, _ in ncu_table.METRICS]
    analyse = dict(zip(columns, [c.strip() for c in lines[2].split("|")[2:-1]]))
    join = dict(zip(columns, [c.strip() for c in lines[3].split("|")[2:-1]]))
    assert lines[2].startswith("| _analyse |") and lines[3].startswith("| _decode_join |"), lines
    assert analyse == {"time": "263.10 us", "DRAM": "61.32%", "memory": "-", "SM": "-", "L1 hit": "-", "L2 hit": "-",
                       "occupancy": "88.5%", "registers": "-", "grid": "-", "block": "-"}, analyse
    assert join["time"] == "240.00 us" and join["L1 hit"] == "12.5%" and join["registers"] == "40 register/thread", join
    path = tmp_path / "ncu.csv"
    path.write_text("==PROF== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance Counters\n")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ncu_table.py"), str(path)], capture_output=True, text=True)
    assert r.returncode == 1 and "no ncu CSV header" in r.stderr, r.stderr
