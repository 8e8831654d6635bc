"""Rank functions: fc.balance inside fc.TrainPipelinePEC (balance=), for test_pipeline_balance.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.sparse.jagged_tensor import JaggedTensor

import freescale_comm as fc
from freescale_comm.planner import CostModel
from dmp_programs import Batch
from pec_pipeline_programs import (DIM, POOLED, ROWS, SEQUENCE, BalancedModel, CountingPlans, _collections, _state,
                                   build, long_histories_on_rank0, make_batches)

COST = CostModel(quadratic=1.0, linear=0.0, constant=1.0)


def _sparse(batch):
    return {"ebc": batch.pooled, "ec": batch.sequence}


class AllFeaturesTower(nn.Module):
    """Per-sample work on every feature of the EC output (items, cats, hist)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(DIM, DIM, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w.copy_(torch.linspace(-0.5, 0.5, DIM * DIM, device=self.w.device).view(DIM, DIM))

    def forward(self, sequences: dict) -> torch.Tensor:
        n = sequences["items"].lengths().numel()
        out = torch.zeros(n, DIM)
        for scale, name in enumerate(("items", "cats", "hist"), start=1):
            jt = sequences[name]
            seg = torch.repeat_interleave(torch.arange(n), jt.lengths())
            out = out + scale * torch.zeros(n, DIM).index_add(0, seg, torch.tanh(jt.values() @ self.w))
        return out


class AllFeaturesModel(BalancedModel):
    """The EC output as it is (PlannedSequences: the plan made ahead) into AllFeaturesTower."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.tower = AllFeaturesTower(device)

    def sequences(self, seq):
        return seq

    def forward(self, batch: Batch):
        pooled = self.ebc(batch.pooled)
        user = self.tower(self.sequences(self.ec(batch.sequence)))
        logits = self.head(torch.cat([pooled.values(), user], dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum"), logits.detach()


class ReorderedModel(AllFeaturesModel):
    """Puts "items" last in the EC's output dict (the same JaggedTensor objects, popped and put
    back), then calls the tower."""

    def sequences(self, seq):
        seq["items"] = seq.pop("items")
        return seq


class ReorderedCopyModel(AllFeaturesModel):
    """The same order as ReorderedModel, in a plain dict (no plan made ahead: the all-gather)."""

    def sequences(self, seq):
        out = dict(seq)
        out["items"] = out.pop("items")
        return out


def _equal_items_and_cats(batches):
    """cats gets the lengths of items on every rank (fresh ids), hist keeps its own."""
    gen = torch.Generator().manual_seed(5)
    for row in batches:
        for r, b in enumerate(row):
            jts = b.sequence.to_dict()
            items = jts["items"]
            cats = JaggedTensor(values=torch.randint(0, ROWS, (items.values().numel(),), generator=gen),
                                lengths=items.lengths())
            new = KeyedJaggedTensor.from_jt_dict({"items": items, "cats": cats, "hist": jts["hist"]})
            row[r] = Batch(b.pooled, new, b.label)
    return batches


def _train(pg, model_cls, batches, steps, pipeline="pec", **kwargs):
    rank = dist.get_rank(pg)
    dmp, opt = build(pg, "rowwise_adagrad", model_cls)
    if pipeline == "pec":
        pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, sparse_inputs=_sparse, **kwargs)
    else:
        fc.balance(dmp.module.tower, COST, group=pg)
        pipe = TrainPipelineSparseDist(dmp, opt, torch.device("cpu"))
    feed = iter([b[rank] for b in batches])
    with CountingPlans() as counted:
        outputs = [pipe.progress(feed).clone() for _ in range(steps)]
    if pipeline == "pec":
        pipe.close()
    return {"outputs": outputs, "state": _state(dmp, opt), "gathered": counted.gathered, "ahead": counted.ahead}


def _diff(a, b):
    out = max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a["outputs"], b["outputs"]))
    state = max(float((a["state"][k] - b["state"][k]).abs().max()) if a["state"][k].numel() else 0.0
                for k in a["state"])
    return {"outputs": out, "state": state}


def reordered_sequences(info, steps: int) -> dict:
    """ReorderedModel (plan made ahead reused: same entries, other order) against ReorderedCopyModel
    (all-gather on the main thread), same data: must be bit for bit equal."""
    pg = dist.group.WORLD
    batches = _equal_items_and_cats(long_histories_on_rank0(make_batches(steps, dist.get_world_size(), 0.5,
                                                                         seed=21, batch=6)))
    out = {}
    ref = _train(pg, ReorderedCopyModel, batches, steps, balance={"tower": COST})
    try:
        got = _train(pg, ReorderedModel, batches, steps, balance={"tower": COST})
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:600], "ref_gathered": ref["gathered"]}
    out["diff"] = _diff(ref, got)
    out["ahead"] = got["ahead"]
    return out


def different_cost_models(info, steps: int) -> str:
    """Ranks pass balance={"tower": <a different CostModel on each rank>}: README says ranks built
    with different `balance` get a ValueError naming the argument."""
    pg = dist.group.WORLD
    rank = dist.get_rank()
    cost = CostModel(quadratic=1.0, linear=0.0, constant=1.0) if rank == 0 else \
        CostModel(quadratic=0.0, linear=0.0, constant=1.0)
    dmp, opt = build(pg, "rowwise_adagrad", BalancedModel)
    try:
        pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, balance={"tower": cost})
    except ValueError as e:
        return f"ValueError at construction: {e}"
    batches = long_histories_on_rank0(make_batches(steps, dist.get_world_size(), 0.5, seed=21, batch=6))
    feed = iter([b[rank] for b in batches])
    try:
        for _ in range(steps):
            pipe.progress(feed)
        what = "ran"
    except Exception as e:  # noqa: BLE001
        what = f"{type(e).__name__} at progress: {e}"[:400]
    try:
        pipe.close()
    except Exception:  # noqa: BLE001
        pass
    return what


def balance_names_sharded_ec(info, steps: int, swap: bool) -> str:
    """balance={"ec": cost}: the balancer's pre-hook moves the EC's *input* KJT (ids) between ranks.
    Should be refused at construction (the module is the sharded EC the pipeline drives).
    swap=True: data where the balanced KJT has the same keys, stride, values and lengths counts
    as the pipeline's (the check in _forward_of passes) -> returns the max output difference
    against the same model without balance."""
    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    if swap:
        batches = _swap_batches(steps, world)
    else:
        batches = long_histories_on_rank0(make_batches(steps, world, 0.5, seed=21, batch=6))
    dmp, opt = build(pg, "rowwise_adagrad", BalancedModel)
    try:
        pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, balance={"ec": COST})
    except ValueError as e:
        return f"ValueError at construction: {e}"
    feed = iter([b[rank] for b in batches])
    try:
        outs = [pipe.progress(feed).clone() for _ in range(steps)]
    except Exception as e:  # noqa: BLE001
        try:
            pipe.close()
        except Exception:  # noqa: BLE001
            pass
        return f"{type(e).__name__} at progress: {e}"[:500]
    pipe.close()
    dmp, opt = build(pg, "rowwise_adagrad", BalancedModel)
    pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg)
    feed = iter([b[rank] for b in batches])
    ref = [pipe.progress(feed).clone() for _ in range(steps)]
    pipe.close()
    return f"ran; max output diff vs unbalanced {max(float((a - b).abs().max()) for a, b in zip(outs, ref))}"


def _swap_batches(steps: int, world: int):
    """2 samples per rank. Rank 0: two samples with items of 4 ids (cats, hist empty): load 2x17;
    rank 1: two samples with items 2, cats 2: 2x5. Optimal: one of each per rank (a swap), so each
    rank keeps 2 samples and 8 sequence ids: the balanced KJT has the pipeline's layout."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        row = []
        for r in range(world):
            if r == 0:
                lengths = {"items": [4, 4], "cats": [0, 0], "hist": [0, 0]}
            else:
                lengths = {"items": [2, 2], "cats": [2, 2], "hist": [0, 0]}
            lens = torch.tensor([v for f in SEQUENCE for v in lengths[f]])
            seq = KeyedJaggedTensor(keys=list(SEQUENCE), values=torch.randint(0, ROWS, (int(lens.sum()),), generator=gen),
                                    lengths=lens)
            plens = torch.ones(len(POOLED) * 2, dtype=torch.int64)
            pooled = KeyedJaggedTensor(keys=list(POOLED), values=torch.randint(0, ROWS, (int(plens.sum()),), generator=gen),
                                       lengths=plens)
            row.append(Batch(pooled, seq, torch.tensor([0.0, 1.0])))
        out.append(row)
    return out


def close_after_user_removed_hooks(info) -> str:
    """The user takes fc.balance off the tower (module.freescale_balance.remove(), the documented
    way) and later closes the pipeline."""
    pg = dist.group.WORLD
    rank = dist.get_rank()
    dmp, opt = build(pg, "rowwise_adagrad", BalancedModel)
    pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, balance={"tower": COST})
    batches = make_batches(2, dist.get_world_size(), 0.5, seed=3)
    feed = iter([b[rank] for b in batches])
    pipe.progress(feed)
    dmp.module.tower.freescale_balance.remove()
    pipe.progress(feed)
    try:
        pipe.close()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "closed"


class CountedTower(AllFeaturesTower):
    """AllFeaturesTower whose 'time' is counted, not measured: each forward advances a shared clock
    by the cost the plan gave this rank times the rank's slowness."""

    clock = {"now": 0.0}
    slowness = 1.0

    def forward(self, sequences: dict) -> torch.Tensor:
        plan = self.freescale_balance.last_plan
        CountedTower.clock["now"] += float(plan.loads_after[dist.get_rank()]) * CountedTower.slowness
        return super().forward(sequences)


class CountedModel(AllFeaturesModel):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.tower = CountedTower(device)


def measured_speeds(info, steps: int) -> dict:
    """TrainPipelinePEC(balance=..., measure_speed=...) with rank 1 computing at half speed (a counted
    clock): the speeds of every balanced forward's plan, its loads, and the outputs against a run
    that does not measure (the same samples each computes: equal within float rounding)."""
    from freescale_comm import _speed_meter

    pg = dist.group.WORLD
    CountedTower.slowness = 2.0 if dist.get_rank() == 1 else 1.0
    _speed_meter.SpeedMeter.clock = staticmethod(lambda: CountedTower.clock["now"])
    batches = _equal_items_and_cats(make_batches(steps, dist.get_world_size(), 0.5, seed=23, batch=8))
    out = {}
    for measure in (True, False):
        plans = []
        original = CountedTower.forward

        def recording(tower, sequences):
            plan = tower.freescale_balance.last_plan
            plans.append({"speeds": None if plan.speeds is None else plan.speeds.tolist(),
                          "loads": plan.loads_after.tolist()})
            return original(tower, sequences)

        CountedTower.forward = recording
        try:
            out[measure] = _train(pg, CountedModel, batches, steps, balance={"tower": COST}, measure_speed=measure)
        finally:
            CountedTower.forward = original
        out[measure]["plans"] = plans
    return {"plans": out[True]["plans"], "plans_unmeasured": out[False]["plans"], "ahead": out[True]["ahead"],
            "diff": _diff(out[True], out[False])}


def measure_speed_without_balance(info) -> str:
    dmp, opt = build(dist.group.WORLD, "rowwise_adagrad", BalancedModel)
    try:
        fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), measure_speed=True)
    except ValueError as e:
        return f"ValueError: {e}"
    return "built"


def balance_in_the_pipeline(info) -> dict:
    """The cases of test_pipeline_balance, one spawn (2 ranks)."""
    return {"reordered": reordered_sequences(info, 3), "cost_models": different_cost_models(info, 3),
            "sharded_target": balance_names_sharded_ec(info, 2, False),
            "removed_hooks": close_after_user_removed_hooks(info),
            "measured_speeds": measured_speeds(info, 5), "measure_without_balance": measure_speed_without_balance(info)}
