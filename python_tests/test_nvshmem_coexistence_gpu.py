"""The nvshmem transport beside other NVSHMEM users of the process (issue 43), on a GPU: written
here, skipped without CUDA, NVSHMEM, torch's NVSHMEM symmetric memory or nvshmem4py; never called
passing without a GPU. Two ranks share GPU 0 (NVSHMEM needs MPS for that: gpu-checklist)."""

import importlib.util

import pytest

import freescale_comm as fc
from freescale_comm.testing import spawn
import coexistence_programs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fc.build_info()["nvshmem"], reason="built without NVSHMEM"),
]

NVSHMEM = {"FREESCALE_TRANSPORT": "nvshmem"}


def test_torch_symmetric_memory_first_then_ours_then_torch_again():
    symm_mem = pytest.importorskip("torch.distributed._symmetric_memory")
    if not getattr(symm_mem, "is_nvshmem_available", lambda: False)():
        pytest.skip("this torch's symmetric memory has no NVSHMEM backend")
    for r in spawn(coexistence_programs.torch_symmetric_memory_first, 2, env=NVSHMEM, timeout_s=300):
        assert r == {"torch first": True, "ours": True, "joined": True, "torch again": True}, r


@pytest.mark.skipif(importlib.util.find_spec("nvshmem") is None, reason="nvshmem4py is not installed")
def test_ours_first_then_nvshmem4py_initializes_allocates_and_puts():
    for r in spawn(coexistence_programs.ours_first_then_nvshmem4py, 2, env=NVSHMEM, timeout_s=300):
        assert r == {"ours": True, "started by us": True, "put landed": True, "ours after": True}, r
