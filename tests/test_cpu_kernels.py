"""Parts of the numba codec (zipccl/kernels/cpu.py) against independent definitions: the runs of
nonzero elements, the bit writers' boundaries, BMI2's pext (zipccl/kernels/bits.py), float16 pair
tables (built, kept from call to call, forgotten when all slots are taken), and the whole encoder
compiled for a CPU without pext."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from llvmlite import binding as llvm
from numba import njit

from zipccl import format as F
from zipccl.codecs import Lossless
from zipccl.kernels import bits, cpu as C
from zipccl.reference.packet import parse_lossless
from test_codec import laplace

FP16 = F.LAYOUTS[torch.float16]


def pext_by_definition(value: int, mask: int) -> int:
    """The bits of ``value`` where ``mask`` has a one, lowest first, packed together."""
    out = k = 0
    for i in range(64):
        if mask >> i & 1:
            out |= (value >> i & 1) << k
            k += 1
    return out


def runs_by_definition(values: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of nonzero elements."""
    runs, start = [], None
    for i, v in enumerate(values.tolist() + [0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            runs.append((start, i))
            start = None
    return runs


_runs = njit(lambda values, cap, bounds: C._nonzero_runs(values, cap, bounds))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_nonzero_runs_match_their_definition(dtype):
    """Every length from 0 to 40 (tails of 0-7 elements after whole words), zeros alone, in runs,
    at either end, a nonzero lane in a word of zeros and the reverse; and -1 past the cap."""
    rng = np.random.default_rng(7)
    for n in range(41):
        for trial in range(30):
            density = (0.0, 0.05, 0.5, 0.95, 1.0)[trial % 5]
            values = ((rng.random(n) < density) * rng.integers(1, 200, n)).astype(dtype)
            want = runs_by_definition(values)
            for cap in (len(want), max(len(want) - 1, 0), n):
                bounds = np.full(2 * n + 2, -7, np.int64)
                got = _runs(values, cap, bounds)
                if len(want) > cap:
                    assert got == -1, (values, cap)
                else:
                    assert got == len(want) and list(zip(bounds[0:2 * got:2], bounds[1:2 * got:2])) == want, values


def _code_lengths(v: np.ndarray, ref: int, lengths: np.ndarray, layout) -> np.ndarray:
    """Each element's code length (bits) under docs/FORMAT.md's symbol rule."""
    field = (v >> layout.mbits) & layout.emax
    off = field - ref
    sym = np.where((off < layout.min_offset) | (off > layout.max_offset), F.SYM_ESC, off + layout.offset_bias)
    sym = np.where(v == 0, F.SYM_ZERO, sym)
    return lengths[sym] + np.where(sym == F.SYM_ESC, layout.ebits, 0)


def _as_float(v: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(v.astype(np.uint16).view(np.int16)).view(dtype)


class _Crafted:
    """A 4,096-element bfloat16 or float16 block whose stream a test shapes element by element.
    Only every 8th element is sampled, so the others shape the stream without changing the block's
    reference exponent or bank entry; they start with the shortest code."""

    def __init__(self, dtype=torch.bfloat16, seed: int = 0):
        self.dtype, self.lay = dtype, F.LAYOUTS[dtype]
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(4096, generator=g)
        x = x.sign() * x.abs().clamp(0.05, 4.0) * 0.01  # no escape in the sample (see sampled_escapes)
        self.v = x.to(dtype).view(torch.int16).numpy().astype(np.int64) & 0xFFFF
        lp = parse_lossless(Lossless("reference", block_size=4096).encode(self.tensor()))
        self.key = int(lp.ref[0]), int(lp.table[0])
        self.lengths = lp.lengths[self.key[1]]
        self.escape = int(self.lengths[F.SYM_ESC]) + self.lay.ebits
        self.sym_of = {int(n): s for s, n in reversed(list(enumerate(self.lengths))) if s >= 2}  # a symbol per length
        free = np.arange(4096) % 8 != 0
        self.v[free] = self.field(self.sym_of[min(self.sym_of)]) | (self.v[free] & 0x7F)

    def tensor(self) -> torch.Tensor:
        return _as_float(self.v, self.dtype)

    def field(self, s: int) -> int:
        """Symbol s's coded field, in place."""
        return (self.key[0] + s - self.lay.offset_bias) << self.lay.mbits

    def code(self, n: int) -> int:
        """An element whose code takes n bits: an escape (a large exponent), or the symbol of that length."""
        big = (self.lay.emax - 3) << self.lay.mbits
        return big | 0x2A if n == self.escape else self.field(self.sym_of[n]) | 0x55

    def bits(self) -> np.ndarray:
        return _code_lengths(self.v, self.key[0], self.lengths, self.lay)

    def pend_seven(self, at: int) -> bool:
        """Sets element at - 1 so that 7 bits are pending before element ``at``, if some code does."""
        for s in sorted(self.sym_of.values()):
            self.v[at - 1] = self.field(s)
            if _code_lengths(self.v[:at], self.key[0], self.lengths, self.lay).sum() % 8 == 7:
                return True
        return False

    def sampled_escapes(self) -> int:
        """Escapes among the sampled elements: packing tries whole groups only where there are none."""
        field = (self.v[::F.SAMPLE_STRIDE] >> self.lay.mbits) & self.lay.emax
        off = field - self.key[0]
        return int(((off < self.lay.min_offset) | (off > self.lay.max_offset)).sum())

    def check(self, monkeypatch, zero: bool) -> None:
        """The block (with one +0.0 as its last element if ``zero``), byte for byte as the reference;
        float16 packed five times, its pair table built on the fourth (PAIR_MIN)."""
        assert self.sampled_escapes() == 0
        if zero:
            self.v[-1] = 0
        x = self.tensor()
        want = Lossless("reference", block_size=4096).encode(x)
        lp = parse_lossless(want)
        assert (int(lp.ref[0]), int(lp.table[0])) == self.key
        tables = C.pair_tables(C.PAIR_SLOTS)
        monkeypatch.setattr(C, "_pair_tables", lambda: tables)
        for _ in range(5 if self.dtype == torch.float16 else 1):
            assert torch.equal(Lossless("numba", block_size=4096).encode(x), want)
        assert tables.used[0] == (self.dtype == torch.float16)


def _lengths_summing_to(options: list[int], count: int, total: int) -> list[int] | None:
    """``count`` code lengths from ``options`` that add up to ``total``, or None."""
    if count == 0:
        return [] if total == 0 else None
    for n in sorted(options, reverse=True):
        if n <= total:
            rest = _lengths_summing_to(options, count - 1, total - n)
            if rest is not None:
                return [n, *rest]
    return None


@pytest.mark.parametrize("over_28", [False, True])
def test_pairs_of_longest_codes_after_seven_pending_bits(monkeypatch, over_28):
    """In a block with +0.0, the bit writer stores two pairs at a time where none is over 28 bits
    (7 pending bits + 2 x 28 < 64): a bfloat16 block whose longest pairs (a 20-bit escape of a large
    exponent and a code: 29 bits, or the longest up to 28 that the block's bank entry makes) come
    two by two after exactly 7 bits, byte for byte as the reference."""
    c = _Crafted()
    sym_of, escape = c.sym_of, c.escape
    longest = 29 if over_28 else max(escape + n for n in sym_of if escape + n <= 28)
    assert longest - escape in sym_of, "the bank entry has no code to pair with an escape"
    placed = 0
    for gr in range(1, 511, 3):
        at = 8 * gr + 4
        if c.pend_seven(at):
            for i in (at, at + 2):
                c.v[i], c.v[i + 1] = c.code(longest - escape), c.code(escape)
            placed += 1
    assert placed >= 50
    assert c.bits().reshape(-1, 2).sum(axis=1).max() == longest
    c.check(monkeypatch, zero=True)


@pytest.mark.parametrize("dtype,group,bits", ids=lambda v: str(v).removeprefix("torch."), argvalues=[
    (torch.bfloat16, 4, 56), (torch.bfloat16, 4, 57), (torch.bfloat16, 2, 57),
    (torch.float16, 4, 56), (torch.float16, 4, 57),  # float16 codes are at most 12 bits: 4 never pass 56
])
def test_groups_of_pairs_packed_whole_up_to_56_bits(monkeypatch, dtype, group, bits):
    """A block without +0.0 is packed with its lookups inside the append, ``group`` pairs at a time
    where no group's codes are over 56 bits (7 pending + 56 < 64), else two pairs at a time, else
    through the passes above: a block whose aligned groups of 2 x ``group`` elements take exactly
    ``bits`` after exactly 7 pending bits, byte for byte as the reference (float16 with and without
    its pair table)."""
    c = _Crafted(dtype, seed=1)
    options = [*c.sym_of, c.escape]
    placed = 0
    for gr in range(1, 511, 3):
        at = 8 * gr + (4 if group == 2 else 0)  # a group of 2 pairs avoids the sampled element
        sampled = int(c.bits()[at]) if group == 4 else 0
        fill = _lengths_summing_to(options, 2 * group - (group == 4), bits - sampled)
        assert fill is not None, (options, bits)
        if c.pend_seven(at):
            c.v[at + (group == 4):at + 2 * group] = [c.code(n) for n in fill]
            placed += 1
    n = c.bits()
    at = np.arange(0, 4096, 2 * group)
    starts = np.concatenate([[0], np.cumsum(n)])[at] % 8
    sums = n.reshape(-1, 2 * group).sum(axis=1)
    assert placed >= 50 and ((sums == bits) & (starts == 7)).sum() == placed and sums.max() == bits
    c.check(monkeypatch, zero=False)


def _words(n: int) -> list[int]:
    rng = np.random.default_rng(0)
    return [0, 2**64 - 1, 0x7E007E00, 0x8000_8000, *map(int, rng.integers(0, 2**63, n, dtype=np.uint64) * 2 + 1)]


def _compiled(impl):
    mbits, ebits = FP16.mbits, FP16.ebits
    return njit(lambda w: impl(w, mbits, ebits))


def test_pair_fields_match_their_definition():
    """A float16 pair's two coded fields (bits 9-14 of each element), first | second << 6, by
    shifts and, where the host has a fast pext, by pext; the encoder uses the one FAST_PEXT says."""
    mask = (FP16.emax << FP16.mbits) | (FP16.emax << FP16.mbits + 16)
    impls = [C._pair_fields_shifts] + ([C._pair_fields_pext] if bits.FAST_PEXT else [])
    for impl in impls:
        fields = _compiled(impl)
        for w in _words(500):
            w32 = w & 0xFFFF_FFFF
            assert fields(np.uint64(w32)) == pext_by_definition(w32, mask), (impl, hex(w32))
    assert C._pair_fields is (C._pair_fields_pext if bits.FAST_PEXT else C._pair_fields_shifts)


def test_pext_matches_its_definition():
    """Every mask, not only the encoder's, on a host whose CPU has BMI2 (fast or not: the
    instruction is the same). Elsewhere LLVM may have no instruction for it, the encoder uses the
    shift version above, and this test skips, which fails a CI run (tests/ci_rules.py): CI runs on
    x86-64 with BMI2."""
    if not llvm.get_host_cpu_features().get("bmi2"):
        pytest.skip(f"this CPU ({llvm.get_host_cpu_name()}) has no BMI2 pext to test")
    f = njit(lambda v, m: bits.pext(v, m))
    words = _words(300)
    for v, m in zip(words, words[::-1]):
        assert int(f(np.uint64(v), np.uint64(m))) == pext_by_definition(v, m), (hex(v), hex(m))


def _float16(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = laplace(n, g)
    if kind == "few_zeros":  # +0.0 in pairs' first and second halves, at blocks' ends
        x[::97] = 0.0
        x[1::211] = 0.0
        x[255::256] = 0.0
    elif kind == "mixed":  # escapes: a wide range of exponents
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-7, 4, (n,), generator=g).float()
    elif kind == "subnormal":  # exponent 0 without +0.0
        x = x * 2.0 ** -12
    return x.half()


@pytest.mark.parametrize("block_size", [256, 4096])
@pytest.mark.parametrize("kind", ["laplace", "few_zeros", "mixed", "subnormal"])
def test_float16_pair_tables_match_reference(monkeypatch, kind, block_size):
    """Tensors whose keys (reference, bank entry) cover PAIR_MIN elements: packed through pair
    tables built in the call, then through the same tables again, byte for byte as the reference."""
    tables = C.pair_tables(C.PAIR_SLOTS)
    monkeypatch.setattr(C, "_pair_tables", lambda: tables)
    x = _float16(kind, 12 * C.PAIR_MIN + 77, seed=1)  # at 256 elements a block, keys spread thin
    want = Lossless("reference", block_size=block_size).encode(x)
    for _ in range(2):
        assert torch.equal(Lossless("numba", block_size=block_size).encode(x), want)
        assert tables.used[0] >= 1  # the pair tables ran


def test_small_tensors_get_pair_tables_after_a_few_calls(monkeypatch):
    """A key's elements count across calls: 4,096-element tensors of one key build its table on the
    fourth call (PAIR_MIN = 16,384), and every packet before and after is the reference's."""
    tables = C.pair_tables(C.PAIR_SLOTS)
    monkeypatch.setattr(C, "_pair_tables", lambda: tables)
    x = _float16("few_zeros", 4096, seed=5)
    want = Lossless("reference", block_size=4096).encode(x)
    for call in range(1, 7):
        assert torch.equal(Lossless("numba", block_size=4096).encode(x), want)
        assert tables.used[0] == (call * 4096 >= C.PAIR_MIN), call


def test_pair_tables_forget_all_when_full(monkeypatch):
    """Keys of PAIR_MIN elements and more, more of them than two slots: the tables are forgotten
    and rebuilt, never looked up for a key whose slot another key took."""
    tables = C.pair_tables(2)
    monkeypatch.setattr(C, "_pair_tables", lambda: tables)
    part = laplace(4 * C.PAIR_MIN, torch.Generator().manual_seed(5))
    x = torch.cat([part * 2.0 ** k for k in (0, 3, 6, 9)] + [part[:500]]).half()
    want = Lossless("reference", block_size=4096).encode(x)
    lp = parse_lossless(want)
    keys = collections.Counter(zip(lp.ref.tolist(), lp.table.tolist()))
    assert sum(4096 * count >= C.PAIR_MIN for count in keys.values()) >= 3  # more keys than slots
    for _ in range(2):
        assert torch.equal(Lossless("numba", block_size=4096).encode(x), want)
        assert 1 <= tables.used[0] <= 2


_GENERIC = textwrap.dedent("""
    import torch
    from zipccl.codecs import Lossless
    from zipccl.kernels import bits, cpu
    assert not bits.FAST_PEXT
    g = torch.Generator().manual_seed(3)
    x = torch.empty(70_000).exponential_(generator=g) * (torch.randint(0, 2, (70_000,), generator=g) * 2 - 1) * 1e-3
    x[::97] = 0.0
    y = x.half()
    want = Lossless("reference", block_size=4096).encode(y)
    for _ in range(2):  # the second call finds pair tables built: their lookups are what pext served
        assert torch.equal(Lossless("numba", block_size=4096).encode(y), want)
    assert cpu._pair_tables().used[0] >= 1
    print("generic ok")
""")


def test_encoder_compiled_for_a_cpu_without_pext(tmp_path):
    """NUMBA_CPU_NAME=generic (no BMI2): FAST_PEXT is off, nothing asks LLVM for pext, and the
    packets are still the reference's, with every array index bounds-checked (NUMBA_BOUNDSCHECK);
    its own kernel cache, so that nothing compiled for this host is loaded. float16 only: its
    pairs are the one place the encoder takes pext, and each more dtype compiled here cost CI
    minutes (three took 496-521 s)."""
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path), NUMBA_BOUNDSCHECK="1")
    run = subprocess.run([sys.executable, "-c", _GENERIC], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "generic ok" in run.stdout, run.stdout + run.stderr
