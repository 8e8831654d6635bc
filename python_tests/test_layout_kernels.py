"""The Triton layout kernels of fc.dispatch / fc.combine, run through Triton's interpreter on CPU
tensors (no GPU): the plan and the packed gather/scatter against pure-torch references, and
dispatch/combine end to end with the kernels forced on CPU tensors. Correctness only: nothing
here is timed."""

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # conftest.py sets it where there is no GPU
    pytest.skip("the layout kernels run here only through Triton's interpreter (TRITON_INTERPRET=1, set before "
                "triton is imported); with a GPU, test_dispatch_gpu.py runs them compiled", allow_module_level=True)

from freescale_comm import _device_dispatch  # noqa: E402
from freescale_comm.testing import spawn  # noqa: E402
from dispatch_programs import PATTERNS, ROW_CASES, roundtrip_through_the_layout_kernels  # noqa: E402


def reference_plan(lengths: torch.Tensor, dest: torch.Tensor, world: int):
    """(sample_counts, row_counts, sent_lengths, home_row, packed_row): a stable sort by destination."""
    order = torch.sort(dest, stable=True).indices
    home = torch.cumsum(lengths, 0) - lengths
    sent = lengths[order]
    return (torch.bincount(dest, minlength=world).tolist(),
            torch.zeros(world, dtype=torch.int64).index_add_(0, dest, lengths).tolist(),
            sent, home[order], torch.cumsum(sent, 0) - sent)


def random_batch(seed: int, samples: int, world: int, max_len: int = 7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (samples,), generator=gen, dtype=torch.int64)
    lengths[torch.rand(samples, generator=gen) < 0.25] = 0  # zero-length samples
    # Half the ranks receive nothing (when there are several).
    targets = torch.arange(0, world, 2) if world > 1 else torch.arange(1)
    dest = targets[torch.randint(0, targets.numel(), (samples,), generator=gen)]
    return lengths, dest.to(torch.int64)


def check_plan(lengths, dest, world):
    plan = _device_dispatch.plan(lengths, dest, world)
    samples, rows, sent, home, packed = reference_plan(lengths, dest, world)
    assert plan.sample_counts == samples and plan.row_counts == rows
    assert plan.rows == int(lengths.sum())
    assert torch.equal(plan.sent_lengths, sent)
    assert torch.equal(plan.home_row, home)
    assert torch.equal(plan.packed_row, packed)
    return plan


@pytest.mark.parametrize("world", [1, 2, 3, 64, 129, 512])
@pytest.mark.parametrize("samples", [0, 1, 37, 300])
def test_the_plan_matches_a_stable_sort(world, samples):
    check_plan(*random_batch(world * 1000 + samples, samples, world), world)


def test_plan_offsets_past_2_31_rows_do_not_overflow():
    lengths = torch.tensor([3 << 30, 1, 1 << 33, 0, 5, (1 << 31) + 7], dtype=torch.int64)
    dest = torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.int64)
    plan = check_plan(lengths, dest, 2)
    assert int(plan.packed_row[-1]) > 1 << 33


@pytest.mark.parametrize("lengths,dest,message", [
    ([2, -1, 3, -4], [0, 1, 0, 1], "lengths\\[1\\] = -1 is negative"),
    ([2, 1, 3], [0, 2, 5], "dest_ranks\\[1\\] = 2 is not a rank of this group; it must be in \\[0, 2\\)"),
    ([2, 1, 3], [0, 1, -1], "dest_ranks\\[2\\] = -1"),
])
def test_the_first_bad_sample_is_named(lengths, dest, message):
    with pytest.raises(ValueError, match=message):
        _device_dispatch.plan(torch.tensor(lengths), torch.tensor(dest), 2)


# Row widths from 1 byte to 4 KiB, in every word width the copy kernel picks (8, 4, 2, 1 bytes).
ROWS = [((), torch.int8), ((3,), torch.uint8), ((1,), torch.bfloat16), ((3,), torch.bfloat16), ((5,), torch.float32),
        ((2, 4), torch.bfloat16), ((), torch.int64), ((7,), torch.float64), ((4096,), torch.int8),
        ((1024,), torch.float32)]


@pytest.mark.parametrize("row_shape,dtype", ROWS)
@pytest.mark.parametrize("world", [1, 4, 33])
def test_gather_and_scatter_match_a_reference_and_invert_each_other(row_shape, dtype, world):
    lengths, dest = random_batch(hash((row_shape, str(dtype), world)) % 1000, 60, world)
    plan = check_plan(lengths, dest, world)
    rows = int(lengths.sum())
    values = (torch.randn((rows, *row_shape), generator=torch.Generator().manual_seed(world)) * 50).to(dtype)
    packed = _device_dispatch.gather(values, plan)
    order = torch.cat([torch.arange(int(h), int(h) + int(n)) for h, n in zip(plan.home_row, plan.sent_lengths)]
                      or [torch.zeros(0, dtype=torch.int64)])
    assert torch.equal(packed, values[order])
    assert torch.equal(_device_dispatch.scatter(packed, plan), values)


def test_a_misaligned_buffer_takes_narrower_words():
    lengths, dest = random_batch(5, 20, 3)
    plan = check_plan(lengths, dest, 3)
    base = torch.arange(int(lengths.sum()) * 8 + 1, dtype=torch.int32).to(torch.int16)
    values = base[1:].view(-1, 8)  # rows of 16 bytes at a 2-byte offset: int16 words, not int64
    packed = _device_dispatch.gather(values, plan)
    assert torch.equal(_device_dispatch.scatter(packed, plan), values)


KERNELS_ON_CPU = {"TRITON_INTERPRET": "1", "FREESCALE_LAYOUT_KERNELS_ON_CPU": "1"}


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_and_combine_through_the_kernels_match_the_cpu_path(world):
    # The same checks as test_dispatch.py's identity round trips (exact rows, lengths and
    # sources; combine brings every row home), with the layout kernels doing the layout work.
    assert spawn(roundtrip_through_the_layout_kernels, world, 70 + world, env=KERNELS_ON_CPU, timeout_s=300) == \
        [len(ROW_CASES) * len(PATTERNS)] * world
