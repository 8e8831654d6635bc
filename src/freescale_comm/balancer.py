"""fc.LoadBalancer: FreeScale's 3-stage balancing protocol on top of fc.dispatch / fc.combine.

Stage 1 (after the embedding AllToAll): every rank all-gathers the lengths of its samples (a few
bytes each), all ranks compute the same plan (fc.planner.plan_rebalance), and the samples move
with fc.dispatch. The lengths move on freescale's own communicator for the group, as the samples
do: no collective goes through the group's backend, which may refuse host tensors (NCCL's does).
Stage 2 (after forward): outputs go home with fc.combine. Stage 3 (backward): gradients follow
through autograd, the backward of each being the other.
"""

from __future__ import annotations

import functools
import math
import operator
import weakref
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from freescale_comm._errors import comm_error, ranks_by, refuse_differing_kinds
from freescale_comm._device_copy import to_device
from freescale_comm._output_layouts import sizes_differ_everywhere
from freescale_comm._speed_meter import SpeedMeter
from freescale_comm.bundle import (
    BalancedBundle,
    agreed_shares,
    argument_leaves,
    bundle_inputs,
    combine_bundle,
    dispatch_bundle,
    feature_order,
    has_rows_per_sample,
    is_jagged,
    is_keyed_jagged,
    is_sequence_batch,
    leaf_kind,
    leaf_rows,
    local_shares,
    rebuilt,
    resolved,
    with_moved,
)
from freescale_comm.communicator import check_priority, eager
from freescale_comm.dispatch import (DispatchHandle, check_jagged_batch, check_lengths_fit, combine, communicator_for,
                                     dispatch)
from freescale_comm.planner import CostModel, RebalancePlan, plan_rebalance

__all__ = ["BalancedBatch", "BalancedBundle", "LoadBalancer", "PlanAhead", "PlannedSequences", "balance"]


@dataclass(frozen=True)
class BalancedBatch:
    values: torch.Tensor  # [rows received, *trailing]: samples by source rank, then original order
    lengths: torch.Tensor  # int64 [samples received]
    source_ranks: torch.Tensor  # int64 [samples received]
    handle: DispatchHandle  # for LoadBalancer.combine
    plan: RebalancePlan  # the plan every rank computed (same on all)


@dataclass(frozen=True)
class PlanAhead:
    """What dispatch_bundle's all-gather and plan would give, made before the sequences exist
    (LoadBalancer.plan_ahead): the plan, every rank's view of its features (local shares, then
    whether each feature's lengths are the cost lengths) and every rank's cost lengths."""

    plan: RebalancePlan
    extras: list[list[int]]
    costs: list[np.ndarray]


class PlannedSequences(dict):
    """An EmbeddingCollection's output (feature -> JaggedTensor) carrying plans made ahead for it,
    per LoadBalancer; a balanced module given it dispatches with that plan, no all-gather, as long
    as its entries are the ones it was made with (a model that replaces one gets the all-gather)."""

    def __init__(self, features: dict, plans: dict["LoadBalancer", PlanAhead]) -> None:
        super().__init__(features)
        self.plans = plans
        self._made_with = dict(features)

    def plan_for(self, balancer: "LoadBalancer") -> Optional[PlanAhead]:
        # the same entries in the same order (dispatch reads each feature's plan by position)
        same = list(self) == list(self._made_with) and all(self[k] is v for k, v in self._made_with.items())
        return self.plans.get(balancer) if same else None


class LoadBalancer:
    """Balances samples across the ranks of `group` (default WORLD) by `cost_model`.
    bytes_per_item: what one history item weighs when moved, for the planner's tie-breaking by
    bytes; None = the row size of the values passed to dispatch. `speed` (settable, each rank its
    own; default 1.0): this rank's relative compute speed (cost per second, any unit the ranks
    share), sent with the lengths: the plan evens load / speed (plan_rebalance's speeds)."""

    def __init__(self, cost_model: CostModel, group: Optional[dist.ProcessGroup] = None,
                 bytes_per_item: Optional[int] = None, *, tolerance: float = 1e-4) -> None:
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a freescale_comm.planner.CostModel, got {type(cost_model).__name__}")
        if bytes_per_item is not None and (isinstance(bytes_per_item, bool) or
                                           not isinstance(bytes_per_item, (int, np.integer)) or bytes_per_item < 0):
            raise ValueError(f"bytes_per_item must be None or an int >= 0, got {bytes_per_item!r}")
        if not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
        self.cost_model = cost_model
        self.group = group
        self.bytes_per_item = None if bytes_per_item is None else int(bytes_per_item)  # (a NumPy int: as the planner)
        self.tolerance = tolerance
        self._speed = 1.0

    @property
    def speed(self) -> float:
        return self._speed

    @speed.setter
    def speed(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"speed must be a positive finite number (this rank's relative compute speed), got {value!r}")
        self._speed = float(value)

    def _speed_bits(self) -> int:
        """This rank's speed as the int64 with its float64's bits (it rides on an int64 all-gather)."""
        return int(torch.tensor([self._speed], dtype=torch.float64).view(torch.int64))

    @staticmethod
    def _speeds(per_rank: list[Any]) -> list[float]:
        """Every rank's speed from the first int64 of its all-gathered vector."""
        return torch.tensor([int(v[0]) for v in per_rank], dtype=torch.int64).view(torch.float64).tolist()

    def plan(self, lengths: torch.Tensor, bytes_per_item: int = 1) -> RebalancePlan:
        """Collective: all-gathers every rank's sample lengths and plans (same plan on all)."""
        return self._plan(lengths, bytes_per_item, [])[0]

    def _plan(self, lengths: torch.Tensor, bytes_per_item: int, extra: list[int],
              codes: Sequence[int] = ()) -> tuple[RebalancePlan, list[list[int]], list[np.ndarray], list[list[int]]]:
        """plan(), with `extra` (ints, as many on every rank) and `codes` (ints, any number)
        riding on the same exchange; returns the plan, every rank's extra, every rank's lengths
        and every rank's codes."""
        if not dist.is_initialized():
            raise RuntimeError("LoadBalancer needs torch.distributed: call dist.init_process_group(...) first")
        head = [self._speed_bits(), len(extra), *extra, len(codes), *codes]
        mine = torch.cat([torch.tensor(head, dtype=torch.int64), lengths.to(torch.int64).cpu()])
        per_rank = _all_gather_host(communicator_for(self.group), mine)
        _check_widths([int(v[1]) // 2 for v in per_rank])  # features (a bundle's: two flags each; plain samples: 0)
        extras = [v[2:2 + len(extra)].tolist() for v in per_rank]
        at = 2 + len(extra)
        all_codes = [v[at + 1:at + 1 + int(v[at])].tolist() for v in per_rank]
        all_lengths = [v[at + 1 + int(v[at]):].numpy() for v in per_rank]
        plan = plan_rebalance(all_lengths, cost_model=self.cost_model, bytes_per_item=bytes_per_item,
                              tolerance=self.tolerance, speeds=self._speeds(per_rank))
        return plan, extras, all_lengths, all_codes

    def plan_ahead(self, comm: Any, batches: list[list[np.ndarray]], item_bytes: int) -> list[PlanAhead]:
        """Collective on `comm` (every rank in the same program order, e.g. a pipeline's worker while
        the batch before computes): the plans of len(batches) dispatch_bundle calls to come, one
        all-gather for all. batches: per call, this rank's lengths (int64 [samples]) of each feature
        of the sequences it will pass, in bundle.feature_order (by name), the cost being their longest (lengths=None);
        item_bytes: what one row of all features weighs (unless bytes_per_item says)."""
        mine = [self._speed_bits(), len(batches)]  # one speed for all of them
        for features in batches:
            lengths = [torch.from_numpy(np.ascontiguousarray(f, dtype=np.int64)) for f in features]
            cost = torch.stack(lengths).amax(0) if lengths else torch.zeros(0, dtype=torch.int64)
            extra = _feature_views(lengths, cost)
            mine += [len(extra), cost.numel(), *extra, *cost.tolist()]
        per_rank = [v.tolist() for v in _all_gather_host(comm, torch.tensor(mine, dtype=torch.int64))]
        if len({v[1] for v in per_rank}) > 1:
            raise comm_error(f"ranks planned different numbers of balanced batches ahead {[v[1] for v in per_rank]}")
        speeds = self._speeds(per_rank)
        at = [2] * len(per_rank)  # per rank: where its next batch starts
        out = []
        for _ in batches:
            extras, costs = [], []
            for r, v in enumerate(per_rank):
                width, n = v[at[r]], v[at[r] + 1]
                extras.append(v[at[r] + 2:at[r] + 2 + width])
                costs.append(np.asarray(v[at[r] + 2 + width:at[r] + 2 + width + n], dtype=np.int64))
                at[r] += 2 + width + n
            _check_widths([len(e) // 2 for e in extras])
            plan = plan_rebalance(costs, cost_model=self.cost_model, bytes_per_item=self.bytes_per_item
                                  if self.bytes_per_item is not None else item_bytes, tolerance=self.tolerance,
                                  speeds=speeds)
            out.append(PlanAhead(plan, extras, costs))
        return out

    @eager
    def dispatch(self, values: torch.Tensor, lengths: torch.Tensor, *, priority: int = 0) -> BalancedBatch:
        """Stage 1. Collective. `values`: rows of this rank's samples back to back; `lengths`:
        int64 rows per sample. Returns the balanced samples this rank now computes on."""
        # Local checks before the all-gather: fc.dispatch's own, plus negative or too long lengths
        # and the priority, which it would only find after this collective.
        priority = check_priority(priority)
        values, lengths = check_jagged_batch(values, lengths)
        host_lengths = lengths.cpu()  # the planner runs on the host (for CUDA tensors: one copy)
        if host_lengths.numel() and int(host_lengths.min()) < 0:
            raise ValueError(f"lengths has a negative entry ({int(host_lengths.min())}); lengths count rows")
        check_lengths_fit(host_lengths, values.shape[0])
        total = int(host_lengths.sum()) if host_lengths.numel() else 0
        if total != values.shape[0]:
            raise ValueError(f"lengths sum to {total}, but values has {values.shape[0]} rows; they must be equal")
        item_bytes = self.bytes_per_item
        if item_bytes is None:
            item_bytes = math.prod(values.shape[1:]) * values.element_size()
        plan = self.plan(host_lengths, item_bytes)
        rank = dist.get_rank(self.group)
        dest = to_device(torch.from_numpy(np.ascontiguousarray(plan.dest[rank])), values.device)
        res = dispatch(values, lengths, dest, group=self.group, priority=priority)
        return BalancedBatch(res.values, res.lengths, res.source_ranks, res.handle, plan)

    @eager
    def combine(self, values: torch.Tensor, handle: DispatchHandle, *, priority: int = 0) -> torch.Tensor:
        """Stage 2: rows computed here go back to their home ranks, in their original order."""
        return combine(values, handle, priority=priority)

    @eager
    def dispatch_bundle(self, sequences: Any, per_sample: Optional[dict[str, torch.Tensor]] = None, *,
                        lengths: Optional[torch.Tensor] = None, priority: int = 0,
                        _arguments: Optional[dict[str, Any]] = None) -> BalancedBundle:
        """Stage 1 for a TorchRec batch, after the EmbeddingCollection's output AllToAll.
        Collective. `sequences`: the EC's output (dict of JaggedTensors, one per feature, or a
        KeyedJaggedTensor), B samples each; `per_sample`: tensors with B rows of any dtype
        (labels, timestamps, num_targets) that move with their samples. A sample's cost is
        `lengths` (int64 [B]) if given, else its longest feature. Returns the bundle this rank
        computes on; combine_bundle sends outputs home."""
        priority = check_priority(priority)  # (local checks before the plan's exchange)
        sequences = resolved(sequences)
        if not is_sequence_batch(sequences):
            raise TypeError("sequences must be a KeyedJaggedTensor or a non-empty dict of JaggedTensors (an "
                            f"EmbeddingCollection's output), got {type(sequences).__name__}")
        jts = sequences.to_dict() if is_keyed_jagged(sequences) else sequences
        samples = {name: jt.lengths().numel() for name, jt in jts.items()}
        batch = next(iter(samples.values()))
        if any(n != batch for n in samples.values()):
            raise ValueError(f"the features of sequences hold different sample counts {samples}; every feature needs "
                             "one entry per sample")
        item_bytes = 0
        for name, jt in jts.items():
            check_jagged_batch(jt.values(), jt.lengths().long())
            item_bytes += math.prod(jt.values().shape[1:]) * jt.values().element_size()
        per_sample = dict(per_sample or {})
        for name, t in per_sample.items():
            if not has_rows_per_sample(t, batch):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"per_sample[{name!r}] must be a tensor with one row per sample ({batch}), got {shape}")
        if lengths is None:
            cost = torch.stack([jt.lengths().long() for jt in jts.values()]).amax(0)
        else:
            cost = lengths
            if not isinstance(cost, torch.Tensor) or cost.dtype != torch.int64 or cost.shape != (batch,):
                raise ValueError(f"lengths must be an int64 tensor of shape ({batch},) (a cost length per sample)")
        # Every rank's view of its features rides on the plan's exchange (all ranks must agree): which
        # can reuse an earlier one's dispatch (equal lengths), which have the cost lengths (then what
        # each rank receives of them is known from the plan)
        names = feature_order(jts)  # the order every rank moves them in, whatever its dict's
        feature_lengths = [jts[name].lengths().long() for name in names]
        ahead = sequences.plan_for(self) if lengths is None and isinstance(sequences, PlannedSequences) else None
        # fc.balance's hooks: the module's other arguments' leaves, each moved where it has one row per
        # sample on every rank (a rank-local look moved a fixed tensor on the ranks whose batch size
        # its rows happened to equal: SIZE_MISMATCH). Their codes ride on the plan's exchange.
        # which tensors require grad here (features' values and weights, per_sample's): each moved
        # tensor requires grad on every rank where it does on one (the backward is collective)
        sample_names = sorted(per_sample, key=repr)
        grads = [int(jts[n].values().requires_grad) | int(getattr(jts[n].weights_or_none(), "requires_grad", False)) << 1
                 for n in names] + [int(per_sample[k].requires_grad) for k in sample_names]
        # and the kinds (dtype, row shape) of what moves: bytes alone can agree where they differ
        kinds = [(jts[n].values().dtype, tuple(jts[n].values().shape[1:]),
                  getattr(jts[n].weights_or_none(), "dtype", None)) for n in names] + \
            [(per_sample[k].dtype, tuple(per_sample[k].shape[1:])) for k in sample_names]
        codes = [_names_code([*names, "per_sample:", *sample_names]), _names_code(kinds), len(grads), *grads] + \
            ([] if _arguments is None else _argument_codes(_arguments, batch, cost.device))
        if ahead is not None:  # every rank made it from these lengths: no all-gather, no host read
            plan, per_rank, all_costs = ahead.plan, ahead.extras, ahead.costs
            # (a module given only the sequences needs none: its hooks' argument leaves are empty)
            all_codes = [v.tolist() for v in _all_gather_host(communicator_for(self.group),
                                                             torch.tensor(codes, dtype=torch.int64))] \
                if _arguments else [codes]
        else:
            mine = _feature_views(feature_lengths, cost)
            plan, per_rank, all_costs, all_codes = self._plan(
                cost.cpu(), self.bytes_per_item if self.bytes_per_item is not None else item_bytes, mine, codes)
        _check_names([c[0] for c in all_codes], names, sample_names)  # (equal names: as many grad flags)
        _check_kinds([c[1] for c in all_codes], names, sample_names, kinds)
        ored = [functools.reduce(operator.or_, (c[3 + i] for c in all_codes)) for i in range(len(grads))]
        feature_grads = {n: (bool(ored[i] & 1), bool(ored[i] & 2)) for i, n in enumerate(names)}
        sample_grads = {k: bool(ored[len(names) + i]) for i, k in enumerate(sample_names)}
        all_codes = [c[3 + len(grads):] for c in all_codes]
        if _arguments is not None:
            moved, moved_grads = _agreed_moves(_arguments, all_codes)
            per_sample.update(moved)
            sample_grads.update(moved_grads)
        n = len(feature_lengths)
        follows_cost = [all(r[n + i] == 1 for r in per_rank) for i in range(n)]
        rank = dist.get_rank(self.group)
        dest = to_device(torch.from_numpy(np.ascontiguousarray(plan.dest[rank])), cost.device)  # (no stream sync)
        shares = agreed_shares([r[:n] for r in per_rank])
        return dispatch_bundle(sequences, per_sample, cost, dest, plan, self.group, priority, shares,
                               _received(plan, rank, all_costs), follows_cost,
                               sizes_differ_everywhere(plan.dest, all_costs, shares, follows_cost),
                               feature_grads, sample_grads)

    @eager
    def combine_bundle(self, output: Any, bundle: BalancedBundle, *, priority: int = 0) -> Any:
        """Stage 2 for dispatch_bundle: sends `output` home. Tensors with one row per sample,
        JaggedTensors laid out as a feature, and dicts/lists/tuples of them (see
        freescale_comm.bundle.combine_bundle)."""
        return combine_bundle(output, bundle, priority)


def _argument_codes(leaves: dict[str, Any], samples: int, device: torch.device) -> list[int]:
    """This rank's look at a balanced module's argument leaves (argument_leaves), for the plan's
    exchange: a hash of their paths, kinds and devices, then per leaf bit 0: it has one row per
    sample here on the samples' device; bit 1: its rows require grad."""
    shape = "\0".join(f"{p}:{leaf_kind(x)}" for p, x in leaves.items())
    flags = []
    for x in leaves.values():
        rows = leaf_rows(x)
        fits = rows is not None and rows.device == device and has_rows_per_sample(rows, samples)
        flags.append(int(fits) | int(fits and rows.requires_grad) << 1)
    return [zlib.crc32(shape.encode()), *flags]


def _agreed_moves(leaves: dict[str, Any], all_codes: list[list[int]]) -> tuple[dict[str, torch.Tensor], dict[str, bool]]:
    """The leaves every rank moves (one row per sample on every rank) and, per moved leaf, whether
    it requires grad on some rank; or CommError on every rank where ranks passed arguments of
    different shapes."""
    by = ranks_by([(c[0], len(c) - 1) for c in all_codes])
    if len(by) > 1:
        raise comm_error("the ranks passed a balanced module's other arguments in different structures (" +
                         ", ".join(f"ranks {ranks}: {n} tensors, layout {h:#010x}" for (h, n), ranks in by.items()) +
                         "): every rank must pass the same arguments, tensors at the same places")
    jagged = [p for p, x in leaves.items() if leaf_kind(x) == "j"]
    if jagged:  # on every rank alike (the structures agree)
        raise TypeError(f"{jagged[0]}: a jagged argument beside the sequences cannot be balanced with them (its own "
                        "lengths); make it a feature of the sequences (the first argument)")
    moved, grads = {}, {}
    for i, (path, leaf) in enumerate(leaves.items(), start=1):
        if all(c[i] & 1 for c in all_codes):
            moved[path] = leaf_rows(leaf)
            grads[path] = any(c[i] & 2 for c in all_codes)
    return moved, grads


def _feature_views(lengths: list[torch.Tensor], cost: torch.Tensor) -> list[int]:
    """A rank's view of its features, for the plan's exchange: per feature the earlier one with equal
    lengths here (or -1), then per feature 1 if its lengths are the cost lengths."""
    return local_shares(lengths) + [int(torch.equal(f, cost.to(f.device, non_blocking=True))) for f in lengths]


def _names_code(names: list[Any]) -> int:
    """A hash of a batch's feature names (in feature_order), for the plan's exchange."""
    return zlib.crc32("\0".join(map(repr, names)).encode())


def _check_names(codes: list[int], names: list[Any], sample_names: list[str]) -> None:
    """CommError unless every rank balanced features and per_sample tensors of the same names
    (`codes`: every rank's _names_code; `names`, `sample_names`: this rank's). They move by name,
    not by their place in a dict."""
    by = ranks_by(codes)
    if len(by) > 1:
        here = f"{names}" + (f", per_sample {sample_names}" if sample_names else "")
        raise comm_error("ranks balanced features of different names (" +
                         ", ".join(f"ranks {ranks}: names {code:#010x}" for code, ranks in by.items()) +
                         f"; here: {here}): every rank's batch needs the same features, by name")


def _check_kinds(codes: list[int], names: list[Any], sample_names: list[str], kinds: list[tuple]) -> None:
    """CommError unless every rank's features and per_sample tensors of each name have the same
    dtype and row shape (`codes`: every rank's hash of them; `kinds`: this rank's, in names' order)."""
    here = ", ".join(f"{n!r}: {k}" for n, k in zip([*names, *sample_names], kinds))
    refuse_differing_kinds(codes, "ranks balanced features or per_sample tensors of different dtypes or row shapes",
                           f"here (dtype, row shape, weights' dtype): {here}; each must be of one kind on every rank")


def _check_widths(widths: list[int]) -> None:
    """CommError unless every rank balanced the same number of features."""
    if len(set(widths)) > 1:
        by = {w: [r for r, x in enumerate(widths) if x == w] for w in sorted(set(widths))}
        raise comm_error("ranks balanced batches of different features (" +
                        ", ".join(f"ranks {ranks}: {w}" for w, ranks in by.items()) +
                        "): every rank's batch needs the same features, each through dispatch_bundle or each "
                        "through dispatch")


def _received(plan: RebalancePlan, rank: int, lengths: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """What `rank` receives under `plan`, every rank's `lengths` known: int64 host tensors, the
    lengths and source ranks of its samples, by source rank, then original order."""
    picked = [dest == rank for dest in plan.dest]
    got = np.concatenate([np.asarray(l, dtype=np.int64)[p] for l, p in zip(lengths, picked)])
    sources = np.concatenate([np.full(int(p.sum()), r, dtype=np.int64) for r, p in enumerate(picked)])
    return torch.from_numpy(got), torch.from_numpy(sources)


def _all_gather_host(comm: Any, vector: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's int64 host vector (lengths may differ), in rank order: its length, then the
    vectors, on `comm` (two AllToAlls)."""
    world, n = comm.world_size, vector.numel()
    sizes = torch.empty(world, dtype=torch.int64)
    comm.all_to_all_single(sizes, torch.full((world,), n, dtype=torch.int64))
    counts = sizes.tolist()
    out = torch.empty(sum(counts), dtype=torch.int64)
    comm.all_to_all_single(out, vector.repeat(world), counts, [n] * world)
    return list(out.split(counts))


class _BalancedDict(dict):
    """The balanced dict of JaggedTensors a module gets (a dict that the hooks can weakly refer to)."""


class _BalanceHooks:
    """The hooks fc.balance put on a module; .remove() takes them off."""

    def __init__(self, module: torch.nn.Module, balancer: LoadBalancer, measure_speed: bool = False) -> None:
        self.balancer = balancer
        self._module = weakref.ref(module)
        self.speed_meter = SpeedMeter() if measure_speed else None  # sets balancer.speed before each plan
        self._device = torch.device("cpu")  # where the forward being timed runs
        # Balanced first input -> what sends the outputs home (a dispatch handle or a bundle),
        # until the forward hook does.
        self._pending: list[tuple[Any, Any]] = []
        self.last_plan: Optional[RebalancePlan] = None  # the plan of the latest forward (loads, imbalance)
        self._hooks = [module.register_forward_pre_hook(self._before, with_kwargs=True),
                       module.register_forward_hook(self._after, with_kwargs=True)]

    @eager
    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._pending = [(ref, h) for ref, h in self._pending if ref() is not None]  # a forward that raised
        args = tuple(resolved(a) for a in args)  # TorchRec's lazy outputs: what they stand for
        kwargs = {k: resolved(a) for k, a in kwargs.items()}
        if self.speed_meter is not None:
            speed = self.speed_meter.update()
            if speed is not None:
                self.balancer.speed = speed  # rides on this forward's plan exchange
        if args and is_sequence_batch(args[0]):
            return self._before_bundle(args, kwargs)
        if len(args) < 2:
            raise TypeError("a module balanced by fc.balance takes (values, lengths, ...) or (sequences, ...) "
                            "positionally, sequences being an EmbeddingCollection's output")
        batch = self.balancer.dispatch(args[0], args[1])
        self.last_plan = batch.plan
        self._measure_from(batch.plan, batch.values.device)
        self._pending.append((weakref.ref(batch.values), batch.handle))
        return (batch.values, batch.lengths, *args[2:]), kwargs

    def _before_bundle(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """sequences first; every other argument's tensors with one row per sample on every rank move
        with them (LoadBalancer.dispatch_bundle's _arguments)."""
        leaves: dict[str, Any] = {}
        for i, a in enumerate(args[1:], start=1):
            leaves.update(argument_leaves(a, f"arg{i}"))
        for k in sorted(kwargs):  # the same order on every rank
            leaves.update(argument_leaves(kwargs[k], f"kw_{k}"))
        bundle = self.balancer.dispatch_bundle(args[0], {}, _arguments=leaves)
        self.last_plan = bundle.plan
        if self.speed_meter is not None:  # (bundle_inputs splits a KJT: not on every forward for nothing)
            moved = bundle_inputs(bundle)
            self._measure_from(bundle.plan, moved[0].device if moved else torch.device("cpu"))
        sequences = bundle.sequences if is_keyed_jagged(bundle.sequences) else _BalancedDict(bundle.sequences)
        new_args = tuple(with_moved(a, bundle.per_sample, f"arg{i}") for i, a in enumerate(args[1:], start=1))
        new_kwargs = {k: with_moved(a, bundle.per_sample, f"kw_{k}") for k, a in kwargs.items()}
        self._pending.append((weakref.ref(sequences), bundle))
        return (sequences, *new_args), new_kwargs

    def _measure_from(self, plan: RebalancePlan, device: torch.device) -> None:
        """The speed meter times this forward of the cost the plan gave this rank."""
        if self.speed_meter is not None:
            self._device = device
            self.speed_meter.start(float(plan.loads_after[dist.get_rank(self.balancer.group)]), device)

    @eager
    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        for i, (ref, home) in enumerate(self._pending):
            if args and ref() is args[0]:
                del self._pending[i]
                if self.speed_meter is not None:
                    self.speed_meter.stop(self._device)
                if isinstance(home, BalancedBundle):
                    return self.balancer.combine_bundle(
                        _joined(output, bundle_inputs(home), empty=home.num_samples == 0), home)
                if not isinstance(output, torch.Tensor):
                    raise TypeError("a module balanced by fc.balance must return one tensor with a row-block per sample")
                return self.balancer.combine(_joined(output, [args[0]], empty=args[0].shape[0] == 0), home)
        raise RuntimeError("fc.balance: forward hook without a matching dispatch (was the input replaced?)")

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        module = self._module()
        if module is not None and getattr(module, "freescale_balance", None) is self:
            module.freescale_balance = None


class _Join(torch.autograd.Function):
    """out = x, whose backward also gives `inputs` zero gradients: a module output that does not
    depend on the balanced inputs (fresh zeros for an empty batch) still runs their dispatch's
    backward, which is collective (its peers wait there for this rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in inputs]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        zero = torch.zeros((), dtype=grad.dtype, device=grad.device)
        if torch.is_grad_enabled():  # create_graph: the zeros depend on grad, so a second order reaches
            zero = grad.sum() * 0    # what produced it on this rank as on its peers (0 rows here: exactly 0)
        # A device-to-device .to() would be a blocking copy on CUDA: inputs on another device get fresh zeros
        return (grad, *(zero.to(dtype).expand(shape) if zero.device == device else torch.zeros(shape, dtype=dtype, device=device)
                        for shape, dtype, device in ctx.shapes))


def _joined(output: Any, inputs: list[torch.Tensor], empty: bool = False) -> Any:
    """`output`, its first floating tensor that does not require grad joined to `inputs` that do
    (under grad mode), where one such exists: see _Join. `empty` (no sample here): the first
    floating tensor, grad or not (it may require grad through parameters alone, never through the
    inputs; the join costs nothing on zero rows)."""
    inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not inputs or not torch.is_grad_enabled():
        return output
    if isinstance(output, torch.Tensor):
        joins = output.is_floating_point() and (empty or not output.requires_grad)
        return _Join.apply(output, *inputs) if joins else output
    if is_jagged(output):
        values = _joined(output.values(), inputs, empty)
        return output if values is output.values() else type(output)(
            values=values, lengths=output.lengths(), weights=output.weights_or_none())
    if isinstance(output, dict):
        for k, v in output.items():
            joined = _joined(v, inputs, empty)
            if joined is not v:
                return rebuilt(output, {k: joined})
    elif isinstance(output, (list, tuple)):
        for i, v in enumerate(output):
            joined = _joined(v, inputs, empty)
            if joined is not v:
                return rebuilt(output, [*output[:i], joined, *output[i + 1:]])
    return output


def balance(module: torch.nn.Module, cost_model: CostModel, *, group: Optional[dist.ProcessGroup] = None,
            bytes_per_item: Optional[int] = None, measure_speed: bool = False) -> torch.nn.Module:
    """Balances every forward of `module`: its inputs are dispatched by a LoadBalancer before it
    runs and its output is combined home after (gradients follow). Either forward(values,
    lengths, ...) returning one row-block per sample, or a TorchRec sequence module:
    forward(sequences, ...) with an EmbeddingCollection's output first; its other tensor
    arguments with one row per sample move along (also inside KeyedTensors, dicts, lists and
    tuples; a jagged one beside the sequences is refused), and its output goes home as
    LoadBalancer.combine_bundle says. Returns the module; its `freescale_balance.remove()` takes
    the hooks off. measure_speed: each forward's time sets the balancer's speed for the next plan
    (freescale_comm._speed_meter: a rank slowed by other work gets less); off by default, as
    plans then follow timings and differ from run to run."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if getattr(module, "freescale_balance", None) is not None:
        raise ValueError("module is already balanced by fc.balance; call module.freescale_balance.remove() first")
    if not isinstance(measure_speed, bool):
        raise TypeError(f"measure_speed must be True or False, got {measure_speed!r}")
    module.freescale_balance = _BalanceHooks(module, LoadBalancer(cost_model, group, bytes_per_item), measure_speed)
    return module
