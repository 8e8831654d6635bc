"""Rank functions training a small TorchRec DistributedModelParallel model (EmbeddingBagCollection
+ EmbeddingCollection, row- and table-wise, some tables on a subset of ranks, fused row-wise
Adagrad, TrainPipelineSparseDist) over a process group, as a TorchRec user does: run once over a
freescale group and once over gloo, the two must agree bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.streamable import Pipelineable
from fbgemm_gpu.split_embedding_configs import EmbOptimType

DIM = 8
BATCH = 6  # samples per rank and step
POOLED = {"user": 64, "ctx": 32}  # EBC feature -> rows
SEQUENCE = {"items": 100, "cats": 20, "hist": 50}  # EC feature -> rows


@dataclass
class Batch(Pipelineable):
    pooled: KeyedJaggedTensor  # one id list per (feature, sample)
    sequence: KeyedJaggedTensor  # one history per (feature, sample)
    label: torch.Tensor  # float [BATCH]

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(self.pooled.to(device, non_blocking), self.sequence.to(device, non_blocking),
                     self.label.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        self.pooled.record_stream(stream)
        self.sequence.record_stream(stream)
        self.label.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return self


def _kjt(rows: dict[str, int], max_len: int, gen: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, max_len + 1, (len(rows) * BATCH,), generator=gen)  # empty lists too
    values = [torch.randint(0, n, (int(lengths[i * BATCH:(i + 1) * BATCH].sum()),), generator=gen)
              for i, n in enumerate(rows.values())]
    return KeyedJaggedTensor(keys=list(rows), values=torch.cat(values), lengths=lengths)


def make_batch(step: int, rank: int) -> Batch:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return Batch(_kjt(POOLED, 3, gen), _kjt(SEQUENCE, 7, gen), torch.randint(0, 2, (BATCH,), generator=gen).float())


@torch.fx.wrap  # TrainPipelineSparseDist traces forward: a leaf call, not traced through
def _mean_rows(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per-sample mean of a jagged [sum(lengths), D] block (0 for empty samples): [len(lengths), D]."""
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    sums = torch.zeros(lengths.numel(), values.shape[1], dtype=values.dtype).index_add_(0, segment, values)
    return sums / lengths.clamp(min=1).unsqueeze(1).to(values.dtype)


class SequenceModel(nn.Module):
    """Pooled embeddings (EBC) and sequence embeddings (EC, mean over each history) feed a linear
    head; forward returns (loss, logits), as TrainPipelineSparseDist expects."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=n, feature_names=[f])
                    for f, n in POOLED.items()], device=device)
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=n, feature_names=[f])
                    for f, n in SEQUENCE.items()], device=device)
        self.head = nn.Linear(DIM * (len(POOLED) + len(SEQUENCE)), 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.pooled)
        sequences = self.ec(batch.sequence)
        means = [_mean_rows(sequences[f].values(), sequences[f].lengths()) for f in SEQUENCE]
        logits = self.head(torch.cat([pooled.values(), *means], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.label)
        return loss, logits.detach()


def _plan(model: SequenceModel, sharders: tuple, world: int) -> ShardingPlan:
    """EBC: "user" row-wise, "ctx" on rank 1. EC: "items" on rank 0 and "cats" on the last rank
    only (the other ranks send TorchRec's empty [0, D] sequence blocks), "hist" row-wise."""
    fused = "fused"
    ebc = construct_module_sharding_plan(
        model.ebc, {"t_user": row_wise(compute_kernel=fused), "t_ctx": table_wise(rank=1, compute_kernel=fused)},
        sharders[0], local_size=world, world_size=world, device_type="cpu")
    ec = construct_module_sharding_plan(
        model.ec, {"t_items": table_wise(rank=0, compute_kernel=fused),
                   "t_cats": table_wise(rank=world - 1, compute_kernel=fused),
                   "t_hist": row_wise(compute_kernel=fused)},
        sharders[1], local_size=world, world_size=world, device_type="cpu")
    return ShardingPlan({"ebc": ebc, "ec": ec})


def train(pg: dist.ProcessGroup, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Trains a fresh model (same seed on every call) for `steps` pipelined steps over `pg`.
    Returns this rank's losses and its local weights (table shards and dense), by name."""
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    torch.manual_seed(0)
    fused_params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    sharders = (EmbeddingBagCollectionSharder(fused_params=fused_params), EmbeddingCollectionSharder(fused_params=fused_params))
    model = SequenceModel(torch.device("meta"))
    plan = _plan(model, sharders, world)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=plan, sharders=list(sharders))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.1))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    pipeline = TrainPipelineSparseDist(dmp, optimizer, torch.device("cpu"))
    batches = [make_batch(step, rank) for step in range(steps)]
    feed, losses = iter(batches), []
    for step in range(steps):
        logits = pipeline.progress(feed)  # the forward output of batch `step`
        losses.append(float(nn.functional.binary_cross_entropy_with_logits(logits, batches[step].label)))
    weights = {}
    for name, value in dmp.state_dict().items():
        if hasattr(value, "local_shards"):  # ShardedTensor: this rank's shards (none if it holds no rows)
            shards = value.local_shards()
            value = torch.cat([s.tensor.flatten() for s in shards]) if shards else torch.empty(0)
        weights[name] = value.detach().clone()
    return losses, weights


def dmp_over_freescale_matches_gloo(info, steps: int) -> dict[str, object]:
    """Trains over the default (freescale) group, then over a gloo group of the same ranks.
    Returns the losses, the names of the weights compared (any difference raises) and how many
    AllToAlls freescale moved."""
    assert dist.get_backend() == "freescale"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        losses_fs, weights_fs = train(dist.group.WORLD, steps)
    native = sum(e.name.startswith("freescale:all_to_all") for e in prof.events())  # moved by freescale
    losses_gl, weights_gl = train(dist.new_group(backend="gloo"), steps)
    assert losses_fs == losses_gl, f"losses differ: freescale {losses_fs} vs gloo {losses_gl}"
    assert weights_fs.keys() == weights_gl.keys()
    for name in weights_fs:
        assert torch.equal(weights_fs[name], weights_gl[name]), f"{name} differs after training"
    return {"losses": losses_fs, "weights": sorted(weights_fs), "native_all_to_alls": native}
