"""Under CI nothing passes silently: real pytest runs of small test modules with the suite's own
plugins (tests/ci_rules.py, tests/triton_mode.py), each seen to fail where a rule is broken: an
unexpected skip (at import or at run time), a skip for want of CUDA that is not a gpu test's or
that the count contradicts, any deselection, an unlisted xfail, a module that does not import."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ci_rules

HERE = Path(__file__).resolve().parent
INI = "[pytest]\nmarkers =\n    gpu: needs a CUDA device\n"


def _pytest(tmp_path: Path, modules: dict[str, str], *args: str, ci: bool = True, workers: int = 0,
            env: dict | None = None, conftest: str = "") -> subprocess.CompletedProcess:
    """pytest on `modules` (file name -> source) in tmp_path, no paths given, with the plugins that
    tests/conftest.py loads; ``workers``: in that many pytest-xdist processes, as `make test` runs
    the suite; ``conftest``: more source for the example's conftest.py."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "pytest.ini").write_text(INI)
    (tmp_path / "conftest.py").write_text(conftest + 'pytest_plugins = ("ci_rules", "triton_mode")\n')
    for name, source in modules.items():
        (tmp_path / name).write_text(source)
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    base["PYTHONPATH"] = str(HERE) + os.pathsep + base.get("PYTHONPATH", "")
    base["CUDA_VISIBLE_DEVICES"] = ""  # no CUDA, also on a GPU machine
    if ci:
        base["CI"] = "1"
    base.update(env or {})
    spread = ["-n", str(workers), "--dist", "loadfile"] if workers else []
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *spread, *args],
                          cwd=tmp_path, env=base, capture_output=True, text=True, timeout=120)


def _fails(out: subprocess.CompletedProcess, *phrases: str) -> None:
    assert out.returncode == 1, out.stdout + out.stderr
    for phrase in phrases:
        assert phrase in out.stdout, (phrase, out.stdout)


PASSING = "def test_passes():\n    assert 1 + 1 == 2\n"
IMPORTORSKIP = ('import pytest\npytest.importorskip("zipccl_no_such_module", reason="no_such_module is missing")\n'
                "def test_never_collected():\n    pass\n")
MODULE_SKIP = ('import pytest\npytest.skip("the tool is not installed", allow_module_level=True)\n'
               "def test_never_collected():\n    pass\n")
SKIP_IN_TEST = 'import pytest\ndef test_skips():\n    pytest.skip("data file not found")\n'
GPU = "import pytest\npytestmark = pytest.mark.gpu\ndef test_on_gpu():\n    pass\ndef test_on_gpu_too():\n    pass\n"
NO_CUDA_SKIP = f"import pytest\n@pytest.mark.skipif(True, reason={ci_rules.NO_CUDA!r})\ndef test_not_gpu_marked():\n    pass\n"


@pytest.mark.parametrize("workers", [0, 2], ids=["one process", "xdist"])
def test_skips_at_import_and_in_a_test_fail_ci(tmp_path, workers):
    out = _pytest(tmp_path, {"test_importorskip.py": IMPORTORSKIP, "test_module_skip.py": MODULE_SKIP,
                             "test_skips.py": SKIP_IN_TEST, "test_ok.py": PASSING}, workers=workers)
    _fails(out, "1 passed, 3 skipped", "CI: 3 unexpected skip(s)")
    report = out.stdout.split("CI: 3 unexpected skip(s)")[-1]
    assert "test_importorskip.py" in report and "no_such_module is missing" in report, out.stdout
    assert "test_module_skip.py" in report and "the tool is not installed" in report, out.stdout
    assert "test_skips.py::test_skips: skipped: data file not found" in report, out.stdout
    assert "CI: skipped 1x: data file not found" in out.stdout, out.stdout  # every reason printed


def test_only_skips_at_import_fail_ci(tmp_path):
    """No test collected (pytest's exit 5) is still reported as the unexpected skip it is."""
    _fails(_pytest(tmp_path, {"test_skips.py": MODULE_SKIP}), "CI: 1 unexpected skip(s)", "the tool is not installed")


def test_gpu_tests_skip_for_want_of_cuda_alone_and_counted(tmp_path):
    """Without CUDA the plugin skips every gpu-marked test with NO_CUDA, whatever skip of its own
    the test has; CI accepts those, counted against the gpu tests collected."""
    own_skip = 'import pytest\n@pytest.mark.gpu\n@pytest.mark.skipif(True, reason="needs 2 GPUs")\ndef test_two():\n    pass\n'
    out = _pytest(tmp_path, {"test_gpu.py": GPU, "test_gpu_own_skip.py": own_skip, "test_ok.py": PASSING},
                  workers=2)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 3 skipped" in out.stdout and "unexpected" not in out.stdout, out.stdout
    assert "CI: 3 skip(s) allowed (gpu-marked" in out.stdout and "of 3 gpu test(s) collected" in out.stdout, out.stdout
    assert f"CI: skipped 3x: {ci_rules.NO_CUDA}" in out.stdout, out.stdout


def test_the_no_cuda_reason_on_a_test_not_gpu_marked_fails_ci(tmp_path):
    _fails(_pytest(tmp_path, {"test_not_gpu.py": NO_CUDA_SKIP, "test_ok.py": PASSING}),
           "CI: 1 unexpected skip(s)", "test_not_gpu_marked: skipped: no CUDA device")


def test_a_gpu_test_skipping_for_another_reason_fails_ci(tmp_path):
    """Only the skip at set-up for want of CUDA is allowed: not a gpu test's skip inside its body,
    nor a gpu module's at import."""
    in_body = 'import pytest\n@pytest.mark.gpu\ndef test_body():\n    pytest.skip("not enough GPUs")\n'
    at_import = f"import pytest\npytest.skip({ci_rules.NO_CUDA!r}, allow_module_level=True)\n"
    out = _pytest(tmp_path, {"test_gpu_body.py": in_body, "test_gpu_import.py": at_import, "test_ok.py": PASSING},
                  conftest="import torch\ntorch.cuda.is_available = lambda: True  # a GPU machine\n")
    _fails(out, "CI: 2 unexpected skip(s)", "test_body: skipped: not enough GPUs", "test_gpu_import.py: skipped")


def test_a_skip_for_want_of_cuda_where_cuda_is_present_fails_ci(tmp_path):
    """Where torch sees CUDA no gpu test may skip: the count of allowed skips must be 0."""
    own = f"import pytest\n@pytest.mark.gpu\n@pytest.mark.skipif(True, reason={ci_rules.NO_CUDA!r})\ndef test_g():\n    pass\n"
    out = _pytest(tmp_path, {"test_gpu.py": own, "test_ok.py": PASSING},
                  conftest="import torch\ntorch.cuda.is_available = lambda: True  # a GPU machine\n")
    _fails(out, "1 skip(s) for want of CUDA, 0 expected (1 gpu test(s) collected)")


@pytest.mark.parametrize("args,env,phrase", [
    (["-m", "not gpu"], {}, "-m 'not gpu' given"),
    (["-k", "passes"], {}, "-k 'passes' given"),
    (["--deselect", "test_two.py::test_other"], {}, "--deselect"),
    (["--ignore", "test_two.py"], {}, "--ignore"),
    ([], {"PYTEST_ADDOPTS": "-k passes"}, "PYTEST_ADDOPTS is set ('-k passes')"),
    (["test_ok.py"], {}, "paths given (test_ok.py)"),
], ids=["-m", "-k", "--deselect", "--ignore", "PYTEST_ADDOPTS", "a path"])
def test_a_deselection_fails_ci(tmp_path, args, env, phrase):
    two = PASSING + "def test_other():\n    pass\n"
    _fails(_pytest(tmp_path, {"test_ok.py": PASSING, "test_two.py": two}, *args, env=env), phrase)


def test_a_deselection_in_test_processes_fails_ci(tmp_path):
    """Under pytest-xdist the test processes deselect; the controller hears of it and fails the run."""
    _fails(_pytest(tmp_path, {"test_ok.py": PASSING, "test_two.py": PASSING + "def test_other():\n    pass\n"},
                   workers=2, conftest="def pytest_collection_modifyitems(config, items):\n"
                                       "    drop = [i for i in items if i.name == 'test_other']\n"
                                       "    items[:] = [i for i in items if i not in drop]\n"
                                       "    config.hook.pytest_deselected(items=drop)\n"),
           "1 test(s) deselected")


XFAIL = 'import pytest\n@pytest.mark.xfail(reason="known", strict=False)\ndef test_known():\n    assert False\n'


def test_an_unlisted_xfail_fails_ci(tmp_path):
    xpass = 'import pytest\n@pytest.mark.xfail(reason="flaky", strict=False)\ndef test_lucky():\n    pass\n'
    _fails(_pytest(tmp_path, {"test_xfail.py": XFAIL, "test_xpass.py": xpass, "test_ok.py": PASSING}),
           "CI: 2 unexpected skip(s) or xfail(s)", "test_known: xfail not listed", "test_lucky: xfail not listed")


def test_a_listed_xfail_passes_ci(tmp_path):
    out = _pytest(tmp_path, {"test_xfail.py": XFAIL, "test_ok.py": PASSING},
                  conftest='import ci_rules\nci_rules.XFAILS["test_xfail.py::test_known"] = "why"\n')
    assert out.returncode == 0 and "1 passed, 1 xfailed" in out.stdout, out.stdout + out.stderr


def test_listed_xfails_are_xfail_marked_tests():
    for name in ci_rules.XFAILS:
        path, function = name.split("::")
        tree = ast.parse((HERE.parent / path).read_text())
        found = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == function]
        assert found and any("xfail" in ast.unparse(d) for d in found[0].decorator_list), name


def test_a_module_that_does_not_import_fails(tmp_path):
    broken = "import zipccl_no_such_module\ndef test_never():\n    pass\n"
    out = _pytest(tmp_path, {"test_broken.py": broken, "test_ok.py": PASSING}, workers=2)
    assert out.returncode not in (0, 5), out.stdout + out.stderr
    assert "ModuleNotFoundError" in out.stdout and "zipccl_no_such_module" in out.stdout, out.stdout


def test_skips_pass_without_ci(tmp_path):
    out = _pytest(tmp_path, {"test_skips.py": MODULE_SKIP, "test_ok.py": PASSING}, "-k", "passes", ci=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 1 skipped" in out.stdout and "CI:" not in out.stdout, out.stdout


def test_the_suite_loads_the_plugins(request):
    """tests/conftest.py points at the plugins tested here, so the checks hold for this suite."""
    import triton_mode
    assert request.config.pluginmanager.get_plugin("ci_rules") is ci_rules
    assert request.config.pluginmanager.get_plugin("triton_mode") is triton_mode


def test_compiled_cases_run_without_the_interpreter(tmp_path):
    """A test that takes the ``compiled`` fixture runs in a pytest of its own with
    TRITON_INTERPRET=0 while the test process interprets; its failure and skip are the test's."""
    source = ("import os, pytest\n"
              "def test_interpreted():\n    assert os.environ['TRITON_INTERPRET'] == '1'\n"
              "def test_compiled(compiled):\n    assert os.environ['TRITON_INTERPRET'] == '0'\n"
              "def test_compiled_fails(compiled):\n    assert 2 + 2 == 5, 'arithmetic on the GPU'\n"
              "def test_compiled_skips(compiled):\n    pytest.skip('a reason of the compiled run')\n")
    out = _pytest(tmp_path, {"test_kernels.py": source}, ci=False)
    assert out.returncode == 1, out.stdout + out.stderr
    failure = out.stdout.split("test_compiled_fails _", 1)[-1]
    assert "compiled (TRITON_INTERPRET=0" in failure and "arithmetic on the GPU" in failure, out.stdout
    assert "1 failed, 2 passed, 1 skipped" in out.stdout and "a reason of the compiled run" in out.stdout, out.stdout


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


def test_ci_refuses_pytest_addopts_that_could_switch_its_rules_off(tmp_path):
    """`-p no:ci_rules` in PYTEST_ADDOPTS would unload the plugin that objects to PYTEST_ADDOPTS:
    .ci/run refuses the variable before it starts the suite (here a `make` that records its call)."""
    (tmp_path / "make").write_text(f"#!/bin/sh\ntouch {tmp_path / 'made'}\n")
    (tmp_path / "make").chmod(0o755)
    env = dict(os.environ, PYTEST_ADDOPTS="-p no:ci_rules", PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["bash", str(HERE.parent / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "PYTEST_ADDOPTS is set (-p no:ci_rules)" in out.stderr, out
    assert not (tmp_path / "made").exists()
