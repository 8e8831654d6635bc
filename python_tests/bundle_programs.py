"""Rank functions for balancing TorchRec batches as bundles: an EmbeddingCollection-like output
(dict of JaggedTensors, or a KeyedJaggedTensor) plus per-sample tensors of other dtypes, under one
plan, through LoadBalancer.dispatch_bundle / combine_bundle and the fc.balance hooks."""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

import freescale_comm as fc
from freescale_comm.planner import CostModel

DIM = 4
COST = CostModel(quadratic=1.0, linear=0.0, constant=1.0)


def _segments(lengths: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths)


def make_inputs(rank: int, seed: int, alike_on: int = -1) -> tuple[dict[str, JaggedTensor], torch.Tensor, torch.Tensor]:
    """Rank 0 holds the long histories (heavy imbalance). "items" and "cats" share lengths, as an
    HSTU batch's features do; "extra" (bfloat16, 2 wide) has its own. Values require grad."""
    gen = torch.Generator().manual_seed(seed + rank)
    batch = 5 + rank
    lengths = torch.randint(0 if rank else 20, 6 if rank else 40, (batch,), generator=gen)
    extra_lengths = torch.randint(0, 4, (batch,), generator=gen)
    if rank == alike_on:  # here "extra" has the lengths of "items" and "cats"; elsewhere it does not
        extra_lengths = lengths.clone()
    rows, extra_rows = int(lengths.sum()), int(extra_lengths.sum())
    sequences = {
        "items": JaggedTensor(values=torch.randn(rows, DIM, generator=gen).requires_grad_(), lengths=lengths,
                              weights=torch.rand(rows, generator=gen)),
        "cats": JaggedTensor(values=torch.randn(rows, DIM, generator=gen).requires_grad_(), lengths=lengths),
        "extra": JaggedTensor(values=torch.randn(extra_rows, 2, generator=gen).to(torch.bfloat16).requires_grad_(),
                              lengths=extra_lengths),
    }
    labels = torch.rand(batch, generator=gen)
    num_targets = torch.randint(1, 4, (batch,), generator=gen)
    return sequences, labels, num_targets


class SequenceModule(nn.Module):
    """Per-sample work only (so balancing cannot change a result): a weighted sum per sample of
    "items", "cats" doubled row by row, a per-sample sum of "extra"."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(DIM, dtype=torch.float32) / DIM + 0.5)
        self.seen_samples = 0

    def forward(self, sequences: dict[str, JaggedTensor], labels: torch.Tensor, *, num_targets: torch.Tensor) -> dict:
        items = sequences["items"]
        n = items.lengths().numel()
        self.seen_samples = n
        scaled = items.values() * self.w * (1 + items.weights().unsqueeze(1))
        user = torch.zeros(n, DIM).index_add_(0, _segments(items.lengths()), scaled)
        user = user + labels.unsqueeze(1) + num_targets.unsqueeze(1).float()
        extra = sequences["extra"]
        extra_sum = torch.zeros(n, 2, dtype=torch.bfloat16).index_add_(0, _segments(extra.lengths()), extra.values())
        cats = JaggedTensor(values=sequences["cats"].values() * 2, lengths=sequences["cats"].lengths())
        return {"user": user, "cats": cats, "extra": extra_sum}


def _loss(out: dict) -> torch.Tensor:
    weights = torch.arange(out["user"].numel(), dtype=torch.float32).view_as(out["user"])  # distinct gradients
    return (out["user"] * weights).sum() + out["cats"].values().sum() * 3 + out["extra"].float().sum()


def hooks_balance_a_sequence_module(info, seed: int, alike_on: int = -1, reversed_on: int = -1) -> dict:
    """fc.balance on a module taking (sequences, labels, num_targets=...): outputs, input
    gradients equal to the unbalanced module's bit for bit; the weight's gradient summed over
    ranks to float rounding. Returns samples computed here before/after and the imbalances.
    reversed_on: that rank's dict holds the features in the other order (a dict built from a set)."""
    rank = info.rank
    module = SequenceModule()
    sequences, labels, num_targets = make_inputs(rank, seed, alike_on)
    if rank == reversed_on:
        sequences = dict(reversed(sequences.items()))
    ref = module(sequences, labels, num_targets=num_targets)
    _loss(ref).backward()
    ref_grads = {k: jt.values().grad.clone() for k, jt in sequences.items()}
    ref_w = module.w.grad.clone()
    for jt in sequences.values():
        jt.values().grad = None
    module.w.grad = None

    fc.balance(module, COST)
    out = module(sequences, labels, num_targets=num_targets)
    computed_here = module.seen_samples
    _loss(out).backward()
    assert torch.equal(out["user"], ref["user"])
    assert torch.equal(out["extra"], ref["extra"])
    assert torch.equal(out["cats"].values(), ref["cats"].values())
    assert torch.equal(out["cats"].lengths(), ref["cats"].lengths())
    for k, jt in sequences.items():
        assert torch.equal(jt.values().grad, ref_grads[k]), f"gradient of {k} differs"
    dist.all_reduce(ref_w)
    w_grad = module.w.grad.clone()
    dist.all_reduce(w_grad)
    assert torch.allclose(w_grad, ref_w, rtol=1e-5), (w_grad, ref_w)
    module.freescale_balance.remove()

    plan = fc.LoadBalancer(COST).plan(sequences["items"].lengths())
    return {"samples_home": labels.numel(), "samples_computed": computed_here,
            "imbalance_before": float(plan.imbalance_before), "imbalance_after": float(plan.imbalance_after)}


_COLLECTIVES = ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
                "all_reduce", "broadcast", "broadcast_object_list", "gather", "scatter", "reduce_scatter", "barrier")


@contextlib.contextmanager
def _group_refuses_host_tensors() -> Iterator[None]:
    """Every torch.distributed collective raises what an NCCL-only group raises for host tensors."""
    def refuse(*args, **kwargs):
        raise RuntimeError("No backend type associated with device type cpu")
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}
    for name in _COLLECTIVES:
        setattr(dist, name, refuse)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def balancing_needs_no_collective_from_the_group(info, seed: int) -> int:
    """fc.balance (a bundle) and LoadBalancer.dispatch move their plan's lengths, the features'
    shared-counts agreement and the samples on freescale's own communicator for the group: once it
    exists (built through the group's object collectives, which an NCCL group runs on the GPU),
    they need no torch.distributed collective, which an NCCL group refuses for host tensors.
    Outputs and gradients equal the unbalanced module's. Returns the samples computed here."""
    from freescale_comm.dispatch import communicator_for

    module = SequenceModule()
    sequences, labels, num_targets = make_inputs(info.rank, seed)
    ref = module(sequences, labels, num_targets=num_targets)
    _loss(ref).backward()
    ref_grads = {k: jt.values().grad.clone() for k, jt in sequences.items()}
    for jt in sequences.values():
        jt.values().grad = None
    fc.balance(module, COST)
    communicator_for(None)  # as on first use
    items = sequences["items"]
    with _group_refuses_host_tensors():
        out = module(sequences, labels, num_targets=num_targets)
        computed_here = module.seen_samples
        _loss(out).backward()
        balancer = fc.LoadBalancer(COST)
        batch = balancer.dispatch(items.values().detach(), items.lengths())
        back = balancer.combine(batch.values, batch.handle)
    assert torch.equal(out["user"], ref["user"]) and torch.equal(out["extra"], ref["extra"])
    assert torch.equal(out["cats"].values(), ref["cats"].values())
    for k, jt in sequences.items():
        assert torch.equal(jt.values().grad, ref_grads[k]), f"gradient of {k} differs"
    assert torch.equal(back, items.values().detach())
    module.freescale_balance.remove()
    return computed_here


def messages_of_a_balanced_forward(info, seed: int, alike: bool) -> int:
    """Operations freescale's communicator runs during one forward of a module balanced by
    fc.balance: the make_inputs bundle ("items" weighted, "cats" with its lengths, "extra" with
    lengths of its own unless `alike`, two per-sample tensors)."""
    from freescale_comm.communicator import Communicator

    module = fc.balance(SequenceModule(), COST)
    sequences, labels, num_targets = make_inputs(info.rank, seed, alike_on=info.rank if alike else -1)
    module(sequences, labels, num_targets=num_targets)  # the communicator exists from here on
    submitted = Communicator._submit
    count = [0]

    def counting(self, *args, **kwargs):
        count[0] += 1
        return submitted(self, *args, **kwargs)

    Communicator._submit = counting
    try:
        module(sequences, labels, num_targets=num_targets)
    finally:
        Communicator._submit = submitted
    return count[0]


def ranks_balance_different_features(info, seed: int, renamed: bool = False, retyped: bool = False) -> str:
    """Rank 0 balances "items" and "cats", the others also "extra": every rank raises, naming who
    balanced what (before, the shared-counts all-gather of different sizes broke, or hung).
    renamed: rank 0 calls its "extra" "extra2" (as many features, other names). retyped: every
    rank has the same features, and a per_sample "label" of 4 bytes a row, float32 on rank 0 and
    int32 on the others (before: moved silently, each receiver reading the other's bytes as its
    own dtype)."""
    sequences, _, _ = make_inputs(info.rank, seed)
    per_sample = None
    if retyped:
        samples = sequences["items"].lengths().numel()
        per_sample = {"label": torch.ones(samples, dtype=torch.float32 if info.rank == 0 else torch.int32)}
    elif info.rank == 0:
        extra = sequences.pop("extra")
        if renamed:
            sequences["extra2"] = extra
    try:
        fc.LoadBalancer(COST).dispatch_bundle(sequences, per_sample)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def kjt_bundle_round_trip(info, seed: int) -> int:
    """dispatch_bundle on a KeyedJaggedTensor (1-D values, weights) and per-sample tensors of
    three dtypes; the balanced KJT, returned as the output, comes home equal to the input, and so
    do the per-sample tensors. Returns the samples this rank computed on."""
    rank = info.rank
    gen = torch.Generator().manual_seed(seed + rank)
    batch = 4 + 2 * rank
    lengths = torch.randint(0, 30 if rank == 0 else 3, (2 * batch,), generator=gen)
    values = torch.randn(int(lengths.sum()), generator=gen)
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths, weights=torch.rand(values.numel()))
    per_sample = {"label": torch.rand(batch, generator=gen), "ts": torch.randint(0, 1 << 40, (batch, 3)),
                  "flag": torch.rand(batch, generator=gen) > 0.5}
    lb = fc.LoadBalancer(COST)
    bundle = lb.dispatch_bundle(kjt, per_sample)
    assert isinstance(bundle.sequences, KeyedJaggedTensor) and bundle.sequences.keys() == ["a", "b"]
    assert all(bundle.per_sample[k].dtype == t.dtype for k, t in per_sample.items())
    home = lb.combine_bundle((bundle.sequences, bundle.per_sample), bundle)
    back, samples = home
    assert isinstance(back, KeyedJaggedTensor)
    for key in ("a", "b"):
        assert torch.equal(back[key].values(), kjt[key].values())
        assert torch.equal(back[key].lengths(), kjt[key].lengths())
        assert torch.equal(back[key].weights(), kjt[key].weights())
    for k, t in per_sample.items():
        assert torch.equal(samples[k], t), k
    return bundle.num_samples


def bad_bundles_raise_before_communicating(info) -> list[str]:
    """Mismatched sample counts, a per-sample tensor of the wrong length, a non-jagged input:
    ValueError/TypeError naming it, on every rank alike; the balancer still works after."""
    lb = fc.LoadBalancer(COST)
    one = JaggedTensor(values=torch.ones(3, 2), lengths=torch.tensor([1, 2]))
    other = JaggedTensor(values=torch.ones(3, 2), lengths=torch.tensor([1, 1, 1]))
    messages = []
    for call in (lambda: lb.dispatch_bundle({"a": one, "b": other}),
                 lambda: lb.dispatch_bundle({"a": one}, {"label": torch.ones(3)}),
                 lambda: lb.dispatch_bundle([one]),
                 lambda: lb.dispatch_bundle({"a": one}, lengths=torch.ones(2))):
        try:
            call()
        except (ValueError, TypeError) as e:
            messages.append(str(e))
        else:
            raise AssertionError("accepted")
    bundle = lb.dispatch_bundle({"a": one})
    assert torch.equal(lb.combine_bundle(bundle.sequences["a"], bundle).values(), one.values())
    return messages


Pair = collections.namedtuple("Pair", "targets weights")


class NestedArgumentsModule(nn.Module):
    """Per-sample work over arguments that hold per-sample rows inside other types: a KeyedTensor
    of dense features, a dict of tensors, a tuple (as TorchRec users pass them)."""

    def forward(self, sequences: dict[str, JaggedTensor], dense, extras: dict, pair: tuple) -> torch.Tensor:
        items = sequences["items"]
        n = items.lengths().numel()
        user = torch.zeros(n, DIM).index_add_(0, _segments(items.lengths()), items.values())
        user = user + dense.values()[:, :DIM] * 2 + dense.values()[:, DIM:].sum(1, keepdim=True)
        user = user + extras["labels"].unsqueeze(1) + extras["times"].float().sum(1, keepdim=True)
        return user + pair[0].unsqueeze(1) * pair[1].unsqueeze(1)


def hooks_move_per_sample_rows_inside_other_arguments(info, seed: int) -> dict:
    """fc.balance with per-sample rows in a KeyedTensor, a defaultdict and a namedtuple: the output equals the
    unbalanced module's bit for bit, and samples did move. (Before, only top-level tensors moved:
    the others stayed home, out of step with the balanced samples, silently where the balanced
    count happened to equal the home one.)"""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    sequences, labels, num_targets = make_inputs(info.rank, seed)
    n = labels.numel()
    gen = torch.Generator().manual_seed(seed * 31 + info.rank)
    dense = KeyedTensor(keys=["a", "b"], length_per_key=[DIM, 3], values=torch.randn(n, DIM + 3, generator=gen))
    extras = collections.defaultdict(list, labels=labels, times=torch.randint(0, 100, (n, 2), generator=gen))
    pair = Pair(num_targets.float(), torch.rand(n, generator=gen))
    module = NestedArgumentsModule()
    ref = module(sequences, dense, extras, pair)
    fc.balance(module, COST)
    seen = []
    module.register_forward_pre_hook(lambda m, args: seen.append(args[0]["items"].lengths().numel()))
    out = module(sequences, dense, extras, pair)
    module.freescale_balance.remove()
    return {"equal": torch.equal(out, ref), "home": n, "computed": seen[0]}


def a_jagged_argument_beside_the_sequences_is_refused(info) -> str:
    """A second JaggedTensor argument (its own lengths) cannot move with the samples: TypeError
    on every rank (after the plan's exchange, where the ranks' arguments are compared)."""
    sequences, labels, _ = make_inputs(info.rank, 3)
    module = fc.balance(NestedArgumentsModule(), COST)
    try:
        module(sequences, sequences["extra"], {"labels": labels}, ())
    except TypeError as e:
        return str(e)
    return "no error"


class FixedTableModule(nn.Module):
    """Takes a tensor that is not per sample (the same [5, DIM] on every rank) beside the sequences."""

    def forward(self, sequences: dict[str, JaggedTensor], table: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        items = sequences["items"]
        user = torch.zeros(items.lengths().numel(), DIM).index_add_(0, _segments(items.lengths()), items.values())
        return user * table.sum(0) + labels.unsqueeze(1)


def a_fixed_tensor_whose_rows_equal_one_ranks_batch_stays(info, seed: int) -> bool:
    """Rank 0 holds 5 samples, rank 1 six; the table has 5 rows on both. Whether it moves must be
    one decision (it moved on rank 0 alone: SIZE_MISMATCH); labels move. Output equals the
    unbalanced module's."""
    sequences, labels, _ = make_inputs(info.rank, seed)
    table = torch.arange(5 * DIM, dtype=torch.float32).view(5, DIM) / 7
    module = FixedTableModule()
    ref = module(sequences, table, labels)
    fc.balance(module, COST)
    out = module(sequences, table, labels)
    module.freescale_balance.remove()
    return bool(torch.equal(out, ref))


def ranks_passing_different_arguments(info) -> str:
    """Rank 1 passes its labels inside a tuple, rank 0 bare: CommError on both, naming the ranks."""
    sequences, labels, _ = make_inputs(info.rank, 5)
    module = fc.balance(FixedTableModule(), COST)
    table = torch.ones(5, DIM)
    try:
        module(sequences, table, labels if info.rank == 0 else (labels, labels))
    except fc.CommError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - the module itself may fail later on rank 1
        return f"{type(e).__name__}: {e}"
    return "no error"


# Every sample costs the same: the plan evens out sample counts (here it moves rank 0's first two
# samples to rank 1, which holds one).
SAMPLES_ONLY = CostModel(quadratic=0.0, linear=0.0, constant=1.0)
# Per case, per rank: each feature's lengths. After balancing rank 1 computes rank 0's first two
# samples and its own, where
# - "samples": "items" has 1 + 2 + 0 rows for 3 samples: as many rows as samples, there only;
# - "features": "a" has 1 + 2 + 2 rows and "b" 2 + 3 + 0, equal there only (other lengths).
# - "everywhere" (rank 0's last sample moves): every rank computes as many "items" rows as samples
#   (2 + 0 + 1 + 1 on rank 0; 0 + 2 + 1 + 1 on rank 1).
COINCIDING = {
    "samples": [{"items": [1, 2, 5, 6, 7]}, {"items": [0]}],
    "everywhere": [{"items": [2, 0, 1, 1, 0]}, {"items": [2, 1, 1]}],
    "features": [{"a": [1, 2, 5, 6, 7], "b": [2, 3, 0, 0, 0]}, {"a": [2], "b": [0]}],
}


def coinciding_sequences(case: str, rank: int, requires_grad: bool = False) -> dict[str, JaggedTensor]:
    """COINCIDING[case]'s features on `rank`, values random ([rows, DIM], seeded by rank)."""
    gen = torch.Generator().manual_seed(7 + rank)
    return {name: JaggedTensor(values=torch.randn(sum(lengths), DIM, generator=gen).requires_grad_(requires_grad),
                               lengths=torch.tensor(lengths))
            for name, lengths in COINCIDING[case][rank].items()}


class RowsModule(nn.Module):
    """Returns per-sample sums of `feature` and its rows scaled (a per-position output, as HSTU's),
    as a tuple, or keyed by the feature's name in a dict (`keyed`; rank 1 builds the dict in the
    other order, as a dict made from a set may be); "jagged" returns the rows as a JaggedTensor;
    `short_on` returns one row fewer on that rank (a layout that fits nothing there)."""

    def __init__(self, feature: str, keyed: bool | str = False, short_on: int = -1) -> None:
        super().__init__()
        self.feature, self.keyed, self.short_on = feature, keyed, short_on
        self.seen: dict = {}

    def forward(self, sequences: dict[str, JaggedTensor]):
        jt = sequences[self.feature]
        n = jt.lengths().numel()
        self.seen = {"samples": n, **{k: int(v.lengths().sum()) for k, v in sequences.items()}}
        user = torch.zeros(n, DIM).index_add_(0, _segments(jt.lengths()), jt.values())
        rows = jt.values() * 3
        if dist.get_rank() == self.short_on:
            rows = rows[:-1]
        if self.keyed == "jagged":
            return user, JaggedTensor(values=rows, lengths=jt.lengths())
        if self.keyed:
            return {self.feature: rows, "user": user} if dist.get_rank() == 1 else {"user": user, self.feature: rows}
        return user, rows


def per_row_output_where_layout_sizes_coincide(info, case: str, feature: str, keyed: bool | str) -> dict:
    """fc.balance on RowsModule over COINCIDING[case]: outputs and the inputs' gradients equal the
    unbalanced module's bit for bit. Returns what the balanced forward saw here (samples, rows per
    feature). Before, each rank picked an output's way home from its own sizes: a rank where the
    rows equalled its samples sent them home as per-sample rows (SIZE_MISMATCH on every rank), one
    where two features' rows were equal raised ValueError alone (its peers waited)."""
    sequences = coinciding_sequences(case, info.rank, requires_grad=True)
    module = RowsModule(feature, keyed)

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        out = module(sequences)
        if keyed == "jagged":
            assert torch.equal(out[1].lengths(), sequences[feature].lengths())
            outs = [out[0], out[1].values()]
        else:
            outs = [out["user"], out[feature]] if keyed else list(out)
        loss = sum((o * torch.arange(o.numel(), dtype=o.dtype).view_as(o)).sum() for o in outs)
        grads = torch.autograd.grad(loss, [jt.values() for jt in sequences.values()], allow_unused=True)
        return [o.detach() for o in outs], [g if g is not None else torch.zeros(0) for g in grads]

    ref_out, ref_grads = run()
    fc.balance(module, SAMPLES_ONLY)
    out, grads = run()
    module.freescale_balance.remove()
    equal = all(torch.equal(a, b) for a, b in zip(out + grads, ref_out + ref_grads))
    return {"equal": equal, "seen": module.seen}


def output_fitting_no_layout_on_one_rank(info) -> str:
    """COINCIDING["features"], "b"'s rows one short on rank 1: ValueError on every rank alike (one
    rank alone raised before, the other waited in the AllToAll)."""
    sequences = coinciding_sequences("features", info.rank)
    module = fc.balance(RowsModule("b", short_on=1), SAMPLES_ONLY)
    try:
        module(sequences)
    except ValueError as e:
        return str(e)
    return "no error"


def outputs_of_different_structures(info, kinds: str) -> str:
    """COINCIDING["features"] (the ranks agree on the ways home), rank 1's module returning another
    structure: `kinds` "count" (one output more) or "kind" (a JaggedTensor where rank 0 returns a
    tensor). CommError on every rank, naming it."""
    sequences = coinciding_sequences("features", info.rank)

    class Differs(RowsModule):
        def forward(self, sequences):
            user, rows = super().forward(sequences)
            if dist.get_rank() == 1:
                return (user, rows, user) if kinds == "count" else (user, sequences["b"])
            return user, rows

    module = fc.balance(Differs("b"), SAMPLES_ONLY)
    try:
        module(sequences)
    except fc.CommError as e:
        return f"{e.code} (culprit {e.culprit}): {e}"
    return "no error"


_Out = collections.namedtuple("_Out", ["user", "rows", "extras"])


class _TypedOutputs(nn.Module):
    """Returns a namedtuple holding a tensor, a JaggedTensor and an OrderedDict, and a defaultdict."""

    def forward(self, sequences: dict[str, JaggedTensor]) -> tuple:
        items = sequences["items"]
        n = items.lengths().numel()
        user = torch.zeros(n, DIM).index_add_(0, _segments(items.lengths()), items.values())
        extras = collections.defaultdict(list, {"twice": user * 2})
        return _Out(user, JaggedTensor(values=items.values() * 3, lengths=items.lengths()),
                    collections.OrderedDict(neg=-user)), extras


def outputs_come_home_as_the_types_the_module_returned(info, seed: int) -> list[str]:
    """A namedtuple came back as a TypeError (rebuilt from one list), an OrderedDict or defaultdict
    as a plain dict; returns the types that came home, after checking every value."""
    module = _TypedOutputs()
    sequences, _, _ = make_inputs(info.rank, seed)
    ref = module(sequences)
    fc.balance(module, COST)
    (out, extras) = module(sequences)
    assert torch.equal(out.user, ref[0].user) and torch.equal(out.rows.values(), ref[0].rows.values())
    assert torch.equal(out.extras["neg"], ref[0].extras["neg"]) and torch.equal(extras["twice"], ref[1]["twice"])
    assert extras["missing"] == []  # the defaultdict's factory came along
    return [type(out).__name__, type(out.extras).__name__, type(extras).__name__]


class _PerSampleSum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.arange(DIM, dtype=torch.float32) / DIM + 0.5)

    def forward(self, sequences: dict[str, JaggedTensor], labels: torch.Tensor) -> torch.Tensor:
        items, cats = sequences["items"], sequences["cats"]
        n = items.lengths().numel()
        rows = (items.values() * self.w + cats.values() ** 2) * (1 + items.weights().unsqueeze(1))
        return torch.zeros(n, DIM).index_add_(0, _segments(items.lengths()), rows) * labels.unsqueeze(1)


def an_empty_rank_built_without_grad(info, seed: int) -> dict:
    """Rank 1 holds no samples and builds its features, weights and labels by hand (no grad);
    rank 0's values, weights and labels require grad and some of its samples are computed on
    rank 1: their gradients came home only if rank 1 ran the dispatch's backward, which it did
    not (its copies did not require grad; rank 0 waited there). Every gradient equals the
    unbalanced module's."""
    rank = info.rank
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([30, 2, 2, 3, 1] if rank == 0 else [], dtype=torch.int64)
    rows = int(lengths.sum())
    leaves = [torch.randn(rows, DIM, generator=gen), torch.randn(rows, DIM, generator=gen), torch.rand(rows, generator=gen),
              torch.rand(lengths.numel(), generator=gen)]
    if rank == 0:
        leaves = [t.requires_grad_() for t in leaves]

    def run(module: nn.Module) -> list:
        sequences = {"items": JaggedTensor(values=leaves[0], lengths=lengths, weights=leaves[2]),
                     "cats": JaggedTensor(values=leaves[1], lengths=lengths)}
        loss = module(sequences, leaves[3]).sum()
        if loss.requires_grad:
            loss.backward()
        grads = [None if t.grad is None else t.grad.clone() for t in leaves]
        for t in leaves:
            t.grad = None
        return grads

    module = _PerSampleSum()
    ref = run(module)
    fc.balance(module, COST)
    got = run(module)
    equal = all((a is None and b is None) or (a is not None and b is not None and torch.allclose(a, b)) for a, b in zip(got, ref))
    return {"equal": equal, "moved": module.freescale_balance.last_plan.moved_samples}


class _Doubled(nn.Module):
    def forward(self, sequences: dict) -> dict:
        items = sequences["items"]
        self.seen = items.lengths().dtype
        return {"items": JaggedTensor(values=items.values() * 2, lengths=items.lengths())}


def int32_lengths_stay_int32(info, keyed: bool) -> list[str]:
    """TorchRec's KeyedJaggedTensors often carry int32 lengths: the balanced module saw int64
    ones and its JaggedTensor output came home with int64 lengths. Returns the dtypes the module
    saw and the output came home with, after checking the values."""
    lengths = torch.tensor([9, 1, 1] if info.rank == 0 else [1], dtype=torch.int32)
    sequences = {"items": JaggedTensor(values=torch.randn(int(lengths.sum()), 2), lengths=lengths)}
    if keyed:
        sequences = KeyedJaggedTensor.from_jt_dict(sequences)
    module = _Doubled()
    ref = module(sequences)["items"]
    fc.balance(module, COST)
    out = module(sequences)["items"]
    assert torch.equal(out.values(), ref.values()) and torch.equal(out.lengths(), ref.lengths())
    return [str(module.seen), str(out.lengths().dtype)]


class _RowsOrFreshZeros(nn.Module):
    """Per-position rows as a JaggedTensor; an empty batch gets a fresh, gradient-free one."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(DIM))

    def forward(self, sequences: dict[str, JaggedTensor]) -> dict:
        items = sequences["items"]
        if items.lengths().numel() == 0:
            return {"items": JaggedTensor(values=torch.zeros(0, DIM), lengths=torch.zeros(0, dtype=torch.int64))}
        return {"items": JaggedTensor(values=items.values() * self.w, lengths=items.lengths())}


def an_empty_rank_returning_fresh_jagged_rows(info) -> bool:
    """Rank 1 has no samples (none move: one sample on rank 0) and its module returns a fresh
    JaggedTensor: rank 1 must still run the backward's AllToAlls (rank 0 waited there). Returns
    whether rank 0's gradient equals the unbalanced one."""
    lengths = torch.tensor([5] if info.rank == 0 else [], dtype=torch.int64)
    values = torch.randn(int(lengths.sum()), DIM, generator=torch.Generator().manual_seed(1)).requires_grad_()
    module = _RowsOrFreshZeros()
    grads = []
    for balanced in (False, True):
        if balanced:
            fc.balance(module, COST)
        out = module({"items": JaggedTensor(values=values, lengths=lengths)})["items"]
        loss = (out.values() ** 2).sum()
        if loss.requires_grad:
            loss.backward()
        grads.append(values.grad.clone() if values.grad is not None else torch.zeros_like(values))
        values.grad = None
    return torch.equal(grads[0], grads[1])


def per_sample_tensors_of_different_names(info) -> str:
    """Rank 1 calls its second per-sample tensor "time" where rank 0 says "ts": they moved paired by
    sorted place, one rank's under the other's name. Returns the error every rank raises."""
    sequences, labels, _ = make_inputs(info.rank, 11)
    per_sample = {"label": labels, "ts" if info.rank == 0 else "time": labels * 2}
    try:
        fc.LoadBalancer(COST).dispatch_bundle(sequences, per_sample)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"
