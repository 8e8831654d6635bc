"""Rank functions for the LoadBalancer tests: balanced computation must equal unbalanced
computation (outputs and gradients), and every rank must plan the same."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import freescale_comm as fc
from freescale_comm.planner import CostModel

CM = CostModel(quadratic=1.0, linear=0.0, constant=0.0)


def _rank_batch(rank: int, seed: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + rank)
    # Rank 0 is the straggler: long samples; the others short ones (some empty).
    hi = 40 if rank == 0 else 6
    lengths = torch.randint(0, hi, (5 + rank,), generator=gen)
    values = torch.randn(int(lengths.sum()), dim, generator=gen)
    return values, lengths


class JaggedCausalMix(torch.nn.Module):
    """Per sample: row t becomes a weighted mean of rows 0..t of the same sample (a causal mix,
    like attention with uniform scores), then a linear layer. Uses lengths, so rows must arrive
    grouped by sample."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(dim) * 0.5 + 0.01)
            self.proj.bias.fill_(0.1)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        out = []
        for block in torch.split(values, lengths.tolist()):
            steps = torch.arange(1, block.shape[0] + 1, dtype=block.dtype, device=block.device).unsqueeze(1)
            out.append(torch.cumsum(block, 0) / steps)
        mixed = torch.cat(out) if out else values[:0]
        return self.proj(mixed)


def balanced_equals_unbalanced(info, seed: int, dim: int, device: str = "cpu") -> dict:
    """On `device` (CUDA: every rank on GPU 0); reductions and checks on the host."""
    rank, world = info.rank, info.world_size
    if device == "cuda":
        torch.cuda.set_device(0)
    values, lengths = (t.to(device) for t in _rank_batch(rank, seed, dim))
    model = JaggedCausalMix(dim).to(device)

    x_ref = values.clone().requires_grad_()
    ref = model(x_ref, lengths)
    ref_loss = (ref * ref).sum()
    ref_loss.backward()
    ref_weight_grad = model.proj.weight.grad.clone().cpu()
    model.zero_grad()

    lb = fc.LoadBalancer(CM)
    x = values.clone().requires_grad_()
    batch = lb.dispatch(x, lengths)
    y = model(batch.values, batch.lengths)
    home = lb.combine(y, batch.handle)
    loss = (home * home).sum()
    loss.backward()
    losses = torch.stack([loss.detach(), ref_loss.detach()]).cpu()
    dist.all_reduce(losses)  # the step's loss over all ranks, balanced vs not
    assert torch.allclose(losses[0], losses[1], rtol=1e-5), losses
    assert torch.allclose(home, ref, atol=1e-5), "balanced forward differs"
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5), "balanced input gradient differs"
    # Weight gradients: each rank computed on other samples; their sum over ranks must agree.
    total, total_ref = model.proj.weight.grad.clone().cpu(), ref_weight_grad
    dist.all_reduce(total)
    dist.all_reduce(total_ref)
    assert torch.allclose(total, total_ref, atol=1e-4), "summed weight gradients differ"

    plan = batch.plan
    plans = [None] * world
    dist.all_gather_object(plans, [d.tolist() for d in plan.dest])
    assert all(p == plans[0] for p in plans), "ranks computed different plans"
    assert batch.values.device == values.device and batch.lengths.device == values.device
    received = CM.cost(batch.lengths.cpu().numpy()).sum()
    assert np.isclose(received, plan.loads_after[rank]), (received, plan.loads_after[rank])
    return {"before": plan.imbalance_before, "after": plan.imbalance_after, "moved": plan.moved_samples}


def module_hook_form(info, seed: int, dim: int) -> float:
    rank = info.rank
    values, lengths = _rank_batch(rank, seed, dim)
    plain = JaggedCausalMix(dim)
    balanced = fc.balance(JaggedCausalMix(dim), CM)
    x_ref = values.clone().requires_grad_()
    ref = plain(x_ref, lengths)
    ref.sum().backward()
    x = values.clone().requires_grad_()
    out = balanced(x, lengths)
    out.sum().backward()
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-5)
    balanced.freescale_balance.remove()
    assert balanced.freescale_balance is None
    again = balanced(values, lengths)  # hooks off: plain local forward
    assert torch.allclose(again, ref.detach(), atol=1e-5)
    return float(out.sum())


def balancer_over_an_nccl_group(info) -> bool:
    """LoadBalancer.dispatch / combine of CUDA tensors over the default group when it is NCCL's,
    which refuses host tensors: the plan's lengths must not go through it. Whether the samples
    came home."""
    torch.cuda.set_device(0)
    balancer = fc.LoadBalancer(CostModel(quadratic=1.0, linear=0.0, constant=1.0))
    lengths = torch.tensor([3, 0, 5, 2], device="cuda")
    values = torch.randn(10, 4, device="cuda")
    batch = balancer.dispatch(values, lengths)
    return bool(torch.equal(balancer.combine(batch.values, batch.handle), values))


def plans_ahead_equal_plans_at_dispatch(info, batches: int) -> list[dict]:
    """LoadBalancer.plan_ahead of `batches` sequence batches at once (3 features each, the first two
    with equal lengths on every rank, the third equal to them on rank 0 only; some batches empty on
    some ranks) against what dispatch_bundle's own all-gather and plan give for each: the same plan,
    every rank's feature views and cost lengths."""
    from freescale_comm.bundle import local_shares
    from freescale_comm.dispatch import communicator_for

    rank = dist.get_rank()
    balancer = fc.LoadBalancer(CM)
    gen = torch.Generator().manual_seed(7 + rank)
    per_batch = []
    for b in range(batches):
        samples = 0 if (b, rank) in {(1, 2), (2, 0)} else 3 + rank + b
        shared = torch.randint(0, 9, (samples,), generator=gen)
        third = shared.clone() if rank == 0 else torch.randint(0, 9, (samples,), generator=gen)
        per_batch.append([shared, shared.clone(), third])
    ahead = balancer.plan_ahead(communicator_for(None), [[f.numpy() for f in fs] for fs in per_batch], 12)
    out = []
    for features, made in zip(per_batch, ahead):
        cost = torch.stack(features).amax(0)
        mine = local_shares(features) + [int(torch.equal(f, cost)) for f in features]
        plan, extras, costs, _ = balancer._plan(cost, 12, mine)
        out.append({"same_plan": all(np.array_equal(a, b) for a, b in zip(plan.dest, made.plan.dest)),
                    "same_extras": extras == made.extras,
                    "same_costs": all(np.array_equal(a, b) for a, b in zip(costs, made.costs)),
                    "samples": [len(c) for c in costs]})
    return out


class _ShortCircuit(torch.nn.Module):
    """Per-row work; an empty batch returns fresh zeros (no grad), as modules often do."""

    def __init__(self, through_parameters: bool = False) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([1.5, -0.5]))
        self.through_parameters = through_parameters  # the empty batch's zeros require grad (a parameter's)

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if lengths.numel() == 0:
            return torch.zeros(0, 2) * self.scale if self.through_parameters else torch.zeros(0, 2)
        return values ** 2 * self.scale


def ranks_whose_batches_differ_in_requires_grad(info, case: str) -> dict:
    """Every rank's gradient equals the unbalanced module's. "empty_input": rank 1 holds no samples
    and passes an empty tensor built by hand (no grad) while rank 0's values require grad: rank 1
    computes some of rank 0's samples, which got no gradient (rank 1's copy did not require grad, so
    it never ran the dispatch's backward: rank 0 waited there, then CommError). "short_circuit": rank 1
    has nothing to compute and its module returns fresh zeros: its combine's result did not require
    grad (loss.backward() raised there) and the dispatch's backward never ran on it."""
    rank = info.rank
    emb = torch.nn.Linear(2, 2)
    torch.manual_seed(3)
    emb.reset_parameters()
    if case == "empty_input":
        lengths = torch.tensor([8, 1, 1, 1] if rank == 0 else [], dtype=torch.int64)
    else:
        lengths = torch.tensor([5] if rank == 0 else [], dtype=torch.int64)
    raw = torch.randn(int(lengths.sum()), 2, generator=torch.Generator().manual_seed(rank))
    module = _ShortCircuit(through_parameters=case == "parameters_only")
    values = emb(raw) if rank == 0 or case != "empty_input" else torch.empty(0, 2)
    reference = module(values, lengths).sum()
    if reference.requires_grad:  # (not on rank 1: nothing to compute, nothing to differentiate)
        reference.backward()
    ref = emb.weight.grad.clone() if emb.weight.grad is not None else torch.zeros(2, 2)
    emb.weight.grad = None

    fc.balance(module, CostModel(quadratic=1.0))
    values = emb(raw) if rank == 0 or case != "empty_input" else torch.empty(0, 2)
    out = module(values, lengths)
    out.sum().backward()
    got = emb.weight.grad if emb.weight.grad is not None else torch.zeros(2, 2)
    return {"equal": torch.allclose(got, ref, rtol=1e-6, atol=1e-7), "computed": module.freescale_balance.last_plan.moved_samples}


def a_gradient_penalty_beside_an_empty_rank(info) -> bool:
    """create_graph=True through fc.balance while rank 1 has nothing to compute (its module returns
    fresh zeros): its gradient did not require grad, or its graph stopped short of rank 0's, and
    the second backward's movements ran on rank 0 only (CommError). Returns whether rank 0's
    second-order gradient equals the unbalanced one."""
    rank = info.rank
    lengths = torch.tensor([5] if rank == 0 else [], dtype=torch.int64)
    values = torch.randn(int(lengths.sum()), 2, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    module = _ShortCircuit()
    grads = []
    for balanced in (False, True):
        if balanced:
            fc.balance(module, CostModel(quadratic=1.0))
        loss = module(values, lengths).sum()
        if loss.requires_grad:
            (g,) = torch.autograd.grad(loss, values, create_graph=True)
            (loss + (g ** 2).sum()).backward()
        grads.append(values.grad.clone() if values.grad is not None else torch.zeros_like(values))
        values.grad = None
    return torch.allclose(grads[0], grads[1])


def balancing_under_torch_compile(info) -> dict[str, bool]:
    """fc.dispatch / fc.combine, LoadBalancer.dispatch / combine and a module under fc.balance,
    each inside torch.compile (aot_eager): outputs and input gradients equal eager ones (Dynamo
    traced into the communicator lookup and raised on every rank)."""
    torch.manual_seed(0)
    model = JaggedCausalMix(4)
    values, lengths = _rank_batch(info.rank, 7, 4)
    dest = (torch.arange(lengths.numel()) + 1) % info.world_size
    lb = fc.LoadBalancer(CM)

    def direct(v: torch.Tensor) -> torch.Tensor:
        res = fc.dispatch(v, lengths, dest)
        return fc.combine(model(res.values, res.lengths), res.handle)

    def balanced(v: torch.Tensor) -> torch.Tensor:
        b = lb.dispatch(v, lengths)
        return lb.combine(model(b.values, b.lengths), b.handle)

    def run(fn) -> tuple[torch.Tensor, torch.Tensor]:
        v = values.clone().requires_grad_()
        out = fn(v)
        out.pow(2).sum().backward()
        return out.detach(), v.grad

    same = {}
    for name, fn in (("dispatch_combine", direct), ("load_balancer", balanced)):
        eager_out, eager_grad = run(fn)
        out, grad = run(torch.compile(fn, backend="aot_eager"))
        same[name] = torch.equal(out, eager_out) and torch.equal(grad, eager_grad)
    eager_out, eager_grad = run(lambda v: model(v, lengths))
    fc.balance(model, CM)
    out, grad = run(torch.compile(lambda v: model(v, lengths), backend="aot_eager"))
    same["balance"] = torch.allclose(out, eager_out, atol=1e-6) and torch.allclose(grad, eager_grad, atol=1e-6)
    return same


def speeds_reach_the_plan(info) -> dict:
    """Each rank sets its own LoadBalancer.speed (rank r: r + 1): dispatch's plan, a plan made ahead
    and LoadBalancer.plan all equal plan_rebalance with every rank's speed, and the balanced step
    still equals the unbalanced one."""
    from freescale_comm.dispatch import communicator_for
    from freescale_comm.planner import plan_rebalance

    rank, world = dist.get_rank(), dist.get_world_size()
    balancer = fc.LoadBalancer(CM)
    balancer.speed = float(rank + 1)
    values, lengths = _rank_batch(rank, 11, 4)
    every = [None] * world
    dist.all_gather_object(every, lengths.numpy())
    expected = plan_rebalance(every, cost_model=CM, bytes_per_item=16, speeds=[r + 1 for r in range(world)])
    batch = balancer.dispatch(values, lengths)
    ahead = balancer.plan_ahead(communicator_for(None), [[lengths.numpy()]], 16)[0]
    planned = balancer.plan(lengths, 16)
    model = JaggedCausalMix(4)
    out = balancer.combine(model(batch.values, batch.lengths), batch.handle)
    return {"dispatch": all(np.array_equal(a, b) for a, b in zip(batch.plan.dest, expected.dest)),
            "ahead": all(np.array_equal(a, b) for a, b in zip(ahead.plan.dest, expected.dest)),
            "plan": all(np.array_equal(a, b) for a, b in zip(planned.dest, expected.dest)),
            "same_output": bool(torch.allclose(out, model(values, lengths), atol=1e-6)),
            "moved": expected.moved_samples, "speeds": None if batch.plan.speeds is None else batch.plan.speeds.tolist(),
            "times": (expected.loads_after / expected.speeds).tolist()}


class _CountedWork(torch.nn.Module):
    """Per-row work whose 'time' is counted, not measured: each forward advances a shared clock by
    the cost of the samples it got times this rank's slowness."""

    def __init__(self, clock: dict, slowness: float) -> None:
        super().__init__()
        self.clock, self.slowness = clock, slowness

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        self.clock["now"] += float(CM.cost(lengths.numpy()).sum()) * self.slowness
        return values * 2


def measured_speeds_steer_the_plans(info, measure: bool) -> dict:
    """fc.balance(measure_speed=...) on 2 ranks, rank 1 computing at half speed (a counted clock):
    the plans from the second forward on give it half rank 0's cost; without measuring, equal loads."""
    from freescale_comm import _speed_meter

    rank = dist.get_rank()
    clock = {"now": 0.0}
    _speed_meter.SpeedMeter.clock = staticmethod(lambda: clock["now"])
    module = fc.balance(_CountedWork(clock, 2.0 if rank == 1 else 1.0), CM, measure_speed=measure)
    gen = torch.Generator().manual_seed(5)  # the same samples on both ranks
    plans = []
    for _ in range(3):
        lengths = torch.randint(1, 12, (24,), generator=gen)
        values = torch.randn(int(lengths.sum()), 2, generator=gen)
        out = module(values, lengths)
        assert torch.equal(out, values * 2)
        plan = module.freescale_balance.last_plan
        plans.append({"speeds": None if plan.speeds is None else plan.speeds.tolist(),
                      "loads": plan.loads_after.tolist()})
    return {"plans": plans, "speed": module.freescale_balance.balancer.speed}
