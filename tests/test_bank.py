"""The fixed bank of codes of format version 2 (zipccl/bank.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zipccl import format as F
from zipccl.bank import BANK, BANK_SIZE
from zipccl.reference import tables as T

RECORD = Path(__file__).parents[1] / "docs" / "bench" / "2026-11-26-bank" / "block4096.json"
KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@pytest.mark.parametrize("dtype", list(KEYS), ids=str)
def test_bank_is_the_recorded_derivation(dtype):
    """zipccl's bank is the bank of 32 that bench/bank_design.py derived and recorded."""
    recorded = json.loads(RECORD.read_text())["banks"][KEYS[dtype]][str(BANK_SIZE)]
    assert BANK[dtype].shape == (BANK_SIZE, F.NSYM)
    assert BANK[dtype].tolist() == recorded


@pytest.mark.parametrize("dtype", list(KEYS), ids=str)
def test_every_entry_is_a_complete_prefix_code(dtype):
    """Every entry codes every symbol in 1..MAXLEN bits with Kraft sum exactly 1, and passes the
    decoder's table check; no two entries are the same."""
    for row in BANK[dtype]:
        assert row.min() >= 1 and row.max() <= F.MAXLEN
        assert int((1 << (F.MAXLEN - row)).sum()) == 1 << F.MAXLEN
        T._unpack_table(T.pack_tables(row[None])[:F.TABLE_BYTES].tobytes())
    assert len({row.tobytes() for row in BANK[dtype]}) == BANK_SIZE
