"""Rank functions for fc.TrainPipelinePEC: the same DMP model trained by TorchRec's
TrainPipelineSparseDist and by the PEC pipeline on the same data must agree (losses, outputs, final
weights, optimizer state); a staleness oracle checks every row each batch reads."""

from __future__ import annotations

import collections
import contextlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from fbgemm_gpu.split_embedding_configs import EmbOptimType

import freescale_comm as fc
from freescale_comm.pipelines._micro_batches import select_samples
from dmp_programs import Batch  # pooled + sequence KJTs and labels, as TorchRec's pipelines move them

DIM = 8
ROWS = 40  # per table: small, so collisions are plentiful
POOLED = {"user": "row_wise", "ctx": "table_wise", "geo": "column_wise"}  # EBC feature -> sharding
SEQUENCE = {"items": "row_wise", "cats": "table_wise", "hist": "column_wise"}  # EC feature -> sharding
OPTIMIZERS = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
              "adagrad": EmbOptimType.EXACT_ADAGRAD, "adam": EmbOptimType.ADAM}  # adam: CUDA only in FBGEMM


def _ids(previous: Optional[torch.Tensor], n: int, collision: float, gen: torch.Generator) -> torch.Tensor:
    """n ids in [0, ROWS): a `collision` share drawn from `previous` (the last batch's ids of this
    feature, all ranks), the rest from rows `previous` does not hold."""
    if previous is None or previous.numel() == 0:
        return torch.randint(0, ROWS, (n,), generator=gen)
    reuse = torch.rand(n, generator=gen) < collision
    fresh_pool = torch.tensor(sorted(set(range(ROWS)) - set(previous.tolist())), dtype=torch.int64)
    if fresh_pool.numel() == 0:
        reuse[:] = True
    ids = previous[torch.randint(0, previous.numel(), (n,), generator=gen)]
    if fresh_pool.numel():
        ids = torch.where(reuse, ids, fresh_pool[torch.randint(0, fresh_pool.numel(), (n,), generator=gen)])
    return ids


def make_batches(steps: int, world: int, collision: float, seed: int = 0, batch: int = 4,
                 empty: str = "ids") -> list[list[Batch]]:
    """batches[step][rank]. The last step's batches are smaller (uneven), and rank world-1's batch at
    step 2 is empty: samples without a single id (`empty="ids"`), or no samples at all
    (`empty="samples"`: TorchRec 1.8's TrainPipelineSparseDist fails on those, in
    construct_jagged_tensors). Collisions are between consecutive steps, across ranks."""
    gen = torch.Generator().manual_seed(seed)
    out: list[list[Batch]] = []
    previous: dict[str, torch.Tensor] = {}
    for step in range(steps):
        sizes = [batch - 2 if step == steps - 1 else batch for _ in range(world)]
        if step == 2 and world > 1 and empty == "samples":
            sizes[-1] = 0
        lengths = {f: [torch.randint(0, 4, (sizes[r],), generator=gen) for r in range(world)]
                   for f in list(POOLED) + list(SEQUENCE)}
        if step == 2 and world > 1:
            for f in lengths:
                lengths[f][-1].zero_()
        values = {f: _ids(previous.get(f), int(sum(int(l.sum()) for l in lengths[f])), collision, gen) for f in lengths}
        previous = values
        row = []
        for r in range(world):
            def kjt(features: dict) -> KeyedJaggedTensor:
                vals, lens = [], []
                for f in features:
                    start = int(sum(int(l.sum()) for l in lengths[f][:r]))
                    vals.append(values[f][start:start + int(lengths[f][r].sum())])
                    lens.append(lengths[f][r])
                return KeyedJaggedTensor(keys=list(features), values=torch.cat(vals), lengths=torch.cat(lens))
            row.append(Batch(kjt(POOLED), kjt(SEQUENCE), torch.randint(0, 2, (sizes[r],), generator=gen).float()))
        out.append(row)
    return out


@torch.fx.wrap
def _mean_rows(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths.to(values.device))
    sums = torch.zeros(lengths.numel(), values.shape[1], dtype=values.dtype, device=values.device).index_add_(0, segment, values)
    return sums / lengths.clamp(min=1).unsqueeze(1).to(values.dtype)


def _collections(device: torch.device, pooling: PoolingType = PoolingType.SUM) -> tuple[nn.Module, nn.Module]:
    """The test models' EmbeddingBagCollection (POOLED) and EmbeddingCollection (SEQUENCE)."""
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f], pooling=pooling)
        for f in POOLED], device=device)
    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name=f"t_{f}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f]) for f in SEQUENCE],
        device=device)
    return ebc, ec


class Model(nn.Module):
    """EBC (pooled) and EC (mean over each history) into a linear head; forward returns
    (loss summed over samples, logits)."""

    def __init__(self, device: torch.device, pooling: PoolingType = PoolingType.SUM, reduction: str = "sum") -> None:
        super().__init__()
        self.ebc, self.ec = _collections(device, pooling)
        self.head = nn.Linear(DIM * (len(POOLED) + len(SEQUENCE)), 1)
        self.reduction = reduction

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.pooled)
        sequences = self.ec(batch.sequence)
        means = [_mean_rows(sequences[f].values(), sequences[f].lengths()) for f in SEQUENCE]
        logits = self.head(torch.cat([pooled.values(), *means], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.label, reduction=self.reduction)
        return loss, logits.detach()


class LearnedWeightModel(Model):
    """Model with a learned loss weight (uncertainty weighting, common in multi-task ranking):
    exp(-s) x the loss + s. With a mean loss, a term no sample carries (s)."""

    def __init__(self, device: torch.device, **kwargs) -> None:
        super().__init__(device, **kwargs)
        self.loss_weight = LossWeight(device)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        loss, logits = super().forward(batch)
        s = self.loss_weight.log_var[0]
        return torch.exp(-s) * loss + s, logits


class LossWeight(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.log_var = nn.Parameter(torch.zeros(1, device=device))

    def reset_parameters(self) -> None:  # DistributedModelParallel materializes meta parameters with it
        nn.init.zeros_(self.log_var)


def _spec(kind: str, world: int, table_rank: int):
    if kind == "row_wise":
        return row_wise(compute_kernel="fused")
    if kind == "column_wise":
        return column_wise(ranks=[r % world for r in range(2)], compute_kernel="fused")
    return table_wise(rank=table_rank % world, compute_kernel="fused")


def build(pg: dist.ProcessGroup, optimizer: str, model_cls: type = Model, device: torch.device = torch.device("cpu"),
          **model_kwargs) -> tuple:
    world = dist.get_world_size(pg)
    torch.manual_seed(0)
    fused = {"optimizer": OPTIMIZERS[optimizer], "learning_rate": 0.1 if optimizer == "sgd" else 0.05}
    static_graph = model_kwargs.pop("static_graph", True)  # the dense part's DDP (TorchRec's default: True)
    wrapper = model_kwargs.pop("data_parallel_wrapper", None) or DefaultDataParallelWrapper(static_graph=static_graph)
    if "fused_params" in model_kwargs:
        fused = model_kwargs.pop("fused_params")
    sharders = (EmbeddingBagCollectionSharder(fused_params=fused), EmbeddingCollectionSharder(fused_params=fused))
    model = model_cls(torch.device("meta"), **model_kwargs)
    if device.type != "cpu":  # the dense head was made on the CPU (DMP materializes only meta tensors on `device`)
        for param in model.parameters():
            if not param.is_meta:
                param.data = param.data.to(device)
    ebc = construct_module_sharding_plan(model.ebc, {f"t_{f}": _spec(k, world, i) for i, (f, k) in enumerate(POOLED.items())},
                                         sharders[0], local_size=world, world_size=world, device_type=device.type)
    ec = construct_module_sharding_plan(model.ec, {f"t_{f}": _spec(k, world, i + 1) for i, (f, k) in enumerate(SEQUENCE.items())},
                                        sharders[1], local_size=world, world_size=world, device_type=device.type)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=device,
                                   plan=ShardingPlan({"ebc": ebc, "ec": ec}), sharders=list(sharders),
                                   data_parallel_wrapper=wrapper)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.1))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def _local(value: object) -> torch.Tensor:
    if hasattr(value, "local_shards"):
        shards = value.local_shards()
        return torch.cat([s.tensor.flatten().cpu() for s in shards]) if shards else torch.empty(0)
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else torch.tensor(float(value))


def _state(dmp: nn.Module, optimizer: CombinedOptimizer) -> dict[str, torch.Tensor]:
    out = {f"weight:{k}": _local(v).clone() for k, v in dmp.state_dict().items()}
    for param, state in optimizer.state_dict()["state"].items():
        for k, v in state.items():
            out[f"state:{param}:{k}"] = _local(v).clone()
    return out


def train(pg: dist.ProcessGroup, pipeline: str, optimizer: str, batches: list[list[Batch]],
          epochs: int = 1, stop_after: Optional[int] = None, **kwargs) -> dict:
    """Trains on `batches` (each epoch a new iterator over them, as a dataloader loop does), or
    stops after `stop_after` steps and reads the state mid-run (the PEC pipeline still open)."""
    rank = dist.get_rank(pg)
    device = kwargs.pop("device", torch.device("cpu"))
    dmp, opt = build(pg, optimizer, kwargs.pop("model_cls", Model), device=device,
                     static_graph=kwargs.pop("static_graph", True),
                     **({"reduction": kwargs.pop("reduction")} if "reduction" in kwargs else {}))
    blocking = kwargs.pop("blocking", False)  # the synchronous reference: every message waited when posted
    if pipeline == "sparse_dist":
        pipe = TrainPipelineSparseDist(dmp, opt, device)
    else:
        pipe = fc.TrainPipelinePEC(dmp, opt, device, group=pg, **kwargs)
        pipe._blocking = blocking
    exchanges: list[tuple[int, str]] = []  # PEC: (priority, dtype) of every exchange, in program order
    # PEC: floats this rank received in the rounds that move rows and in those that move gradients
    # and the ids it received in ask rounds (each message less its counts: per requester, per owned
    # slot its rows per micro-batch, then the next batch's counts and flag)
    moved = {"rows": 0, "gradients": 0, "ids": 0}
    if hasattr(pipe, "_exchange"):
        exchange = pipe._exchange
        post = exchange._a2a
        moving = [None]

        def counted(out, inp, out_splits, in_splits, priority):
            exchanges.append((priority, str(out.dtype)))
            if moving[0] is not None:
                counts = exchange.world * len(exchange.owned) * ((exchange.micro_batches or 0) + 1) + exchange.world
                moved[moving[0]] += out.numel() - (counts if moving[0] == "ids" else 0)
            return post(out, inp, out_splits, in_splits, priority)

        def round_of(kind, fn):
            def run(*args, **kwargs):
                moving[0] = kind
                try:
                    return fn(*args, **kwargs)
                finally:
                    moving[0] = None
            return run
        exchange._a2a = counted
        exchange._rows, exchange._send_grads = round_of("rows", exchange._rows), round_of("gradients", exchange._send_grads)
        exchange.ask = round_of("ids", exchange.ask)
    from freescale_comm.pipelines import _tbe_update
    updates_before = dict(_tbe_update.update_counts)
    outputs = []
    micro_sizes = []  # with micro-batches: the samples of each micro-batch of each batch trained (but the first)
    for _ in range(epochs):
        feed = iter([b[rank] for b in batches])
        while stop_after is None or len(outputs) < stop_after:
            try:
                outputs.append(pipe.progress(feed).detach().cpu().clone())
            except StopIteration:
                break
            split = getattr(pipe, "_batch", None)
            if hasattr(split, "samples"):
                micro_sizes.append([s.numel() for s in split.samples])
            for group in opt.param_groups:  # a learning-rate schedule: deferred updates must use their batch's
                group["lr"] *= 0.8
    state = _state(dmp, opt)  # mid-run for stop_after: the model's state_dict() flushes PEC first
    if hasattr(pipe, "close"):
        pipe.close()
    updates = {k: v - updates_before[k] for k, v in _tbe_update.update_counts.items()}  # fused updates by path
    return {"outputs": outputs, "state": state, "exchanges": exchanges, "micro_sizes": micro_sizes, "updates": updates,
            "fetched": moved["rows"], "gradients": moved["gradients"], "ids": moved["ids"],
            "asked": sum(getattr(pipe, "rows_asked", []))}


def pec_matches_sparse_dist(info, steps: int, collisions: list[float], optimizers: list[str]) -> dict:
    """For each (collision, optimizer): TrainPipelineSparseDist then TrainPipelinePEC on the same
    batches; returns per case the worst differences (0.0 = bit-identical) by what was compared."""
    pg = dist.group.WORLD
    world = dist.get_world_size()
    report = {}
    for collision in collisions:
        batches = make_batches(steps, world, collision, seed=int(collision * 100) + 7)
        for optimizer in optimizers:
            ref = train(pg, "sparse_dist", optimizer, batches)
            pec = train(pg, "pec", optimizer, batches)
            case = f"collision={collision} optimizer={optimizer}"
            assert len(ref["outputs"]) == len(pec["outputs"]) == steps, (case, len(ref["outputs"]), len(pec["outputs"]))
            out_diff = max((_rel(a, b) for a, b in zip(ref["outputs"], pec["outputs"])), default=0.0)
            assert ref["state"].keys() == pec["state"].keys(), (case, sorted(ref["state"]), sorted(pec["state"]))
            state_diff = {k: _rel(ref["state"][k], pec["state"][k]) for k in ref["state"]}
            report[case] = {"outputs": out_diff, "state": state_diff, "exchanges": pec["exchanges"],
                            "updates": pec["updates"]}
    # two epochs (a new iterator after StopIteration), and the state read after 5 of 8 steps
    batches = make_batches(steps, world, 0.5, seed=77)
    for case, kwargs in (("two epochs", {"epochs": 2}), ("stopped after 5 steps", {"stop_after": 5})):
        ref = train(pg, "sparse_dist", optimizers[-1], batches, **kwargs)
        pec = train(pg, "pec", optimizers[-1], batches, **kwargs)
        assert len(ref["outputs"]) == len(pec["outputs"]), (case, len(ref["outputs"]), len(pec["outputs"]))
        report[case] = {"outputs": max(_rel(a, b) for a, b in zip(ref["outputs"], pec["outputs"])),
                        "state": {k: _rel(ref["state"][k], pec["state"][k]) for k in ref["state"]}}
    return report


def adam_on_cuda(info, steps: int, collisions: list[float], optimizer: str = "adam", device: str = "cuda") -> dict:
    """GPU checklist item 9 (FBGEMM's fused Adam is CUDA-only): on this rank's GPU,
    TrainPipelineSparseDist then TrainPipelinePEC with fused Adam; per collision rate the worst
    relative differences of outputs and of every weight and optimizer state (Adam reads the step
    counter: a deferred update applied at a later batch's counter differs by ~1e-2)."""
    pg = dist.group.WORLD
    device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    report = {}
    for collision in collisions:
        batches = make_batches(steps, dist.get_world_size(), collision, seed=int(collision * 100) + 11)
        ref = train(pg, "sparse_dist", optimizer, batches, device=device)
        pec = train(pg, "pec", optimizer, batches, device=device)
        assert len(ref["outputs"]) == len(pec["outputs"]) == steps, (collision, len(ref["outputs"]), len(pec["outputs"]))
        assert ref["state"].keys() == pec["state"].keys(), (sorted(ref["state"]), sorted(pec["state"]))
        report[collision] = {"outputs": max(_rel(a, b) for a, b in zip(ref["outputs"], pec["outputs"])),
                             "state": {k: _rel(ref["state"][k], pec["state"][k]) for k in ref["state"]},
                             # Adam's moments are nonzero once it trained (else the comparison proves nothing)
                             "moments": sum(float(v.abs().sum()) for k, v in pec["state"].items() if k.startswith("state:"))}
    return report


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |a| (0.0: bit-identical up to signed zeros; inf when shapes differ)."""
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0 or torch.equal(a, b):
        return 0.0
    return float((a - b).abs().max() / a.abs().max().clamp(min=1e-30))


# -- the staleness oracle -------------------------------------------------------------------------
class OracleModel(nn.Module):
    """Reads every embedding and returns them: loss = -(sum of all of them), so with fused SGD at
    lr 1 each read of a row adds 1/world to it (TorchRec divides embedding gradients by the world
    size): a row's value is a version counter, exact in float32."""

    def __init__(self, device: torch.device, pooling: PoolingType = PoolingType.SUM) -> None:
        super().__init__()
        self.ebc, self.ec = _collections(device, pooling)
        self.zero = nn.Parameter(torch.zeros(1, device=device))  # a dense parameter, for DDP

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple]:
        pooled = self.ebc(batch.pooled)
        sequences = self.ec(batch.sequence)
        seq_values = [sequences[f].values() for f in SEQUENCE]
        total = pooled.values().sum() + sum(v.sum() for v in seq_values)
        loss = -total + 0.0 * self.zero.sum()
        return loss, (pooled.values().detach(), [v.detach() for v in seq_values])


def staleness_oracle(info, steps: int, cases: list[tuple[float, str]], pipeline_kwargs: Optional[dict] = None) -> dict:
    """Per (collision, mutation): {"checked": reads checked, "stale": stale ones}, see _oracle_run."""
    return {f"{c} {m}": _oracle_run(steps, c, m, **(pipeline_kwargs or {})) for c, m in cases}


def _check_reads(pooled: torch.Tensor, sequences: list, mine: Batch, reads: dict, world: int) -> tuple[int, int]:
    """(reads checked, stale ones) of one batch (or micro-batch) `mine`'s OracleModel output."""
    checked = stale = 0
    for i, f in enumerate(POOLED):
        jt = mine.pooled[f]
        bags = torch.repeat_interleave(torch.arange(jt.lengths().numel()), jt.lengths())
        expected = torch.zeros(jt.lengths().numel(), dtype=torch.float64).index_add_(0, bags, reads[f][jt.values()]) / world
        got = pooled[:, i * DIM:(i + 1) * DIM].double()
        checked += got.shape[0]
        stale += int((got != expected.unsqueeze(1)).any(1).sum())
    for f, got in zip(SEQUENCE, sequences):
        expected = reads[f][mine.sequence[f].values()] / world
        checked += got.shape[0]
        stale += int((got.double() != expected.unsqueeze(1)).any(1).sum())
    return checked, stale


def _oracle_run(steps: int, collision: float, mutate: str, **pipeline_kwargs) -> dict:
    """Trains OracleModel with the PEC pipeline (fused SGD, lr 1, zeroed tables; a rank without
    samples at step 2) and checks every row every batch reads against the number of earlier reads
    of that row (all ranks). `mutate`: "" (none); "early_overlap_reads": OL rows are sent before the
    update they wait for; "late_deferred_updates": deferred gradients are applied after the next
    NOL lookup instead of before."""
    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(steps, world, collision, seed=11, empty="samples")
    dmp, opt = build(pg, "sgd", OracleModel, fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 1.0})
    for value in dmp.state_dict().values():
        for shard in getattr(value, "local_shards", lambda: [])():
            shard.tensor.zero_()
    micro = pipeline_kwargs.get("micro_batches") is not None
    if micro:  # each micro-batch's output and samples, checked one by one
        pipeline_kwargs["merge_output"] = lambda outputs, samples: list(zip(outputs, samples))
    pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, **pipeline_kwargs)
    if mutate:
        setattr(pipe._exchange, mutate, True)
    reads = {f: torch.zeros(ROWS, dtype=torch.float64) for f in list(POOLED) + list(SEQUENCE)}  # reads so far
    feed = iter([b[rank] for b in batches])
    checked = stale = 0
    for step in range(steps):
        out = pipe.progress(feed)
        mine = batches[step][rank]
        parts = [(o, Batch(select_samples(mine.pooled, s), select_samples(mine.sequence, s), mine.label[s]))
                 for o, s in out] if micro else [(out, mine)]
        for (pooled, sequences), batch in parts:
            c, n = _check_reads(pooled, sequences, batch, reads, world)
            checked, stale = checked + c, stale + n
        for f in reads:  # every rank's reads of this step
            for b in batches[step]:
                kjt = b.pooled if f in POOLED else b.sequence
                reads[f] += torch.bincount(kjt[f].values(), minlength=ROWS).double()
    try:
        pipe.progress(feed)
        raise AssertionError("progress() after the last batch must raise StopIteration")
    except StopIteration:
        pass
    pipe.close()
    return {"checked": checked, "stale": stale}


# -- what the pipeline refuses --------------------------------------------------------------------
def _expect(error: type, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except error as e:
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {error.__name__}")


def refusals(info) -> dict:
    """The PEC pipeline's errors: unsupported tables at construction (ValueError naming the table),
    a non-DMP model (TypeError), bad priorities (ValueError), and dataloaders of different lengths
    (CommError on every rank, naming the ranks)."""
    from torchrec.distributed.sharding_plan import data_parallel

    pg = dist.group.WORLD
    world = dist.get_world_size()
    out = {}
    dmp, opt = build(pg, "sgd")
    out["not_dmp"] = _expect(TypeError, fc.TrainPipelinePEC, dmp.module, opt, torch.device("cpu"))
    out["priorities"] = _expect(ValueError, fc.TrainPipelinePEC, dmp, opt, torch.device("cpu"), high_priority=0, low_priority=5)
    out["balance_name"] = _expect(ValueError, fc.TrainPipelinePEC, dmp, opt, torch.device("cpu"), balance={"nope": None})
    out["balance_cost"] = _expect(TypeError, fc.TrainPipelinePEC, dmp, opt, torch.device("cpu"), balance={"head": 1.0})
    for bad_micro in (0, True, 2.5, 5000):  # 5000: accepted, then refused by every rank's first progress()
        out[f"micro_batches={bad_micro!r}"] = _expect(ValueError, fc.TrainPipelinePEC, dmp, opt, torch.device("cpu"),
                                                      micro_batches=bad_micro)
    out["prefetch"] = _expect(ValueError, fc.TrainPipelinePEC, dmp, opt, torch.device("cpu"), prefetch="early")
    out["loss_reduction"] = _expect(ValueError, fc.TrainPipelinePEC, dmp, opt, torch.device("cpu"), micro_batches=2,
                                    loss_reduction="avg")
    out["micro_priorities"] = _expect(ValueError, fc.TrainPipelinePEC, dmp, opt, torch.device("cpu"), micro_batches=2,
                                      next_micro_priority=10, micro_gradient_priority=20)
    out["split_batch"] = _expect(TypeError, fc.TrainPipelinePEC, dmp, opt, torch.device("cpu"), micro_batches=2,
                                 split_batch=5)
    # accepted, then a bare "'int' object is not callable" at the first progress()
    out["sparse_inputs"] = _expect(TypeError, fc.TrainPipelinePEC, dmp, opt, torch.device("cpu"), sparse_inputs=3)
    # the message named no argument
    out["priority_type"] = _expect(TypeError, fc.TrainPipelinePEC, dmp, opt, torch.device("cpu"), high_priority="100")
    # a batch the micro-batch cut cannot handle (labels one longer than the batch): a ValueError naming it
    uncuttable = [Batch(b.pooled, b.sequence, torch.cat([b.label, b.label[:1]])) for b in make_batches(2, world, 0.5)[0]]
    pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, micro_batches=2)
    out["uncuttable"] = _expect(ValueError, pipe.progress, iter([uncuttable[dist.get_rank()]] * 2))
    pipe.close()
    for name, spec in (("data_parallel", data_parallel()), ("dense_kernel", row_wise(compute_kernel="dense"))):
        torch.manual_seed(0)
        sharders = (EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}),
                    EmbeddingCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}))
        model = Model(torch.device("meta"))
        ebc = construct_module_sharding_plan(
            model.ebc, {"t_user": row_wise(compute_kernel="fused"), "t_ctx": spec, "t_geo": table_wise(rank=0, compute_kernel="fused")},
            sharders[0], local_size=world, world_size=world, device_type="cpu")
        bad = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                       plan=ShardingPlan({"ebc": ebc}), sharders=list(sharders))
        out[name] = _expect(ValueError, fc.TrainPipelinePEC, bad, torch.optim.SGD(bad.parameters(), lr=0.1) if name == "dense_kernel"
                            else opt, torch.device("cpu"))
    # dataloaders of different lengths: the last rank has one batch more
    batches = make_batches(4, world, 0.5, seed=5)
    pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg)
    mine = [b[dist.get_rank()] for b in batches]
    feed = iter(mine if dist.get_rank() == world - 1 else mine[:3])

    def run() -> None:
        while True:
            pipe.progress(feed)

    out["lengths"] = _expect(fc.CommError, run)
    out["after_failure"] = _expect(RuntimeError, pipe.progress, feed)
    pipe.close()
    # a dataloader that raises on one rank: that rank raises its error, the others CommError, at once
    dmp, opt = build(pg, "sgd")
    pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg)

    def broken():
        yield from mine[:2]
        if dist.get_rank() == 0:
            raise OSError("disk gone")
        yield from mine[2:]

    feed = broken()
    out["data_error"] = _expect(OSError if dist.get_rank() == 0 else fc.CommError, run)
    pipe.close()
    out["second_close"] = "ok" if pipe.close() is None else "?"
    return out


# -- PEC + balance -----------------------------------------------------------------------------------
class Tower(nn.Module):
    """Per-sample work on the EmbeddingCollection's output (a stand-in for an HSTU tower): sum of
    tanh(items @ W) + cats per history. Counts the samples it computed."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(DIM, DIM, device=device))
        self.samples: list[int] = []
        self.items: list[int] = []  # per call: the squared history lengths summed (the cost it computed)
        self.reset_parameters()

    def reset_parameters(self) -> None:  # DistributedModelParallel calls it when it materializes meta parameters
        with torch.no_grad():
            self.w.copy_(torch.linspace(-0.5, 0.5, DIM * DIM, device=self.w.device).view(DIM, DIM))

    def forward(self, sequences: dict) -> torch.Tensor:
        items, cats = sequences["items"], sequences["cats"]
        n = items.lengths().numel()
        if isinstance(n, int):  # not while torch.fx traces the model
            self.samples.append(n)
            self.items.append(int((items.lengths().to(torch.int64) ** 2).sum()))
        rows = torch.tanh(items.values() @ self.w)
        seg = torch.repeat_interleave(torch.arange(n), items.lengths())
        seg_c = torch.repeat_interleave(torch.arange(n), cats.lengths())
        return torch.zeros(n, DIM).index_add(0, seg, rows) + torch.zeros(n, DIM).index_add(0, seg_c, cats.values())


class BalancedModel(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.ebc, self.ec = _collections(device)
        self.tower = Tower(device)
        self.head = nn.Linear(DIM * (len(POOLED) + 1), 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.pooled)
        user = self.tower(self.ec(batch.sequence))
        logits = self.head(torch.cat([pooled.values(), user], dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum"), logits.detach()


def long_histories_on_rank0(batches: list[list[Batch]], length: int = 6) -> list[list[Batch]]:
    """`batches` with rank 0's histories all `length` long (fresh ids from the global RNG): the
    straggler balancing relieves."""
    for row in batches:
        b = row[0]
        lengths = torch.full_like(b.sequence.lengths(), length)
        values = torch.cat([torch.randint(0, ROWS, (length * b.sequence.stride(),)) for _ in SEQUENCE])
        row[0] = Batch(b.pooled, KeyedJaggedTensor(keys=list(SEQUENCE), values=values, lengths=lengths), b.label)
    return batches


class CountingPlans:
    """Counts, while entered, the balancer's all-gathers of lengths on the calling (main) thread
    (LoadBalancer._plan) and the balanced forwards that used a plan made ahead."""

    def __enter__(self) -> "CountingPlans":
        import threading

        from freescale_comm.balancer import LoadBalancer, PlannedSequences

        self.gathered = self.ahead = 0
        self._saved = (LoadBalancer._plan, PlannedSequences.plan_for)
        plan, plan_for = self._saved
        main = threading.get_ident()

        def counted_plan(balancer, *args, **kwargs):
            self.gathered += threading.get_ident() == main
            return plan(balancer, *args, **kwargs)

        def counted_plan_for(sequences, balancer):
            found = plan_for(sequences, balancer)
            self.ahead += found is not None
            return found

        LoadBalancer._plan, PlannedSequences.plan_for = counted_plan, counted_plan_for
        return self

    def __exit__(self, *exc) -> None:
        from freescale_comm.balancer import LoadBalancer, PlannedSequences

        LoadBalancer._plan, PlannedSequences.plan_for = self._saved


def pec_and_balance_match_sparse_dist_with_balance(info, steps: int, collision: float) -> dict:
    """TrainPipelineSparseDist with fc.balance on the tower vs TrainPipelinePEC(balance={"tower":
    cost}): same data (rank 0's histories long), every output and weight equal bit for bit, and
    the balancer moved samples. Counted: TrainPipelineSparseDist's balancer all-gathers lengths in
    every forward, TrainPipelinePEC's never on the main thread (plans made a batch ahead)."""
    from freescale_comm.planner import CostModel

    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    cost = CostModel(quadratic=1.0, linear=0.0, constant=1.0)
    batches = long_histories_on_rank0(make_batches(steps, world, collision, seed=21, batch=6))
    runs = {}
    for name in ("sparse_dist", "pec"):
        dmp, opt = build(pg, "rowwise_adagrad", BalancedModel)
        tower = dmp.module.tower
        if name == "sparse_dist":
            fc.balance(tower, cost, group=pg)
            pipe = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
        else:
            pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, balance={"tower": cost})
        feed = iter([b[rank] for b in batches])
        with CountingPlans() as counted:
            outputs = [pipe.progress(feed).clone() for _ in range(steps)]
        if name == "pec":
            pipe.close()
            assert tower.freescale_balance is None, "close() must take the balance hooks off"
        runs[name] = {"outputs": outputs, "state": _state(dmp, opt), "samples": list(tower.samples),
                      "gathered": counted.gathered, "ahead": counted.ahead}
    ref, pec = runs["sparse_dist"], runs["pec"]
    assert all(torch.equal(a, b) for a, b in zip(ref["outputs"], pec["outputs"])), "outputs differ"
    for k in ref["state"]:
        assert torch.equal(ref["state"][k], pec["state"][k]), f"{k} differs"
    home = [len(b[rank].label) for b in batches]
    return {"computed": pec["samples"], "home": home, "same_as_reference": pec["samples"] == ref["samples"],
            "gathered": {name: run["gathered"] for name, run in runs.items()},
            "ahead": {name: run["ahead"] for name, run in runs.items()}}


def eval_mode_matches_sparse_dist(info, steps: int) -> int:
    """model.eval(): forward only (no gradients move, nothing is updated); outputs equal
    TrainPipelineSparseDist's bit for bit. Returns the steps compared."""
    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(steps, world, 0.5, seed=31)
    outs = {}
    for name in ("sparse_dist", "pec"):
        dmp, opt = build(pg, "rowwise_adagrad")
        dmp.eval()
        before = _state(dmp, opt)
        pipe = TrainPipelineSparseDist(dmp, opt, torch.device("cpu")) if name == "sparse_dist" else \
            fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg)
        feed = iter([b[rank] for b in batches])
        outs[name] = [pipe.progress(feed).clone() for _ in range(steps)]
        after = _state(dmp, opt)
        assert all(torch.equal(before[k], after[k]) for k in before), f"{name}: eval changed the model"
        if name == "pec":
            pipe.close()
    assert all(torch.equal(a, b) for a, b in zip(outs["sparse_dist"], outs["pec"])), "eval outputs differ"
    return len(outs["pec"])


def balance_and_eval(info, steps: int) -> dict:
    return {"balance": pec_and_balance_match_sparse_dist_with_balance(info, steps, 0.5),
            "eval_steps": eval_mode_matches_sparse_dist(info, 4)}


# -- host reads (device syncs on CUDA) -------------------------------------------------------------
EXCHANGE_METHODS = ("announce", "ask", "prepare", "gradients", "fetch_micro", "stream_gradients", "send_deferred",
                    "apply_deferred", "reset")


def exchange_host_reads(info, modes: dict[str, dict], steps: tuple[int, int] = (4, 8)) -> dict:
    """Per mode (pipeline kwargs): host reads of tensor values (see host_reads.py: device syncs were
    the tables and batches on CUDA) per steady-state step, (reads over steps[1] steps - reads over
    steps[0]) / (steps[1] - steps[0]), collision 0.5, 2 ranks: "exchange" inside the exchange's
    rounds; "pipeline" in the rest of the pipeline's own work: routing (and cutting) each batch on
    the worker, the sharded modules' outputs; with what they were, over the longer run. Every path
    with a NumPy fast lane for CPU tensors takes the one a device would (this process only)."""
    from host_reads import counting

    from freescale_comm.pipelines import _host_counts

    pg = dist.group.WORLD
    rank = dist.get_rank()
    batches = make_batches(max(steps), dist.get_world_size(), 0.5, seed=5)
    out = {}
    # the model is of a device: distinct() takes its device path (torch ops, one host read), not the
    # NumPy one CPU tensors get
    _host_counts._distinct_on_host = lambda groups, union: None

    def fresh(kwargs: dict) -> tuple:  # a pipeline on a new model, and fbgemm's host-resident tensors
        dmp, opt = build(pg, "rowwise_adagrad")
        pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, **dict(kwargs))
        return pipe, [t for tbe in pipe._exchange.tbes for t in (getattr(tbe, "iter_cpu", None), tbe.learning_rate_tensor)
                      if t is not None]  # fbgemm keeps these on the host on every device

    for name, kwargs in modes.items():
        totals = {"exchange": [], "pipeline": []}
        for n in steps:
            pipe, host = fresh(kwargs)
            feed = iter([b[rank] for b in batches[:n]])
            with counting(pipe._exchange, EXCHANGE_METHODS, host) as exchange:
                for _ in range(n):
                    pipe.progress(feed)
                totals["exchange"].append(dict(exchange))
            pipe.close()
            pipe, host = fresh(kwargs)
            feed = iter([b[rank] for b in batches[:n]])
            modules = [info.module for info in pipe._catalog.modules]
            with contextlib.ExitStack() as stack:
                # the worker's routing (and cutting) of each batch, the sharded modules' outputs
                sinks = [stack.enter_context(counting(pipe, ("_route",), host))] + \
                    [stack.enter_context(counting(m, ("forward",), host)) for m in modules]
                for _ in range(n):
                    pipe.progress(feed)
                totals["pipeline"].append(dict(sum(sinks, collections.Counter())))
            pipe.close()
        out[name] = {k: {"per_step": (sum(v[1].values()) - sum(v[0].values())) / (steps[1] - steps[0]), "what": v[1]}
                     for k, v in totals.items()}
    return out


def mean_pooling(info, steps: int) -> dict:
    """MEAN pooling, every table's weights all ones: each bag of the EmbeddingBagCollection the
    pipeline trains pools to 1 (0 if empty), per sharding; and TorchRec's own sharded forward's value
    for the same bags (TorchRec 1.8 on CPU divides table- and column-wise bags by their length twice)."""
    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    dmp, opt = build(pg, "sgd", pooling=PoolingType.MEAN)
    with torch.no_grad():
        for _, weight in dmp.module.ebc.named_parameters():  # each table shard (views of its TBE's weights)
            weight.fill_(1.0)
    dmp.eval()  # the weights stay ones
    batches = make_batches(steps, world, 0.5, seed=9)
    torchrec = dmp.module.ebc(batches[0][rank].pooled)
    torchrec = (torchrec.wait() if hasattr(torchrec, "wait") else torchrec).values()
    pooled: list[torch.Tensor] = []
    hook = dmp.module.ebc.register_forward_hook(lambda module, args, out: pooled.append(out.values().detach().clone()))
    pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg)
    feed = iter([b[rank] for b in batches])
    for _ in range(steps):
        pipe.progress(feed)
    pipe.close()
    hook.remove()
    shardings = {"user": "row_wise", "ctx": "table_wise", "geo": "column_wise"}
    out: dict = {"pec": {}, "torchrec": {}}
    for step, values in enumerate(pooled):
        lengths = batches[step][rank].pooled.lengths().view(len(POOLED), -1)
        for f, (feature, rows) in enumerate(zip(POOLED, values.split(DIM, dim=1))):
            want = (lengths[f] > 0).to(rows.dtype).unsqueeze(1).expand_as(rows)
            out["pec"][shardings[feature]] = max(out["pec"].get(shardings[feature], 0.0), float((rows - want).abs().max()))
            if step == 0:
                got = torchrec.split(DIM, dim=1)[f]
                out["torchrec"][shardings[feature]] = float((got - want).abs().max())
    return out


def micro_batches_with_gradient_clipping_are_refused(info) -> list[str]:
    """A fused optimizer that clips gradients: micro-batches would clip each row's summed gradient
    where TrainPipelineSparseDist clips each use (weights ~1 % apart after 6 steps, silently).
    Returns what constructing with micro_batches raised, then that micro_batches=None builds."""
    pg = dist.group.WORLD
    fused = {"optimizer": OPTIMIZERS["sgd"], "learning_rate": 0.1, "gradient_clipping": True, "max_gradient": 0.05}
    dmp, opt = build(pg, "sgd", fused_params=fused)
    try:
        fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), micro_batches=2)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    fc.TrainPipelinePEC(dmp, opt, torch.device("cpu")).close()
    return [refused, "built"]
