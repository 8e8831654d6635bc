"""The NVSHMEM transport on a GPU (skipped without CUDA or without NVSHMEM in the build). One
PE puts to itself; several PEs on one GPU need NVSHMEM to allow it (without MPS it runs them in
"limited MPG" mode, whose on-stream calls may end the process: the transport refuses it)."""

import pytest

import freescale_comm as fc
from freescale_comm.testing import spawn
import ce_programs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not fc.build_info()["nvshmem"], reason="built without NVSHMEM"),
]

MiB = 1 << 20
NVSHMEM = {"FREESCALE_TRANSPORT": "nvshmem"}
CASES = [("float32", 0), ("float32", 4096), ("bfloat16", 300_000), ("int64", 3 * MiB), ("uint8", 7 * MiB + 5),
         ("float16", 64 * MiB)]


def test_the_forced_transport_is_nvshmem_and_takes_no_kernels_to_itself():
    [(name, path)] = spawn(ce_programs.cuda_transport_and_data_path, 1, env=NVSHMEM, timeout_s=300)
    assert name == "nvshmem"
    assert path.startswith("nvshmem (driver "), path
    # One PE, mapped to itself: SM kernels at most for the copies within the GPU, before driver 13.1.
    assert "no SM kernels" in path or "SM kernels for copies within this GPU only" in path, path


def test_one_pe_put_to_self_matches_a_pure_torch_reference():
    assert spawn(ce_programs.alltoallv_matches_reference, 1, CASES, env=NVSHMEM, timeout_s=600) == [[]]


def test_two_pes_on_one_gpu_match_a_pure_torch_reference():
    for wrong in spawn(ce_programs.alltoallv_matches_reference, 2, CASES, env=NVSHMEM, timeout_s=600):
        assert wrong == []


def test_the_data_path_launches_no_kernels():
    [(kernels, copies)] = spawn(ce_programs.kernels_during_alltoall, 1, 64 * MiB, env=NVSHMEM, timeout_s=300)
    assert kernels == [] and copies > 0, (kernels, copies)


def test_a_later_urgent_transfer_overtakes_a_bulk_one():
    assert spawn(ce_programs.urgent_overtakes_bulk, 1, 256 * MiB, env=NVSHMEM, timeout_s=300) == [True]


def test_back_to_back_synchronous_ops_do_not_deadlock():
    assert spawn(ce_programs.back_to_back_ops_without_a_host_sync, 1, 64 * MiB, 4, env=NVSHMEM,
                 timeout_s=300) == [[0, 0, 0, 0]]
