"""The few exceptions zipccl raises, so callers can catch one base class."""

__all__ = ["ZipcclError", "FormatError", "MismatchError", "UnsupportedError", "RankFailure", "TimeoutError"]


class ZipcclError(Exception):
    """Base class of every error zipccl raises on purpose."""


class FormatError(ZipcclError, ValueError):
    """A packet is malformed: bad magic, version, sizes, checksum or payload."""


class MismatchError(ZipcclError, RuntimeError):
    """Ranks disagreed about a collective call (dtype, numel, op, codec, plan)."""


class UnsupportedError(ZipcclError, TypeError):
    """A dtype, device, layout or option that zipccl does not support."""


class RankFailure(ZipcclError, RuntimeError):
    """A rank failed inside a collective (zipccl.failure): raised on every rank of the group.
    ``rank``: the failing rank (of the job, as dist.get_rank(); -1 where a collective of the
    backend failed and no rank can be named); ``kind``: what failed ("corrupt": a packet it sent
    failed validation, "encode", "decode", "size", "reduce", "lost", "memory", "other");
    ``broken``: the process group lost a connection and must be rebuilt."""

    def __init__(self, message: str, rank: int = -1, kind: str = "other", broken: bool = False):
        super().__init__(message)
        self.rank, self.kind, self.broken = rank, kind, broken


class TimeoutError(ZipcclError, TimeoutError, RuntimeError):  # noqa: A001 - also the builtin's subclass
    """An async handle's ``wait(timeout)`` ran out before the call finished. A RuntimeError too,
    as what torch's backends raise there, so that code written for them catches it."""
