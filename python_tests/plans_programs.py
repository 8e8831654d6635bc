"""fc.TrainPipelinePEC against TrainPipelineSparseDist on generic sharding plans / models / data
(rank functions for freescale_comm.testing.spawn; test_pec_plans.py). A spec describes the model:

  {"modules": [{"kind": "ebc" | "ec", "tables": [{"name", "rows", "dim", "features": [...],
                "pooling": "SUM" | "MEAN", "plan": ["tw", rank] | ["rw"] | ["cw", [ranks]]}]}],
   "optimizer": "sgd" | "rowwise_adagrad" | "adagrad", "steps", "batch", "max_len", "seed",
   "id_pool": {feature: [ids]} (optional), "transform": None | "int32" | "offsets" | ...,
   "empty_steps": [steps where every rank's KJTs are empty]}
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.streamable import Pipelineable
from fbgemm_gpu.split_embedding_configs import EmbOptimType

import freescale_comm as fc
from pec_pipeline_programs import _rel, _state

FIELDS = ("a", "b", "c", "d")
OPTIMIZERS = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
              "adagrad": EmbOptimType.EXACT_ADAGRAD}


@dataclass
class GBatch(Pipelineable):
    a: Optional[KeyedJaggedTensor]
    b: Optional[KeyedJaggedTensor]
    c: Optional[KeyedJaggedTensor]
    d: Optional[KeyedJaggedTensor]
    label: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "GBatch":
        return GBatch(*[None if k is None else k.to(device, non_blocking) for k in (self.a, self.b, self.c, self.d)],
                      self.label.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: torch.Stream) -> None:
        for k in (self.a, self.b, self.c, self.d):
            if k is not None:
                k.record_stream(stream)

    def pin_memory(self) -> "GBatch":
        return self


@torch.fx.wrap
def _seq_feature(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Per sample: sum over its history of values * (1 + 0.25 * position in the feature), so each
    entry's gradient differs (a wrong row/position assignment shows)."""
    n = values.shape[0]
    # (position in the sample's own history: the same whole or cut into micro-batches)
    offsets = torch.cumsum(lengths.to(torch.int64), 0) - lengths.to(torch.int64)
    within = torch.arange(n) - torch.repeat_interleave(offsets, lengths.to(torch.int64))
    scale = 1.0 + 0.25 * within.to(values.dtype)
    segment = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.to(torch.int64))
    return torch.zeros(lengths.numel(), values.shape[1], dtype=values.dtype).index_add_(
        0, segment, values * scale.unsqueeze(1))


@torch.fx.wrap
def _seq_items(out: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """An EmbeddingCollection's output taken in its own key order (as a model iterating it does)."""
    feats = [_seq_feature(jt.values(), jt.lengths()) for _, jt in out.items()]
    return torch.cat(feats, dim=1), torch.cat([jt.values().detach().reshape(-1) for _, jt in out.items()])


@torch.fx.wrap
def _flat(parts: list) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in parts])


def _features(mspec: dict) -> list[str]:
    return [f for t in mspec["tables"] for f in t["features"]]


class GenModel(nn.Module):
    def __init__(self, device: torch.device, spec: dict) -> None:
        super().__init__()
        self.kinds = []
        self.seq_features = []
        width = 0
        for i, m in enumerate(spec["modules"]):
            if m["kind"] == "ebc":
                mod = EmbeddingBagCollection(tables=[
                    EmbeddingBagConfig(name=t["name"], embedding_dim=t["dim"], num_embeddings=t["rows"],
                                       feature_names=list(t["features"]),
                                       pooling=PoolingType[t.get("pooling", "SUM")]) for t in m["tables"]],
                    device=device)
                width += sum(t["dim"] * len(t["features"]) for t in m["tables"])
                self.seq_features.append([])
            else:
                mod = EmbeddingCollection(tables=[
                    EmbeddingConfig(name=t["name"], embedding_dim=t["dim"], num_embeddings=t["rows"],
                                    feature_names=list(t["features"])) for t in m["tables"]], device=device)
                width += sum(t["dim"] * len(t["features"]) for t in m["tables"])
                self.seq_features.append(_features(m))
            setattr(self, f"m{i}", mod)
            self.kinds.append(m["kind"])
        self.head = nn.Linear(width, 1)
        self.iterate = spec.get("ec_iterate", False)
        self.cast = spec.get("cast", False)  # embeddings to float32 first (for fp16 output_dtype)
        self.inputs = spec.get("inputs", list(range(len(spec["modules"]))))

    def forward(self, batch: GBatch) -> tuple[torch.Tensor, torch.Tensor]:
        feats, outs = [], []
        for i, kind in enumerate(self.kinds):
            kjt = getattr(batch, FIELDS[self.inputs[i]])
            out = getattr(self, f"m{i}")(kjt)
            if kind == "ebc":
                v = out.values().float() if self.cast else out.values()
                feats.append(v)
                outs.append(v.detach())
            elif self.iterate:
                feat, flat = _seq_items(out)
                feats.append(feat)
                outs.append(flat)
            else:
                for f in self.seq_features[i]:
                    jt = out[f]
                    values = jt.values().float() if self.cast else jt.values()
                    feats.append(_seq_feature(values, jt.lengths()))
                    outs.append(values.detach())
        logits = self.head(torch.cat(feats, dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum")
        return loss, _flat([logits.detach()] + outs)


def _gen(plan: list, world: int):
    kind = plan[0]
    if kind == "rw":
        return row_wise(compute_kernel="fused")
    if kind == "cw":
        return column_wise(ranks=[r % world for r in plan[1]], compute_kernel="fused")
    if kind == "cwsz":  # uneven column shards: columns per rank
        return column_wise(size_per_rank=plan[1], compute_kernel="fused")
    return table_wise(rank=plan[1] % world, compute_kernel="fused")


def build(pg: dist.ProcessGroup, spec: dict) -> tuple:
    world = dist.get_world_size(pg)
    torch.manual_seed(spec.get("init_seed", 0))
    opt_name = spec.get("optimizer", "sgd")
    fused = {"optimizer": OPTIMIZERS[opt_name], "learning_rate": 0.1 if opt_name == "sgd" else 0.05}
    fused.update(spec.get("fused_extra", {}))
    qcomm = None
    if spec.get("qcomm"):  # quantized embedding comms (forward, backward precision)
        from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
        fwd, bwd = spec["qcomm"]
        qcomm = get_qcomm_codecs_registry(QCommsConfig(forward_precision=CommType[fwd], backward_precision=CommType[bwd]))
    sharders = (EmbeddingBagCollectionSharder(fused_params=fused, qcomm_codecs_registry=qcomm),
                EmbeddingCollectionSharder(fused_params=fused, qcomm_codecs_registry=qcomm,
                                           use_index_dedup=spec.get("use_index_dedup", False)))
    model = GenModel(torch.device("meta"), spec)
    plans = {}
    for i, m in enumerate(spec["modules"]):
        sharder = sharders[0] if m["kind"] == "ebc" else sharders[1]
        plans[f"m{i}"] = construct_module_sharding_plan(
            getattr(model, f"m{i}"), {t["name"]: _gen(t["plan"], world) for t in m["tables"]}, sharder,
            local_size=world, world_size=world, device_type="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=ShardingPlan(plans), sharders=list(sharders))
    if spec.get("weights") == "row_index":  # every row's entries = its row index (known-value tables)
        with torch.no_grad():
            for name, value in dmp.state_dict().items():
                for shard in getattr(value, "local_shards", lambda: [])():
                    row0 = shard.metadata.shard_offsets[0]
                    rows = shard.tensor.shape[0]
                    shard.tensor.copy_(torch.arange(row0, row0 + rows, dtype=shard.tensor.dtype)
                                       .unsqueeze(1).expand_as(shard.tensor))
    if spec.get("weights") == "row_col":  # entry (row, col) = (row % 17) / 16 + col / 64 (global row and column)
        with torch.no_grad():
            for name, value in dmp.state_dict().items():
                for shard in getattr(value, "local_shards", lambda: [])():
                    row0, col0 = shard.metadata.shard_offsets
                    rows, cols = shard.tensor.shape
                    r = torch.arange(row0, row0 + rows, dtype=torch.float32) % 17 / 16
                    c = torch.arange(col0, col0 + cols, dtype=torch.float32) / 64
                    shard.tensor.copy_(r.unsqueeze(1) + c.unsqueeze(0))
            head = dmp.module.head
            for param in (head.weight, head.bias):  # (DDP-wrapped: the same parameters)
                param.copy_(torch.linspace(-0.5, 0.5, param.numel()).view_as(param))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.1))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def _kjt(keys: list[str], values: list[torch.Tensor], lengths: list[torch.Tensor], transform: Optional[str]):
    v = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
    ln = torch.cat(lengths) if lengths else torch.empty(0, dtype=torch.int64)
    if transform == "int32":
        return KeyedJaggedTensor(keys=keys, values=v.to(torch.int32), lengths=ln.to(torch.int32))
    if transform == "int32_values":
        return KeyedJaggedTensor(keys=keys, values=v.to(torch.int32), lengths=ln)
    if transform == "offsets":
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), ln.cumsum(0)])
        return KeyedJaggedTensor(keys=keys, values=v, offsets=offsets)
    if transform == "offsets_int32":
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), ln.cumsum(0)]).to(torch.int32)
        return KeyedJaggedTensor(keys=keys, values=v.to(torch.int32), offsets=offsets)
    if transform == "padded":  # values with trailing entries no length covers (a reused buffer)
        return KeyedJaggedTensor(keys=keys, values=torch.cat([v, torch.zeros(5, dtype=v.dtype)]), lengths=ln)
    if transform == "noncontig":
        v2 = torch.stack([v, torch.zeros_like(v)], dim=1)[:, 0]  # a strided view
        l2 = torch.stack([ln, torch.zeros_like(ln)], dim=1)[:, 0]
        assert not v2.is_contiguous() or v2.numel() <= 1
        return KeyedJaggedTensor(keys=keys, values=v2, lengths=l2)
    return KeyedJaggedTensor(keys=keys, values=v, lengths=ln)


def make_batches(spec: dict, world: int) -> list[list[GBatch]]:
    gen = torch.Generator().manual_seed(spec.get("seed", 0))
    steps, batch, max_len = spec.get("steps", 4), spec.get("batch", 3), spec.get("max_len", 3)
    pools = spec.get("id_pool", {})
    empty_steps = set(spec.get("empty_steps", []))
    transform = spec.get("transform")
    out = []
    for step in range(steps):
        row = []
        for r in range(world):
            sizes = spec.get("sizes", {}).get(f"{step},{r}", batch)
            kjts = []
            inputs = spec.get("inputs", list(range(len(spec["modules"]))))
            for field in range(max(inputs) + 1):
                keys, values, lengths = [], [], []
                tables = [t for i, m in enumerate(spec["modules"]) if inputs[i] == field for t in m["tables"]]
                rows_of = {}
                for t in tables:
                    for f in t["features"]:
                        rows_of[f] = min(rows_of.get(f, t["rows"]), t["rows"])
                for f, rows in rows_of.items():
                    ln = torch.randint(0, max_len + 1, (sizes,), generator=gen)
                    if step in empty_steps:
                        ln.zero_()
                    n = int(ln.sum())
                    if f in pools:
                        pool = torch.tensor(pools[f], dtype=torch.int64)
                        ids = pool[torch.randint(0, pool.numel(), (n,), generator=gen)]
                    else:
                        ids = torch.randint(0, rows, (n,), generator=gen)
                    keys.append(f)
                    values.append(ids)
                    lengths.append(ln)
                if spec.get("kjt_order") == "reversed":
                    keys, values, lengths = keys[::-1], values[::-1], lengths[::-1]
                if spec.get("extra_key"):  # a feature no table reads
                    ln = torch.randint(0, max_len + 1, (sizes,), generator=gen)
                    keys.insert(0, "zz_unused")
                    values.insert(0, torch.randint(0, 1000, (int(ln.sum()),), generator=gen))
                    lengths.insert(0, ln)
                kjts.append(_kjt(keys, values, lengths, transform))
            kjts += [None] * (len(FIELDS) - len(kjts))
            row.append(GBatch(*kjts, torch.randint(0, 2, (sizes,), generator=gen).float()))
        out.append(row)
    return out


def train(pg: dist.ProcessGroup, pipeline: str, spec: dict, batches: list[list[GBatch]], **kwargs) -> dict:
    rank = dist.get_rank(pg)
    dmp, opt = build(pg, spec)
    if spec.get("eval"):
        dmp.eval()
    if pipeline == "sparse_dist":
        pipe = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
    else:
        pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, **kwargs)
    outputs = []
    feed = iter([b[rank] for b in batches])
    while True:
        try:
            out = pipe.progress(feed)
        except StopIteration:
            break
        # (micro-batches merge a flat output into a list: not compared, the state is)
        outputs.append(out.clone() if isinstance(out, torch.Tensor) else torch.zeros(0))
    state = _state(dmp, opt)
    if hasattr(pipe, "close"):
        pipe.close()
    order = {i: list(getattr(dmp.module, f"m{i}")._embedding_names) for i, m in enumerate(spec["modules"])
             if m["kind"] == "ebc"}
    return {"outputs": outputs, "state": state, "order": order}


def compare(info, spec: dict, pec_kwargs: Optional[dict] = None, ref_spec: Optional[dict] = None) -> dict:
    """TrainPipelineSparseDist (on ref_spec's batches if given: e.g. the same data as plain int64
    lengths) vs TrainPipelinePEC on spec's batches. Returns the worst differences or each side's error."""
    pg = dist.group.WORLD
    world = dist.get_world_size()
    report: dict[str, Any] = {}
    runs = {}
    for name, s in (("sparse_dist", ref_spec or spec), ("pec", spec)):
        try:
            runs[name] = train(pg, name, s, make_batches(s, world), **(pec_kwargs or {} if name == "pec" else {}))
        except Exception as e:  # noqa: BLE001
            report[f"{name}_error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
            return report
    ref, pec = runs["sparse_dist"], runs["pec"]
    report["steps"] = (len(ref["outputs"]), len(pec["outputs"]))
    report["outputs"] = max((_rel(a, b) for a, b in zip(ref["outputs"], pec["outputs"])), default=0.0)
    report["output_steps"] = [_rel(a, b) for a, b in zip(ref["outputs"], pec["outputs"])]
    report["keys_equal"] = sorted(ref["state"]) == sorted(pec["state"])
    report["state"] = {k: _rel(ref["state"][k], pec["state"][k]) for k in ref["state"] if k in pec["state"]}
    report["worst_state"] = max(report["state"].values(), default=0.0)
    return report


def pec_only(info, spec: dict, pec_kwargs: Optional[dict] = None) -> dict:
    """Trains with TrainPipelinePEC only; returns outputs and state (or the error)."""
    pg = dist.group.WORLD
    world = dist.get_world_size()
    try:
        run = train(pg, "pec", spec, make_batches(spec, world), **(pec_kwargs or {}))
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    return {"steps": len(run["outputs"]), "finite": all(bool(torch.isfinite(o).all()) for o in run["outputs"])}


def construct_error(info, spec: dict) -> str:
    """The error TrainPipelinePEC's constructor raises for spec's model ("" if none)."""
    pg = dist.group.WORLD
    dmp, opt = build(pg, spec)
    try:
        pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    pipe.close()
    return ""


def mean_by_hand(info, spec: dict) -> dict:
    """Eval mode, tables filled with their row index: each EBC bag's pooled value must be the
    mean (MEAN) or sum (SUM) of its ids; returns the worst |pec - expected| per table."""
    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = dict(spec, eval=True, weights="row_index")
    batches = make_batches(spec, world)
    try:
        run = train(pg, "pec", spec, batches)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    worst: dict[str, float] = {}
    for step, out in enumerate(run["outputs"]):
        b = batches[step][rank]
        n = b.label.numel()
        at = n  # after the logits
        for i, m in enumerate(spec["modules"]):
            kjt = getattr(b, FIELDS[i])
            if m["kind"] != "ebc":
                at += sum(t["dim"] * int(kjt[f].lengths().sum()) for t in m["tables"] for f in t["features"])
                continue
            width = sum(t["dim"] * len(t["features"]) for t in m["tables"])
            pooled = out[at:at + n * width].view(n, width)
            at += n * width
            col = 0
            table_of = {f: t for t in m["tables"] for f in t["features"]}
            for f in run["order"][i]:  # the KeyedTensor's keys: the sharded module's embedding names
                t = table_of[f]
                jt = kjt[f]
                lens = jt.lengths().to(torch.int64)
                seg = torch.repeat_interleave(torch.arange(n), lens)
                sums = torch.zeros(n, dtype=torch.float64).index_add_(0, seg, jt.values().double())
                want = sums / lens.clamp(min=1) if t.get("pooling", "SUM") == "MEAN" else sums
                got = pooled[:, col:col + t["dim"]].double()
                worst[f"{t['name']}:{f}"] = max(worst.get(f"{t['name']}:{f}", 0.0),
                                               float((got - want.unsqueeze(1)).abs().max()) if n else 0.0)
                col += t["dim"]
    return worst


def ref_only(info, spec: dict) -> dict:
    """Trains with TrainPipelineSparseDist only; returns the steps run (or the error)."""
    pg = dist.group.WORLD
    try:
        run = train(pg, "sparse_dist", spec, make_batches(spec, dist.get_world_size()))
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}
    return {"steps": len(run["outputs"]), "finite": all(bool(torch.isfinite(o).all()) for o in run["outputs"])}


class FPModel(nn.Module):
    """A FeatureProcessedEmbeddingBagCollection (position-weighted EBC), as TorchRec's DLRM examples use."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
        from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

        ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t_fp", embedding_dim=4, num_embeddings=10,
                                                                feature_names=["f"])], is_weighted=True, device=device)
        self.fp = FeatureProcessedEmbeddingBagCollection(ebc, PositionWeightedModuleCollection({"f": 3}, device=device))
        self.head = nn.Linear(4, 1, device=device)

    def forward(self, batch: GBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.fp(batch.a).values()).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum"), logits.detach()


def fp_ebc_refusal(info) -> str:
    """The error TrainPipelinePEC's constructor raises for a sharded FeatureProcessedEmbeddingBagCollection."""
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

    pg = dist.group.WORLD
    world = dist.get_world_size()
    torch.manual_seed(0)
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    sharder = FeatureProcessedEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder(fused_params=fused))
    model = FPModel(torch.device("meta"))
    plan = construct_module_sharding_plan(model.fp, {"t_fp": table_wise(rank=0, compute_kernel="fused")}, sharder,
                                          local_size=world, world_size=world, device_type="cpu")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=ShardingPlan({"fp": plan}), sharders=[sharder])
    try:
        fc.TrainPipelinePEC(dmp, torch.optim.SGD(dmp.parameters(), lr=0.1), torch.device("cpu"), group=pg).close()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


def many(info, calls: list[tuple[str, tuple]]) -> list:
    """Each (function of this module, its arguments after info), in one spawn: their results."""
    return [globals()[name](info, *args) for name, args in calls]
