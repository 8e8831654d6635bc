"""Collectives a freescale group delegates to its inner gloo group fail as its own ops do: with a
CommError naming the root cause (the rank it needs that died or closed its group) where the
group's communicator sees one, instead of gloo's
RuntimeError naming a socket ("Connection closed by peer [127.0.0.1]:41234"). Gloo's error stays
chained as the cause. A CommError is a RuntimeError, so clients catching gloo's type still catch it.

What is translated: a failure of the communication itself, raised by wait() or the Work's future
(not a wait(timeout) that ran out while the op goes on: gloo's error, as gloo raises it), or raised
in the call by gloo's transport (send / recv on a closed connection). What gloo refuses in the call
(bad arguments) it raises as it always did, whatever failed before."""

from __future__ import annotations

import datetime
import hashlib
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.distributed as dist

from freescale_comm import _completions
from freescale_comm._core import CommError
from freescale_comm._errors import comm_error, gloo_timed_out, ranks_by
from freescale_comm.work import c10d_wait_limit

# A killed peer's sockets close a moment before /proc shows it gone (a zombie: the last steps of its
# exit): gloo can report the closed connection first. Seconds a group's failures look for a cause,
# from the first failure after the last window closed (one window for a burst of them), and
# seconds between looks.
DEATH_SIGHT_GRACE_S = 1.0
_LOOK_EVERY_S = 0.005
# What gloo's Work.wait(timeout) raises when the caller's limit runs out (not the op's failure;
# a Work's is_completed() cannot tell: gloo's reduce-scatter Works never report completed).
_OWN_LIMIT = "Operation timed out!"


def is_transport_failure(error: BaseException) -> bool:
    """Gloo's own words for a failed connection (its transport's source path), as opposed to a
    refusal of the call's arguments."""
    return "gloo/transport/" in str(error)


_CALL_TEXT_BYTES = 119  # what a rank's segment holds of a call's text (host_layout.h: DelegatedCall)


def call_text(op: str, tensors: Sequence[torch.Tensor], root: Optional[int] = None) -> str:
    """What of a delegated collective must agree across ranks, as text: the op, its root, and the
    dtype and element count of each tensor that gloo matches between ranks (not their shapes:
    gloo moves a [2, 3] against a [6]). A long one ends in a digest of the whole."""
    parts = [op] + ([f"root={root}"] if root is not None else [])
    parts += [",".join(f"{str(t.dtype).removeprefix('torch.')}x{t.numel()}" for t in tensors)]
    text = " ".join(parts)
    if len(text.encode()) > _CALL_TEXT_BYTES:
        text = text[:96] + "..#" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return text


def odd_call_out(calls: Sequence[str], needed: Sequence[int]) -> Optional[tuple[dict[str, list[int]], Optional[int]]]:
    """Among the `needed` ranks' texts of one delegated call ('' unseen), None if those seen agree;
    else (text -> the ranks that called it, the odd rank out: the one rank not calling what two
    or more others called, alike, or None where that cannot be told: two ranks, a tie, or several
    odd ones)."""
    seen = {r: calls[r] for r in needed if 0 <= r < len(calls) and calls[r]}
    by = ranks_by(list(seen.values()))
    if len(by) < 2:
        return None
    ranks = list(seen)
    by = {text: [ranks[i] for i in idx] for text, idx in by.items()}
    sizes = sorted((len(r) for r in by.values()), reverse=True)
    odd = None
    if sizes[0] >= 2 and sizes[1] < sizes[0] and sum(sizes[1:]) == 1:
        odd = next(r[0] for r in by.values() if len(r) == 1)
    return by, odd


def raise_explained(error: BaseException, explained: BaseException) -> NoReturn:
    """Raises gloo's `error` as is where `explained` is it (its traceback kept), else `explained`
    from it."""
    if explained is error:
        raise error
    raise explained from error


class FailureSight:
    """Explains the failed delegated collectives of one freescale group, through its communicator
    `core` (raise_peer_failure: which needed rank died or closed)."""

    def __init__(self, core: Any, group: str) -> None:
        self._core, self._group = core, group
        self._lock = threading.Lock()
        self._window_ends: Optional[float] = None  # time.monotonic() the current grace window ends

    def _deadline(self) -> float:
        with self._lock:
            now = time.monotonic()
            if self._window_ends is None or now > self._window_ends:
                self._window_ends = now + DEATH_SIGHT_GRACE_S
            return self._window_ends

    def explain(self, error: BaseException, op: str, needed: list[int], in_the_call: bool = False,
                call: Optional[int] = None) -> BaseException:
        """The exception to raise for gloo's `error` in `op`: a CommError naming the root cause among
        the group ranks `needed`, looked for until the grace window ends; else a CommError with
        gloo's words (TIMEOUT if gloo timed out). The root cause: ranks that made different calls as
        this rank's delegated call number `call` (SIZE_MISMATCH, naming the odd rank out where one
        is; a rank that then closed or died of it is not the cause), else a needed rank that died
        or closed. Returned unchanged: anything but a RuntimeError, and an error raised
        `in_the_call` that is not gloo's transport failing (a refusal)."""
        if isinstance(error, CommError) or not isinstance(error, RuntimeError):
            return error
        if in_the_call and not is_transport_failure(error):
            return error
        where = f"{op} on freescale group {self._group!r} (run by its inner gloo group)"
        # gloo's own timeout ran the group's whole timeout: one look (the grace is for a socket seen
        # closed before /proc shows its process gone; waiting it out put the error past the timeout)
        deadline = time.monotonic() if gloo_timed_out(error) else self._deadline()
        while True:
            mismatch = self._calls_disagree(call, needed, final=time.monotonic() >= deadline)
            if mismatch is not None:
                message, culprit = mismatch
                self._core.fail_from_outside("SIZE_MISMATCH", f"{where} failed: {message}", culprit)
                return comm_error(f"{where} failed: {message}. gloo said: {error}", "SIZE_MISMATCH", culprit)
            try:
                self._core.raise_peer_failure(needed)
            except CommError as cause:
                code, culprit = getattr(cause, "code", "COMM_ERROR"), getattr(cause, "culprit", None)
                # this group is broken too: its notice tells a survivor that sees this rank leave next
                # who died first (else it names the lowest rank among the dead: perhaps this one)
                self._core.fail_from_outside(code, f"{where} failed: {cause}", culprit)
                return comm_error(f"{where} failed: {cause}. gloo said: {error}", code, culprit)
            if time.monotonic() >= deadline:
                break
            time.sleep(_LOOK_EVERY_S)
        return comm_error(f"{where} failed, and no rank it needs is seen dead or closed (a rank on another host, "
                          f"frozen, or calling another collective?). gloo said: {error}",
                          "TIMEOUT" if gloo_timed_out(error) else "COMM_ERROR")


    def _calls_disagree(self, call: Optional[int], needed: list[int], final: bool) -> Optional[tuple[str, Optional[int]]]:
        """(message, culprit) if the needed ranks' texts of delegated call `call` disagree; None if
        they agree, or if some are unseen and this is not the `final` look (they may still come)."""
        if call is None:
            return None
        calls = self._core.delegated_calls(call)
        found = odd_call_out(calls, needed)
        if found is None or (not final and not all(calls[r] for r in needed if 0 <= r < len(calls))):
            return None
        by, odd = found
        said = "; ".join(f"rank{'s' if len(r) > 1 else ''} {r[0] if len(r) == 1 else r} called '{text}'"
                         for text, r in by.items())
        who = (f"rank {odd} is the odd one out" if odd is not None else
               "which rank is wrong cannot be told (two ranks, or no majority)")
        return (f"the ranks called different collectives as their delegated call #{call} ({said}): {who}; "
                "every rank must call the same collectives in the same order, with tensors of the same dtype and "
                "number of elements"), odd


class DelegatedWork(dist._Work):
    """An inner gloo Work whose failure is raised as `why` explains it (once per Work: wait() and
    the future raise the same exception); all else is the inner Work's."""

    def __init__(self, work: dist.Work, why: Callable[[BaseException], BaseException]) -> None:
        super().__init__()
        self._inner_work = work
        self._why = why
        self._lock = threading.Lock()
        self._explained: Optional[BaseException] = None

    def _explain(self, error: BaseException) -> BaseException:
        with self._lock:  # a second caller waits for the first's explanation rather than look again
            if self._explained is None:
                explained = self._why(error)
                if explained is not error and explained.__cause__ is None:
                    explained.__cause__ = error
                self._explained = explained
            return self._explained

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        limit = c10d_wait_limit(timeout)
        try:
            return self._inner_work.wait() if limit is None else self._inner_work.wait(limit)
        except RuntimeError as e:
            if limit is not None and _OWN_LIMIT in str(e):
                raise  # the caller's own limit ran out (the op may still complete): gloo's error, as gloo raises it
            raise_explained(e, self._explain(e))

    def is_completed(self) -> bool:
        return self._inner_work.is_completed()

    def is_success(self) -> bool:
        return self._inner_work.is_success()

    def exception(self) -> Optional[BaseException]:
        return self._explained if self._explained is not None else self._inner_work.exception()

    def result(self) -> list[torch.Tensor]:
        return self._inner_work.result()

    def _source_rank(self) -> int:  # recv from any source
        return self._inner_work._source_rank()

    def get_future(self) -> torch.futures.Future:
        # A fresh future set from the inner one's callback, not then(): then() re-raises a
        # callback's exception as a plain RuntimeError, and the CommError's type would be lost. A
        # failure is explained on a completion thread: gloo runs the callback on its own worker,
        # which the grace window must not hold.
        inner = self._inner_work.get_future()  # gloo's gather / reduce_scatter: "not implemented", raised as is
        explained: torch.futures.Future = torch.futures.Future()

        def settle(fut: torch.futures.Future) -> None:
            try:
                value = fut.value()
            except RuntimeError as e:
                failure = e  # (`e` is unbound when the except block ends, before the task runs)

                def explain_and_fail() -> None:
                    try:
                        error = self._explain(failure)
                    except BaseException as unexpected:  # noqa: BLE001 - the future must complete all the same
                        error = unexpected
                    explained.set_exception(error)

                _completions.run_soon(explain_and_fail)
                return
            except BaseException as e:  # noqa: BLE001 - handed to the future's waiters as it came
                explained.set_exception(e)
                return
            explained.set_result(value)

        inner.add_done_callback(settle)
        return explained


class AllOfWork(dist._Work):
    """One Work for delegated `works` posted in order on one group (a coalesced call, one op per
    tensor): done when all are, its value `outputs`, the first failure raised (wait() and the
    future alike). Gloo's gather and reduce-scatter Works have no future: those are waited for
    here, so the call returns once they are done, as a synchronous one."""

    def __init__(self, works: list[dist.Work], outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._works, self._outputs = works, outputs
        try:
            self._futures: Optional[list[torch.futures.Future]] = [w.get_future() for w in works]
        except RuntimeError:  # "Work::getFuture not implemented"
            for w in works:
                w.wait()
            self._futures = None  # done: waited for here

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Waits for every part; a limit (c10d_wait_limit's) holds for the whole call."""
        limit = c10d_wait_limit(timeout)
        if limit is None:
            for w in self._works:
                w.wait()
            return True
        deadline = time.monotonic() + limit.total_seconds()
        for w in self._works:
            left = deadline - time.monotonic()
            if left <= 0 and not w.is_completed():
                raise RuntimeError(_OWN_LIMIT)  # as gloo's wait(timeout) says it
            w.wait(datetime.timedelta(seconds=max(left, 0.001)))
        return True

    def is_completed(self) -> bool:
        return self._futures is None or all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> Optional[BaseException]:
        for w in self._works:
            error = w.exception()
            if error is not None:
                return error
        return None

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        done: torch.futures.Future = torch.futures.Future()
        if self._futures is None:  # waited for in the call
            done.set_result(self._outputs)
            return done

        parts = self._futures

        def settle(_: torch.futures.Future) -> None:
            # collect_all completes once every part is done: the first failing part's error, as it came
            for part in parts:
                try:
                    part.value()
                except BaseException as e:  # noqa: BLE001 - handed to the future's waiters as it came
                    done.set_exception(e)
                    return
            done.set_result(self._outputs)

        torch.futures.collect_all(parts).add_done_callback(settle)
        return done
