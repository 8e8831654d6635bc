"""fc.LoadBalancer: FreeScale's 3-stage balancing protocol on top of fc.dispatch / fc.combine.

Stage 1 (after the embedding AllToAll): every rank all-gathers the lengths of its samples (a few
bytes each), all ranks compute the same plan (fc.planner.plan_rebalance), and the samples move
with fc.dispatch. Stage 2 (after forward): outputs go home with fc.combine. Stage 3 (backward):
gradients follow through autograd, the backward of each being the other.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from freescale_comm.dispatch import DispatchHandle, check_jagged_batch, combine, dispatch
from freescale_comm.planner import CostModel, RebalancePlan, plan_rebalance

__all__ = ["BalancedBatch", "LoadBalancer", "balance"]


@dataclass(frozen=True)
class BalancedBatch:
    values: torch.Tensor  # [rows received, *trailing]: samples by source rank, then original order
    lengths: torch.Tensor  # int64 [samples received]
    source_ranks: torch.Tensor  # int64 [samples received]
    handle: DispatchHandle  # for LoadBalancer.combine
    plan: RebalancePlan  # the plan every rank computed (same on all)


class LoadBalancer:
    """Balances samples across the ranks of `group` (default WORLD) by `cost_model`.
    bytes_per_item: what one history item weighs when moved, for the planner's tie-breaking by
    bytes; None = the row size of the values passed to dispatch."""

    def __init__(self, cost_model: CostModel, group: Optional[dist.ProcessGroup] = None,
                 bytes_per_item: Optional[int] = None, *, tolerance: float = 1e-4) -> None:
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a freescale_comm.planner.CostModel, got {type(cost_model).__name__}")
        if bytes_per_item is not None and (not isinstance(bytes_per_item, int) or bytes_per_item < 0):
            raise ValueError(f"bytes_per_item must be None or an int >= 0, got {bytes_per_item!r}")
        if not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
        self.cost_model = cost_model
        self.group = group
        self.bytes_per_item = bytes_per_item
        self.tolerance = tolerance

    def plan(self, lengths: torch.Tensor, bytes_per_item: int = 1) -> RebalancePlan:
        """Collective: all-gathers every rank's sample lengths and plans (same plan on all)."""
        if not dist.is_initialized():
            raise RuntimeError("LoadBalancer needs torch.distributed: call dist.init_process_group(...) first")
        world = dist.get_world_size(self.group)
        count = torch.tensor([lengths.numel()], dtype=torch.int64)
        counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(counts, count, group=self.group)
        widest = max(int(c) for c in counts)
        padded = torch.zeros(widest, dtype=torch.int64)
        padded[: lengths.numel()] = lengths
        gathered = [torch.zeros(widest, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(gathered, padded, group=self.group)
        per_rank = [g[: int(c)].numpy() for g, c in zip(gathered, counts)]
        return plan_rebalance(per_rank, cost_model=self.cost_model, bytes_per_item=bytes_per_item,
                              tolerance=self.tolerance)

    def dispatch(self, values: torch.Tensor, lengths: torch.Tensor, *, priority: int = 0) -> BalancedBatch:
        """Stage 1. Collective. `values`: rows of this rank's samples back to back; `lengths`:
        int64 rows per sample. Returns the balanced samples this rank now computes on."""
        # Local checks before the all-gather: fc.dispatch's own, plus negative lengths, which it
        # would only find after this collective.
        values, lengths = check_jagged_batch(values, lengths)
        host_lengths = lengths.cpu()  # the planner runs on the host (for CUDA tensors: one copy)
        if host_lengths.numel() and int(host_lengths.min()) < 0:
            raise ValueError(f"lengths has a negative entry ({int(host_lengths.min())}); lengths count rows")
        total = int(host_lengths.sum()) if host_lengths.numel() else 0
        if total != values.shape[0]:
            raise ValueError(f"lengths sum to {total}, but values has {values.shape[0]} rows; they must be equal")
        item_bytes = self.bytes_per_item
        if item_bytes is None:
            item_bytes = math.prod(values.shape[1:]) * values.element_size()
        plan = self.plan(host_lengths, item_bytes)
        rank = dist.get_rank(self.group)
        dest = torch.from_numpy(np.ascontiguousarray(plan.dest[rank])).to(values.device)
        res = dispatch(values, lengths, dest, group=self.group, priority=priority)
        return BalancedBatch(res.values, res.lengths, res.source_ranks, res.handle, plan)

    def combine(self, values: torch.Tensor, handle: DispatchHandle, *, priority: int = 0) -> torch.Tensor:
        """Stage 2: rows computed here go back to their home ranks, in their original order."""
        return combine(values, handle, priority=priority)


class _BalanceHooks:
    """The hooks fc.balance put on a module; .remove() takes them off."""

    def __init__(self, module: torch.nn.Module, balancer: LoadBalancer) -> None:
        self.balancer = balancer
        self._module = weakref.ref(module)
        # Balanced input tensor -> its dispatch handle, until the forward hook sends outputs home.
        self._pending: list[tuple[Any, DispatchHandle]] = []
        self._hooks = [module.register_forward_pre_hook(self._before), module.register_forward_hook(self._after)]

    def _before(self, module: torch.nn.Module, args: tuple) -> tuple:
        if len(args) < 2:
            raise TypeError("a module balanced by fc.balance takes (values, lengths, ...) positionally")
        batch = self.balancer.dispatch(args[0], args[1])
        self._pending = [(ref, h) for ref, h in self._pending if ref() is not None]  # a forward that raised
        self._pending.append((weakref.ref(batch.values), batch.handle))
        return (batch.values, batch.lengths, *args[2:])

    def _after(self, module: torch.nn.Module, args: tuple, output: Any) -> torch.Tensor:
        for i, (ref, handle) in enumerate(self._pending):
            if ref() is args[0]:
                del self._pending[i]
                if not isinstance(output, torch.Tensor):
                    raise TypeError("a module balanced by fc.balance must return one tensor with a row-block per sample")
                return self.balancer.combine(output, handle)
        raise RuntimeError("fc.balance: forward hook without a matching dispatch (was the input replaced?)")

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        module = self._module()
        if module is not None and getattr(module, "freescale_balance", None) is self:
            module.freescale_balance = None


def balance(module: torch.nn.Module, cost_model: CostModel, *, group: Optional[dist.ProcessGroup] = None,
            bytes_per_item: Optional[int] = None) -> torch.nn.Module:
    """Balances every forward of `module`, whose forward takes (values, lengths, ...) and returns
    one row-block per sample: inputs are dispatched by a LoadBalancer before it runs and its
    output is combined home after (gradients follow). Returns the module; its
    `freescale_balance.remove()` takes the hooks off."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if getattr(module, "freescale_balance", None) is not None:
        raise ValueError("module is already balanced by fc.balance; call module.freescale_balance.remove() first")
    module.freescale_balance = _BalanceHooks(module, LoadBalancer(cost_model, group, bytes_per_item))
    return module
