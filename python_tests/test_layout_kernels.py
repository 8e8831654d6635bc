"""The Triton layout kernels of fc.dispatch / fc.combine, run through Triton's interpreter on CPU
tensors (no GPU): the plan and the packed gather/scatter against pure-torch references, and
dispatch/combine end to end with the kernels forced on CPU tensors. Correctness only: nothing
here is timed."""

import contextlib
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # conftest.py sets it where there is no GPU
    pytest.skip("the layout kernels run here only through Triton's interpreter (TRITON_INTERPRET=1, set before "
                "triton is imported); with a GPU, test_dispatch_gpu.py runs them compiled", allow_module_level=True)

from freescale_comm import _device_dispatch  # noqa: E402
from freescale_comm.testing import spawn  # noqa: E402
from dispatch_programs import (PATTERNS, ROW_CASES, layout_work_per_call, roundtrip_through_the_layout_kernels,  # noqa: E402
                               row_kinds_that_differ_fail_every_rank)
from kernel_launches import intercept  # noqa: E402
from program_order import ORDERS, permute_programs  # noqa: E402


@pytest.fixture(autouse=True, params=ORDERS)
def program_order(request):
    """Every kernel test runs its launches' programs in each order of program_order.ORDERS."""
    undo = permute_programs(request.param)
    yield request.param
    undo()


def reference_plan(lengths: torch.Tensor, dest: torch.Tensor, world: int, map_rows: bool = True):
    """(sample_counts, row_counts, sent_lengths, home_row, packed_row, row_home): a stable sort by
    destination; row_home: each packed row's home row (None unless map_rows)."""
    order = torch.sort(dest, stable=True).indices
    home = torch.cumsum(lengths, 0) - lengths
    sent = lengths[order]
    row_home = torch.cat([torch.arange(int(h), int(h) + int(n)) for h, n in zip(home[order], sent)]
                         or [torch.zeros(0, dtype=torch.int64)]) if map_rows else None
    return (torch.bincount(dest, minlength=world).tolist(),
            torch.zeros(world, dtype=torch.int64).index_add_(0, dest, lengths).tolist(),
            sent, home[order], torch.cumsum(sent, 0) - sent, row_home)


def random_batch(seed: int, samples: int, world: int, max_len: int = 7):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (samples,), generator=gen, dtype=torch.int64)
    lengths[torch.rand(samples, generator=gen) < 0.25] = 0  # zero-length samples
    # Half the ranks receive nothing (when there are several).
    targets = torch.arange(0, world, 2) if world > 1 else torch.arange(1)
    dest = targets[torch.randint(0, targets.numel(), (samples,), generator=gen)]
    return lengths, dest.to(torch.int64)


def check_plan(lengths, dest, world, rank=0):
    plan = _device_dispatch.plan(lengths, dest, world, rank, int(lengths.sum()))
    samples, rows, sent, home, packed, row_home = reference_plan(lengths, dest, world)
    assert plan.sample_counts == samples and plan.row_counts == rows
    assert plan.rows == int(lengths.sum())
    assert torch.equal(plan.sent_lengths, sent)
    assert torch.equal(plan.sent[:, 1], torch.full_like(sent, rank))
    assert torch.equal(plan.home_row, home)
    assert torch.equal(plan.packed_row, packed)
    assert torch.equal(plan.row_home, row_home)
    return plan


@pytest.mark.parametrize("world", [1, 2, 3, 64, 129, 512])
@pytest.mark.parametrize("samples", [0, 1, 37, 300, 1000])
def test_the_plan_matches_a_stable_sort(world, samples):
    check_plan(*random_batch(world * 1000 + samples, samples, world), world, rank=world - 1)


def test_a_plan_past_2_16_samples_and_many_scan_chunks_matches_a_stable_sort(program_order):
    """70,000 samples: 1,094 blocks, 9 chunks of the first scan level, two steps of the second."""
    if program_order != "random":
        pytest.skip("one order is enough for the large case (the interpreter runs it slowly)")
    check_plan(*random_batch(3, 70_000, 5, max_len=3), 5, rank=2)


def test_plan_offsets_past_2_31_rows_do_not_overflow():
    """Samples of 2**30 to 2**33 rows: every slot, home row and packed row as a stable sort says
    (without the map: 2**34 rows of it would not fit here)."""
    lengths = torch.tensor([3 << 30, 1, 1 << 33, 0, 5, (1 << 31) + 7], dtype=torch.int64)
    dest = torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.int64)
    rows = int(lengths.sum())
    counts, sent, home_row, packed_row, row_home = _device_dispatch.run_plan_kernels(lengths, dest, 2, 1, rows,
                                                                                     with_map=False)
    samples, row_counts, sent_ref, home_ref, packed_ref, _ = reference_plan(lengths, dest, 2, map_rows=False)
    assert counts == samples + row_counts + [lengths.numel()]
    assert torch.equal(sent[:, 0], sent_ref) and torch.equal(sent[:, 1], torch.ones_like(sent_ref))
    assert torch.equal(home_row, home_ref) and torch.equal(packed_row, packed_ref)
    assert int(packed_row[-1]) > 1 << 33 and int(home_row.max()) > 1 << 33 and row_home.numel() == 0


def test_lengths_that_could_wrap_the_row_sum_are_refused_naming_the_sample():
    """A review found lengths whose int64 sum wraps to the values' rows accepted: the map then
    pointed outside the values. Every length must lie in [0, rows]; samples * rows < 2**63."""
    big = [(1 << 62) + 7, (1 << 62) + 4, (1 << 63) - 1]  # sums to 10 modulo 2**64
    with pytest.raises(ValueError, match=r"lengths\[0\] = 4611686018427387911 exceeds the 10 rows of values"):
        _device_dispatch.plan(torch.tensor(big), torch.tensor([1, 0, 0]), 2, 0, 10)
    with pytest.raises(ValueError, match="could sum past 2\\*\\*63 rows"):
        _device_dispatch.plan(torch.tensor([1, 2]), torch.tensor([0, 1]), 2, 0, 1 << 62)


def test_lengths_that_do_not_sum_to_the_values_rows_are_refused():
    with pytest.raises(ValueError, match="lengths sum to 6, but values has 5 rows"):
        _device_dispatch.plan(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 0]), 2, 0, 5)


@pytest.mark.parametrize("lengths,dest,message", [
    ([2, -1, 3, -4], [0, 1, 0, 1], "lengths\\[1\\] = -1 is negative"),
    ([2, 1, 3], [0, 2, 5], "dest_ranks\\[1\\] = 2 is not a rank of this group; it must be in \\[0, 2\\)"),
    ([2, 1, 3], [0, 1, -1], "dest_ranks\\[2\\] = -1"),
])
def test_the_first_bad_sample_is_named(lengths, dest, message):
    with pytest.raises(ValueError, match=message):
        _device_dispatch.plan(torch.tensor(lengths), torch.tensor(dest), 2, 0, sum(max(n, 0) for n in lengths))


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
    assert torch.equal(packed, values[reference_plan(lengths, dest, world)[-1]])
    assert torch.equal(_device_dispatch.scatter(packed, plan), values)


def test_a_misaligned_buffer_takes_narrower_words():
    lengths, dest = random_batch(5, 20, 3)
    plan = check_plan(lengths, dest, 3)
    base = torch.arange(int(lengths.sum()) * 8 + 1, dtype=torch.int32).to(torch.int16)
    values = base[1:].view(-1, 8)  # rows of 16 bytes at a 2-byte offset: int16 words, not int64
    packed = _device_dispatch.gather(values, plan)
    assert torch.equal(_device_dispatch.scatter(packed, plan), values)


# Both are read when used (triton's at a kernel's decoration, when the rank first imports
# _layout_kernels; the forkserver does not): ranks fork with them (fresh_interpreter=False).
KERNELS_ON_CPU = {"TRITON_INTERPRET": "1", "FREESCALE_LAYOUT_KERNELS_ON_CPU": "1"}


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_and_combine_through_the_kernels_match_the_cpu_path(world, program_order):
    # The same checks as test_dispatch.py's identity round trips (exact rows, lengths and
    # sources; combine brings every row home), with the layout kernels doing the layout work,
    # their programs in a random order on every rank (one order: these spawn ranks).
    if program_order != "random":
        pytest.skip("the ranks run their programs in a random order: one run is enough")
    assert spawn(roundtrip_through_the_layout_kernels, world, 70 + world, "random", env=KERNELS_ON_CPU, fresh_interpreter=False,
                 timeout_s=300) == [len(ROW_CASES) * len(PATTERNS)] * world


def test_values_of_other_row_kinds_fail_every_rank_on_the_kernels_path_too(program_order):
    if program_order != "identity":
        pytest.skip("no kernel order matters to a refusal: one run is enough")
    for outcomes in spawn(row_kinds_that_differ_fail_every_rank, 2, env=KERNELS_ON_CPU, fresh_interpreter=False, timeout_s=300):
        for outcome in outcomes[:2]:
            assert outcome.startswith("SIZE_MISMATCH") and "ranks [0]: one kind; ranks [1]" in outcome, outcome
        assert outcomes[2] == "True"


def test_a_balanced_bundle_through_the_kernels_equals_the_unbalanced_module(program_order):
    """fc.balance on a TorchRec-like bundle with the layout kernels doing the layout work (the
    CUDA path): the per-sample handle and the features that follow the cost lengths take what
    each rank receives from the plan (no counts or lengths exchanged), the others exchange them;
    outputs and gradients equal the unbalanced module's bit for bit."""
    if program_order != "identity":
        pytest.skip("the program order is covered by the round trips above")
    pytest.importorskip("torchrec")
    from bundle_programs import hooks_balance_a_sequence_module

    results = spawn(hooks_balance_a_sequence_module, 2, 11, env=KERNELS_ON_CPU, fresh_interpreter=False, timeout_s=300)
    assert any(r["samples_computed"] != r["samples_home"] for r in results), results  # samples did move


def test_a_dispatch_is_five_launches_one_device_op_and_one_host_read(program_order):
    """Counted, not timed: fc.dispatch of device tensors launches the four plan kernels and one
    copy, makes its received (length, source) pairs contiguous (one op) and reads its counts back
    once; combine and dispatch_like launch one copy each (the plan's row map) and read nothing.
    Before: 4 launches and ~20 other device ops per dispatch (8 zero-fills, 3 cumsums, cat, arange,
    an H2D copy, repeat_interleave...)."""
    if program_order != "identity":
        pytest.skip("counts do not depend on the program order")
    plan_kernels = {"count_kernel": 1, "scan_chunks_kernel": 1, "scan_totals_kernel": 1, "place_kernel": 1}
    for report in spawn(layout_work_per_call, 2, env=KERNELS_ON_CPU, fresh_interpreter=False, timeout_s=300):
        assert report["dispatch"] == {"launches": {**plan_kernels, "copy_kernel": 1}, "ops": {"aten.clone.default": 1},
                                      "reads": 1}, report["dispatch"]
        for call in ("combine", "dispatch_like"):
            assert report[call] == {"launches": {"copy_kernel": 1}, "ops": {}, "reads": 0}, (call, report[call])


def test_launch_device_makes_the_tensors_gpu_current(monkeypatch, program_order):
    """Triton launches on the current device's current stream: for tensors of cuda:1 while cuda:0
    is current, the launch must happen with cuda:1 current (its stream is the transport's)."""
    if program_order != "identity":
        pytest.skip("no kernel runs here")
    from test_capture import FakeGpus

    gpus = FakeGpus(monkeypatch, capturing=set())
    with _device_dispatch.launch_device(torch.device("cuda", 1)):
        assert gpus.current == 1
    assert gpus.current == 0
    with _device_dispatch.launch_device(torch.device("cpu")):
        assert gpus.current == 0


def test_every_launch_of_a_plan_and_its_copies_runs_under_the_tensors_device(monkeypatch, program_order):
    """plan(), gather() and scatter() launched on whatever device was current (a wrong GPU and
    stream for tensors of another GPU): every launch must run inside launch_device(their device)."""
    if program_order != "identity":
        pytest.skip("the order of programs does not change where they launch")
    inside = {"device": None}

    @contextlib.contextmanager
    def recording(device):
        saved, inside["device"] = inside["device"], device
        try:
            yield
        finally:
            inside["device"] = saved

    launched: list = []

    def launch(name, kernel, args, kwargs, run):
        launched.append((name, inside["device"]))
        return run()

    monkeypatch.setattr(_device_dispatch, "launch_device", recording)
    intercept(_device_dispatch.kernels(), launch, monkeypatch.setattr)
    lengths, dest = random_batch(9, 40, 3)
    plan = check_plan(lengths, dest, 3)
    values = torch.randn(int(lengths.sum()), 4)
    assert torch.equal(_device_dispatch.scatter(_device_dispatch.gather(values, plan), plan), values)
    assert [name for name, _ in launched] == ["count_kernel", "scan_chunks_kernel", "scan_totals_kernel",
                                              "place_kernel", "copy_kernel", "copy_kernel"]
    assert all(device == values.device for _, device in launched), launched


def test_the_programs_run_in_the_fixture_order(program_order):
    """The order fixture itself: each program takes a ticket from an atomic counter."""
    import triton
    import triton.language as tl

    @triton.jit
    def ticket(counter, out):
        tl.store(out + tl.program_id(0), tl.atomic_add(counter, 1))

    counter, out = torch.zeros(1, dtype=torch.int64), torch.full((16,), -1, dtype=torch.int64)
    ticket[(16,)](counter, out)
    assert sorted(out.tolist()) == list(range(16))
    expected = {"identity": list(range(16)), "reversed": list(range(15, -1, -1))}
    if program_order in expected:
        assert out.tolist() == expected[program_order]
    else:
        assert out.tolist() != list(range(16))


def _variant(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a launch for: each constexpr's value, and each other argument's
    specialization (its type; an int's being 1 or a multiple of 16, a pointer's 16-byte alignment,
    unless the kernel says do_not_specialize), by Triton's own rule (native_specialize_impl)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    from freescale_comm.bench.layout import bound_launch

    arguments, constexprs, warps = bound_launch(kernel, args, kwargs)
    loose = set(kernel.kwargs.get("do_not_specialize") or ())  # InterpretedFunction keeps jit's arguments
    key = []
    for name, value in arguments.items():
        if name in constexprs:
            key.append((name, value))
        else:
            key.append((name,) + native_specialize_impl(BaseBackend, value, False, name not in loose, True))
    return tuple(key) + (("num_warps", warps),)


def test_twenty_balanced_steps_of_e2e_shapes_compile_each_kernel_once(monkeypatch, program_order):
    """Batches as freescale-bench e2e draws them (kuairand lengths, 4 ranks, every step balanced by
    the planner): whatever the shapes, each kernel compiles once (a recompile mid-training costs
    0.3-1.5 s on one rank while the others wait). Before: the copy's search depth and the
    specialized sizes gave each batch its own variants."""
    if program_order != "identity":
        pytest.skip("the variants do not depend on the program order")
    import numpy as np

    from freescale_comm.bench import workloads
    from freescale_comm.planner import CostModel, plan_rebalance

    variants: dict[str, set] = {}

    def launch(name, kernel, args, kwargs, run):
        variants.setdefault(name, set()).add(_variant(kernel, args, kwargs))
        if name != "copy_kernel":  # (no copy result is read here: other tests check them)
            return run()

    intercept(_device_dispatch.kernels(), launch, monkeypatch.setattr)
    world, samples = 4, 8
    cost = CostModel(quadratic=1.0, linear=8.0, constant=16.0)
    for step in range(20):
        per_rank = [workloads.step_lengths("kuairand", samples, seed=0, step=step, rank=r, scale=1 / 16)
                    for r in range(world)]
        plan = plan_rebalance(per_rank, cost_model=cost)
        for rank in range(world):
            lengths = torch.from_numpy(np.asarray(per_rank[rank], dtype=np.int64))
            dest = torch.from_numpy(np.ascontiguousarray(plan.dest[rank])).to(torch.int64)
            values = torch.randn(int(lengths.sum()), 64)  # dim 64, float32: e2e's rows
            device_plan = _device_dispatch.plan(lengths, dest, world, rank, values.shape[0])
            _device_dispatch.scatter(_device_dispatch.gather(values, device_plan), device_plan)
    assert set(variants) == {"count_kernel", "scan_chunks_kernel", "scan_totals_kernel", "place_kernel", "copy_kernel"}
    assert {name: len(keys) for name, keys in variants.items()} == {
        "count_kernel": 1, "scan_chunks_kernel": 1, "scan_totals_kernel": 1, "place_kernel": 1,
        "copy_kernel": 2}, variants  # copy: gather and scatter (TO_PACKED)


def test_copy_tiles_fill_about_4_kib_and_leave_few_lanes_idle(program_order):
    """Issue 39 item 3: the old fixed 32 x 128-word tile left 75 % of lanes masked for 256-byte
    rows, 94 % for 64-byte rows. A row's words round up to a power of two (fewer than half idle),
    rows per program fill ~4 KiB."""
    if program_order != "identity":
        pytest.skip("no kernel runs here")
    k = _device_dispatch.kernels()
    for word_bytes in (1, 2, 4, 8):
        for row_words in range(1, 3000):
            rows, words = k.copy_shape(row_words, word_bytes)
            tiles = -(-row_words // words)
            assert (tiles * words - row_words) / (tiles * words) < 0.5, (row_words, word_bytes, words)
            assert rows * words * word_bytes <= k.COPY_TILE_BYTES or rows == 1, (row_words, word_bytes)
            assert rows == 1 or 2 * rows * words * word_bytes > k.COPY_TILE_BYTES, (row_words, word_bytes)
    assert k.copy_shape(8, 8) == (64, 8) and k.copy_shape(32, 8) == (16, 32)  # 64- and 256-byte rows


# Torch 2.11's CUDA wheels pin Triton 3.6 (what the first GPU machine had, 2026-11-27), whose
# compiler rejected place_kernel where 3.9's accepted it: scripts/setup.sh installs 3.6 here.
TRITON_OF_TORCH_2_11 = Path(__file__).resolve().parents[1] / "build" / "compat" / "triton-3.6.0"


@pytest.mark.parametrize("triton_dir", [None, TRITON_OF_TORCH_2_11], ids=["this-triton", "torch-2.11-triton"])
def test_every_kernel_compiles_for_sm_90_without_spilling_registers(monkeypatch, program_order, triton_dir):
    """Triton's real compiler and ptxas (in Triton's wheel; no GPU needed) on every launch a plan
    and its copies make, at row widths of 1 to 4096 bytes: each kernel compiles, and none spills
    registers to local memory (place's [128, 128] int64 tiles spilled 1 KiB, count's 28 bytes);
    with this environment's Triton and with the one torch 2.11 brings."""
    if program_order != "identity":
        pytest.skip("compiling does not depend on the program order")
    pytest.importorskip("triton.backends.nvidia.compiler")
    if triton_dir is not None and not (triton_dir / "triton").is_dir():
        pytest.skip(f"no Triton at {triton_dir}: scripts/setup.sh installs it (pip --target)")
    from freescale_comm.bench.layout import compile_offline, launch_spec

    launches = []

    def launch(name, kernel, args, kwargs, run):
        launches.append(launch_spec(kernel, args, kwargs))
        return run()

    intercept(_device_dispatch.kernels(), launch, monkeypatch.setattr)
    lengths, dest = random_batch(4, 40, 3)
    plan = check_plan(lengths, dest, 3)
    for row_shape, dtype in (((), torch.uint8), ((8,), torch.float32), ((64,), torch.float32), ((4096,), torch.uint8)):
        values = torch.zeros((int(lengths.sum()), *row_shape), dtype=dtype)
        _device_dispatch.scatter(_device_dispatch.gather(values, plan), plan)
    rows = compile_offline(launches, triton_dir=None if triton_dir is None else str(triton_dir))
    if triton_dir is not None:
        assert {r["triton"] for r in rows} == {"3.6.0"}
    assert {r["kernel"] for r in rows} == {"count_kernel", "scan_chunks_kernel", "scan_totals_kernel", "place_kernel",
                                           "copy_kernel"}
    assert all(r["spill_store_bytes"] == 0 for r in rows), [r for r in rows if r["spill_store_bytes"]]
