"""zipccl.kernels.launch's direct launches against Triton's own, without a GPU: the codec's calls
run against a stand-in CUDA driver (tests/fake_cuda.py) whose launchers record what each launch
passes, with CI's Triton and with the CUDA image's (3.6.0, in build/ from `make setup`). A direct
launch must pass what Triton's own launch passes for the same call (the same compiled kernel,
grid, stream, function, metadata and arguments), and once a call's argument properties were
seen, make no call of Triton's launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("triton", reason="triton not installed (pip install zipccl[gpu]); .ci/run installs it")
from test_triton import image_triton  # noqa: E402


def _rounds(triton_path: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    first = [str(triton_path)] if triton_path is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*first, str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "fake_cuda.py")], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("which", ["installed", "image"])
def test_direct_launches_pass_what_tritons_own_pass(which):
    rounds = _rounds(None if which == "installed" else image_triton())
    own, first, again = rounds["triton"], rounds["direct, first"], rounds["direct, again"]
    assert set(own) == set(again) and len(own) == 5, sorted(own)
    for call, made in own.items():
        assert len(made["launches"]) == 4 and made["triton_runs"], (call, made)  # each its four kernels
        assert again[call]["triton_runs"] == [], (call, again[call]["triton_runs"])  # all four direct
        for theirs, ours in zip(made["launches"], again[call]["launches"], strict=True):
            # the hooks aside: Triton passes its (empty) chains of launch hooks, a direct launch none
            assert theirs["hooks_run"] == ours["hooks_run"] == 0
            theirs.pop("hooks_run"), ours.pop("hooks_run")
            assert ours == theirs, call
    # A tensor's alignment is part of what Triton specializes: x 2 bytes past a 16-byte boundary
    # takes kernels of its own for _analyse and _encode (which read x), the others' as before; the
    # direct launch's first call of it went through Triton for those two alone.
    aligned, shifted = own["encode_into"]["launches"], own["encode_into, x at 2 bytes past 16"]["launches"]
    differ = [a["kernel"] for a, s in zip(aligned, shifted) if a["compiled"] != s["compiled"]]
    assert differ == ["_analyse", "_encode"], differ
    assert first["encode_into, x at 2 bytes past 16"]["triton_runs"] == ["_analyse", "_encode"]
    # A setting that Triton's key reads, changed (Triton 3.9's): Triton's own launch again, and the
    # kernels it compiles for that setting, not those of before
    if "direct, a setting changed" in rounds:
        changed, theirs = rounds["direct, a setting changed"], rounds["triton, a setting changed"]
        assert changed["triton_runs"] == ["_analyse", "_choose", "_place", "_encode"], changed["triton_runs"]
        assert [x["compiled"] for x in changed["launches"]] == [x["compiled"] for x in theirs["launches"]]
        assert not {x["compiled"] for x in changed["launches"]} & {x["compiled"] for x in aligned}
