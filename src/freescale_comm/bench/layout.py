"""The layout work of a dispatch on one GPU: freescale's kernels vs PyTorch references.

The work: given a rank's batch (values [rows, dim], lengths [samples], dest [samples]), count
samples and rows per destination (on the host: the AllToAllv needs them) and gather the rows in
send order (by destination, then original order). References, device-agnostic (tested on CPU):
  torch_sort  vectorized: stable sort by destination, row indices by repeat_interleave, index_select;
  torch_loop  the straightforward one: one mask, nonzero and index_select per destination rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

CASES = ("layout_kernels", "torch_sort", "torch_loop")
KERNELS = ("count_kernel", "scan_chunks_kernel", "scan_totals_kernel", "place_kernel", "copy_kernel")


def _row_index(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Rows [starts[j], starts[j] + lengths[j]) for every j, back to back ([total] int64)."""
    first = torch.repeat_interleave(starts, lengths, output_size=total)
    run_start = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths, output_size=total)
    return first + torch.arange(total, device=starts.device) - run_start


def torch_sort(values: torch.Tensor, lengths: torch.Tensor, dest: torch.Tensor, world: int):
    """(packed rows, sample counts, row counts) with vectorized PyTorch ops."""
    sample_counts = torch.bincount(dest, minlength=world)
    row_counts = torch.zeros(world, dtype=torch.int64, device=dest.device).index_add_(0, dest, lengths)
    counts = torch.cat([sample_counts, row_counts]).tolist()  # the host needs them, as for ours
    order = torch.sort(dest, stable=True).indices
    starts = torch.cumsum(lengths, 0) - lengths
    rows = _row_index(starts[order], lengths[order], sum(counts[world:]))
    return values.index_select(0, rows), counts[:world], counts[world:]


def torch_loop(values: torch.Tensor, lengths: torch.Tensor, dest: torch.Tensor, world: int):
    """(packed rows, sample counts, row counts), one destination rank at a time."""
    starts = torch.cumsum(lengths, 0) - lengths
    parts, sample_counts, row_counts = [], [], []
    for r in range(world):
        mine = (dest == r).nonzero().squeeze(1)
        n_rows = int(lengths[mine].sum())
        parts.append(values.index_select(0, _row_index(starts[mine], lengths[mine], n_rows)))
        sample_counts.append(int(mine.numel()))
        row_counts.append(n_rows)
    return torch.cat(parts), sample_counts, row_counts


def freescale_kernels(values: torch.Tensor, lengths: torch.Tensor, dest: torch.Tensor, world: int):
    """(packed rows, sample counts, row counts) with freescale's plan and gather kernels."""
    from freescale_comm import _device_dispatch

    plan = _device_dispatch.plan(lengths, dest, world, 0, values.shape[0])
    return _device_dispatch.gather(values, plan), plan.sample_counts, plan.row_counts


def _time(fn: Callable[[], Any], warmup: int, iters: int) -> tuple[list[float], Any]:
    """Wall seconds per call (every case ends in a host sync: its counts reach the host)."""
    out = None
    for _ in range(warmup):
        out = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, out


def run(worlds: Sequence[int], samples: int, dim: int, length_scale: float, warmup: int, iters: int,
        seed: int = 0) -> list[dict[str, Any]]:
    """One row per (world, case): time_us (median), speedup of the kernels over the case, wrong
    (rows differing from the kernels' output, or -1 if the counts differ)."""
    from freescale_comm.bench import workloads
    from freescale_comm.bench.report import mean_std

    device = torch.device("cuda", torch.cuda.current_device())
    impls = {"layout_kernels": freescale_kernels, "torch_sort": torch_sort, "torch_loop": torch_loop}
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.from_numpy(workloads.scale_lengths(workloads.kuairand(samples, seed=seed), length_scale)).to(device)
    values = torch.randn(int(lengths.sum()), dim, generator=gen).to(torch.bfloat16).to(device)
    rows = []
    for world in worlds:
        dest = torch.randint(0, world, (samples,), generator=gen).to(device)
        results = {}
        for case in CASES:
            times, out = _time(lambda: impls[case](values, lengths, dest, world), warmup, iters)
            results[case] = (sorted(times)[len(times) // 2], mean_std(times)[1], out)
        kernel_s, _, (kernel_rows, kernel_samples, kernel_row_counts) = results["layout_kernels"]
        for case, (median_s, std_s, (packed, sample_counts, row_counts)) in results.items():
            same_counts = sample_counts == kernel_samples and row_counts == kernel_row_counts
            wrong = int((packed != kernel_rows).any(dim=1).sum()) if same_counts else -1
            rows.append({"case": case, "world": world, "samples": samples, "rows": int(values.shape[0]),
                         "row_bytes": dim * values.element_size(), "time_us": median_s * 1e6, "time_std_us": std_s * 1e6,
                         "kernels_speedup": median_s / kernel_s, "wrong": wrong})
    return rows


def table(rows: Sequence[dict[str, Any]], title: str) -> str:
    header = f"{'world':>6}  {'case':<15} {'time_us':>10} {'± σ':>9} {'kernels x':>10} {'#wrong':>7}"
    lines = [f"# {title}", header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['world']:>6}  {r['case']:<15} {r['time_us']:>10.1f} {r['time_std_us']:>9.1f} "
                     f"{r['kernels_speedup']:>10.1f} {r['wrong']:>7d}")
    return "\n".join(lines)


def kernel_resources() -> list[dict[str, Any]]:
    """Per layout kernel, what Triton compiled on this GPU so far (run after `run`): variants
    (compiled specializations: more than one per row width means a recompile mid-training),
    registers and spills per variant. Read from each kernel's own cache of compiled binaries."""
    from freescale_comm import _layout_kernels

    rows = []
    for name in KERNELS:
        fn = getattr(_layout_kernels, name)
        compiled = []
        for cache in getattr(fn, "device_caches", {}).values():
            binaries = cache[0] if isinstance(cache, tuple) else cache
            compiled += list(binaries.values()) if isinstance(binaries, dict) else []
        rows.append({"kernel": name, "variants": len(compiled),
                     "n_regs": [getattr(c, "n_regs", None) for c in compiled],
                     "n_spills": [getattr(c, "n_spills", None) for c in compiled]})
    return rows


def resources_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["# layout kernels as compiled here (spills > 0: registers ran out)",
             f"{'kernel':<20}{'variants':>9}  {'registers':<16}{'spills':<16}"]
    for r in rows:
        lines.append(f"{r['kernel']:<20}{r['variants']:>9}  {str(r['n_regs']):<16}{str(r['n_spills']):<16}")
    return "\n".join(lines)


_POINTEE = {torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8", torch.int8: "i8",
            torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def bound_launch(kernel: Any, args: tuple, kwargs: dict) -> tuple[dict[str, Any], set[str], int]:
    """One launch of a layout kernel (a triton.jit function or the interpreter's stand-in), as
    Triton sees it: its arguments by name, which of them are constexprs, and its warps."""
    import inspect

    fn = kernel.fn
    kwargs = dict(kwargs)
    warps = kwargs.pop("num_warps", 4)  # a launch option, part of what compiles
    arguments = inspect.signature(fn).bind(*args, **kwargs).arguments
    constexprs = {name for name in arguments if "constexpr" in str(fn.__annotations__.get(name, ""))}
    return dict(arguments), constexprs, warps


def launch_spec(kernel: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """What Triton compiles for one launch of a layout kernel: its name, argument types (pointers
    by dtype, ints as i32 or i64), constants and warps."""
    arguments, constexprs, warps = bound_launch(kernel, args, kwargs)
    signature, constants = {}, {}
    for name, value in arguments.items():
        if name in constexprs:
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _POINTEE[value.dtype]
        else:
            signature[name] = "i32" if -(1 << 31) <= int(value) < (1 << 31) else "i64"
    return {"kernel": kernel.fn.__name__, "signature": signature, "constants": constants, "warps": warps}


def compile_offline(specs: Sequence[dict[str, Any]], arch: int = 90, triton_dir: Optional[str] = None) -> list[dict[str, Any]]:
    """Compiles each distinct launch_spec with Triton's own compiler for sm_<arch> and reads
    registers and spill bytes from ptxas -v: no GPU needed (Triton's wheel carries ptxas). Runs in
    a fresh interpreter without TRITON_INTERPRET (which turns the kernels into its stand-ins), with
    the Triton installed in `triton_dir` (pip --target) ahead of this environment's, if given."""
    import json
    import os
    import subprocess
    import sys

    distinct = list({json.dumps(s, sort_keys=True): s for s in specs}.values())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_dir, env.get("PYTHONPATH")) if p)
    code = "import json, sys; from freescale_comm.bench.layout import _compile_here; " \
           "print(json.dumps(_compile_here(json.load(sys.stdin), int(sys.argv[1]))))"
    out = subprocess.run([sys.executable, "-c", code, str(arch)], input=json.dumps(distinct), capture_output=True,
                         text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"compiling the layout kernels for sm_{arch} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _compile_here(specs: Sequence[dict[str, Any]], arch: int) -> list[dict[str, Any]]:
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from freescale_comm import _layout_kernels

    ptxas = get_ptxas(arch).path
    rows = []
    for spec in specs:
        compiled = triton.compile(ASTSource(fn=getattr(_layout_kernels, spec["kernel"]), signature=spec["signature"],
                                            constexprs=spec["constants"]),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": spec["warps"]})
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(compiled.asm["ptx"])
            ptx.flush()
            report = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", ptx.name, "-o", "/dev/null"],
                                    capture_output=True, text=True, check=True).stderr
        lines = report.splitlines()
        registers = [int(line.split("Used ")[1].split(" registers")[0]) for line in lines if "Used " in line]
        spills = [int(line.split(", ")[1].split(" bytes")[0]) for line in lines if "spill stores" in line]
        rows.append({**spec, "triton": triton.__version__, "registers": max(registers), "spill_store_bytes": max(spills)})
    return rows
