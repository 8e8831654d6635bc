"""Rank functions for NestPipe's pipelining in fc.TrainPipelinePEC (micro_batches=, prefetch=): the
overlapped pipeline against a synchronous run of the same micro-batches (every message waited for
when posted, every row fetched after the update), and against TorchRec's TrainPipelineSparseDist
on whole batches."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from pec_pipeline_programs import _rel, make_batches, train

MICRO = 4
MODES = ("pec", "dual_buffer", "ids")


def _diff(ref: dict, got: dict) -> dict:
    assert len(ref["outputs"]) == len(got["outputs"]), (len(ref["outputs"]), len(got["outputs"]))
    assert ref["state"].keys() == got["state"].keys(), (sorted(ref["state"]), sorted(got["state"]))
    return {"outputs": max((_rel(a, b) for a, b in zip(ref["outputs"], got["outputs"])), default=0.0),
            "state": max(_rel(ref["state"][k], got["state"][k]) for k in ref["state"])}


def fwp_matches_synchronous(info, steps: int, collisions: list[float], optimizer: str) -> dict:
    """Per collision: the worst differences of each prefetch mode with MICRO micro-batches against the
    synchronous reference (prefetch="ids", blocking), the micro-batch sizes seen (empty ones must
    occur: the last batches are smaller than MICRO; a rank has no samples at step 2), and per mode
    the (priority, dtype) of every exchange in program order."""
    pg = dist.group.WORLD
    world = dist.get_world_size()
    report = {}
    for collision in collisions:
        batches = make_batches(steps, world, collision, seed=int(collision * 100) + 5, empty="samples")
        ref = train(pg, "pec", optimizer, batches, prefetch="ids", micro_batches=MICRO, blocking=True)
        for mode in MODES:
            got = train(pg, "pec", optimizer, batches, prefetch=mode, micro_batches=MICRO)
            report[f"collision={collision} prefetch={mode}"] = {
                **_diff(ref, got), "exchanges": got["exchanges"], "micro_sizes": got["micro_sizes"]}
    return report


def fwp_rows_moved(info, steps: int, collisions: list[float]) -> dict:
    """Per (collision, prefetch mode): the floats this rank received in row rounds and in gradient
    rounds, the ids it received in ask rounds (as owner) and those it says it sent (rows_asked), over the
    run, with MICRO micro-batches and with one (the whole batch's distinct rows)."""
    pg = dist.group.WORLD
    report = {}
    for collision in collisions:
        batches = make_batches(steps, dist.get_world_size(), collision, seed=int(collision * 100) + 7, batch=8)
        for mode in MODES:
            runs = {m: train(pg, "pec", "rowwise_adagrad", batches, prefetch=mode, micro_batches=m) for m in (1, MICRO)}
            with _unpacked():  # where shard rows are too large to pack: each micro-batch's rows as they are
                runs["unpacked"] = train(pg, "pec", "rowwise_adagrad", batches, prefetch=mode, micro_batches=MICRO)
            # counted per run; the micro-batched ones also against the packed run (1: another split)
            report[f"collision={collision} prefetch={mode}"] = {
                m: {**{k: r[k] for k in ("fetched", "gradients", "asked", "ids")},
                    **(_diff(runs[MICRO], r) if m != 1 else {})} for m, r in runs.items()}
    return report


@contextlib.contextmanager
def _unpacked():
    """Batches of micro-batches send their rows unpacked, as for shard rows of 2^(62 - M) or more."""
    from freescale_comm.pipelines import _embeddings, _exchange

    saved = _embeddings.packs, _exchange.packs
    _embeddings.packs = _exchange.packs = lambda catalog, micro_batches: False
    try:
        yield
    finally:
        _embeddings.packs, _exchange.packs = saved


def fwp_near_sparse_dist(info, steps: int, collision: float, optimizer: str, micro: list) -> dict:
    """TrainPipelineSparseDist on whole batches against the pipeline with each micro-batch count
    (None: whole batches, every id sent); "M no_sync": the dense part's DDP built with
    static_graph=False, where micro-batches before the last skip the all-reduce. "dense spread":
    the largest difference of a dense weight between this rank and rank 0 (DDP keeps them equal)."""
    pg = dist.group.WORLD
    batches = make_batches(steps, dist.get_world_size(), collision, seed=31)
    ref = train(pg, "sparse_dist", optimizer, batches)
    report = {str(m): _diff(ref, train(pg, "pec", optimizer, batches, micro_batches=m)) for m in micro}
    got = train(pg, "pec", optimizer, batches, micro_batches=micro[-1], static_graph=False)
    report[f"{micro[-1]} no_sync"] = _diff(ref, got)
    # a loss averaged over samples: each micro-batch's weighed by its share ("mean"), or not ("sum")
    mean_ref = train(pg, "sparse_dist", optimizer, batches, reduction="mean")
    for reduction in ("mean", "sum"):
        report[f"{micro[-1]} mean loss, loss_reduction={reduction}"] = _diff(mean_ref, train(
            pg, "pec", optimizer, batches, micro_batches=micro[-1], reduction="mean", loss_reduction=reduction))
    # a learned loss weight: a mean loss's term no sample carries, NaN on an empty micro-batch (the
    # last step's batches hold 2 samples: 2 of the 4 micro-batches are empty)
    from pec_pipeline_programs import LearnedWeightModel
    learned_ref = train(pg, "sparse_dist", optimizer, batches, reduction="mean", model_cls=LearnedWeightModel)
    learned = train(pg, "pec", optimizer, batches, micro_batches=micro[-1], reduction="mean", loss_reduction="mean",
                    model_cls=LearnedWeightModel)
    report[f"{micro[-1]} learned loss weight"] = _diff(learned_ref, learned)
    report["learned finite"] = all(bool(torch.isfinite(v).all()) for v in learned["state"].values())
    report["learned empty micro-batches"] = sum(sizes.count(0) for sizes in learned["micro_sizes"])
    dense = torch.cat([v.flatten() for k, v in sorted(got["state"].items()) if k.startswith("weight:") and "head" in k])
    first = dense.clone()
    dist.broadcast(first, 0)
    report["dense spread"] = float((dense - first).abs().max())
    return report


def fwp_with_balance_matches_synchronous(info, steps: int, collision: float) -> dict:
    """4 micro-batches with fc.balance on the tower (rank 0's histories long): PEC prefetch against
    the synchronous reference, both balanced, outputs and state bit for bit; returns per rank the
    samples the tower computed per call and each step's home samples, and the squared history
    lengths it computed against its own batches' (balancing moved work)."""
    import freescale_comm as fc
    from pec_pipeline_programs import BalancedModel, CountingPlans, _state, build, long_histories_on_rank0
    from freescale_comm.planner import CostModel

    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    cost = CostModel(quadratic=1.0, linear=0.0, constant=1.0)
    batches = long_histories_on_rank0(make_batches(steps, world, collision, seed=23, batch=8))
    runs = {}
    for name, kwargs in (("reference", {"prefetch": "ids"}), ("pec", {"prefetch": "pec"})):
        dmp, opt = build(pg, "rowwise_adagrad", BalancedModel)
        pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, balance={"tower": cost},
                                   micro_batches=MICRO, **kwargs)
        pipe._blocking = name == "reference"
        feed = iter([b[rank] for b in batches])
        with CountingPlans() as counted:
            outputs = [pipe.progress(feed).clone() for _ in range(steps)]
        pipe.close()
        runs[name] = {"outputs": outputs, "state": _state(dmp, opt), "samples": list(dmp.module.tower.samples),
                      "items": list(dmp.module.tower.items),
                      "gathered": counted.gathered, "ahead": counted.ahead}
    ref, got = runs["reference"], runs["pec"]
    return {"diff": _diff(ref, got), "samples": got["samples"], "same_samples": got["samples"] == ref["samples"],
            "home": [len(b[rank].label) for b in batches], "gathered": got["gathered"], "ahead": got["ahead"],
            "computed_cost": sum(got["items"]),
            "home_cost": sum(int((b[rank].sequence["items"].lengths().to(torch.int64) ** 2).sum()) for b in batches)}
