"""Counts reads of tensor values on the host: what would make the CPU wait for the GPU (a device
sync) if the tensors were on CUDA. On CPU runs every tensor is a host tensor, so this is a model:
it counts every .item()/int()/bool() (aten._local_scalar_dense), every .tolist(), and every op
whose output size depends on values (boolean-mask indexing, nonzero, unique, masked_select,
repeat_interleave without output_size), except reads of tensors that live on the host by design
(`host`: e.g. fbgemm's iter_cpu and learning_rate_tensor)."""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SIZED_BY_VALUES = ("aten.nonzero.", "aten._unique", "aten.unique", "aten.masked_select")


class _Reads(TorchDispatchMode):
    def __init__(self, sink: collections.Counter, host: set[int]) -> None:
        super().__init__()
        self.sink, self.host = sink, host

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith("aten._local_scalar_dense"):
            if args[0].data_ptr() not in self.host:
                self.sink[name] += 1
        elif name.startswith(_SIZED_BY_VALUES) or (
                name.startswith("aten.repeat_interleave.Tensor") and kwargs.get("output_size") is None):
            self.sink[name] += 1
        elif name.startswith(("aten.index.Tensor", "aten.index_put")):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype == torch.bool for i in indices):
                self.sink[name + " (boolean mask)"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting(obj: Any, methods: Iterable[str], host: Iterable[torch.Tensor]) -> Iterator[collections.Counter]:
    """Counts host reads inside obj's `methods` (on whichever thread calls them); yields the counter."""
    sink: collections.Counter = collections.Counter()
    host_ptrs = {t.data_ptr() for t in host}
    inside = threading.local()
    tolist = torch.Tensor.tolist

    def counted_tolist(self: torch.Tensor) -> Any:
        if getattr(inside, "depth", 0) and self.data_ptr() not in host_ptrs:
            sink["tolist"] += 1
        return tolist(self)

    def wrapped(method: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            outermost = not getattr(inside, "depth", 0)  # one mode per thread: nested ones would count twice
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                with _Reads(sink, host_ptrs) if outermost else contextlib.nullcontext():
                    return method(*args, **kwargs)
            finally:
                inside.depth -= 1
        return run

    originals = {m: getattr(obj, m) for m in methods}
    own = {m for m in methods if m in vars(obj)}  # instance attributes (e.g. a replaced forward): put back
    torch.Tensor.tolist = counted_tolist
    for m, method in originals.items():
        setattr(obj, m, wrapped(method))
    try:
        yield sink
    finally:
        torch.Tensor.tolist = tolist
        for m, method in originals.items():
            if m in own:
                setattr(obj, m, method)
            else:
                delattr(obj, m)  # the class's method again
