"""zipccl: compressed collective communication for distributed training."""

from .errors import FormatError, MismatchError, UnsupportedError, ZipcclError
from . import codecs

__version__ = "0.1.0"
__all__ = ["ZipcclError", "FormatError", "MismatchError", "UnsupportedError", "codecs"]
