"""freescale-bench overlap: what communication costs the compute it overlaps, on one GPU.

Ranks are processes sharing GPU 0 (CUDA IPC works within a device). Rank 0 runs a bf16 GEMM sized
to last 5-10 ms alone; then the same GEMM while every rank runs one AllToAll of `size` bytes:
  sm_copy  the bytes moved by an SM kernel (torch index_select of the rank's input: what an
           SM-driven AllToAll such as NCCL's costs the SMs on this GPU);
  ce       freescale's copy-engine transport (Communicator.all_to_all_single; no kernels), or
  nvshmem  its NVSHMEM transport (--transport nvshmem).
The GEMM's slowdown is against gemm_alone in the same run; comm_ms is the AllToAll's time from
its submission to its completion (CUDA events on its stream). Plus the busbw of both vs size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

TRANSPORTS = ("ce", "nvshmem")
DEFAULT_SIZES = [64 << 20, 128 << 20, 256 << 20]
DEFAULT_BUSBW_SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
GEMM_TARGET_MS = (5.0, 10.0)


@dataclass(frozen=True)
class OverlapConfig:
    ranks: int = 2  # processes sharing GPU 0
    sizes: tuple[int, ...] = tuple(DEFAULT_SIZES)  # bytes per rank of the overlapped AllToAll
    busbw_sizes: tuple[int, ...] = tuple(DEFAULT_BUSBW_SIZES)
    reps: int = 10  # measured repetitions per case (medians reported)
    warmup: int = 3
    transport: str = "ce"  # freescale's transport under test: ce | nvshmem

    @property
    def cases(self) -> tuple[str, ...]:
        return ("gemm_alone", "sm_copy", self.transport)

    def check(self) -> None:
        if self.ranks < 1:
            raise ValueError("--ranks must be at least 1 (one rank: an AllToAll to itself; busbw is then 0)")
        if self.reps < 1 or self.warmup < 0:
            raise ValueError("--reps must be >= 1 and --warmup >= 0")
        if any(s < 4 * self.ranks for s in (*self.sizes, *self.busbw_sizes)):
            raise ValueError(f"sizes must be at least {4 * self.ranks} bytes (one float per rank)")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--transport must be one of {TRANSPORTS}, got {self.transport!r}")


def _median(xs: Sequence[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _gemm(n: int) -> Callable[[], Any]:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    return lambda: torch.mm(a, b, out=out)


def _elapsed_ms(run: Callable[[], Any], stream: Any) -> Callable[[], float]:
    """Enqueues run() on `stream` between two events; the returned call (after a sync) gives ms."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        run()
        end.record()
    return lambda: start.elapsed_time(end)


def size_gemm(target_ms: tuple[float, float] = GEMM_TARGET_MS) -> tuple[int, float]:
    """(n, ms): a square bf16 GEMM of n lasting within target_ms alone on this GPU."""
    import torch

    stream = torch.cuda.current_stream()
    n, ms = 4096, 0.0
    for _ in range(6):
        gemm = _gemm(n)
        for _ in range(3):
            gemm()
        timings = [_elapsed_ms(gemm, stream) for _ in range(5)]
        torch.cuda.synchronize()
        ms = _median([t() for t in timings])
        if target_ms[0] <= ms <= target_ms[1]:
            return n, ms
        goal = sum(target_ms) / 2
        n = max(512, int(round(n * (goal / ms) ** (1 / 3) / 256)) * 256)  # time ~ n^3
    return n, ms


class _CommCase:
    """`size` bytes of int32 per rank (input of rank p: p * n + arange(n)), moved by a case's call
    (enqueued on the current stream); wrong() counts elements off their expected value."""

    def __init__(self, comm: Any, rank: int, world: int, size: int, transport: str) -> None:
        import torch

        from freescale_comm.bench.alltoall import _expected

        self.n = n = max(world, size // 4 // world * world)
        self.x = torch.arange(n, dtype=torch.int32, device="cuda") + rank * n
        self.out = torch.empty_like(self.x)
        self.expected = {"sm_copy": self.x, transport: _expected(rank, world, n).cuda()}
        blocks, idx = self.x.view(world, -1), torch.arange(world, device="cuda")
        self.runs: dict[str, Callable[[], Any]] = {
            "sm_copy": lambda: torch.index_select(blocks, 0, idx, out=self.out.view(world, -1)),
            transport: lambda: comm.all_to_all_single(self.out, self.x),
        }

    def wrong(self, case: str) -> int:
        import torch

        torch.cuda.synchronize()
        wrong = int((self.out != self.expected[case]).sum())
        self.out.fill_(-1)
        return wrong


def _busbw_rows(comm: Any, rank: int, world: int, cfg: OverlapConfig, side: Any, bar: Any) -> list[dict[str, Any]]:
    """AllToAll busbw vs size: sm_copy (baseline) and the transport, checked then timed."""
    import torch
    import torch.distributed as dist

    from freescale_comm.bench.report import bandwidth_row

    busbw_rows = []
    for size in cfg.busbw_sizes:
        data = _CommCase(comm, rank, world, size, cfg.transport)
        for case in ("sm_copy", cfg.transport):
            data.runs[case]()
            wrong = data.wrong(case)  # checked once, then timed
            for _ in range(cfg.warmup):
                data.runs[case]()
            torch.cuda.synchronize()
            dist.barrier()  # every rank's ops start together
            timers = [_elapsed_ms(data.runs[case], side) for _ in range(cfg.reps)]
            torch.cuda.synchronize()
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, ([t() / 1e3 for t in timers], wrong))
            per_rep = [max(ts[i] for ts, _ in gathered) for i in range(cfg.reps)]  # the slowest rank
            busbw_rows.append(bandwidth_row(case, data.n * 4, world, per_rep, sum(w for _, w in gathered)))
        if bar is not None:
            bar.update(1)
    return busbw_rows


def _rank_bench(info: Any, cfg: OverlapConfig, progress: bool, busbw_only: bool) -> Optional[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    import freescale_comm as fc

    torch.cuda.set_device(0)
    rank, world = info.rank, info.world_size
    comm = fc.Communicator()
    side = torch.cuda.Stream()
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm

        total = len(cfg.busbw_sizes) + (0 if busbw_only else len(cfg.sizes))
        bar = tqdm(total=total, desc="overlap", unit="size", leave=False)
    busbw_rows = _busbw_rows(comm, rank, world, cfg, side, bar)
    # How the bytes moved (e.g. SM kernels for copies within one GPU before driver 13.1): a figure
    # of copy engines means nothing without it.
    data_path = comm.data_paths.get("cuda:0", "unknown")
    if busbw_only:
        if bar is not None:
            bar.close()
        comm.close()
        return {"busbw_rows": busbw_rows, "device": torch.cuda.get_device_name(0),
                "data_path": data_path} if rank == 0 else None

    gemm, gemm_n, gemm_ms = None, 0, 0.0
    if rank == 0:
        gemm_n, gemm_ms = size_gemm()
        gemm = _gemm(gemm_n)
    compute = torch.cuda.current_stream()
    rows = []
    for size in cfg.sizes:
        runs = _CommCase(comm, rank, world, size, cfg.transport).runs
        for case in cfg.cases:
            gemm_times, comm_times = [], []
            for rep in range(cfg.warmup + cfg.reps):
                torch.cuda.synchronize()
                dist.barrier()
                # The GEMM first (it only enqueues): a synchronous ce op returns once its copies are
                # nearly all run (the CPU runs ahead by one window), so after it the GEMM overlapped nothing.
                gemm_timer = _elapsed_ms(gemm, compute) if gemm is not None else None
                comm_timer = _elapsed_ms(runs[case], side) if case != "gemm_alone" else None
                torch.cuda.synchronize()
                if rep >= cfg.warmup:
                    if gemm_timer is not None:
                        gemm_times.append(gemm_timer())
                    if comm_timer is not None:
                        comm_times.append(comm_timer())
            gathered = [None] * world
            dist.all_gather_object(gathered, comm_times)  # rank 0 reports the slowest rank's median
            if rank == 0:
                comm_ms = max(_median(ts) for ts in gathered) if comm_times else 0.0
                rows.append({"case": case, "size_bytes": size, "gemm_n": gemm_n, "gemm_ms": _median(gemm_times),
                             "comm_ms": comm_ms, "ranks": world})
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    comm.close()
    if rank != 0:
        return None
    for r in rows:
        alone = next(x for x in rows if x["size_bytes"] == r["size_bytes"] and x["case"] == "gemm_alone")
        r["slowdown_pct"] = 100.0 * (r["gemm_ms"] / alone["gemm_ms"] - 1.0)
    return {"rows": rows, "busbw_rows": busbw_rows, "gemm_n": gemm_n, "gemm_sized_ms": gemm_ms,
            "device": torch.cuda.get_device_name(0), "data_path": data_path}


def run(cfg: OverlapConfig, progress: bool, busbw_only: bool = False) -> dict[str, Any]:
    """Spawns cfg.ranks processes on GPU 0 (FREESCALE_TRANSPORT=cfg.transport) and returns rank
    0's result: rows, busbw_rows, device (busbw_rows and device only when busbw_only)."""
    from freescale_comm.testing import RankFailure, run_ranks

    results = run_ranks(_rank_bench, cfg.ranks, cfg, progress, busbw_only, timeout_s=1800,
                        env={"FREESCALE_TRANSPORT": cfg.transport})
    if not all(r.ok for r in results):
        raise RankFailure(results)
    return results[0].value


def table(rows: Sequence[dict[str, Any]], title: str) -> str:
    header = f"{'size':>10}  {'case':<11} {'gemm_ms':>9} {'slowdown_pct':>13} {'comm_ms':>9}"
    lines = [f"# {title}", header, "-" * len(header)]
    from freescale_comm.bench.report import human_bytes

    for r in rows:
        comm = f"{r['comm_ms']:>9.3f}" if r["case"] != "gemm_alone" else f"{'-':>9}"
        lines.append(f"{human_bytes(r['size_bytes']):>10}  {r['case']:<11} {r['gemm_ms']:>9.3f} "
                     f"{r['slowdown_pct']:>13.2f} {comm}")
    return "\n".join(lines)


def summary(rows: Sequence[dict[str, Any]], transport: str = "ce") -> str:
    """The goal line: the transport's slowdown (goal <= 2%) beside the SM copy's, per size."""
    parts = []
    for size in sorted({r["size_bytes"] for r in rows}):
        by = {r["case"]: r for r in rows if r["size_bytes"] == size}
        if transport in by and "sm_copy" in by:
            parts.append(f"{size >> 20} MiB: {transport} {by[transport]['slowdown_pct']:+.2f}% "
                         f"vs sm_copy {by['sm_copy']['slowdown_pct']:+.2f}%")
    return f"# GEMM slowdown while overlapped (goal: {transport} <= 2%): " + "; ".join(parts)
