"""A small public launcher for multi-rank programs and tests: spawns N ranks on a free port,
each with a gloo default group, and collects what each returned (or how it died)."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    master_addr: str
    master_port: int


@dataclass
class RankResult:
    rank: int
    value: Any = None             # what the rank function returned
    error: Optional[str] = None   # the traceback if it raised
    exitcode: Optional[int] = None  # process exit code (negative: killed by that signal)

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


class RankFailure(RuntimeError):
    """One or more ranks raised, crashed or hung; the message holds their tracebacks."""

    def __init__(self, results: list[RankResult]) -> None:
        self.results = results
        lines = []
        for r in results:
            if not r.ok:
                lines.append(f"--- rank {r.rank} (exit code {r.exitcode}) ---\n{r.error or 'no traceback (killed or hung)'}")
        super().__init__("ranks failed:\n" + "\n".join(lines))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable[..., Any], info: RankInfo, args: tuple, env: dict, backend: Optional[str],
               timeout_s: float, results: "mp.Queue") -> None:
    # A forkserver child starts with the server's environment (from when it started): the
    # launcher's environment now, plus `env`, replaces it.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR=info.master_addr, MASTER_PORT=str(info.master_port),
                      RANK=str(info.rank), WORLD_SIZE=str(info.world_size),
                      LOCAL_RANK=str(info.rank), LOCAL_WORLD_SIZE=str(info.world_size))
    import torch.distributed as dist

    try:
        if backend is not None:
            dist.init_process_group(backend, init_method=f"tcp://{info.master_addr}:{info.master_port}",
                                    rank=info.rank, world_size=info.world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        value = fn(info, *args)
        results.put((info.rank, value, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((info.rank, None, traceback.format_exc()))
    finally:
        if backend is not None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a failed rank may leave the group broken
                pass


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """os.environ with `env` on top while inside (spawned children copy it when they start)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# Modules the forkserver imports before it forks any rank (see preload_in_ranks).
_PRELOAD: list[str] = ["torch"]


def preload_in_ranks(*modules: str) -> None:
    """Names modules the forkserver imports once, before it forks ranks, so each rank starts with
    them imported (torchrec costs a rank ~1.6 s of CPU to import). Takes effect only if called
    before this process's first run_ranks without `env` (that call starts the server); a module
    that fails to import there is imported by the ranks that need it, as without this call."""
    for name in modules:
        if not isinstance(name, str) or not name:
            raise TypeError(f"preload_in_ranks takes module names (non-empty str), got {name!r}")
        if name not in _PRELOAD:
            _PRELOAD.append(name)


def _rank_context(fresh_interpreter: bool) -> Any:
    """Where ranks start. Forked from a forkserver that imported torch once (a fresh interpreter
    per rank spends ~1.6 s of CPU importing it again); its own interpreter started clean, so ranks
    inherit no launcher threads or CUDA state. Or, fresh_interpreter, spawned: what the launcher's
    environment holds is there from the start of the rank's interpreter (glibc and torch read some
    at start)."""
    if fresh_interpreter:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))  # no effect once the server runs (it already has them)
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: Optional[str] = "gloo",
              timeout_s: float = 120.0, env: Optional[dict[str, str]] = None,
              fresh_interpreter: Optional[bool] = None) -> list[RankResult]:
    """Runs ``fn(RankInfo, *args)`` in `world_size` new processes (each with a `backend`
    default group unless backend is None) and returns one RankResult per rank. `fn` and its
    return value must be picklable. Ranks still alive after `timeout_s` are killed. Each rank
    sees the launcher's environment as it is at this call, `env` on top.

    fresh_interpreter: True spawns each rank as a new interpreter, so `env` is there from its
    start (variables glibc, OpenMP or an import reads); False forks it from the preloaded server
    and sets `env` before the process group and `fn` (enough for what is read when used, such as
    FREESCALE_TIMEOUT_S; not TORCH_DISTRIBUTED_DEBUG, read at import), ~1.5 s of CPU less per
    rank. None (the default): fresh exactly when `env` is given."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if fresh_interpreter is not None and not isinstance(fresh_interpreter, bool):
        raise TypeError(f"fresh_interpreter must be True, False or None (fresh when env is given), "
                        f"got {fresh_interpreter!r}")
    ctx = _rank_context(bool(env) if fresh_interpreter is None else fresh_interpreter)
    results_q: "mp.Queue" = ctx.Queue()
    port = free_port()
    procs = []
    with _environ(env or {}):  # a rank's interpreter starts with `env` (glibc reads some at start)
        for rank in range(world_size):
            info = RankInfo(rank, world_size, "127.0.0.1", port)
            p = ctx.Process(target=_rank_main, args=(fn, info, args, dict(os.environ), backend, timeout_s, results_q),
                            name=f"freescale-rank{rank}", daemon=True)
            p.start()
            procs.append(p)
    results = [RankResult(rank) for rank in range(world_size)]
    deadline = time.monotonic() + timeout_s
    pending = set(range(world_size))

    def take_one(wait_s: float) -> bool:
        """Records one reported result, if one arrives within wait_s."""
        try:
            rank, value, error = results_q.get(timeout=wait_s)
        except queue.Empty:
            return False
        results[rank].value, results[rank].error = value, error
        pending.discard(rank)
        return True

    try:
        while pending and time.monotonic() < deadline:
            take_one(0.1)
            for rank in list(pending):
                if not procs[rank].is_alive() and procs[rank].exitcode is not None:
                    while rank in pending and take_one(0.2):  # results still in flight
                        pass
                    if rank in pending and procs[rank].exitcode == 0:  # os._exit(0) before reporting: not a pass
                        results[rank].error = f"rank {rank} exited (code 0) without reporting a result"
                    pending.discard(rank)  # otherwise it died without reporting (killed)
    except BaseException:  # a test's own timeout, Ctrl-C: no rank outlives the call
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5.0)
        raise
    for rank, p in enumerate(procs):
        p.join(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
        if p.is_alive():
            p.kill()
            p.join()
            if results[rank].error is None:
                results[rank].error = f"rank {rank} still running after {timeout_s} s: killed"
        results[rank].exitcode = p.exitcode
    while pending and take_one(0.2):  # reported past the deadline, before it exited: read it
        pass
    for rank in pending:  # no result read: never a pass (it exited 0 past the deadline, unread)
        if results[rank].error is None:
            results[rank].error = (f"rank {rank} reported no result within {timeout_s} s "
                                   f"(exit code {results[rank].exitcode})")
    return results


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """Like run_ranks, but raises RankFailure unless every rank returned; returns their values."""
    results = run_ranks(fn, world_size, *args, **kwargs)
    if not all(r.ok for r in results):
        raise RankFailure(results)
    return [r.value for r in results]
