"""Settings read from ZIPCCL_* environment variables: parsed here and nowhere else, when zipccl
is imported, and again (those whose variable changed since) by ``refresh``, which every group
the drop-in backend makes calls, as torch reads its own variables when a group is made."""

from __future__ import annotations

import math
import os
import re
import sys

_SETTINGS: dict = {}  # attribute -> (reader, variable, the reader's other arguments, the variable's value read)
_on_refresh: list = []


def _setting(attribute: str, reader, variable: str, *args):
    """``reader(variable, *args)``, remembered for ``refresh`` under ``attribute``."""
    _SETTINGS[attribute] = (reader, variable, args, os.environ.get(variable))
    return reader(variable, *args)


def changed() -> list[str]:
    """The variables whose value in the environment changed since they were last read."""
    return [variable for reader, variable, args, seen in _SETTINGS.values() if os.environ.get(variable) != seen]


def on_refresh(callback) -> None:
    """Call ``callback()`` whenever ``refresh`` changes a setting: what was decided from the
    settings (the collectives' routes) is decided again."""
    _on_refresh.append(callback)


def refresh() -> list[str]:
    """Read again each variable whose value in the environment changed since it was last read,
    and return their names; a setting assigned in code (tests) stays while its variable does not
    change. A bad value raises ValueError naming the variable, as at import, and changes nothing."""
    new = {}
    for attribute, (reader, variable, args, seen) in _SETTINGS.items():
        now = os.environ.get(variable)
        if now != seen:
            new[attribute] = reader(variable, *args), (reader, variable, args, now)
    for attribute, (value, setting) in new.items():
        setattr(sys.modules[__name__], attribute, value)
        _SETTINGS[attribute] = setting
    if new:
        for callback in _on_refresh:
            callback()
    return [setting[1] for _, setting in new.values()]


def _bytes(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be an integer number of bytes") from None
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


#: With ZIPCCL_AUTO_LEARN=0, codec="auto" sends messages smaller than this raw and larger ones
#: lossless (bytes of the input): the measured break-even of lossless vs raw all-reduce at 1 Gbit/s
#: per rank, 4 ranks on 2 cores (docs/bench/netlab_1gbit_sweep_all_reduce.json). By default
#: "auto" instead measures its plans, the backend's own collective among them (zipccl.auto).
AUTO_MIN_BYTES = _setting("AUTO_MIN_BYTES", _bytes, "ZIPCCL_AUTO_MIN_BYTES", 8 << 20)


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} must be one of {', '.join(allowed)}")
    return value


def _flag(name: str, default: str) -> bool:
    return _choice(name, default, ("0", "1")) == "1"


def _text(name: str) -> str | None:
    return os.environ.get(name) or None


#: "1": codec="auto" measures its plans (native, raw, lossless, hierarchical ones) per group and
#: size class and runs the fastest (zipccl.auto); "0": the fixed AUTO_MIN_BYTES threshold between
#: raw and lossless. The same on every rank.
AUTO_LEARN = _setting("AUTO_LEARN", _flag, "ZIPCCL_AUTO_LEARN", "1")


#: Input bytes of a coded pipeline piece (all ranks' chunks of a phase together; zipccl.collectives.
#: pipeline): 0 (default) takes the device's (8 MiB on CPU, 32 MiB on CUDA), at most 16 pieces a
#: phase either way; raw's pieces are at least 16 MiB. The same on every rank (each call checks it).
PIECE_BYTES = _setting("PIECE_BYTES", _bytes, "ZIPCCL_PIECE_BYTES", 0)


#: Reduce-scatter algorithm (every rank must use the same; the metadata exchange checks it):
#: "direct" sends each rank's packet of each chunk to its owner, which decodes them all and
#: reduces them in rank order with fp32 accumulation, rounded once (DESIGN.md invariant 3);
#: "ring" passes re-encoded partial sums around a ring, rounding each hop to the dtype as NCCL
#: does: one flow per link and one direction per pair of ranks, for n-1 encodes per chunk instead of 1.
REDUCE_SCATTER = _setting("REDUCE_SCATTER", _choice, "ZIPCCL_REDUCE_SCATTER", "direct", ("direct", "ring"))


#: Gloo point-to-point payloads travel on two connections per pair of ranks, one per direction
#: (a second gloo group over the same ranks, made on first use: every rank of the job must be in
#: the group). gloo sends a payload only when the receiver's "ready" note arrives, and that note
#: waits behind whatever payload the receiver is itself sending on the shared connection; the
#: 64 MiB all-reduce in the 1 Gbit/s lab: raw 1.17-1.33 s -> 0.88-0.93 s (docs/PERFORMANCE.md).
#: "0" keeps one connection per pair (the group's own).
SPLIT_DIRECTIONS = _setting("SPLIT_DIRECTIONS", _flag, "ZIPCCL_SPLIT_DIRECTIONS", "1")


#: "NxM": the process group is N nodes of M consecutive ranks (zipccl.topology), instead of what
#: the launcher or the host names say: for an emulated cluster (zipccl-netlab up NxM) or a user
#: who knows better. The same on every rank (checked). Unset: found from the launcher.
def nodes_of(text: str) -> tuple[int, int]:
    """'2x4' -> (2, 4): N nodes of M consecutive ranks (ZIPCCL_TOPOLOGY's form)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"ZIPCCL_TOPOLOGY={text!r}: use NxM, e.g. 2x4 (2 nodes of 4 consecutive ranks)")
    return int(m.group(1)), int(m.group(2))


def _nodes(name: str) -> str | None:
    text = _text(name)
    if text is not None:
        nodes_of(text)
    return text


TOPOLOGY = _setting("TOPOLOGY", _nodes, "ZIPCCL_TOPOLOGY")


#: "1": calls that go to the backend's own collective (codec "native", or the plan "auto"
#: chose) first run zipccl's metadata exchange, so that an invalid call or ranks that disagree
#: raise on every rank instead of hanging; costs one small all-gather per call (4-6 ms on 4
#: loopback ranks sharing 2 cores, as much as a small all-reduce). "0" (default): such calls
#: are the backend's collective alone, with torch.distributed's checks and failure modes.
CHECK_NATIVE = _setting("CHECK_NATIVE", _flag, "ZIPCCL_CHECK_NATIVE", "0")


#: "direct" (default): a Triton kernel launched again with arguments of the properties it was
#: compiled for calls its launcher directly (zipccl.kernels.launch), without Triton's per-launch
#: bookkeeping; "triton": every launch through Triton's own.
TRITON_LAUNCH = _setting("TRITON_LAUNCH", _choice, "ZIPCCL_TRITON_LAUNCH", "direct", ("direct", "triton"))


#: "1": the hierarchical collectives move data between the ranks of one node through shared
#: memory (/dev/shm) where all of them can map it (checked when the levels are made); "0": the
#: backend (gloo over TCP loopback) or zipccl's pipeline, as the level's codec says.
SHM = _setting("SHM", _flag, "ZIPCCL_SHM", "1")


def _seconds(name: str) -> float | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be a number of seconds") from None
    if not 0 < value < math.inf:  # NaN, infinity: no bound a wait or a timedelta can take
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {text!r}")
    return value


#: Seconds a rank waits for any one operation of a zipccl call (a peer's packet, size or
#: status, a barrier, the backend's collective) before it counts the peer as lost
#: (zipccl.failure): every rank then raises RankFailure and the group must be rebuilt.
#: Unset (None): zipccl's own waits take DEFAULT_TIMEOUT (the group's timeout where that is
#: shorter), and the backend's own collectives keep torch.distributed's semantics.
TIMEOUT = _setting("TIMEOUT", _seconds, "ZIPCCL_TIMEOUT")

#: The bound of each of zipccl's own waits where ZIPCCL_TIMEOUT is unset, so that no zipccl call
#: blocks for ever (a dead peer on CuPy's NCCL leaves a receive pending for good): 10 minutes,
#: torch's default timeout for NCCL process groups.
DEFAULT_TIMEOUT = 600.0


def wait_bound() -> float:
    """Seconds one of zipccl's waits may take: ZIPCCL_TIMEOUT, else DEFAULT_TIMEOUT."""
    return TIMEOUT if TIMEOUT is not None else DEFAULT_TIMEOUT


#: The codec policy of the drop-in backend (``init_process_group(backend="zipccl")``, whose
#: ``zipccl.backend.Options(codec=...)`` takes precedence): "auto" (default: the backend's own
#: collective wherever compression cannot pay), or "raw", "lossless", "native" for every float
#: tensor it takes, however small (a test suite can force lossless everywhere).
CODEC = _setting("CODEC", _choice, "ZIPCCL_CODEC", "auto", ("auto", "native", "raw", "lossless"))


#: "1": strict transport mode (zipccl.transport.strict): gloo keeps NCCL's rules (exact-size
#: receives, messages matched in issue order whatever their tag, sends and receives that wait on
#: each other issued in one group) and every point-to-point message is checked against them; a
#: violation raises TransportRuleError, as does a message on another device than the group's (a
#: CPU tensor on nccl). For tests (tests/conftest.py turns it on): it adds a small message per
#: payload, and gloo loses its early receives at the codec's bound.
STRICT_TRANSPORT = _setting("STRICT_TRANSPORT", _flag, "ZIPCCL_STRICT_TRANSPORT", "0")


#: Which transport carries CUDA tensors' bytes (zipccl.transport.select, whose table says all):
#: "auto" (CuPy's NCCL, the cuda12 or cuda13 extra, on any group; torch's NCCL on an nccl group
#: without the extra or where the communicator cannot be made), "nccl" (CuPy's NCCL, its errors
#: raised), or "torch" (torch.distributed: CUDA tensors on nccl groups only). CPU tensors always
#: go through torch.distributed.
TRANSPORT = _setting("TRANSPORT", _choice, "ZIPCCL_TRANSPORT", "auto", ("auto", "torch", "nccl"))

#: ZIPCCL_DATA: the folder of the real gradient bucket that the benchmarks (and the test suite)
#: read; None: ``shared/data`` beside the checkout.
DATA = _setting("DATA", _text, "ZIPCCL_DATA")


#: Settings that decide what a group's calls exchange, which every rank of the group must share
#: (one rank checking native calls, or learning, where its peers do not, waits for good): the
#: ranks compare them when they first find their nodes (zipccl.topology: a group's first auto
#: call of a size auto measures, or first hierarchical call). Calls that go native before that
#: carry nothing to compare.
SHARED = ("AUTO_LEARN", "AUTO_MIN_BYTES", "CHECK_NATIVE", "SPLIT_DIRECTIONS", "TRANSPORT")


def codes(names=SHARED) -> list[int]:
    """Each setting as a number that ``shown`` reads back: a flag 0 or 1, bytes as they are, a
    choice by its place among the allowed values."""
    out = []
    for name in names:
        value = getattr(sys.modules[__name__], name)
        out.append(_SETTINGS[name][2][-1].index(value) if isinstance(value, str) else int(value))
    return out


def variable(name: str) -> str:
    """The environment variable of setting ``name``."""
    return _SETTINGS[name][1]


def shown(name: str, code: int) -> str:
    """``VARIABLE=value`` of setting ``name`` whose ``codes`` entry is ``code``."""
    reader, env, args, _ = _SETTINGS[name]
    return f"{env}={args[-1][code] if reader is _choice else code}"
