"""freescale-bench alltoall: all_to_all_single on CPU tensors, freescale's host transport vs gloo in
the same run, plus a `limit` row: every rank copying its bytes once with memcpy, concurrently (the
single-copy ceiling of this machine)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Optional

DEFAULT_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
IMPLS = ("freescale", "gloo", "limit")


def iterations_for(size_bytes: int) -> int:
    """Enough iterations for a stable mean, capped so the whole sweep takes about a minute."""
    if size_bytes <= 1 << 20:
        return 200
    if size_bytes <= 4 << 20:
        return 20
    if size_bytes <= 16 << 20:
        return 10
    return 6


def _expected(rank: int, world: int, n: int):
    import torch

    # Input of rank p: p * n + arange(n); rank r receives p's r-th block of m = n / world.
    m = n // world
    return torch.cat([p * n + rank * m + torch.arange(m, dtype=torch.int32) for p in range(world)])


def _rank_bench(info: Any, sizes: Sequence[int], warmup: int, iters: Optional[int], progress: bool) -> Optional[list[dict]]:
    import torch
    import torch.distributed as dist

    import freescale_comm as fc
    from freescale_comm.bench.report import bandwidth_row

    torch.set_num_threads(1)  # one copy thread per rank, for every implementation alike
    rank, world = info.rank, info.world_size
    comm = fc.Communicator()
    runs = {
        "freescale": lambda out, x: comm.all_to_all_single(out, x),
        "gloo": lambda out, x: dist.all_to_all_single(out, x),
        "limit": lambda out, x: out.copy_(x),
    }
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(sizes) * len(IMPLS), desc="alltoall", unit="case", leave=False)
    rows = []
    for size in sizes:
        n = max(world, size // 4 // world * world)  # int32 elements, divisible by world
        x = torch.arange(n, dtype=torch.int32) + rank * n
        expected = _expected(rank, world, n)
        for impl in IMPLS:
            out = torch.zeros(n, dtype=torch.int32)
            run = runs[impl]
            count = iters or iterations_for(size)
            for _ in range(warmup):
                run(out, x)
            dist.barrier()  # then back to back: every rank's iterations overlap the others'
            times = _batched_copy_times(run, out, x, count) if impl == "limit" else _op_times(run, out, x, count)
            wrong = int((out != (x if impl == "limit" else expected)).sum())
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, (times, wrong))
            if rank == 0:
                # An iteration lasts as long as its slowest rank.
                per_iter = [max(ts[i] for ts, _ in gathered) for i in range(len(times))]
                rows.append(bandwidth_row(impl, n * 4, world, per_iter, sum(w for _, w in gathered)))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    comm.close()
    return rows if rank == 0 else None


def _op_times(run: Any, out: Any, x: Any, count: int) -> list[float]:
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        run(out, x)
        times.append(time.perf_counter() - t0)
    return times


def _batched_copy_times(run: Any, out: Any, x: Any, count: int, batch_s: float = 0.05) -> list[float]:
    """Seconds per copy, from the wall time of batches lasting about `batch_s`: long enough that
    every rank's copies overlap the others' and share the cores, as they would in a collective."""
    t0 = time.perf_counter()
    run(out, x)
    per_batch = max(1, int(batch_s / max(time.perf_counter() - t0, 1e-7)))
    times = []
    for _ in range(count if count < 10 else 10):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            run(out, x)
        times.append((time.perf_counter() - t0) / per_batch)
    return times


def goal_summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """freescale's busbw relative to gloo and to the memcpy limit, per size."""
    by = {(r["impl"], r["size_bytes"]): r for r in rows}
    lines = ["# freescale busbw relative to gloo and to the single-copy limit"]
    for size in sorted({r["size_bytes"] for r in rows}):
        fs, gl, lim = (by.get((i, size)) for i in IMPLS)
        if not (fs and gl and lim):
            continue
        lines.append(
            f"{size:>10} B   x gloo {fs['busbw_gbps'] / gl['busbw_gbps']:6.2f}   "
            f"of limit {100 * fs['busbw_gbps'] / lim['busbw_gbps']:5.1f}%"
        )
    return lines


def run(ranks: int, sizes: Sequence[int], warmup: int, iters: Optional[int], progress: bool) -> list[dict[str, Any]]:
    from freescale_comm.testing import RankFailure, run_ranks

    results = run_ranks(_rank_bench, ranks, list(sizes), warmup, iters, progress, timeout_s=1800)
    if not all(r.ok for r in results):
        raise RankFailure(results)
    return results[0].value
