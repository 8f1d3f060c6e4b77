"""The few exceptions zipccl raises, so callers can catch one base class."""

__all__ = ["ZipcclError", "FormatError", "MismatchError", "UnsupportedError"]


class ZipcclError(Exception):
    """Base class of every error zipccl raises on purpose."""


class FormatError(ZipcclError, ValueError):
    """A packet is malformed: bad magic, version, sizes, checksum or payload."""


class MismatchError(ZipcclError, RuntimeError):
    """Ranks disagreed about a collective call (dtype, numel, op, codec, plan)."""


class UnsupportedError(ZipcclError, TypeError):
    """A dtype, device, layout or option that zipccl does not support."""
