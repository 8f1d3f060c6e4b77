"""The policy behind codec="auto" (zipccl.auto): deterministic, probes both codecs, keeps the faster."""

from __future__ import annotations

import torch

from zipccl.auto import Policy

MiB = 1 << 20


def run(policy: Policy, nbytes: int, calls: int, seconds, lag: int = 1) -> list[str]:
    """Choices for ``calls`` calls of one class; each call's time (``seconds(i, codec)``) reaches the
    policy ``lag`` calls later, as it does through the collectives' metadata exchanges."""
    key = Policy.key("all_reduce", torch.bfloat16, nbytes)
    chosen, waiting = [], []
    for i in range(calls):
        if len(waiting) >= lag + 1:
            policy.learn(key, *waiting.pop(0))
        c = policy.choose(key, nbytes)
        chosen.append(c)
        waiting.append((c, seconds(i, c)))
    return chosen


def test_small_messages_stay_raw():
    assert run(Policy(8 * MiB), 512 << 10, 10, lambda i, c: 1.0 if c == "lossless" else 9.0) == ["raw"] * 10


def test_probes_both_then_keeps_the_faster_and_reprobes():
    chosen = run(Policy(8 * MiB, reprobe=8), 16 * MiB, 20, lambda i, c: 1.0 if c == "raw" else 3.0)
    assert chosen[:4] == ["lossless", "raw"] * 2  # the prior (16 MiB >= 8 MiB) first, each timed twice
    assert [i for i, c in enumerate(chosen) if c == "lossless"] == [0, 2, 8, 16]


def test_one_unlucky_time_does_not_decide():
    # lossless is faster, but its first call is slowed down by something else on the machine
    chosen = run(Policy(8 * MiB), 16 * MiB, 12, lambda i, c: 9.0 if i == 0 else (1.0 if c == "lossless" else 2.0))
    assert chosen[4:] == ["lossless"] * 8


def test_prior_below_the_threshold_is_raw():
    chosen = run(Policy(8 * MiB), 2 * MiB, 7, lambda i, c: 1.0 if c == "lossless" else 2.0)
    assert chosen == ["raw", "lossless", "raw", "lossless", "lossless", "lossless", "lossless"]


def test_a_change_is_noticed_at_the_next_probe():
    # lossless is faster for 40 calls, then raw (a faster link, say)
    chosen = run(Policy(8 * MiB, reprobe=16), 32 * MiB, 80,
                 lambda i, c: (1.0 if c == "lossless" else 2.0) if i < 40 else (5.0 if c == "lossless" else 1.0))
    assert chosen[4:40].count("raw") == 2      # the probes at calls 16 and 32
    assert chosen[50:].count("lossless") <= 2  # switched after the probe at call 48, probing rarely since


def test_identical_histories_give_identical_choices():
    f = lambda i, c: 1.0 + (i % 3) * 0.5 if c == "raw" else 1.4  # noqa: E731
    assert run(Policy(8 * MiB, reprobe=5), 8 * MiB, 50, f) == run(Policy(8 * MiB, reprobe=5), 8 * MiB, 50, f)


def test_classes_are_separate_and_the_table_reports_them():
    p = Policy(8 * MiB)
    run(p, 16 * MiB, 4, lambda i, c: 2.0)
    run(p, 64 * MiB, 4, lambda i, c: 4.0)
    table = p.table()
    assert set(table) == {Policy.key("all_reduce", torch.bfloat16, 16 * MiB),
                          Policy.key("all_reduce", torch.bfloat16, 64 * MiB)}
    assert all(set(v) == {"raw", "lossless"} for v in table.values())
