"""Bootstraps for the compiled core: small blob exchanges during communicator setup."""

from __future__ import annotations

import datetime
import weakref
from typing import Optional

import torch.distributed as dist

from freescale_comm import _core
from freescale_comm._errors import comm_error, gloo_timed_out


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
        group = self.group()
        try:
            dist.all_gather_object(out, bytes(blob), group=group)
        except RuntimeError as e:  # the group's own error (gloo: "Connection closed by peer"): a CommError
            # a freescale group names the root cause itself (its delegated collectives); else a timeout
            # is a peer late or frozen past the group's timeout, anything else one that left
            code = getattr(e, "code", None) or ("TIMEOUT" if gloo_timed_out(e) else "PEER_DIED")
            raise comm_error("building a freescale communicator over the group failed in its setup exchange: a peer "
                             "failed or left before or while building its own, or did not arrive within the group's "
                             "timeout (a CommError here may follow another rank's own error). The group said: "
                             f"{e}", code, getattr(e, "culprit", None)) from e
        return [bytes(b) for b in out]  # type: ignore[arg-type]

    def barrier(self) -> None:
        self.allgather(b"")


class StoreBootstrap(_core.Bootstrap):
    """Exchanges setup blobs through a c10d Store (the one a process group is built on): round k
    of allgather writes ``<k>/<rank>`` and reads every rank's key (Store.get waits for it, up to
    the store's timeout). Used by the backend, which has a store but no group to lean on yet."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: Optional[datetime.timedelta] = None) -> None:
        super().__init__()
        self._store = store
        self._rank = rank
        self._size = size
        self._round = 0
        self._timeout = timeout  # how long a round waits for its peers (None: the store's own timeout)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def allgather(self, blob: bytes) -> list[bytes]:
        prefix = f"bootstrap/{self._round}/"
        self._round += 1
        self._store.set(prefix + str(self._rank), bytes(blob))
        keys = [prefix + str(p) for p in range(self._size)]
        if self._timeout is not None:
            try:
                self._store.wait(keys, self._timeout)
            except RuntimeError as e:  # DistStoreError: a timeout, or the store itself gone
                missing = [p for p, key in enumerate(keys) if not self._check(key)]
                raise comm_error(
                    f"setting up a freescale group: rank(s) {missing} did not reach setup round {self._round - 1} "
                    f"within {self._timeout.total_seconds():g} s (they died or failed before building the group, or "
                    f"are late; the group's timeout bounds this wait). The store said: {e}",
                    "TIMEOUT", missing[0] if missing else None) from e
        return [bytes(self._store.get(key)) for key in keys]

    def _check(self, key: str) -> bool:
        try:
            return bool(self._store.check([key]))
        except RuntimeError:  # the store is gone too: count the key missing
            return False

    def barrier(self) -> None:
        self.allgather(b"")
