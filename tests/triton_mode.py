"""Where the suite runs Triton: in its interpreter for the kernel tests on CPU tensors (every
machine), compiled for the tests that take the ``compiled`` fixture (a GPU machine).

Triton decides between the two when a kernel is decorated, once per process, so the test
processes interpret (TRITON_INTERPRET=1, set here before zipccl.kernels.gpu is imported) and
each ``compiled`` test runs in a pytest of its own without the interpreter, whose outcome
(passed, failed with its report, skipped with its reason) becomes the test's. A pytest plugin
(tests/conftest.py loads it); tests/test_ci_rules.py runs it on small examples.

Triton's interpreter, by default, computes an overflow check for every 32-bit integer add,
subtract and multiply (its ``sanitize_overflow`` option) and asserts none of them (its asserts
need ``debug``): a third of an interpreted decode's time for nothing. The kernels' 32-bit
arithmetic is bounded by design (docs/GPU.md): the tests marked ``overflow_checked``, which
drive it to its bounds (the largest block, the longest codes, every bit pattern, hostile
packets, an input changed under the encoder), run with both options, so that an overflow fails
them; the others, whose inputs stay inside those bounds, with neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def overflow_checks(on: bool):
    """Within: the interpreter's overflow checks computed and asserted (``on``), or neither. On,
    ``torch.empty`` fills what it returns with 0x7F bytes, so that arithmetic on memory no kernel
    wrote overflows every time, not only when the allocator hands out such bytes."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # the tests that need Triton skip (pytest.importorskip)
        yield
        return
    import torch
    builder = interpreter.interpreter_builder
    before, empty = builder.options, torch.empty
    builder.options = dataclasses.replace(before, sanitize_overflow=on, debug=on)
    if on:
        torch.empty = lambda *args, **kwargs: _filled(empty(*args, **kwargs))
    try:
        yield
    finally:
        builder.options, torch.empty = before, empty


def _filled(t):
    import torch
    if t.is_contiguous() and t.numel():
        t.view(-1).view(torch.uint8).fill_(0x7F)
    return t


@pytest.fixture(autouse=True)
def _interpreter_overflow_checks(request):
    """The interpreter's overflow checks, asserted, for a test marked ``overflow_checked``; none
    for the others (a rank of a multi-process test: ``overflow_checks(False)`` in its function).
    A process that has not imported Triton is left so: importing it (and torch) costs seconds."""
    marked = request.node.get_closest_marker("overflow_checked") is not None
    if not marked and "triton.runtime.interpreter" not in sys.modules:
        yield
        return
    with overflow_checks(marked):
        yield


@pytest.fixture
def compiled():
    """The Triton kernels compiled for the GPU, not interpreted: where this process interprets,
    pytest_pyfunc_call below runs the test in a pytest of its own that does not."""


def _outcome(report: Path) -> tuple[str, str]:
    """("passed" | "failed" | "skipped", message) of the one test case of a junit report."""
    cases = list(ET.parse(report).getroot().iter("testcase"))
    if len(cases) != 1:
        return "failed", f"{len(cases)} test cases reported, 1 expected"
    for kind in ("failure", "error", "skipped"):
        for element in cases[0].iter(kind):
            return ("skipped" if kind == "skipped" else "failed"), element.get("message", "")
    return "passed", ""


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if "compiled" not in pyfuncitem.fixturenames or os.environ.get("TRITON_INTERPRET") != "1":
        return None
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS") and not k.startswith("PYTEST_XDIST")}
    env["TRITON_INTERPRET"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junit-xml={report}",
                              pyfuncitem.nodeid], cwd=pyfuncitem.config.rootpath, env=env, capture_output=True,
                             text=True)
        kind, message = _outcome(report) if report.exists() else ("failed", "no report")
    if kind == "skipped":
        pytest.skip(message)
    if kind == "failed" or run.returncode != 0:
        pytest.fail(f"compiled (TRITON_INTERPRET=0, in a pytest of its own): {message}\n"
                    f"{run.stdout[-6000:]}{run.stderr[-3000:]}", pytrace=False)
    return True
