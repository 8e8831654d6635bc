"""The freescale-bench command."""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Optional, Sequence


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib")
    scale = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    try:
        return int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4K, 1M, 65536)") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale-bench", description="Benchmarks of freescale_comm.")
    sub = p.add_subparsers(dest="bench", required=True)
    a = sub.add_parser("alltoall", help="all_to_all_single on CPU: host transport vs gloo vs the memcpy limit")
    a.add_argument("--ranks", type=int, default=4, help="processes on this host (default 4)")
    a.add_argument("--sizes", type=_size, nargs="+", help="bytes per rank (default 4K ... 64M)")
    a.add_argument("--iters", type=int, default=None, help="timed iterations per case (default: by size)")
    a.add_argument("--warmup", type=int, default=10, help="untimed iterations per case")
    a.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    a.add_argument("--no-progress", action="store_true", help="no progress bar")
    d = sub.add_parser("dispatch", help="fc.dispatch + fc.combine of jagged samples vs a pure-PyTorch + gloo reference")
    d.add_argument("--ranks", type=int, default=4, help="processes on this host (default 4)")
    d.add_argument("--rows", type=_size, default=1 << 20, help="rows across all ranks (default 1M)")
    d.add_argument("--dim", type=int, default=128, help="float32 values per row (default 128)")
    d.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    d.add_argument("--warmup", type=int, default=2, help="untimed iterations")
    d.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    pl = sub.add_parser("planner", help="load-balancing plans: freescale vs none, LPT and Karmarkar-Karp")
    pl.add_argument("--ranks", type=int, default=256, help="ranks to balance across (default 256)")
    pl.add_argument("--samples", type=int, default=64, help="samples per rank (default 64)")
    pl.add_argument("--workload", default="kuairand", help="kuairand | ml20m | zipf (default kuairand)")
    pl.add_argument("--seed", type=int, default=0, help="workload seed")
    pl.add_argument("--repeats", type=int, default=20, help="plans timed per method; the median is reported")
    pl.add_argument("--bytes-per-item", type=int, default=512, help="bytes of one embedded item (default 128 float32)")
    pl.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    pl.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.bench == "alltoall":
        from freescale_comm.bench import alltoall
        from freescale_comm.bench.report import bandwidth_table, write_json

        if args.ranks < 2:
            print("freescale-bench: --ranks must be at least 2", file=sys.stderr)
            return 2
        sizes = args.sizes or alltoall.DEFAULT_SIZES
        rows = alltoall.run(args.ranks, sizes, args.warmup, args.iters, not args.no_progress)
        print(bandwidth_table(rows, f"alltoall, {args.ranks} ranks, CPU tensors, {platform.node()}"))
        print("\n".join(alltoall.goal_summary(rows)))
        if args.json:
            write_json(args.json, "alltoall", rows, ranks=args.ranks)
    elif args.bench == "dispatch":
        from freescale_comm.bench import dispatch
        from freescale_comm.bench.report import bandwidth_table, write_json

        if args.ranks < 2 or args.rows < args.ranks or args.dim < 1:
            print("freescale-bench: need --ranks >= 2, --rows >= --ranks and --dim >= 1", file=sys.stderr)
            return 2
        rows = dispatch.run(args.ranks, args.rows, args.dim, args.warmup, args.iters, not args.no_progress)
        print(bandwidth_table(rows, f"dispatch+combine, {args.ranks} ranks, {args.rows} rows x {args.dim} float32, {platform.node()}"))
        print(dispatch.summary(rows))
        if args.json:
            write_json(args.json, "dispatch", rows, ranks=args.ranks, rows_total=args.rows, dim=args.dim)
    elif args.bench == "planner":
        from freescale_comm.bench import planner, workloads
        from freescale_comm.bench.report import write_json

        if args.ranks < 1 or args.samples < 1 or args.repeats < 1 or args.workload not in workloads.WORKLOADS:
            print(f"freescale-bench: need --ranks, --samples, --repeats >= 1 and --workload in {sorted(workloads.WORKLOADS)}",
                  file=sys.stderr)
            return 2
        rows = planner.run(args.ranks, args.samples, args.workload, args.seed, args.repeats, args.bytes_per_item,
                           not args.no_progress)
        print(planner.table(rows, f"planner, {args.ranks} ranks x {args.samples} samples, {args.workload}, HSTU cost"))
        print(planner.summary(rows))
        if args.json:
            write_json(args.json, "planner", rows, ranks=args.ranks, samples=args.samples, workload=args.workload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
