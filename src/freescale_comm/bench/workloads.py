"""Seeded sample-length generators shaped like real sequence-recommendation data.

kuairand: log-normal matched to KuaiRand-27K user histories (median 8,591, mean 11,796, min 100),
truncated at 21,000 items like FreeScale's maximum UIH length. ml20m: MovieLens-20M user
activity, log-normal with s=1.609, loc=19.07, scale=43.1. zipf: Zipf(α) lengths capped at
max_len (NVIDIA recsys-examples' HSTU balancing benchmark: α=1.2, max 4096). heavy_zipf: a heavier
tail, 20 × Zipf(1.3) capped at 21,000 items: about one sample in ten is at the cap, so a rank's
load is a handful of giants plus change (issue 23's case, where balancing stops early).
All return int64 NumPy arrays of `samples` lengths; the same seed gives the same lengths.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["WORKLOADS", "kuairand", "ml20m", "zipf", "heavy_zipf", "generate", "scale_lengths", "step_lengths", "overlapping_ids"]

KUAIRAND_MEDIAN = 8591
KUAIRAND_MEAN = 11796
KUAIRAND_MIN = 100
MAX_UIH_LEN = 21000


def _check(samples: int) -> None:
    if not isinstance(samples, (int, np.integer)) or samples < 0:
        raise ValueError(f"samples must be an int >= 0, got {samples!r}")


def kuairand(samples: int, *, seed: int = 0, max_len: int = MAX_UIH_LEN) -> np.ndarray:
    """KuaiRand-27K-like history lengths in [100, max_len]."""
    _check(samples)
    mu = math.log(KUAIRAND_MEDIAN)
    sigma = math.sqrt(2 * math.log(KUAIRAND_MEAN / KUAIRAND_MEDIAN))  # mean/median = exp(σ²/2)
    raw = np.random.default_rng(seed).lognormal(mu, sigma, samples)
    return np.clip(np.rint(raw), KUAIRAND_MIN, max_len).astype(np.int64)


def ml20m(samples: int, *, seed: int = 0, max_len: int = MAX_UIH_LEN) -> np.ndarray:
    """MovieLens-20M-like user activity (ratings per user), at least 20, capped at max_len."""
    _check(samples)
    z = np.random.default_rng(seed).standard_normal(samples)
    raw = 19.07 + 43.1 * np.exp(1.609 * z)
    return np.clip(np.rint(raw), 20, max_len).astype(np.int64)


def zipf(samples: int, *, seed: int = 0, alpha: float = 1.2, max_len: int = 4096) -> np.ndarray:
    """Zipf(alpha) lengths in [1, max_len]."""
    _check(samples)
    if alpha <= 1:
        raise ValueError(f"alpha must be > 1 for a Zipf law, got {alpha}")
    raw = np.random.default_rng(seed).zipf(alpha, samples)
    return np.minimum(raw, max_len).astype(np.int64)


def heavy_zipf(samples: int, *, seed: int = 0, alpha: float = 1.3, scale: int = 20,
               max_len: int = MAX_UIH_LEN) -> np.ndarray:
    """scale × Zipf(alpha) lengths, capped at max_len (in [scale, max_len])."""
    _check(samples)
    if alpha <= 1:
        raise ValueError(f"alpha must be > 1 for a Zipf law, got {alpha}")
    if not isinstance(scale, (int, np.integer)) or scale < 1:
        raise ValueError(f"scale must be an int >= 1, got {scale!r}")
    raw = np.random.default_rng(seed).zipf(alpha, samples)
    # Cap before scaling: Zipf draws reach 2**63 - 1, and scale × that wraps around.
    return np.minimum(np.minimum(raw, -(-max_len // scale)) * scale, max_len).astype(np.int64)


WORKLOADS = {"kuairand": kuairand, "ml20m": ml20m, "zipf": zipf, "heavy_zipf": heavy_zipf}


def generate(name: str, samples: int, *, seed: int = 0, **kwargs) -> np.ndarray:
    """The workload called `name` (one of WORKLOADS)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    return WORKLOADS[name](samples, seed=seed, **kwargs)


def scale_lengths(lengths: np.ndarray, scale: float) -> np.ndarray:
    """lengths × scale, rounded, at least 1 (int64): a workload shrunk for a small machine."""
    return np.maximum(1, np.rint(np.asarray(lengths) * scale)).astype(np.int64)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one rank's batch at one step (e2e and the simulator draw the same batches)."""
    return (seed * 1_000_003 + step) * 1009 + rank


def step_lengths(name: str, samples: int, *, seed: int, step: int, rank: int, scale: float = 1.0) -> np.ndarray:
    """The lengths of rank `rank`'s `samples` samples at `step`, scaled by `scale`."""
    return scale_lengths(generate(name, samples, seed=step_seed(seed, step, rank)), scale)


def overlapping_ids(counts: list[list[int]], num_rows: int, rate: float, *, seed: int = 0) -> list[list[np.ndarray]]:
    """Embedding ids with a controlled collision rate: [step][rank] int64 arrays of counts[step][rank]
    ids in [0, num_rows). Step 0 draws uniformly; at every later step, round(rate × count) of each
    rank's ids are drawn from the previous step's ids (all ranks), the rest from the rows the
    previous step did not read, in random positions. So exactly that share of every step's ids
    collides with the step before (PEC's overlap rows)."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate!r}")
    rng = np.random.default_rng(seed)
    out: list[list[np.ndarray]] = []
    for step, per_rank in enumerate(counts):
        if step == 0:
            out.append([rng.integers(0, num_rows, n) for n in per_rank])
            continue
        previous = np.unique(np.concatenate(out[-1]))
        fresh_rows = np.setdiff1d(np.arange(num_rows), previous, assume_unique=True)
        if rate < 1 and fresh_rows.size == 0:
            raise ValueError(f"step {step - 1} read every one of the {num_rows} rows: no fresh rows for rate {rate}; "
                             "use more rows or fewer ids")
        batch = []
        for n in per_rank:
            hits = int(round(rate * n))
            ids = np.concatenate([rng.choice(previous, hits), rng.choice(fresh_rows, n - hits) if n > hits else
                                  np.zeros(0, dtype=np.int64)])
            batch.append(rng.permutation(ids).astype(np.int64))
        out.append(batch)
    return out
