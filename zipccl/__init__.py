"""zipccl: compressed collective communication for distributed training."""

from .errors import FormatError, MismatchError, RankFailure, UnsupportedError, ZipcclError
from . import codecs
from .api import all_gather, all_reduce, make_groups, reduce_scatter
from .alltoall import all_to_all, all_to_all_single
from .p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from . import topology
from . import backend, lifetime
from .stats import reset_stats, stats

backend.register()  # dist.init_process_group(backend="zipccl")
lifetime.wait_on_destroy()  # dist.destroy_process_group() waits for zipccl's async calls, as for torch's

__version__ = "0.1.0"
__all__ = ["ZipcclError", "FormatError", "MismatchError", "UnsupportedError", "RankFailure", "codecs", "topology",
           "backend", "all_reduce", "reduce_scatter", "all_gather", "all_to_all_single", "all_to_all", "send", "recv",
           "isend", "irecv", "batch_isend_irecv", "P2POp", "make_groups", "stats", "reset_stats"]
