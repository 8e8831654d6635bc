"""A small caching allocator for the large CPU tensors dispatch/combine return.

A fresh 128 MiB tensor costs ~60 ms of page faults on first touch (more with ranks sharing cores),
several times the copy that fills it. Like the CUDA caching allocator, we keep blocks users have
dropped and hand them out again, already faulted in. A block is free when nothing but the cache
holds its storage (torch's storage use count back at its value at creation); tensors handed out
are views of it, so a user, autograd or numpy holding one keeps the block busy.

Invariants: a busy block is never handed out; at most FREESCALE_OUTPUT_CACHE_BYTES (default
1G; 0 disables caching) of free blocks stay cached; requests under MIN_BYTES bypass the cache.
"""

from __future__ import annotations

import math
import os
import threading

import torch

MIN_BYTES = 1 << 20  # smaller tensors fault in cheaply: plain torch.empty
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # absent: no caching, plain empty


_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _cache_limit() -> int:
    """FREESCALE_OUTPUT_CACHE_BYTES: bytes, with an optional K/M/G binary suffix like the other
    FREESCALE_* sizes."""
    raw = os.environ.get("FREESCALE_OUTPUT_CACHE_BYTES", "1G")  # no blanks, as the core's sizes
    scale = _SUFFIX.get(raw[-1:].upper(), 1)
    digits = raw[:-1] if scale != 1 else raw
    if not digits.isdigit():
        raise ValueError(f"FREESCALE_OUTPUT_CACHE_BYTES={raw!r} must be a byte count >= 0 (a K, M or G suffix is "
                         "allowed; 0 turns the cache off); unset it for the 1G default")
    return int(digits) * scale


class _Block:
    __slots__ = ("buf", "idle_count")

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8)  # uint8 [nbytes]
        self.idle_count = self._count()

    def _count(self) -> int:
        return _use_count(self.buf.untyped_storage()._cdata)

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def free(self) -> bool:
        return self._count() <= self.idle_count


class OutputCache:
    def __init__(self, limit_bytes: int) -> None:
        self._limit = limit_bytes
        self._blocks: list[_Block] = []
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous CPU tensor of `shape` and `dtype`."""
        nbytes = math.prod(shape) * dtype.itemsize
        if _use_count is None or self._limit == 0 or nbytes < MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            block = self._take(nbytes)
            return block.buf[:nbytes].view(dtype).view(shape)

    def _take(self, nbytes: int) -> _Block:
        # Smallest free block that fits without wasting more than half of it.
        fits = [b for b in self._blocks if nbytes <= b.nbytes <= 2 * nbytes and b.free()]
        if fits:
            return min(fits, key=lambda b: b.nbytes)
        self._trim()  # before the new block joins: it is about to be busy
        block = _Block(nbytes)
        self._blocks.append(block)
        return block

    def _trim(self) -> None:
        """Drops free blocks, oldest first, until the free ones fit in the limit."""
        free = [b for b in self._blocks if b.free()]
        excess = sum(b.nbytes for b in free) - self._limit
        for b in free:
            if excess <= 0:
                break
            self._blocks.remove(b)
            excess -= b.nbytes

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._blocks)


_cache: OutputCache | None = None
_cache_lock = threading.Lock()


def output_cache() -> OutputCache:
    """The process's cache (built on first use, reading FREESCALE_OUTPUT_CACHE_BYTES then)."""
    global _cache
    with _cache_lock:
        if _cache is None:
            _cache = OutputCache(_cache_limit())
        return _cache
