"""freescale-bench dispatch: fc.dispatch + fc.combine of jagged samples against a pure-PyTorch
reference (argsort + index_select + gloo all_to_all_single, then index_copy back) in the same run.

Every rank holds rows/ranks rows of `dim` float32 in samples of heavy-tailed lengths, each sent to
a random rank. One iteration = dispatch + combine. algbw counts the values' bytes twice (out and
back) per rank; busbw = algbw x (world - 1) / world."""

from __future__ import annotations

import time
from typing import Any

IMPLS = ("freescale", "torch+gloo")


def _jagged_lengths(rows: int, seed: int) -> Any:
    """Heavy-tailed sample lengths (log-normal, like user histories) summing to `rows`."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = []
    left = rows
    while left > 0:
        draw = torch.exp(torch.randn(4096, generator=gen) * 1.0 + 5.0).long().clamp(1, 20000)
        for n in draw.tolist():
            n = min(n, left)
            lengths.append(n)
            left -= n
            if left == 0:
                break
    return torch.tensor(lengths, dtype=torch.int64)


def _torch_reference(values: Any, lengths: Any, dest: Any, world: int) -> tuple[Any, Any]:
    """dispatch + combine with torch ops and gloo all_to_all_single: (received rows, rows home)."""
    import torch
    import torch.distributed as dist

    row_dest = torch.repeat_interleave(dest, lengths)
    row_order = torch.argsort(row_dest, stable=True)
    send = values.index_select(0, row_order)
    send_samples = torch.bincount(dest, minlength=world)
    recv_samples = torch.empty_like(send_samples)
    dist.all_to_all_single(recv_samples, send_samples)
    sample_order = torch.argsort(dest, stable=True)
    recv_lengths = torch.empty(int(recv_samples.sum()), dtype=torch.int64)
    dist.all_to_all_single(recv_lengths, lengths[sample_order], recv_samples.tolist(), send_samples.tolist())
    send_rows = torch.bincount(row_dest, minlength=world)
    sources = torch.repeat_interleave(torch.arange(world), recv_samples)
    recv_rows = torch.zeros(world, dtype=torch.int64).index_add_(0, sources, recv_lengths)
    recv = values.new_empty((int(recv_rows.sum()), *values.shape[1:]))
    dist.all_to_all_single(recv, send, recv_rows.tolist(), send_rows.tolist())
    back = torch.empty_like(send)
    dist.all_to_all_single(back, recv, send_rows.tolist(), recv_rows.tolist())
    home = torch.empty_like(values).index_copy_(0, row_order, back)
    return recv, home


def _rank_bench(info: Any, rows_per_rank: int, dim: int, warmup: int, iters: int, progress: bool) -> Any:
    import torch
    import torch.distributed as dist

    import freescale_comm as fc
    from freescale_comm.bench.report import bandwidth_row

    torch.set_num_threads(1)  # one copy thread per rank, for both implementations alike
    rank, world = info.rank, info.world_size
    lengths = _jagged_lengths(rows_per_rank, seed=rank)
    dest = torch.randint(0, world, (lengths.numel(),), generator=torch.Generator().manual_seed(100 + rank))
    values = torch.randn(rows_per_rank, dim, generator=torch.Generator().manual_seed(200 + rank))

    def freescale_run() -> tuple[Any, Any]:
        res = fc.dispatch(values, lengths, dest)
        return res.values, fc.combine(res.values, res.handle)

    runs = {"freescale": freescale_run, "torch+gloo": lambda: _torch_reference(values, lengths, dest, world)}
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(IMPLS) * (warmup + iters), desc="dispatch", unit="iter", leave=False)
    results, rows = {}, []
    for impl in IMPLS:
        times = []
        for i in range(warmup + iters):
            dist.barrier()
            t0 = time.perf_counter()
            received, home = runs[impl]()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            if bar is not None:
                bar.update(1)
        results[impl] = received
        wrong = int((home != values).sum())
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (times, wrong))
        if rank == 0:
            per_iter = [max(ts[i] for ts, _ in gathered) for i in range(len(times))]
            rows.append((impl, per_iter, sum(w for _, w in gathered)))
    # Both must deliver the same rows in the same order.
    mismatch = int((results["freescale"] != results["torch+gloo"]).sum())
    mismatches: list[Any] = [None] * world
    dist.all_gather_object(mismatches, mismatch)
    if bar is not None:
        bar.close()
    if rank != 0:
        return None
    size = rows_per_rank * dim * 4
    # algbw counts the values twice: out and back.
    return [bandwidth_row(impl, size, world, t, w + (sum(mismatches) if impl == "freescale" else 0), bytes_moved=2 * size)
            for impl, t, w in rows]


def summary(rows: list[dict[str, Any]]) -> str:
    by = {r["impl"]: r for r in rows}
    return f"# freescale dispatch+combine is {by['torch+gloo']['time_us'] / by['freescale']['time_us']:.2f}x faster than torch+gloo"


def run(ranks: int, rows: int, dim: int, warmup: int, iters: int, progress: bool) -> list[dict[str, Any]]:
    from freescale_comm.testing import RankFailure, run_ranks

    results = run_ranks(_rank_bench, ranks, rows // ranks, dim, warmup, iters, progress, timeout_s=1800)
    if not all(r.ok for r in results):
        raise RankFailure(results)
    return results[0].value
