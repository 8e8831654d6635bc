"""Applying gradients to rows of an FBGEMM TBE (TorchRec's fused optimizer) without a forward.

TrainPipelinePEC applies one batch's embedding gradients in two parts (those the next batch reads
first, the rest later). Each part goes through the TBE's own fused update, the op TorchRec's
backward would call, so the arithmetic is TorchRec's.

Two ways: on CPU, for the optimizers whose fused update FBGEMM exposes as an op of a known schema,
that op is called directly (`direct_fused_update`). Otherwise the TBE runs a forward over the rows
and autograd runs its backward (`autograd_fused_update`): the same update plus a lookup, its
Python and autograd's, which made half of the pipeline's update cost on CPU ranks (its output is
thrown away)."""

from __future__ import annotations

import threading
from typing import Optional

import torch

from freescale_comm._device_copy import on_device

# The CPU fused-update ops called directly, with the schema each was checked against (bit-identical
# to the forward + backward path, python_tests/test_tbe_update.py, with FBGEMM 1.8.0 in CI and 1.9.0
# beside torch 2.14.1): an FBGEMM whose op differs falls back to forward + backward instead of
# guessing at its arguments.
_POOLED_TAIL = "Tensor grad_output, Tensor(a!) host_weights, Tensor weights_placements, Tensor weights_offsets, " \
    "Tensor D_offsets, int max_D, Tensor hash_size_cumsum, int total_hash_size_bits, Tensor indices, Tensor offsets, " \
    "int pooling_mode, Tensor indice_weights, bool stochastic_rounding, "
_NOBAG_TAIL = "Tensor grad_output, Tensor(a!) host_weights, Tensor weights_placements, Tensor weights_offsets, int D, " \
    "Tensor hash_size_cumsum, int total_hash_size_bits, Tensor indices, Tensor offsets, bool stochastic_rounding, "
_MOMENTUM = "Tensor(b!) momentum1_host, Tensor momentum1_placements, Tensor momentum1_offsets, "
_KNOWN = {  # (optimizer, nobag) -> schema
    ("sgd", False): f"fbgemm::split_embedding_backward_codegen_sgd_cpu({_POOLED_TAIL}Tensor learning_rate_tensor, "
                    "int output_dtype=0) -> ()",
    ("sgd", True): f"fbgemm::split_embedding_nobag_backward_codegen_sgd_cpu({_NOBAG_TAIL}Tensor learning_rate_tensor) -> ()",
    ("rowwise_adagrad", False): f"fbgemm::split_embedding_backward_codegen_rowwise_adagrad_cpu({_POOLED_TAIL}"
                                f"{_MOMENTUM}Tensor learning_rate_tensor, float eps=0., float weight_decay=0., "
                                "int weight_decay_mode=0, float max_norm=0., int output_dtype=0) -> ()",
    ("rowwise_adagrad", True): f"fbgemm::split_embedding_nobag_backward_codegen_rowwise_adagrad_cpu({_NOBAG_TAIL}"
                               f"{_MOMENTUM}Tensor learning_rate_tensor, float eps=0., float weight_decay=0., "
                               "int weight_decay_mode=0, float max_norm=0.) -> ()",
    ("adagrad", False): f"fbgemm::split_embedding_backward_codegen_adagrad_cpu({_POOLED_TAIL}{_MOMENTUM}"
                        "Tensor learning_rate_tensor, float eps=0., int output_dtype=0) -> ()",
    ("adagrad", True): f"fbgemm::split_embedding_nobag_backward_codegen_adagrad_cpu({_NOBAG_TAIL}{_MOMENTUM}"
                       "Tensor learning_rate_tensor, float eps=0.) -> ()",
}
_OPTIMIZERS = {"exact_sgd": "sgd", "exact_row_wise_adagrad": "rowwise_adagrad", "exact_adagrad": "adagrad"}
# (major, minor) FBGEMM releases whose ops the tests checked bit for bit (1.9.0 beside torch 2.14.1);
# add a release here after running python_tests/test_tbe_update.py with it.
_CHECKED_RELEASES = {(1, 8), (1, 9)}
_PLAIN_WEIGHT_DECAY = (0, 1, 2)  # WeightDecayMode NONE, L2, DECOUPLE: what the ops above take as arguments
_ops: dict[tuple[str, bool], Optional[object]] = {}  # checked once per process
# Counted, not claimed: fused updates by path in this process ("direct", "forward_backward").
update_counts = {"direct": 0, "forward_backward": 0}
_counts_lock = threading.Lock()


def _checked_fbgemm() -> bool:
    """Whether the installed FBGEMM is a release whose direct call was checked (_CHECKED_RELEASES):
    a later one may keep an op's schema and change what its autograd wrapper does around it."""
    import fbgemm_gpu

    parts = str(getattr(fbgemm_gpu, "__version__", "")).split(".")
    try:
        return (int(parts[0]), int(parts[1])) in _CHECKED_RELEASES
    except (IndexError, ValueError):
        return False


def _has_hooks(tbe: torch.nn.Module) -> bool:
    """Any forward or backward hook on `tbe` or on every module (Module.__call__ runs them; the direct
    call does not)."""
    from torch.nn.modules import module as nn_module

    own = (tbe._forward_hooks, tbe._forward_pre_hooks, tbe._backward_hooks, tbe._backward_pre_hooks)
    every = (getattr(nn_module, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                         "_global_backward_hooks", "_global_backward_pre_hooks"))
    return any(own) or any(bool(h) for h in every)


def _signature(schema) -> tuple:
    """A schema's name, arguments (name, type, default, written or not, keyword-only) and returns:
    everything but the names of alias sets, which FBGEMM renames between releases ((b!) in 1.8,
    (g!) in 1.9's registration of the same op)."""
    def argument(a) -> tuple:
        return a.name, str(a.type), repr(a.default_value), bool(a.alias_info and a.alias_info.is_write), a.kwarg_only
    return schema.name, tuple(map(argument, schema.arguments)), tuple(map(argument, schema.returns))


def _direct_op(tbe: torch.nn.Module) -> Optional[tuple[str, bool, object]]:
    """(optimizer, nobag, op) where the direct call applies to `tbe`, else None."""
    weights = getattr(tbe, "weights_host", None)
    optimizer = _OPTIMIZERS.get(str(getattr(getattr(tbe, "optimizer", None), "value", "")))
    args = getattr(tbe, "optimizer_args", None)
    if weights is None or weights.numel() == 0 or optimizer is None or args is None or args.gradient_clipping:
        return None  # not on the host, another optimizer, or clipping (the autograd path clamps first)
    if int(getattr(tbe, "output_dtype", -1)) != 0 or weights.dtype != torch.float32:
        return None  # checked with FP32 tables and outputs only
    if int(getattr(args, "weight_decay_mode", -1)) not in _PLAIN_WEIGHT_DECAY:
        return None  # counter / CowClip modes run another op (row counters, iterations); global decay has no CPU op
    if getattr(tbe, "_used_rowwise_adagrad_with_counter", False) or \
            getattr(tbe, "_used_rowwise_adagrad_with_global_weight_decay", False):
        return None
    if getattr(tbe, "use_writeback_bwd_prehook", False) or _has_hooks(tbe):
        return None  # a hook (FBGEMM's writeback drops repeated ids' gradients) runs in Module.__call__ only
    if not isinstance(getattr(tbe, "learning_rate_tensor", None), torch.Tensor):
        return None
    nobag = bool(tbe.is_nobag)
    key = (optimizer, nobag)
    if key not in _ops:
        name = f"split_embedding{'_nobag' if nobag else ''}_backward_codegen_{optimizer}_cpu"
        try:
            packet = getattr(torch.ops.fbgemm, name, None) if _checked_fbgemm() else None
            matches = packet is not None and _signature(packet.default._schema) == \
                _signature(torch._C.parse_schema(_KNOWN[key]))
        except (AttributeError, RuntimeError):
            matches = False
        _ops[key] = packet.default if matches else None
    op = _ops[key]
    return None if op is None else (optimizer, nobag, op)


def direct_fused_update(tbe: torch.nn.Module, indices: torch.Tensor, offsets: torch.Tensor,
                        grad_out: torch.Tensor, lr: float) -> bool:
    """Runs `tbe`'s fused CPU update for (indices, offsets) with output gradient `grad_out` and
    learning rate `lr`, as its backward would; False (nothing done) where it does not apply.
    Unlike the forward, it checks no bounds: every index must be a row of its table (the pipeline's
    rows were checked against the tables when routed and looked up before any update)."""
    found = _direct_op(tbe)
    if found is None:
        return False
    optimizer, nobag, op = found
    lr_tensor = torch.full_like(tbe.learning_rate_tensor, lr)  # as set_learning_rate's fill_ rounds it
    grad = grad_out.to(torch.float32).contiguous()  # the FP32 output's gradient
    head = [grad, tbe.weights_host, tbe.weights_placements, tbe.weights_offsets]
    if nobag:
        head += [tbe.max_D, tbe.hash_size_cumsum, tbe.total_hash_size_bits, indices, offsets, tbe.stochastic_rounding]
    else:
        no_weights = torch.empty(0, dtype=grad.dtype, device=grad.device)  # unweighted: no per-id weights
        head += [tbe.D_offsets, tbe.max_D, tbe.hash_size_cumsum, tbe.total_hash_size_bits, indices, offsets,
                 int(tbe.pooling_mode), no_weights, tbe.stochastic_rounding]
    args = tbe.optimizer_args
    momentum = [] if optimizer == "sgd" else [tbe.momentum1_host, tbe.momentum1_placements, tbe.momentum1_offsets]
    tail: list = [lr_tensor]
    if optimizer == "rowwise_adagrad":
        tail += [args.eps, args.weight_decay, int(args.weight_decay_mode), args.max_norm]
    elif optimizer == "adagrad":
        tail += [args.eps]
    if not nobag:
        tail += [int(tbe.output_dtype)]
    op(*head, *momentum, *tail)
    return True


def autograd_fused_update(tbe: torch.nn.Module, indices: torch.Tensor, offsets: torch.Tensor,
                          grad_out: torch.Tensor, iteration: int, lr: float) -> None:
    """The general way: a forward at step `iteration` (the counter Adam-like optimizers read) with
    learning rate `lr`, then its backward, which is the fused update; the TBE's counters and
    learning rate are restored after."""
    saved_lr = tbe.get_learning_rate()
    saved_iter = tbe.iter.clone()  # (a copy on the device, not a host read)
    saved_iter_cpu = tbe.iter_cpu.clone() if hasattr(tbe, "iter_cpu") else None
    tbe.set_learning_rate(lr)
    tbe.iter.fill_(iteration)
    if hasattr(tbe, "iter_cpu"):
        tbe.iter_cpu.fill_(iteration)
    try:
        with torch.enable_grad():  # the fused update is the TBE's backward, even under a caller's no_grad
            out = tbe(indices, offsets)  # the forward advances the counter to iteration + 1
            out.backward(grad_out.to(out.dtype))
    finally:
        tbe.set_learning_rate(saved_lr)
        tbe.iter.copy_(saved_iter)
        if saved_iter_cpu is not None:
            tbe.iter_cpu.copy_(saved_iter_cpu)


def tbe_update(tbe: torch.nn.Module, per_feature: dict[int, tuple[torch.Tensor, torch.Tensor]], iteration: int,
               lr: float, direct: bool = True) -> None:
    """Applies gradients to rows of `tbe`'s tables through its fused update, as if its forward ran
    at step `iteration` with learning rate `lr`.
    per_feature: TBE feature index -> (int64 rows [n], float grads [n, dim]); each id is its own
    bag, so a row's gradients accumulate in the order given (the order TorchRec's input has).
    direct=False: always forward + backward (the reference the direct call is tested against)."""
    features = len(tbe.feature_table_map)
    dims = [tbe.embedding_specs[t][1] for t in tbe.feature_table_map]
    device = next(iter(per_feature.values()))[0].device
    empty = torch.empty(0, dtype=torch.int64, device=device)
    parts = [per_feature.get(f, (empty, torch.empty(0, dims[f], device=device))) for f in range(features)]
    indices = torch.cat([rows for rows, _ in parts])
    numels = [rows.numel() for rows, _ in parts]  # host ints: no read of the device
    counts = on_device(numels, device)
    if tbe.is_nobag:  # sequence TBE: one bag per feature, output [ids, dim]
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        grad_out = torch.cat([g for _, g in parts])
    else:  # pooled TBE: B bags per feature, id i of a feature alone in bag i, output [B, sum dims]
        bags = max(max(numels, default=0), 1)
        starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])
        within = torch.minimum(torch.arange(1, bags + 1, device=device).unsqueeze(0), counts.unsqueeze(1))  # [F, B]
        offsets = torch.cat([counts.new_zeros(1), (starts.unsqueeze(1) + within).reshape(-1)])
        grad_out = torch.zeros(bags, sum(dims), device=device)
        col = 0
        for (_, g), d in zip(parts, dims):
            grad_out[:g.shape[0], col:col + d] = g
            col += d
    path = "direct" if direct and direct_fused_update(tbe, indices, offsets, grad_out, lr) else "forward_backward"
    if path == "forward_backward":
        autograd_fused_update(tbe, indices, offsets, grad_out, iteration, lr)
    with _counts_lock:
        update_counts[path] += 1
