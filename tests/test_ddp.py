"""DDP comm hook: parity with DDP's own all-reduce, bit-identity lossless vs raw, state handling."""

from __future__ import annotations

import hashlib
import math
import pickle
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_wrapper
from torch.nn.parallel import DistributedDataParallel as DDP

import zipccl
import zipccl.ddp
import zipccl.rules
from zipccl.entropy import EntropyRate

pytestmark = pytest.mark.timeout(300)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.LayerNorm(256), torch.nn.GELU(),
                               torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))


def _train(rank, groups, mode, steps, gabv=False, static=False):
    if rank >= 2:
        return None
    g = groups[2]
    ddp = DDP(_model(), process_group=g, gradient_as_bucket_view=gabv, static_graph=static, bucket_cap_mb=0.05)
    state = None
    if mode in ("topk", "entropy"):
        rate = EntropyRate(min_density=0.01, max_density=0.3, warmup=3, every=2, sample=0.5)
        state = zipccl.ddp.State(group=g, codec=mode, density=0.1, rate=rate)
        ddp.register_comm_hook(state, zipccl.ddp.hook)
    elif mode != "torch":
        state = zipccl.ddp.State(group=g, codec="lossless" if mode.endswith("lossless") else "raw")
        hook = zipccl.ddp.hook
        if mode.startswith("bf16"):
            hook = zipccl.ddp.bf16_hook
        elif mode.startswith("torchbf16"):
            # PyTorch's wrapper; DDP refuses its name on CPU (CUDA/NCCL only), so rename the closure
            hook = bf16_compress_wrapper(zipccl.ddp.hook)
            hook.__name__ = "torch_bf16_wrapper_of_zipccl"
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randn(16, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    return dict(digest=hashlib.sha1(flat.numpy().tobytes()).hexdigest(), params=flat, losses=losses,
                stats=state.stats() if state else None)


@pytest.mark.parametrize("gabv,static", [(False, False), (True, False), (False, True)])
def test_hook_parity(pool, gabv, static):
    steps = 100
    runs = {mode: pool.run(_train, mode, steps, gabv, static, timeout=240)[:2] for mode in ("torch", "raw", "lossless")}
    for mode, res in runs.items():
        assert all(not isinstance(r, BaseException) for r in res), res
        assert res[0]["digest"] == res[1]["digest"], f"{mode}: ranks differ"
    assert runs["lossless"][0]["digest"] == runs["raw"][0]["digest"]  # lossless changes nothing
    assert runs["lossless"][0]["losses"] == runs["raw"][0]["losses"]
    assert runs["raw"][0]["digest"] == runs["torch"][0]["digest"]  # a sum of two is the same in any order
    st = runs["lossless"][0]["stats"]
    assert st["iterations"] == steps and 0 < st["wire_bytes"] < st["raw_bytes"]


def test_lossy_hooks_train_identically_on_every_rank(pool):
    lossless = pool.run(_train, "lossless", 12)[:2]
    for mode in ("topk", "entropy"):
        res = pool.run(_train, mode, 12, timeout=240)[:2]
        assert all(not isinstance(r, BaseException) for r in res), res
        assert res[0]["digest"] == res[1]["digest"], mode
        st = [r["stats"] for r in res]
        assert st[0]["densities"] == st[1]["densities"] and len(st[0]["densities"]) == 12
        assert st[0]["residual_bytes"] > 0
        assert st[0]["ratio"] < (0.35 if mode == "topk" else 0.9)  # entropy: lossless warm-up, densities <= 0.3
        assert bool(torch.isfinite(res[0]["params"]).all())
        assert res[0]["digest"] != lossless[0]["digest"]  # it really is lossy
        if mode == "entropy":
            assert st[0]["densities"][:3] == [None] * 3  # warm-up: lossless
            assert all(0.01 <= d <= 0.3 for d in st[0]["densities"][3:])
            assert st[0]["decisions"] == st[1]["decisions"]
        else:
            assert set(st[0]["densities"]) == {0.1}


class _SlowOnRankZero(torch.autograd.Function):
    """Identity; its backward sleeps on rank 0, so that DDP's buckets become ready at different
    times on the two ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if dist.get_rank() == 0:
            time.sleep(1.0)
        return g


def _steps(ddp, rank: int, forward_args, after=None) -> torch.Tensor:
    """One backward pass of ``ddp`` per item of ``forward_args`` (the forward's arguments after the
    input, 8 x 64 values seeded by rank), ``after()`` after each; the gradients, flat."""
    gen = torch.Generator().manual_seed(7 + rank)
    for args in forward_args:
        ddp.zero_grad()
        ddp(torch.randn(8, 64, generator=gen), *args).square().mean().backward()
        if after is not None:
            after()
    return torch.cat([p.grad.reshape(-1) for p in ddp.parameters() if p.grad is not None])


def _unused_parameters(rank, groups, codec):
    """DDP with find_unused_parameters=True (a layer no rank uses) and zipccl's hook: DDP
    all-reduces its map of used parameters on the group from autograd's thread, beside the
    hook's calls on zipccl's thread. Three steps, rank 0's backward 1 s slower in the middle."""
    if rank >= 2:
        return None
    g = groups[2]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.first, self.unused = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
            self.rest = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(6)))

        def forward(self, x):
            return self.rest(_SlowOnRankZero.apply(self.first(x)))

    ddp = DDP(Model(), process_group=g, find_unused_parameters=True, bucket_cap_mb=0.02)
    ddp.register_comm_hook(zipccl.ddp.State(group=g, codec=codec, density=0.1, rules=None), zipccl.ddp.hook)
    return _steps(ddp, rank, [()] * 3)


@pytest.mark.parametrize("codec", ["topk", "lossless"])
def test_find_unused_parameters_beside_the_hooks_calls(pool, codec):
    """The top-k hook's packets travel point to point, as every other of zipccl's messages: a
    collective of the group from zipccl's thread (its all-to-all, before) met DDP's own
    all-reduce of the unused map in another order on each rank, and gloo failed or hung."""
    a, b = pool.run(_unused_parameters, codec, timeout=120)[:2]
    assert torch.equal(a, b), (a - b).abs().max()


def _unused_last_bucket_skipped(rank, groups):
    """DDP's skip_all_reduce_unused_params with the model's first layer unused: its bucket, DDP's
    last, never reaches the hook, so no bucket of a step says it is the last. Three steps of
    top-k: each counted, each deciding its density once."""
    if rank >= 2:
        return None
    g = groups[2]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.unused = torch.nn.Linear(64, 64)
            self.rest = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))

        def forward(self, x):
            return self.rest(x)

    ddp = DDP(Model(), process_group=g, find_unused_parameters=True, bucket_cap_mb=0.001,
              skip_all_reduce_unused_params=True)
    state = zipccl.ddp.State(group=g, codec="topk", density=0.1, rules=None)
    ddp.register_comm_hook(state, zipccl.ddp.hook)
    grads = _steps(ddp, rank, [()] * 3)
    return state.stats(), grads


def test_steps_are_counted_where_ddp_skips_the_last_bucket(pool):
    (a, ga), (b, gb) = pool.run(_unused_last_bucket_skipped, timeout=120)[:2]
    assert a["iterations"] == b["iterations"] == 3, (a, b)
    assert a["densities"] == b["densities"] == [0.1] * 3, (a, b)
    assert torch.equal(ga, gb)


def _a_bucket_skipped_for_a_step(rank, groups):
    """skip_all_reduce_unused_params with layer ``b`` unused in step 3 alone: its bucket skips the
    hook that step; its residual (what top-k has not sent of b's gradients) is kept whole for
    step 4, not dropped as a bucket that DDP's rebuild replaced. The sums of |residual| of b's
    bucket after steps 2 and 3, and whether it is there after step 4."""
    if rank >= 2:
        return None
    g = groups[2]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = (torch.nn.Linear(64, 64) for _ in range(3))

        def forward(self, x, use_b):
            x = self.a(x)
            return self.c(self.b(x) if use_b else x)

    model = Model()
    ddp = DDP(model, process_group=g, find_unused_parameters=True, bucket_cap_mb=0.0001,
              skip_all_reduce_unused_params=True)
    state = zipccl.ddp.State(group=g, codec="topk", density=0.1, rules=None, model=model)
    ddp.register_comm_hook(state, zipccl.ddp.hook)
    sums = []

    def b_residual() -> None:
        keys = [k for k, parts in state.parts.items() if parts and any(n == "b.weight" for n, _ in parts)]
        sums.append(sum(float(state.residuals.store[k].abs().sum()) for k in keys if k in state.residuals.store))

    _steps(ddp, rank, [(use_b,) for use_b in (True, True, True, False, True)], b_residual)
    return sums


def test_a_bucket_that_ddp_skips_for_a_step_keeps_its_residual(pool):
    for sums in pool.run(_a_bucket_skipped_for_a_step, timeout=120)[:2]:
        assert sums[2] > 0 and sums[3] == sums[2] and sums[4] > 0, sums


def _rules_grads(rank, groups, rules):
    """One backward under DDP's own all-reduce and one under the top-k hook: the gradients."""
    if rank >= 2:
        return None
    g = groups[2]
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(7 + rank))
    out = {}
    for mode in ("torch", "topk"):
        model = _model()
        ddp = DDP(model, process_group=g, bucket_cap_mb=0.05)
        if mode == "topk":
            ddp.register_comm_hook(zipccl.ddp.State(group=g, codec="topk", density=0.01, rules=rules, model=model),
                                   zipccl.ddp.hook)
        ddp(x).square().mean().backward()
        out[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    model = _model()  # this rank's own gradients, by plain torch without DDP
    model(x).square().mean().backward()
    out["local"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("with_rules", [True, False])
def test_layer_rules_keep_small_tensors_exact(pool, with_rules):
    """With the default rules, 1-D tensors and small weights get the exact average (2 ranks: DDP's
    own result, bit for bit) while large weights go top-k: each of their entries the average of
    what the ranks sent, each rank its own gradient's entry or nothing (plain torch's gradients
    of each rank, without DDP), and few of them nonzero; without rules everything is sparsified."""
    rules = zipccl.rules.LayerRules() if with_rules else None
    res = pool.run(_rules_grads, rules)[:2]
    assert all(not isinstance(r, BaseException) for r in res), res
    torch_grads, topk_grads = res[0]["torch"], res[0]["topk"]
    small_same = []
    for name, grad in torch_grads.items():
        same = torch.equal(grad, topk_grads[name])
        if grad.dim() < 2 or grad.numel() < 4096:
            small_same.append(same)
        else:
            assert not same, name
            mine, theirs, got = res[0]["local"][name], res[1]["local"][name], topk_grads[name]
            sent = [torch.zeros_like(got), mine / 2, theirs / 2, (mine + theirs) / 2]
            assert bool(sum(got == s for s in sent).bool().all()), name
            assert 0 < int(got.count_nonzero()) <= 0.1 * got.numel(), (name, int(got.count_nonzero()))
    # without rules a small tensor is exact only if all its entries made the bucket's top 1%
    assert all(small_same) if with_rules else not all(small_same)
    assert all(torch.equal(res[0]["topk"][n], res[1]["topk"][n]) for n in torch_grads)


class _TwoLinear(torch.nn.Module):
    """One bucket whose order DDP's rebuild changes: registered b, a but applied a then b, and a
    bias's gradient ready before its weight's."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.b = torch.nn.Linear(64, 64)
        self.a = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.b(self.a(x))


class _TwoWeights(torch.nn.Module):
    """One bucket of two weights of one shape, which DDP's rebuild swaps (b, a before it; a's
    gradient ready first): the bucket's shapes in order, so its key, stay the same."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.b = torch.nn.Linear(64, 64, bias=False)
        self.a = torch.nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.a(self.b(x))


def _after_rebuild(rank, groups):
    """Three backward passes of the same input under the top-k hook with rules that keep the
    biases exact: each step's gradients, the bucket's order each step, the residuals kept; and
    this rank's own gradients by plain torch (no optimizer: the same every step)."""
    if rank >= 2:
        return None
    g = groups[2]
    model = _TwoLinear()
    ddp = DDP(model, process_group=g, bucket_cap_mb=25)
    state = zipccl.ddp.State(group=g, codec="topk", density=0.05, model=model,
                             rules=zipccl.rules.LayerRules(min_numel=0))
    names = {id(p): n for n, p in model.named_parameters()}
    orders = []

    def spy(s, bucket):
        orders.append([names[id(p)] for p in bucket.parameters()])
        return zipccl.ddp.hook(s, bucket)

    ddp.register_comm_hook(state, spy)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    steps = []
    for _ in range(3):
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        steps.append({n: p.grad.clone() for n, p in model.named_parameters()})
    local = _TwoLinear()
    local(x).square().mean().backward()
    saved = pickle.dumps(state)  # a checkpoint, restored into a new DDP (its buckets as before the rebuild)
    restored = _TwoLinear()
    back = pickle.loads(saved).attach(g, restored)
    named = back.names == {id(p): n for n, p in restored.named_parameters()}
    ddp = DDP(restored, process_group=g, bucket_cap_mb=25)
    ddp.register_comm_hook(back, zipccl.ddp.hook)
    ddp(x).square().mean().backward()
    return dict(steps=steps, orders=orders, residual_keys=len(state.residuals.store),
                residual_numel=sum(r.numel() for r in state.residuals.store.values()),
                local={n: p.grad.clone() for n, p in local.named_parameters()},
                restored_numel=sorted(r.numel() for r in back.residuals.store.values()), named=named)


def test_rules_and_residuals_follow_ddps_rebuilt_bucket(pool):
    """DDP reorders the bucket after the first step (a bias before its weight, the numel the
    same): the biases still get the exact average at every step (plain torch's gradients of the
    two ranks: (a + b) / 2), the weights only what top-k sent, and the residuals of the bucket
    as it was are moved into the bucket as it is (one bucket's worth kept, not two), as a
    checkpoint's are into a restored job's first bucket, whose layout is the one before the
    rebuild (test_error_feedback_is_exact_across_ddps_rebuild_and_a_restored_checkpoint: the
    values)."""
    res = pool.run(_after_rebuild, timeout=120)[:2]
    assert all(not isinstance(r, BaseException) for r in res), res
    assert res[0]["orders"][0] != res[0]["orders"][-1], res[0]["orders"]  # the rebuild this guards
    for step in range(3):
        for name in ("a.bias", "b.bias"):
            want = (res[0]["local"][name] + res[1]["local"][name]) / 2
            assert torch.equal(res[0]["steps"][step][name], want), (step, name)
        for name in ("a.weight", "b.weight"):
            assert 0 < int(res[0]["steps"][step][name].count_nonzero()) < 0.2 * 4096, (step, name)
    assert res[0]["residual_keys"] == 1 and res[0]["residual_numel"] == 2 * 4096, res[0]
    assert res[0]["restored_numel"] == [2 * 4096] and res[0]["named"] is True, res[0]


def _resumed(rank, groups, steps, saved_after, like_shapes=False, named=True):
    """``steps`` backward passes of the same input under the top-k hook (biases kept exact),
    each step's weight gradients as the hook leaves them; with ``saved_after``, the state is
    pickled after that many steps and restored into a new model and DDP (its buckets as before
    DDP's rebuild) for the rest; ``named=False``: the state made without ``model``. Also this
    rank's own gradients by plain torch."""
    if rank >= 2:
        return None
    g = groups[2]
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))

    make = _TwoWeights if like_shapes else _TwoLinear

    def job(state=None):
        model = make()
        if state is None:
            state = zipccl.ddp.State(group=g, codec="topk", density=0.05, model=model if named else None,
                                     rules=zipccl.rules.LayerRules(min_numel=0))
        else:
            state = pickle.loads(pickle.dumps(state)).attach(g, model)
        ddp = DDP(model, process_group=g, bucket_cap_mb=25)
        ddp.register_comm_hook(state, zipccl.ddp.hook)
        return model, ddp, state

    model, ddp, state = job()
    got = []
    for step in range(steps):
        if step == saved_after:
            model, ddp, state = job(state)
        ddp.zero_grad()
        ddp(x).square().mean().backward()
        got.append({n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("weight")})
    local = make()
    local(x).square().mean().backward()
    return dict(got=got, local={n: p.grad.clone() for n, p in local.named_parameters() if n.endswith("weight")})


def _error_feedback(local: list[dict], steps: int, density: float) -> list[dict]:
    """Top-k with error feedback by plain torch, per rank over its weights' gradients (the same
    every step): the k largest of gradient + residual sent, the rest kept; the average of what
    the ranks sent, summed in rank order in fp32."""
    names = sorted(local[0])
    flat = [torch.cat([g[n].reshape(-1) for n in names]) for g in local]
    k = math.ceil(density * flat[0].numel())
    residual, out = [torch.zeros_like(f) for f in flat], []
    for _ in range(steps):
        total = torch.zeros_like(flat[0])
        for r, f in enumerate(flat):
            c = f + residual[r]
            sent = torch.zeros_like(c)
            idx = c.abs().topk(k).indices
            sent[idx] = c[idx]
            residual[r] = c - sent
            total = total + sent
        avg, at = total / len(flat), 0
        step = {}
        for n in names:
            step[n] = avg[at:at + local[0][n].numel()].view_as(local[0][n])
            at += local[0][n].numel()
        out.append(step)
    return out


@pytest.mark.parametrize("like_shapes", [False, True], ids=["biases", "like shapes"])
@pytest.mark.parametrize("saved_after", [None, 2])
def test_error_feedback_is_exact_across_ddps_rebuild_and_a_restored_checkpoint(pool, saved_after, like_shapes):
    """Each step's weight gradients are plain torch's top-k with error feedback: across DDP's
    bucket rebuild after the first step (the residual follows its parameters into the new
    bucket, under another key, or under the same one where the bucket's shapes in order are the
    same), and (``saved_after``) across a checkpoint saved after the rebuild and restored into
    a new DDP, whose first step has the buckets as before it."""
    _assert_error_feedback(pool.run(_resumed, 4, saved_after, like_shapes, timeout=120)[:2], 4)


def _assert_error_feedback(res: list, steps: int) -> None:
    """Both ranks' weight gradients at every step are plain torch's top-k with error feedback."""
    assert all(not isinstance(r, BaseException) for r in res), res
    want = _error_feedback([r["local"] for r in res], steps, 0.05)
    for step in range(steps):
        for name, w in want[step].items():
            assert torch.equal(res[0]["got"][step][name], w), (step, name)
            assert torch.equal(res[1]["got"][step][name], w), (step, name)


@pytest.mark.parametrize("like_shapes", [False, True], ids=["biases", "like shapes"])
def test_error_feedback_is_exact_across_ddps_rebuild_without_parameter_names(pool, like_shapes):
    """The same without ``model=``: the residual follows its parameters into DDP's rebuilt bucket
    by this process's parameters, not dropped (step 0's unsent gradient was lost) nor applied at
    another parameter's positions."""
    _assert_error_feedback(pool.run(_resumed, 4, None, like_shapes, False, timeout=120)[:2], 4)


def test_a_new_buckets_residual_is_taken_from_the_buckets_that_held_its_parameters():
    """Bucket "new" holds w2 and w1 (in that order), which buckets "old1" (w1, w0) and "old2" (w2)
    held: its residual is theirs, parameter by parameter; "old2", emptied, goes; "old1" keeps
    w0's and zeros where w1's was. A bucket of w0 and w9, which no residual holds (a parameter
    unfrozen since), takes w0's and zeros for w9, and "old1", all taken, goes. Before, nothing
    moved where any parameter was in no residual: w0's unsent gradient was lost, and kept."""
    from zipccl.ddp import _take_residual
    state = zipccl.ddp.State(codec="topk")
    store = state.residuals.store
    store["old1"], store["old2"] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), torch.tensor([6.0, 7.0])
    state.parts = {"old1": (("w1", 3), ("w0", 2)), "old2": (("w2", 2),), "new": (("w2", 2), ("w1", 3))}
    _take_residual(state, "new")
    assert torch.equal(store["new"], torch.tensor([6.0, 7.0, 1.0, 2.0, 3.0]))
    assert "old2" not in store and "old2" not in state.parts
    assert torch.equal(store["old1"], torch.tensor([0.0, 0.0, 0.0, 4.0, 5.0]))
    state.parts["other"] = (("w0", 2), ("w9", 1))
    _take_residual(state, "other")
    assert torch.equal(store["other"], torch.tensor([4.0, 5.0, 0.0]))
    assert "old1" not in store and "old1" not in state.parts
    state.parts["none"] = (("w8", 4),)
    _take_residual(state, "none")
    assert "none" not in store


class _SparseEmbedding(torch.nn.Module):
    """A sparse embedding (its gradients sparse tensors) beside a dense layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(50, 16, sparse=True)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, ids):
        return self.out(self.emb(ids))


def _sparse_gradients(rank, groups, codec):
    """One backward pass of a model with sparse embedding gradients under the hook: its
    gradients, densified; and this rank's own by plain torch."""
    if rank >= 2:
        return None
    g = groups[2]
    ids = torch.randint(0, 50, (8,), generator=torch.Generator().manual_seed(rank))
    ddp = DDP(_SparseEmbedding(), process_group=g)
    ddp.register_comm_hook(zipccl.ddp.State(group=g, codec=codec), zipccl.ddp.hook)
    ddp(ids).square().sum().backward()
    local = _SparseEmbedding()
    local(ids).square().sum().backward()
    return [{n: p.grad.to_dense() if p.grad.is_sparse else p.grad for n, p in m.named_parameters()}
            for m in (ddp.module, local)]


@pytest.mark.parametrize("codec", ["lossless", "topk"])
def test_sparse_gradients_are_averaged_by_the_backend(pool, codec):
    """A bucket of sparse gradients (nn.Embedding(sparse=True)) is averaged by the group's own
    backend, as torch's allreduce_hook does (zipccl's codecs take dense tensors); the dense
    buckets beside it still go through zipccl (top-k's rules keep this small one exact). Every
    gradient is the two ranks' average of plain torch's (summed sparse: to 1e-6), the same on both."""
    (a, la), (b, lb) = pool.run(_sparse_gradients, codec, timeout=120)[:2]
    for n in la:
        want = (la[n] + lb[n]) / 2
        assert torch.allclose(a[n], want, atol=1e-6) and torch.equal(a[n], b[n]), n
    assert int((la["emb.weight"] != 0).any(1).sum()) < 50  # sparse: some rows untouched


def _another_ranks_ddp_state(rank, groups):
    """A lossy state with a residual, pickled on each of 2 ranks: attached on the other rank, then
    on its own; a lossless state, which holds no residual, on the other rank."""
    import pickle
    if rank >= 2:
        return None
    g, out = groups[2], {}
    for codec in ("topk", "lossless"):
        state = zipccl.ddp.State(group=g, codec=codec)
        if state.residuals is not None:
            state.residuals.store["bucket"] = torch.full((10,), float(rank))
        saved = [None, None]
        dist.all_gather_object(saved, pickle.dumps(state), group=g)
        try:
            pickle.loads(saved[1 - rank]).attach(g)
            out[codec] = "attached"
        except ValueError as e:
            out[codec] = str(e)
        out[codec, "own"] = float(pickle.loads(saved[rank]).attach(g).residuals.store["bucket"][0]) \
            if codec == "topk" else None
    return out


def test_a_state_with_residuals_saved_by_another_rank_is_refused(pool):
    for rank, res in enumerate(pool.run(_another_ranks_ddp_state)[:2]):
        assert not isinstance(res, BaseException), res
        assert f"saved by rank {1 - rank} of 2, and this is rank {rank} of 2" in res["topk"], res
        assert res["topk", "own"] == rank and res["lossless"] == "attached", res


def _entropy_with_an_exact_first_bucket(rank, groups):
    """Buckets of about one parameter each, the first (the last layer's) a LayerNorm that the
    rules keep exact: the entropy rate still decides, from the step's first lossy bucket."""
    if rank >= 2:
        return None
    g = groups[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 128), torch.nn.LayerNorm(128))
    ddp = DDP(model, process_group=g, bucket_cap_mb=0.001)
    state = zipccl.ddp.State(group=g, codec="entropy", model=model, rate=EntropyRate(warmup=2, every=1))
    ddp.register_comm_hook(state, zipccl.ddp.hook)
    for step in range(6):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp.zero_grad()
        ddp(x).square().mean().backward()
    return state.stats()


def test_the_entropy_rate_decides_where_the_first_bucket_is_exact(pool):
    res = pool.run(_entropy_with_an_exact_first_bucket, timeout=120)[:2]
    assert all(not isinstance(r, BaseException) for r in res), res
    densities = res[0]["densities"]
    assert densities[:2] == [None, None] and all(d is not None for d in densities[2:]), densities
    assert len(res[0]["decisions"]) >= 3 and res[0]["ratio"] < 0.5, res[0]
    assert res[0]["densities"] == res[1]["densities"]


def test_a_bucket_of_the_same_shapes_but_other_parameters_takes_its_residual_by_name():
    """Two weights of one shape swapped in a bucket keep its key (shapes in order), but not its
    layout, and its residual follows the parameters (by their names; without names, no model
    given, by this process's parameters), not the positions."""
    from zipccl.ddp import _key, _parts, _relayout, _take_residual
    w1, w2, bias = (torch.nn.Parameter(torch.zeros(s)) for s in ((4, 4), (4, 4), (4,)))
    for named in (True, False):
        state = zipccl.ddp.State(codec="topk", density=0.1, rules=None)  # every parameter lossy
        state.names = {id(w1): "w1", id(w2): "w2", id(bias): "bias"} if named else {}

        def step(params):
            key, changed = _key(state, 0, params)
            _relayout(state, key, _parts(state, params, 36), changed)
            _take_residual(state, key)
            return key
        key = step([w1, w2, bias])
        state.residuals.store[key], state.layouts[key] = torch.arange(36.0), ([(0, 32)], [(32, 36)])
        assert step([w1, w2, bias]) == key and torch.equal(state.residuals.store[key], torch.arange(36.0))
        assert step([w2, w1, bias]) == key and key not in state.layouts
        # w2's residual first now, then w1's, then the bias's
        want = torch.cat([torch.arange(16.0, 32.0), torch.arange(16.0), torch.arange(32.0, 36.0)])
        assert torch.equal(state.residuals.store[key], want), (named, state.residuals.store[key])
        assert list(state.residuals.store) == [key] and list(state.parts) == [key]  # nothing left aside
        assert _key(state, 0, [bias, w1, w2])[0] != key  # another order of shapes: another key


def test_attaching_a_model_drops_the_residuals_of_parameters_it_no_longer_has_at_their_size():
    """A checkpoint's residuals for a parameter that the model now has at another size (or not at
    all) could never be taken by a bucket: dropped at ``attach``, with a warning naming them;
    the others are kept for the buckets to take. Those of a state made without ``model`` (held
    by this process's parameters) are named by it."""
    state = zipccl.ddp.State(codec="topk", rules=None)
    store = state.residuals.store
    store["both"], store["gone"] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), torch.tensor([6.0, 7.0])
    state.parts = {"both": (("a", 3), ("b", 2)), "gone": (("c", 2),)}
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))  # b reshaped
    with pytest.warns(RuntimeWarning, match="residuals of b, c dropped"):
        state.attach(None, model)
    assert list(store) == ["both"] and torch.equal(store["both"], torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0]))
    assert state.parts == {"both": (("a", 3), (None, 2))}
    state = zipccl.ddp.State(codec="topk", rules=None)  # made without model: by this process's parameters
    state.residuals.store["ids"] = torch.arange(1.0, 9.0)
    state.parts = {"ids": ((("id", id(model.b)), 4), (("id", id(model.a)), 3), (("id", 0), 1))}
    with pytest.warns(RuntimeWarning, match=r"residuals of \('id', 0\) dropped"):
        state.attach(None, model)
    assert state.parts == {"ids": (("b", 4), ("a", 3), (None, 1))}  # named now: taken by name
    assert torch.equal(state.residuals.store["ids"], torch.tensor([1.0, 2, 3, 4, 5, 6, 7, 0]))


def test_segments_of_a_bucket():
    rules = zipccl.rules.LayerRules(min_numel=10)
    params = [torch.nn.Parameter(torch.zeros(4, 5)), torch.nn.Parameter(torch.zeros(3)),
              torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(5, 5))]
    names = {id(params[3]): "blocks.0.ln_f.weight"}
    lossy, exact = zipccl.rules.segments(rules, params, names, 52)
    assert lossy == [(0, 20)] and exact == [(20, 52)]  # neighbours merged
    params.append(torch.nn.Parameter(torch.zeros(3, 4)))
    assert zipccl.rules.segments(rules, params, names, 64) == ([(0, 20), (52, 64)], [(20, 52)])
    assert zipccl.rules.segments(rules, params, names, 53) is None  # parameters do not tile the bucket
    with pytest.raises(ValueError):
        zipccl.rules.LayerRules(min_numel=-1)


def test_bf16_hooks_compose(pool):
    modes = ("bf16-raw", "bf16-lossless", "torchbf16-lossless")
    res = {m: pool.run(_train, m, 20, timeout=240)[:2] for m in modes}
    for m in modes:
        assert all(not isinstance(r, BaseException) for r in res[m]), res[m]
    digests = {res[m][r]["digest"] for m in modes for r in range(2)}
    assert len(digests) == 1  # ranks agree, lossless == raw, zipccl's and PyTorch's wrappers agree
    assert res["bf16-lossless"][0]["stats"]["ratio"] < 0.9
    fp32 = pool.run(_train, "lossless", 20)[0]
    assert fp32["digest"] not in digests  # bf16 gradients really were rounded


def _register_twice(rank, groups):
    if rank >= 2:
        return None
    ddp = DDP(_model(), process_group=groups[2])
    state = zipccl.ddp.State(group=groups[2])
    ddp.register_comm_hook(state, zipccl.ddp.hook)
    try:
        ddp.register_comm_hook(state, zipccl.ddp.hook)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_registering_twice_is_refused(pool):
    res = pool.run(_register_twice)[:2]
    assert all("can only be called once" in r for r in res), res


def test_state_pickles_and_validates():
    state = zipccl.ddp.State(codec="raw")
    state.raw_bytes, state.wire_bytes, state.iterations = 1000, 600, 7
    back = pickle.loads(pickle.dumps(state))
    assert back.group is None and back.codec == "raw" and back.stats() == state.stats()
    with pytest.raises(ValueError, match="unknown codec"):
        zipccl.ddp.State(codec="zstd")
    with pytest.raises(ValueError, match="density"):
        zipccl.ddp.State(codec="topk", density=0.0)
    lossy = zipccl.ddp.State(codec="entropy")
    lossy.residuals.update((0, 3), torch.ones(3), torch.zeros(3))
    back = pickle.loads(pickle.dumps(lossy))
    assert back.rate is not None and torch.equal(back.residuals.store[(0, 3)], torch.ones(3))
    with pytest.raises(ValueError):
        zipccl.ddp.State(codec=object())
    # residuals held by parameter name (a state made with model=...): attached without the model,
    # they could not be placed, and would be dropped; refused, with what to do
    model = torch.nn.Linear(3, 1)
    named = zipccl.ddp.State(codec="topk", model=model, rules=None)
    named.residuals.update((0, ((1, 3), (1,))), torch.ones(4), torch.zeros(4))
    named.parts[(0, ((1, 3), (1,)))] = (("weight", 3), ("bias", 1))
    back = pickle.loads(pickle.dumps(named))
    with pytest.raises(ValueError, match=r"held by parameter name .*attach\(group, model=model\)"):
        back.attach()
    assert back.attach(model=model).names == {id(p): n for n, p in model.named_parameters()}


def _foreign_group(rank, groups):
    if rank < 2:  # ranks 0 and 1 are in groups[2]; 2 and 3 are not
        return "member"
    try:
        zipccl.ddp.State(group=groups[2])
    except ValueError as e:
        return str(e)
    return "no error"


def test_group_the_process_is_not_in(pool):
    res = pool.run(_foreign_group)
    assert res[2].startswith("this process is not a member") and res[3].startswith("this process is not")


@pytest.mark.timeout(400)
def test_train_gpt_example_smoke(tmp_path):
    """examples/train_gpt.py on 2 ranks: DDP with zipccl's lossless hook, and DDP unchanged on
    the drop-in backend (ZIPCCL_CODEC=lossless), each give plain torch's parameters bit for bit
    (a sum of two is the same in any order), with fewer bytes on the wire."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = {}
    for name, flags, codec in (("torch", ["--comm", "torch"], None), ("lossless", ["--comm", "lossless"], None),
                               ("dropin", ["--backend", "zipccl", "--comm", "torch"], "lossless")):
        path = tmp_path / f"{name}.json"
        env = dict(os.environ, PYTHONPATH=str(root), **({"ZIPCCL_CODEC": codec} if codec else {}))
        res = subprocess.run([sys.executable, str(root / "examples" / "train_gpt.py"), *flags, "--steps", "3",
                              "--d-model", "64", "--layers", "2", "--text-bytes", "1000000", "--dtype", "bf16",
                              "--json", str(path)], capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "eval loss" in res.stdout
        out[name] = json.loads(path.read_text())
    assert len(out["torch"]["losses"]) == 3 and out["torch"]["eval_loss"] > 0
    for name in ("lossless", "dropin"):
        assert out[name]["param_sha256"] == out["torch"]["param_sha256"], name
        assert out[name]["losses"] == out["torch"]["losses"], name
        assert out[name]["wire_bytes"] < 0.8 * out[name]["raw_bytes"], name
    assert out["dropin"]["backend"] == "zipccl" and out["torch"]["backend"] == "gloo"


def _train_nodes(rank, groups, codec, algorithm, steps):
    """Four ranks as two emulated nodes (ZIPCCL_TOPOLOGY=2x2): DDP with zipccl's hook (codec None:
    DDP's own all-reduce)."""
    old, zipccl.config.TOPOLOGY = zipccl.config.TOPOLOGY, "2x2"
    zipccl.topology.forget()
    try:
        ddp = DDP(_model(), bucket_cap_mb=0.05)
        if codec is not None:
            ddp.register_comm_hook(zipccl.ddp.State(codec=codec, algorithm=algorithm), zipccl.ddp.hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(steps):
            x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
        return hashlib.sha1(flat.numpy().tobytes()).hexdigest(), zipccl.stats()["last"]["codec"], flat
    finally:
        zipccl.config.TOPOLOGY = old
        zipccl.topology.forget()


def test_hierarchical_hook_on_two_nodes(pool):
    """auto restricted to hierarchical plans gives raw hierarchical's bits (with two nodes every
    hierarchical plan sums the same way), on every rank; flat raw too is the same on every rank;
    both train as DDP's own all-reduce does, up to the order of the sums."""
    runs = {(c, a): pool.run(_train_nodes, c, a, 20, timeout=240)
            for c, a in (("raw", "hierarchical"), ("auto", "hierarchical"), ("raw", "flat"), (None, None))}
    for key, res in runs.items():
        assert all(not isinstance(r, BaseException) for r in res), (key, res)
        assert len({r[0] for r in res}) == 1, f"{key}: ranks differ"
    assert runs[("auto", "hierarchical")][0][0] == runs[("raw", "hierarchical")][0][0]
    assert runs[("raw", "hierarchical")][0][1] == "hierarchical/raw+raw"
    assert runs[("auto", "hierarchical")][0][1].startswith("hierarchical/shm+")
    plain = runs[(None, None)][0][2]
    for key in (("raw", "hierarchical"), ("raw", "flat")):
        torch.testing.assert_close(runs[key][0][2], plain, rtol=1e-4, atol=1e-6, msg=f"{key} against DDP's own")


def _threads_that_make_groups(rank, groups, codec):
    """A new whole-job gloo group's first use is DDP's ``codec`` hook: the threads on which
    zipccl makes its own groups (dist.new_group) during the first steps."""
    import threading
    g = dist.new_group(backend="gloo")
    made, real = [], dist.new_group

    def watched(*args, **kwargs):
        made.append(threading.current_thread().name)
        return real(*args, **kwargs)

    dist.new_group = watched
    try:
        ddp = DDP(_model(), process_group=g, bucket_cap_mb=0.05)
        ddp.register_comm_hook(zipccl.ddp.State(group=g, codec=codec, density=0.1), zipccl.ddp.hook)
        gen = torch.Generator().manual_seed(7 + rank)
        for _ in range(2):
            ddp(torch.randn(16, 32, generator=gen)).square().mean().backward()
    finally:
        dist.new_group = real
    dist.destroy_process_group(g)
    return made


@pytest.mark.parametrize("codec", ["lossless", "topk"])
def test_the_hooks_groups_are_made_on_the_callers_thread(pool, codec):
    """zipccl's second gloo group for DDP's group is made while the thread that runs the hook
    waits for it (on the set-up's own thread, named after it, which bounds the wait:
    heartbeat.bounded), never on or for zipccl's async thread, where it could cross a group the
    program makes meanwhile."""
    made = pool.run(_threads_that_make_groups, codec, timeout=120)
    assert all(m and all("zipccl" not in name.removeprefix("zipccl-setup<-") for name in m) for m in made), made
