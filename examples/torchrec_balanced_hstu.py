"""FreeScale's load balancing in a TorchRec model, on CPU ranks:

    python examples/torchrec_balanced_hstu.py [--ranks 4] [--steps 6] [--max-len 1024]

A DistributedModelParallel model (EmbeddingCollection, table-wise and row-wise, fused row-wise
Adagrad, TrainPipelineSparseDist, all over a "freescale" group) feeds an HSTU-like sequence module
(causal self-attention per user history, cost ~ L²) whose histories are heavy-tailed. The run is
made twice from the same seed and data: as is, and with one line,

    fc.balance(model.seq, cost_model)

which moves whole samples (every feature's embeddings, labels riding along) after the embedding
AllToAll so each rank gets about the same attention work, and sends the outputs home (gradients
follow through autograd). Printed: per-rank compute (thread CPU seconds in the sequence module,
so cores shared by several ranks do not blur it), its imbalance (max / mean), step times and the
losses of both runs. Needs torchrec 1.8 and fbgemm-gpu-cpu (scripts/setup.sh installs them).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingCollection, JaggedTensor, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.streamable import Pipelineable

import freescale_comm as fc
from freescale_comm.testing import spawn

DIM = 32
LAYERS = 4  # attention layers of the sequence module
BATCH = 32  # samples per rank and step
TABLES = {"items": 5000, "cats": 100}  # sequence feature -> rows; both aligned per sample


@dataclass
class Batch(Pipelineable):
    sequence: KeyedJaggedTensor  # "items" and "cats", one history per sample each
    label: torch.Tensor  # float [BATCH]

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(self.sequence.to(device, non_blocking), self.label.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        self.sequence.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return self


def make_batch(step: int, rank: int, max_len: int) -> Batch:
    """Heavy-tailed history lengths (Pareto, as real user histories), the same for both runs."""
    rng = np.random.default_rng(1000 * step + rank)
    lengths = np.minimum((rng.pareto(1.1, BATCH) + 1) * 24, max_len).astype(np.int64)
    items = rng.integers(0, TABLES["items"], lengths.sum())
    cats = rng.integers(0, TABLES["cats"], lengths.sum())
    kjt = KeyedJaggedTensor(keys=list(TABLES), values=torch.from_numpy(np.concatenate([items, cats])),
                            lengths=torch.from_numpy(np.concatenate([lengths, lengths])))
    return Batch(kjt, torch.from_numpy((rng.random(BATCH) < 0.3).astype(np.float32)))


class CausalAttention(nn.Module):
    """HSTU-like: per user, LAYERS of causal single-head self-attention (residual) over the
    history (items + cats embeddings), the last position's output as the user's representation:
    [samples, DIM]. One sample at a time, so a sample's result does not depend on which rank
    computes it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(LAYERS))
        self.out = nn.Linear(DIM, DIM)
        self.cpu_seconds = 0.0  # thread CPU time spent here since the last reset

    def forward(self, sequences: dict, labels: Optional[torch.Tensor]) -> torch.Tensor:
        start = time.thread_time()
        x = sequences["items"].values() + sequences["cats"].values()
        users = []
        for row in torch.split(x, sequences["items"].lengths().tolist()):
            if row.shape[0] == 0:
                users.append(torch.zeros(DIM))
                continue
            causal = torch.ones(row.shape[0], row.shape[0], dtype=torch.bool).triu(1)
            for qkv in self.qkv:
                q, k, v = qkv(row).chunk(3, dim=1)
                scores = (q @ k.T) / math.sqrt(DIM)
                row = row + scores.masked_fill(causal, float("-inf")).softmax(dim=1) @ v
            users.append(self.out(row[-1]))
        self.cpu_seconds += time.thread_time() - start
        return torch.stack(users) if users else torch.zeros(0, DIM)


def fitted_cost_model(seq: CausalAttention) -> fc.planner.CostModel:
    """Seconds per sample of `seq` as qL² + lL + c, fitted on rank 0 (per-sample Python overhead
    included, which FLOP counts miss) and broadcast: every rank must plan with the same model."""
    fitted = [None]
    if dist.get_rank() == 0:
        lengths, seconds = [4, 16, 64, 128, 256, 512, 1024], []
        for n in lengths:  # as in training: autograd records the graph
            rows = {f: JaggedTensor(values=torch.randn(n, DIM, requires_grad=True), lengths=torch.tensor([n]))
                    for f in TABLES}
            runs = []
            for _ in range(3):
                start = time.thread_time()
                seq(rows, None)
                runs.append(time.thread_time() - start)
            seconds.append(min(runs))
        fitted[0] = fc.planner.CostModel.fit(lengths, seconds)
    dist.broadcast_object_list(fitted, src=0)
    return fitted[0]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=n, feature_names=[f])
                    for f, n in TABLES.items()], device=torch.device("meta"))
        self.seq = CausalAttention()
        self.head = nn.Linear(DIM, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        users = self.seq(self.ec(batch.sequence), batch.label)
        logits = self.head(users).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.label), logits.detach()


def train(info, balance: bool, steps: int, max_len: int) -> dict:
    torch.set_num_threads(1)  # compute on the rank's own thread: its CPU time is its work
    world, rank = info.world_size, info.rank
    pg = dist.group.WORLD  # the "freescale" default group: the sharding AllToAlls and the balancing
    torch.manual_seed(0)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    sharder = EmbeddingCollectionSharder(fused_params=fused)
    model = Model()
    plan = ShardingPlan({"ec": construct_module_sharding_plan(
        model.ec, {"t_items": row_wise(compute_kernel="fused"), "t_cats": table_wise(rank=world - 1, compute_kernel="fused")},
        sharder, local_size=world, world_size=world, device_type="cpu")})
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=plan, sharders=[sharder])
    seq = dmp.module.seq
    if balance:
        fc.balance(seq, fitted_cost_model(seq))  # the one line: balance after the embedding AllToAll
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.05))
    pipeline = TrainPipelineSparseDist(dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), torch.device("cpu"))
    batches = [make_batch(step, rank, max_len) for step in range(steps)]
    feed = iter(batches)
    losses, cpu, wall, planned = [], [], [], []
    for step in range(steps):
        seq.cpu_seconds = 0.0
        dist.barrier()
        start = time.perf_counter()
        logits = pipeline.progress(feed)
        wall.append(time.perf_counter() - start)
        cpu.append(seq.cpu_seconds)
        hooks = getattr(seq, "freescale_balance", None)
        if hooks is not None and hooks.last_plan is not None:
            planned.append((float(hooks.last_plan.imbalance_before), float(hooks.last_plan.imbalance_after)))
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batches[step].label)
        losses.append(float(loss))
    return {"losses": losses, "cpu": cpu, "wall": wall, "planned": planned, "cost": repr(getattr(seq, "freescale_balance", None) and seq.freescale_balance.balancer.cost_model),
            "items": [int(b.sequence["items"].lengths().sum()) for b in batches]}


def _summary(name: str, results: list[dict]) -> dict:
    cpu = np.array([r["cpu"] for r in results])  # [ranks, steps]
    wall = np.array([r["wall"] for r in results]).max(axis=0)  # a step ends when its slowest rank does
    imbalance = cpu.max(axis=0) / np.maximum(cpu.mean(axis=0), 1e-12)
    skip = 1 if cpu.shape[1] > 1 else 0  # the first step also fills the pipeline
    print(f"{name}: sequence-module compute per rank (CPU s, mean over steps): "
          + " ".join(f"{c:.3f}" for c in cpu[:, skip:].mean(axis=1)))
    print(f"{name}: imbalance max/mean per step: " + " ".join(f"{x:.2f}" for x in imbalance)
          + f"  (mean {imbalance[skip:].mean():.2f})")
    print(f"{name}: step wall time (s, slowest rank): " + " ".join(f"{w:.3f}" for w in wall)
          + f"  (mean {wall[skip:].mean():.3f})")
    planned = results[0]["planned"]
    if planned:
        print(f"{name}: the planner's imbalance (cost model) before -> after per step: "
              + " ".join(f"{b:.2f}->{a:.2f}" for b, a in planned) + f"; cost model {results[0]['cost']}")
    return {"imbalance": float(imbalance[skip:].mean()), "wall": float(wall[skip:].mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-len", type=int, default=1024, help="history length cap (items)")
    args = parser.parse_args()
    runs = {}
    for balance in (False, True):
        name = "balanced" if balance else "as is"
        runs[name] = spawn(train, args.ranks, balance, args.steps, args.max_len, backend="freescale", timeout_s=1800)
    print(f"{args.ranks} ranks, {BATCH} samples per rank and step, items per rank and step: "
          + "; ".join(" ".join(str(n) for n in r["items"]) for r in runs["as is"]))
    stats = {name: _summary(name, results) for name, results in runs.items()}
    diff = max(abs(a - b) for ra, rb in zip(runs["as is"], runs["balanced"])
               for a, b in zip(ra["losses"], rb["losses"]))
    print("losses (rank 0) as is:    " + " ".join(f"{x:.7f}" for x in runs["as is"][0]["losses"]))
    print("losses (rank 0) balanced: " + " ".join(f"{x:.7f}" for x in runs["balanced"][0]["losses"]))
    print(f"largest loss difference over ranks and steps: {diff:.3g} "
          + ("(bit-identical)" if diff == 0 else "(float rounding: dense gradients are summed in another order)"))
    print(f"imbalance {stats['as is']['imbalance']:.2f} -> {stats['balanced']['imbalance']:.2f}; "
          f"step time {stats['as is']['wall']:.3f} s -> {stats['balanced']['wall']:.3f} s")


if __name__ == "__main__":
    main()
