"""The freescale-bench command."""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from typing import Any, Callable, Optional, Sequence

from freescale_comm.bench import trace
from freescale_comm.bench.placement import DEFAULT_MEASURED_RANKS, default_ranks, usable_cores

# Processes one host may spawn for a benchmark: per usable core, and at least this many in all.
# Beyond them a run is hours of spawning (each rank imports torch), not a measurement.
MAX_LOCAL_RANKS_PER_CORE = 4
MIN_LOCAL_RANKS_CAP = 8


def _size(text: str) -> int:
    """Bytes (or a count) such as 4K, 1M, 65536: finite, >= 0."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib")
    scale = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    try:
        value = int(float(number) * scale)
    except (ValueError, OverflowError):  # (inf, nan: OverflowError / ValueError)
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4K, 1M, 65536)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {text!r}")
    return value


def _count(low: int) -> Callable[[str], int]:
    """An integer flag's type: at least `low` (argparse refuses the rest, before anything runs)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _local_ranks(low: int) -> Callable[[str], int]:
    """--ranks of a benchmark that spawns its ranks here: at least `low`, at most
    MAX_LOCAL_RANKS_PER_CORE per usable core (MIN_LOCAL_RANKS_CAP at least)."""
    at_least = _count(low)

    def parse(text: str) -> int:
        value = at_least(text)
        cores = len(usable_cores())
        most = max(MIN_LOCAL_RANKS_CAP, MAX_LOCAL_RANKS_PER_CORE * cores)
        if value > most:
            raise argparse.ArgumentTypeError(
                f"at most {most} processes on this host ({MAX_LOCAL_RANKS_PER_CORE} per usable core, {cores} here), "
                f"got {value}; freescale-bench simulate models thousands of ranks")
        return value

    return parse


def _finite(low: float, *, above: bool = False) -> Callable[[str], float]:
    """A float flag's type: finite and >= `low` (> `low` if `above`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if above else '>='} {low:g}, got {text!r}")
        return value

    return parse


def _writable_outputs(args: argparse.Namespace) -> Optional[str]:
    """Why an output of `args` cannot be written (--json / --plot: a file; --trace: a directory, made
    with its parents), checked before the benchmark runs so a typo loses no results; None if all can."""
    for flag in ("json", "plot", "trace"):
        path = getattr(args, flag, None)
        if not path:
            continue
        path = os.path.abspath(path)
        if flag == "trace":
            if os.path.exists(path) and not os.path.isdir(path):
                return f"--trace {path}: exists and is not a directory"
            where = path
            while not os.path.exists(where):  # the first ancestor that exists must take new entries
                where = os.path.dirname(where)
        else:
            if os.path.isdir(path):
                return f"--{flag} {path}: is a directory (give a file name)"
            where = os.path.dirname(path)
            if not os.path.isdir(where):
                return f"--{flag} {path}: directory {where} does not exist"
        if not os.path.isdir(where) or not os.access(where, os.W_OK | os.X_OK):
            return f"--{flag} {path}: {where} is not a writable directory"
    return None


def _outputs(p: argparse.ArgumentParser, *, trace: bool = False, progress: bool = True,
             json_help: str = "also write the rows as JSON") -> None:
    """The output flags benchmarks share: --json, and --trace / --no-progress where they apply."""
    if trace:
        p.add_argument("--trace", metavar="DIR", help="write trace.json, timeline.png and bubbles.png there")
    p.add_argument("--json", metavar="PATH", help=json_help)
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freescale-bench", description="Benchmarks of freescale_comm.")
    sub = p.add_subparsers(dest="bench", required=True)
    a = sub.add_parser("alltoall", help="all_to_all_single: on CPU, host transport vs gloo vs the memcpy limit; "
                                        "with --transport ce|nvshmem, CUDA tensors vs an SM copy")
    a.add_argument("--ranks", type=_local_ranks(2), default=4,
                   help="processes on this host (default 4; with CUDA: sharing GPU 0)")
    a.add_argument("--transport", choices=("host", "ce", "nvshmem"), default="host",
                   help="host: CPU tensors (default); ce / nvshmem: CUDA tensors on that transport")
    a.add_argument("--sizes", type=_size, nargs="+", help="bytes per rank (default: host 4K ... 64M; ce / nvshmem "
                   "1M ... 256M)")
    a.add_argument("--iters", type=_count(1), default=None, help="timed iterations per case (default: host by size; "
                   "ce / nvshmem 20)")
    a.add_argument("--warmup", type=_count(0), default=10, help="untimed iterations per case")
    _outputs(a)
    d = sub.add_parser("dispatch", help="fc.dispatch + fc.combine of jagged samples vs a pure-PyTorch + gloo reference")
    d.add_argument("--ranks", type=_local_ranks(2), default=4, help="processes on this host (default 4)")
    d.add_argument("--rows", type=_size, default=1 << 20, help="rows across all ranks (default 1M)")
    d.add_argument("--dim", type=int, default=128, help="float32 values per row (default 128)")
    d.add_argument("--iters", type=_count(1), default=5, help="timed iterations (default 5)")
    d.add_argument("--warmup", type=_count(0), default=2, help="untimed iterations")
    _outputs(d)
    so = sub.add_parser("soak", help="N ranks x M random all_to_all_single ops (11 dtypes, 0..max bytes per peer, "
                                     "priorities, async waits out of order, strided inputs), every byte checked")
    so.add_argument("--ranks", type=_local_ranks(2), default=4, help="processes on this host (default 4)")
    so.add_argument("--ops", type=int, default=2000, help="ops per rank (default 2000)")
    so.add_argument("--seed", type=_count(0), default=0, help="seed of the op list (the same on every rank)")
    so.add_argument("--max-bytes", type=_size, default=1 << 20, help="largest block one rank sends another (default 1M)")
    so.add_argument("--window", type=int, default=80, help="async ops in flight at most (default 80)")
    _outputs(so, progress=False)
    pl = sub.add_parser("planner", help="load-balancing plans: freescale vs none, LPT and Karmarkar-Karp")
    pl.add_argument("--ranks", type=int, default=256, help="ranks to balance across (default 256)")
    pl.add_argument("--samples", type=int, default=64, help="samples per rank (default 64)")
    pl.add_argument("--workload", default="kuairand",
                    help="kuairand | ml20m | zipf | heavy_zipf, several comma-separated, or all (default kuairand)")
    pl.add_argument("--seed", type=_count(0), default=0, help="workload seed (the first of a sweep)")
    pl.add_argument("--seeds", type=int, default=1, help="seeds to sweep; the table gives each figure's worst case")
    pl.add_argument("--repeats", type=int, default=20, help="plans timed per method; the median is reported")
    pl.add_argument("--bytes-per-item", type=int, default=512, help="bytes of one embedded item (default 128 float32)")
    pl.add_argument("--slow-share", type=float, default=0.0,
                    help="share of the ranks that compute slower (default 0; e.g. 0.05: 5%% of them)")
    pl.add_argument("--slow-speed", type=float, default=0.5,
                    help="their speed relative to the others, in (0, 1] (default 0.5)")
    _outputs(pl)
    mb = sub.add_parser("microbatch", help="distinct ids one rank's micro-batches send: key-centric clustering vs a "
                        "random split and contiguous chunks (NestPipe's micro-batches; CPU, NumPy)")
    mb.add_argument("--samples", type=int, default=512, help="samples of the batch (default 512)")
    mb.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8], help="micro-batch counts (default 2 4 8)")
    mb.add_argument("--workload", nargs="+", default=["interests", "zipf"], help="interests and/or zipf (default both)")
    mb.add_argument("--scale", type=float, default=1 / 64, help="kuairand lengths scaled by this (default 1/64)")
    mb.add_argument("--seed", type=_count(0), default=0, help="workload seed")
    mb.add_argument("--repeats", type=int, default=5, help="plans timed; the median is reported (default 5)")
    _outputs(mb, progress=False)
    e = sub.add_parser("e2e", help="HSTU-like training step on N local ranks: vanilla vs balance, overlap, PEC and their mixes")
    _e2e_args(e)
    ps = sub.add_parser("pec-sweep", help="exposed embedding comm vs collision rate: vanilla vs PEC (e2e step)")
    _pec_sweep_args(ps)
    tp = sub.add_parser("torchrec-pec", help="a TorchRec DMP model on N CPU ranks: TrainPipelineSparseDist, "
                        "TrainPipelineSemiSync, TorchRec's TrainPipelinePEC (if installed) and fc.TrainPipelinePEC "
                        "vs collision rate")
    tp.add_argument("--ranks", type=_local_ranks(2), default=4, help="processes on this host (default 4)")
    tp.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                    help="collision rates in [0, 1] (default 0 0.25 0.5 0.75 1)")
    tp.add_argument("--steps", type=int, default=8, help="measured steps per pipeline and rate (default 8)")
    tp.add_argument("--warmup", type=int, default=3, help="steps before measuring (default 3)")
    tp.add_argument("--rounds", type=int, default=3, help="trainings per pipeline and rate, in rotated order (default 3)")
    tp.add_argument("--samples", type=int, default=64, help="samples per rank and step (default 64)")
    tp.add_argument("--pipelines", nargs="+", default=None, help="which pipelines (default: sparse_dist "
                    "semi_sync torchrec_pec pec pec_balance); NestPipe's: dbp fwp1 fwp2 fwp4 fwp8 fwp2_random "
                    "fwp4_random fwp8_random nestpipe")
    tp.add_argument("--nestpipe", action="store_true", help="NestPipe's modes with sparse_dist and pec (the "
                    "pipelines above from dbp on)")
    _pin_arg(tp)
    tp.add_argument("--plot", metavar="PNG", default="torchrec-pec.png", help="where to draw (default torchrec-pec.png)")
    _outputs(tp, progress=False)
    si = sub.add_parser("simulate", help="the e2e step at scale (up to 4096 ranks) on a cost + network model")
    si.add_argument("--ranks", type=int, default=None, help="ranks (default 256, at most 4096)")
    si.add_argument("--samples", type=int, default=64, help="samples per rank and step (default 64)")
    si.add_argument("--workload", default="kuairand", help="kuairand | ml20m | zipf (default kuairand)")
    si.add_argument("--steps", type=int, default=3, help="steps simulated (default 3)")
    si.add_argument("--seed", type=_count(0), default=0, help="workload seed")
    si.add_argument("--groups", type=int, default=4, help="pipeline groups of the overlapped modes (default 4)")
    si.add_argument("--bandwidth-gbps", type=_finite(0, above=True), default=50.0,
                    help="AllToAll bandwidth per rank, GB/s (default 50)")
    si.add_argument("--latency-us", type=_finite(0), default=20.0, help="latency per collective, µs (default 20)")
    si.add_argument("--bytes-per-item", type=int, default=512, help="bytes of one embedded item (default 512)")
    si.add_argument("--dense-bytes", type=_size, default=16 << 20, help="dense gradient bytes all-reduced per step")
    si.add_argument("--plan-us-per-sample", type=_finite(0), default=0.5, help="planner time per sample of the world, µs")
    si.add_argument("--calibration", metavar="E2E_JSON",
                    help="use the cost model fitted by a measured run (the --json of freescale-bench e2e); "
                         "default: HSTU FLOPs (4 layers, 4 heads x 128) at 300 TFLOP/s")
    si.add_argument("--modes", nargs="+", default=None, help="modes to simulate (default all)")
    si.add_argument("--nestpipe", action="store_true", help="instead: fc.TrainPipelinePEC's modes (sync, pec, dbp, "
                    "fwp1/2/4/8, nestpipe) at each of --nestpipe-ranks, with scaling efficiency (an analytic "
                    "steady-state step: freescale_comm/bench/simulate_nestpipe.py)")
    si.add_argument("--nestpipe-ranks", type=int, nargs="+", default=None, help="--nestpipe: ranks (default 256 1536)")
    si.add_argument("--collision", type=_finite(0), default=None, help="--nestpipe: share of rows the batch before read "
                    "(default 0.5)")
    _outputs(si, trace=True, progress=False)
    la = sub.add_parser("layout", help="CUDA: fc.dispatch's layout work (counts + gather) at training sizes: the Triton "
                        "kernels vs a vectorized PyTorch sort and a per-rank loop; the kernels' registers and spills")
    la.add_argument("--worlds", type=int, nargs="+", default=[32, 128, 512], help="group sizes (default 32 128 512)")
    la.add_argument("--samples", type=int, nargs="+", default=[16384, 131072],
                    help="samples of the dispatched batch (default 16384 131072)")
    la.add_argument("--dim", type=int, default=128, help="bf16 values per row (default 128)")
    la.add_argument("--scale", type=float, default=1 / 64, help="kuairand lengths scaled by this (default 1/64)")
    la.add_argument("--reps", type=int, default=10, help="measured repetitions; medians (default 10)")
    la.add_argument("--warmup", type=int, default=3, help="unmeasured repetitions (default 3)")
    _outputs(la, progress=False)
    _overlap_args(sub.add_parser("overlap", help="CUDA: a bf16 GEMM alone vs overlapped with an SM-copy or a copy-engine "
                                                 "AllToAll; busbw vs size; layout kernels vs PyTorch"))
    return p


def _overlap_args(o: argparse.ArgumentParser) -> None:
    from freescale_comm.bench import overlap

    o.add_argument("--ranks", type=_local_ranks(1), default=2, help="processes sharing GPU 0 (default 2)")
    o.add_argument("--transport", choices=overlap.TRANSPORTS, default="ce", help="freescale's transport (default ce)")
    o.add_argument("--sizes", type=_size, nargs="+", default=overlap.DEFAULT_SIZES,
                   help="bytes per rank of the overlapped AllToAll (default 64M 128M 256M)")
    o.add_argument("--busbw-sizes", type=_size, nargs="+", default=overlap.DEFAULT_BUSBW_SIZES,
                   help="bytes per rank of the bandwidth sweep (default 1M ... 256M)")
    o.add_argument("--reps", type=int, default=10, help="measured repetitions per case; medians (default 10)")
    o.add_argument("--warmup", type=int, default=3, help="unmeasured repetitions per case (default 3)")
    o.add_argument("--layout-worlds", type=int, nargs="+", default=[32, 128, 512],
                   help="group sizes of the layout-kernel comparison (default 32 128 512)")
    o.add_argument("--layout-samples", type=int, default=256, help="samples of the dispatched batch (default 256)")
    o.add_argument("--layout-dim", type=int, default=128, help="bf16 values per row (default 128)")
    o.add_argument("--layout-scale", type=float, default=1 / 16,
                   help="kuairand lengths scaled by this (default 1/16: about 740 rows per sample)")
    _outputs(o)


def _check_cuda_transport(transport: str) -> None:
    """ValueError unless a GPU is visible and this build has `transport`."""
    import torch

    import freescale_comm as fc

    if not torch.cuda.is_available():
        raise ValueError("this benchmark needs a CUDA GPU, and torch sees none here")
    info = fc.build_info()
    if transport not in info["transports"]:
        why = info["nvshmem_detail"] if transport == "nvshmem" else "built without nvcc; reinstall where nvcc is"
        raise ValueError(f"this build has no {transport} transport ({why})")


def run_alltoall_cuda(args: argparse.Namespace) -> int:
    """alltoall --transport ce|nvshmem: busbw of CUDA tensors vs an SM copy of the same bytes."""
    import datetime

    from freescale_comm.bench import overlap
    from freescale_comm.bench.report import bandwidth_table, write_json

    sizes = tuple(args.sizes or overlap.DEFAULT_BUSBW_SIZES)
    cfg = overlap.OverlapConfig(ranks=args.ranks, busbw_sizes=sizes, reps=args.iters or 20, warmup=args.warmup,
                                transport=args.transport)
    try:
        cfg.check()
        _check_cuda_transport(cfg.transport)
    except ValueError as err:
        print(f"freescale-bench alltoall: {err}", file=sys.stderr)
        return 2
    res = overlap.run(cfg, progress=not args.no_progress, busbw_only=True)
    print(bandwidth_table(res["busbw_rows"], f"alltoall, {cfg.ranks} ranks on one {res['device']}, CUDA tensors, "
                                             f"{cfg.transport} vs sm_copy, {datetime.date.today()}"))
    print(f"# data path: {res['data_path']}")
    if args.json:
        write_json(args.json, "alltoall", res["busbw_rows"], ranks=cfg.ranks, transport=cfg.transport, device=res["device"],
                   data_path=res["data_path"])
    return _fails_on_wrong("alltoall", res["busbw_rows"])


def run_overlap(args: argparse.Namespace) -> int:
    import dataclasses
    import datetime

    from freescale_comm.bench import layout, overlap
    from freescale_comm.bench.report import bandwidth_table, write_json

    cfg = overlap.OverlapConfig(ranks=args.ranks, sizes=tuple(args.sizes), busbw_sizes=tuple(args.busbw_sizes),
                                reps=args.reps, warmup=args.warmup, transport=args.transport)
    try:
        cfg.check()
        if args.layout_samples < 1 or args.layout_dim < 1 or min(args.layout_worlds) < 1:
            raise ValueError("--layout-samples, --layout-dim and --layout-worlds must be >= 1")
        _check_cuda_transport(cfg.transport)
    except ValueError as err:
        print(f"freescale-bench overlap: {err}", file=sys.stderr)
        return 2
    res = overlap.run(cfg, progress=not args.no_progress)
    where = f"{cfg.ranks} ranks on one {res['device']}, {datetime.date.today()}"
    print(overlap.table(res["rows"], f"overlap, {where}; bf16 GEMM n={res['gemm_n']}, medians of {cfg.reps}"))
    print(overlap.summary(res["rows"], cfg.transport))
    print(f"# data path: {res['data_path']}")
    print(bandwidth_table(res["busbw_rows"], f"alltoall on CUDA tensors, {where} (sm_copy: one index_select of the same bytes)"))
    layout_rows = layout.run(args.layout_worlds, args.layout_samples, args.layout_dim, args.layout_scale,
                             args.warmup, args.reps)
    print(layout.table(layout_rows, f"dispatch layout (counts + gather) of {args.layout_samples} samples, "
                                    f"{layout_rows[0]['rows']} rows x {args.layout_dim} bf16, one {res['device']}"))
    if args.json:
        write_json(args.json, "overlap", res["rows"], busbw_rows=res["busbw_rows"], layout_rows=layout_rows,
                   device=res["device"], date=str(datetime.date.today()), config=dataclasses.asdict(cfg),
                   data_path=res["data_path"])
    return _fails_on_wrong("overlap", res["busbw_rows"], layout_rows)


def _fails_on_wrong(command: str, *row_lists: list[dict]) -> int:
    """1 (and a line on stderr) if any row counted wrong elements: a benchmark of wrong bytes fails."""
    bad = [r for rows in row_lists for r in rows if r.get("wrong", 0)]
    for r in bad:
        print(f"freescale-bench {command}: {r['wrong']} wrong elements in {({k: r[k] for k in r if k != 'wrong'})}",
              file=sys.stderr)
    return 1 if bad else 0


def run_layout(args: argparse.Namespace) -> int:
    import datetime

    import torch

    from freescale_comm.bench import layout
    from freescale_comm.bench.report import write_json

    if not torch.cuda.is_available():
        print("freescale-bench layout: needs a CUDA device (the kernels' timings mean nothing under the interpreter)",
              file=sys.stderr)
        return 2
    if min(args.samples) < 1 or args.dim < 1 or min(args.worlds) < 1 or not 0 < args.scale <= 1:
        print("freescale-bench layout: --samples, --dim and --worlds must be >= 1, --scale in (0, 1]", file=sys.stderr)
        return 2
    rows = []
    for samples in args.samples:
        part = layout.run(args.worlds, samples, args.dim, args.scale, args.warmup, args.reps)
        print(layout.table(part, f"dispatch layout (counts + gather) of {samples} samples, {part[0]['rows']} rows x "
                                 f"{args.dim} bf16, {torch.cuda.get_device_name()}, {datetime.date.today()}"))
        rows += part
    resources = layout.kernel_resources()
    print(layout.resources_table(resources))
    if args.json:
        write_json(args.json, "layout", rows, kernels=resources, device=torch.cuda.get_device_name(),
                   date=str(datetime.date.today()))
    return _fails_on_wrong("layout", rows)


def _modes(simulated: bool = False) -> tuple[str, ...]:
    if simulated:
        from freescale_comm.bench.simulate import MODES
    else:
        from freescale_comm.bench.e2e import MODES
    return tuple(MODES)


def _step_args(e: argparse.ArgumentParser, dim: int = 64, layers: int = 2, steps: int = 8,
               length_scale: float = 1 / 16) -> None:
    """The training step's shape, shared by e2e and pec-sweep."""
    e.add_argument("--ranks", type=_local_ranks(2), default=None,
                   help="processes on this host, each on a CPU core of its own (default: one per usable core, "
                        f"2 to {DEFAULT_MEASURED_RANKS}; here {default_ranks()})")
    _pin_arg(e)
    e.add_argument("--steps", type=int, default=steps, help=f"measured steps per mode (default {steps})")
    e.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them (default 1)")
    e.add_argument("--samples", type=int, default=8, help="samples per rank and step (default 8)")
    e.add_argument("--workload", default="kuairand", help="kuairand | ml20m | zipf (default kuairand)")
    e.add_argument("--length-scale", type=float, default=length_scale,
                   help=f"history lengths scaled by this (default 1/{round(1 / length_scale)})")
    e.add_argument("--dim", type=int, default=dim, help=f"embedding / model dim (default {dim})")
    e.add_argument("--layers", type=int, default=layers, help=f"HSTU layers of the dense tower (default {layers})")
    e.add_argument("--groups", type=int, default=4, help="compute groups of the overlapped modes (default 4)")


def _step_config(args: argparse.Namespace, **more: object) -> "Any":
    from freescale_comm.bench import e2e

    ranks = default_ranks() if args.ranks is None else args.ranks
    return e2e.E2EConfig(ranks=ranks, pin_cores=not args.no_pin, steps=args.steps, warmup=args.warmup,
                         samples=args.samples, workload=args.workload, length_scale=args.length_scale, dim=args.dim,
                         layers=args.layers, groups=args.groups, seed=args.seed, **more)


def _pec_sweep_args(ps: argparse.ArgumentParser) -> None:
    _step_args(ps, dim=256, layers=1, steps=3, length_scale=1 / 12)
    ps.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0],
                    help="collision rates in [0, 1] (default 0 0.1 0.2 0.4 0.6 0.8 1)")
    ps.add_argument("--seed", type=_count(0), default=0, help="data and weight seed")
    ps.add_argument("--plot", metavar="PNG", default="pec-sweep.png", help="where to draw the sweep (default pec-sweep.png)")
    _outputs(ps)


def run_pec_sweep(args: argparse.Namespace) -> int:
    import dataclasses

    from freescale_comm.bench import pec_sweep
    from freescale_comm.bench.report import write_json

    try:
        sweep = pec_sweep.SweepConfig(_step_config(args, modes=pec_sweep.SWEEP_MODES), tuple(args.rates))
        sweep.check()
    except ValueError as err:
        print(f"freescale-bench pec-sweep: {err}", file=sys.stderr)
        return 2
    from freescale_comm.bench.placement import oversubscription_note, place_ranks

    rows = pec_sweep.run(sweep, progress=not args.no_progress)
    cfg = sweep.e2e
    note = oversubscription_note(place_ranks(cfg.ranks))
    if note:
        print(note)
    title = (f"pec-sweep, {cfg.ranks} ranks x {cfg.samples} samples, {cfg.workload} x {cfg.length_scale:.3g}, "
             f"dim {cfg.dim}, {platform.node()}; ms per step, mean of {cfg.steps}")
    print(pec_sweep.table(rows, title))
    print(pec_sweep.summary(rows))
    print("# wrote " + pec_sweep.plot(rows, args.plot, title))
    if args.json:
        write_json(args.json, "pec-sweep", rows, config=dataclasses.asdict(sweep))
    return 0


def _pin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-pin", action="store_true",
                   help="leave the ranks unpinned (default: each on its own core, standing for one device per rank)")


def _e2e_args(e: argparse.ArgumentParser) -> None:
    _step_args(e)
    e.add_argument("--collision-rate", type=float, default=None,
                   help="ids with this share read at the step before (default: uniform random ids)")
    e.add_argument("--modes", nargs="+", default=list(_modes()), help="modes to run (default all)")
    e.add_argument("--seed", type=_count(0), default=0, help="data and weight seed")
    e.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the dense tower computes")
    e.add_argument("--speeds", action=argparse.BooleanOptionalAction, default=True,
                   help="balancing evens load / each rank's measured speed (default), or load alone (--no-speeds, "
                        "as FreeScale)")
    _outputs(e, trace=True, json_help="also write the rows (and the fitted cost model) as JSON")


def run_e2e(args: argparse.Namespace) -> int:
    import dataclasses

    from freescale_comm.bench import e2e
    from freescale_comm.bench.placement import oversubscription_note, placement_json, placement_words
    from freescale_comm.bench.report import (bubble_summary, busy_note, compute_line, overlap_note, step_table,
                                             write_json)

    try:
        cfg = _step_config(args, modes=tuple(args.modes), device=args.device, collision_rate=args.collision_rate,
                           balance_speeds=args.speeds)
        cfg.check()
    except ValueError as err:
        print(f"freescale-bench e2e: {err}", file=sys.stderr)
        return 2
    res = e2e.run(cfg, progress=not args.no_progress)
    pinned = placement_words(res.placement, cfg.pin_cores)
    title = (f"e2e, {cfg.ranks} ranks ({pinned}) x {cfg.samples} samples, {cfg.workload} x "
             f"{cfg.length_scale:.3g}, dim {cfg.dim}, {cfg.device}, {platform.node()}; "
             f"ms per step, mean of {cfg.steps}")
    # Ranks sharing cores wait for each other's: the oversubscription line says it, not the busy one.
    busy = "" if res.placement.oversubscribed else busy_note(res.rows)
    print("\n".join(line for line in (oversubscription_note(res.placement), busy,
                                      step_table(res.rows, title, extra=("sparsity", "loss")),
                                      bubble_summary(res.rows), compute_line(res.rows), overlap_note(res.rows)) if line))
    print("# losses per step (same seed, every mode): "
          + "; ".join(f"{m} " + " ".join(f"{v:.6f}" for v in ls) for m, ls in res.losses.items()))
    if args.trace:
        paths = trace.write_all(args.trace, res.timelines, res.rows, f"e2e {cfg.ranks} ranks: step time and bubbles")
        print("# wrote " + ", ".join(paths))
    if args.json:
        write_json(args.json, "e2e", res.rows, config=dataclasses.asdict(cfg),
                   cost_model=dataclasses.asdict(res.cost_model), losses=res.losses, reduction=res.reduction(),
                   placement=placement_json(res.placement, res.rank_cores))
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    import json

    from freescale_comm.bench import simulate
    from freescale_comm.bench.report import bubble_summary, step_table, write_json

    # Flags of the other form would be silently ignored: refused instead (exit 2, before running).
    other = ([f for f, v in (("--ranks", args.ranks), ("--modes", args.modes), ("--trace", args.trace),
                             ("--calibration", args.calibration)) if v is not None] if args.nestpipe else
             [f for f, v in (("--nestpipe-ranks", args.nestpipe_ranks), ("--collision", args.collision)) if v is not None])
    if other:
        why = ("--nestpipe simulates its own modes at each of --nestpipe-ranks" if args.nestpipe else
               "these apply only with --nestpipe")
        print(f"freescale-bench simulate: {', '.join(other)}: {why}", file=sys.stderr)
        return 2
    modes = _modes(simulated=True) if args.modes is None else args.modes
    p = simulate.SimParams(ranks=256 if args.ranks is None else args.ranks, samples=args.samples,
                           workload=args.workload, steps=args.steps, seed=args.seed, modes=tuple(modes), groups=args.groups,
                           bandwidth_gbps=args.bandwidth_gbps, latency_us=args.latency_us,
                           bytes_per_item=args.bytes_per_item, dense_bytes=args.dense_bytes,
                           plan_us_per_sample=args.plan_us_per_sample)
    if args.nestpipe:
        return _simulate_nestpipe(args, p)
    try:
        if p.ranks > 4096:
            raise ValueError("ranks must be at most 4096")
        if args.calibration:
            with open(args.calibration) as f:
                p = simulate.with_calibration(p, json.load(f))
        p.check()
    except (ValueError, OSError) as err:
        print(f"freescale-bench simulate: {err}", file=sys.stderr)
        return 2
    timelines = {m: simulate.simulate_mode(p, m) for m in p.modes}
    rows = [{"mode": m, **simulate.mode_metrics(tl)} for m, tl in timelines.items()]
    cm = p.cost_model
    print(step_table(rows, f"simulate, {p.ranks} ranks x {p.samples} samples, {p.workload}; cost "
                           f"{cm.quadratic:.3g}·L² + {cm.linear:.3g}·L + {cm.constant:.3g} s; "
                           f"{p.bandwidth_gbps:g} GB/s, {p.latency_us:g} µs; ms per step, mean of {p.steps}"))
    print(bubble_summary(rows))
    if args.trace:
        paths = trace.write_all(args.trace, timelines, rows, f"simulate {p.ranks} ranks: step time and bubbles")
        print("# wrote " + ", ".join(paths))
    if args.json:
        import dataclasses

        write_json(args.json, "simulate", rows, params={**dataclasses.asdict(p), "cost_model": dataclasses.asdict(cm)})
    return 0


def _simulate_nestpipe(args: argparse.Namespace, p: Any) -> int:
    import dataclasses

    from freescale_comm.bench import simulate_nestpipe as sn
    from freescale_comm.bench.report import write_json

    rows = []
    all_ranks = [256, 1536] if args.nestpipe_ranks is None else args.nestpipe_ranks
    collision = 0.5 if args.collision is None else args.collision
    try:
        if any(not 2 <= w <= 4096 for w in all_ranks):
            raise ValueError(f"--nestpipe-ranks must lie in [2, 4096], got {all_ranks}")
        if collision > 1:
            raise ValueError(f"--collision must lie in [0, 1], got {collision:g}")
        for ranks in all_ranks:
            q = dataclasses.replace(p, ranks=ranks)
            q.check()
            rows += sn.run(q, list(sn.NESTPIPE_MODES), collision)
    except ValueError as err:
        print(f"freescale-bench simulate: {err}", file=sys.stderr)
        return 2
    cm = p.cost_model
    print(sn.table(rows, f"simulate --nestpipe (SIMULATED, an analytic model, not a measurement): {p.samples} samples "
                         f"per rank, {p.workload}, collision {collision:g}; cost {cm.quadratic:.3g}·L² + "
                         f"{cm.linear:.3g}·L + {cm.constant:.3g} s; {p.bandwidth_gbps:g} GB/s, {p.latency_us:g} µs; "
                         f"ms per step, mean of {p.steps}"))
    for ranks in all_ranks:
        mine = {r["mode"]: r for r in rows if r["ranks"] == ranks}
        best = min(mine.values(), key=lambda r: r["step_ms"])
        print(f"{ranks} ranks: fastest {best['mode']} ({best['step_ms']:.2f} ms, scaling efficiency "
              f"{best['scaling_efficiency']:.1%}); fwp4 exposes {mine['fwp4']['exposed_ms']:.2f} ms vs fwp1's "
              f"{mine['fwp1']['exposed_ms']:.2f} (simulated)")
    if args.json:
        write_json(args.json, "simulate-nestpipe", rows,
                   params={**dataclasses.asdict(p), "cost_model": dataclasses.asdict(cm), "collision": collision})
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    unwritable = _writable_outputs(args)
    if unwritable:
        parser.error(unwritable)  # exit 2, before anything runs
    if args.bench == "alltoall" and args.transport != "host":
        return run_alltoall_cuda(args)
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
        if _fails_on_wrong("alltoall", rows):
            return 1
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
        if _fails_on_wrong("dispatch", rows):
            return 1
    elif args.bench == "soak":
        from freescale_comm.bench import soak
        from freescale_comm.bench.report import write_json

        if args.ranks < 2 or args.ops < 1 or args.window < 0:
            print("freescale-bench: need --ranks >= 2, --ops >= 1 and --window >= 0", file=sys.stderr)
            return 2
        rows = soak.run(args.ranks, args.ops, args.seed, args.max_bytes, args.window)
        print(soak.summary(rows, args.ranks, args.ops, args.seed))
        if args.json:
            write_json(args.json, "soak", rows, ranks=args.ranks, ops=args.ops, seed=args.seed)
        if any(r["wrong_bytes"] for r in rows):
            return 1
    elif args.bench == "overlap":
        return run_overlap(args)
    elif args.bench == "layout":
        return run_layout(args)
    elif args.bench == "microbatch":
        from freescale_comm.bench import microbatch
        from freescale_comm.bench.report import write_json

        if (args.samples < 1 or args.repeats < 1 or min(args.micro_batches) < 1 or not 0 < args.scale <= 1
                or not set(args.workload) <= set(microbatch.WORKLOADS)):
            print(f"freescale-bench microbatch: need --samples, --repeats, --micro-batches >= 1, --scale in (0, 1] and "
                  f"--workload in {microbatch.WORKLOADS}", file=sys.stderr)
            return 2
        rows = microbatch.run(args.workload, args.samples, args.micro_batches, args.seed, args.repeats, args.scale)
        print(microbatch.table(rows, f"micro-batches of one rank's batch: {args.samples} samples, kuairand x "
                                     f"{args.scale:.3g}, seed {args.seed}, {platform.node()}"))
        if args.json:
            write_json(args.json, "microbatch", rows)
        return 0
    elif args.bench == "planner":
        from freescale_comm.bench import planner, workloads
        from freescale_comm.bench.report import write_json

        names = list(workloads.WORKLOADS) if args.workload == "all" else args.workload.split(",")
        if (args.ranks < 1 or args.samples < 1 or args.repeats < 1 or args.seeds < 1
                or not all(n in workloads.WORKLOADS for n in names)):
            print(f"freescale-bench: need --ranks, --samples, --repeats, --seeds >= 1 and --workload in "
                  f"{sorted(workloads.WORKLOADS)} (comma-separated) or all", file=sys.stderr)
            return 2
        if not (0 <= args.slow_share <= 1 and 0 < args.slow_speed <= 1):
            print(f"freescale-bench planner: need --slow-share in [0, 1] and --slow-speed in (0, 1], got "
                  f"{args.slow_share} and {args.slow_speed}", file=sys.stderr)
            return 2
        rows = []
        for name in names:
            per_seed = [planner.run(args.ranks, args.samples, name, args.seed + k, args.repeats, args.bytes_per_item,
                                    not args.no_progress, args.slow_share, args.slow_speed) for k in range(args.seeds)]
            rows += per_seed[0] if args.seeds == 1 else planner.worst_over_seeds(per_seed)
        seeds = f"seed {args.seed}" if args.seeds == 1 else f"worst of seeds {args.seed}..{args.seed + args.seeds - 1}"
        slow = (f", {args.slow_share:g} of the ranks at speed {args.slow_speed:g} (figures: load / speed)"
                if args.slow_share > 0 else "")
        print(planner.table(rows, f"planner, {args.ranks} ranks x {args.samples} samples, HSTU cost, {seeds}{slow}"))
        print(planner.summary(rows))
        if args.json:
            write_json(args.json, "planner", rows, ranks=args.ranks, samples=args.samples, workloads=names,
                       seed=args.seed, seeds=args.seeds, slow_share=args.slow_share, slow_speed=args.slow_speed)
    elif args.bench == "e2e":
        return run_e2e(args)
    elif args.bench == "simulate":
        return run_simulate(args)
    elif args.bench == "pec-sweep":
        return run_pec_sweep(args)
    elif args.bench == "torchrec-pec":
        return run_torchrec_pec(args)
    return 0


def run_torchrec_pec(args: argparse.Namespace) -> int:
    import dataclasses

    try:
        from freescale_comm.bench import torchrec_pipelines as tp
    except ImportError as err:
        print(f"freescale-bench torchrec-pec needs torchrec and fbgemm_gpu: {err}", file=sys.stderr)
        return 2
    from freescale_comm.bench.report import write_json

    if args.nestpipe and args.pipelines:
        print("freescale-bench torchrec-pec: --nestpipe names its own pipelines: drop it or --pipelines", file=sys.stderr)
        return 2
    cfg = tp.PipelineBenchConfig(ranks=args.ranks, rates=tuple(args.rates), steps=args.steps, warmup=args.warmup,
                                 rounds=args.rounds, samples=args.samples, pin_cores=not args.no_pin,
                                 pipelines=tuple(args.pipelines or (("sparse_dist", "pec") + tp.NESTPIPE if args.nestpipe
                                                                    else tp.PIPELINES)))
    try:
        cfg.check()
    except ValueError as err:
        print(f"freescale-bench torchrec-pec: {err}", file=sys.stderr)
        return 2
    from freescale_comm.bench.placement import oversubscription_note, placement_json, placement_words

    res = tp.run(cfg)
    rows = res.rows
    pinned = placement_words(res.placement, cfg.pin_cores)
    title = (f"torchrec-pec, {cfg.ranks} CPU ranks ({pinned}) x {cfg.samples} samples, dim {cfg.dim}, "
             f"{platform.node()}; ms per step, median of {cfg.rounds} rounds of {cfg.steps} steps")
    note = oversubscription_note(res.placement)
    if note:
        print(note)
    print(tp.table(rows, title))
    print(tp.summary(rows))
    print("# wrote " + tp.plot(rows, args.plot, title))
    if args.json:
        write_json(args.json, "torchrec-pec", rows, config=dataclasses.asdict(cfg),
                   placement=placement_json(res.placement, res.rank_cores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
