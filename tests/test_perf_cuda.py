"""zipccl-perf's CUDA options, checked without a GPU: the one-line refusal (exit 2) where CUDA is
missing, which runs they allow where it is there (a stand-in CUDA), the clock, the baseline
table, the buffers' device and the network lab's NCCL interface. The GPU runs themselves:
bench/gpu_check.sh and the gpu suite (docs/GPU.md)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zipccl import config
from zipccl.bench import all_gather, common, cuda, perf, reduce_scatter
from zipccl.bench.netlab import NetLab

ROOT = Path(__file__).resolve().parents[1]


CUDA_FLAGS = [
    ["--device", "cuda"],
    ["--device", "cuda", "--share-gpu", "--nranks", "4"],
    ["--share-gpu", "--collective", "reduce_scatter"],
    ["--transport", "nccl"],
    ["--device", "cuda", "--share-gpu", "--nranks", "2", "--netlab", "1gbit"],  # before any lab is built
]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK")


def _refused_in_one_line(code: int, out: str, err: str) -> None:
    assert code == 2 and out == "", (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("zipccl-perf: ") and "CUDA" in lines[0], lines[0]


@pytest.mark.timeout(240)
def test_without_cuda_one_line_and_exit_2():
    """The command as users run it: one line on stderr, nothing on stdout, exit 2."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")  # no CUDA, also on a GPU machine
    for k in LAUNCHER_VARS:
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "zipccl.bench", *CUDA_FLAGS[0]], capture_output=True, text=True,
                       env=env, timeout=200)
    _refused_in_one_line(r.returncode, r.stdout, r.stderr)


@pytest.mark.parametrize("flags", CUDA_FLAGS)
def test_every_cuda_option_without_cuda_is_refused_in_one_line(monkeypatch, capsys, flags):
    """The same refusal for every option that needs CUDA, from zipccl-perf's main in this process."""
    from zipccl.bench import perf
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    code = perf.main(list(flags))
    out, err = capsys.readouterr()
    _refused_in_one_line(code, out, err)


def _args(*flags: str) -> argparse.Namespace:
    ap = common.parser("zipccl-perf")
    cuda.add_options(ap)
    return ap.parse_args(list(flags))


@pytest.fixture
def one_gpu(monkeypatch):
    """torch as it looks on a machine with one GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_refusals_with_one_gpu(one_gpu):
    args = _args("--device", "cuda", "--nranks", "4")
    assert cuda.refusal(args, launched=False) == ("4 ranks need 4 CUDA devices and torch sees 1: add --share-gpu "
                                                  "(every rank on cuda:0, NCCL's socket transport between them)")
    assert cuda.refusal(_args("--device", "cuda", "--nranks", "1"), launched=False) is None
    assert cuda.refusal(_args("--device", "cuda", "--nranks", "4", "--share-gpu"), launched=False) is None
    assert cuda.refusal(_args("--device", "cuda", "--nranks", "4"), launched=True) is None  # the launcher's ranks
    assert cuda.refusal(_args("--device", "cuda", "--netlab", "1gbit"), launched=False) == \
        "--netlab on CUDA runs every rank on this machine's GPU: add --share-gpu"
    assert cuda.refusal(_args("--share-gpu", "--backend", "zipccl"), launched=False).startswith(
        "--backend zipccl times dist.* calls on CPU tensors")
    for flags in (["--share-gpu"], ["--transport", "auto"], ["--transport", "nccl"], ["--device", "cuda"]):
        args = _args("--nranks", "1", *flags)
        assert cuda.refusal(args, launched=False) is None and args.device == "cuda", flags
    args = _args()
    assert cuda.refusal(args, launched=False) is None and args.device == "cpu"


def test_the_transport_reaches_spawned_ranks(monkeypatch):
    monkeypatch.setattr(config, "TRANSPORT", config.TRANSPORT)
    monkeypatch.setenv("ZIPCCL_TRANSPORT", "torch")
    cuda.apply(_args())  # CPU: left alone
    assert os.environ["ZIPCCL_TRANSPORT"] == "torch"
    cuda.apply(argparse.Namespace(device="cuda", transport=None))
    assert os.environ["ZIPCCL_TRANSPORT"] == config.TRANSPORT == "nccl"
    cuda.apply(argparse.Namespace(device="cuda", transport="auto"))
    assert os.environ["ZIPCCL_TRANSPORT"] == config.TRANSPORT == "auto"


def test_nccl_baseline_first():
    assert cuda.with_baseline([("raw", "raw", "world"), ("auto", "auto", "world")], "torch") == \
        [("torch", None, "nccl"), ("raw", "raw", "world"), ("auto", "auto", "world")]
    assert cuda.with_baseline([("torch", None, "world"), ("lossless", "lossless", "world")], "torch") == \
        [("torch", None, "nccl"), ("lossless", "lossless", "world")]


def test_a_cuda_tables_line_names_its_pieces(monkeypatch):
    """The pipeline's piece size on CUDA, in the line each CUDA table opens with: an A/B of
    ZIPCCL_PIECE_BYTES reads in its record which pieces each table ran."""
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    args = argparse.Namespace(device="cuda", share_gpu=True)
    assert "NCCL 2.28.9;" in cuda.table_lines(args, 4)[0] and "pieces of 32 MiB;" in cuda.table_lines(args, 4)[0]
    monkeypatch.setattr(config, "PIECE_BYTES", 12 << 19)
    assert "pieces of 6 MiB;" in cuda.table_lines(args, 4)[0]


def test_on_cuda_every_table_runs_on_the_nccl_group():
    """zipccl's tables on CUDA run on the group the baseline uses, so that auto's native plan is
    that group's own NCCL collective (on the gloo world it would be gloo's, staged through the host)."""
    args = argparse.Namespace(datatype="bfloat16", op="sum", backend="gloo", codec="all", baseline=False)
    _, _, on_cuda = perf._plan(argparse.Namespace(**vars(args), device="cuda"))
    assert on_cuda == [("torch", None, "nccl")] + [(c, c, "nccl") for c in common.CODECS], on_cuda
    _, _, on_cpu = perf._plan(argparse.Namespace(**vars(args), device="cpu"))
    assert on_cpu == [(c, c, "world") for c in common.CODECS], on_cpu


def test_cpu_clock_times_the_host():
    t0 = time.perf_counter()
    clock = cuda.Clock("cpu")
    for pause in (0.01, 0.2):
        with clock:
            time.sleep(pause)
    first, second = clock.seconds()
    assert first >= 0.01 and second >= 0.2 and first + second <= time.perf_counter() - t0  # each call's own time


@pytest.mark.parametrize("spec,in_place", [(reduce_scatter.SPEC, True), (all_gather.SPEC, True),
                                           (all_gather.SPEC, False)])
def test_buffers_on_the_device_keep_nccl_tests_aliasing(spec, in_place):
    """The meta device stands in for CUDA: both buffers land there, in place as views of one."""
    out, inp = common.placed(spec, in_place, *spec.buffers(1024, 4), 1, 4, torch.bfloat16, "meta")
    assert out.device.type == inp.device.type == "meta"
    if in_place:
        view, whole = (out, inp) if spec.name == "reduce_scatter" else (inp, out)
        assert view._base is whole and view.storage_offset() == 1 * view.numel()
    else:
        assert out._base is None and inp._base is None


def test_netlab_ranks_use_their_veth_for_nccl():
    lab = NetLab(4, "10gbit", nodes=2)
    for rank, veth in ((0, "zcl-v0a"), (1, "zcl-v0a"), (2, "zcl-v1a"), (3, "zcl-v1a")):
        env = lab.env(rank, 29531)
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == veth
