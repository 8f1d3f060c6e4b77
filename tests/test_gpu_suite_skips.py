"""Without CUDA, every test of the gpu suite skips, and for want of CUDA alone (conftest.py lets CI
accept only that reason): none is skipped for want of GPUs, TRITON_INTERPRET or anything else."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ci_rules import ALLOWED_SKIPS

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_every_gpu_test_skips_for_want_of_cuda(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")  # no CUDA, also on a GPU machine
    env.pop("CI", None)
    report = tmp_path / "gpu.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                        f"--junit-xml={report}", "tests"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cases = ET.parse(report).getroot().iter("testcase")
    reasons = {f"{c.get('classname')}.{c.get('name')}": [s.get("message", "") for s in c.iter("skipped")]
               for c in cases}
    files = {name.split(".")[1] for name in reasons}
    assert {"test_nccl_gpu", "test_gpu_lab"} <= files, sorted(reasons)
    assert len(reasons) >= 20, sorted(reasons)
    assert "no CUDA device" in ALLOWED_SKIPS
    for name, skipped in reasons.items():
        assert len(skipped) == 1 and "no CUDA device" in skipped[0] and "GPUs" not in skipped[0], (name, skipped)
