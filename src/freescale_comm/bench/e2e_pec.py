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

import torch
import torch.distributed as dist

from freescale_comm.bench.e2e_config import E2EConfig, Mode
from freescale_comm.bench.e2e_trainer import StepTrainer
from freescale_comm.pec import PrioritizedEmbedding, RowWiseSharding
from freescale_comm.planner import CostModel

__all__ = ["PECTrainer"]


class PECTrainer(StepTrainer):
    """One rank's training loop with prioritized embedding communication. Collective to build."""

    def __init__(self, cfg: E2EConfig, mode: Mode, rank: int, cost_model: CostModel, progress: Any) -> None:
        super().__init__(cfg, mode, rank, cost_model, progress)
        self.groups = cfg.groups  # compute chunks: pe.progress() runs between them
        sharding = RowWiseSharding([cfg.rows_per_rank * cfg.ranks], cfg.ranks)
        self.pe = PrioritizedEmbedding(sharding, self.table.weight, lr=cfg.lr)
        # The step about to run: its ids [items], lengths and fetched rows [items, dim] (start() fills them).
        self._ids, self._lengths, self._rows = torch.empty(0, dtype=torch.int64), [], torch.empty(0, cfg.dim)

    def _compute(self, step: int, ids: torch.Tensor, lengths: list[int], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward + backward of the batch in chunks, pe.progress() after each; returns (loss sum,
        gradient of rows [items, dim])."""

        def progress() -> None:
            with self.rec.compute("pec_progress"):
                self.pe.progress()

        loss_sum, grad = self.forward_backward(rows, ids, lengths, self.groups, "forward_backward", between=progress)
        return loss_sum, grad.cpu()

    def start(self) -> None:
        """Collective. Fetches step 0's rows (blocking: nothing to hide it under yet)."""
        dist.barrier()
        self.rec.begin_step(-1)  # the first fetch, before the first step
        self._ids, self._lengths = self.samples(0)
        self.pe.prefetch([self._ids])
        self._rows = self.rec.blocking("pec_fetch", self.pe.fetch)

    def run_step(self, step: int) -> None:
        cfg, rec = self.cfg, self.rec
        dist.barrier()  # every step starts together: steps are measured one by one
        rec.begin_step(step)
        has_next = step + 1 < cfg.warmup + cfg.steps
        if has_next:
            next_ids, next_lengths = self.samples(step + 1)
            self.pe.prefetch([next_ids])
        loss_sum, grad = self._compute(step, self._ids, self._lengths, self._rows)
        params, flat = self.dense_gradients(loss_sum)
        rec.blocking("pec_backward", lambda: self.pe.backward(grad))
        # The OL gradients' round trip (owner update, OL rows back) runs on the runtime's thread
        # under the dense all-reduce; fetch() then mostly finds the rows there.
        rec.blocking("dense_allreduce", lambda: dist.all_reduce(flat))
        with rec.compute("dense_sgd"):
            self._dense_sgd(params, flat)
        if has_next:
            self._rows = rec.blocking("pec_fetch", self.pe.fetch)
            self._ids, self._lengths = next_ids, next_lengths
        self.losses.append(float(flat[-1]) / (cfg.ranks * cfg.samples))
        rec.end_step()
        if self.progress is not None:
            self.progress.update(1)

    def finish(self) -> dict[str, Any]:
        """Collective. Applies the deferred gradients, closes the runtime; what the run measured."""
        self.pe.flush()
        self.pe.close()
        return super().finish()
