"""pyproject.toml's dependency floors are the versions CI runs: `make setup` installs
.ci/versions.txt's pins, which must be those floors, and under CI the installed versions are
exactly them (the cuda13 extra, which CI does not install, aside)."""

from __future__ import annotations

import os
import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNTESTED_EXTRAS = ("cuda13",)


def _floors() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra, deps in project["optional-dependencies"].items():
        if extra not in UNTESTED_EXTRAS:
            specs += deps
    floors = {}
    for spec in specs:
        m = re.fullmatch(r"([\w.-]+)\s*(>=|==)\s*([\w.]+)", spec)
        assert m, f"{spec!r}: every dependency CI installs has a floor (>=) or a pin (==)"
        floors[m.group(1).lower()] = m.group(3)
    return floors


def _pins() -> dict[str, str]:
    lines = [l.split("#")[0].strip() for l in (ROOT / ".ci" / "versions.txt").read_text().splitlines()]
    return {name.lower(): version for name, version in (l.split("==") for l in lines if l)}


def test_floors_are_the_pinned_versions():
    assert _floors() == _pins()


def test_installed_versions_are_the_pins_under_ci():
    """Under CI (a fresh `make setup`), each is installed at its pin; elsewhere, at least at it."""
    def key(v: str) -> tuple:
        return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:3])
    for name, pin in _pins().items():
        installed = metadata.version(name)
        if os.environ.get("CI"):
            assert key(installed) == key(pin), (name, installed, pin)
        else:
            assert key(installed) >= key(pin), (name, installed, pin)
