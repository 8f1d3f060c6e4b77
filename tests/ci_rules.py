"""What a CI run (CI set) holds the suite to: a skip other than the allowed ones fails the run, at
collection as at run time, and hypothesis draws the same examples on every run.

A pytest plugin (tests/conftest.py loads it) kept free of torch, so that tests/test_ci_rules.py can
load it into small pytest runs of its own and watch them fail.
"""

from __future__ import annotations

import os

from hypothesis import settings

# A CI failure must reproduce from the commit alone: examples seeded from each test, none replayed
# from a local example database. Recent hypothesis loads a profile like this one by itself when it
# sees CI; registering it here keeps it so whatever version pip installs.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

#: Skip reasons CI accepts (substrings), each with why; every other skip fails a run with CI set, so
#: that a test CI is meant to run cannot pass unnoticed by skipping (a missing tool or data file).
ALLOWED_SKIPS: dict[str, str] = {
    "no CUDA device": "the gpu-marked suite (pytest -m gpu) needs a CUDA device; CI machines have none (docs/GPU.md)",
}

_unexpected: list[str] = []


def _check(report) -> None:
    if not (report.skipped and os.environ.get("CI")) or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(allowed in reason for allowed in ALLOWED_SKIPS):
        _unexpected.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report):
    _check(report)


def pytest_collectreport(report):
    """A module that skips while it is imported (``pytest.importorskip``, ``allow_module_level``)
    reports here, not in pytest_runtest_logreport: its tests are never collected."""
    _check(report)


def pytest_sessionfinish(session, exitstatus):
    # 5 too: a run whose every module skipped at import collected no tests.
    if _unexpected and session.exitstatus in (0, 5):
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if _unexpected:
        terminalreporter.write_line(f"CI: {len(_unexpected)} unexpected skip(s), which fail this run "
                                    "(tests/ci_rules.py ALLOWED_SKIPS):", red=True)
        for line in _unexpected:
            terminalreporter.write_line(f"  {line}")
