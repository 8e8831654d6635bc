"""Host values to the device without making the CPU wait for the device.

A blocking copy to CUDA (torch.tensor(..., device=d), t.to(d)) syncs the stream; so may a
non-blocking one from pageable memory (CUDA's API sync behavior: the driver may sync to stage it).
to_device stages in pinned memory first, which PyTorch's caching host allocator keeps until the
copy has run."""

from __future__ import annotations

import torch


def on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 [len(values)] of host ints on `device`, copied without a device sync."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device (see the module docstring)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device, non_blocking=True)  # (already there, or the host: the tensor itself)
