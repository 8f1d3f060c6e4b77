"""Under CI an unexpected skip fails the run, a module skipped at import included, and hypothesis
draws the same examples every run: real pytest runs of small test modules with the suite's own CI
plugin (tests/ci_rules.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _pytest(tmp_path: Path, modules: dict[str, str], ci: bool = True, workers: int = 0) -> subprocess.CompletedProcess:
    """pytest on `modules` (file name -> source) in tmp_path, with the plugin that tests/conftest.py
    loads; ``workers``: in that many pytest-xdist processes, as `make test` runs the suite."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ("ci_rules",)\n')
    for name, source in modules.items():
        (tmp_path / name).write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
    if ci:
        env["CI"] = "1"
    spread = ["-n", str(workers), "--dist", "loadfile"] if workers else []
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *spread,
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


PASSING = "def test_passes():\n    assert 1 + 1 == 2\n"
IMPORTORSKIP = ('import pytest\npytest.importorskip("zipccl_no_such_module", reason="no_such_module is missing")\n'
                "def test_never_collected():\n    pass\n")
MODULE_SKIP = ('import pytest\npytest.skip("the tool is not installed", allow_module_level=True)\n'
               "def test_never_collected():\n    pass\n")


@pytest.mark.parametrize("workers", [0, 2], ids=["one process", "xdist"])
def test_skips_at_import_fail_ci(tmp_path, workers):
    out = _pytest(tmp_path, {"test_importorskip.py": IMPORTORSKIP, "test_module_skip.py": MODULE_SKIP,
                             "test_ok.py": PASSING}, workers=workers)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 passed, 2 skipped" in out.stdout, out.stdout
    report = out.stdout.split("CI: 2 unexpected skip(s)")[-1]
    assert "test_importorskip.py" in report and "no_such_module is missing" in report, out.stdout
    assert "test_module_skip.py" in report and "the tool is not installed" in report, out.stdout


def test_only_skips_at_import_fail_ci(tmp_path):
    """No test collected (pytest's exit 5) is still reported as the unexpected skip it is."""
    out = _pytest(tmp_path, {"test_skips.py": MODULE_SKIP})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "CI: 1 unexpected skip(s)" in out.stdout and "the tool is not installed" in out.stdout, out.stdout


@pytest.mark.parametrize("workers", [0, 2], ids=["one process", "xdist"])
def test_skip_in_a_test_fails_ci(tmp_path, workers):
    source = 'import pytest\ndef test_skips():\n    pytest.skip("data file not found")\n'
    out = _pytest(tmp_path, {"test_skips.py": source, "test_ok.py": PASSING}, workers=workers)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "CI: 1 unexpected skip(s)" in out.stdout and "data file not found" in out.stdout, out.stdout


def test_allowed_skips_pass_ci(tmp_path):
    """The gpu-marked tests' "no CUDA device", at import and at run time, and an xfail, leave CI green."""
    at_import = 'import pytest\npytest.skip("no CUDA device here", allow_module_level=True)\n'
    at_run = ('import pytest\n@pytest.mark.skipif(True, reason="no CUDA device (docs/GPU.md)")\n'
              "def test_gpu():\n    pass\n"
              '@pytest.mark.xfail(reason="known", strict=True)\ndef test_xfail():\n    assert False\n')
    out = _pytest(tmp_path, {"test_gpu_module.py": at_import, "test_gpu_marked.py": at_run, "test_ok.py": PASSING})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 2 skipped, 1 xfailed" in out.stdout and "unexpected skip" not in out.stdout, out.stdout


def test_skips_pass_without_ci(tmp_path):
    out = _pytest(tmp_path, {"test_skips.py": MODULE_SKIP, "test_ok.py": PASSING}, ci=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 1 skipped" in out.stdout, out.stdout


def test_suite_loads_the_plugin(request):
    """tests/conftest.py points at the plugin tested above, so the checks hold for this suite."""
    import ci_rules
    assert request.config.pluginmanager.get_plugin("ci_rules") is ci_rules


DRAWS = ("from hypothesis import given, strategies as st\n"
         "@given(st.integers(0, 2**62))\n"
         "def test_draws(x):\n"
         "    with open('draws.txt', 'a') as f:\n"
         "        f.write(f'{x}\\n')\n")


def test_hypothesis_derandomized_in_ci(tmp_path):
    draws = []
    for run in range(2):
        out = _pytest(tmp_path / str(run), {"test_draws.py": DRAWS})
        assert out.returncode == 0, out.stdout + out.stderr
        draws.append((tmp_path / str(run) / "draws.txt").read_text().split())
    assert len(draws[0]) > 10 and draws[0] == draws[1]
