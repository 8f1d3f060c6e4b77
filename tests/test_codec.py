"""The lossless and raw codecs: bit-exactness, reference equality, size bound, untrusted packets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import zipccl
from zipccl import format as F
from zipccl.codecs import Lossless, Raw, packet_size
from zipccl.reference.packet import parse_lossless

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:  # the gpu extra is optional; .ci/run installs it, so CI runs these
    HAVE_TRITON = False
TRITON_MARKS = () if HAVE_TRITON else pytest.mark.skip(reason="triton not installed (pip install zipccl[gpu])")
FAST = ["numba", pytest.param("triton", marks=TRITON_MARKS)]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
BS = 256  # small blocks so that multi-block cases stay fast in the reference


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(INT[x.dtype])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.numel() == b.numel()
    assert torch.equal(bits(a), bits(b))


def laplace(n: int, g: torch.Generator, scale: float = 1e-3) -> torch.Tensor:
    """Laplace(0, scale) draws from ``g`` (torch.distributions samples from the global generator)."""
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return torch.empty(n).exponential_(generator=g) * sign * scale


def make(kind: str, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        x = torch.randn(n, generator=g)
    elif kind == "laplace":
        x = laplace(n, g)
    elif kind == "zeros":
        x = torch.zeros(n)
    elif kind == "equal":
        x = torch.full((n,), 0.375)
    elif kind == "mixed":  # wide exponent range, exact zeros, tiny values: escapes everywhere
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-40, 4, (n,), generator=g).float()
        x[torch.rand(n, generator=g) < 0.2] = 0.0
    elif kind == "few_zeros":  # a few +0.0 per block, at its edges too: the run-by-run fast paths
        x = laplace(n, g)
        x[::97] = 0.0
        x[BS - 1::BS] = 0.0
        x[-1:] = 0.0  # the last of a block whose length is no multiple of a word's lanes
    elif kind == "zero_runs":  # +0.0 in runs of 1-64 (rows a batch did not touch): odd and even ends
        x = laplace(n, g)
        lengths = torch.randint(1, 65, (n // 2 + 2,), generator=g)
        ends = torch.cumsum(lengths, 0)
        for a, e in zip(ends[0::2].tolist(), ends[1::2].tolist()):  # every other run is zeros
            x[a:e] = 0.0
    elif kind == "subnormal":  # exponent 0 without +0.0 (which fast paths tell apart by a second look)
        layout = F.LAYOUTS[dtype]
        mant = torch.randint(1, 1 << layout.mbits, (n,), generator=g, dtype=torch.int64)
        sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) << (layout.itemsize * 8 - 1)
        tiny = (mant | sign).to(torch.int32 if dtype == torch.float32 else torch.int16)
        x = torch.randn(n, generator=g).to(dtype)
        pick = torch.rand(n, generator=g) < 0.3
        x[pick] = tiny.view(dtype)[pick]
        return x
    elif kind == "random_bits":  # incompressible: every bit pattern
        ib = torch.randint(-2**15, 2**15, (n,), generator=g, dtype=torch.int32)
        if dtype == torch.float32:
            ib = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
            return ib.view(torch.float32)
        return ib.to(torch.int16).view(dtype)
    else:
        raise ValueError(kind)
    return x.to(dtype)


KINDS = ["gauss", "laplace", "zeros", "equal", "mixed", "few_zeros", "zero_runs", "subnormal", "random_bits"]
SIZES = [0, 1, BS - 1, BS, BS + 1, 5 * BS + 77]


# Triton's interpreter walks a block's chain of codes in Python, about a second per block-sized
# case, so it takes the grid in two cuts instead of whole: every kind at the sizes that cost
# little (0, 1) and at several blocks with a tail, and the sizes at a block's edges with the kinds
# whose block ends differ (coded, +0.0 at the edges, raw blocks). numba takes the whole grid.
EDGE_KINDS = ("gauss", "few_zeros", "random_bits")
IMPL_KIND_N = [pytest.param(impl, kind, n, marks=TRITON_MARKS if impl == "triton" else ())
               for impl in ("numba", "triton") for kind in KINDS for n in SIZES
               if impl == "numba" or n in (0, 1, 5 * BS + 77) or kind in EDGE_KINDS]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl,kind,n", IMPL_KIND_N)
def test_fast_impls_match_reference(impl, dtype, kind, n):
    """Invariant 2: byte-identical packets and identical decoded bits across implementations
    (Triton under its interpreter, on CPU tensors)."""
    x = make(kind, n, dtype)
    ref, fast = Lossless("reference", block_size=BS), Lossless(impl, block_size=BS)
    p_ref, p_fast = ref.encode(x), fast.encode(x)
    assert torch.equal(p_ref, p_fast)
    assert p_fast.numel() <= fast.max_encoded_size(n, dtype)
    for impl in (ref, fast):
        assert_same_bits(impl.decode(p_ref), x)


@pytest.mark.overflow_checked
@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_longest_codes_match_reference(impl, dtype):
    """Coded fields halving in frequency one step down give codes up to MAXLEN bits, longer
    than the decoder's 10-bit multi-symbol window: those take its single-symbol path."""
    n = 1 << 15  # 32 blocks of the Triton encoder: one decoder program, the interpreter's pace
    g = torch.Generator().manual_seed(0)
    lay = F.LAYOUTS[dtype]
    k = torch.floor(-torch.log2(torch.rand(n, generator=g).clamp_min(1e-30))).long()  # geometric, p = 1/2
    # the bf16 bank's longest codes lie below a block's reference, float16's above it
    field = (lay.emax // 2 + k).clamp_max(lay.emax - 3) if dtype == torch.float16 else (lay.emax - 3 - k).clamp_min(1)
    low = torch.randint(0, 1 << (lay.mbits + 1), (n,), generator=g)  # the sign (top bit) and the mantissa
    v = (low >> lay.mbits) << (lay.mbits + lay.ebits) | field << lay.mbits | (low & ((1 << lay.mbits) - 1))
    x = torch.where(v >= 1 << 15, v - (1 << 16), v).to(torch.int16).view(dtype)
    bs = F.GPU_BLOCK_SIZE if impl == "triton" else F.DEFAULT_BLOCK_SIZE  # each one's default (the interpreter
    ref, fast = Lossless("reference", block_size=bs), Lossless(impl, block_size=bs)  # decodes short blocks faster)
    p = ref.encode(x)
    assert _longest_code_used(p, x) == F.MAXLEN
    assert torch.equal(fast.encode(x), p)
    assert_same_bits(fast.decode(p), x)


@pytest.mark.parametrize("impl", FAST)
def test_float16_side_bits_around_zeros(impl):
    """float16's side bits (the sign and the mantissa bit below the coded field, four elements a
    byte after a block's rest bytes): blocks whose nonzero elements fill their last side byte
    with 4, 3, 2 and 1 elements, +0.0 between the elements of a byte and across whole bytes'
    worth of elements, a block more than a sixteenth +0.0 (the CPU codec's other path), -0.0
    (side bits only), subnormals and escapes; encode, decode and decode_into against the
    reference."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(8 * 256 + 70, generator=g) * 1e-3).to(torch.float16)
    x[5:300:3] = torch.tensor([6e-8, -3e-6, 5e-5], dtype=torch.float16).repeat(33)
    for b in range(8):  # b +0.0 at random in block b, and in odd blocks a run of 4b + 1
        x[256 * b + torch.randperm(256, generator=g)[:b]] = 0.0
        if b % 2:
            x[256 * b + 20:256 * b + 20 + 4 * b + 1] = 0.0
    x[256 * 6 + torch.randperm(256, generator=g)[:100]] = 0.0
    x[256 * 3 + 40:256 * 3 + 48] = -0.0
    x[256 * 2 + 9:256 * 2 + 12] = torch.tensor([60000.0, -1000.0, float("inf")], dtype=torch.float16)  # escapes
    ref, fast = Lossless("reference", block_size=256), Lossless(impl, block_size=256)
    p = ref.encode(x)
    lp = parse_lossless(p)
    assert set(((lp.nvalid - lp.nzero) % 4).tolist()) == {0, 1, 2, 3} and F.RAW_BLOCK not in lp.table
    assert (lp.nzero * 16 > lp.nvalid).any()
    assert torch.equal(fast.encode(x), p)
    assert_same_bits(fast.decode(p), x)
    out = torch.empty_like(x)
    assert fast.decode_into(p, out).problem() is None
    assert_same_bits(out, x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("planned, actual", [("few", "many"), ("many", "none"), ("many", "few"), ("few", "none")])
def test_cpu_rest_section_stays_in_its_plan_when_the_tensor_changes(dtype, planned, actual):
    """The numba encoder plans section 3 from its first pass over the tensor; a tensor written
    between that pass and the rest section's (by another thread) must not push its writes past
    the section and its 8 bytes of slack (with more or fewer +0.0 than planned)."""
    from zipccl.kernels import cpu as C
    from zipccl.reference.plan import choose, plan

    def make(kind, seed):
        # few: at most 1/16 of each block, the last one's 200 elements too (its section ends the
        # section: an overrun there lands past the slack, not in the next block's part)
        x = torch.randn(4 * BS + 200, generator=torch.Generator().manual_seed(seed)).to(dtype)
        x[::{"many": 2, "few": 17, "none": 10**9}[kind]] = 0
        return x

    lay, before, after = F.LAYOUTS[dtype], make(planned, 1), make(actual, 2)
    nb = F.num_blocks(before.numel(), BS)
    ref, hist, nzero = np.zeros(nb, np.int64), np.zeros((nb, F.NSYM), np.int64), np.zeros(nb, np.int64)
    C._analyse(C._int_view(before), BS, lay.mbits, ref, hist, nzero)
    tables, cost = choose(hist, dtype), np.zeros(nb, np.int64)
    streams = np.empty(4 * nb * BS * (F.MAXLEN + lay.ebits) // 32 + 8, np.uint8)
    C._pack(C._int_view(before), BS, lay.mbits, ref, tables.assign, nzero, hist, tables.codes, tables.lengths, streams,
            cost, np.zeros((nb, F.substreams(BS) or 1), np.uint16), C._pair_tables())
    pl = plan(tables, ref, cost, nzero, before.numel(), BS, lay)
    assert (pl.table[:-1] != F.RAW_BLOCK).all()  # whole blocks coded: their sections planned from nzero
    size = int(pl.rest_start[-1])
    buf = np.full(size + 8 + 4096, 0xAB, np.uint8)
    C._rest(C._int_view(after), BS, lay.mbits, pl.table, pl.nzero, pl.rest_start, buf)
    assert (buf[size + 8:] == 0xAB).all()


def test_cpu_encoder_leaves_a_sampled_zero_out_of_the_reference_exponent():
    """A +0.0 as the sample's last element (every SAMPLE_STRIDE-th element is sampled) must not
    count toward the block's reference exponent: byte for byte against the reference."""
    x = torch.tensor([1.0] * 8 + [0.0], dtype=torch.bfloat16)
    p = Lossless(impl="reference", block_size=256).encode(x)
    assert int(parse_lossless(p).ref[0]) == 127
    assert torch.equal(Lossless(impl="numba", block_size=256).encode(x), p)


def _longest_code_used(p: torch.Tensor, x: torch.Tensor) -> int:
    """The longest code among the symbols that the packet's coded blocks hold, each element's
    symbol worked out from docs/FORMAT.md's rule (coded field - reference + the layout's
    offset_bias; +0.0 is SYM_ZERO, an offset outside min_offset..max_offset the escape)."""
    lp, layout = parse_lossless(p), F.LAYOUTS[x.dtype]
    v = bits(x).to(torch.int64) & ((1 << 8 * layout.itemsize) - 1)
    exp = ((v >> layout.mbits) & layout.emax).numpy()
    longest, bs = 0, lp.header.block_size
    for b, t in enumerate(lp.table):
        if t == F.RAW_BLOCK:
            continue
        off = exp[b * bs:(b + 1) * bs] - int(lp.ref[b])
        sym = np.where((off < layout.min_offset) | (off > layout.max_offset), F.SYM_ESC, off + layout.offset_bias)
        sym = np.where(v[b * bs:(b + 1) * bs].numpy() == 0, F.SYM_ZERO, sym)
        longest = max(longest, int(lp.lengths[t][sym].max()))
    return longest


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_16bit_pattern_roundtrips(dtype):
    """All 65536 patterns: ±0, subnormals, ±inf, every NaN payload."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    codec = Lossless()
    assert_same_bits(codec.decode(codec.encode(x)), x)
    shuffled = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))]
    assert_same_bits(codec.decode(codec.encode(shuffled)), shuffled)


@pytest.mark.parametrize("impl", ["reference", *FAST])
def test_fp32_special_values(impl):
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45,
                             1.17549435e-38, 3.4028235e38, -3.4028235e38, 1.0, -2.5])
    payload_nans = torch.tensor([0x7F800001, 0x7FC00001, 0xFFFFFFFF, 0x7FBFFFFF], dtype=torch.int64)
    x = torch.cat([specials, payload_nans.to(torch.int32).view(torch.float32)]).repeat(100)
    codec = Lossless(impl, block_size=BS)
    assert_same_bits(codec.decode(codec.encode(x)), x)


@settings(max_examples=60, deadline=None)
@given(data=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=700),
       dtype=st.sampled_from(DTYPES), scale=st.integers(0, 31))
def test_random_bit_patterns_roundtrip(data, dtype, scale):
    """Hypothesis: arbitrary bit patterns, with the high bits shifted down to vary exponents."""
    arr = np.array(data, dtype=np.uint64) >> np.uint64(scale)
    if dtype == torch.float32:
        x = torch.from_numpy(arr.astype(np.uint32).view(np.int32)).view(torch.float32)
    else:
        x = torch.from_numpy((arr & np.uint64(0xFFFF)).astype(np.uint16).view(np.int16)).view(dtype)
    codec = Lossless(block_size=BS)
    p = codec.encode(x)
    assert p.numel() <= codec.max_encoded_size(x.numel(), dtype)
    assert_same_bits(codec.decode(p), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_real_gradients_ratio_and_reference(real_grads, dtype):
    """On the real bucket: bit-exact, and the numba packet equals the reference on a slice."""
    x = real_grads.to(dtype)
    codec = Lossless()
    p = codec.encode(x)
    assert_same_bits(codec.decode(p), x)
    ratio = p.numel() / (x.numel() * x.element_size())
    assert ratio <= {torch.bfloat16: 0.675, torch.float16: 0.80, torch.float32: 0.835}[dtype]  # the format's targets (docs/FORMAT.md)
    part = x[1_000_000:1_000_000 + 20_000]
    assert torch.equal(Lossless("reference").encode(part), codec.encode(part))


def test_gaussian_bf16_ratio():
    x = make("gauss", 1 << 20, torch.bfloat16) * 0.02
    p = Lossless().encode(x)
    assert p.numel() / (x.numel() * 2) <= 0.67


def test_incompressible_stays_within_bound_and_raw_blocks_used():
    x = make("random_bits", 10_000, torch.bfloat16)
    codec = Lossless()
    p = codec.encode(x)
    assert p.numel() <= codec.max_encoded_size(x.numel(), x.dtype)
    # every block raw: the packet is the data, the header, the sub-stream lengths (all 0) and the index
    assert p.numel() - x.numel() * 2 == F.HEADER_SIZE + sum(F.prefix_sizes(x.numel(), F.DEFAULT_BLOCK_SIZE))


def test_decode_into_out_and_layouts():
    x = make("gauss", 3000, torch.bfloat16).reshape(30, 100)
    codec = Lossless()
    p = codec.encode(x)
    assert p.dtype == torch.uint8 and p.dim() == 1
    out = torch.empty(60, 50, dtype=torch.bfloat16)
    y = codec.decode(p, out=out)
    assert y.data_ptr() == out.data_ptr() and y.shape == (3000,)
    assert_same_bits(out, x)
    with pytest.raises(ValueError):
        codec.decode(p, out=torch.empty(2999, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        codec.decode(p, out=torch.empty(3000, dtype=torch.float16))


def test_unsupported_inputs():
    codec = Lossless()
    with pytest.raises(zipccl.UnsupportedError, match="bfloat16"):
        codec.encode(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(zipccl.UnsupportedError, match="contiguous"):
        codec.encode(torch.zeros(4, 4)[:, 1])
    with pytest.raises(zipccl.UnsupportedError):
        Raw().encode(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(zipccl.UnsupportedError, match="numba"):
        Lossless("numba").encode(torch.zeros(4, device="meta"))
    with pytest.raises(ValueError):
        Lossless(impl="fast")
    with pytest.raises(ValueError):
        Lossless(block_size=1000)
    assert issubclass(zipccl.FormatError, zipccl.ZipcclError)


@pytest.mark.parametrize("codec", [Raw(), Lossless(block_size=BS), Lossless(block_size=BS, checksum=True)], ids=repr)
def test_truncated_to_reported_size_decodes(codec):
    x = make("mixed", 2000, torch.bfloat16)
    p = codec.encode(x)
    padded = torch.cat([p, torch.full((37,), 0xAB, dtype=torch.uint8)])
    assert packet_size(padded) == p.numel()
    assert_same_bits(codec.decode(padded[:packet_size(padded)]), x)
    assert_same_bits(codec.decode(padded), x)  # trailing bytes past the reported size are ignored
    for cut in (0, 10, F.HEADER_SIZE, p.numel() // 2, p.numel() - 1):
        with pytest.raises(zipccl.FormatError):
            codec.decode(p[:cut].clone())


def _corrupt(p: torch.Tensor, offset: int, value: int) -> torch.Tensor:
    q = p.clone()
    q[offset] = value
    return q


@pytest.mark.parametrize("impl", ["reference", *FAST])
def test_corrupt_headers_raise(impl):
    codec = Lossless(impl, block_size=BS)
    p = codec.encode(make("gauss", 1500, torch.float32))
    with pytest.raises(zipccl.FormatError, match="magic"):
        codec.decode(_corrupt(p, 0, ord("X")))
    for off in range(4, F.HEADER_SIZE):  # every header byte is covered by the header CRC
        with pytest.raises(zipccl.FormatError):
            codec.decode(_corrupt(p, off, int(p[off]) ^ 0x10))
    with pytest.raises(zipccl.FormatError):
        Raw().decode(p)  # a lossless packet is not a raw packet
    with pytest.raises(zipccl.FormatError):
        codec.decode(torch.zeros(10, dtype=torch.float32).view(torch.uint8))


def _rewrite_header(p: torch.Tensor, **changes) -> torch.Tensor:
    """A packet whose header is re-signed after a change: only deeper validation can catch it."""
    h = F.parse_header(p[:F.HEADER_SIZE].numpy().tobytes(), None, p.numel())
    fields = {**h.__dict__, **changes}
    q = p.clone()
    q[:F.HEADER_SIZE] = torch.frombuffer(bytearray(F.Header(**fields).pack()), dtype=torch.uint8)
    return q


@pytest.mark.parametrize("impl", ["reference", *FAST])
def test_inconsistent_sections_raise(impl):
    codec = Lossless(impl, block_size=BS)
    p = codec.encode(make("mixed", 1500, torch.bfloat16))
    h = F.parse_header(p[:F.HEADER_SIZE].numpy().tobytes(), None, p.numel())
    s0, s1, s2, s3 = h.sections
    bad = [dict(numel=h.numel + 1), dict(numel=h.numel + BS), dict(block_size=BS * 2), dict(block_size=300),
           dict(sections=(s0, s1, s2 + 4, s3 - 4)), dict(sections=(s0, s1, s2 - 4, s3 + 4)),
           dict(sections=(s0 + 16, s1, s2, s3)), dict(ntables=h.ntables + 1), dict(dtype=torch.float16)]
    for change in bad:
        with pytest.raises(zipccl.FormatError):
            codec.decode(_rewrite_header(p, **change))


@pytest.mark.parametrize("impl", ["reference", *FAST])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_payload_bit_flips_never_crash(impl, dtype):
    """Without checksum a flipped payload bit either raises FormatError or decodes to some floats
    of the right size (never a crash or a write outside ``out``); with checksum it always raises."""
    x = make("mixed", 1200, dtype)
    plain, checked = Lossless(impl, block_size=BS), Lossless(impl, block_size=BS, checksum=True)
    p, pc = plain.encode(x), checked.encode(x)
    rng = np.random.default_rng(0)
    guard = torch.full((x.numel() + 64,), 7, dtype=INT[dtype])
    for off in rng.integers(F.HEADER_SIZE, p.numel(), {"numba": 25, "triton": 4}.get(impl, 6)):
        for bit in (0, 5):
            q = _corrupt(p, int(off), int(p[off]) ^ (1 << bit))
            out = guard.clone()
            try:
                plain.decode(q, out=out[:x.numel()].view(dtype))
            except zipccl.FormatError:
                pass
            assert torch.equal(out[x.numel():], guard[x.numel():])
            qc = _corrupt(pc, int(off), int(pc[off]) ^ (1 << bit))
            with pytest.raises(zipccl.FormatError):
                checked.decode(qc)


def test_raw_codec_roundtrip_and_bound():
    for dtype in DTYPES:
        x = make("random_bits", 1001, dtype)
        p = Raw().encode(x)
        assert p.numel() == Raw().max_encoded_size(1001, dtype)
        assert_same_bits(Raw().decode(p), x)


@pytest.mark.parametrize("heading, values, dtype, size", [
    ("## Worked example\n", [1.0, -2.0, 0.0, 0.5, 3.0, 1.5, 0.0, 1e-30], torch.bfloat16, 78),
    ("## Worked example: float16\n", [1.1, -1.7, 0.0, 2.3, 1.2, -1.0, 0.0, 3.1, 1.05, -0.0, 1.9, 5.0],
     torch.float16, 85)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("impl", ["reference", *FAST])
def test_format_doc_worked_example(heading, values, dtype, size, impl):
    """docs/FORMAT.md's worked examples, written out by hand from the format's rules, are the
    packets every implementation produces, byte for byte: ``encode``'s and ``encode_into``'s (at
    the front of a larger buffer, whose other bytes stay as they were, with the size returned)."""
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "FORMAT.md").read_text()
    block = doc.split(heading, 1)[1].split("```", 2)[1]
    data = bytearray()
    for line in block.splitlines():
        for token in line.split()[1 if line[:1].isalpha() else 0:]:
            if len(token) != 2 or any(c not in "0123456789abcdef" for c in token):
                break
            data.append(int(token, 16))
    x = torch.tensor(values).to(dtype)
    assert len(data) == size
    codec = Lossless(impl=impl, block_size=256)
    assert bytes(codec.encode(x).numpy()) == bytes(data)
    buf = torch.full((codec.max_encoded_size(x.numel(), dtype) + 8,), 0xA5, dtype=torch.uint8)
    assert int(codec.encode_into(x, buf)) == size
    assert bytes(buf[:size].numpy()) == bytes(data) and bool((buf[size:] == 0xA5).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["reference", *FAST])
def test_section_0_gives_each_substreams_bits(impl, dtype):
    """Section 0 holds, per block and per 256 elements of it, the bits of their codes and escaped
    fields, worked out here from the format's rules alone (each element's symbol from the block's
    reference, its code length in the bank entry the index names, an escape's raw field), 0 for a
    raw block; every decoder refuses the packet with a sub-stream's bits changed, and those that
    start sub-streams apart (the reference, Triton) also one with a bit moved to the next (their
    sum, the block's size, unchanged), which the numba decoder, one chain per block, decodes."""
    from zipccl.bank import BANK
    g = torch.Generator().manual_seed(11)
    n, bs = 3 * 1024 + 300, 1024
    x = (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2)).to(dtype)
    x[::9] = 0.0
    top = 2 ** (8 * x.element_size() - 1)
    x.view(INT[dtype])[1024:2048] = torch.randint(-top, top, (1024,), generator=g, dtype=torch.int64).to(INT[dtype])
    packet = Lossless(impl, block_size=bs).encode(x)
    lay, nb = F.LAYOUTS[dtype], F.num_blocks(n, bs)
    head = F.parse_header(packet[:F.HEADER_SIZE].numpy().tobytes(), None, packet.numel())
    s0 = head.sections[0]
    assert s0 == 2 * nb * (bs // 256)
    got = packet[F.HEADER_SIZE:F.HEADER_SIZE + s0].numpy().view(np.uint16).reshape(nb, bs // 256).astype(np.int64)
    index = packet[F.HEADER_SIZE + s0:F.HEADER_SIZE + s0 + 8 * nb].numpy().view(np.uint16).reshape(nb, 4)
    bits = x.view(INT[dtype]).to(torch.int64) & ((1 << (8 * lay.itemsize)) - 1)
    raw_blocks = 0
    for b in range(nb):
        ref, entry = int(index[b, 0]) & 255, int(index[b, 0]) >> 8
        if entry == F.RAW_BLOCK:
            raw_blocks += 1
            assert (got[b] == 0).all(), b
            continue
        v = bits[b * bs:(b + 1) * bs]
        field = (v >> lay.mbits) & lay.emax
        offset = field - ref
        fits = (offset >= 2 - lay.offset_bias) & (offset <= 31 - lay.offset_bias)
        sym = torch.where(v == 0, 0, torch.where(fits, offset + lay.offset_bias, 1))
        width = torch.from_numpy(BANK[dtype][entry].astype(np.int64))[sym] + torch.where(sym == 1, lay.ebits, 0)
        want = [int(width[j:j + 256].sum()) for j in range(0, bs, 256)]
        assert got[b].tolist() == want, (b, got[b].tolist(), want)
    assert raw_blocks == 1 and int(got[nb - 1, 2]) == 0  # block 1 raw; the last block's third sub-stream empty
    at = F.HEADER_SIZE  # block 0's sub-streams 0 and 1
    for moved_bit in [True, False]:  # one bit moved from sub-stream 0 to 1 (the block's bits kept), one bit added
        lengths = packet[at:at + 4].numpy().view(np.uint16).copy()
        lengths[0] -= moved_bit
        lengths[1] += 1
        bad = packet.clone()
        bad[at:at + 4] = torch.from_numpy(lengths.view(np.uint8).copy())
        for other in ["reference", "numba", "triton"]:
            if moved_bit and other == "numba":  # walks a block in one chain: needs only the sum
                assert torch.equal(Lossless(other, block_size=bs).decode(bad).view(INT[dtype]), x.view(INT[dtype]))
                continue
            with pytest.raises(zipccl.FormatError) as refused:
                Lossless(other, block_size=bs).decode(bad)
            if other != "triton":  # the GPU decoder names the lowest error bit: the next lane may start mid-code
                assert "sub-stream lengths" in str(refused.value), (other, moved_bit, refused.value)
