"""zipccl.fsdp: FSDP2 custom comms against FSDP2's default and plain torch, every op and divide
factor, the layer rules, error feedback across steps and checkpoints, HSDP, the FSDP1 hook, and
the example's smoke runs."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zipccl.fsdp
from zipccl.fsdp import EXACT, Rule, TAGC_RULES, group_of

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[1]


class _Net(torch.nn.Module):
    """Named like a transformer layer: attention exact, MLP lossy when opted in."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(16, 128)
        self.attn = torch.nn.Linear(128, 128)
        self.norm = torch.nn.LayerNorm(128)
        self.fc = torch.nn.Linear(128, 256)
        self.out = torch.nn.Linear(256, 4)

    def forward(self, x):
        h = self.emb(x)
        h = h + self.attn(h)
        return self.out(torch.nn.functional.gelu(self.fc(self.norm(h))))


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _inputs(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _sharded(group, setup=None, mp=None):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = DeviceMesh.from_group(group, "cpu")
    model = _net()
    kw = dict(mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
    for m in (model.emb, model.attn, model.fc, model.out):
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    if setup is not None:
        setup(model)
    return model


def _digest(model) -> tuple[str, torch.Tensor]:
    flat = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest(), flat


def _train(rank, groups, n, comm, steps, lossy=None, mp=None):
    if rank >= n:
        return None
    model = _sharded(groups[n], mp=mp)
    comms = None
    if comm != "torch":
        comms = zipccl.fsdp.compress(model, codec=comm, lossy=lossy, min_numel=0, density=0.05, sampled=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = _inputs(rank, step)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    digest, flat = _digest(model)
    return dict(digest=digest, params=flat, stats=comms.stats() if comms else None,
                groups=comms.groups() if comms else None)


@pytest.mark.parametrize("n", [2, 4])
def test_custom_comms_match_fsdp2_default(pool, n):
    """raw and lossless give the same bits; on 2 ranks (a sum of two is the same in any order) also
    FSDP2's default's bits, on 4 its values within summation-order tolerance."""
    steps = 8
    runs = {c: pool.run(_train, n, c, steps, timeout=400)[:n] for c in ("torch", "raw", "lossless")}
    for c, res in runs.items():
        assert all(not isinstance(r, BaseException) for r in res), res
        assert len({r["digest"] for r in res}) == 1, f"{c}: ranks differ"
    assert runs["lossless"][0]["digest"] == runs["raw"][0]["digest"]
    if n == 2:
        assert runs["raw"][0]["digest"] == runs["torch"][0]["digest"]
    else:
        torch.testing.assert_close(runs["raw"][0]["params"], runs["torch"][0]["params"], rtol=1e-5, atol=1e-6)
    st = runs["lossless"][0]["stats"]
    assert st["reduce_scatter"]["calls"] == steps * 5 and st["all_gather"]["calls"] >= steps * 5
    assert 0 < st["wire_bytes"] < st["raw_bytes"]


def _issued(rank, groups, n, late: float):
    """Rank 1 comes ``late`` seconds after rank 0 to an all-gather and an async reduce-scatter:
    how long each of rank 0's calls took to return, whether its Work was done then, and the
    results after ``wait()``, against plain torch on every rank's input (sums in rank order)."""
    import time
    if rank >= n:
        return None
    group = groups[n]
    ag, rs = zipccl.fsdp.AllGather("lossless"), zipccl.fsdp.ReduceScatter("lossless")
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    whole = torch.cat(inputs)
    out, shard, sync = torch.empty(n * 1000), torch.empty(1000), torch.empty(1000)
    if rank == 1:
        time.sleep(late)
    t0 = time.monotonic()
    works = [ag(out, inputs[rank].clone(), group),
             rs(shard, whole * (rank + 1), group, dist.ReduceOp.SUM, async_op=True)]
    returned = time.monotonic() - t0
    done_at_return = [w.is_completed() for w in works]
    for w in works:
        w.wait()
    unawaited = rs(sync, whole.clone(), group, dist.ReduceOp.SUM)  # FSDP2's call: done when it returns
    total = whole * 1
    for r in range(1, n):
        total = total + whole * (r + 1)
    mine = slice(rank * 1000, (rank + 1) * 1000)
    return dict(returned=returned, done=done_at_return, works=[isinstance(w, dist.Work) for w in works],
                gathered=torch.equal(out, whole), reduced=torch.equal(shard, total[mine]),
                sync=unawaited is None and torch.equal(sync, (whole + whole)[mine]))


def test_all_gather_and_async_reduce_scatter_return_before_the_data_moves(pool):
    """FSDP2's custom all-gather returns a torch Work at once (FSDP waits for it before its
    copy-out), as does the reduce-scatter given async_op=True: with the peer 2 s late, rank 0's
    calls return well before, their Works not done; after wait() the results are plain torch's."""
    res = pool.run(_issued, 2, 2.0, timeout=120)
    assert all(not isinstance(r, BaseException) for r in res), res
    first = res[0]
    assert first["returned"] < 1.0 and first["done"] == [False, False], first
    for r in res[:2]:
        assert r["works"] == [True, True] and r["gathered"] and r["reduced"] and r["sync"], r


def _ops(rank, groups, n, dtype):
    """One ReduceScatter call per op on exactly summable data, against plain torch on every rank's input."""
    if rank >= n:
        return None
    g = groups[n]
    chunk = 1000
    inputs = [(torch.randint(-64, 64, (n * chunk,), generator=torch.Generator().manual_seed(r)) / 8).to(dtype)
              for r in range(n)]
    out = {}
    ops = {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM,
           "premul": dist.distributed_c10d._make_nccl_premul_sum(1 / 3) if hasattr(dist.distributed_c10d,
                                                                                   "_make_nccl_premul_sum")
           else None}
    if ops["premul"] is None:  # FSDP's own way of making it (set_gradient_divide_factor)
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
        ops["premul"] = _get_gradient_divide_factors(g, None, torch.float32, "cpu", 3.0)[2]
    for codec in ("raw", "lossless"):
        for name, op in ops.items():
            rs = zipccl.fsdp.ReduceScatter(codec)
            inp = rs.allocate((n * chunk,), dtype=dtype, device=torch.device("cpu"))
            inp.copy_(inputs[rank])
            output = rs.allocate((chunk,), dtype=dtype, device=torch.device("cpu"))
            assert rs(output, inp, g, op) is None  # complete on return
            parts = [x[rank * chunk:(rank + 1) * chunk] for x in inputs]
            if name == "premul":
                parts = [p * op.factor for p in parts]
            acc = torch.zeros(chunk, dtype=torch.float32)
            for p in parts:  # rank order, fp32
                acc += p.float()
            want = (acc / n if name == "avg" else acc).to(dtype)
            out[(codec, name)] = bool(torch.equal(output.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                                  want.view(torch.int16 if dtype != torch.float32 else torch.int32)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_op_against_plain_torch(pool, dtype):
    for res in pool.run(_ops, 4, dtype, timeout=300)[:4]:
        assert not isinstance(res, BaseException), res
        assert all(res.values()), res


def _divide(rank, groups, n, how):
    """FSDP2's divide factors end to end: the sharded gradients against plain torch's sum of every
    rank's gradient, scaled as the setting says."""
    if rank >= n:
        return None
    g = groups[n]
    model = _sharded(g)
    factor = {"default": n, "factor": 3.0, "force_sum": n}[how]
    for m in model.modules():  # per FSDP module: the setters do not recurse
        if how == "factor" and hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(3.0)
        elif how == "force_sum" and hasattr(m, "set_force_sum_reduction_for_comms"):
            m.set_force_sum_reduction_for_comms(True)
    zipccl.fsdp.compress(model, codec="lossless")
    x, y = _inputs(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    got = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    want = {}
    for r in range(n):  # independent: every rank's gradient from an unsharded copy
        ref = _net()
        xr, yr = _inputs(r, 0)
        torch.nn.functional.mse_loss(ref(xr), yr).backward()
        for name, p in ref.named_parameters():
            want[name] = want.get(name, 0) + p.grad
    return all(torch.allclose(got[k], want[k] / factor, rtol=1e-5, atol=1e-7) for k in want)


@pytest.mark.parametrize("how", ["default", "factor", "force_sum"])
def test_divide_factors_end_to_end(pool, how):
    res = pool.run(_divide, 4, how, timeout=200)[:4]
    assert res == [True] * 4, res


def test_rules_by_name_and_type():
    net = _net()
    named = dict(net.named_modules())
    assert group_of("attn", named["attn"], min_numel=0) == EXACT            # by name
    assert group_of("fc", named["fc"], min_numel=0) == "mlp"
    assert group_of("norm", named["norm"], min_numel=0) == EXACT            # 1-D parameters only
    assert group_of("fc", named["fc"]) == EXACT                             # 33K elements < MIN_NUMEL
    emb = torch.nn.Embedding(1000, 100)
    assert group_of("layers.0.lookup", emb) == "embedding"                  # by type
    assert group_of("blocks.3.mlp.c_proj", torch.nn.Linear(300, 300)) == "mlp"
    assert group_of("blocks.3.attn.c_proj", torch.nn.Linear(300, 300)) == EXACT  # attention wins, first rule
    assert group_of("head", torch.nn.Linear(300, 300)) == EXACT             # no rule: exact
    assert group_of("fc_out", torch.nn.Linear(300, 300)) == EXACT           # whole components only
    mine = (Rule("big", types=(torch.nn.Linear,)),)
    assert group_of("attn", torch.nn.Linear(300, 300), mine) == "big"       # the rules are data
    assert group_of("blocks.0.out", torch.nn.Linear(300, 300), TAGC_RULES + (Rule("mlp", names=("out",)),)) == "mlp"
    with pytest.raises(ValueError, match="FSDP modules"):
        zipccl.fsdp.compress(net)
    with pytest.raises(ValueError, match="lossy"):
        zipccl.fsdp.compress(net, lossy="zip")
    with pytest.raises(ValueError, match="codec"):
        zipccl.fsdp.compress(net, codec="topk")


def _rules_in_fsdp(rank, groups, n):
    """One backward with raw comms and one with lossy top-k: exact modules' gradients equal bit
    for bit, lossy modules' differ."""
    if rank >= n:
        return None
    out = {}
    for lossy in (None, "topk"):
        model = _sharded(groups[n])
        comms = zipccl.fsdp.compress(model, codec="raw", lossy=lossy, min_numel=0, density=0.05, sampled=False)
        x, y = _inputs(rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        out[lossy] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        groups_ = comms.groups()
    return groups_, out


def test_rules_decide_per_fsdp_module(pool):
    for res in pool.run(_rules_in_fsdp, 2)[:2]:
        assert not isinstance(res, BaseException), res
        groups_, out = res
        assert groups_ == {"": EXACT, "emb": "embedding", "attn": EXACT, "fc": "mlp", "out": EXACT}
        for name in out[None]:
            same = torch.equal(out[None][name], out["topk"][name])
            assert same == (not name.startswith(("fc.", "emb."))), name


def _feedback(rank, groups, n, split):
    """Lossy steps; with ``split`` the comms are rebuilt after 2 steps from a saved state dict
    (or, split == "fresh", without it; "saved before marks": a state dict of the keys before 0c38f11)."""
    if rank >= n:
        return None
    model = _sharded(groups[n])
    make = lambda: zipccl.fsdp.compress(model, codec="lossless", lossy="topk", min_numel=0, density=0.05,  # noqa
                                        sampled=False)
    info = {"fsdp_pre_hooks": len(model._forward_pre_hooks)}
    comms = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        if step == 2 and split:
            buf = io.BytesIO()
            torch.save(comms.state_dict(), buf)
            comms = make()
            if split in ("load", "saved before marks"):
                buf.seek(0)
                state = torch.load(buf, weights_only=False)
                if split == "saved before marks":  # the keys of zipccl before 0c38f11
                    for s in state.values():
                        del s["order"], s["last"]
                        s["anchor"] = "fc" if "fc" in s["residuals"] else "emb"
                comms.load_state_dict(state)
        x, y = _inputs(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 0:
            res = comms.state_dict()["mlp"]["residuals"]["fc"]
            padded = sum(p.numel() for p in model.fc.parameters())
            info["residual"] = (res.numel(), padded, int((res == 0).sum()))
            kept = res.clone()
        if step == 1:  # a state dict is a snapshot: the next step does not write into it
            info["snapshot_kept"] = torch.equal(res, kept) and not torch.equal(
                comms.state_dict()["mlp"]["residuals"]["fc"], kept)
        opt.step()
        opt.zero_grad()
    info["digest"] = _digest(model)[0]
    info["densities"] = comms.stats()["densities"]
    info["steps"] = comms.state_dict()["mlp"]["step"]
    info["pre_hooks"] = len(model._forward_pre_hooks)  # FSDP's and compress's own, once however often it ran
    zipccl.fsdp.compress(model, codec="lossless")
    info["pre_hooks_without_lossy"] = len(model._forward_pre_hooks)
    return info


def _frozen_mid_training(rank, groups, n):
    """Lossy steps; at step 2 fc's bias is frozen, so FSDP2 reduce-scatters fc's weight alone: fc's
    residual restarts from zeros then, and a RuntimeWarning naming fc says so, at that step only."""
    import warnings
    if rank >= n:
        return None
    model = _sharded(groups[n])
    comms = zipccl.fsdp.compress(model, codec="lossless", lossy="topk", min_numel=0, density=0.05, sampled=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    said = []
    for step in range(4):
        if step == 2:
            model.fc.bias.requires_grad_(False)
        x, y = _inputs(rank, step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.nn.functional.mse_loss(model(x), y).backward()
        said.append([str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "zipccl.fsdp" in
                     str(w.message)])
        opt.step()
        opt.zero_grad()
    return said, comms.state_dict()["mlp"]["residuals"]["fc"].numel(), model.fc.weight.numel()


def test_a_parameter_frozen_mid_training_restarts_its_modules_residual_and_says_so(pool):
    for r in pool.run(_frozen_mid_training, 2, timeout=300)[:2]:
        said, residual, weight = r
        assert [len(s) for s in said] == [0, 0, 1, 0] and "module 'fc'" in said[2][0], said
        assert residual == weight, r  # the weight alone now (bias: 256 elements fewer)


def _another_ranks_state(rank, groups, n):
    """One lossy step, then each rank loads the state that its neighbour saved, then its own."""
    if rank >= n:
        return None
    model = _sharded(groups[n])
    comms = zipccl.fsdp.compress(model, codec="lossless", lossy="topk", min_numel=0, density=0.05, sampled=False)
    x, y = _inputs(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    states = [None] * n
    dist.all_gather_object(states, comms.state_dict(), group=groups[n])
    try:
        comms.load_state_dict(states[(rank + 1) % n])
        out = "loaded"
    except ValueError as e:
        out = str(e)
    comms.load_state_dict(states[rank])
    return out, dist.get_world_size()


def test_a_state_saved_by_another_rank_is_refused(pool):
    """Residuals are laid out by the rank's shards: another rank's (or world's) state was loaded
    and applied at the wrong positions, or dropped where the sizes differed. (The job's ranks
    are recorded: the pool's world is larger than the FSDP group.)"""
    for rank, res in enumerate(pool.run(_another_ranks_state, 2)[:2]):
        assert not isinstance(res, BaseException), res
        said, world = res
        assert f"saved by rank {1 - rank} of {world}, and this is rank {rank} of {world}" in said, said


def test_error_feedback_across_steps_and_checkpoints(pool):
    runs = {s: pool.run(_feedback, 2, s, timeout=300)[:2] for s in (None, "load", "fresh", "saved before marks")}
    for s, res in runs.items():
        assert all(not isinstance(r, BaseException) for r in res), (s, res)
        assert res[0]["digest"] == res[1]["digest"], s
        assert [(r["pre_hooks"] - r["fsdp_pre_hooks"], r["pre_hooks_without_lossy"] - r["fsdp_pre_hooks"])
                for r in res] == [(1, 0)] * 2, s
    whole = runs[None][0]
    assert whole["snapshot_kept"] is True
    numel, padded, zeros = whole["residual"]
    assert numel >= padded  # this rank's whole (padded) contribution to the module
    k = round(0.05 * numel)
    assert k <= zeros < k + numel // 100  # the sent entries are cleared, the rest kept
    assert whole["densities"] == {"mlp": [0.05] * 4, "embedding": [0.05] * 4} and whole["steps"] == 3
    assert runs["load"][0]["digest"] == whole["digest"]    # the checkpoint carried the residuals
    assert runs["saved before marks"][0]["digest"] == whole["digest"]
    assert runs["fresh"][0]["digest"] != whole["digest"]   # and they matter


def _sgd_steps(model, rank: int, steps: int = 10) -> None:
    """``steps`` steps of SGD with momentum on this rank's inputs."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        x, y = _inputs(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _hsdp(rank, groups, comm, how="default", steps=10):
    """HSDP on a 2 x 2 mesh: torch's own, or FSDP on the shard dimension with zipccl's replicate
    hook; ``how``: a divide factor equal to the shard size (2: the reduce-scatter then averages),
    or forced sums with a factor of 8."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _net()
    fsdp_mesh = mesh if comm == "torch" else mesh["shard"]
    for m in (model.emb, model.attn, model.fc, model.out):
        fully_shard(m, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    if comm != "torch":
        zipccl.fsdp.compress(model, codec=comm, replicate_group=mesh["replicate"].get_group())
    for m in model.modules():  # after compress: the hook reads the factor at each call
        if how in ("factor", "force_sum") and hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(2.0 if how == "factor" else 8.0)
            m.set_force_sum_reduction_for_comms(how == "force_sum")
    zipccl.reset_stats()
    if how in ("accumulate", "reset"):  # three microbatches a step, the replicate group reduced after the last
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if how == "reset":  # two microbatches, then the recovery from an exception mid-step: they are discarded
            for micro in range(2):
                model.set_requires_all_reduce(False)
                x, y = _inputs(rank, 100 + micro)
                torch.nn.functional.mse_loss(model(x), y).backward()
            model.reset_iter_state()
            opt.zero_grad()
            zipccl.reset_stats()
        for step in range(steps):
            for micro in range(3):
                model.set_requires_all_reduce(micro == 2)
                x, y = _inputs(rank, 3 * step + micro)
                torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    else:
        _sgd_steps(model, rank, steps)
    return _digest(model) + (zipccl.stats().get("all_reduce", {}).get("calls", 0),)


def test_hsdp_replicate_all_reduce_through_zipccl(pool):
    runs = {c: pool.run(_hsdp, c, timeout=300) for c in ("torch", "raw", "lossless")}
    for c, res in runs.items():
        assert all(not isinstance(r, BaseException) for r in res), (c, res)
        assert len({r[0] for r in res}) == 1, c
    assert runs["raw"][0][0] == runs["lossless"][0][0]
    torch.testing.assert_close(runs["raw"][0][1], runs["torch"][0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["factor", "force_sum", "accumulate", "reset"])
def test_hsdp_replicate_all_reduce_keeps_the_divide_factor_and_accumulation(pool, how):
    """With a divide factor the replicate group sums (the factor is the whole division), as
    torch's own HSDP: the same parameters after two steps. With gradient accumulation
    (``set_requires_all_reduce(False)`` but on each step's last microbatch) the replicate group
    is reduced once a step, each FSDP module's shard of the step's microbatches together; after
    ``reset_iter_state()`` (an exception mid-step) without what the reset discarded."""
    runs = {c: pool.run(_hsdp, c, how, 2, timeout=300) for c in ("torch", "raw")}
    for c, res in runs.items():
        assert all(not isinstance(r, BaseException) for r in res), (c, res)
    torch.testing.assert_close(runs["raw"][0][1], runs["torch"][0][1], rtol=1e-5, atol=1e-6)
    if how in ("accumulate", "reset"):
        assert runs["raw"][0][2] == 2 * 5, runs["raw"][0][2]  # a step's: the model's and its four modules'


def _fsdp1(rank, groups, n, comm, strategy):
    if rank >= n:
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    model = FSDP(_net(), process_group=groups[n], device_id=torch.device("cpu"),
                 sharding_strategy=getattr(ShardingStrategy, strategy), use_orig_params=True)
    state = None
    if comm != "torch":
        state = zipccl.fsdp.State1(groups[n], codec=comm)
        model.register_comm_hook(state, zipccl.fsdp.hook1)
    _sgd_steps(model, rank)
    with FSDP.summon_full_params(model):
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest(), flat, state.counters.calls if state else None


def _hook1_counters(rank, groups):
    """hook1's all-reduce (NO_SHARD) of 3 and of 1001 elements on 4 ranks, raw: its counters."""
    state = zipccl.fsdp.State1(groups[4], codec="raw")
    for numel in (3, 1001):
        zipccl.fsdp.hook1(state, torch.ones(numel))
    return state.counters.as_dict()


def test_fsdp1_hook_counts_the_raw_bytes_of_padded_chunks(pool):
    """Under raw the all-reduce sends what it would send uncompressed: each rank's chunk, padded
    to ceil(elements / ranks), 2 (ranks - 1) times. The counters floored the chunk: a 3-element gradient
    counted 0 raw bytes, a 1001-element one a ratio of 1.004."""
    for c in pool.run(_hook1_counters):
        assert c["raw_bytes"] == c["wire_bytes"] == 2 * 3 * (1 + 251) * 4, c


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_fsdp1_hook_against_its_default(pool, strategy):
    runs = {c: pool.run(_fsdp1, 2, c, strategy, timeout=300)[:2] for c in ("torch", "raw", "lossless")}
    for c, res in runs.items():
        assert all(not isinstance(r, BaseException) for r in res), (c, res)
        assert res[0][0] == res[1][0], c
    assert runs["raw"][0][0] == runs["lossless"][0][0] == runs["torch"][0][0]  # 2 ranks: any order, same sums
    assert runs["lossless"][0][2] == 10


def _example(tmp_path, *args, **env) -> dict:
    out = tmp_path / f"{'_'.join(a.strip('-') for a in args)}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    subprocess.run([sys.executable, str(ROOT / "examples" / "fsdp_gpt.py"), "--steps", "3", "--d-model", "64",
                    "--layers", "1", "--ctx", "32", "--batch", "2", "--text-bytes", "200000", "--json", str(out),
                    *args], check=True, timeout=500, env=env, cwd=ROOT)
    return json.loads(out.read_text())


def test_example_smoke(tmp_path):
    """examples/fsdp_gpt.py on a mesh of 2: zipccl's lossless comms, and FSDP2 unchanged on the
    drop-in backend (ZIPCCL_CODEC=lossless), each give plain FSDP2's parameters bit for bit (a
    sum of two is the same in any order) with fewer bytes on the wire; TAGC's rules per group."""
    plain = _example(tmp_path, "--mesh", "2", "--comm", "torch")
    lossless = _example(tmp_path, "--mesh", "2", "--comm", "lossless")
    dropin = _example(tmp_path, "--mesh", "2", "--backend", "zipccl", "--comm", "torch", ZIPCCL_CODEC="lossless")
    tagc = _example(tmp_path, "--mesh", "2", "--comm", "tagc", "--lossy", "topk", "--density", "0.1",
                    "--min-numel", "0", "--mp", "bf16")
    assert len(plain["losses"]) == 3 and plain["backend"] == "gloo" and dropin["backend"] == "zipccl"
    for run in (lossless, dropin):
        assert run["param_sha256"] == plain["param_sha256"] and run["losses"] == plain["losses"]
        assert 0 < run["wire_bytes_per_step"] < 0.9 * run["raw_bytes_per_step"]
    assert tagc["densities"] == {"mlp": [0.1] * 3, "embedding": [0.1] * 3}
    assert tagc["groups"]["blocks.0.fc"] == "mlp" and tagc["groups"]["blocks.0.qkv"] == "exact"
    assert tagc["reduce_scatter_wire_bytes_per_step"] < lossless["reduce_scatter_wire_bytes_per_step"]
