"""The e2e benchmark's modes and configuration, and the samples every rank reads: what the
trainers (bench/e2e_trainer.py, bench/e2e_pec.py), the runner (bench/e2e.py), the PEC sweep and the
simulator share. Modes are described in bench/e2e.py."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from freescale_comm.bench import workloads
from freescale_comm.bench.placement import default_ranks
from freescale_comm.planner import CostModel

__all__ = ["MODES", "Mode", "E2EConfig", "home_batch", "EMBEDDING_PRIORITY", "GRADIENT_PRIORITY",
           "PREFETCH_PRIORITY"]


@dataclass(frozen=True)
class Mode:
    balance: bool
    overlap: bool
    pec: bool = False


MODES: dict[str, Mode] = {
    "vanilla": Mode(balance=False, overlap=False),
    "balance": Mode(balance=True, overlap=False),
    "overlap": Mode(balance=False, overlap=True),
    "freescale": Mode(balance=True, overlap=True),
    "pec": Mode(balance=False, overlap=True, pec=True),
    "balance_pec": Mode(balance=True, overlap=True, pec=True),
}

# Priorities on freescale's queue (larger = sooner): what compute needs next goes first.
EMBEDDING_PRIORITY = 100  # minus the group index
GRADIENT_PRIORITY = 50  # minus the group index
PREFETCH_PRIORITY = 0


@dataclass(frozen=True)
class E2EConfig:
    ranks: int = field(default_factory=default_ranks)  # one per usable core, 2 to 4 (bench/placement.py)
    steps: int = 8  # measured steps per mode (the modes take turns: each step of every mode is one sample)
    warmup: int = 1  # steps run before them, not measured
    samples: int = 8  # per rank and step
    workload: str = "kuairand"
    length_scale: float = 1 / 16  # workload lengths are scaled by this (and kept >= 1)
    dim: int = 64
    heads: int = 2
    layers: int = 2
    rows_per_rank: int = 16384
    groups: int = 4  # sample groups of the overlapped modes' pipeline
    lr: float = 0.5
    seed: int = 0
    modes: tuple[str, ...] = tuple(MODES)
    device: str = "cpu"  # where the dense tower computes
    collision_rate: Optional[float] = None  # share of each step's ids read at the step before; None: uniform ids
    # What balancing plans with: None fits one to this machine's timings at the start of the run;
    # a given model makes the plans (and so which samples move) the same on any machine or load.
    cost_model: Optional[CostModel] = None
    # Each rank's threads on one core of its own (round robin when ranks outnumber cores), and
    # malloc keeping freed memory as a device allocator does: one device per rank (bench/placement.py).
    pin_cores: bool = True
    # Balancing evens load / speed, each rank's speed measured (the cost it computed per second of
    # its compute, smoothed over steps): a rank slowed by other work on its core gets less. False:
    # load alone, as FreeScale plans.
    balance_speeds: bool = True

    def check(self) -> None:
        problems = []
        if self.ranks < 2:
            problems.append("ranks must be >= 2")
        if self.steps < 1 or self.warmup < 0:
            problems.append("steps must be >= 1 and warmup >= 0")
        if self.samples < 1 or self.groups < 1:
            problems.append("samples and groups must be >= 1")
        if self.workload not in workloads.WORKLOADS:
            problems.append(f"workload must be one of {sorted(workloads.WORKLOADS)}")
        if not 0 < self.length_scale <= 1:
            problems.append("length_scale must be in (0, 1]")
        if self.dim < 1 or self.heads < 1 or self.dim % self.heads or self.layers < 1:
            problems.append("dim must be a positive multiple of heads, layers >= 1")
        if self.rows_per_rank < 1:
            problems.append("rows_per_rank must be >= 1")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            problems.append(f"modes must be a non-empty subset of {list(MODES)} (got {list(self.modes)})")
        if self.collision_rate is not None and not 0 <= self.collision_rate <= 1:
            problems.append("collision_rate must be None or in [0, 1]")
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            problems.append("cost_model must be None (fit one) or a freescale_comm.planner.CostModel")
        if self.device not in ("cpu", "cuda"):
            problems.append("device must be cpu or cuda")
        elif self.device == "cuda" and not torch.cuda.is_available():
            problems.append("device is cuda but torch sees no CUDA device: use device cpu")
        if problems:
            raise ValueError("bad e2e config: " + "; ".join(problems))


def home_batch(cfg: E2EConfig, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples rank `rank` reads at `step`: (ids int64 [ΣL], lengths int64 [samples]).
    Deterministic in (seed, step, rank), whatever the mode."""
    lengths = _lengths(cfg, step, rank)
    if cfg.collision_rate is None:
        ids = np.random.default_rng(workloads.step_seed(cfg.seed, step, rank) + 1).integers(0, cfg.rows_per_rank * cfg.ranks, int(lengths.sum()))
    else:
        ids = _overlapping_ids(cfg, step + 1)[step][rank]
    return torch.from_numpy(ids), torch.from_numpy(lengths)


def _lengths(cfg: E2EConfig, step: int, rank: int) -> np.ndarray:
    return workloads.step_lengths(cfg.workload, cfg.samples, seed=cfg.seed, step=step, rank=rank,
                                  scale=cfg.length_scale)


@functools.lru_cache(maxsize=4)
def _overlapping_ids(cfg: E2EConfig, steps: int) -> list[list[np.ndarray]]:
    """Steps [0, steps) of every rank's ids at cfg.collision_rate (each step depends on the one before)."""
    counts = [[int(_lengths(cfg, s, r).sum()) for r in range(cfg.ranks)] for s in range(steps)]
    return workloads.overlapping_ids(counts, cfg.rows_per_rank * cfg.ranks, cfg.collision_rate, seed=cfg.seed)


