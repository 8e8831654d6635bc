"""The bindings release the GIL where a CUDA call can block on a full stream queue (issue 29 item
3.1): recording the submission event on the caller's stream waits for room in its queue, and what
drains that queue may be a done-callback the progress thread runs, which takes the GIL. Run on
the emulated device (`_core._emulated`, test equipment of FREESCALE_TEST_SUPPORT=ON builds) with a
ce communicator: no GPU needed."""

import torch
import torch.distributed as dist

from freescale_comm import _core
from freescale_comm._bootstrap import StoreBootstrap
from freescale_comm.testing import spawn


def a_full_stream_queue_drained_by_a_done_callback(info) -> list[int]:
    """Op A's done-callback (Python, on the progress thread) opens a gate that the caller's full
    stream waits on; op B is then submitted on that stream, so its submission event waits for
    room. Holding the GIL there deadlocked: the callback could never run. Returns B's output."""
    # (Event creation is left unblocked by the test's own stream waits: not what this tests.)
    device = _core._emulated.EmulatedDevice(queue_depth=2, creation_blocks_while_waiting=False)
    comm = _core._emulated.ce_communicator(StoreBootstrap(dist.HashStore(), 0, 1), _core.Config(), device)
    user, side = device.create_stream(), device.create_stream()
    gate, start = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    a_in, a_out = torch.arange(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    b_in, b_out = torch.arange(8, 16, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    layout = _core.AllToAllLayout.packed([64], [64])
    device.wait_geq(side, start.data_ptr(), 1)  # A starts only once its callback is registered
    a = comm.all_to_all(a_in.data_ptr(), a_out.data_ptr(), layout, 0, False, side)
    a.add_done_callback(lambda: gate.fill_(1))
    device.wait_geq(user, gate.data_ptr(), 1)  # running: the queue holds two more
    while device.queued(user) < 2:
        device.wait_geq(user, gate.data_ptr(), 1)
    start.fill_(1)
    b = comm.all_to_all(b_in.data_ptr(), b_out.data_ptr(), layout, 0, False, user)  # hung here
    comm.wait(b, 30.0)
    comm.wait(a, 30.0)
    device.synchronize(user)
    comm.close()
    assert torch.equal(a_out, a_in)
    return b_out.tolist()


def test_submitting_on_a_full_stream_queue_lets_done_callbacks_run(emulated_device_built):
    assert spawn(a_full_stream_queue_drained_by_a_done_callback, 1, timeout_s=60) == [list(range(8, 16))]
