"""Hostile packets: every decoder raises FormatError or decodes inside its bounds.

The targeted tests below pin each check (the caller's bound, sizes against the packet, block
index entries); the fuzz tests run zipccl.bench.fuzz's seeded mutations of real and synthetic
packets (bench/fuzz.py runs the same cases by the hundred thousand).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import zipccl
import zipccl.topk
from zipccl import format as F
from zipccl.bench import fuzz
from zipccl.codecs import Lossless, Raw, TopK
from zipccl.reference.packet import parse_lossless

IMPLS = ["reference", "numba", "triton"]
CODECS = [Raw(), *(Lossless(impl, block_size=256) for impl in IMPLS), TopK(density=0.1)]
INT = fuzz.INTS


def _rewrite(p: torch.Tensor, **changes) -> torch.Tensor:
    """The packet with header fields changed and the header CRC re-signed."""
    h = F.parse_header(p[:F.HEADER_SIZE].numpy().tobytes(), None, p.numel())
    q = p.clone()
    q[:F.HEADER_SIZE] = torch.frombuffer(bytearray(F.Header(**{**h.__dict__, **changes}).pack()), dtype=torch.uint8)
    return q


def _encode(codec, x: torch.Tensor) -> torch.Tensor:
    """numba encodes lossless packets for every implementation (the same bytes; the interpreter is slow)."""
    return (Lossless("numba", block_size=256) if isinstance(codec, Lossless) else codec).encode(x)


def _data(n: int = 700, dtype=torch.bfloat16) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-2
    x[::13] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_max_numel_bounds_the_claimed_size(codec):
    p = _encode(codec, _data())
    assert codec.decode(p, max_numel=700).numel() == 700
    with pytest.raises(zipccl.FormatError, match=r"700 elements.*bound of 699"):
        codec.decode(p, max_numel=699)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("numel", [701, 1 << 20, (1 << 31) + 1, 1 << 40, 1 << 60, (1 << 64) - 1])
def test_a_claimed_size_is_checked_before_anything_of_it_is_allocated(codec, numel):
    """A header (re-signed) claiming more elements than its packet can hold: FormatError, with no
    allocation of the claimed size (the guard raises OverBound instead of allocating)."""
    q = _rewrite(_encode(codec, _data()), numel=numel)
    with fuzz.AllocGuard() as guard:
        guard.limit = 1 << 18
        for kwargs in ({"max_numel": 700}, {"out": torch.empty(700, dtype=torch.bfloat16)}):
            with pytest.raises(zipccl.FormatError):
                codec.decode(q, **kwargs)
        if not isinstance(codec, TopK) or numel > zipccl.topk.MAX_NUMEL:
            with pytest.raises(zipccl.FormatError):  # the packet alone shows the size implausible
                codec.decode(q)


def test_topk_packets_claim_at_most_int32_addressable_elements():
    p = TopK(density=0.1).encode(_data())
    with pytest.raises(zipccl.FormatError, match="int32"):
        TopK().header(_rewrite(p, numel=(1 << 31) + 1))
    with pytest.raises(zipccl.FormatError, match="bound"):
        TopK().parse(_rewrite(p, numel=1 << 31), max_numel=1 << 20)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_out_of_another_size_or_dtype_is_a_format_error(codec):
    p = _encode(codec, _data())
    for out in (torch.empty(699, dtype=torch.bfloat16), torch.empty(700, dtype=torch.float16)):
        with pytest.raises(zipccl.FormatError, match="out has"):
            codec.decode(p, out=out)
    with pytest.raises(ValueError, match="contiguous"):
        codec.decode(p, out=torch.empty(700, 2, dtype=torch.bfloat16)[:, 0])


def _index_entry(p: torch.Tensor, b: int) -> tuple[int, np.ndarray]:
    h = F.parse_header(p[:F.HEADER_SIZE].numpy().tobytes(), None, p.numel())
    at = F.HEADER_SIZE + h.sections[0] + b * F.INDEX_ENTRY
    return at, p[at:at + F.INDEX_ENTRY].numpy().view(np.uint16).copy()


def _with_entry(p: torch.Tensor, b: int, words) -> torch.Tensor:
    at, _ = _index_entry(p, b)
    q = p.clone()
    q[at:at + F.INDEX_ENTRY] = torch.from_numpy(np.asarray(words, np.uint16).view(np.uint8).copy())
    return q


@pytest.mark.parametrize("impl", IMPLS)
def test_corrupt_index_entries_raise(impl):
    """An entry whose stream runs past the section, whose zero count exceeds its block, whose table
    does not exist, or a coded block without a word per 32 elements: FormatError, nothing written
    outside ``out``."""
    codec = Lossless(impl, block_size=256)
    p = _encode(codec, _data(600))
    _, last = _index_entry(p, 2)
    _, first = _index_entry(p, 0)
    ntables = int(p[20])
    ref, table = int(first[0]) & 255, int(first[0]) >> 8
    assert table != F.RAW_BLOCK
    bad = [
        (2, [last[0], 0xFFFF, last[2], 0]),                       # nwords past the stream's end
        (0, [first[0], first[1], 257, 0]),                        # nzero > block size
        (2, [last[0], last[1], 600 - 512 + 1, 0]),                # nzero > the last block's 88 elements
        (0, [ref | ntables << 8, first[1], first[2], 0]),         # table id out of range
        (0, [ref | 0xFE << 8, first[1], first[2], 0]),
        (0, [first[0], first[1], first[2], 1]),                   # the reserved word
        (0, [first[0], 0, first[2], 0]),                          # a coded block without a word
        (0, [F.RAW_BLOCK << 8, 0, first[2], 0]),                  # a raw block with zeros
    ]
    guard = torch.full((600 + 128,), 0x5A5A, dtype=torch.int16)
    for b, words in bad:
        out = guard.clone()
        with pytest.raises(zipccl.FormatError):
            codec.decode(_with_entry(p, b, words), out=out[64:664].view(torch.bfloat16))
        assert torch.equal(out[:64], guard[:64]) and torch.equal(out[664:], guard[664:])
    # Words moved from one block to the next keep the sums right: only the kernels can tell.
    _, second = _index_entry(p, 1)
    moved = _with_entry(_with_entry(p, 0, [first[0], first[1] - 1, first[2], 0]), 1,
                        [second[0], second[1] + 1, second[2], 0])
    out = guard.clone()
    with pytest.raises(zipccl.FormatError):
        codec.decode(moved, out=out[64:664].view(torch.bfloat16))
    assert torch.equal(out[:64], guard[:64]) and torch.equal(out[664:], guard[664:])


@pytest.mark.parametrize("impl", ["numba", "triton"])
def test_a_stream_flip_that_changes_a_zero_count_is_named(impl):
    """Flipped bits of the exponent stream that still parse but change a block's count of zeros:
    the reference names the zero count (it chooses the packets), and so must each fast decoder, its
    own check, not only some error (the Triton kernels OR every check of a block)."""
    ref = Lossless("reference", block_size=256)
    p = ref.encode(_data(600))
    lp = parse_lossless(p)
    found = []
    for off in range(lp.stream_offset, lp.rest_offset):
        for bit in range(8):
            q = p.clone()
            q[off] ^= 1 << bit
            try:
                ref.decode(q)
            except zipccl.FormatError as e:
                if "zero count" in str(e):
                    found.append(q)
        if len(found) >= 4:
            break
    assert found
    for q in found:
        with pytest.raises(zipccl.FormatError, match="zero count"):
            Lossless(impl, block_size=256).decode(q)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_reference_that_puts_fields_out_of_range_is_named(impl):
    """A block's reference moved to either end of the field's range (0, 255) with its stream
    unchanged: the stream still parses and its zeros still count right, but the offsets name
    fields below 0 or above 255. Every decoder names it (decode, and decode_into's verdict), and
    nothing is written outside ``out``."""
    p = Lossless("reference", block_size=256).encode(_data(600))
    _, first = _index_entry(p, 0)
    assert int(first[0]) & 255 not in (0, 255)
    guard = torch.full((600 + 128,), 0x5A5A, dtype=torch.int16)
    for ref in (0, 255):
        q = _with_entry(p, 0, [ref | (int(first[0]) & 0xFF00), first[1], first[2], 0])
        out = guard.clone()
        with pytest.raises(zipccl.FormatError, match="decoded exponent out of range"):
            Lossless(impl, block_size=256).decode(q, out=out[64:664].view(torch.bfloat16))
        assert torch.equal(out[:64], guard[:64]) and torch.equal(out[664:], guard[664:])
        verdict = Lossless(impl, block_size=256).decode_into(q, torch.empty(600, dtype=torch.bfloat16))
        assert verdict.problem() == "decoded exponent out of range", (impl, ref, verdict.problem())


def test_alloc_guard_and_guard_bytes_catch_what_they_guard(monkeypatch):
    """The harness's own checks are not vacuous: an allocation above the bound and a write past
    ``out`` are reported."""
    with fuzz.AllocGuard() as guard:
        guard.limit = 100
        torch.empty(100)
        for make in (lambda: torch.empty(101), lambda: torch.zeros(11, 10), lambda: np.empty(101),
                     lambda: torch.full((101,), 1.0)):
            with pytest.raises(fuzz.OverBound):
                make()
    assert torch.empty(101).numel() == 101  # restored on exit

    class Sloppy(Raw):
        def decode(self, packet, out=None, *, max_numel=None):
            result = super().decode(packet, out=out, max_numel=max_numel)
            if out is not None:  # one element past the end of out
                torch.as_strided(out, (out.numel() + 1,), (1,))[-1] = 1.0
            return result

    monkeypatch.setattr(fuzz, "decoder", lambda family: Sloppy())
    base = next(b for b in fuzz.base_packets("raw", None) if b.numel > 1)
    failures = set()
    with fuzz.AllocGuard() as guard:
        for i in range(20):
            try:
                fuzz.check_case("raw", random.Random(i), base, base.packet.copy(), guard, {})
            except fuzz.CaseFailure as e:
                failures.add(e.category)
    assert "guard" in failures


# Cases per decoder family in the suite (all deterministic); `make test-long` runs bench/fuzz.py
# with 200,000 a family. The reference decoder takes 10-20 ms per small packet and the Triton
# interpreter about 2 s per packet that reaches its kernel, so the lossless family's cases run
# mostly on numba: the three share the validation code.
CI_CASES = {"raw": 3_000, "topk": 3_000, "numba": 3_000, "reference": 300, "triton": 12}


@pytest.fixture(scope="module")
def grads(real_grads):
    return real_grads.numpy()


@pytest.mark.parametrize("family", list(CI_CASES))
def test_fuzz(family, grads):
    s = fuzz.run(family, CI_CASES[family], seed=0, grads=grads)
    assert s.cases == CI_CASES[family]
    assert s.failed == 0, "\n".join(s.failures)
    assert s.ok > 0 and s.format_error > 0, s.as_dict()
    if family in ("numba", "reference"):  # mutations get through validation into the decoders
        assert any("stream" in r for r in s.errors), s.errors  # the bank's codes are complete: a
        # corrupt stream decodes to symbols, and is caught when it overruns its block
        assert any("zero count" in r for r in s.errors), s.errors


def test_resized_index_mutations_reach_the_kernels(grads):
    """A block's zero count or stream words changed with its section resized to match passes the
    index's sums, so the numba decoder's kernels meet it: they name the zero count or the stream,
    or decode inside their bounds, and nothing else happens."""
    bases = fuzz.base_packets("numba", grads)
    r = random.Random(2)
    seen = set()
    for _ in range(400):
        base = r.choice(bases)
        buf, name = fuzz._index_resized(r, base.packet.copy(), base)
        try:
            Lossless("numba").decode(torch.from_numpy(buf))
        except zipccl.FormatError as e:
            seen.add(str(e).split(" (")[0])
    assert {"zero count of a block does not match its index entry",
            "invalid or truncated code in an exponent stream"} <= seen, seen


def test_fuzz_cases_replay(grads):
    """Case i is the same case whenever it runs: a failure's number reproduces it."""
    bases = fuzz.base_packets("numba", grads)
    a = [fuzz.mutate("numba", fuzz.case_rng(0, "numba", i), bases[0], bases)[0] for i in range(50)]
    b = [fuzz.mutate("numba", fuzz.case_rng(0, "numba", i), bases[0], bases)[0] for i in range(50)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert fuzz.run("numba", 300, grads=grads).as_dict() | {"seconds": 0} == \
        fuzz.run("numba", 300, grads=grads).as_dict() | {"seconds": 0}


def test_bench_fuzz_smoke(tmp_path):
    """bench/fuzz.py (long runs, a child process per family) runs and writes its summary."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "fuzz.json"
    script = Path(__file__).parents[1] / "bench/fuzz.py"
    run = subprocess.run([sys.executable, str(script), "--cases", "60", "--family", "raw,topk=30", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = json.loads(out.read_text())
    assert summary["failed"] == 0 and [f["family"] for f in summary["families"]] == ["raw", "topk"]
    assert [f["cases"] for f in summary["families"]] == [60, 30]
    assert all(f["format_error"] + f["decoded_ok"] == f["cases"] for f in summary["families"])
    assert "over-bound" in run.stdout


@pytest.mark.overflow_checked
def test_decode_into_agrees_with_the_reference_on_hostile_packets(grads):
    """The Triton decode_into (header and index checked on the device) on four valid packets and
    seeded mutations of packets without a payload checksum, against the reference decoder: where the reference
    decodes the packet and its header is the one ``out`` implies (numel, dtype, this decoder's
    blocks of 256), decode_into's verdict is good and its bits the reference's; everywhere else
    the verdict names a problem."""
    bases = [b for b in fuzz.base_packets("triton", grads) if not b.checksum and b.numel]
    reference, codec = Lossless("reference"), Lossless("triton", block_size=256)
    outcomes = {"agreed_good": 0, "agreed_bad": 0}
    for i in range(24):
        r = fuzz.case_rng(7, "decode_into", i)
        base = r.choice(bases)
        packet = torch.from_numpy(base.packet if i < 4 else fuzz.mutate("triton", r, base, tuple(bases))[0])
        try:
            want = reference.decode(packet, max_numel=base.numel)
            h = F.parse_header(packet[:F.HEADER_SIZE].numpy().tobytes(), None, packet.numel())
            good = (h.numel, h.dtype, h.block_size, h.flags) == (base.numel, base.dtype, 256, 0)
        except zipccl.FormatError:
            want, good = None, False
        out = torch.zeros(base.numel, dtype=base.dtype)
        problem = codec.decode_into(packet, out).problem()
        assert (problem is None) == good, (i, base.label, problem)
        if good:
            assert torch.equal(out.view(INT[base.dtype]), want.view(INT[base.dtype])), (i, base.label)
        outcomes["agreed_good" if good else "agreed_bad"] += 1
    assert min(outcomes.values()) >= 3, outcomes  # both kinds were tried
