"""The network lab: N nodes on a shaped, switched network, built from Linux network namespaces.

    zipccl-netlab up N RATE      # e.g. up 4 1gbit: 4 nodes of one rank each
    zipccl-netlab up NxM RATE    # e.g. up 2x2 1gbit: 2 nodes of 2 ranks each
    zipccl-netlab status
    zipccl-netlab down           # idempotent
    zipccl-perf --netlab 1gbit [--nodes 2] ...

Topology: namespace ``zcl-r<i>`` per node holds ``zcl-v<i>a`` (10.213.0.<i+1>/24);
its veth peer ``zcl-v<i>b`` sits in namespace ``zcl-br`` on bridge ``zcl-br0``.
Both directions of every node's link are shaped with ``tc tbf`` (egress of each
veth end), so each node gets RATE in and RATE out through a non-blocking switch.
The M ranks of a node share its namespace and address: their traffic to each other
stays inside it, over its loopback, unshaped (as NVLink and shared memory stay
inside a machine). Ranks get torchrun's variables (GROUP_RANK = node, LOCAL_RANK,
LOCAL_WORLD_SIZE), from which zipccl.topology finds the nodes. On a GPU machine,
``zipccl-perf --share-gpu --netlab RATE`` runs every rank on its one GPU, each an NCCL host of
its own (zipccl.launch.lab_env) whose socket transport uses its node's veth (NCCL_SOCKET_IFNAME).
Every name starts with ``zcl-``; addresses exist only inside the lab's own
namespaces. Measured on these 2-core machines: 1 Gbit/s per rank is accurate
(iperf3 0.95 Gbit/s); netem (delay) is not in this kernel; above about 1 Gbit/s per
core the CPUs, not the links, are the limit (a 16-core GPU machine: 10 Gbit/s per rank,
its bucket a millisecond of traffic, ``burst``). Needs root, ``ip`` and ``tc`` (iproute2).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time

PREFIX = "zcl-"
BRIDGE_NS = f"{PREFIX}br"
BRIDGE = f"{PREFIX}br0"
SUBNET = "10.213.0"
BURST = 128 << 10  # bytes, at least: >= 64 KiB (a GSO packet); smaller bursts under-deliver at Gbit rates
#: Each core drives about 1 Gbit/s of shaped veth traffic (measured on these 2-core machines).
MAX_ACCURATE_BITS_PER_CORE = 1e9
#: Seconds the other ranks get once one has failed, before they are killed.
RANK_GRACE = 15.0


class LabError(RuntimeError):
    """The lab cannot be built here (not root, no iproute2, a command failed)."""


def rate_bits(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmg]?)(bit|bps)?", rate.strip().lower())
    if not m:
        raise ValueError(f"rate {rate!r}: use e.g. 1gbit, 500mbit, 100mbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] * (8 if m.group(3) == "bps" else 1)
    if float(m.group(1)) * scale < 1e3:
        raise ValueError(f"rate {rate!r}: at least 1kbit")
    return float(m.group(1)) * scale


def check_host() -> None:
    if os.geteuid() != 0:
        raise LabError("the network lab needs root (network namespaces, veth, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LabError(f"`{tool}` not found: install iproute2 (apt-get install iproute2)")


def _sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    out = subprocess.run(argv, capture_output=True, text=True)
    if check and out.returncode:
        raise LabError(f"`{' '.join(argv)}` failed: {out.stderr.strip()}")
    return out


def namespaces() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def rank_ns(i: int) -> str:
    """The namespace of node ``i`` (with one rank per node, of rank i)."""
    return f"{PREFIX}r{i}"


def rank_if(i: int) -> str:
    return f"{PREFIX}v{i}a"


def rank_ip(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def shape(text: str) -> tuple[int, int]:
    """'4' -> (4, 1), '2x2' -> (2, 2): nodes and ranks per node."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*", text)
    if not m:
        raise ValueError(f"{text!r}: use N (nodes of one rank) or NxM (N nodes of M ranks), e.g. 4 or 2x2")
    return int(m.group(1)), int(m.group(2) or 1)


def burst(bits: float) -> int:
    """tbf's bucket in bytes for ``bits`` per second: BURST, or a millisecond of traffic where
    that is more (10 Gbit/s: 1.25 MB), so that the timer's granularity does not cap the rate."""
    return max(BURST, int(bits / 8 / 1000))


def up(nranks: int, rate: str) -> None:
    """Build the lab of ``nranks`` nodes (tearing down any previous one first)."""
    check_host()
    bits = rate_bits(rate)
    if not 1 <= nranks <= 200:
        raise ValueError("the number of nodes must be in 1..200")
    cores = os.cpu_count() or 1
    if bits > MAX_ACCURATE_BITS_PER_CORE * cores:
        print(f"# warning: {rate} per rank is above what {cores} CPU cores can drive; the CPUs, not the links, "
              "will limit throughput", file=sys.stderr)
    down()
    try:
        _sh("ip", "netns", "add", BRIDGE_NS)
        _sh("ip", "link", "add", BRIDGE, "type", "bridge", ns=BRIDGE_NS)
        _sh("ip", "link", "set", BRIDGE, "up", ns=BRIDGE_NS)
        for i in range(nranks):
            ns, a, b = rank_ns(i), rank_if(i), f"{PREFIX}v{i}b"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "set", "lo", "up", ns=ns)
            _sh("ip", "link", "add", a, "netns", ns, "type", "veth", "peer", "name", b, "netns", BRIDGE_NS)
            _sh("ip", "addr", "add", f"{rank_ip(i)}/24", "dev", a, ns=ns)
            _sh("ip", "link", "set", a, "up", ns=ns)
            _sh("ip", "link", "set", b, "master", BRIDGE, ns=BRIDGE_NS)
            _sh("ip", "link", "set", b, "up", ns=BRIDGE_NS)
            for dev, where in ((a, ns), (b, BRIDGE_NS)):
                _sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(bits)}bit", "burst",
                    str(burst(bits)), "latency", "100ms", ns=where)
    except BaseException:
        down()
        raise


def pids() -> list[int]:
    """The processes inside the lab's namespaces (a run's ranks)."""
    return [int(p) for ns in namespaces() for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]


def down() -> list[str]:
    """Kill what runs inside the lab (a killed run's ranks, which would wait on their peers for
    their whole timeout), then delete its namespaces (their veths go with them); returns what
    was removed."""
    for pid in pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    gone = namespaces()
    for ns in gone:
        _sh("ip", "netns", "del", ns, check=False)
    return gone


def worst(codes: list[int]) -> int:
    """The ranks' worst exit status, as a shell gives it (128 + N: killed by signal N)."""
    return max((128 - c if c < 0 else c for c in codes), default=0)


def status() -> str:
    found = namespaces()
    if not found:
        return "netlab: down"
    lines = [f"netlab: {len(found)} namespaces"]
    for ns in sorted(found):
        shaping = _sh("tc", "qdisc", "show", ns=ns, check=False).stdout.strip().replace("\n", "; ")
        lines.append(f"  {ns}: {shaping or '-'}")
    return "\n".join(lines)


class NetLab:
    """``with NetLab(4, "1gbit") as lab:`` builds the lab and always tears it down (also on Ctrl-C);
    ``NetLab(4, "1gbit", nodes=2)``: 4 ranks on 2 nodes of 2."""

    def __init__(self, nranks: int, rate: str, nodes: int | None = None):
        nodes = nranks if nodes is None else nodes
        if nodes < 1 or nranks % nodes:
            raise ValueError(f"{nranks} ranks do not make {nodes} nodes of equal size")
        self.nranks, self.rate, self.nodes, self.per_node = nranks, rate, nodes, nranks // nodes

    def __enter__(self) -> "NetLab":
        """Build the lab: a lab left by a run killed outright is torn down first; one whose ranks
        still run (another run's) is refused, not taken from them."""
        if os.geteuid() == 0 and pids():
            raise LabError("a lab is up and in use (zipccl-netlab status; zipccl-netlab down ends it)")
        interrupt = lambda *a: (_ for _ in ()).throw(KeyboardInterrupt())  # noqa: E731 - unwinds to __exit__
        self._old = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            up(self.nodes, self.rate)
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        down()
        self._restore()

    def _restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def env(self, rank: int, port: int) -> dict:
        """torch.distributed environment of a rank inside the lab (one intra-op thread per rank, as
        torchrun does: N ranks with default thread pools oversubscribe the cores and stall)."""
        node = rank // self.per_node
        return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.nranks), GROUP_RANK=str(node),
                    LOCAL_RANK=str(rank % self.per_node), LOCAL_WORLD_SIZE=str(self.per_node),
                    MASTER_ADDR=rank_ip(0), MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=rank_if(node),
                    NCCL_SOCKET_IFNAME=rank_if(node),  # NCCL's sockets too (zipccl-perf --share-gpu --netlab)
                    OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))

    def popen(self, rank: int, argv: list[str], env: dict, **kw) -> subprocess.Popen:
        """A rank in its node's namespace, killed with this process however it dies (SIGKILL too)."""
        from ..launch import _die_with_launcher
        return subprocess.Popen(["ip", "netns", "exec", rank_ns(rank // self.per_node), *argv], env=env,
                                preexec_fn=_die_with_launcher, **kw)

    def run_ranks(self, argv: list[str], timeout: float, port: int = 29531, quiet_others: bool = True) -> list[int]:
        """Run ``argv`` as every rank (rank 0's output passes through); their exit codes. All are
        killed on timeout, and the others RANK_GRACE seconds after one fails (time to say why
        they fail with it), not left waiting on it for their own timeout."""
        procs = [self.popen(r, argv, self.env(r, port),
                            stdout=None if r == 0 or not quiet_others else subprocess.DEVNULL)
                 for r in range(self.nranks)]
        deadline, failed = time.monotonic() + timeout, None
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if now >= deadline:
                    raise LabError(f"ranks did not finish within {timeout:.0f} s")
                if failed is None and any(p.returncode for p in procs):
                    failed = now
                    rank, code = next((r, p.returncode) for r, p in enumerate(procs) if p.returncode)
                    print(f"# netlab: rank {rank} exited with status {worst([code])}; the others get "
                          f"{RANK_GRACE:g} s", file=sys.stderr, flush=True)
                elif failed is not None and now - failed >= RANK_GRACE:
                    break
                time.sleep(0.1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return [p.returncode for p in procs]


def unavailable() -> str | None:
    """Why the lab cannot be built here, or None: not root, no iproute2, network namespaces
    refused (a probe namespace is made and deleted), or a lab up already, which may be another
    run's and is left alone (``up`` would tear it down).

    The probe is named per process and outside the lab's prefix: processes probing at once (test
    workers collecting together) would otherwise find each other's probe and report a refusal."""
    try:
        check_host()
    except LabError as e:
        return str(e)
    if namespaces():
        return "a lab is up already (zipccl-netlab status; zipccl-netlab down removes it)"
    probe = f"zipccl-probe-{os.getpid()}"
    made = _sh("ip", "netns", "add", probe, check=False)
    if made.returncode:
        return f"network namespaces cannot be created here ({made.stderr.strip() or 'ip netns add failed'})"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def run_in_lab(rate: str, nranks: int, argv: list[str], timeout: float = 3600.0, nodes: int | None = None) -> int:
    """zipccl-perf's command ``argv``, without --netlab, as N ranks inside the lab (on ``nodes``
    nodes; default one per rank), the lab torn down after; the ranks' worst exit status.
    Raises LabError where the lab cannot be built, another run's ranks are in it, or the ranks
    outlive ``timeout``; a lab left by a killed run is torn down first."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--netlab":
            skip = True
        elif not a.startswith("--netlab="):
            rest.append(a)
    check_host()
    with NetLab(nranks, rate, nodes) as lab:
        where = f"{lab.nodes} nodes of {lab.per_node} ranks" if lab.per_node > 1 else f"{nranks} ranks"
        print(f"# netlab: {where}, {rate} per {'node' if lab.per_node > 1 else 'rank'} (tc tbf, both directions)",
              flush=True)
        how = f"netlab {rate}" + (f", {lab.nodes}x{lab.per_node}" if lab.per_node > 1 else "")
        return worst(lab.run_ranks([sys.executable, "-m", "zipccl.bench.perf", *rest, "--how", how], timeout))


def run_perf(rate: str, nranks: int, argv: list[str], timeout: float = 3600.0, nodes: int | None = None) -> int:
    """zipccl-perf --netlab: run_in_lab, a lab that cannot be built said in one line (status 2)."""
    try:
        return run_in_lab(rate, nranks, argv, timeout, nodes)
    except LabError as e:
        print(f"zipccl-perf: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zipccl-netlab", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="build N shaped node namespaces (NxM: M ranks share each)")
    u.add_argument("shape", help="N (nodes of one rank) or NxM (N nodes of M ranks), e.g. 4 or 2x2")
    u.add_argument("rate", help="per-node rate, e.g. 1gbit")
    sub.add_parser("down", help="remove the lab (idempotent)")
    sub.add_parser("status", help="what exists now")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "up":
            nodes, per_node = shape(args.shape)
            up(nodes, args.rate)
            print(status())
            if per_node > 1:
                print(f"netlab: {nodes} nodes of {per_node} ranks: run rank r in {rank_ns(0)[:-1]}<r // {per_node}> "
                      f"with GROUP_RANK=r // {per_node}, LOCAL_RANK=r % {per_node} (or ZIPCCL_TOPOLOGY={args.shape})")
        elif args.cmd == "down":
            check_host()
            gone = down()
            print(f"netlab: removed {len(gone)} namespaces" if gone else "netlab: nothing to remove")
        else:
            check_host()
            print(status())
    except (LabError, ValueError) as e:
        print(f"zipccl-netlab: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
