"""TrainPipelinePEC's fused update without a forward (pipelines/_tbe_update.py): on CPU, FBGEMM's
fused-update op called directly must leave weights and optimizer state bit-identical to the TBE's
forward + backward, the way TorchRec's backward applies them; where it does not apply, the
forward + backward runs."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("torchrec")
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode  # noqa: E402
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: E402
    ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

from freescale_comm.pipelines import _tbe_update  # noqa: E402
from freescale_comm.pipelines._tbe_update import _direct_op, tbe_update  # noqa: E402

ROWS = 50


def _tbe(optimizer: EmbOptimType, pooling: PoolingMode, shared: bool = False, **kwargs) -> SplitTableBatchedEmbeddingBagsCodegen:
    """Three features on three tables, or (shared) two features on one table and one on another:
    FBGEMM's pooled CPU row-wise Adagrad takes another kernel for a shared table, the only one that
    applies weight decay."""
    dims = [8, 8, 8] if pooling == PoolingMode.NONE else [8, 16, 4]  # sequence tables share one dim
    if shared:
        dims = dims[1:]
        kwargs["feature_table_map"] = [0, 0, 1]
    torch.manual_seed(0)
    if optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        kwargs.setdefault("weight_decay", 0.01)
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for d in dims], optimizer=optimizer,
        pooling_mode=pooling, learning_rate=0.05, **kwargs)


def _state(tbe) -> list[torch.Tensor]:
    state = [tbe.weights_host.clone(), tbe.learning_rate_tensor.clone(), tbe.iter.clone()]
    if hasattr(tbe, "momentum1_host"):
        state.append(tbe.momentum1_host.clone())
    return state


def _train(tbe, direct: bool) -> None:
    """Four updates with repeated rows, a feature without rows in every other, a changing rate."""
    dims = [tbe.embedding_specs[t][1] for t in tbe.feature_table_map]
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        sizes = [(0, 30), (2, 7)] + ([(1, 0)] if step % 2 else [(1, 3)])
        work = {f: (torch.randint(0, ROWS, (n,), generator=g), torch.randn(n, dims[f], generator=g)) for f, n in sizes}
        tbe_update(tbe, work, iteration=step + 10, lr=0.03 + 0.01 * step, direct=direct)


@pytest.mark.parametrize("optimizer,pooling,shared", list(itertools.product(
    [EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_ADAGRAD],
    [PoolingMode.NONE, PoolingMode.SUM, PoolingMode.MEAN], [False, True])))
def test_direct_update_equals_forward_backward(optimizer, pooling, shared):
    direct, reference = _tbe(optimizer, pooling, shared), _tbe(optimizer, pooling, shared)
    before = _state(direct)
    assert _direct_op(direct) is not None, "FBGEMM's CPU op changed its schema: the direct call is off"
    _train(direct, direct=True)
    _train(reference, direct=False)
    after, expected = _state(direct), _state(reference)
    assert not torch.equal(after[0], before[0])  # it trained
    for a, e in zip(after, expected):
        assert torch.equal(a, e)
    assert torch.equal(after[1], before[1]) and torch.equal(after[2], before[2])  # rate and counter kept


def test_clipping_takes_the_forward_backward():
    """Gradient clipping clamps in autograd's backward, before the op: not the direct call."""
    tbe = _tbe(EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, gradient_clipping=True, max_gradient=0.01)
    assert _direct_op(tbe) is None
    reference = _tbe(EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, gradient_clipping=True, max_gradient=0.01)
    _train(tbe, direct=True)
    _train(reference, direct=False)
    assert torch.equal(tbe.weights_host, reference.weights_host)


def test_an_unknown_schema_takes_the_forward_backward(monkeypatch):
    """An FBGEMM whose op has another schema is never called with guessed arguments."""
    monkeypatch.setitem(_tbe_update._KNOWN, ("rowwise_adagrad", False), "fbgemm::something_else() -> ()")
    monkeypatch.setattr(_tbe_update, "_ops", {})
    tbe = _tbe(EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM)
    assert _direct_op(tbe) is None
    calls = []
    real = _tbe_update.autograd_fused_update
    monkeypatch.setattr(_tbe_update, "autograd_fused_update", lambda *a: calls.append(1) or real(*a))
    _train(tbe, direct=True)
    assert len(calls) == 4


@pytest.mark.parametrize("mode", [1, 2])
def test_row_wise_adagrad_weight_decay_passes_through(mode):
    """Weight decay as L2 or decoupled reaches the op (a pooled shared table and a sequence TBE: the
    kernels that apply it on CPU)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode
    for pooling in (PoolingMode.NONE, PoolingMode.SUM):
        direct, reference, plain = (_tbe(EmbOptimType.EXACT_ROWWISE_ADAGRAD, pooling, True, weight_decay=decay,
                                         weight_decay_mode=WeightDecayMode(mode)) for decay in (0.01, 0.01, 0.0))
        assert _direct_op(direct) is not None
        for tbe, is_direct in ((direct, True), (reference, False), (plain, True)):
            _train(tbe, direct=is_direct)
        assert torch.equal(direct.weights_host, reference.weights_host)
        assert torch.equal(direct.momentum1_host, reference.momentum1_host)
        assert not torch.equal(direct.weights_host, plain.weights_host)  # the decay did something


def test_counter_modes_and_backward_hooks_take_the_forward_backward():
    """Row-wise Adagrad with a counter or CowClip runs another op (row counters, iterations); a
    backward hook (FBGEMM's writeback drops repeated ids' gradients) runs only through the module:
    the direct call must not apply to them."""
    from fbgemm_gpu.tbe.config.optimizer_config import (CounterBasedRegularizationDefinition, CounterWeightDecayMode,
                                                        UserEnabledConfigDefinition, WeightDecayMode)
    counter, reference = (_tbe(EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.SUM, weight_decay_mode=WeightDecayMode.COUNTER,
                               counter_based_regularization=CounterBasedRegularizationDefinition(
                                   counter_weight_decay_mode=CounterWeightDecayMode.DECOUPLE, counter_halflife=2))
                          for _ in range(2))
    assert _direct_op(counter) is None
    _train(counter, direct=True)
    _train(reference, direct=False)
    assert torch.equal(counter.weights_host, reference.weights_host)
    writeback = _tbe(EmbOptimType.EXACT_SGD, PoolingMode.SUM,
                     extra_optimizer_config=UserEnabledConfigDefinition(use_writeback_bwd_prehook=True))
    assert _direct_op(writeback) is None
    hooked = _tbe(EmbOptimType.EXACT_SGD, PoolingMode.SUM)
    hooked.register_full_backward_pre_hook(lambda module, grad: None)
    assert _direct_op(hooked) is None
    forward_hooked = _tbe(EmbOptimType.EXACT_SGD, PoolingMode.SUM)
    forward_hooked.register_forward_hook(lambda module, args, out: None)
    assert _direct_op(forward_hooked) is None
    plain = _tbe(EmbOptimType.EXACT_SGD, PoolingMode.SUM)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        assert _direct_op(plain) is None  # a hook on every module runs on the TBE's forward too
    finally:
        handle.remove()
    assert _direct_op(plain) is not None


def test_an_fbgemm_release_not_checked_takes_the_forward_backward(monkeypatch):
    """A later FBGEMM may keep an op's schema and change its wrapper: only checked releases."""
    import fbgemm_gpu
    monkeypatch.setattr(fbgemm_gpu, "__version__", "1.10.0")
    monkeypatch.setattr(_tbe_update, "_ops", {})
    assert _direct_op(_tbe(EmbOptimType.EXACT_SGD, PoolingMode.SUM)) is None


def test_the_schema_check_ignores_alias_set_names_only():
    """FBGEMM 1.9 registers the same ops with other alias-set names ((g!) for 1.8's (b!)) and other
    spelling of defaults: the same signature. Another argument, type or default is not."""
    from freescale_comm.pipelines._tbe_update import _KNOWN, _signature
    ours = _KNOWN[("adagrad", True)]
    same = ours.replace("(b!)", "(g!)").replace("eps=0.", "eps = 0")
    assert same != ours
    assert _signature(torch._C.parse_schema(same)) == _signature(torch._C.parse_schema(ours))
    for other in (ours.replace("eps=0.", "eps=1."), ours.replace("float eps=0.", "float eps=0., int iter=0"),
                  ours.replace("Tensor(b!) momentum1_host", "Tensor momentum1_host")):
        assert _signature(torch._C.parse_schema(other)) != _signature(torch._C.parse_schema(ours)), other
