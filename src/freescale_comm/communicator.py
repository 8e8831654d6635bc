"""Communicator: the direct face. Turns tensors into plain views (pointer, bytes) and hands them
to the compiled core, which moves them on its own transports (never through the group)."""

from __future__ import annotations

import atexit
import collections.abc
import datetime
import functools
import logging
import math
import operator
import os
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any, Callable, Optional, TypeVar, Union

import torch
import torch.distributed as dist

from freescale_comm import _completions, _core
from freescale_comm._bootstrap import GroupBootstrap
from freescale_comm._capture import refuse_capture
from freescale_comm.work import Work

logger = logging.getLogger("freescale_comm")

SplitSizes = Optional[Union[Sequence[int], torch.Tensor]]


_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
_live_lock = threading.Lock()


def _abandon_in_forked_child() -> None:
    """After fork(), in the child: every communicator belongs to the parent (its progress threads
    and shared memory are the parent's). The child never closes them (closing would tell the
    parent's peers this rank left) and refuses to use them."""
    for comm in list(_live):  # no lock: the child has one thread, and a parent's thread may have held it
        comm._abandon_after_fork()


os.register_at_fork(after_in_child=_abandon_in_forked_child)


@atexit.register
def _close_all() -> None:
    # Progress threads must stop before the interpreter does (they may run Python callbacks).
    with _live_lock:
        communicators = list(_live)
    for comm in communicators:
        comm._close(drain=True)  # ops posted before exit finish, as gloo's do


def _group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """The group's own timeout (torch's default when the backend does not expose one)."""
    from freescale_comm.backend import ProcessGroupFreescale  # (imports this module)

    if isinstance(group, ProcessGroupFreescale):  # torch keeps no per-device backend for it
        return group._timeout
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001 - backends differ in what they expose
            continue
    return dist.default_pg_timeout


def _check_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (splits run along dim 0); reshape it with .view(1)")
    return t


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if the bytes of contiguous tensors `a` and `b` intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


F = TypeVar("F", bound=Callable[..., Any])


# torch's lazy form of torch.compiler.disable (Dynamo does not trace into it, its file being
# torch's): it imports Dynamo at the first call instead of at `import freescale_comm` (1.2 s of CPU).
_lazy_disable = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


def eager(fn: F) -> F:
    """Marks a collective entry point that torch.compile runs eagerly (a graph break): Dynamo cannot
    trace the process group and communicator objects it reaches (it raised on every rank).

    Dynamo is never imported here: only torch.compile (or whoever imported Dynamo) can be tracing,
    so where it is not loaded `fn` runs as is. Importing it at a call would run its imports with
    the user's groups alive, and torch.distributed.nn.functional binds group.WORLD as a default
    argument at import: the group would outlive dist.destroy_process_group, and a forked child
    would hang at exit in its destructor (gloo's threads are not there after a fork)."""
    disabled = _lazy_disable(fn)

    @functools.wraps(fn)
    def entry(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" in sys.modules:
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return entry  # type: ignore[return-value]


def check_priority(priority: object, name: str = "priority") -> int:
    """`priority` (the argument `name`) as an int32 (larger = sooner); TypeError / ValueError otherwise."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"{name} must be an int (larger = sooner), got {priority!r}")
    if not -(2**31) <= priority < 2**31:
        raise ValueError(f"{name} must fit in 32 bits, got {priority}")
    return priority


def _split_sizes(splits: SplitSizes, dim0: int, world: int, name: str, tensor_name: str) -> list[int]:
    """Validated per-rank row counts; None or [] splits dim 0 equally (as dist does)."""
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    elif isinstance(splits, collections.abc.Mapping):  # its keys are no splits (gloo refuses it too)
        raise TypeError(f"{name} must be a sequence of ints (one per rank, in rank order), got a "
                        f"{type(splits).__name__}; pass a list")
    elif splits is not None and not isinstance(splits, (list, tuple)):
        try:
            splits = list(splits)  # any iterable of ints (a generator, a range), as dist takes
        except TypeError:
            raise TypeError(f"{name} must be a sequence of ints, got {type(splits).__name__}") from None
    if splits is None or len(splits) == 0:
        if dim0 % world != 0:
            raise ValueError(
                f"{name}=None splits {tensor_name} equally, but its dim 0 ({dim0}) is not divisible by the "
                f"world size ({world}); pass {name} explicitly"
            )
        return [dim0 // world] * world
    try:
        sizes = [operator.index(s) for s in splits]
    except TypeError:
        raise TypeError(f"{name} must be a sequence of ints, got {splits!r}") from None
    if len(sizes) != world:
        raise ValueError(f"{name} has {len(sizes)} entries; it needs one per rank (world size {world})")
    negative = [s for s in sizes if s < 0]
    if negative:
        raise ValueError(f"{name} has negative entries {negative}; every split must be >= 0")
    if sum(sizes) != dim0:
        raise ValueError(
            f"{name} sums to {sum(sizes)}, but {tensor_name} has {dim0} rows along dim 0; make them equal"
        )
    return sizes


def _check_self_block(rank: int, in_splits: list[int], row_bytes_in: int, input: torch.Tensor,
                      out_splits: list[int], row_bytes_out: int, output: torch.Tensor) -> None:
    """What `rank` sends itself must equal, in bytes, what it expects from itself: known
    locally, so refused before any communication (as gloo's alltoallv does), leaving the
    communicator usable. Rows of other shapes with the same bytes (TorchRec's [0, D]) pass."""
    sent, expected = in_splits[rank] * row_bytes_in, out_splits[rank] * row_bytes_out
    if sent != expected:
        raise ValueError(
            f"rank {rank} sends itself {sent} bytes (input_split_sizes[{rank}] = {in_splits[rank]} rows of "
            f"{row_bytes_in} bytes, input shape {tuple(input.shape)}) but expects {expected} bytes from itself "
            f"(output_split_sizes[{rank}] = {out_splits[rank]} rows of {row_bytes_out} bytes, output shape "
            f"{tuple(output.shape)}); each block must match in bytes what its receiver expects: fix the splits or "
            "the row shapes"
        )


class Communicator:
    """Moves tensors between the ranks of `group` (default: WORLD) on freescale's own transports.

    Construction is collective over `group` (it bootstraps through the group's object
    collectives); afterwards data never moves through the group. Ops are matched across ranks by
    program order; `priority` (larger = sooner) only reorders their execution.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "freescale_comm.Communicator needs torch.distributed: call dist.init_process_group(...) first"
            )
        group = group if group is not None else dist.group.WORLD
        if dist.get_rank(group) < 0:
            raise ValueError("this process is not a member of `group`; build the Communicator on its members only")
        self._start(GroupBootstrap(group), _group_timeout(group), group)

    @classmethod
    def _over(cls, bootstrap: _core.Bootstrap, timeout: datetime.timedelta, group: Optional[dist.ProcessGroup] = None) -> "Communicator":
        """A communicator bootstrapped through `bootstrap` (e.g. a store), for the backend itself."""
        comm = cls.__new__(cls)
        comm._start(bootstrap, timeout, group)
        return comm

    def _start(self, bootstrap: _core.Bootstrap, timeout: datetime.timedelta, group: Optional[dist.ProcessGroup]) -> None:
        # Weak: the communicator must not keep a group alive past dist.destroy_process_group.
        self._group = weakref.ref(group) if group is not None else None
        config = _core.Config.from_env()  # ValueError naming a malformed FREESCALE_* variable
        if config.timeout_ms == 0:
            config.timeout_ms = max(1, int(timeout.total_seconds() * 1000))
        self._bootstrap, self._timeout_ms = bootstrap, config.timeout_ms
        self._cuda_cores: dict[int, Any] = {}  # device index -> core moving that GPU's tensors
        self._registered: list[torch.Tensor] = []  # register_buffer's tensors, kept alive
        if config.transport in ("ce", "nvshmem"):
            config.transport = "host"  # the knob picks the GPU transport; CPU tensors take host
        self._owner_pid = os.getpid()
        self._forked_from: Optional[int] = None  # set in a forked child: the parent's pid
        self._core = _core.Communicator(bootstrap, config)
        self._inflight: list[Work] = []  # async ops whose tensors must outlive the caller's refs
        with _live_lock:
            _live.add(self)

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.size

    @property
    def transport(self) -> str:
        """The transport moving this communicator's bytes ("host", ...)."""
        return self._core.transport

    @property
    def data_paths(self) -> dict[str, str]:
        """How each transport built so far moves bytes on this machine, and whether that takes
        SM kernels from the compute it overlaps (and why): {"cpu": ..., "cuda:<index>": ...}.
        A device's entry appears after the first op on that device's tensors."""
        paths = {"cpu": self._core.data_path}
        paths.update({f"cuda:{index}": core.data_path for index, core in sorted(self._cuda_cores.items())})
        return paths

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Lets peers write this rank's CUDA receive buffers that lie in `tensor`'s memory directly:
        each received block is then one copy on a copy engine from the sender's input, with no
        staging in the sender's arena and so no copy within a GPU, which drivers before CUDA 13.1
        run as SM kernels (`data_paths` says which copies take SMs). Register the output buffers
        you reuse (e.g. preallocated embedding outputs); the tensor must outlive this communicator.
        Registering is local, but the first use of a GPU builds its core collectively: call it on
        every rank at the same point, before the ops that receive into it. At most 16 per GPU."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register_buffer: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cuda":
            raise ValueError(f"register_buffer: tensor is on {tensor.device}; only CUDA tensors are registered "
                             "(CPU tensors move through shared memory with no copy to avoid)")
        if not tensor.is_contiguous() or tensor.numel() == 0:
            raise ValueError("register_buffer: tensor must be contiguous and non-empty")
        self._check_not_forked()
        self._core_for(tensor.device).register_buffer(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        self._registered.append(tensor)  # its memory must not be freed and reused while peers write it

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The group it was built on; None once that group is destroyed (or if built on a store)."""
        return self._group() if self._group is not None else None

    @eager
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: SplitSizes = None,
        input_split_sizes: SplitSizes = None,
        *,
        priority: int = 0,
        async_op: bool = False,
    ) -> Work:
        """Same semantics as ``dist.all_to_all_single``: rows of `input` (dim 0), cut by
        `input_split_sizes` (None = equal), go to ranks in order; rows from rank p land in
        `output` at the offset given by `output_split_sizes`. Any dtype; as with gloo, input and
        output rows may differ in shape (e.g. a `[0, D]` input and a flat output, as TorchRec
        sends): what each pair of ranks exchanges must agree in bytes, else CommError
        (SIZE_MISMATCH) on every rank; a rank's block to itself is checked locally (ValueError). `input` may be non-contiguous, `output` must be contiguous
        (gloo would write a non-contiguous one as if it were contiguous). Returns a Work, already
        completed unless `async_op`. Bad arguments raise ValueError/TypeError before any
        communication; failures between ranks raise CommError on every rank."""
        return self._all_to_all(output, input, output_split_sizes, input_split_sizes, priority, async_op,
                                "all_to_all_single")

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: SplitSizes,
                    input_split_sizes: SplitSizes, priority: int, async_op: bool, op_name: str) -> Work:
        """all_to_all_single, named `op_name` in profiler traces (the backend's barrier and list
        form are AllToAlls too)."""
        _check_tensor(output, "output")
        _check_tensor(input, "input")
        if output.dtype != input.dtype:
            raise TypeError(
                f"output dtype {output.dtype} differs from input dtype {input.dtype}; "
                "all_to_all_single moves elements, so pass tensors of one dtype"
            )
        if output.device != input.device:
            raise ValueError(f"output is on {output.device} but input is on {input.device}; put both on one device")
        if input.device.type not in ("cpu", "cuda"):
            raise ValueError(f"input and output are on {input.device}: freescale moves CPU and CUDA tensors only")
        check_priority(priority)
        if not output.is_contiguous():
            raise ValueError("output must be contiguous: receive into a contiguous tensor and copy it where needed")
        # Bytes per dim-0 row of each side (a side with 0 rows may have any shape). As gloo, only
        # the bytes each pair exchanges must agree; the transport checks that between ranks.
        row_bytes_in = math.prod(input.shape[1:]) * input.element_size()
        row_bytes_out = math.prod(output.shape[1:]) * output.element_size()
        world = self.world_size
        in_splits = _split_sizes(input_split_sizes, input.shape[0], world, "input_split_sizes", "input")
        out_splits = _split_sizes(output_split_sizes, output.shape[0], world, "output_split_sizes", "output")
        _check_self_block(self.rank, in_splits, row_bytes_in, input, out_splits, row_bytes_out, output)
        if output.is_conj() or output.is_neg():
            raise ValueError("output is a lazy conjugate (or negated) view, whose memory holds other values than it "
                             "shows: receive into a plain tensor and conjugate that (gloo refuses such views too)")
        source = input.resolve_conj().resolve_neg()  # a lazy view's memory holds the unconjugated values
        if not source.is_contiguous():
            source = source.contiguous()
        elif _overlap(source, output):
            source = source.clone()  # in place (as gloo allows): what is sent must not change while received into
        layout = _core.AllToAllLayout.packed([s * row_bytes_in for s in in_splits], [s * row_bytes_out for s in out_splits])
        return self._submit(output, source, layout, priority, async_op, op_name)

    def _core_for(self, device: torch.device) -> Any:
        """The core moving tensors of `device`: the host one, or (built at the first op on that
        GPU, collectively: every rank's first op on CUDA tensors is the same op) a CUDA one."""
        if device.type == "cpu":
            return self._core
        index = device.index if device.index is not None else torch.cuda.current_device()
        core = self._cuda_cores.get(index)
        if core is None:
            transports = _core.build_info()["transports"]
            if "ce" not in transports:
                raise ValueError(f"tensors are on {device}, but this build moves CPU tensors only (built without nvcc: "
                                 f"transports {transports}); use .cpu() or an NCCL group")
            config = _core.Config.from_env()
            config.timeout_ms, config.cuda_device = self._timeout_ms, index
            core = self._cuda_cores[index] = _core.Communicator(self._bootstrap, config)
            # What serves this GPU (the nvshmem transport names NVSHMEM's version and library file,
            # and whether it joined a runtime another user started), as NCCL_DEBUG=INFO says its own.
            logger.info("freescale cuda:%d: %s", index, core.data_path)
        return core

    def _submit(self, output: torch.Tensor, input: torch.Tensor, layout: Any, priority: int, async_op: bool,
                op_name: str) -> Work:
        """Queues an AllToAllv of the contiguous tensors' bytes as `layout` (a checked
        _core.AllToAllLayout) says. CPU: waits for it unless async_op. CUDA: the transfer starts
        after the current stream's work so far; unless async_op, the current stream then waits
        for it (the CPU only until its copies are enqueued: Work.wait). Under torch.profiler, the op is a range from submission to
        completion named by `op_name`, its priority and bytes."""
        self._check_not_forked()
        if not torch.autograd.profiler._is_profiler_enabled:
            return self._submit_now(output, input, layout, priority, async_op, op_name)
        name = f"freescale:{op_name} priority={priority} send={sum(layout.send_bytes)}B recv={sum(layout.recv_bytes)}B"
        with torch.autograd.profiler.record_function(name) as op_range:
            work = self._submit_now(output, input, layout, priority, True, op_name)
            op_range._call_end_callbacks_on_future(work.get_future())  # the range ends when the op does
        if not async_op:
            work.wait()
        return work

    def _submit_now(self, output: torch.Tensor, input: torch.Tensor, layout: Any, priority: int, async_op: bool,
                    op_name: str) -> Work:
        cuda = input.device.type == "cuda"
        if cuda:
            refuse_capture(input.device, "all_to_all")  # before anything is queued (peers are not affected)
        core = self._core_for(input.device)
        stream = torch.cuda.current_stream(input.device).cuda_stream if cuda else 0
        handle = core.all_to_all(input.data_ptr(), output.data_ptr(), layout, priority, not async_op and not cuda, stream,
                                 op_name)  # the kind peers check theirs against
        work = Work(core, handle, [output], keepalive=(input, output), device=input.device if cuda else None)
        if async_op or cuda:  # tensors stay referenced until the op completed on the host
            self._forget_completed()
            self._inflight.append(work)
        if not async_op:
            work.wait()
        return work

    def _forget_completed(self) -> None:
        """Drops completed ops from _inflight (their tensors settled: Work._settle_buffers)."""
        keep = []
        for work in self._inflight:
            if work.is_completed():
                work._settle_buffers()
            else:
                keep.append(work)
        self._inflight = keep

    def _abandon_after_fork(self) -> None:
        self._forked_from = self._owner_pid
        for core in (self._core, *self._cuda_cores.values()):
            core.abandon_after_fork()
        self._inflight = []

    def _check_not_forked(self) -> None:
        if self._forked_from is not None:
            raise _core.InvalidUsageError(
                f"this Communicator belongs to process {self._forked_from}, which forked this one (pid {os.getpid()}); "
                "a forked child cannot use its parent's communicators: create new ones in the child (with its own group)"
            )

    def close(self) -> None:
        """Stops the progress threads; pending ops fail with CommError. Idempotent. CUDA ops the
        caller already waited for (Work.wait) are completed first, within the timeout: their
        bytes are on this GPU, but peers may still need this rank's receipt, and closing would
        fail them (a synchronized stream does not mean the op completed on the host)."""
        self._close(drain=False)

    def _close(self, drain: bool) -> None:
        """close(); `drain`: every pending op is let finish first, all within one timeout, as gloo's
        teardown lets its queued work finish (a peer late to an op this rank posted gets its
        bytes, not a CommError): destroy_process_group and interpreter exit."""
        if self._forked_from is not None:
            return  # the parent's: left alone
        deadline = time.monotonic() + self._timeout_ms / 1000
        for work in list(self._inflight):
            work._complete_before_close(max(deadline - time.monotonic(), 0.0), pending_too=drain)
        for core in self._cuda_cores.values():
            core.close()
        self._core.close()
        for work in self._inflight:  # failed by the close: abandoned device copies keep their tensors
            work._settle_buffers()
        self._inflight.clear()
        _completions.release_idle()

    @property
    def closed(self) -> bool:
        return self._core.closed

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

