"""Who wrote the tables: TrainPipelinePEC's own fused updates, or someone else in place.

Batches in flight hold rows fetched earlier and gradients deferred to later, so a write of the
tables from outside the pipeline while they are in flight (`torch.distributed.checkpoint.load` into
`model.state_dict()`, a `copy_` into the weights) would train them on rows older than the write
and apply older gradients on top of it. Every in-place write bumps the version counter of the
tensor written, shared by all views of one storage (the TBE's weights and the shard views
`split_embedding_weights()` and TorchRec's state_dict() hand out); the watch notes the counters
after each of the pipeline's own writes, so a counter that moved since says someone else wrote.
The optimizer state is not watched (a load writes the weights too)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class TablesWrittenInPlace(RuntimeError):
    """This rank's tables were written in place outside TrainPipelinePEC while batches were in flight."""

    def __init__(self, tables: list[str]) -> None:
        super().__init__(
            f"tables {tables} were written in place outside TrainPipelinePEC while it held batches in flight "
            "(torch.distributed.checkpoint.load into model.state_dict(), a copy_ into the weights): those "
            "batches' rows were fetched, and the last batch's gradients deferred, before the write. The pipeline "
            "stops here and drops them: the tables keep what was written. close() it and build a new one; load "
            "before the first progress(), after StopIteration or after close()")
        self.tables = tables


class TableWatch:
    """The version counters of this rank's table shards, noted after the pipeline's own writes.

    shards: slot key (module, table, shard) -> an object with `.weight`, a view of the TBE's weights."""

    def __init__(self, shards: dict) -> None:
        self._views = {key: shard.weight for key, shard in shards.items()}
        self._lock = threading.Lock()  # a noted state and the writes it follows change together
        self._noted = self._now()

    def _now(self) -> dict:
        return {key: view._version for key, view in self._views.items()}

    def _moved(self) -> list[str]:
        now = self._now()
        return sorted({key[1] for key, version in now.items() if version != self._noted[key]})

    def note(self) -> None:
        """Takes the tables as they are now as the pipeline's (nothing in flight: writes were allowed)."""
        with self._lock:
            self._noted = self._now()

    def check(self) -> None:
        """TablesWrittenInPlace if someone else wrote them since the last note."""
        with self._lock:
            moved = self._moved()
        if moved:
            raise TablesWrittenInPlace(moved)

    @contextlib.contextmanager
    def own_writes(self) -> Iterator[None]:
        """The pipeline's own writes inside: checked before (nothing written if someone else wrote
        first), noted after, under one lock so a check on another thread never sees them half done."""
        with self._lock:
            moved = self._moved()
            if moved:
                raise TablesWrittenInPlace(moved)
            try:
                yield
            finally:
                self._noted = self._now()
