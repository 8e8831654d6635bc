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


def test_the_odd_call_out_is_one_rank_against_two_or_more_alike():
    a, b, c = "all_reduce float32x4", "all_reduce float32x5", "broadcast root=0 float32x4"
    assert _delegated.odd_call_out([a, a, a], [0, 1, 2]) is None
    assert _delegated.odd_call_out([a, b, a], [0, 1, 2]) == ({a: [0, 2], b: [1]}, 1)
    assert _delegated.odd_call_out([a, b], [0, 1]) == ({a: [0], b: [1]}, None)  # a tie
    assert _delegated.odd_call_out([a, a, b, b], [0, 1, 2, 3])[1] is None  # a tie
    assert _delegated.odd_call_out([a, a, b, c], [0, 1, 2, 3])[1] is None  # two odd ones
    assert _delegated.odd_call_out([a, "", b, a], [0, 1, 2, 3]) == ({a: [0, 3], b: [2]}, 2)  # rank 1 unseen
    assert _delegated.odd_call_out([a, b, a], [0, 2]) is None  # rank 1 not needed


def test_a_call_seen_disagreeing_outranks_a_rank_that_closed(monkeypatch):
    """The ranks' texts of the failed call disagree: SIZE_MISMATCH naming the odd one, and the
    group's communicator fails naming it, though a needed rank closed (the cause's own peer)."""
    monkeypatch.setattr(_delegated, "DEATH_SIGHT_GRACE_S", 0.2)
    core = _Core()
    core.dead_at = 0.0  # rank 2 is gone
    core.delegated_calls = lambda n: ["all_reduce float32x4", "all_reduce float32x5", "all_reduce float32x4"]
    error = _delegated.FailureSight(core, "g").explain(RuntimeError("Connection closed by peer"), "all_reduce",
                                                        [0, 1, 2], call=7)
    assert (error.code, error.culprit) == ("SIZE_MISMATCH", 1), error
    assert "delegated call #7" in str(error) and "rank 1 is the odd one out" in str(error), error
    assert core.failed_with == ("SIZE_MISMATCH", 1)


def test_call_texts_say_what_gloo_matches_and_fit_the_segment():
    import torch

    assert _delegated.call_text("all_reduce", [torch.ones(2, 3)]) == "all_reduce float32x6"
    assert _delegated.call_text("broadcast", [torch.ones(4, dtype=torch.int64)], root=1) == "broadcast root=1 int64x4"
    long = _delegated.call_text("all_reduce_coalesced", [torch.ones(i + 1) for i in range(40)])
    other = _delegated.call_text("all_reduce_coalesced", [torch.ones(i + 1) for i in range(41)])
    assert len(long.encode()) <= 119 and long != other
