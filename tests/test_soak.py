"""bench/soak.py at small counts: memory and open files stay flat over many collectives and DDP steps.

The full soak (2,000 calls, 1,000 steps per hook, target under 1 MiB per 1,000) is a recorded
benchmark (docs/bench/2026-11-25-reliability/soak.json). Here the counts are small, so the bound is
looser than the target but far below a real leak: a 64 KiB tensor kept per all-reduce reads
+72-76 MiB per 1,000 calls in the collectives phase and more in DDP (one all-reduce per bucket,
four buckets per step: about 200), while clean runs read between -8 and +0.5 MiB per 1,000.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BOUND = 16 << 20  # bytes per 1,000 calls (steps) after warm-up


def _soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(400)
def test_soak_small(tmp_path):
    """Two ranks (the full soak runs four), three rounds of the collectives' schedule after the
    unsampled one (315 calls) and 150 DDP steps per hook, fitted past the first half of each
    phase (the collectives' last two rounds; the lossless decoder's caches fill during the first
    50-70 DDP steps): fds flat, memory slope under BOUND on every rank, every rank's results
    bit-identical. With 64 KiB kept per all-reduce (--leak 65536) every phase fails on both ranks
    (+80 MiB per 1,000 in the collectives, +200 in DDP)."""
    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--nranks", "2", "--calls", "315", "--steps", "150",
                          "--warmup", "0.5", "--max-slope", str(BOUND), "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=380)
    assert out.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["nranks"] == 2 and list(report["phases"]) == ["collectives", "ddp-lossless", "ddp-entropy"]
    for name, phase in report["phases"].items():
        assert len(set(phase["hashes"])) == 1, (name, phase["hashes"])
        for rank, s in enumerate(phase["ranks"]):
            assert s["fitted"] >= 7, (name, rank, s)
            assert s["fd_min"] == s["fd_max"], f"{name} rank {rank}: fds {s['fd_min']}..{s['fd_max']}"
            assert s["slope_bytes_per_1000"] < BOUND, \
                f"{name} rank {rank}: {s['slope_bytes_per_1000'] / 2**20:.1f} MiB per 1,000 after warm-up"
    assert res.returncode == 0 and report["ok"], res.stdout[-3000:] + res.stderr[-3000:]


def test_verdict_catches_a_leak():
    """The fit and verdict on made-up samples: the collectives' within-round pattern (+-3 MiB, as
    measured) passes, the same with 64 KiB kept per call fails, and so does a growing fd count."""
    soak = _soak()
    pattern = [3 << 20 if (i % soak.ROUND) < soak.ROUND // 2 else -(3 << 20) for i in range(soak.ROUND)]

    def phase(leak_per_call: int, fd_at: int | None = None) -> dict:
        calls = list(range(10, 315, 10)) + [315]  # as bench/soak.py --calls 315 samples them
        samples = [(c, (500 << 20) + pattern[(c - 1) % soak.ROUND] + leak_per_call * c,
                    30 + (fd_at is not None and c >= fd_at), 0.0, 0, 0, 0) for c in calls]
        return dict(ranks=[soak.summarize(samples, 0.5, soak.ROUND, soak.ROUND)], hashes=["a"])

    assert soak.verdict(phase(0), BOUND) == []
    assert any("memory grows" in m for m in soak.verdict(phase(64 << 10), BOUND))
    assert any("open fds" in m for m in soak.verdict(phase(0, fd_at=300), BOUND))
    assert any("different results" in m for m in soak.verdict(dict(ranks=[], hashes=["a", "b"]), BOUND))
