"""python -m freescale_comm demo: the main job in one small run (under a minute on 2 cores).

Runs `freescale-bench e2e --ranks 4 --trace freescale-demo` (a measured HSTU-like training step
on 4 local ranks, every mode), then `freescale-bench simulate --ranks 256` calibrated with the
cost model that run fitted, and the default H100 model.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m freescale_comm", description="freescale_comm's demo")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="measured e2e step on 4 ranks, traces and plots, then the 256-rank simulation")
    d.add_argument("--ranks", type=int, default=4, help="local ranks of the measured run (default 4)")
    d.add_argument("--out", default="freescale-demo", help="directory for trace.json and the PNGs")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    from freescale_comm.bench import cli

    with tempfile.TemporaryDirectory() as tmp:
        measured = os.path.join(tmp, "e2e.json")
        flags = ["--no-progress"] if args.no_progress else []
        code = cli.main(["e2e", "--ranks", str(args.ranks), "--trace", args.out, "--json", measured, *flags])
        if code:
            return code
        print()
        code = cli.main(["simulate", "--ranks", "256", "--workload", "kuairand"])
        if code:
            return code
        print()
        print("# the same 256 ranks with the cost model fitted on this machine (CPU compute, lengths x 1/12):")
        return cli.main(["simulate", "--ranks", "256", "--workload", "kuairand", "--calibration", measured])


if __name__ == "__main__":
    sys.exit(main())
