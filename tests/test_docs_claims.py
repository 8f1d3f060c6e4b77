"""What README.md, docs/*.md and bench/README.md name exists: every path (a file or folder of the
repository), test (``file::function``, and ``::function`` after it for the same file), flag
(``--flag`` in the ``--help`` of the command it follows, or of one of the project's commands) and
ZIPCCL_ variable (read in zipccl/config.py); the counts of tests they give (README's, and "(N
cases)" after a test's name) against pytest's collection; the format version they say the code
implements; and the files each record of docs/bench names."""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import importlib
import io
import json
import os
import re
import runpy
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

import ci_rules

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
TRACKED = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True,
                         check=True).stdout.split()
#: ZIPCCL_ variables that configure the test suite or the GPU script, not the library, and the files
#: that read them.
TEST_SETTINGS = {"ZIPCCL_FAULT_LOG": ("tests/test_faults.py", "tests/test_dead_rank.py"),
                 "ZIPCCL_STEP_END": ("tests/workers.py", "bench/gpu_check.sh"),
                 "ZIPCCL_COMMIT": ("bench/gpu_check.sh",)}
#: The commands whose flags the docs name: how each is started here, and what names it in a doc.
COMMANDS = {
    "zipccl-perf": ("module", "zipccl.bench.perf"), "python -m zipccl.bench": ("module", "zipccl.bench.perf"),
    "zipccl-codec-bench": ("module", "zipccl.bench.codec"), "python -m zipccl.bench.codec": ("module", "zipccl.bench.codec"),
    "zipccl-netlab": ("module", "zipccl.bench.netlab"), "python -m zipccl.bench.tour": ("module", "zipccl.bench.tour"),
    "python -m zipccl.kernels.aot": ("module", "zipccl.kernels.aot"),
    "torchrun": ("parser", "torch.distributed.run"), "pytest": ("pytest", ""),
    **{f"{p.parent.name}/{p.name}": ("path", str(p)) for d in ("bench", "examples") for p in (ROOT / d).glob("*.py")},
    **{f"bench/{p.name}": ("bash", str(p)) for p in (ROOT / "bench").glob("*.sh")},
}


def _spans() -> list[tuple[str, int, str]]:
    """(doc, line, text) of every inline code span (a line break in one read as a space), link
    target and path or test named in the prose of the docs, outside fenced blocks."""
    out = []
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), doc.read_text(), flags=re.M | re.S)
        prose = r"(?<![\w/`.:-])((?:zipccl|tests|docs|bench|examples|\.ci)/[\w./*{},-]*[\w/*}]|test_\w+\.py::\w+)"
        for pattern in (r"`([^`]+)`", r"\]\(([^)\s]+)\)", prose):
            out += [(doc.name, text.count("\n", 0, m.start()) + 1, re.sub(r"\s*\n\s*", " ", m.group(1)).replace(":: ", "::"))
                    for m in re.finditer(pattern, text) if "://" not in m.group(1)]
    return out


SPANS = _spans()


# ---- paths ----------------------------------------------------------------------------------------------------

EXTENSIONS = r"\.(?:py|md|json|jsonl|sh|png|toml|txt)"
TOP = {t.split("/")[0] for t in TRACKED}
#: File names the docs give that are not the repository's, and what they are.
NOT_OURS = {"bench-results/bench.png": "the plot that make bench writes",
            "analyze_perf_json.py": "nccl-tests' script that reads its JSON",
            "plan.txt": "what bench/gpu_check.sh writes", "steps.txt": "what bench/gpu_check.sh writes",
            **{f"{name}.py": "a removed probe, which bench/README.md says git keeps at ce90e09"
               for name in ("codec_replay", "collective_cpu", "lab_schedules", "lossy_cpu", "gpu_roofline")}}


def _is_path(token: str) -> bool:
    """A path of the repository: a file name with its extension, or a path under one of its
    top-level entries (not ``../shared``, an absolute path or a placeholder)."""
    if not re.fullmatch(r"[\w.*{},/-]+", token) or token.startswith(("../", "/", "~")):
        return False
    return bool(re.search(EXTENSIONS + "$", token)) or "/" in token and token.split("/")[0] in TOP


def _expand(path: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", path)
    return [p for alt in m.group(1).split(",") for p in _expand(path[:m.start()] + alt + path[m.end():])] if m \
        else [path]


def _exists(path: str, doc: str) -> bool:
    """A tracked file or folder at ``path`` from the root, from the doc's folder, or, for a short
    form (``transport/base.py``, ``api.py``), ending a tracked path."""
    path = path.split("#")[0].rstrip("/")
    if doc != "README.md" and not path.startswith(("docs/", "zipccl/", "tests/", "bench/", "examples/")):
        candidates = [path, f"docs/{path}"]
    else:
        candidates = [path]
    for c in candidates:
        c = str(Path(c)).replace("docs/../", "")
        if any(fnmatch.fnmatch(t, c) or t.startswith(c.rstrip("*") + "/") and "*" not in c for t in TRACKED):
            return True
    return any(fnmatch.fnmatch(t, f"*/{path}") or t.startswith(f"{path}/") or f"/{path}/" in f"/{t}"
               for t in TRACKED)


@lru_cache(maxsize=None)
def _bundled() -> frozenset:
    """The files that records of docs/bench hold in one JSON (file name -> contents)."""
    names = set()
    for t in TRACKED:
        if t.startswith("docs/bench/") and t.endswith(".json"):
            data = json.loads((ROOT / t).read_text())
            if isinstance(data, dict):
                names |= {f"{Path(t).parent}/{k}" for k in data if re.search(EXTENSIONS + "$", k)}
    return frozenset(names)


def test_every_path_named_exists():
    named = [(doc, n, p) for doc, n, span in SPANS for p in _expand(span.strip()) if _is_path(p) and p not in NOT_OURS]
    assert len(named) > 150, len(named)  # the docs do name paths: the parser found them
    missing = [f"{doc}:{n}: {p}" for doc, n, p in named
               if not _exists(p, doc) and not any(fnmatch.fnmatch(k, p if "/" in p else f"*/{p}") for k in _bundled())]
    assert not missing, "\n".join(missing)


# ---- tests ----------------------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _test_functions(file: str) -> frozenset:
    """The test functions pytest collects from tests/``file``: ``test_*`` at module level and in
    ``Test*`` classes."""
    path = ROOT / "tests" / file
    if not path.exists():
        return frozenset()
    tree = ast.parse(path.read_text())
    names = {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
    for cls in (c for c in tree.body if isinstance(c, ast.ClassDef) and c.name.startswith("Test")):
        names |= {f"{cls.name}::{f.name}" for f in cls.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
    return frozenset(names)


def test_every_test_named_exists():
    named, last = [], {}
    for doc, n, span in SPANS:
        for m in re.finditer(r"(?:tests/)?(test_\w+\.py)?::(\w+(?:::\w+)?)", span):
            file = m.group(1) or last.get(doc)
            last[doc] = file
            named.append((doc, n, file, m.group(2)))
        for m in re.finditer(r"(?:tests/)?(test_\w+\.py)(?!::)", span):
            last[doc] = m.group(1)
            if not (ROOT / "tests" / m.group(1)).exists():
                named.append((doc, n, m.group(1), None))
    assert len(named) > 60, len(named)
    missing = [f"{doc}:{n}: {file}::{fn}" for doc, n, file, fn in named
               if file is None or (fn not in _test_functions(file) if fn else True)]
    assert not missing, "\n".join(missing)


def _collected(session: pytest.Session) -> tuple[str, ...]:
    """The node ids of the whole suite: this session's own where it collected all of it (every test
    file, nothing deselected: what `make test` runs), else what ``pytest --collect-only`` lists
    (outside CI's rules), which costs a second collection of the suite (about 15 s of CPU)."""
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py")}
    if not ci_rules._state["deselected"] and files <= {item.nodeid.split("::")[0] for item in session.items}:
        return tuple(item.nodeid for item in session.items)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return tuple(line for line in run.stdout.splitlines() if "::" in line)


def test_the_counts_of_tests_the_docs_give_are_the_suites(request):
    """README's count of tests, and each "`test` (N cases)" in the docs, against what pytest collects."""
    ids = _collected(request.session)
    told = re.search(r"\(([\d,]+) tests, two processes\)", (ROOT / "README.md").read_text())
    assert told and int(told[1].replace(",", "")) == len(ids), (told and told[1], len(ids))
    claims = [(doc.name, m[1], m[2], int(m[3].replace(",", ""))) for doc in DOCS
              for m in re.finditer(r"`(?:tests/(test_\w+\.py))?(?:::)?(test_\w+)` \(([\d,]+) (?:[\w-]+ )?cases",
                                   doc.read_text())]
    assert len(claims) >= 2, claims  # the pattern finds the docs' claims
    wrong = [(doc, name, n, got) for doc, file, name, n in claims
             if n != (got := sum(1 for i in ids if i.split("::")[-1].split("[")[0] == name
                                 and (not file or i.startswith(f"tests/{file}::"))))]
    assert not wrong, wrong


# ---- flags ----------------------------------------------------------------------------------------------------

def _help_of(kind: str, target: str, *args: str) -> str:
    if kind == "pytest":  # without this suite's conftest, which imports torch: its plugins add no flag
        return subprocess.run([sys.executable, "-m", "pytest", "--noconftest", "--help"], capture_output=True,
                              text=True, cwd=ROOT, timeout=120).stdout
    if kind == "parser":
        return importlib.import_module(target).get_args_parser().format_help()
    if kind == "bash":
        return subprocess.run(["bash", target, *args, "--help"], capture_output=True, text=True, timeout=60).stdout
    out, argv = io.StringIO(), sys.argv
    sys.argv = [target, *args, "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            (runpy.run_module if kind == "module" else runpy.run_path)(target, run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


@lru_cache(maxsize=None)
def _flags(command: str) -> frozenset:
    """The long flags in ``command``'s --help, its subcommands' included."""
    kind, target = COMMANDS[command]
    text = _help_of(kind, target)
    for sub in re.findall(r"\{([\w,-]+)\}", text)[:1]:
        text += "".join(_help_of(kind, target, s) for s in sub.split(","))
    return frozenset(re.findall(r"(--[a-zA-Z][\w-]*)", text))


def test_every_flag_named_is_in_its_commands_help():
    named = []
    for doc, n, span in SPANS:
        flags = [(m.start(), m.group(1)) for m in re.finditer(r"(?:^|\s)(--[a-zA-Z][\w-]*)", span)]
        if not flags:
            continue
        at = sorted((m.start(), c) for c in COMMANDS for m in re.finditer(re.escape(c) + r"(?=\s|$)", span))
        at += [(m.start(), None) for m in re.finditer(r"\s--(?=\s)", span)]  # after "--": another program's
        at.sort(key=lambda a: a[0])
        for pos, flag in flags:
            before = [c for start, c in at if start < pos]
            named.append((doc, n, flag, before[-1] if before else None))
    assert len(named) > 50, len(named)
    everything = frozenset().union(*(_flags(c) for c in COMMANDS))
    missing = [f"{doc}:{n}: {flag}" + (f" ({command} --help)" if command else "")
               for doc, n, flag, command in named if flag not in (_flags(command) if command else everything)]
    assert not missing, "\n".join(missing)


# ---- environment variables ---------------------------------------------------------------------------------

def test_every_zipccl_variable_named_is_read_in_config():
    named = {(doc.name, v) for doc in DOCS for v in re.findall(r"\b(ZIPCCL_[A-Z0-9_]*[A-Z0-9])\b", doc.read_text())}
    assert len({v for _, v in named}) > 8, named
    config = (ROOT / "zipccl" / "config.py").read_text()
    read = set(re.findall(r"\"(ZIPCCL_[A-Z0-9_]+)\"", config))
    for var, files in TEST_SETTINGS.items():
        assert all(var in (ROOT / f).read_text() for f in files), var
    missing = sorted(f"{doc}: {v}" for doc, v in named if v not in read and v not in TEST_SETTINGS)
    assert not missing, "\n".join(missing)


# ---- sections ----------------------------------------------------------------------------------------------

def test_every_section_cited_exists():
    """``docs/X.md, "Section"`` and ``(see "Section")`` name a heading of that page (or of the same
    page), or a paragraph's bold title: the title, or the start of it."""
    def titles(page: Path) -> list[str]:
        text = page.read_text()
        return [t.strip() for t in re.findall(r"^#+\s+(.+)$", text, re.M) + re.findall(r"\*\*([^*]+)\*\*", text)]

    cited = []
    for doc in DOCS:
        text = re.sub(r"\s*\n\s*", " ", doc.read_text())
        for m in re.finditer(r"(?:([\w./-]*\b[A-Z]+\.md),?:?\s+|\bsee\s+)\"([^\"]{3,80})\"", text):
            page = next((p for p in (ROOT / (m.group(1) or ""), doc.parent / (m.group(1) or ""), ROOT / "docs" / (m.group(1) or ""))
                         if m.group(1) and p.is_file()), doc)
            cited.append((doc.name, page, m.group(2)))
    assert len(cited) > 10, cited
    missing = [f"{doc}: {page.relative_to(ROOT)} \"{title}\"" for doc, page, title in cited
               if not any(t.startswith(title) for t in titles(page))]
    assert not missing, "\n".join(missing)


# ---- records --------------------------------------------------------------------------------------------------

def _git_files(commit: str, folder: str) -> list[str] | None:
    """The files under ``folder`` at ``commit``, or None where this clone lacks the commit (shallow)."""
    r = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", commit, folder + "/"],
                       capture_output=True, text=True)
    return r.stdout.split() if r.returncode == 0 else None


def test_every_file_a_record_names_is_kept():
    """A record's README names its files in code spans (``lab.json``, ``codec_*.json``): each is in
    its folder (or a folder below), in its folder's bundled JSON, elsewhere in the repository, or,
    where the README says they "stay in git at" a commit, in its folder at that commit."""
    missing, checked = [], 0
    for t in (t for t in TRACKED if re.fullmatch(r"docs/bench/[^/]+/README\.md", t)):
        folder, text = str(Path(t).parent), (ROOT / t).read_text()
        kept = re.search(r"stays?\s+in\s+git\s+at\s+([0-9a-f]{7,40})", text)
        files = [f for f in TRACKED + sorted(_bundled()) + (_git_files(kept.group(1), folder) or [] if kept else [])
                 if f.startswith(folder + "/")]
        for m in re.finditer(r"`([^`]+)`", text):
            for name in (n.strip("(),;:'\"") for n in m.group(1).split()):
                if not re.fullmatch(r"[\w.*{},-]+" + EXTENSIONS, name) or name.isupper() or name.startswith("FILE."):
                    continue  # a path from the root (checked with the docs), or a placeholder
                checked += 1
                for one in _expand(name):
                    if not any(fnmatch.fnmatch(f, f"{folder}/{one}") or fnmatch.fnmatch(f, f"{folder}/*/{one}")
                               for f in files) and not any(f.endswith("/" + one) for f in TRACKED):
                        missing.append(f"{t}: {one}")
    assert checked > 30, checked  # the records do name their files: the parser found them
    assert not missing, "\n".join(sorted(set(missing)))


def test_records_stay_small_and_cited():
    """docs/bench keeps one current record per area and the history the docs cite: under 1 MB and
    100 files in all, and every record folder named by README.md or a page of docs/ (git keeps the
    rest)."""
    records = [t for t in TRACKED if t.startswith("docs/bench/")]
    size = sum((ROOT / t).stat().st_size for t in records)
    assert 10 < len(records) < 100 and size < 1_000_000, (len(records), size)
    folders = {t.split("/")[2] for t in records if t.count("/") > 2}
    cited = "".join(doc.read_text() for doc in DOCS)
    uncited = sorted(f for f in folders if f not in cited)
    assert not uncited, uncited


def test_the_format_version_the_docs_give_the_code_is_the_codes():
    """docs/FORMAT.md's title and every "implements format version N" name zipccl.format.VERSION."""
    from zipccl import format as F
    claims = [(doc.name, int(m.group(1) or m.group(2))) for doc in DOCS
              for m in re.finditer(r"implements\s+format\s+version\s+(\d+)|^# zipccl packet format, version (\d+)",
                                   doc.read_text(), re.M)]
    assert ("FORMAT.md", F.VERSION) in claims and ("GPU.md", F.VERSION) in claims, claims
    assert all(v == F.VERSION for _, v in claims), claims


def test_no_file_holds_a_machines_paths_or_work_notes():
    """The repository speaks of the software: no tracked text names a machine's home or work
    folders (records give paths relative to the checkout, or $OUT), nor an issue by number."""
    found = []
    patterns = re.compile(r"(?<![\w.$])/(?:root|home|work)/|\bissue [0-9]+", re.I)
    for t in TRACKED:
        path = ROOT / t
        if t == "tests/test_docs_claims.py" or path.suffix in (".png", ".npy", ".tgz", ".gz") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        found += [f"{t}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in patterns.finditer(text)]
    assert not found, "\n".join(found)
