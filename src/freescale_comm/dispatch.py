"""fc.dispatch / fc.combine: move jagged samples (runs of rows) to other ranks and back, with
autograd (the backward of one is the other). The layout work (counting, putting samples in
destination order and back) runs in C++ for CPU tensors and in Triton kernels for CUDA tensors; the
bytes move on freescale's transports (host shared memory, copy engines)."""

from __future__ import annotations

import math
import threading
import zlib
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from freescale_comm import _core, _device_dispatch
from freescale_comm._capture import refuse_capture
from freescale_comm._device_copy import to_device
from freescale_comm._errors import refuse_differing_kinds
from freescale_comm._output_cache import output_cache
from freescale_comm.communicator import Communicator, check_priority, eager

_comms: "weakref.WeakKeyDictionary[Any, Communicator]" = weakref.WeakKeyDictionary()
_comms_lock = threading.Lock()
def communicator_for(group: Optional[dist.ProcessGroup]) -> Communicator:
    """The Communicator moving dispatch/combine bytes for `group` (default WORLD): a freescale
    group's own, else one built over the group on first use (collective) and kept with it."""
    group = group if group is not None else dist.group.WORLD
    own = getattr(group, "_comm", None)
    if isinstance(own, Communicator):
        return own
    with _comms_lock:
        comm = _comms.get(group)
        if comm is None or comm.closed:
            comm = Communicator(group)
            _comms[group] = comm
        return comm


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to send rows back: the plan of this rank's send and the row counts
    received from every rank. Opaque to users; valid with the communicator that made it."""

    comm: Communicator
    plan: Any  # _core.JaggedPlan (CPU tensors) or _device_dispatch.DevicePlan (CUDA tensors)
    send_rows: list[int]  # [world] rows this rank sent to each rank
    recv_rows: list[int]  # [world] rows this rank received from each rank
    recv_lengths: torch.Tensor  # int64 [received samples]
    # the dispatched values required grad on some rank: then every rank's combine result does
    # (under grad mode), so every rank joins the movement's backward, which is collective
    grad: bool = False

    @property
    def rows_sent(self) -> int:
        return sum(self.send_rows)

    @property
    def rows_received(self) -> int:
        return sum(self.recv_rows)


@dataclass(frozen=True)
class DispatchResult:
    values: torch.Tensor  # [rows received, *trailing]: samples by source rank, then original order
    lengths: torch.Tensor  # int64 [samples received]
    source_ranks: torch.Tensor  # int64 [samples received]
    handle: DispatchHandle


def _check_index_tensor(t: object, name: str, samples: Optional[int], device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int64, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {t.dtype}; convert it with .long()")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D (one entry per sample), got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but values is on {device}; put them on one device with .to()")
    if samples is not None and t.numel() != samples:
        raise ValueError(f"{name} has {t.numel()} entries but lengths has {samples}; give one per sample")
    return t.contiguous()


def _check_values(values: object, name: str = "values") -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension (rows along dim 0)")
    if values.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {values.device}: freescale dispatches CPU and CUDA tensors; use .to()")
    if values.is_sparse or values.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {values.layout}")
    return values


def check_lengths_fit(lengths: torch.Tensor, rows: int) -> None:
    """ValueError naming the first length above `rows` (host lengths): with one, a sum of lengths
    can wrap around int64 to the row count and pass for a batch."""
    if lengths.numel() and int(lengths.max()) > rows:
        first = int(torch.nonzero(lengths > rows)[0, 0])
        raise ValueError(f"lengths[{first}] = {int(lengths[first])} exceeds the {rows} rows of values; lengths must "
                         "sum to values.shape[0]")


def check_jagged_batch(values: object, lengths: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Local checks of a batch of jagged samples (rows of `values`, `lengths` rows per sample):
    TypeError/ValueError naming the argument. Returns them (lengths contiguous)."""
    values = _check_values(values)
    lengths = _check_index_tensor(lengths, "lengths", None, values.device)
    if values.device.type == "cuda" or _device_dispatch.forced_on_cpu():
        return values, lengths  # the plan kernel checks the sum with the counts it reads back
    check_lengths_fit(lengths, values.shape[0])
    total = int(lengths.sum()) if lengths.numel() else 0
    if total != values.shape[0]:
        raise ValueError(f"lengths sum to {total}, but values has {values.shape[0]} rows; they must be equal")
    return values, lengths


def row_kind(values: torch.Tensor) -> int:
    """A hash of values' dtype and row shape (shape[1:]), which every rank's must equal: the bytes
    alone can (float32 rows of 2 and float64 rows of 1) and the receiver reads them as its own kind."""
    return zlib.crc32(f"{values.dtype}|{tuple(values.shape[1:])}".encode()) & 0x7FFF_FFFF


def check_row_kinds(kinds: list[int], values: torch.Tensor, what: str) -> None:
    """CommError on every rank (each compares every rank's kind) where ranks' values differ in
    dtype or row shape."""
    refuse_differing_kinds(kinds, f"{what}: ranks passed values of different dtypes or row shapes",
                           f"this rank's are {values.dtype} rows of shape {tuple(values.shape[1:])}. Every rank's "
                           "values must have the same dtype and shape after dim 0 (empty ones too)")


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _move_rows(values: torch.Tensor, handle: DispatchHandle, priority: int, forward: bool) -> torch.Tensor:
    """forward: rows in original order on this rank → rows received (dispatch's movement), sent
    straight from their rows in `values`. Else the reverse (combine's movement): rows received →
    their home rows, landing there straight. No staging copy either way for CPU tensors; CUDA
    tensors go through _move_rows_cuda (gathered by the layout kernels)."""
    if values.device.type == "cuda":
        refuse_capture(values.device, "fc.dispatch" if forward else "fc.combine")
    values = values.contiguous()
    if isinstance(handle.plan, _device_dispatch.DevicePlan):
        return _move_rows_cuda(values, handle, priority, forward)
    rows = handle.rows_received if forward else handle.rows_sent
    out = output_cache().empty((rows, *values.shape[1:]), values.dtype)
    make_layout = _core.dispatch_layout if forward else _core.combine_layout
    handle.comm._submit(out, values, make_layout(handle.plan, _row_bytes(values), handle.recv_rows), priority,
                        async_op=False, op_name="dispatch" if forward else "combine")
    return out


def _move_rows_cuda(values: torch.Tensor, handle: DispatchHandle, priority: int, forward: bool) -> torch.Tensor:
    """_move_rows for CUDA tensors: the layout kernels put rows in send order (forward) or back
    home (reverse) on the current stream; the copy engines move them packed between."""
    row_bytes = _row_bytes(values)
    sent = [r * row_bytes for r in handle.send_rows]
    received = [r * row_bytes for r in handle.recv_rows]
    if forward:
        packed = _device_dispatch.gather(values, handle.plan)
        out = torch.empty((handle.rows_received, *values.shape[1:]), dtype=values.dtype, device=values.device)
        handle.comm._submit(out, packed, _core.AllToAllLayout.packed(sent, received), priority, async_op=False,
                            op_name="dispatch")
        return out
    packed = torch.empty((handle.rows_sent, *values.shape[1:]), dtype=values.dtype, device=values.device)
    handle.comm._submit(packed, values, _core.AllToAllLayout.packed(received, sent), priority, async_op=False,
                        op_name="combine")
    return _device_dispatch.scatter(packed, handle.plan)


# Each movement's backward is the other movement, applied as a Function: with create_graph=True
# (a gradient penalty) the gradient is itself differentiable, through the movement back.
class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, handle: DispatchHandle, priority: int) -> torch.Tensor:
        ctx.handle, ctx.priority = handle, priority
        return _move_rows(values, handle, priority, forward=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        # (create_graph: every rank records the movement, its grad requiring grad or not)
        return _Combine.apply(tracked(grad, True), ctx.handle, ctx.priority), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, handle: DispatchHandle, priority: int) -> torch.Tensor:
        ctx.handle, ctx.priority = handle, priority
        return _move_rows(values, handle, priority, forward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        return _Dispatch.apply(tracked(grad, True), ctx.handle, ctx.priority), None, None


# What a rank receives, when every rank knows it beforehand (a LoadBalancer's plan): int64 host
# tensors [samples received], their lengths and their source ranks, by source rank, then original order.
Received = tuple[torch.Tensor, torch.Tensor]


@eager
def dispatch(values: torch.Tensor, lengths: torch.Tensor, dest_ranks: torch.Tensor, *,
             group: Optional[dist.ProcessGroup] = None, priority: int = 0) -> DispatchResult:
    """Sends sample i (rows lengths[:i].sum() ... + lengths[i] of `values`) to rank dest_ranks[i]
    of `group` (default WORLD). Collective. Returns the samples this rank received, ordered by
    source rank, then by their original order there; their lengths and source ranks; and the
    handle combine needs to send rows back. Autograd flows back through combine's movement."""
    return dispatch_received(values, lengths, dest_ranks, None, group=group, priority=priority)


def dispatch_received(values: torch.Tensor, lengths: torch.Tensor, dest_ranks: torch.Tensor,
                      received: Optional[Received], *, group: Optional[dist.ProcessGroup] = None,
                      priority: int = 0, move: bool = True, grad: Optional[bool] = None) -> DispatchResult:
    """fc.dispatch; with `received` (every rank's own, as a plan all ranks computed says), no
    counts or lengths cross: one AllToAll, the rows'. move=False (rows of zero bytes only): none
    at all, a handle for dispatch_like and combine. grad: whether values requires grad on some
    rank, where the caller's exchange told (with `received`); without `received` the counts tell."""
    values, lengths = check_jagged_batch(values, lengths)
    dest_ranks = _check_index_tensor(dest_ranks, "dest_ranks", lengths.numel(), values.device)
    priority = check_priority(priority)
    grad = values.requires_grad if grad is None else grad  # (the counts' exchange, where it runs, tells better)
    if not dist.is_initialized():
        raise RuntimeError("fc.dispatch needs torch.distributed: call dist.init_process_group(...) first")
    if not move and _row_bytes(values) != 0:
        raise ValueError("move=False needs values of zero bytes per row")
    world = dist.get_world_size(group)
    if values.device.type == "cuda" or _device_dispatch.forced_on_cpu():
        return _dispatch_cuda(values, lengths, dest_ranks, world, group, priority, received, move, grad)
    # Local checks (ValueError naming a bad length or rank) before anything collective.
    plan = _core.plan_jagged_dispatch(lengths.data_ptr(), dest_ranks.data_ptr(), lengths.numel(), world)
    comm = communicator_for(group)

    # 1. Sample counts, 2. lengths of the samples, in send order (unless known); then the rows (in autograd).
    if received is None:
        send_counts = torch.from_numpy(plan.sample_counts)
        # [world, (samples, values require grad here, row kind)]: every rank learns whether any
        # rank's values require grad, and whether all are of one kind
        both = torch.empty(world, 3, dtype=torch.int64)
        comm.all_to_all_single(both, torch.stack([send_counts, torch.full_like(send_counts, values.requires_grad),
                                                  torch.full_like(send_counts, row_kind(values))], 1),
                               priority=priority)
        check_row_kinds(both[:, 2].tolist(), values, "fc.dispatch")
        recv_counts, grad = both[:, 0].contiguous(), bool(both[:, 1].any())
        recv_lengths = torch.empty(int(recv_counts.sum()), dtype=torch.int64)
        comm.all_to_all_single(recv_lengths, torch.from_numpy(plan.sent_lengths), recv_counts.tolist(),
                               send_counts.tolist(), priority=priority)
        source_ranks = torch.repeat_interleave(torch.arange(world, dtype=torch.int64), recv_counts)
    else:
        recv_lengths, source_ranks = received
    handle = DispatchHandle(comm, plan, plan.row_counts.tolist(), _rows_from(recv_lengths, source_ranks, world),
                            recv_lengths, bool(grad))
    return _deliver(values, handle, source_ranks, priority, move, grad)


def _rows_from(lengths: torch.Tensor, sources: torch.Tensor, world: int) -> list[int]:
    """[world] rows received from each rank, from the received samples' lengths and sources (host)."""
    return torch.zeros(world, dtype=torch.int64).index_add_(0, sources, lengths).tolist()


def grad_for_combine(handle: DispatchHandle, grad: bool) -> None:
    """Marks `handle` (and so every combine on it) as one whose rows require grad on some rank."""
    object.__setattr__(handle, "grad", handle.grad or grad)  # (a frozen dataclass: set once, at dispatch)


def tracked(values: torch.Tensor, grad: Optional[bool]) -> torch.Tensor:
    """`values`, as a leaf that requires grad where `grad` says some rank's copy does and this one's
    does not (a rank with an empty batch built by hand), so that every rank's result requires grad
    and every rank runs the movement's backward, which is collective (else its peers wait there,
    or the samples it computed for them get no gradient)."""
    if grad and not values.requires_grad and torch.is_grad_enabled() and (values.is_floating_point() or values.is_complex()):
        return values.detach().requires_grad_()
    return values


def _deliver(values: torch.Tensor, handle: DispatchHandle, source_ranks: torch.Tensor, priority: int,
             move: bool, grad: Optional[bool] = None) -> DispatchResult:
    """The dispatch's result: its rows moved on `handle` (in autograd), or, not `move` (rows of
    zero bytes), an empty output of the received rows' count without any message."""
    out = _Dispatch.apply(tracked(values, grad), handle, priority) if move else \
        values.new_empty((handle.rows_received, *values.shape[1:]))
    return DispatchResult(out, handle.recv_lengths, source_ranks, handle)


def _dispatch_cuda(values: torch.Tensor, lengths: torch.Tensor, dest_ranks: torch.Tensor, world: int,
                   group: Optional[dist.ProcessGroup], priority: int, received: Optional[Received] = None,
                   move: bool = True, grad: Optional[bool] = None) -> DispatchResult:
    """dispatch of CUDA tensors: the plan kernels, one host sync for its counts, the counts over
    the host transport, the lengths and rows over the copy engines. (CPU tensors too, through
    Triton's interpreter, when a test forces the kernels: _device_dispatch.forced_on_cpu.)"""
    if values.device.type == "cuda":
        refuse_capture(values.device, "fc.dispatch")  # before the plan's host sync would invalidate the capture
    plan = _device_dispatch.plan(lengths, dest_ranks.contiguous(), world, dist.get_rank(group), values.shape[0])
    comm = communicator_for(group)  # after the plan's local checks, as for CPU tensors
    if received is None:
        kind = row_kind(values)
        send_counts = torch.tensor([(n, r, int(values.requires_grad), kind)
                                    for n, r in zip(plan.sample_counts, plan.row_counts)],
                                   dtype=torch.int64).view(world, 4)  # host
        recv_counts = torch.empty(world, 4, dtype=torch.int64)
        comm.all_to_all_single(recv_counts, send_counts, priority=priority)  # [world, (samples, rows, grad, kind)]
        recv_samples, recv_rows, grads, kinds = (list(column) for column in zip(*recv_counts.tolist()))
        check_row_kinds(kinds, values, "fc.dispatch")
        grad = any(grads)
        # Each sample's length comes with its sender's rank: one device op makes both contiguous.
        both = torch.empty(sum(recv_samples), 2, dtype=torch.int64, device=values.device)
        comm.all_to_all_single(both, plan.sent, recv_samples, plan.sample_counts, priority=priority)
        recv_lengths, source_ranks = both.T.contiguous()
    else:
        recv_rows = _rows_from(*received, world)
        recv_lengths, source_ranks = (to_device(t, values.device) for t in received)  # no stream sync
    handle = DispatchHandle(comm, plan, plan.row_counts, recv_rows, recv_lengths, bool(grad))
    return _deliver(values, handle, source_ranks, priority, move, grad)


def _check_for_handle(values: object, handle: object, priority: object) -> tuple[torch.Tensor, int]:
    """Local checks of rows moved on an earlier dispatch's handle (combine, dispatch_like): the
    handle, the values, the priority, the device, the communicator still open."""
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be the .handle of an fc.dispatch result, got {type(handle).__name__}")
    values = _check_values(values)
    priority = check_priority(priority)
    plan_device = handle.recv_lengths.device
    if values.device != plan_device:
        raise ValueError(f"values is on {values.device}, but the dispatch behind this handle moved tensors of "
                         f"{plan_device}; move them there (.to({str(plan_device)!r}))")
    if handle.comm.closed:
        raise ValueError("handle belongs to a communicator that was closed (its group was destroyed); dispatch again")
    return values, priority


@eager
def combine(values: torch.Tensor, handle: DispatchHandle, *, priority: int = 0) -> torch.Tensor:
    """Returns rows of the samples a dispatch delivered here to their home ranks, in their
    original order: `values` holds one row-block per received sample (the dispatch's lengths;
    any trailing shape). Collective over the dispatch's group. Autograd flows back through
    dispatch's movement."""
    values, priority = _check_for_handle(values, handle, priority)
    if values.shape[0] != handle.rows_received:
        raise ValueError(
            f"values has {values.shape[0]} rows, but the dispatch behind this handle delivered {handle.rows_received} "
            f"rows ({handle.recv_lengths.numel()} samples) to this rank; pass one row-block per received sample "
            "(is the handle from another dispatch call?)"
        )
    # Where the dispatch's values required grad on some rank, every rank's result does (under grad
    # mode): its backward is collective, and a rank whose rows carry no grad (an empty batch's fresh
    # zeros) must still join it
    return _Combine.apply(tracked(values, handle.grad), handle, priority)


@eager
def dispatch_like(values: torch.Tensor, handle: DispatchHandle, *, priority: int = 0,
                  grad: Optional[bool] = None) -> torch.Tensor:
    """Sends more rows the way an earlier dispatch sent its samples: `values` holds, in this
    rank's original order, one row-block per sample with that dispatch's lengths (any dtype and
    trailing shape). Collective over its group; one AllToAll (the counts are known). Returns the
    rows received, as that dispatch's result orders them; autograd flows back through combine's
    movement. grad=True: some rank's `values` require grad (the caller knows), so this rank's
    result does too; else values.requires_grad, which must then agree on every rank."""
    values, priority = _check_for_handle(values, handle, priority)
    if values.shape[0] != handle.rows_sent:
        raise ValueError(f"values has {values.shape[0]} rows, but the dispatch behind this handle sent {handle.rows_sent} "
                         "from this rank; pass rows laid out as that dispatch's values")
    return _Dispatch.apply(tracked(values, grad), handle, priority)
