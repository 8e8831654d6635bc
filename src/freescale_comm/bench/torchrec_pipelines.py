"""freescale-bench torchrec-pec: one DMP model (EmbeddingBagCollection + EmbeddingCollection, row-,
table- and column-wise, fused row-wise Adagrad, an MLP head) trained on N CPU ranks by TorchRec's
TrainPipelineSparseDist (the baseline), TrainPipelineSemiSync (stale by one batch: a reference, not
a competitor), TorchRec's TrainPipelinePEC where the installed TorchRec has it, and
fc.TrainPipelinePEC (alone, and with fc.balance on the HSTU-like tower: pec_balance), at several collision rates (that share of every batch's ids was read by the
batch before, on any rank).

Every pipeline trains `rounds` times per rate, in a rotated order. Measured per step on every rank,
then: step_ms = the median over rounds of the slowest rank's mean step (wall, between returns of
progress(): the throughput); spread = how far the rounds of one pipeline lie apart (the machine's
noise, against which a difference between pipelines is read); cpu_ms = CPU time a rank's process
(every thread) spends per step, mean over ranks: what ranks sharing a machine's cores compete for
(with more ranks than cores, step time follows it more than any overlap); exposed_comm_ms = main-thread time blocked on embedding communication, mean over ranks:
TorchRec's pipelines: Python-level c10d Work.wait() calls (the id, embedding and gradient
AllToAlls; DDP's dense all-reduce waits in C++ and is not counted), split by phase: ids (outside
forward and backward), embeddings (in forward), gradients (in backward). fc.TrainPipelinePEC, by
the same rule (blocked, not working): its waits on the worker that posts every message and on the
messages of the rounds it runs itself: the prefetch (ids, flags, NOL rows) and the rows that waited
for the last update (OL rows; with micro-batches, each micro-batch's as it starts): "embeddings";
the OL gradients' round trip: "gradients". update and rounds (ours only): the main thread's own
work on the critical path, compute rather than a wait, as TorchRec's lookups, the unpacking of its
AllToAlls' outputs and its fused update (inside backward) are uncounted: the fused update of the
gradients that go first (update), and in the rounds it runs, selecting gradients, looking rows up
and placing them (rounds; before 2026-11-26 this was counted as exposed, a stricter ruler for ours
than TorchRec's, which at 512 samples per rank read 2-4x its figure). ids_sent: embedding rows a
rank asks for per step (ours only): every id of the batch, or with micro-batches each distinct
row of the batch once (packed with the micro-batches reading it); rows_moved: the rows that come to it (with micro-batches a row several of them read
moves once, and its gradient goes back once).
bubble_ms = step_ms
minus the mean rank's time not blocked on embedding communication (idle ranks and exposed comm).
Each rank stands for one device: its threads run on its own core (bench/placement.py: pinned, the
core held while the rank waits, malloc keeping freed memory), round robin when there are more ranks
than cores, and then the CLI says so above the table (`--no-pin`: unpinned). Timings on a busy
machine say little, and none come from a GPU."""

from __future__ import annotations

import contextlib
import gc
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.streamable import Pipelineable

from freescale_comm.bench.placement import RankPlacement, device_like_env, place_ranks

PIPELINES = ("sparse_dist", "semi_sync", "torchrec_pec", "pec", "pec_balance")
# NestPipe's modes (all fc.TrainPipelinePEC): dbp = prefetch="dual_buffer"; fwpM = M frozen-window
# micro-batches, clustered, rows after each update (prefetch="ids"; fwp1: the whole batch the same
# way, the baseline of the micro-batched ones); fwpM_random = the same on uniformly random
# micro-batches; nestpipe = 4 clustered micro-batches, PEC's split of the dual buffer (prefetch="pec":
# the rows DBP would fetch early and then refresh are fetched once, after the update) and fc.balance
NESTPIPE = ("dbp", "fwp1", "fwp2", "fwp4", "fwp8", "fwp2_random", "fwp4_random", "fwp8_random", "nestpipe")
ALL_PIPELINES = PIPELINES + NESTPIPE


@dataclass(frozen=True)
class PipelineBenchConfig:
    ranks: int = 4
    rates: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    steps: int = 8  # measured, after `warmup`
    rounds: int = 3  # every pipeline trains `rounds` times per rate, in a rotated order
    warmup: int = 3
    samples: int = 64  # per rank and step
    rows: int = 200_000  # per table: fresh ids stay fresh at collision 0
    dim: int = 64
    history: int = 24  # mean ids per sequence feature and sample (pooled features: history / 4)
    hidden: int = 512  # MLP width
    seed: int = 0
    pipelines: tuple[str, ...] = PIPELINES
    # each rank's threads on its own core (round robin past the cores), held while it waits, and malloc
    # keeping freed memory: one device per rank, as the e2e demo (bench/placement.py)
    pin_cores: bool = True

    def check(self) -> None:
        if self.ranks < 2 or self.steps < 1 or self.warmup < 0 or self.samples < 1 or self.rounds < 1:
            raise ValueError("need ranks >= 2, steps >= 1, warmup >= 0, samples >= 1, rounds >= 1")
        if not self.rates or any(not 0 <= r <= 1 for r in self.rates):
            raise ValueError(f"rates must be collision rates in [0, 1], got {list(self.rates)}")
        unknown = set(self.pipelines) - set(ALL_PIPELINES)
        if unknown:
            raise ValueError(f"unknown pipelines {sorted(unknown)}; choose from {ALL_PIPELINES}")


# -- where the main thread blocks ------------------------------------------------------------------
class _Blocked:
    """Main-thread time in Python-level c10d Work.wait(), by phase."""

    def __init__(self) -> None:
        self.phase = "ids"
        self.ms = {"ids": 0.0, "embeddings": 0.0, "gradients": 0.0}
        self._main = threading.get_ident()

    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        saved, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = saved


@contextmanager
def _counting_waits(blocked: _Blocked) -> Iterator[None]:
    work = torch._C._distributed_c10d.Work
    original = work.wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != blocked._main:
            return original(self, *args, **kwargs)
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            blocked.ms[blocked.phase] += (time.perf_counter() - start) * 1e3

    work.wait = wait
    try:
        yield
    finally:
        work.wait = original


def _phased(pipe: Any, blocked: _Blocked) -> None:
    """Wraps a TorchRec pipeline's forward and backward so waits inside them get their phase."""
    model_fwd, backward = pipe._model_fwd, pipe._backward

    def fwd(*a: Any, **k: Any) -> Any:
        with blocked.in_phase("embeddings"):
            return model_fwd(*a, **k)

    def bwd(*a: Any, **k: Any) -> Any:
        with blocked.in_phase("gradients"):
            return backward(*a, **k)

    pipe._model_fwd, pipe._backward = fwd, bwd


# -- the model and its data ------------------------------------------------------------------------
POOLED = {"user": "row_wise", "ctx": "table_wise"}  # EmbeddingBagCollection feature -> sharding
SEQUENCE = {"items": "row_wise", "cats": "column_wise"}  # EmbeddingCollection feature -> sharding


class Batch(Pipelineable):
    def __init__(self, pooled: KeyedJaggedTensor, sequence: KeyedJaggedTensor, label: torch.Tensor) -> None:
        self.pooled, self.sequence, self.label = pooled, sequence, label

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(self.pooled.to(device, non_blocking), self.sequence.to(device, non_blocking),
                     self.label.to(device, non_blocking=non_blocking))

    def record_stream(self, stream: Any) -> None:
        pass

    def pin_memory(self) -> "Batch":
        return self


class Tower(nn.Module):
    """HSTU-like work per user history, ~L² per sample: causal self-attention over the summed item
    and category embeddings of each history, then its mean. Takes the EmbeddingCollection's output
    first (what fc.balance moves); returns one row per sample."""

    def __init__(self, device: torch.device, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, device=device)

    def forward(self, sequences: dict) -> torch.Tensor:
        items, cats = sequences["items"], sequences["cats"]
        x = self.proj(items.values() + cats.values())  # both features share each history's length
        outs = []
        # empty histories and empty (micro-)batches still reach proj, with zero gradients: DDP's static
        # graph needs every rank to use the same parameters in every backward
        for rows in torch.split(x, items.lengths().tolist()):
            if rows.shape[0] == 0:
                outs.append(rows.sum(0))
                continue
            scores = rows @ rows.T / rows.shape[1] ** 0.5
            mask = torch.ones_like(scores, dtype=torch.bool).triu(1)
            outs.append((scores.masked_fill(mask, float("-inf")).softmax(-1) @ rows).mean(0))
        return torch.stack(outs) if outs else x[:0]


class Model(nn.Module):
    """Pooled features and the tower's per-history rows into an MLP; forward returns (loss, logits)."""

    def __init__(self, device: torch.device, rows: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name=f"t_{f}", embedding_dim=dim, num_embeddings=rows, feature_names=[f]) for f in POOLED], device=device)
        self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
            name=f"t_{f}", embedding_dim=dim, num_embeddings=rows, feature_names=[f]) for f in SEQUENCE], device=device)
        self.tower = Tower(device, dim)
        self.mlp = nn.Sequential(nn.Linear(dim * (len(POOLED) + 1), hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.ebc(batch.pooled)
        user = self.tower(self.ec(batch.sequence))
        logits = self.mlp(torch.cat([p.values(), user], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum")
        return loss, logits.detach()


def make_batches(cfg: PipelineBenchConfig, world: int, rank: int, rate: float) -> list[Batch]:
    """This rank's batches; a `rate` share of every feature's ids was read by the batch before (any
    rank), the rest were not."""
    pooled, sequence = POOLED, SEQUENCE
    gen = torch.Generator().manual_seed(cfg.seed)
    previous: dict[str, torch.Tensor] = {}
    batches = []
    for _ in range(cfg.steps + cfg.warmup):
        lengths, values = {}, {}
        # histories: heavy-tailed (log-normal around `history`, capped at 8x), shared by the sequence
        # features of a sample; pooled features: uniform around history / 4
        history = (cfg.history * torch.exp(torch.randn(world, cfg.samples, generator=gen) - 0.5)).long()
        history = history.clamp(max=8 * cfg.history)
        for f in list(pooled) + list(sequence):
            if f in sequence:
                lengths[f] = history
            else:
                mean = max(1, cfg.history // 4)
                lengths[f] = torch.randint(0, 2 * mean + 1, (world, cfg.samples), generator=gen)
            n = int(lengths[f].sum())
            fresh = torch.randint(0, cfg.rows, (n,), generator=gen)
            prev = previous.get(f)
            if prev is not None and prev.numel():
                taken = torch.isin(fresh, prev)  # fresh ids must be new: redraw the few that are not
                for _ in range(50):
                    if not bool(taken.any()):
                        break
                    fresh[taken] = torch.randint(0, cfg.rows, (int(taken.sum()),), generator=gen)
                    taken = torch.isin(fresh, prev)
                reuse = torch.rand(n, generator=gen) < rate
                fresh = torch.where(reuse, prev[torch.randint(0, prev.numel(), (n,), generator=gen)], fresh)
            values[f] = fresh
        previous = values

        def kjt(features: dict) -> Any:
            vals, lens = [], []
            for f in features:
                start = int(lengths[f][:rank].sum())
                vals.append(values[f][start:start + int(lengths[f][rank].sum())])
                lens.append(lengths[f][rank])
            return KeyedJaggedTensor(keys=list(features), values=torch.cat(vals), lengths=torch.cat(lens))

        batches.append(Batch(kjt(pooled), kjt(sequence), torch.randint(0, 2, (cfg.samples,), generator=gen).float()))
    return batches


def _build(cfg: PipelineBenchConfig, pg: Any) -> tuple[Any, Any]:
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan, row_wise,
                                                    table_wise)
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    pooled, sequence = POOLED, SEQUENCE
    world = dist.get_world_size(pg)
    torch.manual_seed(cfg.seed)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    sharders = (EmbeddingBagCollectionSharder(fused_params=fused), EmbeddingCollectionSharder(fused_params=fused))
    spec = {"row_wise": lambda i: row_wise(compute_kernel="fused"),
            "table_wise": lambda i: table_wise(rank=i % world, compute_kernel="fused"),
            "column_wise": lambda i: column_wise(ranks=[i % world, (i + 1) % world], compute_kernel="fused")}
    model = Model(torch.device("meta"), cfg.rows, cfg.dim, cfg.hidden)
    ebc = construct_module_sharding_plan(model.ebc, {f"t_{f}": spec[k](i) for i, (f, k) in enumerate(pooled.items())},
                                         sharders[0], local_size=world, world_size=world, device_type="cpu")
    ec = construct_module_sharding_plan(model.ec, {f"t_{f}": spec[k](i + 1) for i, (f, k) in enumerate(sequence.items())},
                                        sharders[1], local_size=world, world_size=world, device_type="cpu")
    # the dense part's DDP without static_graph (TorchRec's default is True), for every pipeline alike:
    # micro-batches before the last may then skip its all-reduce (no_sync is broken with static_graph)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=ShardingPlan({"ebc": ebc, "ec": ec}), sharders=list(sharders),
                                   data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=False))
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.01))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def torchrec_pec_class() -> Optional[type]:
    """TorchRec's own TrainPipelinePEC, None where the installed TorchRec has none. TorchRec 1.9
    defines it in train_pipeline.pec_train_pipeline and exports it from neither the package nor
    train_pipelines."""
    import importlib

    for module in ("torchrec.distributed.train_pipeline", "torchrec.distributed.train_pipeline.train_pipelines",
                   "torchrec.distributed.train_pipeline.pec_train_pipeline"):
        try:
            cls = getattr(importlib.import_module(module), "TrainPipelinePEC", None)
        except ImportError:
            continue
        if cls is not None:
            return cls
    return None


def _pipeline(name: str, dmp: Any, opt: Any, pg: Any) -> Optional[Any]:
    import torchrec.distributed.train_pipeline as tp
    from torchrec.distributed.train_pipeline import train_pipelines

    device = torch.device("cpu")
    if name == "sparse_dist":
        return tp.TrainPipelineSparseDist(dmp, opt, device)
    if name == "semi_sync":
        return train_pipelines.TrainPipelineSemiSync(dmp, opt, device, start_batch=0)
    if name == "torchrec_pec":
        cls = torchrec_pec_class()
        return None if cls is None else cls(dmp, opt, device)
    import freescale_comm as fc
    from freescale_comm.planner import CostModel

    cost = CostModel(quadratic=1.0, linear=8.0, constant=16.0)  # the tower's: attention ~ L², plus per-row work
    if name == "pec_balance":
        return fc.TrainPipelinePEC(dmp, opt, device, group=pg, balance={"tower": cost})
    if name == "dbp":
        return fc.TrainPipelinePEC(dmp, opt, device, group=pg, prefetch="dual_buffer")
    if name == "nestpipe":
        return fc.TrainPipelinePEC(dmp, opt, device, group=pg, micro_batches=4, balance={"tower": cost})
    if name.startswith("fwp"):
        return fc.TrainPipelinePEC(dmp, opt, device, group=pg, prefetch="ids",
                                   micro_batches=int(name[3:].split("_")[0]))
    return fc.TrainPipelinePEC(dmp, opt, device, group=pg)


@contextmanager
def _random_micro_batches(seed: int) -> Iterator[None]:
    """The fwpM_random baselines: every sample to a uniformly random micro-batch (seeded, so every
    pipeline of a round sees the same split), in place of the key-centric clustering."""
    from freescale_comm.pipelines import _micro_batches

    gen = torch.Generator().manual_seed(seed)
    clustered = _micro_batches.cluster

    def random_split(catalog: Any, inputs: dict, micro_batches: int) -> list[torch.Tensor]:
        where = torch.randint(0, micro_batches, (_micro_batches.batch_size(inputs),), generator=gen)
        return [torch.nonzero(where == m).squeeze(1) for m in range(micro_batches)]

    _micro_batches.cluster = random_split
    try:
        yield
    finally:
        _micro_batches.cluster = clustered


def _train(cfg: PipelineBenchConfig, name: str, rate: float, pg: Any, rank: int, world: int) -> dict[str, Any]:
    batches = make_batches(cfg, world, rank, rate)
    dmp, opt = _build(cfg, pg)
    try:
        pipe = _pipeline(name, dmp, opt, pg)
    except Exception as e:  # noqa: BLE001 - reported as the row's note
        return {"error": f"{type(e).__name__}: {e}"}
    if pipe is None:
        return {"error": "not in the installed TorchRec"}
    blocked = _Blocked()
    ours = hasattr(pipe, "exposed_ms")
    if not ours:
        _phased(pipe, blocked)
    feed = iter(batches)
    steps, cpu, exposed = [], [], []
    split = _random_micro_batches(cfg.seed + rank) if name.endswith("_random") else contextlib.nullcontext()
    try:
        with _counting_waits(blocked), split:
            last, last_cpu = time.perf_counter(), time.process_time()
            for i in range(cfg.warmup + cfg.steps):
                before = dict(blocked.ms)
                pipe.progress(feed)
                now, now_cpu = time.perf_counter(), time.process_time()
                if i >= cfg.warmup:
                    steps.append((now - last) * 1e3)
                    cpu.append((now_cpu - last_cpu) * 1e3)
                    if ours:
                        exposed.append(dict(pipe.exposed_by_phase[-1]))
                    else:
                        exposed.append({k: blocked.ms[k] - before[k] for k in blocked.ms})
                last, last_cpu = now, now_cpu
    except Exception as e:  # noqa: BLE001
        # (TorchRec 1.8 and 1.9's TrainPipelineSemiSync needs CUDA: it records tensors on its lookup stream)
        where = "" if ours else f"TorchRec's {type(pipe).__name__} on CPU: "
        return {"error": f"{where}{type(e).__name__}: {str(e)[:200]}"}
    finally:
        if hasattr(pipe, "close"):
            pipe.close()
    # rows asked per measured step (ours: each micro-batch's distinct rows; whole batches: every id)
    rows_asked = pipe.rows_asked[cfg.warmup:] if ours else []
    rows_moved = pipe.rows_fetched[cfg.warmup:] if ours else []
    updates = pipe.update_ms[cfg.warmup:] if ours else []
    rounds = pipe.round_ms[cfg.warmup:] if ours else []
    return {"steps": steps, "cpu": cpu, "exposed": exposed, "rows_asked": rows_asked, "rows_moved": rows_moved,
            "updates": updates, "rounds": rounds}


def rank_program(info: Any, cfg: PipelineBenchConfig, cores: Optional[tuple[int, ...]]) -> dict[str, Any]:
    """One rank's trainings ("results") and the cores its threads could run on, read at its end."""
    from freescale_comm.bench.e2e import measured_rank
    from freescale_comm.bench.placement import thread_cores

    with measured_rank(info, cores):  # one compute thread; pinned and held where `cores` says
        results = _measure(cfg)
        return {"results": results, "cores": thread_cores()}


def _measure(cfg: PipelineBenchConfig) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from freescale_comm.bench.e2e import rotated

    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    # Rounds, each pipeline in turn in a rotated order: a machine whose speed drifts (a shared VM, a
    # build beside it) slows every pipeline alike instead of whichever ran during the slow minute.
    for rnd in range(cfg.rounds):
        for i, rate in enumerate(cfg.rates):
            for name in rotated(list(cfg.pipelines), rnd + i):
                dist.barrier()
                gc.collect()
                results.append({"pipeline": name, "collision_rate": rate, "round": rnd,
                                **_train(cfg, name, rate, pg, rank, world)})
    return results


@dataclass(frozen=True)
class PipelineBenchResult:
    rows: list[dict[str, Any]]  # one per (pipeline, rate): see run()
    placement: RankPlacement  # rank -> core (pinned there if config.pin_cores)
    rank_cores: list[list[int]]  # [rank]: the cores its threads could run on, read at its end


def run(cfg: PipelineBenchConfig, timeout_s: float = 1800.0) -> PipelineBenchResult:
    """Spawns cfg.ranks gloo ranks, placed as cfg.pin_cores says, trains every pipeline at every
    rate cfg.rounds times; one row per (pipeline, rate). step_ms: the median over rounds of the
    slowest rank's mean step; round_spread: (slowest - fastest round) / step_ms, how much the machine
    moved the same measurement; the exposed and bubble figures are means over rounds, steps and ranks."""
    from freescale_comm.testing import spawn

    cfg.check()
    placement = place_ranks(cfg.ranks)
    ran = spawn(rank_program, cfg.ranks, cfg, placement.cores if cfg.pin_cores else None, backend="gloo",
                timeout_s=timeout_s, env=device_like_env() if cfg.pin_cores else {})
    per_rank = [r["results"] for r in ran]
    groups: dict[tuple[str, float], list[list[dict[str, Any]]]] = {}
    for i, first in enumerate(per_rank[0]):
        groups.setdefault((first["pipeline"], first["collision_rate"]), []).append([r[i] for r in per_rank])
    rows = []
    for rate in cfg.rates:
        for name in cfg.pipelines:
            rounds = groups[(name, rate)]
            row: dict[str, Any] = {"pipeline": name, "collision_rate": rate}
            errors = [r["error"] for runs in rounds for r in runs if "error" in r]
            if errors:
                row["note"] = errors[0]
                rows.append(row)
                continue
            # a round's step: the slowest rank's wall time over its measured steps, per step (what
            # sets throughput; a per-step maximum over ranks would also charge jitter between ranks)
            per_round = [max(statistics.fmean(r["steps"]) for r in runs) for runs in rounds]
            exposed_steps = [e for runs in rounds for r in runs for e in r["exposed"]]
            phases = {p: statistics.fmean(e[p] for e in exposed_steps) for p in ("ids", "embeddings", "gradients")}
            exposed = sum(phases.values())
            own = statistics.fmean(t for runs in rounds for r in runs for t in r["steps"])  # a rank's own step
            step = statistics.median(per_round)
            cpu = statistics.fmean(t for runs in rounds for r in runs for t in r["cpu"])
            asked = [n for runs in rounds for r in runs for n in r["rows_asked"]]
            if asked:
                row["ids_sent"] = statistics.fmean(asked)  # per rank and step
                row["rows_moved"] = statistics.fmean(n for runs in rounds for r in runs for n in r["rows_moved"])
                row["update_ms"] = statistics.fmean(u for runs in rounds for r in runs for u in r["updates"])
                row["round_ms"] = statistics.fmean(u for runs in rounds for r in runs for u in r["rounds"])
            row.update(step_ms=step, round_spread=(max(per_round) - min(per_round)) / step, cpu_ms=cpu,
                       exposed_comm_ms=exposed, **{f"exposed_{p}_ms": v for p, v in phases.items()},
                       bubble_ms=statistics.fmean(per_round) - (own - exposed), rounds=len(rounds))
            rows.append(row)
    return PipelineBenchResult(rows, placement, [r["cores"] for r in ran])


def table(rows: list[dict[str, Any]], title: str) -> str:
    head = (f"{'pipeline':<13}{'collision':>10}{'step_ms':>10}{'spread':>8}{'cpu_ms':>8}{'exposed':>10}{'ids':>8}{'emb':>8}{'grads':>8}"
            f"{'bubble':>9}{'update':>8}{'rounds':>8}{'ids_sent':>10}{'moved':>8}")
    lines = [f"# {title}", head]
    for r in rows:
        if "note" in r:
            lines.append(f"{r['pipeline']:<13}{r['collision_rate']:>10.2f}  ({r['note']})")
            continue
        lines.append(f"{r['pipeline']:<13}{r['collision_rate']:>10.2f}{r['step_ms']:>10.2f}{r['round_spread']:>8.1%}{r['cpu_ms']:>8.2f}"
                     f"{r['exposed_comm_ms']:>10.2f}"
                     f"{r['exposed_ids_ms']:>8.2f}{r['exposed_embeddings_ms']:>8.2f}{r['exposed_gradients_ms']:>8.2f}"
                     f"{r['bubble_ms']:>9.2f}" + (f"{r['update_ms']:>8.2f}{r['round_ms']:>8.2f}{r['ids_sent']:>10.0f}"
                                                  f"{r['rows_moved']:>8.0f}" if "ids_sent" in r
                                                  else f"{'-':>8}{'-':>8}{'-':>10}{'-':>8}"))
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """The issue's goals, checked on these rows: at collision 0 PEC exposes at most 30 % of
    TrainPipelineSparseDist's embedding communication; at every rate its step is no slower."""
    by = {(r["pipeline"], r["collision_rate"]): r for r in rows if "note" not in r}
    lines = []
    for rate in sorted({r["collision_rate"] for r in rows}):
        base, ours = by.get(("sparse_dist", rate)), by.get(("pec", rate))
        if base is None or ours is None:
            continue
        share = ours["exposed_comm_ms"] / base["exposed_comm_ms"] if base["exposed_comm_ms"] > 0 else float("nan")
        goal = f"{'met' if share <= 0.30 else 'NOT met'} (<= 30 %)" if rate == 0 else ""
        lines.append(f"collision {rate:.2f}: PEC exposes {share:.0%} of TrainPipelineSparseDist's embedding comm {goal}; "
                     f"step {ours['step_ms']:.2f} vs {base['step_ms']:.2f} ms: {step_verdict(ours, base)}")
    return "\n".join(lines + nestpipe_summary(rows))


def nestpipe_summary(rows: list[dict[str, Any]]) -> list[str]:
    """NestPipe's goals on these rows: 4 frozen-window micro-batches expose at most 40 % of the
    whole batch's embedding communication (fwp4 vs fwp1) and send at most 1.2x its distinct ids
    and move at most 1.2x its distinct rows (the embedding rows, and so their gradients);
    at collision 0.5 the full mix (nestpipe) has the lowest step of every mode run."""
    by = {(r["pipeline"], r["collision_rate"]): r for r in rows if "note" not in r}
    lines = []
    for rate in sorted({r["collision_rate"] for r in rows}):
        whole, fwp4 = by.get(("fwp1", rate)), by.get(("fwp4", rate))
        if whole is not None and fwp4 is not None and whole["exposed_comm_ms"] > 0:
            share = fwp4["exposed_comm_ms"] / whole["exposed_comm_ms"]
            lines.append(f"collision {rate:.2f}: 4 micro-batches expose {share:.0%} of the whole batch's embedding comm "
                         f"({fwp4['exposed_comm_ms']:.2f} vs {whole['exposed_comm_ms']:.2f} ms): "
                         f"{'met' if share <= 0.40 else 'NOT met'} (<= 40 %)")
        if whole is not None and whole.get("ids_sent"):
            for m in (2, 4, 8):
                moved, named = [], []
                for kind in ("", "_random"):
                    r = by.get((f"fwp{m}{kind}", rate))
                    if r is not None and "ids_sent" in r:
                        label = "random" if kind else "clustered"
                        moved.append(f"{label} {r['rows_moved'] / whole['rows_moved']:.2f}x")
                        named.append(f"{label} {r['ids_sent'] / whole['ids_sent']:.2f}x")
                if moved:
                    goal = ""
                    if by.get((f"fwp{m}", rate)) is not None and m == 4:
                        fwp = by[("fwp4", rate)]
                        ratio = max(fwp["rows_moved"] / whole["rows_moved"], fwp["ids_sent"] / whole["ids_sent"])
                        goal = f": {'met' if ratio <= 1.2 else 'NOT met'} (clustered <= 1.2x, rows and ids)"
                    lines.append(f"collision {rate:.2f}: {m} micro-batches move {', '.join(moved)} the whole batch's "
                                 f"distinct rows (each row and its gradient once) and send {', '.join(named)} "
                                 f"its ids{goal}")
        mine = [r for (name, r_rate), r in by.items() if r_rate == rate]
        if rate == 0.5 and by.get(("nestpipe", rate)) is not None and len(mine) > 1:
            best = min(mine, key=lambda r: r["step_ms"])
            nest = by[("nestpipe", rate)]
            verdict = "met" if best is nest else f"NOT met ({best['pipeline']}: {best['step_ms']:.2f} ms)"
            lines.append(f"collision 0.50: nestpipe (DBP/PEC + FWP 4 + balance) steps in {nest['step_ms']:.2f} ms, "
                         f"lowest of {len(mine)} modes: {verdict}")
    return lines


def step_verdict(ours: dict[str, Any], base: dict[str, Any]) -> str:
    """Ours against the baseline by median step: no slower; slower by less than the rounds of either
    moved (the machine's noise: no measurable difference); or SLOWER."""
    slower = ours["step_ms"] / base["step_ms"] - 1
    if slower <= 0:
        return f"no slower ({-slower:.1%} faster)"
    noise = max(ours.get("round_spread", 0.0), base.get("round_spread", 0.0))
    if slower <= noise:
        return f"within noise ({slower:.1%} slower; the rounds of one pipeline differ by up to {noise:.1%})"
    return f"SLOWER by {slower:.1%} (the rounds of one pipeline differ by up to {noise:.1%})"


def plot(rows: list[dict[str, Any]], path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in ALL_PIPELINES:
        mine = [r for r in rows if r["pipeline"] == name and "note" not in r]
        if not mine:
            continue
        rates = [r["collision_rate"] for r in mine]
        axes[0].plot(rates, [r["exposed_comm_ms"] for r in mine], marker="o", label=name)
        axes[1].plot(rates, [r["step_ms"] for r in mine], marker="o", label=name)
    axes[0].set(xlabel="collision rate", ylabel="exposed embedding comm (ms/step)")
    axes[1].set(xlabel="collision rate", ylabel="step time (ms)")
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
