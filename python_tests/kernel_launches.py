"""Tests' stand-ins for the layout kernels: every launch of one goes through a hook."""

from __future__ import annotations

from typing import Any, Callable

from freescale_comm.bench.layout import KERNELS

Hook = Callable[[str, Any, tuple, dict, Callable[[], Any]], Any]


def intercept(kernels: Any, hook: Hook, set_attr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Replaces each layout kernel of `kernels` (the _layout_kernels module) by a stand-in: a launch
    `kernel[grid](*args, **kwargs)` returns hook(name, kernel, args, kwargs, run), run() making the
    real launch. set_attr: monkeypatch.setattr in a test (undone after it)."""

    class Launch:
        def __init__(self, kernel: Any, name: str) -> None:
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                return hook(self.name, self.kernel, args, kwargs, lambda: self.kernel[grid](*args, **kwargs))
            return call

    for name in KERNELS:
        set_attr(kernels, name, Launch(getattr(kernels, name), name))
