"""codec="auto": the plan of each call, learned per process group from the calls' own times.

Compression pays only where the link is slower than the codec, and that depends on the links,
the cores, the dtype and the size: a fixed threshold that is right for a 1 Gbit/s link makes a
loopback or NVLink call 2-3x slower, and zipccl's own pipeline (even raw) costs more CPU than
the backend's collective. So "auto" measures, and the backend's own collective ("native") is
one of the plans it measures. Every rank of a group must choose the same plan for a call, so
a Policy decides only from what every rank knows alike: the order of the group's calls, and
the times that come back through the group's metadata exchanges (each call's slowest rank's
time). Per class of calls (collective, dtype, power of two of the bytes):

- below ``probe_min_bytes`` always the first candidate (native): latency-bound, where coding
  never paid in any measurement and zipccl's exchange alone would cost as much as the call;
- the first calls try every candidate in turn until each has been timed ``explore`` times and
  those times have come back (one unlucky time on a shared machine, or a size's cold first
  call, must not decide: a call's time comes back with a later call's exchange, so stopping
  after ``explore`` rounds would decide on a plan's first time alone; on an H200 that kept NCCL
  for 256 MiB on a 10 Gbit/s lab, lossless's first 346 ms against NCCL's 342, where its timed
  calls took 257),
  at most twice as many rounds; from then on the fastest by its recent
  times, and each slower plan once more after a number of calls that grows with how much it
  lost: what re-trying all losers costs stays near ``budget`` of the class's time (among three
  plans, one 3x slower is re-tried every 200 calls, one 10% slower every 32), so that a
  changed link or load is still noticed within a few hundred calls at most.

A call's time reaches the policy with the group's next metadata exchange, so decisions lag. On
CUDA a call returns once its work is queued, so a measured call is timed by events on the
caller's stream around it (zipccl.collectives.autoplan.DeviceSpan), never by its queued host time.
Native calls carry no exchange (it would double a small call's time): their times wait on each
rank and travel with the next call that has one.
"""

from __future__ import annotations

import math

PROBE_MIN_BYTES = 1 << 20
EXPLORE = 2
REPROBE = 32
MAX_REPROBE = 1024
BUDGET = 0.02


class Policy:
    """Deterministic plan choice per class of calls; identical inputs give identical choices on
    every rank."""

    def __init__(self, probe_min_bytes: int = PROBE_MIN_BYTES, explore: int = EXPLORE, reprobe: int = REPROBE,
                 budget: float = BUDGET):
        if explore < 1 or reprobe < 1 or budget <= 0:
            raise ValueError("explore and reprobe must be >= 1 and budget > 0")
        self.probe_min_bytes, self.explore, self.reprobe, self.budget = probe_min_bytes, explore, reprobe, budget
        self.calls: dict = {}   # class -> calls decided so far
        self.last: dict = {}    # (class, plan) -> the index of the call that last ran it
        self.recent: dict = {}  # (class, plan) -> the last two times of a call
        self.timed: dict = {}   # (class, plan) -> how many of its calls' times have come back
        self._schedule: dict = {}  # class -> (candidates, fastest, ((loser, re-try interval), ...)) until it learns
        self._step = None  # what the last ``choose`` changed, for ``undo``

    @staticmethod
    def key(collective: str, dtype, nbytes: int, device="cpu") -> tuple:
        """A class of calls: collective, dtype, power of two of the bytes, and the kind of device
        (a group may carry CPU tensors on gloo and CUDA ones on NCCL, whose plans and times differ)."""
        return collective, str(dtype), nbytes.bit_length(), getattr(device, "type", str(device))

    def measures(self, nbytes: int, candidates: tuple[str, ...]) -> bool:
        """Whether a call's time can change a choice: below ``probe_min_bytes`` or with one
        candidate the first always runs (its time needs no synchronised clock)."""
        return nbytes >= self.probe_min_bytes and len(candidates) > 1

    def choose(self, key: tuple, nbytes: int, candidates: tuple[str, ...]) -> str:
        """The plan of the class's next call, among ``candidates`` (the first is the default)."""
        if not self.measures(nbytes, candidates):
            self._step = None
            return candidates[0]
        i = self.calls.get(key, 0)
        self.calls[key] = i + 1
        if self._exploring(key, i, candidates):
            plan = candidates[i % len(candidates)]
        else:
            plan = self._exploit(key, i, candidates)
        self._step = key, i, plan, self.last.get((key, plan))
        self.last[(key, plan)] = i
        return plan

    def undo(self) -> None:
        """Take back the last ``choose``: its call failed on every rank (a mismatch found in its
        exchange, whose ranks may have chosen in different classes), so that the ranks' next
        choices are alike again. Once only; nothing where the last call took no step."""
        if self._step is None:
            return
        key, i, plan, last = self._step
        self._step = None
        self.calls[key] = i
        if last is None:
            self.last.pop((key, plan), None)
        else:
            self.last[(key, plan)] = last

    def _exploring(self, key, i: int, candidates) -> bool:
        """Whether call ``i`` still takes the candidates in turn: ``explore`` rounds, then until
        every candidate's ``explore`` times have come back, at most as many rounds again."""
        rounds = self.explore * len(candidates)
        if i < rounds:
            return True
        return i < 2 * rounds and any(self.timed.get((key, c), 0) < self.explore for c in candidates)

    def _exploit(self, key, i: int, candidates) -> str:
        schedule = self._schedule.get(key)
        if schedule is None or schedule[0] != candidates:  # worked out once per time learned: calls are many
            schedule = self._schedule[key] = (candidates, *self._plan(key, candidates))
        _, best, losers = schedule
        for c, interval in losers:  # the first loser whose turn has come
            if i - self.last.get((key, c), -MAX_REPROBE) >= interval:
                return c
        return best

    def _plan(self, key, candidates) -> tuple[str, tuple]:
        """The class's fastest plan and each loser's re-try interval, from the times so far."""
        times = {c: self.seconds(key, c) for c in candidates}
        timed = [c for c in candidates if times[c] is not None]
        best = min(timed, key=times.get) if timed else candidates[0]
        share = self.budget / (len(candidates) - 1)  # each loser's part of the budget
        losers = []
        for c in candidates:
            if c != best:
                loss = 0.0 if times[c] is None else max(0.0, times[c] / max(times[best], 1e-9) - 1)
                losers.append((c, min(MAX_REPROBE, max(self.reprobe, math.ceil(loss / share)))))
        return best, tuple(losers)

    def learn(self, key: tuple, plan: str, seconds: float) -> None:
        """A finished call's time (the slowest rank's)."""
        self.recent[(key, plan)] = (self.recent.get((key, plan), ())[-1:] + (seconds,))
        self.timed[(key, plan)] = self.timed.get((key, plan), 0) + 1
        self._schedule.pop(key, None)

    def seconds(self, key: tuple, plan: str) -> float | None:
        """The plan's time in this class: the lower of its last two, since whatever else runs on
        the machine only ever adds time; None before its first."""
        times = self.recent.get((key, plan))
        return min(times) if times else None

    def table(self) -> dict:
        """{class: {plan: seconds}} learned so far (for users and tests)."""
        out: dict = {}
        for key, plan in self.recent:
            out.setdefault(key, {})[plan] = self.seconds(key, plan)
        return out

    def explain(self) -> list[str]:
        """One line per class: each plan's time and what the class runs now, and why."""
        lines = []
        for key, times in sorted(self.table().items()):
            collective, dtype, bits, device = key
            shown = ", ".join(f"{p} {s * 1e3:.2f} ms" for p, s in sorted(times.items(), key=lambda kv: kv[1]))
            best = min(times, key=times.get)
            state = "probing" if self._exploring(key, self.calls.get(key, 0), tuple(times)) else f"-> {best} (fastest)"
            where = "" if device == "cpu" else f" ({device})"
            lines.append(f"{collective} {dtype.replace('torch.', '')} {1 << (bits - 1)}-{(1 << bits) - 1} B{where}: "
                         f"{shown} {state}")
        return lines
