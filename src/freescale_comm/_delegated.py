"""Collectives a freescale group delegates to its inner gloo group fail as its own ops do: with a
CommError naming the root cause (the rank that died, closed its group, or aborted and why) where
the group's communicator sees one, instead of gloo's RuntimeError naming a socket ("Connection
closed by peer [127.0.0.1]:41234"). Gloo's error stays chained as the cause. A CommError is a
RuntimeError, so clients catching gloo's type still catch it.

Failures raised by wait() or the Work's future are communication failures; one raised in the
call (gloo's send / recv on a closed connection) is one if gloo's transport raised it or a root
cause is in sight, else gloo refused the arguments, and that error is raised as it always was."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from freescale_comm._core import CommError
from freescale_comm._errors import comm_error

# A killed peer's sockets close a moment before /proc shows it gone (a zombie): gloo can report the
# closed connection first. Seconds a failure waits for the cause to come into sight, and between looks.
DEATH_SIGHT_GRACE_S = 1.0
_LOOK_EVERY_S = 0.005


def _is_transport_failure(error: BaseException) -> bool:
    """Gloo's own words for a failed connection (its transport's source path), as opposed to a
    refusal of the call's arguments."""
    return "gloo/transport/" in str(error)


def explain(error: BaseException, core: Any, op: str, group: str, needed: Iterable[int],
            in_the_call: bool = False) -> BaseException:
    """The exception to raise for gloo's `error` in `op` on freescale group `group`: a CommError
    naming the root cause that `core` (the group's communicator) sees among the ranks `needed`
    (group ranks), looked for up to DEATH_SIGHT_GRACE_S; else a CommError carrying gloo's message
    (TIMEOUT if gloo timed out). Anything but a RuntimeError is returned unchanged, and so is an
    error raised `in_the_call` (before gloo returned a Work) that is not a transport failure and
    has no root cause in sight: gloo refusing the arguments."""
    if isinstance(error, CommError) or not isinstance(error, RuntimeError):
        return error
    needed = list(needed)
    where = f"{op} on freescale group {group!r} (run by its inner gloo group)"
    refusal = in_the_call and not _is_transport_failure(error)
    deadline = time.monotonic() + (0.0 if refusal else DEATH_SIGHT_GRACE_S)
    while True:
        try:
            core.raise_peer_failure(needed)
        except CommError as cause:
            return comm_error(f"{where} failed: {cause}. gloo said: {error}", getattr(cause, "code", "COMM_ERROR"),
                              getattr(cause, "culprit", None))
        if time.monotonic() >= deadline:
            break
        time.sleep(_LOOK_EVERY_S)
    if refusal:
        return error
    timed_out = "timed out" in str(error).lower()
    return comm_error(f"{where} failed, and no rank of the group is seen dead, closed or aborted (a rank on another "
                      f"host, frozen, or calling another collective?). gloo said: {error}",
                      "TIMEOUT" if timed_out else "COMM_ERROR")


class DelegatedWork(dist._Work):
    """An inner gloo Work whose failure is raised as explain() says; all else is the inner one's."""

    def __init__(self, work: dist.Work, why: Callable[[BaseException], BaseException]) -> None:
        super().__init__()
        self._inner_work = work
        self._why = why

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        try:
            return self._inner_work.wait() if timeout is None else self._inner_work.wait(timeout)
        except RuntimeError as e:
            error = self._why(e)
            if error is e:
                raise
            raise error from e

    def is_completed(self) -> bool:
        return self._inner_work.is_completed()

    def is_success(self) -> bool:
        return self._inner_work.is_success()

    def exception(self) -> Optional[BaseException]:
        return self._inner_work.exception()

    def result(self) -> list[torch.Tensor]:
        return self._inner_work.result()

    def _source_rank(self) -> int:  # recv from any source
        return self._inner_work._source_rank()

    def get_future(self) -> torch.futures.Future:
        # A fresh future set from the inner one's callback, not then(): then() re-raises a
        # callback's exception as a plain RuntimeError, and the CommError's type would be lost.
        inner = self._inner_work.get_future()  # gloo's gather / reduce_scatter: "not implemented", raised as is
        explained: torch.futures.Future = torch.futures.Future()

        def settle(fut: torch.futures.Future) -> None:
            try:
                value = fut.value()
            except RuntimeError as e:
                error = self._why(e)
                if error is not e:
                    error.__cause__ = e
                explained.set_exception(error)
                return
            except BaseException as e:  # noqa: BLE001 - handed to the future's waiters as it came
                explained.set_exception(e)
                return
            explained.set_result(value)

        inner.add_done_callback(settle)
        return explained
