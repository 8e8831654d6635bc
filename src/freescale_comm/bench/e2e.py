"""freescale-bench e2e: a synthetic HSTU-like training step on N local ranks, in several modes.

One step, per rank (a thread of torch compute each), on the `freescale` default group:
  ids ─ counts AllToAll, id AllToAll ─▶ owners look rows up ─ embedding AllToAll ─▶ dense
  forward (jagged causal attention) + loss + backward ─ gradient AllToAll ─▶ owners' SGD on the
  rows; dense gradients (and the loss) all-reduced, SGD on the dense weights.

Modes (MODES):
- vanilla:   TorchRec-like. Every AllToAll blocking, one batch, no balancing.
- balance:   + LoadBalancer: each step's samples are balanced by the HSTU cost before the id
             AllToAll (only lengths are needed to plan, and ids weigh 8 B per item where an
             embedded item weighs dim × 4 B, so the balanced samples fetch their own rows).
- overlap:   + async, priority-ordered AllToAlls overlapped with compute: the next step's ids
             (balanced, counted, exchanged at the lowest priority) move under this step's
             compute; the embeddings come in `groups` sample groups, highest priority first for
             the group compute needs next, so group g+1 arrives while group g computes; each
             group's gradient AllToAll leaves as soon as its backward is done, below every
             embedding fetch; the dense all-reduce runs under the rows' update.
- pec:       + prioritized embedding communication (freescale_comm.pec, see bench/e2e_pec.py):
             the next step's ids and the rows it reads that this step does not (non-overlap) move
             at low priority under this step's compute; the overlap rows' gradients and fetch go
             first at high priority after backward; the non-overlap gradients are deferred.
- freescale: balance + overlap.
- balance_pec: balance + pec.
Every mode does the same math: same seed → same losses (to float rounding).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from freescale_comm.bench import workloads
from freescale_comm.bench.hstu_model import DenseTower, ShardedTable, sample_labels
from freescale_comm.bench.report import bubble_reduction
from freescale_comm.bench.timeline import StepRecorder, Timeline, mode_metrics
from freescale_comm.planner import CostModel

__all__ = ["MODES", "Mode", "E2EConfig", "E2EResult", "run", "home_batch"]


@dataclass(frozen=True)
class Mode:
    balance: bool
    overlap: bool
    pec: bool = False


MODES: dict[str, Mode] = {
    "vanilla": Mode(balance=False, overlap=False),
    "balance": Mode(balance=True, overlap=False),
    "overlap": Mode(balance=False, overlap=True),
    "freescale": Mode(balance=True, overlap=True),
    "pec": Mode(balance=False, overlap=True, pec=True),
    "balance_pec": Mode(balance=True, overlap=True, pec=True),
}

# Priorities on freescale's queue (larger = sooner): what compute needs next goes first.
EMBEDDING_PRIORITY = 100  # minus the group index
GRADIENT_PRIORITY = 50  # minus the group index
PREFETCH_PRIORITY = 0


@dataclass(frozen=True)
class E2EConfig:
    ranks: int = 4
    steps: int = 3  # measured steps per mode
    warmup: int = 1  # steps run before them, not measured
    samples: int = 8  # per rank and step
    workload: str = "kuairand"
    length_scale: float = 1 / 12  # workload lengths are scaled by this (and kept >= 1)
    dim: int = 64
    heads: int = 2
    layers: int = 2
    rows_per_rank: int = 16384
    groups: int = 4  # sample groups of the overlapped modes' pipeline
    lr: float = 0.5
    seed: int = 0
    modes: tuple[str, ...] = tuple(MODES)
    device: str = "cpu"  # where the dense tower computes
    collision_rate: Optional[float] = None  # share of each step's ids read at the step before; None: uniform ids
    # What balancing plans with: None fits one to this machine's timings at the start of the run;
    # a given model makes the plans (and so which samples move) the same on any machine or load.
    cost_model: Optional[CostModel] = None

    def check(self) -> None:
        problems = []
        if self.ranks < 2:
            problems.append("ranks must be >= 2")
        if self.steps < 1 or self.warmup < 0:
            problems.append("steps must be >= 1 and warmup >= 0")
        if self.samples < 1 or self.groups < 1:
            problems.append("samples and groups must be >= 1")
        if self.workload not in workloads.WORKLOADS:
            problems.append(f"workload must be one of {sorted(workloads.WORKLOADS)}")
        if not 0 < self.length_scale <= 1:
            problems.append("length_scale must be in (0, 1]")
        if self.dim < 1 or self.heads < 1 or self.dim % self.heads or self.layers < 1:
            problems.append("dim must be a positive multiple of heads, layers >= 1")
        if self.rows_per_rank < 1:
            problems.append("rows_per_rank must be >= 1")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            problems.append(f"modes must be a non-empty subset of {list(MODES)} (got {list(self.modes)})")
        if self.collision_rate is not None and not 0 <= self.collision_rate <= 1:
            problems.append("collision_rate must be None or in [0, 1]")
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            problems.append("cost_model must be None (fit one) or a freescale_comm.planner.CostModel")
        if self.device not in ("cpu", "cuda"):
            problems.append("device must be cpu or cuda")
        elif self.device == "cuda" and not torch.cuda.is_available():
            problems.append("device is cuda but torch sees no CUDA device: use device cpu")
        if problems:
            raise ValueError("bad e2e config: " + "; ".join(problems))


@dataclass
class E2EResult:
    config: E2EConfig
    rows: list[dict[str, Any]]  # one per mode: design.md §6 e2e keys and more
    timelines: dict[str, Timeline]  # mode -> measured steps, all ranks
    losses: dict[str, list[float]]  # mode -> global mean loss of every step (warmup included)
    computed_samples: dict[str, list[list[int]]]  # mode -> [rank][step] samples computed there
    cost_model: CostModel  # the config's, or fitted at the start of the run; balancing plans with it

    def reduction(self, mode: str = "freescale", baseline: str = "vanilla") -> Optional[float]:
        """Fraction of bubble ms removed by `mode` relative to `baseline` (None if either is missing)."""
        return bubble_reduction(self.rows, mode, baseline)


def home_batch(cfg: E2EConfig, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples rank `rank` reads at `step`: (ids int64 [ΣL], lengths int64 [samples]).
    Deterministic in (seed, step, rank), whatever the mode."""
    lengths = _lengths(cfg, step, rank)
    if cfg.collision_rate is None:
        ids = np.random.default_rng(workloads.step_seed(cfg.seed, step, rank) + 1).integers(0, cfg.rows_per_rank * cfg.ranks, int(lengths.sum()))
    else:
        ids = _overlapping_ids(cfg, step + 1)[step][rank]
    return torch.from_numpy(ids), torch.from_numpy(lengths)


def _lengths(cfg: E2EConfig, step: int, rank: int) -> np.ndarray:
    return workloads.step_lengths(cfg.workload, cfg.samples, seed=cfg.seed, step=step, rank=rank,
                                  scale=cfg.length_scale)


@functools.lru_cache(maxsize=4)
def _overlapping_ids(cfg: E2EConfig, steps: int) -> list[list[np.ndarray]]:
    """Steps [0, steps) of every rank's ids at cfg.collision_rate (each step depends on the one before)."""
    counts = [[int(_lengths(cfg, s, r).sum()) for r in range(cfg.ranks)] for s in range(steps)]
    return workloads.overlapping_ids(counts, cfg.rows_per_rank * cfg.ranks, cfg.collision_rate, seed=cfg.seed)


def calibrate(cfg: E2EConfig, device: torch.device, points: int = 6, repeats: int = 2) -> CostModel:
    """Collective. Times forward + backward of single samples at `points` lengths spanning the
    workload (the fastest of `repeats` runs), averages over ranks and fits a CostModel to the
    seconds: every rank gets the same model, which the LoadBalancer then plans with."""
    full = workloads.generate(cfg.workload, 4096, seed=cfg.seed)
    lengths = np.unique(workloads.scale_lengths(np.quantile(full, np.linspace(0, 1, points)), cfg.length_scale))
    if lengths.size < 2:  # every length scaled to the same value: a fit needs two
        lengths = np.array([lengths[0], 2 * lengths[0]], dtype=np.int64)
    torch.manual_seed(cfg.seed)
    dense = DenseTower(cfg.dim, cfg.heads, cfg.layers).to(device)
    seconds = torch.zeros(lengths.size, dtype=torch.float64)
    for i, L in enumerate(lengths.tolist()):
        x = torch.randn(L, cfg.dim, device=device, requires_grad=True)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            dense(x, [L]).sum().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        seconds[i] = best
    dist.all_reduce(seconds)
    return CostModel.fit(lengths, (seconds / dist.get_world_size()).numpy())


@dataclass
class _Group:
    """One sample group of a prepared step, seen from the rank that computes it."""

    lengths: list[int]
    ids: torch.Tensor  # int64 [items] in sample order
    order: torch.Tensor  # int64 [items]: positions sorted by owner rank (stable)
    send: list[int]  # [world] ids asked of each owner
    recv: list[int]  # [world] ids each rank asks of me
    recv_ids: Optional[torch.Tensor] = None  # int64 [Σ recv]: rows to look up for the askers
    id_work: Any = None
    id_key: str = ""


class _Trainer:
    """One rank's training loop in one mode."""

    def __init__(self, cfg: E2EConfig, mode: Mode, rank: int, cost_model: CostModel, progress: Any) -> None:
        self.cfg, self.mode, self.rank = cfg, mode, rank
        self.world = cfg.ranks
        self.device = torch.device(cfg.device)
        self.progress = progress
        torch.manual_seed(cfg.seed)
        self.dense = DenseTower(cfg.dim, cfg.heads, cfg.layers).to(self.device)
        self.table = ShardedTable(rank, cfg.rows_per_rank, cfg.dim, cfg.seed, torch.device("cpu"))
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        self.rec = StepRecorder(rank, sync=sync)
        self.groups = cfg.groups if mode.overlap else 1
        self.balancer = None
        if mode.balance:
            from freescale_comm.balancer import LoadBalancer

            self.balancer = LoadBalancer(cost_model, bytes_per_item=8)  # ids move: 8 B per item
        self.losses: list[float] = []
        self.sparsity: list[float] = []
        self.computed: list[int] = []  # samples this rank computed, per prepared step

    # -- communication helpers: blocking, or async at a priority ----------------------------------
    def _alltoall(self, name: str, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                  in_splits: list[int], priority: Optional[int]) -> tuple[str, Any]:
        if priority is None:
            self.rec.blocking(name, lambda: dist.all_to_all_single(out, inp, out_splits, in_splits))
            return "", None
        from freescale_comm.backend import priority as fc_priority

        t0 = self.rec.clock()
        with fc_priority(priority):
            work = dist.all_to_all_single(out, inp, out_splits, in_splits, async_op=True)
        return self.rec.issue_at(name, t0, work), work

    def _async(self, priority: int) -> Optional[int]:
        return priority if self.mode.overlap else None

    # -- the step's stages ---------------------------------------------------------------------------
    def samples(self, step: int) -> tuple[torch.Tensor, list[int]]:
        """This rank's samples at `step`, balanced if on (blocking): ids [items], lengths. Records
        how many it computes and their sparsity."""
        ids, lengths = home_batch(self.cfg, step, self.rank)
        if self.balancer is not None:
            batch = self.rec.blocking("balance", lambda: self.balancer.dispatch(ids, lengths))
            ids, lengths = batch.values, batch.lengths
        lengths_list = lengths.tolist()
        self.computed.append(len(lengths_list))
        if lengths_list:
            self.sparsity.append(1.0 - sum(lengths_list) / (len(lengths_list) * max(lengths_list)))
        return ids, lengths_list

    def prepare(self, step: int) -> list[_Group]:
        """Balance (if on), split into groups, exchange counts, issue the id AllToAlls."""
        ids, lengths_list = self.samples(step)
        starts = np.concatenate([[0], np.cumsum(lengths_list)]).astype(np.int64)
        groups = []
        for part in np.array_split(np.arange(len(lengths_list)), self.groups):
            lo = int(starts[part[0]]) if part.size else 0
            hi = int(starts[part[-1] + 1]) if part.size else 0
            gids = ids[lo:hi]
            owner = gids // self.cfg.rows_per_rank
            order = torch.argsort(owner, stable=True)
            send = torch.bincount(owner, minlength=self.world).tolist()
            groups.append(_Group([lengths_list[i] for i in part], gids, order, send, []))
        # Counts: to rank d, the [groups] ids I ask of it (one tiny blocking AllToAll).
        counts_in = torch.tensor([[g.send[d] for g in groups] for d in range(self.world)], dtype=torch.int64)
        counts_out = torch.empty_like(counts_in)
        self._alltoall("counts", counts_out, counts_in, [1] * self.world, [1] * self.world, None)
        for i, g in enumerate(groups):
            g.recv = counts_out[:, i].tolist()
            g.recv_ids = torch.empty(sum(g.recv), dtype=torch.int64)
            g.id_key, g.id_work = self._alltoall("ids", g.recv_ids, g.ids[g.order], g.recv, g.send,
                                                 self._async(PREFETCH_PRIORITY))
        return groups

    def step(self, step: int, groups: list[_Group]) -> Optional[list[_Group]]:
        """Runs `step` on its prepared groups; in overlapped modes, returns step+1's (prepared
        under this step's compute)."""
        cfg, rec = self.cfg, self.rec
        total_samples = cfg.ranks * cfg.samples
        nxt = None
        if self.mode.overlap and step + 1 < cfg.warmup + cfg.steps:
            nxt = self.prepare(step + 1)
        for g in groups:
            if g.id_work is not None:
                rec.wait(g.id_key, g.id_work)
        with rec.compute("lookup"):
            rows = [self.table.lookup(g.recv_ids) for g in groups]
        fetched = []
        for i, (g, r) in enumerate(zip(groups, rows)):
            out = torch.empty(sum(g.send), cfg.dim)
            fetched.append((out, *self._alltoall("embeddings", out, r, g.send, g.recv,
                                                 self._async(EMBEDDING_PRIORITY - i))))
        loss_sum = torch.zeros((), device=self.device)
        grads_in = []
        for i, (g, (emb, key, work)) in enumerate(zip(groups, fetched)):
            if work is not None:
                rec.wait(key, work)
            if not g.lengths:  # an empty group (fewer samples than groups here)
                grad_out = emb
            else:
                with rec.compute("forward_backward"):
                    x = torch.empty_like(emb)
                    x[g.order] = emb  # back to sample order
                    x = x.to(self.device).requires_grad_()
                    logits = self.dense(x, g.lengths)
                    loss = F.binary_cross_entropy_with_logits(
                        logits, sample_labels(g.ids, g.lengths).to(self.device), reduction="sum")
                    (loss / total_samples).backward()
                    grad_out = x.grad.cpu()[g.order]  # owner order
                    loss_sum += loss.detach()
            grads = torch.empty(sum(g.recv), cfg.dim)
            grads_in.append((g, grads, *self._alltoall("gradients", grads, grad_out, g.recv, g.send,
                                                       self._async(GRADIENT_PRIORITY - i))))
        # Dense gradients and the loss, one flat all-reduce (under the rows' update when overlapped).
        params = [p for p in self.dense.parameters()]
        # A rank that computed no sample has no gradients: zeros.
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                         + [loss_sum.reshape(1)]).cpu()
        if self.mode.overlap:
            t0 = rec.clock()
            reduce_work = dist.all_reduce(flat, async_op=True)
            reduce_key = rec.issue_at("dense_allreduce", t0, reduce_work)
        else:
            rec.blocking("dense_allreduce", lambda: dist.all_reduce(flat))
        for g, grads, key, work in grads_in:
            if work is not None:
                rec.wait(key, work)
            with rec.compute("update"):
                self.table.sgd(g.recv_ids, grads, cfg.lr)
        if self.mode.overlap:
            rec.wait(reduce_key, reduce_work)
        with rec.compute("dense_sgd"):
            self._dense_sgd(params, flat)
        self.losses.append(float(flat[-1]) / total_samples)
        return nxt

    def _dense_sgd(self, params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
        """SGD on the dense weights from `flat`, their all-reduced gradients back to back."""
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                p -= self.cfg.lr * flat[offset:offset + n].view_as(p).to(self.device)
                p.grad = None
                offset += n

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        dist.barrier()
        self.rec.begin_step(-1)  # the first prefetch, before the first step
        groups = self.prepare(0) if self.mode.overlap else None
        for step in range(cfg.warmup + cfg.steps):
            dist.barrier()  # every step starts together: steps are measured one by one
            self.rec.begin_step(step)
            if not self.mode.overlap:
                groups = self.prepare(step)
            groups = self.step(step, groups)
            self.rec.end_step()
            if self.progress is not None:
                self.progress.update(1)
        return {"losses": self.losses, "timeline": self.rec.timeline.to_dict(), "sparsity": self.sparsity,
                "computed_samples": self.computed}


def trainer_for(cfg: E2EConfig, mode: Mode, rank: int, cost_model: CostModel, progress: Any) -> "_Trainer":
    """Collective (a PEC trainer builds its communicator): one rank's trainer for `mode`."""
    if mode.pec:
        from freescale_comm.bench.e2e_pec import PECTrainer

        return PECTrainer(cfg, mode, rank, cost_model, progress)
    return _Trainer(cfg, mode, rank, cost_model, progress)


def _rank_program(info: Any, cfg: E2EConfig, progress: bool) -> dict[str, Any]:
    torch.set_num_threads(1)  # one compute thread per rank
    bar = None
    if progress and info.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(cfg.modes) * (cfg.warmup + cfg.steps), desc=f"e2e {cfg.ranks} ranks", unit="step",
                   leave=False)
    cost_model = cfg.cost_model if cfg.cost_model is not None else calibrate(cfg, torch.device(cfg.device))
    out: dict[str, Any] = {"cost_model": cost_model}
    for name in cfg.modes:
        if bar is not None:
            bar.set_postfix_str(name)
        out[name] = trainer_for(cfg, MODES[name], info.rank, cost_model, bar).run()
    if bar is not None:
        bar.close()
    return out


def run(cfg: E2EConfig, progress: bool = True, timeout_s: float = 600.0) -> E2EResult:
    """Spawns cfg.ranks processes on the freescale backend, runs every mode, and measures."""
    from freescale_comm.testing import spawn

    cfg.check()
    per_rank = spawn(_rank_program, cfg.ranks, cfg, progress, backend="freescale", timeout_s=timeout_s)
    measured = lambda s: s >= cfg.warmup  # noqa: E731
    rows, timelines, losses, computed = [], {}, {}, {}
    for name in cfg.modes:
        tl = Timeline()
        for r in per_rank:
            tl.extend(Timeline.from_dict(r[name]["timeline"]).select(measured))
        timelines[name] = tl
        losses[name] = per_rank[0][name]["losses"]
        computed[name] = [r[name]["computed_samples"] for r in per_rank]
        sparsity = [v for r in per_rank for v in r[name]["sparsity"]]
        rows.append({"mode": name, **mode_metrics(tl), "sparsity": float(np.mean(sparsity)) if sparsity else math.nan,
                     "loss": losses[name][-1]})
    return E2EResult(cfg, rows, timelines, losses, computed, per_rank[0]["cost_model"])
