"""freescale_comm: a communication runtime for distributed training of sequence recommendation
models: prioritized AllToAll on SM-free transports, jagged dispatch/combine and load balancing.

The direct face: ``fc.Communicator(group).all_to_all_single(...)``. See README.md.
"""

from freescale_comm._core import (
    CommError,
    ErrorCode,
    InternalError,
    InvalidUsageError,
    UnsupportedError,
)
from freescale_comm.build import build_info
from freescale_comm.communicator import Communicator
from freescale_comm.work import Work

__version__: str = build_info()["version"]

__all__ = [
    "CommError",
    "Communicator",
    "ErrorCode",
    "InternalError",
    "InvalidUsageError",
    "UnsupportedError",
    "Work",
    "__version__",
    "build_info",
]
