"""DDP on the drop-in backend (zipccl.backend) with raw and lossless forced, in each of DDP's
modes (the default, create_graph, static_graph, find_unused_parameters,
gradient_as_bucket_view, no_sync), against plain torch: each rank's local gradients, gathered
over a plain gloo group and averaged as DDP does (each scaled by 1/world, summed in rank
order, in fp32). On 2 ranks that sum has two terms, so every summation order gives the same
bits and the comparison is exact, for DDP on gloo as well (which checks the reference).

torch's own DistributedTest.test_ddp_create_graph on this backend with lossless forced (both
ranks died with SIGSEGV there before commit 511d8ee; about 100 s on 2 cores, so run by hand:
tests/torch_ddp_suite.py says how).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from workers import Pool, Restarting

pytestmark = pytest.mark.timeout(600)

WORLD = 2
CODECS = ("raw", "lossless")
MODES = ("default", "create_graph", "static_graph", "find_unused_parameters", "gradient_as_bucket_view",
         "no_sync")


def ddp_groups(nranks: int) -> dict:
    """On every rank: a zipccl group per forced codec, and plain gloo (DDP's baseline and the
    reference's gather)."""
    from zipccl.backend import Options
    ranks = list(range(nranks))
    out = {c: dist.new_group(ranks, backend="zipccl", pg_options=Options(codec=c)) for c in CODECS}
    out["gloo"] = dist.new_group(ranks, backend="gloo")
    return out


@pytest.fixture(scope="module")
def dpool():
    """The file's pool of 2 ranks, started again after a test ended it."""
    pools = Restarting(lambda: Pool(WORLD, backend="zipccl", more_groups=ddp_groups))
    yield pools
    pools.close()


class _Net(torch.nn.Module):
    """Several buckets (at bucket_cap_mb=0.01). For find_unused_parameters two more layers:
    ``branch``, used only where the input asks, and ``unused``, never used. For create_graph
    one parameter: torch's DDP raises "a leaf Variable that requires grad is being used in an
    in-place operation" in backward(create_graph=True) on a model of several parameters, on
    gloo too (torch 2.13.0); torch's own test has one."""

    def __init__(self, mode: str = "default"):
        super().__init__()
        torch.manual_seed(0)
        if mode == "create_graph":
            self.body, self.head = torch.nn.Identity(), torch.nn.Linear(24, 5, bias=False)
        else:
            self.body = torch.nn.Sequential(torch.nn.Linear(24, 96), torch.nn.Tanh(), torch.nn.Linear(96, 96),
                                            torch.nn.Tanh())
            self.head = torch.nn.Linear(96, 5)
        if mode == "find_unused_parameters":
            self.branch = torch.nn.Linear(96, 5)
            self.unused = torch.nn.Linear(96, 5)

    def forward(self, x, use_branch=False):
        h = self.body(x)
        return self.head(h) + self.branch(h) if use_branch else self.head(h)


def _average(model, gloo) -> list:
    """DDP's average of every rank's local gradients of ``model``, in plain torch: gathered (an
    exact copy), each scaled by 1/world, summed in rank order in fp32; a parameter that no rank
    used stays None, one that some rank left unused counts zeros there."""
    out = []
    for p in model.parameters():
        used = torch.tensor([p.grad is not None], dtype=torch.int32)
        dist.all_reduce(used, group=gloo)
        if not used.item():
            out.append(None)
            continue
        g = torch.zeros_like(p) if p.grad is None else p.grad.detach()
        parts = [torch.empty_like(g) for _ in range(WORLD)]
        dist.all_gather(parts, g.contiguous(), group=gloo)
        acc = torch.zeros_like(parts[0])
        for part in parts:
            acc = acc + part * (1.0 / WORLD)
        out.append(acc)
    return out


def _train(rank, groups, backend, mode, steps=3, micro=3):
    """DDP over ``groups[backend]`` in ``mode`` and, beside it, the same model without DDP whose
    gradients are averaged by ``_average``; both step with SGD. Returns the mismatches (step,
    what, parameter index) and zipccl's statistics."""
    import zipccl
    group, gloo = groups[backend], groups["gloo"]
    kwargs = dict(static_graph=mode == "static_graph", find_unused_parameters=mode == "find_unused_parameters",
                  gradient_as_bucket_view=mode == "gradient_as_bucket_view")
    ddp, ref = DDP(_Net(mode), process_group=group, bucket_cap_mb=0.01, **kwargs), _Net(mode)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, ref))
    gen = torch.Generator().manual_seed(1000 + rank)
    zipccl.reset_stats()
    bad = []
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        branch = mode == "find_unused_parameters" and rank == 0  # rank 1 leaves it unused
        for k in range(micro if mode == "no_sync" else 1):
            x, y = torch.randn(8, 24, generator=gen), torch.randn(8, 5, generator=gen)
            local = mode == "no_sync" and k < micro - 1  # accumulate without communication
            for model in (ddp, ref):
                with ddp.no_sync() if local and model is ddp else contextlib.nullcontext():
                    loss = torch.nn.functional.mse_loss(model(x, branch), y)  # no_sync covers the forward
                    loss.backward(create_graph=mode == "create_graph")
        want = _average(ref, gloo)
        for i, (p, w) in enumerate(zip(ddp.module.parameters(), want)):
            if (p.grad is None) != (w is None) or (w is not None and not torch.equal(p.grad.detach(), w)):
                bad.append((step, "grad", i))
            if mode == "create_graph" and w is not None and not p.grad.requires_grad:
                bad.append((step, "grad without graph", i))
        for p, w in zip(ref.parameters(), want):
            p.grad = w
        with torch.no_grad():
            opt.step()
            ref_opt.step()
        for i, (p, q) in enumerate(zip(ddp.module.parameters(), ref.parameters())):
            if not torch.equal(p.detach(), q.detach()):
                bad.append((step, "param", i))
    return bad, zipccl.stats()


@pytest.mark.parametrize("mode", MODES)
def test_ddp_modes_match_plain_torch(dpool, mode):
    """Each mode on gloo, raw and lossless: bit-identical gradients and parameters to plain
    torch at every step; zipccl took the all-reduces (forced codecs take every float tensor)."""
    for backend in ("gloo",) + CODECS:
        out = dpool().run(_train, backend, mode, timeout=180)
        for rank, value in enumerate(out):
            assert not isinstance(value, BaseException), f"{backend} rank {rank}: {value!r}"
            bad, stats = value
            assert bad == [], f"{backend} {mode} rank {rank}: differs from plain torch at {bad[:8]}"
            calls = stats.get("all_reduce", {}).get("calls", 0)
            if backend == "gloo":
                assert calls == 0, stats
            else:
                assert calls >= 3, stats  # 3 steps, a bucket or more each
                assert stats["last"]["codec"] == backend, stats["last"]


def _torch_create_graph(rank, groups, backend):
    """torch's DistributedTest.test_ddp_create_graph: a scalar parameter, six backward passes
    with create_graph=True and no zero_grad; the gradients accumulate to 2, 4, ..., 12."""
    import zipccl

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self):
            return self.p.pow(2)

    zipccl.reset_stats()
    ddp = DDP(Model(), process_group=groups[backend])
    seen = []
    for _ in range(6):
        ddp().backward(create_graph=True)
        seen.append((ddp.module.p.grad.item(), ddp.module.p.grad.requires_grad))
    return seen, zipccl.stats().get("all_reduce", {}).get("calls", 0)


@pytest.mark.parametrize("backend", CODECS)
def test_torch_create_graph_case(dpool, backend):
    """The case that killed both ranks with SIGSEGV in the reducer (zipccl.backend._Work)."""
    out = dpool().run(_torch_create_graph, backend, timeout=120)
    for rank, value in enumerate(out):
        assert not isinstance(value, BaseException), f"rank {rank}: {value!r}"
        seen, calls = value
        assert seen == [(2.0 * (i + 1), True) for i in range(6)], seen
        assert calls == 6


def _failing_bucket(rank, groups):
    """A zipccl all-reduce that fails inside DDP's backward: the reducer must raise, not crash."""
    import zipccl.backend
    ddp = DDP(_Net(), process_group=groups["lossless"], bucket_cap_mb=0.01)
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(rank))
    api_all_reduce = zipccl.backend.api.all_reduce

    def broken(*args, **kwargs):
        raise ValueError(f"bucket refused on rank {rank}")

    zipccl.backend.api.all_reduce = broken
    try:
        ddp(x).square().mean().backward()
    except RuntimeError as e:
        return str(e)
    finally:
        zipccl.backend.api.all_reduce = api_all_reduce
    return "no error"


def test_failed_all_reduce_raises_in_backward(dpool):
    """The reducer reads the Work's future from C++: a failure there raises a RuntimeError that
    names the error, on every rank, and the pool's processes live on."""
    pool = dpool()
    out = pool.run(_failing_bucket, timeout=120)
    for rank, value in enumerate(out):
        assert isinstance(value, str) and f"ValueError: bucket refused on rank {rank}" in value, value
    assert pool.alive


def _work_contract(rank, groups, backend):
    """What a Work of an async all-reduce gives: result() and get_future().value() are the
    tensor itself, reduced; after a failure, wait() and result() raise the call's error and the
    future raises in C++ (a RuntimeError naming it)."""
    import zipccl.backend
    t = torch.full((3000,), float(rank + 1))
    work = dist.all_reduce(t, group=groups[backend], async_op=True)
    out = dict(result=work.result()[0] is t, future=work.get_future().wait()[0] is t, sum=t.eq(3.0).all().item())
    api_all_reduce = zipccl.backend.api.all_reduce

    def broken(*args, **kwargs):
        raise ValueError("refused")

    zipccl.backend.api.all_reduce = broken
    try:
        work = dist.all_reduce(t, group=groups[backend], async_op=True)
        for name, call in (("wait", work.wait), ("result", work.result), ("future", work.get_future().wait)):
            try:
                call()
                out[name + " error"] = None
            except Exception as e:  # the test asserts which
                out[name + " error"] = f"{type(e).__name__}: {e}"
    finally:
        zipccl.backend.api.all_reduce = api_all_reduce
    return out


@pytest.mark.parametrize("backend", CODECS)
def test_work_gives_what_gloo_gives(dpool, backend):
    res = dpool().run(_work_contract, backend, timeout=120)
    for value in res:
        assert not isinstance(value, BaseException), value
        assert value["result"] and value["future"] and value["sum"], value
        assert value["wait error"] == value["result error"] == "ValueError: refused", value
        assert value["future error"].startswith("RuntimeError: ") and "ValueError: refused" in value["future error"]
