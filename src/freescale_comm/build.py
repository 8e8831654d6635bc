"""What this installation was built with."""

from __future__ import annotations

from typing import Any

from freescale_comm import _core


def build_info() -> dict[str, Any]:
    """Keys: version (str), cuda (bool: CUDA sources compiled in), nvshmem (bool),
    cuda_archs (list[int]), transports (list[str]: transports this build can construct)."""
    return dict(_core.build_info())
