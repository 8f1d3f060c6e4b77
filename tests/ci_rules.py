"""What a CI run (CI set) holds the suite to, so that nothing passes silently:

- the whole suite runs: no deselection (``-m``, ``-k``, ``--deselect``, ``--ignore``, ``--lf``,
  paths on the command line, anything in PYTEST_ADDOPTS, a plugin's deselection);
- the one skip allowed is a ``gpu``-marked test's for want of CUDA (NO_CUDA, which this plugin
  adds to those tests itself where torch sees no CUDA device); their count is printed and must
  equal the number of ``gpu`` tests collected (none where CUDA is present); any other skip, at
  collection or at run time, fails the run, and every skip reason is printed;
- an xfail (or xpass) fails the run unless its test is listed in XFAILS with the reason;
- hypothesis draws the same examples on every run.

A test module that does not import is a collection error, which fails any pytest run.

A pytest plugin (tests/conftest.py loads it), kept free of torch until a ``gpu`` test is
collected, so that tests/test_ci_rules.py can load it into small pytest runs of its own and watch
them fail. Under pytest-xdist the test processes count what they collected and deselected and
the controlling process, which sees every report, judges.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import settings

# A CI failure must reproduce from the commit alone: examples seeded from each test, none replayed
# from a local example database. Recent hypothesis loads a profile like this one by itself when it
# sees CI; registering it here keeps it so whatever version pip installs.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

#: The reason of the one skip CI accepts: a ``gpu``-marked test on a machine without CUDA.
NO_CUDA = "no CUDA device: the gpu suite runs on a GPU machine (docs/GPU.md)"

#: Tests that may xfail (or xpass) under CI, as ``path::function`` (any parameters), each with why.
XFAILS: dict[str, str] = {}

_state: dict = {"gpu": 0, "tests": 0, "deselected": 0, "allowed": 0, "unexpected": [], "skips": Counter(),
                "worker_counts": []}


def _ci() -> bool:
    return bool(os.environ.get("CI"))


def _cuda_available() -> bool:
    import torch  # only where gpu tests are collected: the suite imports torch anyway
    return torch.cuda.is_available()


def _base(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


# -- in every process that collects (the only one, or each pytest-xdist test process) -----------

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu and not _cuda_available():
        for item in gpu:  # first, so that this reason, and no other, is the one reported
            item.add_marker(pytest.mark.skipif(True, reason=NO_CUDA), append=False)


def pytest_deselected(items):
    _state["deselected"] += len(items)


def pytest_collection_finish(session):
    _state["tests"] = len(session.items)
    _state["gpu"] = sum(1 for item in session.items if item.get_closest_marker("gpu"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().ci_gpu = item.get_closest_marker("gpu") is not None  # travels to xdist's controller


# -- where the reports arrive (the only process, or xdist's controller) --------------------------

def _reason(report) -> str:
    return str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)


def _judge(report) -> None:
    if hasattr(report, "wasxfail"):
        if _base(report.nodeid) not in XFAILS:
            _state["unexpected"].append(f"{report.nodeid}: xfail not listed in XFAILS ({report.wasxfail})")
        return
    if not report.skipped:
        return
    reason = _reason(report).removeprefix("Skipped: ")
    _state["skips"][reason] += 1
    if getattr(report, "ci_gpu", False) and report.when == "setup" and reason == NO_CUDA:
        _state["allowed"] += 1
    else:
        _state["unexpected"].append(f"{report.nodeid}: skipped: {reason}")


def pytest_runtest_logreport(report):
    _judge(report)


def pytest_collectreport(report):
    """A module that skips while it is imported (``pytest.importorskip``, ``allow_module_level``)
    reports here, not in pytest_runtest_logreport: its tests are never collected."""
    _judge(report)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: what a test process collected and deselected."""
    counts = getattr(node, "workeroutput", {}).get("ci_rules")
    if counts:
        _state["worker_counts"].append(counts)


def _selection_problems(config) -> list[str]:
    """Why this run would not run the whole suite."""
    o = config.option
    problems = []
    if os.environ.get("PYTEST_ADDOPTS"):
        problems.append(f"PYTEST_ADDOPTS is set ({os.environ['PYTEST_ADDOPTS']!r})")
    for flag, value in (("-m", getattr(o, "markexpr", "")), ("-k", getattr(o, "keyword", "")),
                        ("--deselect", getattr(o, "deselect", None)), ("--ignore", getattr(o, "ignore", None)),
                        ("--ignore-glob", getattr(o, "ignore_glob", None)), ("--lf", getattr(o, "lf", False)),
                        ("--sw", getattr(o, "stepwise", False))):
        if value:
            problems.append(f"{flag} {value!r} given")
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        problems.append(f"paths given ({' '.join(config.args)}): CI runs the configured testpaths")
    counts = _state["worker_counts"] or [{"tests": _state["tests"], "gpu": _state["gpu"],
                                          "deselected": _state["deselected"]}]
    if any(c["deselected"] for c in counts):
        problems.append(f"{max(c['deselected'] for c in counts)} test(s) deselected")
    return problems


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workeroutput"):  # an xdist test process: the controller judges
        config.workeroutput["ci_rules"] = {k: _state[k] for k in ("tests", "gpu", "deselected")}
        return
    if not _ci():
        return
    counts = _state["worker_counts"] or [{"gpu": _state["gpu"]}]
    gpu = max(c["gpu"] for c in counts)
    _state["gpu_collected"] = gpu
    _state["problems"] = _selection_problems(config)
    expected = 0 if (gpu == 0 or _cuda_available()) else gpu
    if _state["allowed"] != expected:
        _state["problems"].append(f"{_state['allowed']} skip(s) for want of CUDA, {expected} expected "
                                  f"({gpu} gpu test(s) collected)")
    if (_state["unexpected"] or _state["problems"]) and session.exitstatus in (0, 5):
        # 5 too: a run whose every module skipped at import collected no tests.
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workeroutput") or not _ci():
        return
    write = terminalreporter.write_line
    write(f"CI: {_state['allowed']} skip(s) allowed (gpu-marked, {NO_CUDA!r}) of "
          f"{_state.get('gpu_collected', 0)} gpu test(s) collected")
    for reason, n in sorted(_state["skips"].items()):
        write(f"CI: skipped {n}x: {reason}")
    for problem in _state.get("problems", []):
        write(f"CI: not the whole suite or not as counted, which fails this run: {problem}", red=True)
    if _state["unexpected"]:
        write(f"CI: {len(_state['unexpected'])} unexpected skip(s) or xfail(s), which fail this run "
              "(tests/ci_rules.py):", red=True)
        for line in _state["unexpected"]:
            write(f"  {line}")
