"""An independent view of what the CUDA driver offers, through cuda-python's driver bindings (the
optional ``probe`` extra, ``pip install freescale_comm[probe]``): the driver version, the copy
engines, and the device attributes the transports rely on. GPU tests compare it with
``Communicator.data_paths``; where there is no driver (or no cuda-python) it says why instead of
raising."""

from __future__ import annotations

from typing import Any

# CUdevice_attribute numbers (cuda.h 13.0) the transports check, by the name cuda.h gives them.
ATTRIBUTES = {
    "ASYNC_ENGINE_COUNT": 40,
    "UNIFIED_ADDRESSING": 41,
    "CAN_FLUSH_REMOTE_WRITES": 98,
    "HOST_REGISTER_SUPPORTED": 99,
    "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": 102,
    "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED": 103,
    "GPU_DIRECT_RDMA_SUPPORTED": 116,
    "GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS": 117,
    "GPU_DIRECT_RDMA_WRITES_ORDERING": 118,
    "CAN_USE_64_BIT_STREAM_MEM_OPS": 122,
}


def probe(device: int = 0) -> dict[str, Any]:
    """{"available": bool, "why": str (when not), "driver_version": int (13010 = 13.1),
    "attributes": {name: value}} for CUDA device `device`. Never raises."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        return {"available": False, "why": f"cuda-python is not installed ({e}): pip install freescale_comm[probe]"}

    def call(fn, *args):
        """A driver call's results after its CUresult; raises RuntimeError naming a failure."""
        err, *out = fn(*args)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{fn.__name__} returned {err}")
        return out[0] if len(out) == 1 else out

    try:
        call(driver.cuInit, 0)
        version = call(driver.cuDriverGetVersion)
        dev = call(driver.cuDeviceGet, device)
        attributes = {name: call(driver.cuDeviceGetAttribute, driver.CUdevice_attribute(number), dev)
                      for name, number in ATTRIBUTES.items()}
    except Exception as e:  # no driver (libcuda missing), no device, an old driver
        return {"available": False, "why": f"the CUDA driver cannot be probed here: {e}"}
    return {"available": True, "driver_version": int(version), "attributes": attributes}
