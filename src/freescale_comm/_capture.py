"""CUDA graph capture: freescale's transfers are driven by the host per op, so a graph replay
could not repeat them. Every CUDA entry point refuses capture first, before it touches the
device (a host sync, such as reading counts back, would invalidate the user's capture)."""

from __future__ import annotations

import torch

from freescale_comm import _core


def refuse_capture(device: torch.device, what: str) -> None:
    """InvalidUsageError if the current stream of `device` (the tensors' GPU, not the current
    one) is capturing a CUDA graph; `what` names the call."""
    with torch.cuda.device(device):
        capturing = torch.cuda.is_current_stream_capturing()
    if capturing:
        raise _core.InvalidUsageError(
            f"{what} on CUDA tensors of {device} cannot be captured into a CUDA graph: freescale's transfers are "
            "driven by the host for every op, so a replay would not repeat them; run it outside the captured region"
        )
