"""Balance plans a batch ahead (TrainPipelinePEC with balance=): fc.balance's first stage, all-gather
the sample lengths and plan, moved off the critical path.

A balanced module that takes an EmbeddingCollection's output gets, in each forward, sequences whose
lengths are its input KeyedJaggedTensor's, known when the pipeline routes the batch, a step early.
So the pipeline's worker all-gathers every rank's lengths of each (micro-)batch then, on the
pipeline's communicator in its program order, and every rank makes the plans the balancer would
make; the EmbeddingCollection's output carries them (PlannedSequences) and the balancer dispatches
with them: per balanced forward, no all-gather, no planning and no host read of the lengths on the
main thread. A model that hands the balanced module anything else gets the all-gather as before."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from freescale_comm.balancer import LoadBalancer, PlanAhead
from freescale_comm.bundle import feature_order
from freescale_comm.pipelines._catalog import ModuleInfo
from freescale_comm.pipelines._embeddings import sequence_features
from freescale_comm.pipelines._micro_batches import HostLengths

Plans = dict[str, dict[LoadBalancer, PlanAhead]]  # sequence module fqn -> its plan per balancer


def plan_ahead(comm: Any, balancers: list[LoadBalancer], modules: list[ModuleInfo],
               inputs: list[dict[str, Any]], host_lengths: Optional[HostLengths] = None) -> list[Plans]:
    """Collective on `comm`: per (micro-)batch of `inputs` (sharded module fqn -> its
    KeyedJaggedTensor), the plans of every balancer for every sequence module's output.
    host_lengths: the lengths already read (MicroBatches'); the others are read once each."""
    host_lengths = host_lengths if host_lengths is not None else HostLengths()
    out: list[Plans] = [{} for _ in inputs]
    for info in modules:
        features = feature_order(sequence_features(info))  # the order dispatch_bundle moves them in
        lengths = [_feature_lengths(batch[info.fqn], features, host_lengths) for batch in inputs]
        item_bytes = sum(info.table_of(f).dim for f in features) * torch.float32.itemsize  # values are float32
        for balancer in balancers:
            for plans, ahead in zip(out, balancer.plan_ahead(comm, lengths, item_bytes)):
                plans.setdefault(info.fqn, {})[balancer] = ahead
    return out


def _feature_lengths(kjt: Any, features: list[str], host_lengths: HostLengths) -> list[np.ndarray]:
    """kjt's lengths of each of `features` (int64 [samples]) on the host."""
    host, keys = host_lengths.of(kjt), kjt.keys()
    return [host[keys.index(f)] for f in features]
