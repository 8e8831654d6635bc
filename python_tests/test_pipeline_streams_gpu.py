"""TrainPipelinePEC's worker stream on a GPU (skipped without CUDA; gpu checklist item 9): a host
read on the worker waits for the worker's own work, not for kernels the main thread enqueued after
posting the task, while on the legacy default stream (the pipeline before its own stream) it waits
for them; joining the task orders the main stream after it; a pageable batch copy holds the main
thread up only when issued on the main stream (the pipeline issues it on the worker)."""

import concurrent.futures

import pytest
import torch

from freescale_comm.pipelines._streams import CudaStreams

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 500_000_000  # ~0.3 s of GPU clock at ~1.5 GHz: far longer than the task's own work


def _task_while_main_is_busy(on_own_stream: bool) -> tuple[float, bool]:
    """Posts a task (a kernel, then a host read), then enqueues a long kernel on the main stream;
    returns (the task's result, whether the long kernel had finished when the task returned)."""
    device = torch.device("cuda", torch.cuda.current_device())
    streams = CudaStreams(device)
    worker = concurrent.futures.ThreadPoolExecutor(1, initializer=lambda: torch.cuda.set_device(device))
    x = torch.arange(4, device=device, dtype=torch.float32)

    def task() -> float:
        return float((x * 2).sum().item())  # a host read, as the exchange's sizes are read

    task()
    with torch.cuda.stream(streams.side):  # both streams' cached blocks warm: no cudaMalloc in the measured run
        task()
    torch.cuda.synchronize()
    mark = streams.posted()  # the task is ordered after x, not after what follows
    busy_done = torch.cuda.Event()

    run = (lambda: streams.run(mark, task, ())) if on_own_stream else (lambda: (task(), None))
    torch.cuda._sleep(SLEEP_CYCLES)  # the main thread's "forward", enqueued after the post
    busy_done.record()
    result, done = worker.submit(run).result()
    finished_first = busy_done.query()
    if done is not None:
        streams.joined(done)
    torch.cuda.synchronize()
    worker.shutdown()
    return result, finished_first


def test_the_workers_host_reads_do_not_wait_for_the_main_streams_kernels():
    result, main_finished = _task_while_main_is_busy(on_own_stream=True)
    assert result == 12.0
    assert not main_finished, "the worker's host read waited for the main stream's kernel"


def test_on_the_legacy_default_stream_they_did():
    """The baseline the worker stream fixes (if this fails, the default stream is per-thread here and
    the first test proves less than it says)."""
    result, main_finished = _task_while_main_is_busy(on_own_stream=False)
    assert result == 12.0 and main_finished


def test_joining_a_task_orders_the_main_stream_after_it():
    device = torch.device("cuda", torch.cuda.current_device())
    streams = CudaStreams(device)
    worker = concurrent.futures.ThreadPoolExecutor(1, initializer=lambda: torch.cuda.set_device(device))
    out = torch.zeros(1 << 20, device=device)

    def task() -> None:  # a long kernel, then a write, on the worker's stream
        torch.cuda._sleep(SLEEP_CYCLES)
        out.fill_(1.0)

    _, done = worker.submit(streams.run, streams.posted(), task, ()).result()
    streams.joined(done)
    total = out.sum()  # on the main stream: after the task's write, because of the join
    assert float(total) == out.numel()
    worker.shutdown()


def test_a_pageable_batch_copy_waits_for_the_compute_stream_unless_the_worker_issues_it():
    """Why the pipeline copies batches on the worker (_route): a non_blocking copy from pageable
    memory syncs the stream it is issued on, so on the main stream the main thread waits for the
    kernels queued there (its forward and backward), at least once the batch is too large to stage
    at once; issued by the worker on its own stream, the main thread does not wait at all."""
    device = torch.device("cuda", torch.cuda.current_device())
    streams = CudaStreams(device)
    worker = concurrent.futures.ThreadPoolExecutor(1, initializer=lambda: torch.cuda.set_device(device))
    # 64 MiB, pageable: on an H200 (driver 580, 2026-11-27) a 256 KiB copy was staged at once and
    # returned before the stream's kernels ran; 16 MiB and 256 MiB waited for them.
    host = torch.arange(1 << 24, dtype=torch.float32)
    assert not host.is_pinned()
    host.to(device, non_blocking=True)  # warm both streams' pools
    worker.submit(streams.run, streams.posted(), lambda: host.to(device, non_blocking=True), ()).result()
    torch.cuda.synchronize()

    busy_done = torch.cuda.Event()
    torch.cuda._sleep(SLEEP_CYCLES)  # the main stream's "forward"
    busy_done.record()
    # On the worker: whether the main stream's kernels had run when its copy returned (they had not:
    # the copy did not wait for them).
    copied = worker.submit(streams.run, streams.posted(),
                           lambda: (host.to(device, non_blocking=True), busy_done.query()), ())
    (result, kernels_ran_first), done = copied.result()
    streams.joined(done)
    assert not kernels_ran_first and torch.equal(result.cpu(), host)

    torch.cuda._sleep(SLEEP_CYCLES)
    busy_done.record()
    on_main = host.to(device, non_blocking=True)
    assert busy_done.query(), "a pageable copy on the main stream returned before its kernels ran: the baseline moved"
    assert torch.equal(on_main.cpu(), host)
    worker.shutdown()
