"""The caching allocator behind dispatch/combine outputs: a block is handed out again only once
nothing outside the cache holds it, and the free blocks kept stay under the limit."""

import pytest
import torch

from freescale_comm._output_cache import MIN_BYTES, OutputCache, _cache_limit

MiB = 1 << 20
ROWS = MiB // 4  # a float32 [ROWS] tensor is 1 MiB


def _block_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_dropped_output_is_reused():
    cache = OutputCache(64 * MiB)
    a = cache.empty((ROWS,), torch.float32)
    first = _block_ptr(a)
    del a
    b = cache.empty((ROWS // 2, 2), torch.float32)  # same bytes, other shape
    assert _block_ptr(b) == first
    assert b.shape == (ROWS // 2, 2) and b.is_contiguous()


@pytest.mark.parametrize("holder", ["tensor", "view", "numpy", "autograd"])
def test_a_held_output_is_never_handed_out_again(holder):
    cache = OutputCache(64 * MiB)
    a = cache.empty((ROWS,), torch.float32).fill_(7.0)
    if holder == "tensor":
        kept = a
    elif holder == "view":
        kept = a[::3]
    elif holder == "numpy":
        kept = a.numpy()
    else:  # autograd saves the input of mul for its backward
        w = torch.ones(ROWS, requires_grad=True)
        kept = (a * w).sum()
    ptr = _block_ptr(a)
    del a
    b = cache.empty((ROWS,), torch.float32).fill_(1.0)
    assert _block_ptr(b) != ptr
    assert kept is not None
    if holder == "autograd":
        kept.backward()
        assert torch.equal(w.grad, torch.full((ROWS,), 7.0))  # the saved input was not overwritten


def test_small_requests_and_a_zero_limit_bypass_the_cache():
    cache = OutputCache(64 * MiB)
    cache.empty((MIN_BYTES // 8,), torch.float32)
    assert cache.cached_bytes() == 0
    off = OutputCache(0)
    off.empty((ROWS,), torch.float32)
    assert off.cached_bytes() == 0


def test_free_blocks_are_trimmed_to_the_limit():
    cache = OutputCache(2 * MiB)
    held = [cache.empty((ROWS,), torch.float32) for _ in range(3)]
    assert cache.cached_bytes() == 3 * MiB  # busy blocks are not the limit's business
    held.clear()
    big = cache.empty((4 * ROWS,), torch.float32)  # too big for the free 1 MiB blocks
    assert cache.cached_bytes() == 4 * MiB + 2 * MiB  # two free ones kept, one dropped
    assert big.numel() == 4 * ROWS


def test_a_block_twice_too_big_is_not_used_for_a_small_request():
    cache = OutputCache(64 * MiB)
    big = cache.empty((4 * ROWS,), torch.float32)
    ptr = _block_ptr(big)
    del big
    small = cache.empty((ROWS,), torch.float32)
    assert _block_ptr(small) != ptr


def test_a_bad_limit_names_the_variable(monkeypatch):
    monkeypatch.setenv("FREESCALE_OUTPUT_CACHE_BYTES", "lots")
    with pytest.raises(ValueError, match="FREESCALE_OUTPUT_CACHE_BYTES"):
        _cache_limit()
    monkeypatch.setenv("FREESCALE_OUTPUT_CACHE_BYTES", "-1")
    with pytest.raises(ValueError, match=">= 0"):
        _cache_limit()
    monkeypatch.setenv("FREESCALE_OUTPUT_CACHE_BYTES", " 1G ")  # blanks, refused as the core's sizes refuse them
    with pytest.raises(ValueError, match="FREESCALE_OUTPUT_CACHE_BYTES"):
        _cache_limit()
    monkeypatch.setenv("FREESCALE_OUTPUT_CACHE_BYTES", "256M")
    assert _cache_limit() == 256 * MiB
