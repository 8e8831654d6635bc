"""Bootstraps for the compiled core: small blob exchanges during communicator setup."""

from __future__ import annotations

import weakref

import torch.distributed as dist

from freescale_comm import _core


class GroupBootstrap(_core.Bootstrap):
    """Exchanges setup blobs through an existing process group's object collectives (any
    backend). Used while a communicator is built (and when it first moves a GPU's tensors); data
    never moves through the group. Holds the group weakly: dist.destroy_process_group must free
    it then (a gloo group kept alive into interpreter shutdown aborts the process at exit)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self._group = weakref.ref(group)
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)

    def group(self) -> dist.ProcessGroup:
        group = self._group()
        if group is None:
            raise RuntimeError(
                "the process group this communicator bootstraps through was destroyed (dist.destroy_process_group); "
                "build a new Communicator on a live group")
        return group

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allgather(self, blob: bytes) -> list[bytes]:
        out: list[object] = [None] * self._size
        dist.all_gather_object(out, bytes(blob), group=self.group())
        return [bytes(b) for b in out]  # type: ignore[arg-type]

    def barrier(self) -> None:
        self.allgather(b"")


class StoreBootstrap(_core.Bootstrap):
    """Exchanges setup blobs through a c10d Store (the one a process group is built on): round k
    of allgather writes ``<k>/<rank>`` and reads every rank's key (Store.get waits for it, up to
    the store's timeout). Used by the backend, which has a store but no group to lean on yet."""

    def __init__(self, store: dist.Store, rank: int, size: int) -> None:
        super().__init__()
        self._store = store
        self._rank = rank
        self._size = size
        self._round = 0

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allgather(self, blob: bytes) -> list[bytes]:
        prefix = f"bootstrap/{self._round}/"
        self._round += 1
        self._store.set(prefix + str(self._rank), bytes(blob))
        return [bytes(self._store.get(prefix + str(p))) for p in range(self._size)]

    def barrier(self) -> None:
        self.allgather(b"")
