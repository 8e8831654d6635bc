"""Where the measured benchmarks' ranks run: one CPU core per rank, standing for one device per rank.

A measured run (`freescale-bench e2e`, the demo) stands for ranks that each own an accelerator.
On a CPU host that means each rank owns a core: its compute then takes the same time whatever
the other ranks do, and a rank that idles frees nothing the others can use. With more ranks than
cores they share (round robin), and a rank that waits lends its core to the others: the same
work then takes longer in the modes that keep every rank busy at once (balancing), so step times
no longer stand for one device per rank. `oversubscription_note` says so in one line.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterator, Optional

__all__ = ["usable_cores", "default_ranks", "RankPlacement", "place_ranks", "pin_this_process", "hold_core",
           "thread_cores", "device_like_env", "oversubscription_note", "placement_words", "placement_json",
           "DEFAULT_MEASURED_RANKS"]

DEFAULT_MEASURED_RANKS = 4  # what the demo runs when the machine has a core for each


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity mask, not the machine's core count)."""
    return sorted(os.sched_getaffinity(0))


def default_ranks(cores: Optional[list[int]] = None, most: int = DEFAULT_MEASURED_RANKS) -> int:
    """Ranks of a measured run by default: one per usable core, at most `most`, at least 2."""
    n = len(usable_cores() if cores is None else cores)
    return max(2, min(most, n))


@dataclass(frozen=True)
class RankPlacement:
    """rank -> the one core it runs on. `shared`: how many ranks each used core holds at most."""

    cores: tuple[int, ...]  # [ranks]: core of rank r
    available: int  # usable cores when it was made

    @property
    def ranks(self) -> int:
        return len(self.cores)

    @property
    def oversubscribed(self) -> bool:
        return self.ranks > self.available

    @property
    def shared(self) -> int:
        return max(self.cores.count(c) for c in set(self.cores))


def place_ranks(ranks: int, cores: Optional[list[int]] = None) -> RankPlacement:
    """Rank r runs on cores[r % len(cores)]: its own core while ranks <= cores, else round robin."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    cores = usable_cores() if cores is None else sorted(cores)
    if not cores:
        raise ValueError("cores must name at least one CPU core")
    return RankPlacement(tuple(cores[r % len(cores)] for r in range(ranks)), len(cores))


def pin_this_process(core: int) -> list[int]:
    """Pins every thread of this process (the communicator's progress thread and gloo's included)
    to `core`; threads started later inherit it from their creator. Returns the thread ids pinned."""
    pinned = []
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            os.sched_setaffinity(tid, {core})
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        pinned.append(tid)
    return pinned


# What holds a rank's core while the rank does not use it: a process at SCHED_IDLE (it runs only
# when nothing else on the core wants to; any thread of the rank preempts it on wake-up) spinning on
# that core, killed with its parent (PR_SET_PDEATHSIG). Unprivileged: lowering one's own policy.
_HOLDER = """
import ctypes, os, sys
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG = 1, SIGKILL = 9
if os.getppid() != int(sys.argv[2]):
    sys.exit(0)  # the parent ended before the prctl
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
"""


@contextlib.contextmanager
def hold_core(core: int) -> Iterator[subprocess.Popen]:
    """While inside, `core` never idles: a SCHED_IDLE process spins there whenever the rank pinned
    to it waits. A device's idle time helps no other device; a CPU core's does: on a 2-core VM the
    same compute ran 3-18 % faster while the other core idled than while it computed (shared
    hardware below the vCPUs), so a straggler in an unbalanced mode computed faster than the same
    work in a balanced one. Held, the cores measured 2-4 % apart."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(core), str(os.getpid())],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield holder
    finally:
        holder.kill()
        holder.wait()


def thread_cores() -> list[int]:
    """Every core any thread of this process may run on (the union of their affinity masks)."""
    cores: set[int] = set()
    for name in os.listdir("/proc/self/task"):
        try:
            cores |= os.sched_getaffinity(int(name))
        except ProcessLookupError:
            continue
    return sorted(cores)


# glibc's malloc returns freed blocks of 128 KiB+ to the kernel (mmap/munmap, heap trimming), so a
# rank that frees a step's activations faults them back in at the next step: compute time then
# swings with what the allocator happened to keep (18 % between modes of the same work, measured on
# a 2-core VM). A device's caching allocator (PyTorch's on CUDA) keeps its blocks; these settings do
# the same on the CPU: blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap, which
# is never trimmed. Read once, when the rank's interpreter starts.
_KEEP_FREED_MEMORY = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=18446744073709551615"


def device_like_env(environ: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Environment for a rank process that stands for a device: malloc keeps freed memory (above).
    Tunables the caller already set win (they come later in GLIBC_TUNABLES)."""
    mine = (os.environ if environ is None else environ).get("GLIBC_TUNABLES", "")
    return {"GLIBC_TUNABLES": _KEEP_FREED_MEMORY + (":" + mine if mine else "")}


def oversubscription_note(placement: RankPlacement) -> str:
    """One line for the top of a measured table: '' when every rank has its own core."""
    if not placement.oversubscribed:
        return ""
    return (f"# oversubscribed: {placement.ranks} ranks share {placement.available} CPU cores (up to "
            f"{placement.shared} per core), so a rank that waits lends its core to the others: the same work "
            f"computes slower in modes that keep every rank busy (balance), and step times and bubbles do not "
            f"stand for one device per rank; use --ranks {placement.available} or fewer for that")


def placement_words(placement: RankPlacement, pinned: bool) -> str:
    """How a measured run's ranks ran, for its table's title."""
    if not pinned:
        return "unpinned"
    return "sharing cores" if placement.oversubscribed else "each on its own core"


def placement_json(placement: RankPlacement, rank_cores: list[list[int]]) -> dict:
    """A measured run's placement for its --json: the cores planned, and per rank the cores its
    threads could run on, read at its end."""
    return {"cores": list(placement.cores), "usable_cores": placement.available,
            "oversubscribed": placement.oversubscribed, "rank_cores": rank_cores}
