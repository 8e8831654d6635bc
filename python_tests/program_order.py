"""Triton's interpreter runs a launch's programs one at a time in x-y-z order, which would hide a
program that reads what a later one of the same launch writes (on a GPU they run at once, in any
order). permute_programs makes it run them in another order: its loop visits every grid index
once, and each index it sets goes through a permutation of the grid."""

from __future__ import annotations

from typing import Callable

import torch

ORDERS = ("identity", "reversed", "random")


def permute_programs(order: str, seed: int = 1234) -> Callable[[], None]:
    """From now on every interpreted launch runs its programs in `order` (one of ORDERS; random:
    a new seeded permutation per launch). Returns what undoes it."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    state = {"dims": (1, 1, 1), "order": [0]}
    gen = torch.Generator().manual_seed(seed)

    def dim(nx: int, ny: int, nz: int) -> None:
        n = nx * ny * nz
        perm = {"identity": torch.arange(n), "reversed": torch.arange(n - 1, -1, -1),
                "random": torch.randperm(n, generator=gen)}[order]
        state.update(dims=(nx, ny, nz), order=perm.tolist())
        set_dim(nx, ny, nz)

    def idx(x: int, y: int, z: int) -> None:
        _, ny, nz = state["dims"]
        k = state["order"][(x * ny + y) * nz + z]
        set_idx(k // (ny * nz), (k // nz) % ny, k % nz)

    builder.set_grid_dim, builder.set_grid_idx = dim, idx

    def undo() -> None:
        builder.set_grid_dim, builder.set_grid_idx = set_dim, set_idx
    return undo
