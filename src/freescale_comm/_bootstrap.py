"""Bootstraps for the compiled core: small blob exchanges during communicator setup."""

from __future__ import annotations

import torch.distributed as dist

from freescale_comm import _core


class GroupBootstrap(_core.Bootstrap):
    """Exchanges setup blobs through an existing process group's object collectives (any
    backend). Used only while a communicator is built; data never moves through the group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self._group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allgather(self, blob: bytes) -> list[bytes]:
        out: list[object] = [None] * self._size
        dist.all_gather_object(out, bytes(blob), group=self._group)
        return [bytes(b) for b in out]  # type: ignore[arg-type]

    def barrier(self) -> None:
        self.allgather(b"")
