"""Rank functions: TrainPipelinePEC's two threads as two CUDA streams (stream_order.StreamChecker),
for every prefetch mode, whole batches and micro-batches, with balance, in eval mode and after a
failure; and the two mutations (no stream edges at the hand-offs; no record_stream) the checker
must catch."""

from __future__ import annotations

import dataclasses
import threading

import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor

import freescale_comm as fc
from freescale_comm.pipelines import _streams
from freescale_comm.planner import CostModel
from pec_pipeline_programs import BalancedModel, build, long_histories_on_rank0, make_batches
from dmp_programs import Batch
from stream_order import CheckedStreams, StreamChecker

COPIED_ON: list[str] = []  # per host batch copied to the device: the thread that copied it


@dataclasses.dataclass
class HostBatch(Batch):
    """A batch in host memory: to(device) copies every tensor, as a host-to-device copy makes new
    blocks on the stream that issues it, and notes the thread that issued it."""

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        COPIED_ON.append(threading.current_thread().name)
        return Batch(_copied(self.pooled), _copied(self.sequence), self.label.clone())


def _copied(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().clone(), lengths=kjt.lengths().clone())


def checked_run(info, steps: int, cases: dict[str, dict]) -> dict:
    """Per case (name -> {"pipeline": TrainPipelinePEC kwargs, "mirror": bool, "record": bool,
    "balance": bool, "eval": bool, "collision": float (0.5), "fail": bool (rank 0's data ends two
    batches early: CommError on every rank)}), each reading a checkpoint mid-run: the checker's
    violations (kinds and the first few), its op counts per stream and its cross-stream uses, the
    outputs' sum (the run trained), whether it failed, how often close() drained the worker's
    stream, and which threads copied the host batches to the device."""
    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    saved = _streams.for_device
    try:
        for name, case in cases.items():
            balanced = case.get("balance", False)
            dmp, opt = build(pg, "rowwise_adagrad", BalancedModel) if balanced else build(pg, "rowwise_adagrad")
            checker = StreamChecker()
            streams = CheckedStreams(checker, case.get("mirror", True), case.get("record", True))
            _streams.for_device = lambda device: streams
            kwargs = dict(case.get("pipeline", {}))
            if balanced:
                kwargs["balance"] = {"tower": CostModel(quadratic=1.0, linear=0.0, constant=1.0)}
            if case.get("eval", False):
                dmp.eval()
            pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, **kwargs)
            total = 0.0
            batches = make_batches(steps, world, case.get("collision", 0.5), seed=41, batch=8)
            if balanced:
                batches = long_histories_on_rank0(batches)
            # in host memory (made before the checker: not tracked); the pipeline copies each to the device
            mine = [HostBatch(b[rank].pooled, b[rank].sequence, b[rank].label) for b in batches]
            COPIED_ON.clear()
            with checker.on("main"):
                feed = iter(mine[:-2] if case.get("fail") and rank == 0 else mine)  # fail: dataloaders disagree
                failed = None
                try:
                    for step in range(steps):
                        total += float(pipe.progress(feed).sum())
                        if step == steps // 2:  # a checkpoint mid-run: flush() joins the deferred update
                            dmp.state_dict()
                except fc.CommError as e:
                    failed = type(e).__name__
                pipe.close()
            kinds = sorted({v.split(":")[0] for v in checker.violations})
            report[name] = {"violations": len(checker.violations), "kinds": kinds, "first": checker.violations[:3],
                            "ops": dict(checker.ops), "cross_stream_uses": checker.cross_stream_uses, "total": total,
                            "drains": streams.drains, "failed": failed, "copied_on": sorted(set(COPIED_ON))}
    finally:
        _streams.for_device = saved
    return report
