"""Rank functions: the tables written in place from outside fc.TrainPipelinePEC
(torch.distributed.checkpoint.load into model.state_dict()) while it holds batches in flight."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

import freescale_comm as fc
from contract_programs import _diff
from pec_pipeline_programs import _local, _state, build, make_batches

CPU = torch.device("cpu")


def _weights(dmp) -> dict[str, torch.Tensor]:
    return {k: _local(v) for k, v in dmp.state_dict().items()}


def _epoch(pipe, batches: list) -> list[torch.Tensor]:
    outputs, feed = [], iter(batches)
    while True:
        try:
            outputs.append(pipe.progress(feed).clone())
        except StopIteration:
            return outputs


def checkpoint_loaded_in_place_mid_run(info, steps: int, save_at: int, load_at: int, where: str,
                                       read_first: bool) -> dict:
    """PEC trains `save_at` steps, saves a DCP checkpoint, trains on to `load_at`, then
    dcp.load()s it in place into model.state_dict() with batches in flight; the next progress()
    (or, `read_first`, the next model.state_dict()) must refuse. Then the tables must hold the
    checkpoint (no deferred gradient on top), close() must succeed, and a new pipeline training
    the batches from `save_at` on must match TrainPipelineSparseDist resuming from the same
    checkpoint, bit for bit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [b[rank] for b in make_batches(steps, world, 0.5, seed=29)]
    dmp, opt = build(dist.group.WORLD, "sgd")
    pipe = fc.TrainPipelinePEC(dmp, opt, CPU, group=dist.group.WORLD)
    feed = iter(mine)
    for _ in range(save_at):
        pipe.progress(feed)
    dcp.save(dmp.state_dict(), checkpoint_id=where)  # (the state_dict flushes the deferred gradients)
    saved = _weights(dmp)
    for _ in range(load_at - save_at):
        pipe.progress(feed)
    state = dmp.state_dict()
    dcp.load(state, checkpoint_id=where)  # in place, batches in flight
    raised = None
    try:
        if read_first:
            dmp.state_dict()
        else:
            pipe.progress(feed)
    except RuntimeError as e:
        raised = f"{type(e).__name__}: {e}"
    after = _weights(dmp)
    pipe.close()
    out = {"raised": raised, "tables_hold_the_checkpoint": all(torch.equal(saved[k], after[k]) for k in saved)}

    resumed = fc.TrainPipelinePEC(dmp, opt, CPU, group=dist.group.WORLD)
    pec = {"outputs": _epoch(resumed, mine[save_at:]), "state": _state(dmp, opt)}
    resumed.close()
    ref_dmp, ref_opt = build(dist.group.WORLD, "sgd")
    ref_state = ref_dmp.state_dict()
    dcp.load(ref_state, checkpoint_id=where)  # before any batch: TorchRec resumes from the checkpoint
    ref_pipe = TrainPipelineSparseDist(ref_dmp, ref_opt, CPU)
    ref = {"outputs": _epoch(ref_pipe, mine[save_at:]), "state": _state(ref_dmp, ref_opt)}
    return {**out, **_diff(ref, pec)}
