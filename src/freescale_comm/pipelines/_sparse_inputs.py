"""Where each sharded module's input comes from in a batch: `batch.sparse`, `batch["ids"]`, ... found
by tracing the model's forward with torch.fx (the sharded modules as leaves), as TorchRec's
pipelines do. The pipeline looks the next batch's features up this way before its forward runs."""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch import nn

Path = list[tuple[str, Any]]  # ("attr", name) | ("item", key), applied in order to the batch


class _Tracer(torch.fx.Tracer):
    """Traces only the modules that hold a sharded module (`through`: their qualified names): every
    other module is a leaf, so user code the pipeline needs not see (a tower, a loss) is never traced."""

    def __init__(self, through: set[str]) -> None:
        super().__init__()
        self._through = through

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname not in self._through


def _path(node: torch.fx.Node, fqn: str) -> Path:
    steps: Path = []
    while node.op != "placeholder":
        if node.op == "call_function" and node.target is getattr and isinstance(node.args[1], str):
            steps.append(("attr", node.args[1]))
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], (str, int)):
            steps.append(("item", node.args[1]))
        else:
            raise ValueError(f"the input of sharded module {fqn!r} is computed in forward ({node.format_node()}), "
                             "not read from the batch: pass sparse_inputs=lambda batch: {fqn: kjt, ...}")
        node = node.args[0]
    first = next(n for n in node.graph.nodes if n.op == "placeholder")
    if node is not first:
        raise ValueError(f"the input of sharded module {fqn!r} comes from forward's argument {node.target!r}: the "
                         "pipeline calls model(batch), so it must come from the batch")
    return list(reversed(steps))


def find_sparse_inputs(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, Path]:
    """fqn -> path in the batch of the KeyedJaggedTensor each of `modules` is called with."""
    through = {".".join(fqn.split(".")[:k]) for fqn in modules for k in range(fqn.count(".") + 1)}
    tracer = _Tracer(through)
    try:
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 - any tracing failure has the same remedy
        raise ValueError(f"cannot trace the model's forward with torch.fx to find its sparse inputs ({e}); pass "
                         "sparse_inputs=lambda batch: {module_fqn: kjt, ...}") from e
    paths: dict[str, Path] = {}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in modules:
            if node.target in paths:
                raise ValueError(f"sharded module {node.target!r} is called more than once per forward: not supported")
            arg = node.args[0] if node.args else next(iter(node.kwargs.values()), None)
            if not isinstance(arg, torch.fx.Node):
                raise ValueError(f"sharded module {node.target!r} is called without a KeyedJaggedTensor argument")
            paths[node.target] = _path(arg, node.target)
    missing = sorted(set(modules) - set(paths))
    if missing:
        raise ValueError(f"sharded modules {missing} are not called by the model's forward")
    return paths


def read_path(batch: Any, path: Path) -> Any:
    for kind, key in path:
        batch = getattr(batch, key) if kind == "attr" else batch[key]
    return batch


def reader(paths: dict[str, Path]) -> Callable[[Any], dict[str, Any]]:
    return lambda batch: {fqn: read_path(batch, p) for fqn, p in paths.items()}
