"""python -m freescale_comm demo: the main job in one small run (about 40 s on 2 cores, as the README says).

Runs `freescale-bench e2e --trace freescale-demo` (a measured HSTU-like training step on local
ranks, one per CPU core up to 4, each pinned to its own core as one device per rank; every mode),
then `freescale-bench simulate --ranks 256` with the default H100 model and with the cost model
that run fitted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from freescale_comm.bench import cli

    p = argparse.ArgumentParser(prog="python -m freescale_comm", description="freescale_comm's demo")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="measured e2e step on local ranks (one per core, 2 to 4), traces and plots, then the 256-rank simulation")
    d.add_argument("--ranks", type=cli._local_ranks(2), default=None,
                   help="local ranks of the measured run (default: one per usable CPU core, 2 to 4)")
    d.add_argument("--out", default="freescale-demo", help="directory for trace.json and the PNGs")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    unwritable = cli._writable_outputs(argparse.Namespace(trace=args.out))
    if unwritable:
        p.error(unwritable.replace("--trace", "--out", 1))  # exit 2, before the measured run

    with tempfile.TemporaryDirectory() as tmp:
        measured = os.path.join(tmp, "e2e.json")
        flags = ["--no-progress"] if args.no_progress else []
        ranks = ["--ranks", str(args.ranks)] if args.ranks is not None else []
        code = cli.main(["e2e", *ranks, "--trace", args.out, "--json", measured, *flags])
        if code:
            return code
        print()
        code = cli.main(["simulate", "--ranks", "256", "--workload", "kuairand"])
        if code:
            return code
        print()
        with open(measured) as f:
            scale = json.load(f)["config"]["length_scale"]
        print(f"# the same 256 ranks with the cost model fitted on this machine (CPU compute, lengths x {scale:.3g}):")
        return cli.main(["simulate", "--ranks", "256", "--workload", "kuairand", "--calibration", measured])


if __name__ == "__main__":
    sys.exit(main())
