"""The codec benchmark smoke-runs at a tiny size, so that it cannot rot."""

import json

import torch

from zipccl.bench import codec as bench


def test_codec_bench_smoke(tmp_path, capsys):
    out = tmp_path / "codec.json"
    assert bench.main(["--size", "3000", "--repeat", "1", "--dtypes", "bf16,fp32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert "zipccl-lossless" in table and "memcpy" in table
    names = {r["codec"] for r in rows}
    assert {"zipccl-lossless", "memcpy"} <= names
    for r in rows:
        assert r["roundtrip_ok"], r
        assert r["bytes"] in (6000, 12000) and r["ratio"] > 0 and r["encode_GBps"] > 0
    ours = [r for r in rows if r["codec"] == "zipccl-lossless" and r["data"] == "gaussian" and r["dtype"] == "bf16"]
    assert ours and ours[0]["ratio"] < 0.75


def test_trained_gradients_are_real():
    g = bench.train_small_model_grads(steps=2)
    assert g.dtype.is_floating_point and g.numel() > 100_000
    assert (g != 0).float().mean() > 0.5


def test_codec_stages_smoke():
    """bench/codec_stages.py (where the codec's time goes) runs every stage for every dtype."""
    import importlib.util
    from pathlib import Path

    import torch

    spec = importlib.util.spec_from_file_location("codec_stages", Path(__file__).parents[1] / "bench/codec_stages.py")
    stages_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stages_mod)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(20_000, generator=torch.Generator().manual_seed(1)) * 1e-3).to(dtype)
        stages = stages_mod.stages(x)
        assert set(stages) == {"analyse", "tables", "pack", "plan", "rest", "encode (all)", "decode kernel",
                               "decode (all)"}
        assert all(stages_mod.best(fn, 2) > 0 for fn in stages.values())


def test_format_alternatives_smoke(tmp_path):
    """bench/format_alternatives.py (the ratio table of docs/FORMAT.md, format version 1's layout)
    runs and gives every row a ratio."""
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    data = tmp_path / "grads.npy"
    np.save(data, (np.random.default_rng(0).standard_normal(50_000) * 1e-3).astype(np.float32))
    script = Path(__file__).parents[1] / "bench/format_alternatives.py"
    out = subprocess.run([sys.executable, str(script), str(data)], capture_output=True, text=True, timeout=300,
                         check=True).stdout
    ratios = [float(line.split("|")[-2]) for line in out.splitlines() if line.startswith("|")]
    assert len(ratios) == 17 and all(0.5 < r < 1.0 for r in ratios), out


def test_bank_design_smoke(tmp_path):
    """bench/bank_design.py (the bank of codes' ratio in docs/FORMAT.md) runs on a tiny bucket and
    model, and its model of block sizes matches today's encoder (the script asserts it)."""
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    data = tmp_path / "grads.npy"
    np.save(data, (np.random.default_rng(0).standard_normal(20_000) * 1e-3).astype(np.float32))
    script = Path(__file__).parents[1] / "bench/bank_design.py"
    out = subprocess.run([sys.executable, str(script), "--data", str(data), "--sizes", "2,4", "--steps", "3",
                          "--width", "16", "--layers", "1", "--json", str(tmp_path / "bank.json")],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [line.split("|")[3:-1] for line in out.splitlines() if line.startswith("| ") and "tensor" not in line]
    assert len(rows) == 8 and all(0.4 < float(r) <= 1.001 for row in rows for r in row), out
    # the last column, a free optimal code per block, bounds today's tables and every bank
    assert all(float(row[-1]) <= min(float(r) for r in row[:-1]) for row in rows), out
    assert json.loads((tmp_path / "bank.json").read_text())["banks"]["fp16"]["4"]


def test_format_alternatives_float16_splits():
    """--float16's bound, on blocks whose every element is one value: one symbol, so one bit
    each (a Huffman code has no shorter word), plus the raw bits that each split leaves."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("format_alternatives",
                                                  Path(__file__).parents[1] / "bench/format_alternatives.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = dict(mod.float16_splits(torch.full((2 * 4096 + 5,), 1.5)))  # the 5 past whole blocks are left out
    assert rows == {"exponent (version 2's symbol)": (1 + 3 + 8) / 16, "exponent and top mantissa bit": (1 + 2 + 8) / 16,
                    "exponent and top two mantissa bits": (1 + 1 + 8) / 16}
