"""codec="auto": raw or lossless for each call, learned per process group from the calls' own times.

Compression pays only where the link is slower than the codec, and that depends on the link,
the cores, the dtype and the size: a fixed threshold that is right for a 1 Gbit/s link makes a
loopback or NVLink call 2-3x slower. So "auto" measures. Every rank of a group must choose the
same codec for a call (the metadata exchange checks it), so a Policy decides only from what
every rank knows alike: the order of the group's calls, and the times that come back through
their metadata exchanges (each call's slowest rank's time). Per class of calls (collective,
dtype, power of two of the bytes):

- below ``probe_min_bytes`` always raw: latency-bound, where coding never paid in any
  measurement (docs/PERFORMANCE.md);
- the first ``explore`` calls alternate, the prior first (lossless from ``prior_min_bytes``
  up, raw below), so each codec is timed twice (one unlucky time on a shared machine must not
  decide); from then on the faster of the two by their recent times, and every ``reprobe``
  calls the slower one once more, so that a changed link or load is noticed.

A call's time reaches the policy with the next call's metadata, so decisions lag one call.
"""

from __future__ import annotations

PROBE_MIN_BYTES = 1 << 20
EXPLORE = 4
REPROBE = 32
CODECS = ("raw", "lossless")


class Policy:
    """Deterministic codec choice per class of calls; identical inputs give identical choices on
    every rank."""

    def __init__(self, prior_min_bytes: int, probe_min_bytes: int = PROBE_MIN_BYTES, explore: int = EXPLORE,
                 reprobe: int = REPROBE):
        self.prior_min_bytes, self.probe_min_bytes = prior_min_bytes, probe_min_bytes
        self.explore, self.reprobe = explore, reprobe
        self.calls: dict = {}  # class -> auto calls decided so far
        self.recent: dict = {}  # (class, codec) -> the last two times of a call

    @staticmethod
    def key(collective: str, dtype, nbytes: int) -> tuple:
        return collective, str(dtype), nbytes.bit_length()

    def choose(self, key: tuple, nbytes: int) -> str:
        if nbytes < self.probe_min_bytes:
            return "raw"
        i = self.calls.get(key, 0)
        self.calls[key] = i + 1
        prior = "lossless" if nbytes >= self.prior_min_bytes else "raw"
        other = CODECS[1 - CODECS.index(prior)]
        if i < self.explore:
            return (prior, other)[i % 2]
        times = [self.seconds(key, c) for c in CODECS]
        if None in times:
            return prior
        best = CODECS[times.index(min(times))]
        if i % self.reprobe == 0:
            return CODECS[1 - CODECS.index(best)]
        return best

    def learn(self, key: tuple, codec: str, seconds: float) -> None:
        """A finished call's time (the slowest rank's)."""
        self.recent[(key, codec)] = (self.recent.get((key, codec), ())[-1:] + (seconds,))

    def seconds(self, key: tuple, codec: str) -> float | None:
        """The codec's time in this class: the lower of its last two, since whatever else runs on
        the machine only ever adds time; None before its first."""
        times = self.recent.get((key, codec))
        return min(times) if times else None

    def table(self) -> dict:
        """{class: {codec: seconds}} learned so far (for users and tests)."""
        out: dict = {}
        for key, codec in self.recent:
            out.setdefault(key, {})[codec] = self.seconds(key, codec)
        return out
