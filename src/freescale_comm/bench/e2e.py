"""freescale-bench e2e: a synthetic HSTU-like training step on N local ranks, in several modes.

One step, per rank (a thread of torch compute each), on the `freescale` default group:
  ids ─ counts AllToAll, id AllToAll ─▶ owners look rows up ─ embedding AllToAll ─▶ dense
  forward (jagged causal attention) + loss + backward ─ gradient AllToAll ─▶ owners' SGD on the
  rows; dense gradients (and the loss) all-reduced, SGD on the dense weights.

Modes (MODES):
- vanilla:   TorchRec-like. Every AllToAll blocking, one batch, no balancing.
- balance:   + LoadBalancer: each step's samples are balanced by the HSTU cost before the id
             AllToAll (only lengths are needed to plan, and ids weigh 8 B per item where an
             embedded item weighs dim × 4 B, so the balanced samples fetch their own rows).
- overlap:   + async, priority-ordered AllToAlls overlapped with compute: the next step's ids
             (balanced, counted, exchanged at the lowest priority) move under this step's
             compute; the embeddings come in `groups` sample groups, highest priority first for
             the group compute needs next, so group g+1 arrives while group g computes; each
             group's gradient AllToAll leaves as soon as its backward is done, below every
             embedding fetch; the dense all-reduce runs under the rows' update.
- pec:       + prioritized embedding communication (freescale_comm.pec, see bench/e2e_pec.py):
             the next step's ids and the rows it reads that this step does not (non-overlap) move
             at low priority under this step's compute; the overlap rows' gradients and fetch go
             first at high priority after backward; the non-overlap gradients are deferred.
- freescale: balance + overlap.
- balance_pec: balance + pec.
Every mode does the same math: same seed → same losses (to float rounding).
"""

from __future__ import annotations

import contextlib
import gc
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch

from freescale_comm.bench.e2e_config import (EMBEDDING_PRIORITY, GRADIENT_PRIORITY, MODES, PREFETCH_PRIORITY,
                                             E2EConfig, Mode, home_batch)
from freescale_comm.bench.e2e_pec import PECTrainer
from freescale_comm.bench.e2e_trainer import StepTrainer, calibrate
from freescale_comm.bench.placement import (RankPlacement, device_like_env, hold_core, pin_this_process, place_ranks,
                                            thread_cores)
from freescale_comm.bench.report import bubble_reduction
from freescale_comm.bench.timeline import Timeline, mode_metrics
from freescale_comm.planner import CostModel

__all__ = ["MODES", "Mode", "E2EConfig", "E2EResult", "run", "home_batch", "trainer_for", "calibrate", "measured_rank",
           "spawn_measured", "rotated",
           "EMBEDDING_PRIORITY", "GRADIENT_PRIORITY", "PREFETCH_PRIORITY"]


@dataclass
class E2EResult:
    config: E2EConfig
    rows: list[dict[str, Any]]  # one per mode: design.md §6 e2e keys and more
    timelines: dict[str, Timeline]  # mode -> measured steps, all ranks
    losses: dict[str, list[float]]  # mode -> global mean loss of every step (warmup included)
    computed_samples: dict[str, list[list[int]]]  # mode -> [rank][step] samples computed there
    cost_model: CostModel  # the config's, or fitted at the start of the run; balancing plans with it
    placement: RankPlacement  # rank -> core (pinned there if config.pin_cores)
    rank_cores: list[list[int]]  # [rank]: the cores its threads could run on, read at its end

    def reduction(self, mode: str = "freescale", baseline: str = "vanilla") -> Optional[float]:
        """Fraction of bubble ms removed by `mode` relative to `baseline` (None if either is missing)."""
        return bubble_reduction(self.rows, mode, baseline)


def trainer_for(cfg: E2EConfig, mode: Mode, rank: int, cost_model: CostModel, progress: Any) -> "StepTrainer":
    """Collective (a PEC trainer builds its communicator): one rank's trainer for `mode`."""
    if mode.pec:
        return PECTrainer(cfg, mode, rank, cost_model, progress)
    return StepTrainer(cfg, mode, rank, cost_model, progress)


@contextlib.contextmanager
def measured_rank(info: Any, cores: Optional[tuple[int, ...]]) -> Iterator[None]:
    """A measured rank's setting while inside: one compute thread and, if `cores`, every thread on
    this rank's core, held while the rank waits (placement.hold_core)."""
    torch.set_num_threads(1)  # one compute thread per rank
    if cores is None:
        yield
        return
    pin_this_process(cores[info.rank])
    with hold_core(cores[info.rank]):
        yield


def rotated(names: list[str], k: int) -> list[str]:
    """names, started at its (k mod len)-th: round k's order, so every mode takes every place in turn."""
    k %= len(names)
    return names[k:] + names[:k]


def _rank_program(info: Any, cfg: E2EConfig, progress: bool, cores: Optional[tuple[int, ...]]) -> dict[str, Any]:
    with measured_rank(info, cores):
        return _measure(info, cfg, progress)


def _measure(info: Any, cfg: E2EConfig, progress: bool) -> dict[str, Any]:
    bar = None
    if progress and info.rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(cfg.modes) * (cfg.warmup + cfg.steps), desc=f"e2e {cfg.ranks} ranks", unit="step",
                   leave=False)
    cost_model = cfg.cost_model if cfg.cost_model is not None else calibrate(cfg, torch.device(cfg.device))
    trainers = {name: trainer_for(cfg, MODES[name], info.rank, cost_model, bar) for name in cfg.modes}
    # The modes take turns, step by step, each round in a rotated order: a machine whose speed drifts
    # (a shared VM, a build beside it) then slows every mode alike, where one mode after another
    # would give each its own machine. Python's collector runs between rounds only (as training
    # loops that manage it do), never inside a timed step.
    names = list(trainers)
    for trainer in trainers.values():
        trainer.start()
    gc.disable()
    try:
        for step in range(cfg.warmup + cfg.steps):
            gc.collect()
            for name in rotated(names, step):
                if bar is not None:
                    bar.set_postfix_str(f"{name}, step {step}")
                trainers[name].run_step(step)
    finally:
        gc.enable()
    out: dict[str, Any] = {"cost_model": cost_model, **{name: t.finish() for name, t in trainers.items()}}
    if bar is not None:
        bar.close()
    out["cores"] = thread_cores()  # where this rank's threads could run, read after the run
    return out


def spawn_measured(program: Any, cfg: E2EConfig, *args: Any, timeout_s: float) -> tuple[list[Any], RankPlacement]:
    """Runs `program(info, *args, cores)` on cfg.ranks ranks of the freescale backend, placed as
    cfg.pin_cores says (cores None when not pinned); returns what each rank returned and the placement."""
    from freescale_comm.testing import spawn

    placement = place_ranks(cfg.ranks)
    cores = placement.cores if cfg.pin_cores else None
    env = device_like_env() if cfg.pin_cores else {}
    per_rank = spawn(program, cfg.ranks, *args, cores, backend="freescale", timeout_s=timeout_s, env=env)
    return per_rank, placement


def run(cfg: E2EConfig, progress: bool = True, timeout_s: float = 600.0) -> E2EResult:
    """Spawns cfg.ranks processes on the freescale backend, runs every mode, and measures."""
    cfg.check()
    per_rank, placement = spawn_measured(_rank_program, cfg, cfg, progress, timeout_s=timeout_s)
    measured = lambda s: s >= cfg.warmup  # noqa: E731
    rows, timelines, losses, computed = [], {}, {}, {}
    for name in cfg.modes:
        tl = Timeline()
        for r in per_rank:
            tl.extend(Timeline.from_dict(r[name]["timeline"]).select(measured))
        timelines[name] = tl
        losses[name] = per_rank[0][name]["losses"]
        computed[name] = [r[name]["computed_samples"] for r in per_rank]
        sparsity = [v for r in per_rank for v in r[name]["sparsity"]]
        rows.append({"mode": name, **mode_metrics(tl), "sparsity": float(np.mean(sparsity)) if sparsity else math.nan,
                     "loss": losses[name][-1]})
    return E2EResult(cfg, rows, timelines, losses, computed, per_rank[0]["cost_model"], placement,
                     [r["cores"] for r in per_rank])
