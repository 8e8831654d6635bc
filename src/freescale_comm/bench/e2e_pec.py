"""The e2e benchmark's `pec` and `balance_pec` modes: the same training step as bench/e2e.py, its
embedding traffic driven by freescale_comm.pec.PrioritizedEmbedding.

Per step N, every rank:
  (balance N+1's samples) → prefetch(ids of N+1)            low priority, async
  forward/backward of N in `groups` chunks, pe.progress() between them: N+1's ids, the flags and
  its non-overlap rows move under this compute
  pe.backward(grads of N)                                    overlap gradients first (high), the
                                                             rest deferred (lowest, sent by the
                                                             next progress())
  dense all-reduce, dense SGD                                meanwhile the runtime's thread applies
                                                             the overlap gradients and sends the
                                                             overlap rows (high)
  pe.fetch() → rows of N+1                                   waits for what is left of them
The row-wise sharded table is the same `ShardedTable` the other modes use: same rows, same math.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from freescale_comm.bench.e2e import E2EConfig, Mode, _Trainer
from freescale_comm.bench.hstu_model import sample_labels
from freescale_comm.pec import PrioritizedEmbedding, RowWiseSharding
from freescale_comm.planner import CostModel

__all__ = ["PECTrainer"]


class PECTrainer(_Trainer):
    """One rank's training loop with prioritized embedding communication. Collective to build."""

    def __init__(self, cfg: E2EConfig, mode: Mode, rank: int, cost_model: CostModel, progress: Any) -> None:
        super().__init__(cfg, mode, rank, cost_model, progress)
        self.groups = cfg.groups  # compute chunks: pe.progress() runs between them
        sharding = RowWiseSharding([cfg.rows_per_rank * cfg.ranks], cfg.ranks)
        self.pe = PrioritizedEmbedding(sharding, self.table.weight, lr=cfg.lr)

    def _compute(self, step: int, ids: torch.Tensor, lengths: list[int], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward + backward of the batch in chunks; returns (loss sum, gradient of rows [items, dim])."""
        total_samples = self.cfg.ranks * self.cfg.samples
        x = rows.to(self.device).requires_grad_()
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        loss_sum = torch.zeros((), device=self.device)
        for part in np.array_split(np.arange(len(lengths)), self.groups):
            if part.size:
                lo, hi = int(starts[part[0]]), int(starts[part[-1] + 1])
                lens = lengths[part[0]:part[-1] + 1]
                with self.rec.compute("forward_backward"):
                    logits = self.dense(x[lo:hi], lens)
                    loss = F.binary_cross_entropy_with_logits(
                        logits, sample_labels(ids[lo:hi], lens).to(self.device), reduction="sum")
                    (loss / total_samples).backward()
                    loss_sum += loss.detach()
            with self.rec.compute("pec_progress"):
                self.pe.progress()
        grad = x.grad.cpu() if x.grad is not None else torch.zeros_like(rows)
        return loss_sum, grad

    def run(self) -> dict[str, Any]:
        cfg, rec = self.cfg, self.rec
        total_steps = cfg.warmup + cfg.steps
        dist.barrier()
        rec.begin_step(-1)  # the first fetch, before the first step
        ids, lengths = self.samples(0)
        self.pe.prefetch([ids])
        rows = rec.blocking("pec_fetch", self.pe.fetch)
        for step in range(total_steps):
            dist.barrier()  # every step starts together: steps are measured one by one
            rec.begin_step(step)
            has_next = step + 1 < total_steps
            if has_next:
                next_ids, next_lengths = self.samples(step + 1)
                self.pe.prefetch([next_ids])
            loss_sum, grad = self._compute(step, ids, lengths, rows)
            params = list(self.dense.parameters())
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                             + [loss_sum.reshape(1)]).cpu()
            rec.blocking("pec_backward", lambda: self.pe.backward(grad))
            # The OL gradients' round trip (owner update, OL rows back) runs on the runtime's thread
            # under the dense all-reduce; fetch() then mostly finds the rows there.
            rec.blocking("dense_allreduce", lambda: dist.all_reduce(flat))
            with rec.compute("dense_sgd"):
                self._dense_sgd(params, flat)
            if has_next:
                rows = rec.blocking("pec_fetch", self.pe.fetch)
                ids, lengths = next_ids, next_lengths
            self.losses.append(float(flat[-1]) / (cfg.ranks * cfg.samples))
            rec.end_step()
            if self.progress is not None:
                self.progress.update(1)
        self.pe.flush()
        self.pe.close()
        return {"losses": self.losses, "timeline": rec.timeline.to_dict(), "sparsity": self.sparsity,
                "computed_samples": self.computed}
