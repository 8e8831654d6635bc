"""Bootstraps for the compiled core: small blob exchanges during communicator setup."""

from __future__ import annotations

import datetime
import os
import socket
import weakref
from typing import Optional

import torch.distributed as dist

from freescale_comm import _core
from freescale_comm._errors import comm_error, gloo_timed_out


# Communicators this process built over each group (program order, alike on every rank): names
# their arrival keys in the group's store.
_built_over: "weakref.WeakKeyDictionary[dist.ProcessGroup, int]" = weakref.WeakKeyDictionary()


def _process_start(pid: int) -> Optional[str]:
    """Process `pid`'s start time (clock ticks after boot, /proc/<pid>/stat), None if it is gone
    or a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class GroupBootstrap(_core.Bootstrap):
    """Exchanges setup blobs through an existing process group's object collectives (any
    backend). Used while a communicator is built (and when it first moves a GPU's tensors); data
    never moves through the group. Holds the group weakly: dist.destroy_process_group must free
    it then (a gloo group kept alive into interpreter shutdown aborts the process at exit).

    Each rank first sets an arrival key in the group's store (its host, pid and start time), so a
    setup exchange that fails because a peer's connections closed can name the peer: the one rank
    on this host that arrived and is gone, else the one rank that never arrived."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self._group = weakref.ref(group)
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        built = _built_over.get(group, 0)
        _built_over[group] = built + 1
        self._arrival_prefix = f"freescale_comm/communicator/{built}/arrived/"
        self._store = self._group_store(group)
        if self._store is not None:
            me = f"{socket.gethostname()} {os.getpid()} {_process_start(os.getpid())}"
            try:
                self._store.set(self._arrival_prefix + str(self._rank), me)
            except RuntimeError:  # the store's host is gone: the exchange will say what failed
                self._store = None

    @staticmethod
    def _group_store(group: dist.ProcessGroup) -> Optional[dist.Store]:
        try:
            return dist.distributed_c10d._get_process_group_store(group)
        except Exception:  # noqa: BLE001 - torch keeps no store for it (or no such function): no names
            return None

    def _gone_peer(self) -> Optional[int]:
        """The peer that left, as the arrival keys tell (see the class); None if not one."""
        if self._store is None:
            return None
        here, gone, never, unknown = socket.gethostname(), [], [], []
        for p in range(self._size):
            key = self._arrival_prefix + str(p)
            try:
                if not self._store.check([key]):
                    never.append(p)
                    continue
                host, pid, start = self._store.get(key).decode().split(" ")
            except (RuntimeError, ValueError):
                return None  # the store cannot say
            if host != here:
                unknown.append(p)
            elif _process_start(int(pid)) != start:
                gone.append(p)
        if len(gone) == 1:
            return gone[0]
        return never[0] if not gone and not unknown and len(never) == 1 else None

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
            culprit = getattr(e, "culprit", None)
            if culprit is None and code == "PEER_DIED":
                culprit = self._gone_peer()
            who = f"rank {culprit} left (its process is gone, or it never began building its own); " \
                if culprit is not None and code == "PEER_DIED" else ""
            raise comm_error("building a freescale communicator over the group failed in its setup exchange: "
                             f"{who}a peer failed or left before or while building its own, or did not arrive within "
                             "the group's timeout (a CommError here may follow another rank's own error). The group "
                             f"said: {e}", code, culprit) from e
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
