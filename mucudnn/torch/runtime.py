"""The names mucudnn.torch's runtime had before it was split by responsibility (docs/torch.md):
the session (:mod:`.offload_session`), its plan's lifecycle (:mod:`.session_plans`), the
recorder of a step's calls and profile (:mod:`.recorder`), the records of a step
(:mod:`.records`) and the host links (:mod:`.link`). Scripts that import them from here keep
working; new code imports them from those modules."""

from .link import CudaLink, Mark, SameMemoryLink, Transfer, dense, measure_bandwidth
from .offload_session import OffloadSession
from .recorder import ADDS, CONCATS
from .recording import LINK_PROBE_BYTES
from .records import CHEAP, CONVOLUTIONS, offload_everything, rerun_as_recorded

__all__ = ["ADDS", "CHEAP", "CONCATS", "CONVOLUTIONS", "LINK_PROBE_BYTES", "CudaLink", "Mark",
           "OffloadSession", "SameMemoryLink", "Transfer", "dense", "measure_bandwidth",
           "offload_everything", "rerun_as_recorded"]
