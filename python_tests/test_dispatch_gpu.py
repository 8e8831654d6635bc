"""dispatch / combine of CUDA tensors (skipped without CUDA): the layout kernels against the CPU
planner and a pure-torch gather, then the multi-rank programs of test_dispatch.py on GPU 0."""

import pytest
import torch

import freescale_comm as fc
from freescale_comm import _core, _device_dispatch
from freescale_comm.testing import spawn
from balancer_programs import balanced_equals_unbalanced, balancer_over_an_nccl_group
from dispatch_programs import PATTERNS, ROW_CASES, bad_inputs_raise_before_communicating, gradients_match_single_process, roundtrip_is_identity

pytestmark = pytest.mark.gpu


def _batch(samples: int, world: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 40, (samples,), generator=gen, dtype=torch.int64)
    lengths[torch.rand(samples, generator=gen) < 0.1] = 0  # empty samples too
    dest = torch.randint(0, world, (samples,), generator=gen, dtype=torch.int64)
    return lengths, dest


@pytest.mark.parametrize("world", [1, 3, 64, 1031])
@pytest.mark.parametrize("samples", [0, 1, 1000, 5000])
def test_plan_kernel_matches_the_cpu_planner(world, samples):
    lengths, dest = _batch(samples, world, seed=world * 7 + samples)
    cpu = _core.plan_jagged_dispatch(lengths.data_ptr(), dest.data_ptr(), samples, world)
    plan = _device_dispatch.plan(lengths.cuda(), dest.cuda(), world, 0, int(lengths.sum()))
    order = torch.from_numpy(cpu.order)
    starts = torch.cumsum(lengths, 0) - lengths
    sent = torch.from_numpy(cpu.sent_lengths)
    assert plan.sample_counts == cpu.sample_counts.tolist()
    assert plan.row_counts == cpu.row_counts.tolist()
    assert torch.equal(plan.sent_lengths.cpu(), sent)
    assert torch.equal(plan.home_row.cpu(), starts[order])
    assert torch.equal(plan.packed_row.cpu(), torch.cumsum(sent, 0) - sent)


@pytest.mark.parametrize("row_shape,dtype", ROW_CASES + (((256,), torch.bfloat16),))
def test_gather_and_scatter_kernels_match_torch(row_shape, dtype):
    world, samples = 17, 3000
    lengths, dest = _batch(samples, world, seed=5)
    values = (torch.randn((int(lengths.sum()), *row_shape)) * 50).to(dtype).cuda()
    plan = _device_dispatch.plan(lengths.cuda(), dest.cuda(), world, 0, int(lengths.sum()))
    order = torch.sort(dest, stable=True).indices
    starts = torch.cumsum(lengths, 0) - lengths
    rows = torch.cat([torch.arange(int(starts[i]), int(starts[i] + lengths[i])) for i in order.tolist()])
    packed = _device_dispatch.gather(values, plan)
    assert torch.equal(packed, values[rows.cuda()])
    assert torch.equal(_device_dispatch.scatter(packed, plan), values)


def test_bad_samples_raise_naming_them():
    with pytest.raises(ValueError, match=r"dest_ranks\[2\] = 4"):
        _device_dispatch.plan(torch.tensor([1, 2, 3, 4], device="cuda"), torch.tensor([0, 1, 4, -1], device="cuda"), 4,
                              0, 10)
    with pytest.raises(ValueError, match=r"lengths\[1\] = -2"):
        _device_dispatch.plan(torch.tensor([1, -2, 3], device="cuda"), torch.tensor([0, 1, 2], device="cuda"), 4, 0, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_dispatch_then_combine_is_the_identity_on_gpu(world):
    assert spawn(roundtrip_is_identity, world, 60 + world, "cuda", timeout_s=300) == [len(ROW_CASES) * len(PATTERNS)] * world


def test_gradients_on_gpu_equal_a_single_process_reference():
    diffs = spawn(gradients_match_single_process, 3, 5, "cuda", timeout_s=300)
    assert max(diffs) < 1e-12, diffs


def test_bad_input_on_gpu_raises_before_communication():
    messages = spawn(bad_inputs_raise_before_communicating, 2, "cuda", timeout_s=300)
    assert len(messages[0]) == 13 and "dest_ranks[1] = 2" in messages[0][1]


def test_load_balancer_on_gpu_equals_the_unbalanced_step():
    stats = spawn(balanced_equals_unbalanced, 3, 21, 6, "cuda", backend="freescale", timeout_s=300)
    assert stats[0]["moved"] > 0 and all(s == stats[0] for s in stats)


def test_load_balancer_over_an_nccl_group():
    """The plan's lengths went through the group's all_gather on host tensors, which NCCL's
    refuses ("No backend type associated with device type cpu"); one rank, one GPU (NCCL allows
    one rank per GPU)."""
    assert spawn(balancer_over_an_nccl_group, 1, backend="nccl", timeout_s=300) == [True]


def test_the_layout_kernels_are_triton_and_the_core_has_no_kernels():
    from freescale_comm import _device_dispatch

    assert _device_dispatch.kernels().__name__ == "freescale_comm._layout_kernels"
    assert not hasattr(_core, "plan_jagged_dispatch_cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_the_kernels_run_on_the_tensors_gpu_while_another_is_current():
    """Issue 39 item 1: Triton launches on the current device; tensors of cuda:1 while cuda:0 is
    current must still be planned and copied on cuda:1 (its stream)."""
    world = 17
    lengths, dest = _batch(3000, world, seed=11)
    values = torch.randn(int(lengths.sum()), 64).to("cuda:1")
    with torch.cuda.device(0):
        plan = _device_dispatch.plan(lengths.to("cuda:1"), dest.to("cuda:1"), world, 0, values.shape[0])
        packed = _device_dispatch.gather(values, plan)
        back = _device_dispatch.scatter(packed, plan)
    order = torch.sort(dest, stable=True).indices
    starts = torch.cumsum(lengths, 0) - lengths
    rows = torch.cat([torch.arange(int(starts[i]), int(starts[i] + lengths[i])) for i in order.tolist()])
    assert torch.equal(packed.cpu(), values.cpu()[rows])
    assert torch.equal(back, values)
