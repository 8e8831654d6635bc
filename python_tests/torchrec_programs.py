"""Rank functions running TorchRec's own AllToAll modules over a "freescale" group: each result is
checked against the same module over a gloo group of the same ranks and, where the answer is
known locally, against that answer."""

from __future__ import annotations

import torch
import torch.distributed as dist

import freescale_comm as fc
from torchrec.distributed.dist_data import JaggedTensorAllToAll, KJTAllToAll, SequenceEmbeddingsAllToAll
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

NUM_IDS = 50  # ids per table: [0, NUM_IDS)


def _groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    fs = dist.new_group(backend="freescale")
    gl = dist.new_group(backend="gloo")
    assert dist.get_backend(fs) == "freescale"
    return fs, gl


def _random_kjt(keys: list[str], batch: int, gen: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)  # empty samples included
    values = torch.randint(0, NUM_IDS, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def _table(feature: int, dim: int) -> torch.Tensor:
    """The embedding table of feature `feature`: row i is distinct for every (feature, id)."""
    return (torch.arange(NUM_IDS * dim, dtype=torch.float32).view(NUM_IDS, dim) + 1000.0 * feature)


def _lookup(kjt: KeyedJaggedTensor, dim: int) -> torch.Tensor:
    """Embeddings of every value of `kjt`, in its (key-major) value order: [num_values, dim]."""
    rows = [_table(int(k[1:]), dim)[kjt[k].values()] for k in kjt.keys()]
    return torch.cat(rows) if rows else torch.empty(0, dim)


def _same_kjt(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> None:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    assert torch.equal(a.lengths(), b.lengths())
    assert torch.equal(a.values(), b.values())
    assert torch.equal(a.weights(), b.weights())


def kjt_then_sequence_embeddings(info, seed: int, features_per_rank: int, batch: int, dim: int) -> int:
    """Sequence (table-wise) sharding's two AllToAlls: KJTAllToAll sends each rank the features it
    owns, a lookup runs there, SequenceEmbeddingsAllToAll returns the embeddings (and, backward,
    their gradients). Returns how many embedding rows came home."""
    rank, world = info.rank, info.world_size
    fs, gl = _groups()
    keys = [f"f{i}" for i in range(features_per_rank * world)]
    kjt = _random_kjt(keys, batch, torch.Generator().manual_seed(seed + rank))
    splits = [features_per_rank] * world

    def run(pg):
        tensors_awaitable = KJTAllToAll(pg, splits)(kjt).wait()
        features = tensors_awaitable.wait()
        local_embs = _lookup(features, dim).requires_grad_()
        out = SequenceEmbeddingsAllToAll(pg, splits)(
            local_embs=local_embs,
            lengths=features.lengths().view(-1, features.stride()),
            input_splits=tensors_awaitable._input_splits["values"],
            output_splits=tensors_awaitable._output_splits["values"],
        ).wait()
        # A weight per home row makes each gradient row distinct.
        (out * torch.arange(out.shape[0], dtype=out.dtype).unsqueeze(1)).sum().backward()
        return features, out.detach(), local_embs.grad

    features_fs, out_fs, grad_fs = run(fs)
    features_gl, out_gl, grad_gl = run(gl)
    _same_kjt(features_fs, features_gl)
    assert features_fs.keys() == keys[rank * features_per_rank:(rank + 1) * features_per_rank]
    assert features_fs.stride() == batch * world
    assert torch.equal(out_fs, out_gl)
    assert torch.equal(grad_fs, grad_gl)
    # The embeddings that come home are those of this rank's own ids, in its KJT's value order.
    assert torch.equal(out_fs, _lookup(kjt, dim)), "sequence embeddings came back out of order"
    return out_fs.shape[0]


def jagged_tensor_all_to_all(info, seed: int) -> int:
    """JaggedTensorAllToAll (TorchRec's KeyedJaggedTensorPool path): a random number of jagged
    items to each rank, the receive counts first exchanged by all_to_all_single. Returns the
    number of items received."""
    rank, world = info.rank, info.world_size
    fs, gl = _groups()
    gen = torch.Generator().manual_seed(seed + rank)
    send = torch.randint(0, 4, (world,), generator=gen)  # items to each rank, zeros included
    lengths = torch.randint(0, 5, (int(send.sum()),), generator=gen)
    values = torch.randint(-1000, 1000, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen)
    jt = JaggedTensor(values=values, lengths=lengths, weights=weights)

    def run(pg):
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=pg)
        return receive, JaggedTensorAllToAll(jt, send, receive, pg).wait()

    receive_fs, out_fs = run(fs)
    receive_gl, out_gl = run(gl)
    assert torch.equal(receive_fs, receive_gl)
    assert torch.equal(out_fs.lengths(), out_gl.lengths())
    assert torch.equal(out_fs.values(), out_gl.values())
    assert torch.equal(out_fs.weights(), out_gl.weights())
    assert out_fs.lengths().numel() == int(receive_fs.sum())
    return out_fs.lengths().numel()


def _native_ranges(prof) -> list[str]:
    return [e.name for e in prof.events() if e.name.startswith("freescale:")]


def group_default_priority_reaches_torchrec_backward(info) -> dict[str, list[str]]:
    """TorchRec's SequenceEmbeddingsAllToAll over a group made with fc.Options(priority=7):
    forward inside fc.priority(50), backward (run by autograd) outside it; outputs and gradients
    as over gloo. Returns the profiler ranges of each phase."""
    rank, world = info.rank, info.world_size
    pg = dist.new_group(backend="freescale", pg_options=fc.Options(priority=7))
    gl = dist.new_group(backend="gloo")
    assert pg.default_priority == 7
    rows = 2 * world  # one local table, one sample per rank, two rows each, 3 wide
    splits = [2] * world

    def forward(group):
        local = (torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) + 100 * rank).requires_grad_()
        out = SequenceEmbeddingsAllToAll(group, [1] * world)(
            local_embs=local, lengths=torch.full((1, world), 2), input_splits=splits, output_splits=splits).wait()
        return local, out

    profile = lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])  # noqa: E731
    with profile() as forward_ranges, fc.priority(50):
        local, out = forward(pg)
    weights = torch.arange(out.numel(), dtype=out.dtype).view_as(out)  # distinct gradient rows
    with profile() as backward_ranges:
        (out * weights).sum().backward()
    local_gl, out_gl = forward(gl)
    (out_gl * weights).sum().backward()
    assert torch.equal(out, out_gl) and torch.equal(local.grad, local_gl.grad)
    try:
        dist.new_group(backend="freescale", pg_options=dist.ProcessGroupGloo._Options())
    except TypeError as e:
        assert "fc.Options" in str(e), e
    else:
        raise AssertionError("a gloo Options object was accepted as a freescale group's pg_options")
    return {"forward": _native_ranges(forward_ranges), "backward": _native_ranges(backward_ranges)}
