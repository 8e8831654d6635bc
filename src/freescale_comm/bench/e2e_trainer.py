"""One rank's training loop of the e2e benchmark (every mode but PEC's, bench/e2e_pec.py) and the
cost-model calibration the balanced modes plan with. The step and its modes: bench/e2e.py."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from freescale_comm._speed_meter import SpeedMeter
from freescale_comm.bench import workloads
from freescale_comm.bench.e2e_config import (EMBEDDING_PRIORITY, GRADIENT_PRIORITY, PREFETCH_PRIORITY, E2EConfig,
                                             Mode, home_batch)
from freescale_comm.bench.hstu_model import DenseTower, ShardedTable, sample_labels
from freescale_comm.bench.timeline import StepRecorder
from freescale_comm.planner import CostModel

__all__ = ["StepTrainer", "calibrate"]


def calibrate(cfg: E2EConfig, device: torch.device, points: int = 6, repeats: int = 2) -> CostModel:
    """Collective. Times forward + backward of single samples at `points` lengths spanning the
    workload (the fastest of `repeats` runs, after one untimed run: first runs pay for warm-up),
    averages over ranks and fits a CostModel to the seconds: every rank gets the same model, which
    the LoadBalancer then plans with. On the CPU the clock is this thread's CPU time: what the work
    costs, not what a busy machine lets the rank have (a fit under load was once constant-dominated
    and planned no move)."""
    full = workloads.generate(cfg.workload, 4096, seed=cfg.seed)
    lengths = np.unique(workloads.scale_lengths(np.quantile(full, np.linspace(0, 1, points)), cfg.length_scale))
    if lengths.size < 2:  # every length scaled to the same value: a fit needs two
        lengths = np.array([lengths[0], 2 * lengths[0]], dtype=np.int64)
    torch.manual_seed(cfg.seed)
    dense = DenseTower(cfg.dim, cfg.heads, cfg.layers).to(device)
    clock = time.perf_counter if device.type == "cuda" else time.thread_time

    def once(L: int) -> float:
        x = torch.randn(L, cfg.dim, device=device, requires_grad=True)
        t0 = clock()
        dense(x, [L]).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return clock() - t0

    once(int(lengths[-1]))  # warm-up, untimed
    seconds = torch.tensor([min(once(L) for _ in range(repeats)) for L in lengths.tolist()], dtype=torch.float64)
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


class StepTrainer:
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
        self.cost_model = cost_model
        self.balancer = None
        self._measured = [0.0, 0.0]  # the cost this rank computed and the seconds it took, since the last plan
        self._speed = SpeedMeter()  # this rank's measured speed (cost per second), smoothed
        if mode.balance:
            from freescale_comm.balancer import LoadBalancer

            self.balancer = LoadBalancer(cost_model, bytes_per_item=8)  # ids move: 8 B per item
        self.losses: list[float] = []
        self.sparsity: list[float] = []
        self.computed: list[int] = []  # samples this rank computed, per prepared step
        self._groups: Optional[list[_Group]] = None  # overlapped modes: the next step's, prepared ahead

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
            if self.cfg.balance_speeds:
                self._update_speed()
            batch = self.rec.blocking("balance", lambda: self.balancer.dispatch(ids, lengths))
            ids, lengths = batch.values, batch.lengths
        lengths_list = lengths.tolist()
        self.computed.append(len(lengths_list))
        if lengths_list:
            self.sparsity.append(1.0 - sum(lengths_list) / (len(lengths_list) * max(lengths_list)))
        return ids, lengths_list

    def _update_speed(self) -> None:
        """The balancer plans with this rank's speed: what it computed per second since the last
        plan, averaged with the speed before (a rank that computed nothing keeps its speed)."""
        speed = self._speed.fold(*self._measured)
        self._measured = [0.0, 0.0]
        if speed is not None:
            self.balancer.speed = speed

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
                x = torch.empty_like(emb)
                x[g.order] = emb  # back to sample order
                # Every mode computes a rank's samples in the same cfg.groups chunks (the overlapped
                # modes' groups are those chunks): grouping changes compute time (the working set),
                # so the modes would otherwise not compute the same work.
                chunks = 1 if self.mode.overlap else cfg.groups
                loss, grad = self.forward_backward(x, g.ids, g.lengths, chunks, "forward_backward")
                grad_out = grad.cpu()[g.order]  # owner order
                loss_sum += loss
            grads = torch.empty(sum(g.recv), cfg.dim)
            grads_in.append((g, grads, *self._alltoall("gradients", grads, grad_out, g.recv, g.send,
                                                       self._async(GRADIENT_PRIORITY - i))))
        # Dense gradients and the loss, one flat all-reduce (under the rows' update when overlapped).
        params, flat = self.dense_gradients(loss_sum)
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

    def forward_backward(self, x: torch.Tensor, ids: torch.Tensor, lengths: list[int], chunks: int, name: str,
                         between: Optional[Callable[[], None]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward + backward of samples x [ΣL, dim] (ids [ΣL], lengths) in `chunks` chunks of whole
        samples, each recorded as compute `name`, `between()` after each; the dense gradients add up.
        Returns (loss sum, d loss / d x [ΣL, dim])."""
        total_samples = self.cfg.ranks * self.cfg.samples
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        loss_sum = torch.zeros((), device=self.device)
        grads = []
        for part in np.array_split(np.arange(len(lengths)), chunks):
            if part.size:
                lo, hi = int(starts[part[0]]), int(starts[part[-1] + 1])
                lens = lengths[part[0]:part[-1] + 1]
                t0 = self.rec.clock()
                with self.rec.compute(name):
                    xs = x[lo:hi].to(self.device).requires_grad_()  # a leaf per chunk: no full-size gradients
                    loss = F.binary_cross_entropy_with_logits(
                        self.dense(xs, lens), sample_labels(ids[lo:hi], lens).to(self.device), reduction="sum")
                    (loss / total_samples).backward()
                    loss_sum += loss.detach()
                    grads.append(xs.grad)
                self._measured[0] += float(self.cost_model.cost(lens).sum())
                self._measured[1] += self.rec.clock() - t0  # (on a device: to completion, rec syncs)
            if between is not None:
                between()
        grad = torch.cat(grads) if grads else torch.zeros_like(x, device=self.device)
        return loss_sum, grad

    def dense_gradients(self, loss_sum: torch.Tensor) -> tuple[list[torch.nn.Parameter], torch.Tensor]:
        """The dense weights and their gradients back to back, then the loss sum: flat float32
        [Σ numel + 1] on the CPU, what one all-reduce sums. A rank that computed no sample has no
        gradients: zeros."""
        params = list(self.dense.parameters())
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                         + [loss_sum.reshape(1)]).cpu()
        return params, flat

    def _dense_sgd(self, params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
        """SGD on the dense weights from `flat`, their all-reduced gradients back to back."""
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                p -= self.cfg.lr * flat[offset:offset + n].view_as(p).to(self.device)
                p.grad = None
                offset += n

    # -- the run, step by step (so that modes can take turns: bench/e2e.py) -----------------------
    def start(self) -> None:
        """Collective. Before step 0: in overlapped modes, step 0's ids are prepared (issued)."""
        dist.barrier()
        self.rec.begin_step(-1)  # the first prefetch, before the first step
        self._groups = self.prepare(0) if self.mode.overlap else None

    def run_step(self, step: int) -> None:
        """Collective. Runs `step` (steps run in order, from 0), timed from a barrier."""
        dist.barrier()  # every step starts together: steps are measured one by one
        self.rec.begin_step(step)
        groups = self._groups if self.mode.overlap else self.prepare(step)
        self._groups = self.step(step, groups)
        self.rec.end_step()
        if self.progress is not None:
            self.progress.update(1)

    def finish(self) -> dict[str, Any]:
        """What the run measured: losses, the timeline, sparsity and samples computed per step."""
        return {"losses": self.losses, "timeline": self.rec.timeline.to_dict(), "sparsity": self.sparsity,
                "computed_samples": self.computed}

    def run(self) -> dict[str, Any]:
        """Collective. Every step of this mode alone, then finish()."""
        self.start()
        for step in range(self.cfg.warmup + self.cfg.steps):
            self.run_step(step)
        return self.finish()
