"""CommErrors raised by Python-level checks between ranks, carrying `.code` (an ErrorCode name) and
`.culprit` (the rank at the root, None if unknown) as the core's do (README: every CommError)."""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

from freescale_comm._core import CommError


def comm_error(message: str, code: str = "COMM_ERROR", culprit: Optional[int] = None) -> CommError:
    err = CommError(message)
    err.code, err.culprit = code, culprit
    return err


def gloo_timed_out(error: BaseException) -> bool:
    """Whether a gloo group's error says it timed out (a peer late or frozen past the group's
    timeout) rather than that a connection failed."""
    return "timed out" in str(error).lower()


def ranks_by(values: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """Each rank's value -> the ranks that hold it (in order of first appearance), for messages
    naming who disagreed."""
    by: dict[Hashable, list[int]] = {}
    for rank, value in enumerate(values):
        by.setdefault(value, []).append(rank)
    return by


def refuse_differing_kinds(codes: Sequence[Hashable], what: str, here: str) -> None:
    """CommError (SIZE_MISMATCH) on every rank unless every rank's code (a hash of the dtypes and
    row shapes it passed) is the same: `what` they disagreed on, the ranks of each kind, and
    `here` (this rank's kinds and what every rank must pass)."""
    by = ranks_by(codes)
    if len(by) > 1:
        groups = "; ".join(f"ranks {ranks}: one kind" for ranks in by.values())
        raise comm_error(f"{what} ({groups}); {here}", "SIZE_MISMATCH")
