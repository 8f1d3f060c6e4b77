"""bench/soak.py: its verdict on made-up samples, and the script itself at a smoke's counts.

The full soak (2,000 calls, 1,000 steps per hook, target under 1 MiB per 1,000) runs in `make
test-long`, a recorded benchmark (docs/bench/2026-11-25-reliability/soak.json): a 64 KiB tensor
kept per all-reduce reads +72-76 MiB per 1,000 calls in the collectives phase and more in DDP
(one all-reduce per bucket, four buckets per step: about 200), while clean runs read between -8
and +0.5 MiB per 1,000.
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
BOUND = 16 << 20  # bytes per 1,000 calls (steps) after warm-up: the bound the verdict test applies


def _soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(300)
def test_soak_smoke(tmp_path):
    """bench/soak.py at a smoke's counts: two ranks (the full soak runs four), 105 calls of the
    collectives' schedule and 30 DDP steps per hook. Open files stay flat after the warm-up on
    every rank (sampled every 5), every rank's results are bit-identical, and the report has every phase; memory is
    not judged here (at these counts the caches are still filling: +10 to +105 MiB per 1,000
    read), but in the full soak, which `make test-long` runs before each release (its slopes
    recorded in docs/PERFORMANCE.md "Soak"). It took 51 s of the suite's CPU at 315 calls and
    150 steps, the counts a memory slope needs."""
    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--nranks", "2", "--calls", "105",
                          "--steps", "30", "--every", "5", "--warmup", "0.5", "--max-slope", "1e15", "--json",
                          str(out)], capture_output=True, text=True, env=env, timeout=280)
    assert out.exists(), res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["nranks"] == 2 and list(report["phases"]) == ["collectives", "ddp-lossless", "ddp-entropy"]
    for name, phase in report["phases"].items():
        assert len(phase["hashes"]) == 2 and len(set(phase["hashes"])) == 1, (name, phase["hashes"])
        for rank, s in enumerate(phase["ranks"]):
            assert s["fitted"] >= 3, (name, rank, s)
            assert s["fd_min"] == s["fd_max"], f"{name} rank {rank}: fds {s['fd_min']}..{s['fd_max']}"
    assert res.returncode == 0 and report["ok"], res.stdout[-3000:] + res.stderr[-3000:]  # memory judged not at all


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
