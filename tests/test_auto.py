"""The policy behind codec="auto" (zipccl.auto), with synthetic times: it tries every plan, keeps
the fastest, re-tries losers at a rate that bounds their cost, and depends on nothing but its inputs."""

from __future__ import annotations

import torch

from zipccl.auto import Policy

MiB = 1 << 20
FLAT = ("native", "raw", "lossless")
ALL = FLAT + ("hierarchical/native", "hierarchical/raw", "hierarchical/lossless")


def run(policy: Policy, nbytes: int, calls: int, seconds, plans=FLAT, lag: int = 1) -> list[str]:
    """Choices for ``calls`` calls of one class; each call's time (``seconds(i, plan)``) reaches the
    policy ``lag`` calls later, as it does through the collectives' metadata exchanges."""
    key = Policy.key("all_reduce", torch.bfloat16, nbytes)
    chosen, waiting = [], []
    for i in range(calls):
        if len(waiting) >= lag + 1:
            policy.learn(key, *waiting.pop(0))
        c = policy.choose(key, nbytes, plans)
        chosen.append(c)
        waiting.append((c, seconds(i, c)))
    return chosen


def run_exchanged(policy: Policy, nbytes: int, calls: int, seconds, plans=("native", "lossless")) -> list[str]:
    """As ``run``, with the collectives' own lag: the times of earlier calls come back with the
    next call that has a metadata exchange, and a native call has none."""
    key = Policy.key("all_reduce", torch.bfloat16, nbytes)
    chosen, waiting = [], []
    for i in range(calls):
        c = policy.choose(key, nbytes, plans)
        if c != "native":
            for plan, t in waiting:
                policy.learn(key, plan, t)
            waiting = []
        chosen.append(c)
        waiting.append((c, seconds(i, c)))
    return chosen


def test_small_messages_go_native_without_probing():
    chosen = run(Policy(), 512 << 10, 10, lambda i, c: 1.0 if c == "lossless" else 9.0)
    assert chosen == ["native"] * 10


def test_tries_every_plan_twice_then_keeps_the_fastest():
    times = {"native": 3.0, "raw": 2.0, "lossless": 1.0}
    chosen = run(Policy(), 16 * MiB, 40, lambda i, c: times[c])
    assert chosen[:7] == list(FLAT) * 2 + ["native"]  # lossless's second time not back yet: one more in turn
    assert chosen[7:32] == ["lossless"] * 25


def test_a_plans_cold_first_call_does_not_decide():
    """A size's first lossless call is slow, the later ones beat native; native calls bring no
    times back: the turns go on until lossless's second time is back, and lossless runs from
    then on (an H200's 10 Gbit/s lab at 256 MiB: lossless's first 346 ms, its timed calls 257,
    NCCL 342)."""
    cold = {"native": 0.342, "lossless": 0.257}
    chosen = run_exchanged(Policy(), 256 * MiB, 40, lambda i, c: 0.346 if (i, c) == (1, "lossless") else cold[c])
    assert chosen[:6] == ["native", "lossless"] * 3, chosen
    assert chosen[6:36] == ["lossless"] * 30, chosen  # native's re-try comes at call 36


def test_native_wins_where_coding_cannot_pay():
    times = {"native": 1.0, "raw": 2.5, "lossless": 3.0}  # a fast link: zipccl's pipeline costs CPU only
    chosen = run(Policy(), 64 * MiB, 600, lambda i, c: times[c])
    steady = chosen[6:]
    assert steady.count("native") / len(steady) > 0.98
    # losers come back at a rate that keeps their cost near the budget: the mean time after the
    # probing is within 3% of always-native (a fixed re-probe every 32 calls would cost 8%)
    mean = sum(times[c] for c in steady) / len(steady)
    assert mean < 1.03 * times["native"], mean


def test_reprobe_interval_grows_with_the_loss():
    times = {"native": 1.0, "raw": 1.1, "lossless": 4.0}
    chosen = run(Policy(), 64 * MiB, 1000, lambda i, c: times[c])[6:]
    assert 20 <= chosen.count("raw") <= 40       # 10% slower: every 32 calls
    assert 2 <= chosen.count("lossless") <= 5    # 4x slower: about every 300 calls


def test_one_unlucky_time_does_not_decide():
    # lossless is faster, but its first call is slowed down by something else on the machine
    chosen = run(Policy(), 16 * MiB, 14, lambda i, c: 9.0 if i == 2 else {"native": 2.0, "raw": 2.0}.get(c, 1.0))
    assert chosen[8:] == ["lossless"] * 6  # from when its second time has come back (one call's lag)


def test_a_change_is_noticed():
    # lossless is faster for 100 calls, then native (a faster link, say)
    f = lambda i, c: {"native": 2.0, "raw": 2.2, "lossless": 1.0}[c] if i < 100 else \
        {"native": 1.0, "raw": 1.5, "lossless": 3.0}[c]  # noqa: E731
    chosen = run(Policy(), 32 * MiB, 300, f)
    assert chosen[6:100].count("lossless") > 80
    assert chosen[200:].count("native") >= 95


def test_hierarchical_plans_are_chosen_like_any_other():
    times = dict(zip(ALL, (1.0, 1.1, 0.8, 0.7, 0.75, 0.45)))
    chosen = run(Policy(), 64 * MiB, 100, lambda i, c: times[c], plans=ALL)
    assert chosen[:12] == list(ALL) * 2
    assert chosen[12:].count("hierarchical/lossless") > 80


def test_identical_histories_give_identical_choices():
    f = lambda i, c: 1.0 + (i % 3) * 0.5 if c == "raw" else 1.4 + (i % 5) * 0.1  # noqa: E731
    a = run(Policy(), 8 * MiB, 300, f)
    assert a == run(Policy(), 8 * MiB, 300, f)
    assert len(set(a[6:])) > 1  # the history does move it: the equality above is not trivial


def test_classes_are_separate_and_the_table_reports_them():
    p = Policy()
    run(p, 16 * MiB, 6, lambda i, c: 2.0)
    run(p, 64 * MiB, 6, lambda i, c: 4.0)
    table = p.table()
    assert set(table) == {Policy.key("all_reduce", torch.bfloat16, 16 * MiB),
                          Policy.key("all_reduce", torch.bfloat16, 64 * MiB)}
    assert all(set(v) == set(FLAT) for v in table.values())
    assert len(p.explain()) == 2 and "native" in p.explain()[0]
    # six calls in turn, the last two times not back: still probing; once they are, decided
    assert all(line.endswith("probing") for line in p.explain()), p.explain()
    for plan in ("raw", "lossless"):
        p.learn(Policy.key("all_reduce", torch.bfloat16, 16 * MiB), plan, 2.0)
    assert p.explain()[0].endswith("(fastest)") and p.explain()[1].endswith("probing"), p.explain()


def test_cpu_and_cuda_calls_of_one_size_are_classes_of_their_own():
    """A group can carry CPU tensors (gloo) and CUDA ones (NCCL): their times never mix, any GPU
    of a kind is one class, and the table says which device a class is."""
    p = Policy()
    cpu = Policy.key("all_reduce", torch.bfloat16, 16 * MiB, torch.device("cpu"))
    cuda = Policy.key("all_reduce", torch.bfloat16, 16 * MiB, torch.device("cuda", 0))
    assert cpu != cuda and cuda == Policy.key("all_reduce", torch.bfloat16, 16 * MiB, torch.device("cuda", 3))
    for plan, seconds in (("native", 1.0), ("raw", 2.0), ("lossless", 3.0)):
        p.learn(cpu, plan, seconds)
        p.learn(cuda, plan, 4.0 - seconds)
    assert p.table()[cpu]["native"] == 1.0 and p.table()[cuda]["native"] == 3.0
    lines = p.explain()
    assert len(lines) == 2 and sum("(cuda)" in line for line in lines) == 1 and "(cpu)" not in "".join(lines)


def test_bad_settings_are_refused():
    import pytest
    with pytest.raises(ValueError):
        Policy(explore=0)
