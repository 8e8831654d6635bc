"""FailureSight (the explanation of a delegated collective's failure) on a fake communicator: no ranks."""

import time

from freescale_comm import _delegated
from freescale_comm._errors import comm_error


class _Core:
    """raise_peer_failure raises PEER_DIED naming rank 2 once `dead_at` (time.monotonic()) passed."""

    def __init__(self) -> None:
        self.dead_at = float("inf")

    def raise_peer_failure(self, needed):
        if 2 in needed and time.monotonic() >= self.dead_at:
            raise comm_error("[PEER_DIED] rank 2 died", "PEER_DIED", 2)

    def fail_from_outside(self, code, message, culprit):
        self.failed_with = (code, culprit)


def test_a_failure_after_the_grace_window_closed_opens_a_new_one(monkeypatch):
    """A failure with no cause in sight waits out the window; a later failure, after it closed,
    whose cause (a death) shows a moment later, is named PEER_DIED. It got no grace within 10 s of
    the last window (COMM_ERROR)."""
    monkeypatch.setattr(_delegated, "DEATH_SIGHT_GRACE_S", 0.2)
    core = _Core()
    sight = _delegated.FailureSight(core, "g")
    first = sight.explain(RuntimeError("Connection closed by peer"), "all_reduce", [0, 1, 2])
    assert first.code == "COMM_ERROR", first
    time.sleep(0.3)  # the window closed
    core.dead_at = time.monotonic() + 0.05  # the next death shows just after gloo's error
    second = sight.explain(RuntimeError("Connection closed by peer"), "all_reduce", [0, 1, 2])
    assert (second.code, second.culprit) == ("PEER_DIED", 2), second
    assert core.failed_with == ("PEER_DIED", 2)  # the group's communicator fails too, naming the cause


def test_a_gloo_timeout_looks_once_instead_of_waiting_out_the_grace(monkeypatch):
    """gloo timed out after the group's whole timeout: the error came a grace window (1 s) past it
    (the blame audit: 6.07 s against a 5 s group timeout). Counted, not timed: one look at the
    peers for a timeout, several within the window for a closed connection."""
    monkeypatch.setattr(_delegated, "DEATH_SIGHT_GRACE_S", 0.2)
    core = _Core()
    looks = []
    core.raise_peer_failure = lambda needed: looks.append(needed)
    sight = _delegated.FailureSight(core, "g")
    timed_out = sight.explain(RuntimeError("[../gloo/transport/tcp/pair.cc:446] Timed out waiting 5000ms for recv"),
                              "all_reduce", [0, 1, 2])
    assert timed_out.code == "TIMEOUT" and len(looks) == 1, (timed_out, len(looks))
    time.sleep(0.3)  # the window closed
    closed = sight.explain(RuntimeError("Connection closed by peer"), "all_reduce", [0, 1, 2])
    assert closed.code == "COMM_ERROR" and len(looks) > 2, (closed, len(looks))


def test_refusals_in_the_call_are_left_as_gloo_raised_them():
    sight = _delegated.FailureSight(_Core(), "g")
    refusal = RuntimeError("ProcessGroupGloo::allgather: invalid tensor size")
    assert sight.explain(refusal, "all_gather", [0, 1], in_the_call=True) is refusal
    not_runtime = ValueError("x")
    assert sight.explain(not_runtime, "all_gather", [0, 1]) is not_runtime
