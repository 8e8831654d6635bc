"""Tensors of an op that failed after its communicator gave up on device copies it cannot cancel
(a lane stuck behind work it cannot see end; the emulated case is cpp_tests' CeEmulatedFailures.
AnAbandonedLaneIsSaidAndWhatItTouchesStaysMapped) stay referenced for the life of the process: freed,
the caching allocator would hand their blocks to new tensors while the stuck copies still write
them. Other completed ops' tensors are freed as before."""

import gc
import weakref

import pytest
import torch

from freescale_comm import work as work_module
from freescale_comm.communicator import Communicator
from freescale_comm.work import Work


class FakeHandle:
    def __init__(self, failed: bool) -> None:
        self._failed = failed

    def is_completed(self) -> bool:
        return True

    def failed(self) -> bool:
        return self._failed


class FakeCore:
    def __init__(self, abandoned: bool) -> None:
        self.device_work_abandoned = abandoned
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _communicator_holding(work: Work, core: FakeCore) -> Communicator:
    comm = Communicator.__new__(Communicator)
    comm._inflight, comm._cuda_cores, comm._core = [work], {}, core
    comm._forked_from, comm._timeout_ms = None, 1000
    return comm


@pytest.mark.parametrize("settled_by", ["next_op", "close"])
@pytest.mark.parametrize("failed, abandoned, kept", [(True, True, True), (True, False, False), (False, True, False)])
def test_only_a_failed_ops_tensors_under_abandoned_device_work_are_kept(settled_by, failed, abandoned, kept):
    core = FakeCore(abandoned)
    out = torch.ones(4)
    ref = weakref.ref(out)
    comm = _communicator_holding(Work(core, FakeHandle(failed), [out], keepalive=(out,)), core)
    held = len(work_module._ABANDONED_BUFFERS)
    del out
    if settled_by == "next_op":
        comm._forget_completed()
    else:
        comm._close(drain=False)
    assert comm._inflight == []
    gc.collect()
    assert (ref() is not None) == kept
    assert len(work_module._ABANDONED_BUFFERS) - held == int(kept)
