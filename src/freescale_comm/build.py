"""What this installation was built with."""

from __future__ import annotations

from typing import Any

from freescale_comm import _core


LAYOUT_KERNELS = ("triton: src/freescale_comm/_layout_kernels.py (plan, gather, scatter of fc.dispatch / fc.combine on "
                  "CUDA tensors; the compiled core launches no kernel); CI tests them on CPU through Triton's "
                  "interpreter, never timed there")


def build_info() -> dict[str, Any]:
    """Keys: version (str), cuda (bool: CUDA sources compiled in), nvshmem (bool),
    cuda_archs (list[int]), transports (list[str]: transports this build can construct),
    layout_kernels (str: where the only SM kernels live and how they are tested)."""
    return {**_core.build_info(), "layout_kernels": LAYOUT_KERNELS}
