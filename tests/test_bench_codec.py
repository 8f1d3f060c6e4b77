"""The codec benchmark smoke-runs at a tiny size, so that it cannot rot."""

import json

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
