"""FreeScale's prioritized embedding communication in a TorchRec model, by changing one line:

    python examples/torchrec_pec_pipeline.py [--ranks 2] [--steps 8] [--collision 0.5]

    pipeline = TrainPipelineSparseDist(model, optimizer, device)   # TorchRec
    pipeline = fc.TrainPipelinePEC(model, optimizer, device)       # FreeScale's PEC

A DistributedModelParallel model (EmbeddingBagCollection + EmbeddingCollection, row-, table- and
column-wise, fused row-wise Adagrad, an MLP head; freescale_comm.bench.torchrec_pipelines) is
trained twice on CPU ranks from the same seed and data whose batches share a `--collision` share of
their ids with the batch before: with TrainPipelineSparseDist and with fc.TrainPipelinePEC. Printed:
both runs' losses (equal: PEC reads exactly what synchronous training reads) and what PEC's main
thread waited on embedding communication per step. Needs torchrec and fbgemm-gpu-cpu
(scripts/setup.sh installs them). Timings on shared CPU cores are not GPU timings.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

import freescale_comm as fc
from freescale_comm.bench import torchrec_pipelines as tp
from freescale_comm.testing import RankInfo, spawn


def train(cfg: tp.PipelineBenchConfig, use_pec: bool, collision: float) -> tuple[list[float], list[float]]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = tp.make_batches(cfg, world, rank, collision)
    model, optimizer = tp._build(cfg, dist.group.WORLD)
    if use_pec:
        pipeline = fc.TrainPipelinePEC(model, optimizer, torch.device("cpu"))  # <- the one line
    else:
        pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    losses, feed = [], iter(batches)
    for batch in batches:
        logits = pipeline.progress(feed)
        losses.append(float(nn.functional.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum")))
    exposed = list(getattr(pipeline, "exposed_ms", []))
    if use_pec:
        pipeline.close()
    return losses, exposed


def rank_main(info: RankInfo, cfg: tp.PipelineBenchConfig, collision: float) -> dict:
    torch.set_num_threads(1)
    reference, _ = train(cfg, False, collision)
    losses, exposed = train(cfg, True, collision)
    return {"reference": reference, "pec": losses, "exposed_ms": exposed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--collision", type=float, default=0.5)
    args = parser.parse_args()
    cfg = tp.PipelineBenchConfig(ranks=args.ranks, steps=args.steps, warmup=0, samples=32, rows=50_000)
    results = spawn(rank_main, args.ranks, cfg, args.collision, backend="gloo", timeout_s=600)
    for rank, r in enumerate(results):
        same = "equal" if r["reference"] == r["pec"] else "DIFFERENT"
        print(f"rank {rank}: losses {same}: TrainPipelineSparseDist {[round(x, 4) for x in r['reference'][:4]]}..., "
              f"TrainPipelinePEC {[round(x, 4) for x in r['pec'][:4]]}...")
        print(f"rank {rank}: PEC's main thread waited {[round(x, 2) for x in r['exposed_ms']]} ms on embedding traffic")


if __name__ == "__main__":
    main()
