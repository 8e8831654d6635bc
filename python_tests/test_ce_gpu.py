"""The copy-engine transport on a GPU (skipped without CUDA): several ranks share GPU 0."""

import pytest

from freescale_comm.testing import spawn
import ce_programs
import failure_path_programs

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.mark.parametrize("world", [2, 4])
def test_ce_alltoallv_matches_a_pure_torch_reference(world):
    cases = [("float32", 0), ("float32", 4096), ("bfloat16", 300_000), ("int64", 3 * MiB), ("uint8", 7 * MiB + 5),
             ("float16", 64 * MiB), ("float32", 256 * MiB)]
    for wrong in spawn(ce_programs.alltoallv_matches_reference, world, cases, timeout_s=600):
        assert wrong == []


def test_ce_path_launches_no_kernels():
    for kernels, copies in spawn(ce_programs.kernels_during_alltoall, 2, 64 * MiB, timeout_s=300):
        assert kernels == [] and copies > 0, (kernels, copies)


def test_a_later_urgent_transfer_overtakes_a_bulk_one():
    assert spawn(ce_programs.urgent_overtakes_bulk, 2, 256 * MiB, timeout_s=300) == [True, True]



def test_capture_into_a_cuda_graph_is_refused_clearly():
    for message in spawn(ce_programs.capture_is_refused_and_the_communicator_goes_on, 2, timeout_s=300):
        assert "CUDA graph" in message


def test_the_freescale_backend_moves_cuda_alltoall_on_copy_engines():
    assert spawn(ce_programs.backend_moves_cuda_alltoall_on_copy_engines, 2, backend="freescale",
                 timeout_s=300) == [[0], [0]]


def test_back_to_back_synchronous_ops_do_not_deadlock():
    for wrong in spawn(ce_programs.back_to_back_ops_without_a_host_sync, 2, 64 * MiB, 4, timeout_s=300):
        assert wrong == [0, 0, 0, 0]


def test_cuda_futures_order_the_stream_that_waits_on_them():
    for wrong in spawn(ce_programs.futures_order_the_waiting_stream, 2, 256 * MiB, backend="freescale",
                       timeout_s=300):
        assert wrong == {"wait": 0, "then": 0, "wait_then_future": 0, "single": 0}


def test_ops_on_64_torch_streams_made_before_the_first_op_all_complete():
    """Checklist item 2: torch's stream pool hands out shared streams; the transport's own
    streams and events must not depend on any of them staying idle."""
    assert spawn(failure_path_programs.ops_on_many_streams, 2, 64, timeout_s=300) == [0, 0]
