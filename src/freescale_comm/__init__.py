"""freescale_comm: a communication runtime for distributed training of sequence recommendation
models: prioritized AllToAll on SM-free transports, jagged dispatch/combine and load balancing.

Importing it registers the torch.distributed backend "freescale". The direct faces:
``fc.Communicator(group).all_to_all_single(...)``, ``fc.dispatch`` / ``fc.combine``. See README.md.
"""

from freescale_comm._core import (
    CommError,
    ErrorCode,
    InternalError,
    InvalidUsageError,
    UnsupportedError,
)
from freescale_comm import microbatch, planner
from freescale_comm.backend import Options, ProcessGroupFreescale, priority, register_backend
from freescale_comm.balancer import BalancedBatch, BalancedBundle, LoadBalancer, balance
from freescale_comm.build import build_info
from freescale_comm.communicator import Communicator
from freescale_comm.dispatch import DispatchHandle, DispatchResult, combine, dispatch
from freescale_comm.work import Work

__version__: str = build_info()["version"]


def __getattr__(name: str) -> object:
    """TrainPipelinePEC imports torchrec: loaded on first use, so `import freescale_comm` does not need it."""
    if name == "TrainPipelinePEC":
        from freescale_comm.pipelines import TrainPipelinePEC
        return TrainPipelinePEC
    raise AttributeError(f"module 'freescale_comm' has no attribute {name!r}")


def __dir__() -> list[str]:
    """With TrainPipelinePEC (loaded on first use; left out of __all__, so `import *` needs no torchrec)."""
    return sorted([*globals(), "TrainPipelinePEC"])

register_backend()

__all__ = [
    "BalancedBatch",
    "BalancedBundle",
    "CommError",
    "Communicator",
    "DispatchHandle",
    "DispatchResult",
    "ErrorCode",
    "InternalError",
    "InvalidUsageError",
    "LoadBalancer",
    "Options",
    "ProcessGroupFreescale",
    "UnsupportedError",
    "Work",
    "__version__",
    "balance",
    "build_info",
    "combine",
    "dispatch",
    "microbatch",
    "planner",
    "priority",
    "register_backend",
]
