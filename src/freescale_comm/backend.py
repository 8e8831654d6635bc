"""The torch.distributed backend "freescale": a ProcessGroup whose all-to-alls and barrier run on
freescale's own transports, with every other collective delegated to an inner group built on the
same store (gloo for CPU tensors, NCCL for CUDA tensors). ``with fc.priority(p):`` sets the
priority of the native ops issued inside it.

torch hands a Python ProcessGroup subclass every call made on the group, under the new method
names (all_to_all_single, all_gather_single, reduce_scatter_single, ...) or the old ones
(alltoall_base, _allgather_base, ...); inner c10d backends answer only to the old ones.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import logging
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from freescale_comm import _core
from freescale_comm._bootstrap import StoreBootstrap
from freescale_comm._delegated import (AllOfWork, DelegatedWork, FailureSight, call_text, is_transport_failure,
                                       raise_explained)
from freescale_comm._errors import comm_error, gloo_timed_out
from freescale_comm.communicator import Communicator, check_priority
from freescale_comm.work import Work, c10d_wait_limit

logger = logging.getLogger("freescale_comm")

BACKEND_NAME = "freescale"

# None outside any fc.priority block: the group's default priority applies.
_priority: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("freescale_priority", default=None)


@contextlib.contextmanager
def priority(p: int) -> Iterator[None]:
    """Native ops issued through a ``freescale`` group inside this block run at priority `p`
    (an int; larger = sooner), whatever the group's default. Priorities reorder execution, never
    matching. The block holds on the thread (and context) that enters it: backward AllToAlls run
    by autograd take the group's default priority instead (see Options)."""
    token = _priority.set(check_priority(p))
    try:
        yield
    finally:
        _priority.reset(token)


def current_priority() -> int:
    """The priority set by the innermost ``fc.priority`` block (0 outside any)."""
    p = _priority.get()
    return 0 if p is None else p


@dataclasses.dataclass(frozen=True)
class Options:
    """The ``pg_options`` of a freescale group. `priority` (int, larger = sooner; default 0) is
    the group's default: its native ops run at it unless issued inside ``fc.priority(...)``.
    Unlike that block, it reaches ops issued on any thread, e.g. the backward AllToAlls autograd
    runs for TorchRec's comm ops: give embedding traffic its own group at a high priority::

        emb_pg = dist.new_group(backend="freescale", pg_options=fc.Options(priority=100))
    """

    priority: int = 0

    def __post_init__(self) -> None:
        check_priority(self.priority)


class _NativeWork(dist._Work):
    """A c10d Work over a freescale op: wait() drives the op on the waiting thread."""

    def __init__(self, work: Work, result: list[torch.Tensor]) -> None:
        super().__init__()
        self._work = work
        self._result = result

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        limit = c10d_wait_limit(timeout)
        return self._work.wait(None if limit is None else max(limit, datetime.timedelta(0)))

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Optional[BaseException]:
        return self._work.exception()

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()


class _BarrierWork(_NativeWork):
    """A barrier's Work: its future's value is [] (gloo's), not the empty message it sent; wait()
    with no timeout of its own waits `timeout` (dist.barrier(timeout=...)), None: the group's."""

    def __init__(self, work: Work, timeout: Optional[datetime.timedelta]) -> None:
        super().__init__(work, [])
        self._timeout = timeout

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        limit = c10d_wait_limit(timeout)
        return super().wait(self._timeout if limit is None else limit)

    def get_future(self) -> torch.futures.Future:
        def nothing(fut: torch.futures.Future) -> list[torch.Tensor]:
            fut.wait()  # re-raises the op's error
            return []

        return self._work.get_future().then(nothing)


# Store key each rank of a freescale group sets as it begins building it (+ its group rank).
_ARRIVED = "freescale-arrived/"


def _not_arrived(store: dist.Store, size: int) -> list[int]:
    """Group ranks whose arrival key is not in the group's store ([] if the store cannot say)."""
    try:
        return [r for r in range(size) if not store.check([f"{_ARRIVED}{r}"])]
    except Exception:  # noqa: BLE001 - the store's host is gone too: the caller says what it can
        return []


class ProcessGroupFreescale(dist.ProcessGroup):
    """Created by torch for ``init_process_group("freescale")`` / ``new_group(backend="freescale")``."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, group_name: str = "",
                 options: Optional[Options] = None) -> None:
        super().__init__(rank, size)
        self.default_priority = (options or Options()).priority  # ops outside any fc.priority block
        self._store = store
        self._timeout = timeout
        self._group_name_ = group_name
        try:
            store.set(f"{_ARRIVED}{rank}", "1")  # names the ranks that never came if the rendezvous fails
            self._cpu = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        except RuntimeError as e:  # its rendezvous timed out (DistStoreError), or the store's host left
            missing = _not_arrived(store, size)
            who = (f"rank(s) {missing} never began building it (died or failed before, or late)" if missing else
                   "a rank died or failed while building it, or is late")
            raise comm_error(f"setting up a freescale group: its inner gloo group's rendezvous failed within "
                             f"{timeout.total_seconds():g} s: {who}. gloo said: {e}", "TIMEOUT",
                             missing[0] if len(missing) == 1 else None) from e
        # TORCH_DISTRIBUTED_DEBUG=DETAIL: torch checks collectives only in the backends it wraps, and
        # it wraps no ProcessGroup subclass (this one): wrap the inner gloo group here (CPU tensors'
        # delegated ops), and check native ops through it too (_check_native)
        self._detail = dist.get_debug_level() == dist.DebugLevel.DETAIL
        if self._detail:
            from torch.distributed.distributed_c10d import _create_process_group_wrapper  # (private: only here)

            self._cpu = _create_process_group_wrapper(self._cpu, "freescale", store, rank, size, timeout)
        self._cuda: Optional[dist.ProcessGroup] = None  # NCCL, built on first use
        self._cuda_lock = threading.Lock()
        self._comm: Optional[Communicator] = None
        self._sight: Optional[FailureSight] = None  # explains delegated CPU ops' failures (built on first use)
        self._cuda_native = "ce" in _core.build_info()["transports"]  # CUDA tensors on copy engines
        try:
            # setup rounds wait for peers up to the group's timeout, as its gloo rendezvous does (not
            # FREESCALE_TIMEOUT_S, the ops' limit: ranks may start seconds apart)
            self._comm = Communicator._over(StoreBootstrap(dist.PrefixStore("freescale/", store), rank, size, timeout),
                                            timeout)
        except _core.UnsupportedError as e:
            # Ranks on several hosts: the host transport cannot serve them; gloo moves CPU data.
            logger.warning("freescale group %r: native ops fall back to gloo (%s)", group_name, e)

    # --- identity -----------------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        self._group_name_ = name
        super()._set_group_name(name)

    @property
    def group_name(self) -> str:
        return self._group_name_

    def __repr__(self) -> str:
        return f"ProcessGroupFreescale(rank={self.rank()}, size={self.size()}, name={self._group_name_!r})"

    # --- where a call goes ----------------------------------------------------------------------
    def _inner(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The inner group for these tensors' device: gloo (CPU) or NCCL (CUDA)."""
        device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))
        if device.type == "cpu":
            return self._cpu
        if device.type == "cuda":
            return self._nccl()
        raise ValueError(f"the freescale backend takes CPU or CUDA tensors, got {device}; move them with .to()")

    def _nccl(self) -> Any:
        with self._cuda_lock:
            if self._cuda is None:
                if not dist.is_nccl_available():
                    raise RuntimeError("CUDA tensors need NCCL for the collectives freescale delegates, and this torch has none")
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self._timeout
                self._cuda = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", self._store), self.rank(), self.size(), options)
            return self._cuda

    def _native(self, tensors: Sequence[torch.Tensor]) -> bool:
        """True if freescale's own transports move these tensors: CPU ones (host transport), CUDA
        ones in CUDA builds (copy engines) unless their setup found it cannot serve this group."""
        if self._comm is None:
            return False
        devices = {t.device.type for t in tensors}
        return devices == {"cpu"} or (devices == {"cuda"} and self._cuda_native)

    def _check_native(self, op: str, barrier_options: Any = None) -> None:
        """TORCH_DISTRIBUTED_DEBUG=DETAIL: before a native op (all_to_all_single, all_to_all or
        barrier), torch's checks of the collective gloo runs for it, with no data (they compare the
        op's kind and sequence number across ranks; all_to_all's sizes may differ). A mismatch, or a
        rank that did not arrive, is a CommError on every rank that checked."""
        if not self._detail:
            return
        empty = torch.empty(0)
        try:
            if op == "barrier":
                self._cpu.barrier(barrier_options if barrier_options is not None else dist.BarrierOptions()).wait()
            elif op == "all_to_all":
                self._cpu.alltoall([empty] * self.size(), [empty] * self.size(), dist.AllToAllOptions()).wait()
            else:
                self._cpu.alltoall_base(empty, empty, [], [], dist.AllToAllOptions()).wait()
        except RuntimeError as e:
            raise _checks_failed(op, self._group_name_, e) from e

    def _native_cuda_failed(self, error: Exception) -> None:
        """The copy-engine setup (collective: it fails on every rank alike) could not serve this
        group, e.g. ranks on several nodes: NCCL moves CUDA tensors from now on."""
        self._cuda_native = False
        logger.warning("freescale group %r: CUDA all_to_all falls back to NCCL (%s)", self._group_name_, error)

    # --- native ---------------------------------------------------------------------------------
    @property
    def default_priority(self) -> int:
        """The priority of this group's native ops issued outside any ``fc.priority`` block."""
        return self._default_priority

    @default_priority.setter
    def default_priority(self, p: int) -> None:
        self._default_priority = check_priority(p)

    def _op_priority(self) -> int:
        p = _priority.get()
        return self._default_priority if p is None else p

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], opts: Any = None) -> dist.Work:
        with _refused_as_gloo_refuses():
            return self._all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def _all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                           input_split_sizes: Sequence[int], opts: Any = None) -> dist.Work:
        if not self._native([output, input]):
            opts = opts if opts is not None else dist.AllToAllOptions()
            return self._inner([input]).alltoall_base(output, input, list(output_split_sizes), list(input_split_sizes), opts)
        if self.size() == 1 and isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor) and \
                output.dim() == 0 and input.dim() == 0:
            output, input = output.view(1), input.view(1)  # one rank's scalar, copied as gloo does (views: it lands)
        assert self._comm is not None
        self._check_native("all_to_all_single")
        try:
            work = self._comm.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                priority=self._op_priority(), async_op=True)
        except _core.UnsupportedError as e:
            if input.device.type != "cuda":
                raise
            self._native_cuda_failed(e)
            return self._all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)
        return _NativeWork(work, [output])

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int],
                      input_split_sizes: Sequence[int], opts: Any = None) -> dist.Work:
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        with _refused_as_gloo_refuses():
            return self._alltoall(output_tensors, input_tensors, opts)

    def _alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        tensors = [*output_tensors, *input_tensors]
        if not self._native(tensors):
            return self._inner(tensors).alltoall(output_tensors, input_tensors, opts if opts is not None else dist.AllToAllOptions())
        if len(output_tensors) != self.size() or len(input_tensors) != self.size():
            raise ValueError(f"all_to_all needs one output and one input tensor per rank ({self.size()}), got "
                             f"{len(output_tensors)} outputs and {len(input_tensors)} inputs")
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise TypeError(f"all_to_all tensors must share one dtype, got {sorted(map(str, dtypes))}")
        for i, t in enumerate(output_tensors):
            if torch._debug_has_internal_overlap(t) == 1:  # 1: certainly overlaps (2: cannot tell cheaply)
                raise ValueError(f"all_to_all output_tensor_list[{i}] has elements that share memory (an expand()ed, "
                                 f"stride-0 view): it cannot hold the {t.numel()} values it receives; pass a tensor "
                                 f"of its own (.clone() it)")
        # One byte-level AllToAllv over packed copies: rows = elements, so shapes may differ per rank.
        send = torch.cat([t.reshape(-1) for t in input_tensors]) if input_tensors else torch.empty(0)
        recv = torch.empty(sum(t.numel() for t in output_tensors), dtype=send.dtype, device=send.device)
        assert self._comm is not None
        self._check_native("all_to_all")
        work = self._comm._all_to_all(recv, send, [t.numel() for t in output_tensors], [t.numel() for t in input_tensors],
                                      self._op_priority(), True, "all_to_all")

        def unpack(_: Any) -> list[torch.Tensor]:
            if recv.is_cuda:  # copies may run on a stream other than recv's: keep its block until they ran
                recv.record_stream(torch.cuda.current_stream(recv.device))
            for out, part in zip(output_tensors, recv.split([t.numel() for t in output_tensors])):
                out.copy_(part.view_as(out))
            return output_tensors

        return _UnpackWork(work, output_tensors, unpack)

    def barrier(self, opts: Any = None) -> dist.Work:
        if self._comm is None:
            return self._cpu.barrier(opts if opts is not None else dist.BarrierOptions())
        self._check_native("barrier", opts)
        empty = torch.empty(0, dtype=torch.uint8)
        work = self._comm._all_to_all(empty, empty, [0] * self.size(), [0] * self.size(), self._op_priority(), True,
                                      "barrier")
        timeout = getattr(opts, "timeout", None)  # BarrierOptions' default (unset) is negative
        return _BarrierWork(work, timeout if timeout is not None and timeout >= datetime.timedelta(0) else None)

    # --- delegated (same results as the inner group) ------------------------------------------
    def _delegate(self, op: str, tensors: Sequence[torch.Tensor], call: Callable[[Any], dist.Work],
                  peers: Optional[Sequence[int]] = None, root: Optional[int] = None,
                  collective: bool = True) -> dist.Work:
        """call(inner group for `tensors`); a CPU op's failure is raised as a CommError naming its root
        cause among `peers` (group ranks; default: all) where this group's communicator sees one. A
        `collective` (every rank calls it alike: `tensors`, the ones gloo matches, and `root`) is
        published first, so a failure can name the rank that called another one."""
        inner = self._inner(tensors)
        if inner is not self._cpu or self._comm is None:
            return call(inner)  # CUDA: NCCL reports its own failures; ranks on several hosts: no sight of them
        if self._sight is None:
            self._sight = FailureSight(self._comm._core, self._group_name_)
        sight = self._sight
        needed = list(range(self.size())) if peers is None else list(peers)
        core = self._comm._core
        try:
            work = call(inner)
        except RuntimeError as e:
            if self._detail and _CHECKS_SAY in str(e):
                raise _checks_failed(op, self._group_name_, e) from e
            # a call gloo refused (its arguments) was not made: it takes no number among the calls
            n = core.note_delegated_call(call_text(op, tensors, root)) if collective and is_transport_failure(e) else None
            raise_explained(e, sight.explain(e, op, needed, in_the_call=True, call=n))
        n = core.note_delegated_call(call_text(op, tensors, root)) if collective else None
        return DelegatedWork(work, lambda e: sight.explain(e, op, needed, call=n))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._delegate("broadcast", tensors, lambda g: g.broadcast(tensors, opts), root=opts.rootRank)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._delegate("all_reduce", tensors, lambda g: g.allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._delegate("all_reduce_coalesced", tensors, lambda g: g.allreduce_coalesced(tensors, opts))

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._delegate("reduce", tensors, lambda g: g.reduce(tensors, opts), root=opts.rootRank)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._delegate("all_gather", input_tensors, lambda g: g.allgather(output_tensors, input_tensors, opts))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        return self._delegate("all_gather_into_tensor", [input], lambda g: g._allgather_base(output, input, opts))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        return self.all_gather_single(output, input, opts)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._delegate("all_gather_coalesced", input_list,
                              lambda g: g.allgather_coalesced(output_lists, input_list, opts))

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        # (the inner groups' coalesced form is not callable from Python: functional collectives,
        # DTensor and FSDP2 reach it) one all_gather_into_tensor per pair, in order, one Work
        return AllOfWork([self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)], outputs)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._delegate("gather", input_tensors, lambda g: g.gather(output_tensors, input_tensors, opts),
                              root=opts.rootRank)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        return self._delegate("scatter", output_tensors, lambda g: g.scatter(output_tensors, input_tensors, opts),
                              root=opts.rootRank)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        return self._delegate("reduce_scatter", output_tensors,
                              lambda g: g.reduce_scatter(output_tensors, input_tensors, opts))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        return self._delegate("reduce_scatter_tensor", [input], lambda g: g._reduce_scatter_base(output, input, opts))

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        # as allgather_into_tensor_coalesced
        return AllOfWork([self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)], outputs)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self._delegate("send", tensors, lambda g: g.send(tensors, dst, tag), peers=[dst], collective=False)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self._delegate("recv", tensors, lambda g: g.recv(tensors, src, tag), peers=[src], collective=False)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        return self._delegate("recv", tensors, lambda g: g.recv_anysource(tensors, tag), collective=False)

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> None:
        return self._cpu.monitored_barrier(*args, **kwargs)

    # --- lifetime -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """destroy_process_group: ops still pending finish first (within the timeout), as gloo's."""
        self._close(drain=True)

    def abort(self) -> None:
        """Pending ops fail at once (a thread stuck in one returns)."""
        self._close(drain=False)

    def _close(self, drain: bool) -> None:
        if self._comm is not None:
            self._comm._close(drain)
        for inner in (self._cpu, self._cuda):
            if inner is not None and hasattr(inner, "shutdown"):
                try:
                    inner.shutdown()
                except Exception:  # noqa: BLE001 - best effort while tearing down
                    logger.debug("inner group shutdown failed", exc_info=True)


class _UnpackWork(_NativeWork):
    """all_to_all (list form): the op's bytes land packed, and are copied to the caller's outputs
    once it completes: in wait() (CUDA: on the caller's current stream, after it waited for the
    op), or in the future's callback (CUDA: on the callback's stream, which waited for the op; the
    child future's events follow the copies). Unpacks once; a CUDA unpack records an event that
    the later path's stream waits on. CPU outputs, as gloo's, hold the result once the op
    completes, waited for or not: the thread completing it unpacks, and is_completed() and
    result() do before they answer (the callback may not have run yet)."""

    def __init__(self, work: Work, outputs: list[torch.Tensor], unpack: Any) -> None:
        super().__init__(work, outputs)
        self._unpack = unpack
        self._unpacked = False
        self._unpacked_event: Optional[torch.cuda.Event] = None  # CUDA: after the unpack copies
        self._lock = threading.Lock()
        self._on_host = not any(t.is_cuda for t in outputs)
        if self._on_host:
            work.get_future().add_done_callback(lambda _: self._finish_if_succeeded())

    def _finish_if_succeeded(self) -> None:
        """Unpacks once the op succeeded. Never raises (it runs as a done-callback, and for
        is_completed()): an unpack that fails stays undone, and wait(), result() and the future
        raise its error when they unpack."""
        if self._work.is_success():
            try:
                self._finish()
            except Exception:  # noqa: BLE001 - raised again where the caller unpacks
                logger.debug("all_to_all: unpacking the outputs failed; raised again by wait()", exc_info=True)

    def is_completed(self) -> bool:
        done = super().is_completed()
        if done and self._on_host:
            self._finish_if_succeeded()
        return done

    def result(self) -> list[torch.Tensor]:
        if self._on_host and self._work.is_completed() and self._work.is_success():
            self._finish()
        return self._result

    def _finish(self) -> None:
        device = self._result[0].device if self._result else torch.device("cpu")
        with self._lock:
            if not self._unpacked:
                self._unpack(None)
                self._unpacked = True
                if device.type == "cuda":
                    self._unpacked_event = torch.cuda.Event()
                    self._unpacked_event.record(torch.cuda.current_stream(device))
            elif self._unpacked_event is not None:
                torch.cuda.current_stream(device).wait_event(self._unpacked_event)

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        done = super().wait(timeout)
        self._finish()
        return done

    def get_future(self) -> torch.futures.Future:
        def then(fut: torch.futures.Future) -> list[torch.Tensor]:
            fut.wait()  # re-raises the op's error; CUDA: the callback's stream waits for the op
            self._finish()
            return self._result

        return self._work.get_future().then(then)


class ArgumentValueError(ValueError, RuntimeError):
    """A bad argument to a collective of a freescale group, found before any communication: a
    ValueError, and a RuntimeError as gloo raises for the same calls (clients catch either)."""


class ArgumentTypeError(TypeError, RuntimeError):
    """As ArgumentValueError, for a TypeError."""


_CHECKS_SAY = "Detected mismatch between collectives"  # how torch's DETAIL checks start a mismatch


def _checks_failed(op: str, group: str, error: RuntimeError) -> BaseException:
    """torch's DETAIL checks' failure before `op`, as a CommError in torch's words: which ranks run
    which collective (COMM_ERROR), or which did not arrive in time (TIMEOUT; the culprit if one)."""
    late = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(error))
    ranks = [int(r) for r in re.findall(r"\d+", late.group(1))] if late else []
    return comm_error(f"{op} on freescale group {group!r}: TORCH_DISTRIBUTED_DEBUG=DETAIL's collective checks "
                      f"failed: {error}", "TIMEOUT" if late or gloo_timed_out(error) else "COMM_ERROR",
                      ranks[0] if len(ranks) == 1 else None)


@contextlib.contextmanager
def _refused_as_gloo_refuses() -> Iterator[None]:
    """Local refusals (ValueError / TypeError) re-raised as also RuntimeError, gloo's type for them."""
    try:
        yield
    except ValueError as e:
        raise ArgumentValueError(str(e)) from e
    except TypeError as e:
        raise ArgumentTypeError(str(e)) from e


def _create(backend_options: Any, pg_options: Any = None) -> ProcessGroupFreescale:
    if pg_options is not None and not isinstance(pg_options, Options):
        raise TypeError(f"pg_options of a freescale group must be freescale_comm.Options (e.g. "
                        f"fc.Options(priority=100)) or None, got {type(pg_options).__name__}")
    return ProcessGroupFreescale(backend_options.store, backend_options.group_rank, backend_options.group_size,
                                 backend_options.timeout, str(backend_options.group_id or ""), pg_options)


def register_backend(name: str = BACKEND_NAME) -> None:
    """Registers the torch.distributed backend `name` (idempotent; done on import)."""
    if name.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(name, _create, extended_api=True, devices=["cpu", "cuda"])
