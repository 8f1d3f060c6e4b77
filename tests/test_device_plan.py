"""The GPU encoder's device plan (kernels/device_plan.py) against the host plan (reference/plan.py:
choose, plan, the block index) and each block's bank entry against a brute-force count of its
sample's bits under every entry, on the CPU (its Triton kernel in the interpreter), and the
index reader against the host's. The Triton encoder that uses the plan is checked byte for byte
against the reference in test_triton.py, test_codec.py and, on a GPU, test_nccl_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zipccl.bank import BANK, BANK_SIZE
from zipccl.format import LAYOUTS, NSYM, RAW_BLOCK, SYM_ESC, num_blocks
from zipccl.kernels import device_plan
from zipccl.reference.plan import choose, plan


def _host(sampled, exact, ref, numel, block_size, dtype):
    layout = LAYOUTS[dtype]
    tables = choose(sampled, dtype)
    pl = plan(tables, ref, tables.cost(exact, layout), exact[:, 0].copy(), numel, block_size, layout)
    blocks = np.stack([pl.ref, pl.table, pl.word_start[:-1], pl.rest_start[:-1]], axis=1)
    return pl.lengths, pl.codes, pl.front(), blocks, pl.sizes


def _cheapest(sampled, dtype) -> np.ndarray:
    """Each block's bank entry that codes its sample in the fewest bits (code + an escape's raw
    field), ties to the lowest entry: every entry's bits counted for every block (a matrix
    product of the sample's counts and each entry's bits per symbol), then the first minimum."""
    layout = LAYOUTS[dtype]
    per_symbol = np.array(BANK[dtype], dtype=np.int64)[:BANK_SIZE, :NSYM].copy()
    per_symbol[:, SYM_ESC] += layout.ebits
    bits = np.asarray(sampled, dtype=np.int64).reshape(-1, NSYM) @ per_symbol.T
    return bits.argmin(axis=1)


def _check(sampled, exact, ref, numel, block_size, dtype):
    want = _host(sampled, exact, ref, numel, block_size, dtype)
    got = device_plan.plan(torch.from_numpy(sampled), torch.from_numpy(exact), torch.from_numpy(ref), numel,
                           block_size, dtype)
    np.testing.assert_array_equal(got.lengths.numpy(), want[0])
    np.testing.assert_array_equal(got.codes.numpy(), want[1])
    np.testing.assert_array_equal(got.index.numpy(), want[2])
    np.testing.assert_array_equal(got.blocks.numpy().reshape(-1, 4), want[3].reshape(-1, 4))
    assert got.sizes == want[4]
    entries, cheapest = got.blocks[:, 1].numpy(), _cheapest(sampled, dtype)
    wrong = np.flatnonzero((entries != RAW_BLOCK) & (entries != cheapest))
    assert wrong.size == 0, f"blocks {wrong[:8]}: entries {entries[wrong[:8]]}, cheapest {cheapest[wrong[:8]]}"


@st.composite
def histograms(draw):
    """Blocks' sampled and whole histograms as an encoder's first pass could report them: peaked
    or flat, some with escapes enough to stay raw, the last block possibly short."""
    block_size = draw(st.sampled_from([256, 1024, 4096]))
    nb = draw(st.integers(1, 70))
    numel = (nb - 1) * block_size + draw(st.integers(1, block_size))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    exact = np.zeros((nb, NSYM), np.int64)
    for b in range(nb):
        n = min(block_size, numel - b * block_size)
        kind = draw(st.sampled_from(["peaked", "flat", "escapes", "zeros"]))
        p = {"peaked": np.exp(-0.5 * ((np.arange(NSYM) - 27) / 1.5) ** 2), "flat": np.ones(NSYM),
             "escapes": np.eye(NSYM)[SYM_ESC] + 0.01, "zeros": np.eye(NSYM)[0] + 0.001}[kind]
        exact[b] = rng.multinomial(n, p / p.sum())
    sampled = np.minimum(exact, rng.integers(0, 1 + exact // 4 + 1))  # a sample of each block
    ref = rng.integers(0, 256, nb).astype(np.int64)
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    return sampled, exact, ref, numel, block_size, dtype


@settings(max_examples=60, deadline=None)
@given(histograms())
def test_device_plan_equals_host_plan(case):
    _check(*case)


def test_ties_between_entries():
    """Blocks whose sample is one symbol: every entry that gives it the shortest code costs the
    same (the lowest entry wins), the case where a careless argmin differs."""
    nb = 33
    exact = np.tile(np.bincount([28] * 1000 + [0] * 24, minlength=NSYM), (nb, 1)).astype(np.int64)
    shortest = BANK[torch.bfloat16][:, 28]
    assert (shortest == shortest.min()).sum() > 1  # a tie indeed
    _check(exact // 8, exact, np.full(nb, 120, np.int64), nb * 1024, 1024, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_real_gradients(real_grads, dtype):
    """Histograms of the real bucket, as the reference computes them, planned both ways: every
    fourth block of 1024 across the whole bucket (800 blocks of every layer; the interpreter
    runs the plan's kernel block by block), and the bucket's short last block."""
    from zipccl.reference.lossless import block_symbols, float_bits, sample_mask
    block_size = 1024
    layout = LAYOUTS[dtype]
    whole = real_grads.numel() // block_size * block_size
    grads = torch.cat([real_grads[:whole].view(-1, block_size)[::4].flatten(), real_grads[whole:]])
    assert 0 < grads.numel() - grads.numel() // block_size * block_size < block_size
    ref, sym, _, _, valid, _ = block_symbols(float_bits(grads.to(dtype)), layout, block_size)
    nb = num_blocks(grads.numel(), block_size)
    exact = torch.zeros(nb, NSYM, dtype=torch.int64).scatter_add_(1, sym, valid.to(torch.int64))
    sampled = torch.zeros(nb, NSYM, dtype=torch.int64).scatter_add_(
        1, sym, (valid & sample_mask(block_size, "cpu")).to(torch.int64))
    _check(sampled.numpy(), exact.numpy(), ref.numpy(), grads.numel(), block_size, dtype)


def test_no_blocks():
    empty = np.zeros((0, NSYM), np.int64)
    _check(empty, empty, np.zeros(0, np.int64), 0, 1024, torch.bfloat16)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 40), st.sampled_from([256, 4096]), st.integers(0, 2**32 - 1),
       st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
       st.sampled_from([torch.bfloat16, torch.float16]))
def test_index_read_on_the_device_equals_the_host_read(nb, block_size, seed, mutations, dtype):
    """A real packet's block index, then with bytes overwritten: the same rows, the same first
    invalid entry and the same totals from both readers (so the same FormatError, or none);
    float16's rest totals count its side bytes too."""
    from zipccl.codecs import Lossless
    from zipccl.format import CODEC_LOSSLESS, HEADER_SIZE, parse_header
    from zipccl.reference.packet import read_index
    g = torch.Generator().manual_seed(seed)
    numel = nb * block_size - int(torch.randint(0, block_size, (1,), generator=g))
    x = (torch.randn(numel, generator=g) * 0.02).to(dtype)
    x[torch.randint(0, numel, (numel // 7,), generator=g)] = 0.0
    if seed % 2:
        x[:block_size] = 0.0  # a block of +0.0 only: nzero == nvalid, the bound of a check
    packet = Lossless("numba", block_size=block_size).encode(x)
    h = parse_header(packet[:HEADER_SIZE].numpy().tobytes(), CODEC_LOSSLESS, packet.numel())
    start = HEADER_SIZE + h.sections[0]
    stop = start + h.sections[1]
    for where, value in mutations:
        packet[start + where % (stop - start)] = value
    layout = LAYOUTS[dtype]
    host = read_index(packet, start, stop, numel, block_size, h.ntables, layout)
    dev = device_plan.read_index(packet, start, stop, numel, block_size, h.ntables, layout)
    assert isinstance(dev[1], torch.Tensor)  # the check is left on the device
    assert dev[1][0] == host[1][0]  # the first invalid entry, or nb
    if host[1][0] == nb:  # valid: every row and total, as the decoder uses them
        assert dev[1].tolist() == list(host[1])
        assert len(dev[0]) == len(host[0]) == 7
        for k, (got, want) in enumerate(zip(dev[0], host[0])):
            if k < 5:  # per block (ref, table, nwords, nzero, nvalid): the host's array has one unused entry more
                assert want[nb] == 0, (k, want)
                want = want[:nb]
            np.testing.assert_array_equal(got.numpy(), want)  # whole rows: the prefix sums have nb + 1 entries
