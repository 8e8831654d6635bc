"""TrainPipelinePEC: FreeScale's prioritized embedding communication (PEC) on a TorchRec
DistributedModelParallel model's own sharded embeddings, adopted by changing one line:

    pipeline = TrainPipelineSparseDist(model, optimizer, device)   # TorchRec
    pipeline = fc.TrainPipelinePEC(model, optimizer, device)       # FreeScale's PEC

While batch N computes, the rows batch N+1 reads that N does not (NOL) are looked up and sent at
low priority; the rows both read (OL) wait for N's update and go first, at high priority; N's
gradients for rows N+1 does not read are deferred (lowest priority) and applied before any later
batch reads those rows. Every read equals synchronous training's. All of it runs on the
pipeline's own fc.Communicator (a worker thread posts every message, in the same order on every
rank), so the same code runs on CPU (host transport) and CUDA (ce / nvshmem). On CUDA the worker
issues on a stream of its own, ordered with the caller's at every hand-off (see _streams), and
copies each batch to the device there.

Scope: sharded EmbeddingCollection and EmbeddingBagCollection (SUM or MEAN pooling, unweighted),
table-wise, row-wise and column-wise, fused kernels (the optimizer TorchRec fuses into the TBE:
SGD, (row-wise) Adagrad, Adam...). Any other sharding or kernel: ValueError at construction naming
the table. float32 weights. The sharded modules' inputs must be read from the batch
(`batch.sparse`, `batch["ids"]`): found by torch.fx tracing, or given as `sparse_inputs`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
import types
import weakref
import zlib
from typing import Any, Callable, Generic, Iterator, Mapping, Optional, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from freescale_comm.balancer import PlannedSequences, balance as fc_balance
from freescale_comm.communicator import Communicator, check_priority
from freescale_comm.microbatch import MAX_MICRO_BATCHES
from freescale_comm.pipelines import _streams
from freescale_comm.pipelines._catalog import build_catalog, sharded_modules
from freescale_comm.pipelines._embeddings import accumulate_gradients, micro_leaves, module_output, route, route_micro
from freescale_comm.pipelines._exchange import PREFETCH, Asks, PecExchange
from freescale_comm.pipelines._micro_batches import MicroBatches, SplitBatch, cut, merge_outputs
from freescale_comm.pipelines._plans_ahead import Plans, plan_ahead
from freescale_comm.pipelines._sparse_inputs import find_sparse_inputs, reader
from freescale_comm.pipelines._table_writes import TablesWrittenInPlace
from freescale_comm.planner import CostModel

# the sharded modules a live TrainPipelinePEC drives (one pipeline per module at a time), to a weak
# reference to it: a strong one kept the pipeline, and through it the module (the key), for the
# life of the process once both were dropped
_driven: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _driver_of(module: nn.Module) -> Optional["TrainPipelinePEC"]:
    ref = _driven.get(module)
    return ref() if ref is not None else None

logger = logging.getLogger("freescale_comm")

In = TypeVar("In")
Out = TypeVar("Out")


class TrainPipelinePEC(Generic[In, Out]):
    """Constructed like TorchRec's TrainPipelineSparseDist; `progress(dataloader_iter)` runs one
    step and returns that batch's output, fills on the first call, drains at the end of the data and
    then raises StopIteration. Results equal TrainPipelineSparseDist's (see README: TorchRec).

    model: a DistributedModelParallel whose forward(batch) returns (losses, output).
    execute_all_batches: False stops as soon as the data runs out, without training the batch
        already fetched (TorchRec's TrainPipelineSparseDist, which looks two batches ahead, leaves two).
        The pipeline reads three batches ahead of the one it trains (TrainPipelineSparseDist: two;
        the counts of the batch after next ride on the next one's ids); batches read from an iterator
        are trained even if a later progress() gets another.
    Checkpoints: the sharded modules' state_dict() and the optimizer's (the one given, and the
    model's fused_optimizer) apply the deferred gradients first (flush), so they hold what
    TrainPipelineSparseDist's would; load_state_dict() on them is refused while batches are in
    flight (rows fetched before the load): load before the first progress(), after StopIteration
    or after close(). A write of the tables in place meanwhile (torch.distributed.checkpoint.load
    into model.state_dict()) fails the pipeline at its next progress(), state_dict() or load (see
    _table_writes); the tables keep what was written.
    group: the ranks to move embeddings among (default: the model's sharding process group).
    high_priority / low_priority / deferred_priority: OL traffic, prefetch traffic, NOL gradients.
    next_micro_priority / micro_gradient_priority (with micro_batches): the next micro-batch's rows,
        the current micro-batch's gradients; high >= next_micro > micro_gradient > low.
    sparse_inputs: batch -> {sharded module fqn: KeyedJaggedTensor}, when tracing cannot find them.
    balance: {submodule fqn: CostModel}: FreeScale's load balancing after the embedding
        communication: each named module (one consuming the embeddings, e.g. an HSTU tower taking
        the EmbeddingCollection's output first) runs on samples fc.balance moved so every rank gets
        about the same cost, and its outputs go home (gradients follow). Removed by close(). Its
        plans are made a batch ahead on the worker (the lengths of each EmbeddingCollection's output
        are its input's, known when the batch is routed), so a module given that output as it is
        dispatches without the all-gather of lengths (see _plans_ahead).
    measure_speed (with balance): each balanced forward's time sets this rank's speed, and the plans
        made after it give a slower rank less cost (fc.balance's measure_speed; the plans made ahead
        use the speed measured up to when they are made, a batch or two behind).
    prefetch: what of batch N+1 moves while N computes. "pec" (FreeScale): the rows N does not
        read, the rest right after N's update, at high_priority. "dual_buffer" (NestPipe's DBP):
        every row, into N+1's own buffer; after N's update the rows N also read are refreshed
        (PEC's high-priority round: the same code). "ids": only the ids; every row after N's
        update (no overlap across batches; with micro_batches, NestPipe's FWP alone).
    micro_batches: NestPipe's frozen-window pipelining: each batch is cut into this many
        micro-batches (fc.microbatch's key-centric clustering of each rank's samples; every rank
        runs the same number, empty ones included); each micro-batch's forward and backward run
        on its own distinct rows, and the rows that wait for the last update move one round per
        micro-batch, micro-batch m+1's (at next_micro_priority) while m computes, and m's
        gradients that go first leave while m+1 computes (at micro_gradient_priority). A row
        several micro-batches read moves once, with the first, and its gradient, summed over
        them, once, with the last (rows are frozen within a batch). Embedding
        gradients accumulate over the micro-batches and apply once per batch, through the fused
        optimizer; dense gradients accumulate too (DDP all-reduces each micro-batch's; built with
        static_graph=False, only the last one's, with the sum: see _ddp). The micro-batches'
        gradients add up, so say how the model reduces its loss over samples (loss_reduction). The
        model must use the same dense parameters on an empty micro-batch as on any other (as
        DDP's static graph requires of every backward: a rank whose graph skips one waits forever);
        an empty one (fewer samples than micro-batches) runs forward and backward but trains
        nothing: its loss sends no gradient (a mean over no samples is NaN, and so is 0 x NaN).
        What a layer computes over the batch (BatchNorm's statistics) it computes per micro-batch.
        progress() returns the micro-batches' outputs merged by merge_output. None: whole
        batches, every id sent as TorchRec sends it (results bit-identical to
        TrainPipelineSparseDist).
    loss_reduction (with micro_batches): "sum" (default) if the model's losses are summed over
        samples, "mean" if averaged: then each micro-batch's loss is scaled by its share of the
        batch's samples, so the gradients are the whole batch's mean's. A mean loss left at "sum"
        would weigh every micro-batch as a whole batch.
    split_batch: (batch, int64 sample indices) -> that micro-batch, for batches the built-in
        cut cannot handle (it cuts KeyedJaggedTensors, tensors of batch-size rows, and dataclasses,
        dicts, lists, tuples and plain objects field by field).
    merge_output: (the micro-batches' outputs, per micro-batch its int64 sample indices) -> the
        batch's output. Default: tensors whose first dimension is each micro-batch's sample count
        are put back in the batch's sample order, tuples / lists / dicts item by item, anything
        else as the list of the micro-batches' values. Pass merge_output for outputs that are not
        per sample (jagged values, per-task weights: a tensor of one row per task would be taken
        for one row per sample whenever every micro-batch holds as many samples as tasks).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 execute_all_batches: bool = True, *, group: Optional[dist.ProcessGroup] = None,
                 high_priority: int = 100, low_priority: int = 0, deferred_priority: int = -10,
                 sparse_inputs: Optional[Callable[[Any], dict[str, Any]]] = None,
                 balance: Optional[Mapping[str, CostModel]] = None, measure_speed: bool = False,
                 prefetch: str = "pec",
                 micro_batches: Optional[int] = None, next_micro_priority: int = 50,
                 micro_gradient_priority: int = 25, loss_reduction: str = "sum",
                 split_batch: Optional[SplitBatch] = None,
                 merge_output: Optional[Callable[[list[Any], list[torch.Tensor]], Any]] = None) -> None:
        if not hasattr(model, "plan") or not hasattr(model, "module"):
            raise TypeError(f"model must be a torchrec DistributedModelParallel, got {type(model).__name__}")
        for name, p in (("high_priority", high_priority), ("next_micro_priority", next_micro_priority),
                        ("micro_gradient_priority", micro_gradient_priority), ("low_priority", low_priority),
                        ("deferred_priority", deferred_priority)):
            check_priority(p, name)
        if not high_priority > low_priority > deferred_priority:
            raise ValueError("priorities must satisfy high_priority > low_priority > deferred_priority, got "
                             f"{high_priority}, {low_priority}, {deferred_priority}")
        if micro_batches is not None and not high_priority >= next_micro_priority > micro_gradient_priority > low_priority:
            raise ValueError("priorities must satisfy high_priority >= next_micro_priority > micro_gradient_priority > "
                             f"low_priority, got {high_priority}, {next_micro_priority}, {micro_gradient_priority}, "
                             f"{low_priority}")
        if prefetch not in PREFETCH:
            raise ValueError(f"prefetch must be one of {', '.join(map(repr, PREFETCH))}, got {prefetch!r}")
        if micro_batches is not None and (isinstance(micro_batches, bool) or not isinstance(micro_batches, int)
                                          or not 1 <= micro_batches <= MAX_MICRO_BATCHES):
            raise ValueError(f"micro_batches must be an int in [1, {MAX_MICRO_BATCHES}] (or None: whole batches), got "
                             f"{micro_batches!r}")
        if loss_reduction not in ("sum", "mean"):
            raise ValueError(f"loss_reduction must be 'sum' or 'mean' (how the model reduces its loss over samples), "
                             f"got {loss_reduction!r}")
        self._loss_scale = loss_reduction == "mean"
        if sparse_inputs is not None and not callable(sparse_inputs):
            raise TypeError(f"sparse_inputs must be callable batch -> {{sharded module fqn: its input}}, got "
                            f"{type(sparse_inputs).__name__}")
        if split_batch is not None and not callable(split_batch):
            raise TypeError(f"split_batch must be callable (batch, samples) -> micro-batch, got {type(split_batch).__name__}")
        if merge_output is not None and not callable(merge_output):
            raise TypeError(f"merge_output must be callable (outputs, samples) -> output, got {type(merge_output).__name__}")
        self._micro_batches, self._split_batch, self._merge_output = micro_batches, split_batch, merge_output
        self._model, self._optimizer, self._device = model, optimizer, _with_index(torch.device(device))
        self._execute_all_batches = execute_all_batches
        if group is None:
            env = getattr(model, "_env", None)
            group = getattr(env, "process_group", None)
        rank = dist.get_rank(group) if group is not None else dist.get_rank()
        world = dist.get_world_size(group) if group is not None else dist.get_world_size()
        model_group = getattr(getattr(model, "_env", None), "process_group", None)
        if model_group is not None and dist.get_world_size(model_group) != world:
            raise ValueError(f"group has {world} ranks but the model is sharded over {dist.get_world_size(model_group)}: "
                             "pass the model's sharding group (or leave group=None)")
        self._catalog = build_catalog(model.module, model.plan, rank)
        # a pipeline left on these modules is closed here, as a TrainPipelineSparseDist made per epoch
        # is dropped: idle (its data ran out, or it failed), or with batches in flight (their deferred
        # gradients apply, as its close() does; its read-ahead is dropped, as a dropped TorchRec
        # pipeline's prefetched batches are). Every rank builds the new one at the same point, so
        # what the close sends, every rank sends. (Its hooks kept a pipeline dropped mid-epoch alive,
        # and it refused the new one: "close() that one first", with nothing left to close.)
        others: dict[int, Any] = {}  # id -> the other pipeline
        for info in self._catalog.modules:
            other = _driver_of(info.module)
            if other is not None:
                others[id(other)] = other
        for other in others.values():
            busy = other._batch is not None and other._failure is None and not other._closed
            other.close()
            other._closed_why = (f"a new TrainPipelinePEC was built on the same model, which closed this "
                                 f"{'one (its batches in flight were flushed)' if busy else 'idle one'}")
        modules = dict(sharded_modules(model.module))
        self._read_inputs = sparse_inputs if sparse_inputs is not None else \
            reader(find_sparse_inputs(model.module, modules))
        to_balance = _balance_targets(model.module, balance, modules)  # checked before anything starts
        if not isinstance(measure_speed, bool):
            raise TypeError(f"measure_speed must be True or False, got {measure_speed!r}")
        if measure_speed and not to_balance:
            raise ValueError("measure_speed=True times the modules `balance` names, and balance names none: "
                             "pass balance={submodule fqn: CostModel}, or leave measure_speed False")
        self._comm = Communicator(group)
        # every rank must drive the same rounds: the arguments that shape them must agree, and a rank
        # that cannot serve its own shards refuses with all the others
        try:
            _agree(self._comm, self._catalog.refusal or _micro_batch_refusal(self._catalog, micro_batches), {
                "micro_batches": micro_batches, "prefetch": prefetch, "execute_all_batches": execute_all_batches,
                "loss_reduction": loss_reduction, "balance": sorted((k, repr(v)) for k, v in balance.items()) if balance is not None else None,
                "high_priority": high_priority, "low_priority": low_priority, "deferred_priority": deferred_priority,
                "next_micro_priority": next_micro_priority, "micro_gradient_priority": micro_gradient_priority})
        except BaseException:
            self._comm.close()
            raise
        # from here on, a failure releases what was made (the communicator, the worker, hooks) before
        # it is raised: nothing keeps running, and the model is the user's again
        self._hooks, self._wrapped, self._balanced = [], [], []
        self._worker = None
        try:
            tables = {s.weight.device for s in self._catalog.local.values()}
            self._exchange = PecExchange(self._comm, self._catalog, high_priority, low_priority, deferred_priority,
                                         tables.pop() if len(tables) == 1 else self._device, prefetch=prefetch,
                                         micro_batches=micro_batches, micro=next_micro_priority,
                                         micro_gradients=micro_gradient_priority)
            # DDP wrappers of the dense part that micro-batches before the last may skip syncing in. Not
            # static_graph ones (TorchRec's default): no_sync() there asserts or silently stops all-reducing
            # (pytorch/pytorch#143580, #187732), so each micro-batch's backward syncs its own gradients
            self._ddp = [m for m in model.modules()
                         if isinstance(m, nn.parallel.DistributedDataParallel) and not getattr(m, "static_graph", False)]
            data_device = self._exchange.device
            self._worker = concurrent.futures.ThreadPoolExecutor(  # the CUDA device is per thread
                1, thread_name_prefix="freescale-pec",
                initializer=(lambda: torch.cuda.set_device(data_device)) if data_device.type == "cuda" else None)
            # on CUDA the worker runs on its own stream; each post and join is also a stream edge (_streams)
            self._streams = _streams.for_device(data_device)
            self._batch: Optional[Any] = None  # batch N (MicroBatches with micro_batches), its rows fetched
            self._inputs: dict[str, Any] = {}  # the sharded-module inputs of what forward runs on now
            self._reads: tuple[list, list] = ([], [])  # per slot: rows each id reads, positions (module_output)
            self._asks: Optional[Asks] = None  # batch N's rows (leaves) per slot
            self._micro_rows: list[Optional[concurrent.futures.Future]] = []  # per micro-batch: its rows' round
            self._blocking = False  # tests' synchronous reference: every message waited for when posted
            self._step = 0
            self._deferred_sent: Optional[concurrent.futures.Future] = None
            self._asked_next: Optional[concurrent.futures.Future] = None  # the next batch's ids, in flight
            self._has_next = False  # batch N+1 exists (every rank agreed)
            self._routed: collections.deque = collections.deque()  # worker: (batch, inputs, asks) counted, not asked
            self._failure: Optional[BaseException] = None  # what broke the pipeline: raised again
            # a step's own gradient round has begun and not returned: a failure then leaves the tables
            # with part of that batch's update (flush() refuses to hand them out as a step's)
            self._update_open = False
            self._failure_flushed = False  # flush() after the failure applied what it could
            self._closed = False
            self._closed_why = "close() was called"
            self._progressing = threading.Lock()  # held by the thread in progress()
            # per step, ms the main thread was blocked on embedding communication (waiting for the worker
            # or for a message), in all and by phase ("ids": counts, ids; "embeddings": flags, NOL rows, the
            # rows that waited for the last update (OL rows; with micro-batches each one's, as it starts);
            # "gradients": the OL gradients' round trip). The work the main thread does in the rounds it
            # runs itself (selecting, looking up, placing rows) is round_ms; its fused update, update_ms
            self.exposed_ms: list[float] = []
            self.round_ms: list[float] = []
            # per step: the ids this rank sent its owners (every id; with micro-batches each distinct row of
            # the batch once, with the micro-batches reading it)
            self.rows_asked: list[int] = []
            # per step: rows that moved to this rank (with micro-batches, a row two of them read moves once;
            # dual_buffer moves the ones that wait for the last update twice: counted once)
            self.rows_fetched: list[int] = []
            # per step, ms the main thread spent applying gradients that go first to its own shards (the
            # TBEs' fused update: compute on the critical path, not a wait; TorchRec runs it in backward)
            self.update_ms: list[float] = []
            self.exposed_by_phase: list[dict[str, float]] = []
            # the hooks fc.balance made here (removing them later leaves a user's own re-balancing alone)
            for target, cost_model in to_balance:
                self._balanced.append(fc_balance(target, cost_model, group=group,
                                                 measure_speed=measure_speed).freescale_balance)
            # balance plans made a batch ahead, for every sequence module's output (see _plans_ahead)
            self._balancers = [hooks.balancer for hooks in self._balanced]
            self._sequence_modules = [info for info in self._catalog.modules if not info.pooled] if self._balancers else []
            self._plans: list[Plans] = []  # per micro-batch (one: whole batches) of batch N
            self._plans_now: Plans = {}  # of what forward runs on now
            # the pipeline's forward of each sharded module, installed only while progress() runs the
            # model (_driving): outside it the module is TorchRec's (or another pipeline's, e.g.
            # EvalPipelineSparseDist's rewritten forward), and a forward there applies the deferred
            # gradients first (_forward_elsewhere)
            self._forwards = {info.fqn: self._forward_of(info) for info in self._catalog.modules}
            self._driving_now = False
            for info in self._catalog.modules:
                _driven[info.module] = weakref.ref(self)
                self._hooks.append(info.module.register_forward_pre_hook(
                    lambda module, args, fqn=info.fqn: self._forward_elsewhere(module, fqn)))
                # a checkpoint sees every update, as after TrainPipelineSparseDist's steps
                self._hooks.append(info.module.register_state_dict_pre_hook(lambda *_: self.flush()))
                loadable = info.module._register_load_state_dict_pre_hook(lambda *_: self._check_loadable())
                # first, before TorchRec's own hooks rewrite the state dict in place (a refused load leaves it whole)
                info.module._load_state_dict_pre_hooks.move_to_end(loadable.id, last=False)
                self._hooks.append(loadable)
            # the optimizers that read the tables' fused state: their state_dict() flushes first too, and
            # their load_state_dict() is refused while batches are in flight (instance attributes, so
            # DCP's get_optimizer_state_dict goes through them; removed by close())
            for holder in {id(o): o for o in (optimizer, getattr(model, "fused_optimizer", None)) if o is not None}.values():
                self._wrap(holder, "state_dict", lambda *_, **__: self.flush())
                self._wrap(holder, "load_state_dict", lambda *_, **__: self._check_loadable())
            # refused before any module is touched (TorchRec's own load hooks rewrite the state dict in place):
            # through the DMP, and through its inner module (whose own pre-hook runs before any child loads)
            self._wrap(model, "load_state_dict", lambda *_, **__: self._check_loadable())
            root = model.module._register_load_state_dict_pre_hook(lambda *_: self._check_loadable())
            model.module._load_state_dict_pre_hooks.move_to_end(root.id, last=False)
            self._hooks.append(root)
        except BaseException:
            self._closed, self._closed_why = True, "its constructor failed"
            if self._worker is not None:
                self._worker.shutdown(wait=True, cancel_futures=True)
            self._comm.close()
            self._give_back_the_model()
            raise

    def _wrap(self, holder: Any, name: str, before: Callable[..., None]) -> None:
        """holder.name(...) runs before(*args) first, until close(). A method bound to holder: a deep
        copy of holder (an EMA model) gets its own, which calls its class's method alone."""
        if name in vars(holder) or not hasattr(type(holder), name):  # someone else's: left alone
            return
        original = weakref.ref(holder)

        def wrapped(this: Any, *args: Any, **kwargs: Any) -> Any:
            if this is original():
                before(*args, **kwargs)
            return getattr(type(this), name)(this, *args, **kwargs)
        method = types.MethodType(wrapped, holder)
        setattr(holder, name, method)
        self._wrapped.append((holder, name, method))

    @contextlib.contextmanager
    def _driving(self) -> Iterator[None]:
        """The pipeline's forwards installed on the sharded modules while the model runs one batch;
        what was there before (a TorchRec pipeline's rewritten forward, or nothing) comes back."""
        before = [(info.module, info.module.__dict__.get("forward")) for info in self._catalog.modules]
        for info in self._catalog.modules:
            info.module.forward = self._forwards[info.fqn]
        self._driving_now = True
        try:
            yield
        finally:
            self._driving_now = False
            for module, forward in before:
                if forward is None:
                    module.__dict__.pop("forward", None)
                else:
                    module.forward = forward

    def _forward_elsewhere(self, module: nn.Module, fqn: str) -> None:
        """A sharded module's forward outside progress() (the user's own eval step, TorchRec's
        EvalPipelineSparseDist): the deferred gradients apply first, so it reads the tables
        TrainPipelineSparseDist would hold. A training step there (grad on, module training) while
        batches are in flight is refused: its update would land after their rows were fetched."""
        if self._driving_now or self._closed or self._failure is not None:
            return
        if self._batch is not None and module.training and torch.is_grad_enabled():
            raise RuntimeError(f"sharded module {fqn!r} ran a training forward outside TrainPipelinePEC.progress while "
                               "the pipeline holds batches in flight (their rows were fetched before any update "
                               "this step would make): train through progress(), evaluate under model.eval() or "
                               "torch.no_grad(), or close() the pipeline first")
        self.flush()

    def _tables_unchanged(self) -> None:
        """With batches in flight: fails the pipeline with TablesWrittenInPlace if someone else wrote
        the tables in place since its last update (_table_writes); its deferred gradients are then
        dropped, and its communicator closed so peers learn it at once instead of at their timeout."""
        if self._batch is None or self._closed or self._failure is not None:
            return
        try:
            self._exchange.tables.check()
        except TablesWrittenInPlace as e:
            self._failure = e
            self._comm.close()
            self._quiesce()
            raise

    def _check_loadable(self) -> None:
        """Loading state while batches are in flight would train them on rows fetched before the load,
        and apply gradients of batches before it to the loaded tables."""
        self._tables_unchanged()  # (torch.distributed.checkpoint.load wrote them already: say that)
        if self._batch is not None and not self._closed:
            raise RuntimeError("load_state_dict while TrainPipelinePEC holds batches in flight (their rows were "
                               "fetched, and gradients deferred, before the load): load before the first progress(), "
                               "after it raised StopIteration, or after close()")

    # -- the model's sharded modules call these during forward -------------------------------------
    def _forward_of(self, info: Any) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            kjt = args[0] if args else next(iter(kwargs.values()), None)
            expected = self._inputs.get(info.fqn)
            if expected is None:
                raise RuntimeError(f"sharded module {info.fqn!r} was called outside TrainPipelinePEC.progress")
            if kjt is not expected and not _same_input(kjt, expected):
                raise RuntimeError(f"sharded module {info.fqn!r} was called with an input that is not the one the "
                                   "pipeline read from the batch (other keys, samples or ids), whose rows it fetched: "
                                   "pass that input as it is read from the batch, or say where it is (sparse_inputs=)")
            out = module_output(info, kjt, *self._reads)
            plans = self._plans_now.get(info.fqn)
            return PlannedSequences(out, plans) if plans else out
        return forward

    # -- helpers -----------------------------------------------------------------------------------
    def _next_batch(self, dataloader_iter: Iterator[In]) -> Any:
        """The next batch as the dataloader made it (the worker copies it to the device: _route);
        None at the end; a _DataError if reading it failed (raised on the worker after every rank
        learned it, so no peer waits for this rank)."""
        try:
            return next(dataloader_iter)
        except StopIteration:
            return None
        except Exception as e:  # noqa: BLE001 - re-raised by _route
            return _DataError(e)

    def _route(self, batch: Optional[In], step: int) -> tuple[Any, dict[str, Any], Any]:
        """Worker: the batch on the device (or its MicroBatches; its inputs; its Asks), or Nones at the
        end of data."""
        if isinstance(batch, _DataError):
            raise batch.error
        if batch is None:
            return None, {}, None
        # the host-to-device copy runs here, on the worker's stream (as TorchRec's on its memcpy
        # stream): a pageable batch syncs that stream, never the compute stream, and the main thread
        # never waits for it; a pinned one copies while the main stream computes
        batch = batch.to(self._device, non_blocking=True) if hasattr(batch, "to") else batch
        inputs = self._read_inputs(batch)
        if self._micro_batches is None:
            return batch, inputs, route(self._catalog, inputs, step)
        split = cut(batch, inputs, self._catalog, self._micro_batches, self._read_inputs, self._split_batch)
        return split, {}, route_micro(self._catalog, split.inputs, step)

    def _post(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Runs fn on the worker (FIFO: program order) after everything this thread issued so far,
        on the device too; take its result with _join. The reference mode waits for it here."""
        mark = self._streams.posted()
        self._streams.cross(True, args, self._exchange)  # (_routed: the worker's alone; its batches came as args)
        future = self._worker.submit(self._streams.run, mark, fn, args)
        if self._blocking:
            concurrent.futures.wait([future])
        return future

    def _join(self, future: concurrent.futures.Future, phase: Optional[str] = None) -> Any:
        """A worker task's result; what this thread issues next runs after the task, on the device
        too. phase: the time blocked on it is exposed communication of that phase."""
        start = time.perf_counter()
        try:
            result, done = future.result()
        finally:
            if phase is not None:
                self._exposed[phase] += (time.perf_counter() - start) * 1e3
        self._streams.joined(done)
        self._streams.cross(False, result, self._exchange)
        return result

    def _announce(self, batch: Optional[In]) -> bool:
        """Worker: the first batch's counts. Whether it exists on every rank."""
        try:
            routed = self._route(batch, self._step)
        except Exception:
            _tell_peers(lambda: self._exchange.announce(None, failed=True))
            raise
        asks = routed[2]
        if batch is not None:
            self._routed.append(routed)
        return self._exchange.announce(asks)

    def _ask(self, following: Optional[In], step: int) -> tuple[In, dict[str, Any], bool, list[Plans]]:
        """Worker: the oldest routed batch's ids go out with the counts of `following` (batch
        `step`; None: out of data). Returns that batch, its inputs, whether `following` exists and,
        with balance=, its balance plans per micro-batch (made here: see _plans_ahead)."""
        batch, inputs, asks = self._routed.popleft()
        try:
            routed = self._route(following, step)
        except Exception:
            _tell_peers(lambda: self._exchange.ask(asks, None, failed=True))
            raise
        if following is not None:
            self._routed.append(routed)
        has_following = self._exchange.ask(asks, routed[2])
        split = batch if isinstance(batch, MicroBatches) else None
        plans = plan_ahead(self._comm, self._balancers, self._sequence_modules,
                           split.inputs if split else [inputs], split.host_lengths if split else None) \
            if self._sequence_modules else []
        return batch, inputs, has_following, plans

    def _blocked(self) -> float:
        """ms this thread has been blocked in the exchange's waits so far."""
        return self._exchange.blocked_ms[threading.get_ident()]

    def _round_on_this_thread(self, start: float, update: float, blocked: float, phase: str) -> float:
        """A round this thread ran since `start` (perf_counter s; `blocked`: _blocked() then): the
        time it blocked is exposed in `phase`; returns the rest, less `update` ms of fused update,
        this thread's own work for the round (ms)."""
        waited = self._blocked() - blocked
        self._exposed[phase] += waited
        return (time.perf_counter() - start) * 1e3 - update - waited

    # -- the TorchRec contract ---------------------------------------------------------------------
    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """Trains one batch (forward, backward, optimizer step) and returns its output."""
        if not self._progressing.acquire(blocking=False):  # the rounds' order is one thread's program order
            raise RuntimeError("progress() is already running on another thread: drive a TrainPipelinePEC from one "
                               "thread")
        try:
            return self._progress(dataloader_iter)
        finally:
            self._progressing.release()

    def _progress(self, dataloader_iter: Iterator[In]) -> Out:
        if self._closed:
            raise RuntimeError(f"the pipeline is closed ({self._closed_why})")
        if self._failure is not None:
            raise RuntimeError(f"TrainPipelinePEC failed at step {self._step} ({self._failure!r}); its tables may hold "
                               "a partial update: restore a checkpoint and build a new pipeline") from self._failure
        self._exposed = {"ids": 0.0, "embeddings": 0.0, "gradients": 0.0}
        if self._batch is None:  # nothing in flight: the tables as they are now are the ones to train
            self._exchange.tables.note()
        self._tables_unchanged()
        try:
            if self._batch is None:  # fill: batch 0's counts, its ids (with batch 1's counts), its rows
                if not self._join(self._post(self._announce, self._next_batch(dataloader_iter)), "ids"):
                    raise StopIteration
                first, inputs, self._has_next, self._plans = self._join(
                    self._post(self._ask, self._next_batch(dataloader_iter), self._step + 1), "ids")
                self._join(self._post(self._exchange.prepare), "embeddings")
                self._batch, self._inputs, self._asks = first, inputs, self._exchange.current[0]
                self._micro_rows = []  # the first batch's rows all came in prepare()
                self._asked_next = self._post(self._ask, self._next_batch(dataloader_iter), self._step + 2) \
                    if self._has_next else None  # batch 1's ids, batch 2's counts
            training = self._model.training
            lrs = {}
            if training:
                self._optimizer.zero_grad()  # sets each TBE's learning rate for this batch
                # read now, while no update runs on the worker (those pin an earlier batch's rate)
                lrs = {id(t): t.get_learning_rate() for t in self._exchange.tbes}
            has_next = self._has_next  # batch N+1 exists (agreed when its counts went out)
            trained_rows = sum(self._asks.sent(s).numel() for s in range(len(self._asks.rows)))
            fetched_rows = sum(sum(counts) for counts in self._asks.fresh_counts)
            if not has_next and not self._execute_all_batches:  # the data ran out: stop before training
                self._drain()
                raise StopIteration
            # after batch N+1's ids (one worker, FIFO)
            prepared = self._post(self._exchange.prepare) if has_next else None
            streamed: list[concurrent.futures.Future] = []  # earlier micro-batches' OL gradients, in flight
            if isinstance(self._batch, MicroBatches):
                output, grads = self._micro_steps(training, lrs, has_next, streamed)
            else:
                for piece in self._asks.pieces:
                    piece.requires_grad_(training)
                self._reads = (self._asks.pieces, self._asks.positions)
                self._plans_now = self._plans[0] if self._plans else {}
                with self._driving():
                    losses, output = self._model(self._batch)
                self._plans_now = {}
                grads = None
                if training:
                    torch.sum(losses, dim=0).backward()
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._asks.pieces]
            nxt, nxt_inputs, has_after, nxt_plans = None, {}, False, []
            if self._asked_next is not None:  # N+1's ids, N+2's counts: sent during the previous step
                nxt, nxt_inputs, has_after, nxt_plans = self._join(self._asked_next, "ids")
            if self._deferred_sent is not None:  # ran before it
                self._join(self._deferred_sent)
            if prepared is not None:
                self._join(prepared, "embeddings")
            # the worker is idle here (everything submitted was waited for): the gradient round trip
            # runs on this thread, no handoff; program order across ranks is unchanged
            in_flight = tuple(f for f in (self._join(future, "gradients") for future in streamed) if f is not None)
            start, updated, blocked = time.perf_counter(), self._exchange.update_ms, self._blocked()
            self._update_open = True
            self._exchange.gradients(grads, lrs, has_next, in_flight)
            self._update_open = False  # this rank's part is applied; the deferred rest goes on (flush)
            update = self._exchange.update_ms - updated  # this rank's own fused update: compute, not a wait
            rounds = self._round_on_this_thread(start, update, blocked, "gradients")
            if has_next and self._exchange.later is not None:
                # micro-batch 0's rows move on the worker while this thread applies the rest of the
                # update (rows micro-batch 0 does not read), before any later micro-batch's fetch
                first, updated = self._post(self._exchange.fetch_micro, 0), self._exchange.update_ms
                if not self._exchange.late_split_updates:  # (mutated: fetch_micro(1) applies it, late)
                    self._exchange.apply_later()
                update += self._exchange.update_ms - updated
                self._join(first, "embeddings")
            elif has_next:  # N+1's rows that waited for this update (with micro-batches: its first one's)
                start, blocked = time.perf_counter(), self._blocked()
                self._exchange.fetch_micro(0 if self._micro_batches is not None else None)
                rounds += self._round_on_this_thread(start, 0.0, blocked, "embeddings")
            # the next micro-batches' rows, in order, before anything of lower priority
            self._micro_rows = [None] + [self._post(self._exchange.fetch_micro, m)
                                         for m in range(1, self._micro_batches)] \
                if has_next and self._micro_batches is not None else []
            # not waited: posted under the optimizer step and the next forward; errors surface at the next wait
            self._deferred_sent = self._post(self._exchange.send_deferred)
            # N+2's ids with N+3's counts, under the optimizer step and the next forward
            self._asked_next = self._post(self._ask, self._next_batch(dataloader_iter), self._step + 3) \
                if has_after else None
            if training:
                self._optimizer.step()
        except StopIteration:
            raise
        except BaseException as e:
            self._failure = e
            if not isinstance(e, Exception):  # Ctrl-C, SystemExit: stop now (peers learn it), no waiting out a peer
                self._comm.close()
            self._quiesce()
            raise
        self.exposed_ms.append(sum(self._exposed.values()))
        self.rows_asked.append(trained_rows)
        self.rows_fetched.append(fetched_rows)
        self.update_ms.append(update)
        self.round_ms.append(rounds)
        self.exposed_by_phase.append(dict(self._exposed))
        self._step += 1
        if has_next:
            self._batch, self._inputs, self._asks = nxt, nxt_inputs, self._exchange.current[0]
            self._plans = nxt_plans
            self._has_next = has_after
        else:
            self._drain()
        return output

    def _micro_steps(self, training: bool, lrs: dict[int, float], has_next: bool,
                     streamed: list[concurrent.futures.Future]) -> tuple[Any, Optional[list[torch.Tensor]]]:
        """Batch N's micro-batches, forward and backward one after another, each once its rows are
        in, each but the last one's OL gradients posted (`streamed`) while the next computes;
        returns the merged output and, training, per slot the gradient of each asked row."""
        split: MicroBatches = self._batch
        last = len(split.batches) - 1
        outputs, micro_grads = [], []
        # per slot, each row's gradient summed over the micro-batches so far (a row sends one gradient
        # per batch, with the last micro-batch that reads it)
        totals = [torch.zeros_like(p) for p in self._asks.pieces] if training and self._asks.last is not None else []
        for m, batch in enumerate(split.batches):
            rows = self._micro_rows[m] if m < len(self._micro_rows) else None
            if rows is not None:
                self._join(rows, "embeddings")
            mine, reads = micro_leaves(self._asks, m, training)
            self._inputs, self._reads = split.inputs[m], (reads, self._asks.micro[m].positions)
            self._plans_now = self._plans[m] if m < len(self._plans) else {}
            with contextlib.ExitStack() as stack:
                if training and m < last:  # dense gradients accumulate; DDP syncs on the last (see _ddp)
                    for ddp in self._ddp:
                        stack.enter_context(ddp.no_sync())
                with self._driving():
                    losses, out = self._model(batch)
                if training:
                    loss = torch.sum(losses, dim=0)
                    if split.samples[m].numel() == 0:  # trains nothing (a mean over no samples is NaN,
                        loss = _NoGradient.apply(loss)  # and 0 x NaN too); backward still runs (DDP's hooks)
                    elif self._loss_scale:  # a mean over the micro-batch's samples: weigh it by its share
                        loss = loss * (split.samples[m].numel() / max(split.size, 1))
                    loss.backward()
            if training:
                micro_grads.append(accumulate_gradients(self._asks, totals, m, _grads_of(mine)))
            if training and m < last:  # after prepare(N+1) on the worker (its flags say which go first)
                self._update_open = True
                streamed.append(self._post(self._exchange.stream_gradients, m, micro_grads[-1], lrs, has_next))
            outputs.append(out)
        self._inputs, self._plans_now = {}, {}
        grads = None
        if training:  # per micro-batch, its entries' gradients (with several, each row's total so far)
            grads = micro_grads[0] if len(micro_grads) == 1 else \
                [torch.cat([g[s] for g in micro_grads]) for s in range(len(self._asks.rows))]
        if self._merge_output is not None:
            return self._merge_output(outputs, split.samples), grads
        return merge_outputs(outputs, split.samples, split.size), grads

    def _drain(self) -> None:
        """The data ran out: every update applied, the exchange forgets the batches. As
        TrainPipelineSparseDist's empty queue: the next progress() fills from the iterator it is
        given and raises StopIteration where that one has no batch, so a loop of a fixed count per
        epoch, on a new iterator each, trains every epoch."""
        self._join(self._post(self._exchange.reset), "gradients")
        self._batch, self._asks, self._inputs, self._asked_next = None, None, {}, None
        self._plans, self._plans_now = [], {}
        self._micro_rows = []
        self._has_next = False
        self._routed.clear()

    def _quiesce(self) -> None:
        """After a failure: waits until the worker has run (or failed) every task posted so far, so
        nothing it does races a checkpoint the caller takes next (it updates tables), on the device
        too (the main stream waits for the worker's). Bounded by the communicator's timeout: each
        task's peers posted it too, or fail with CommError."""
        try:
            self._worker.submit(lambda: None).result()
        except BaseException:  # noqa: BLE001 - the failure being raised says what went wrong
            pass
        self._streams.drain()

    def flush(self) -> None:
        """Applies the gradients PEC deferred (its last batch's, for rows the next batch does not
        read), so the tables and optimizer state are what TrainPipelineSparseDist would hold after
        the same steps. Local (every rank sent them already); runs by itself before the sharded
        modules' state_dict() and in close()."""
        if self._closed:
            return
        self._tables_unchanged()
        if self._failure is not None:
            self._flush_after_failure()
            return
        if self._deferred_sent is not None:
            self._join(self._deferred_sent)
        self._join(self._post(self._exchange.apply_deferred))

    def _flush_after_failure(self) -> None:
        """After a failure (an error, Ctrl-C): applies what is left of the last trained batch's update
        that needs no further message, so a checkpoint then holds that step's tables as
        TrainPipelineSparseDist's would; RuntimeError if part of an update cannot be applied (its
        gradient round was cut, its deferred gradients never arrived): the tables then match no step.
        Before, a checkpoint after Ctrl-C silently lacked the deferred gradients."""
        if self._failure_flushed or isinstance(self._failure, TablesWrittenInPlace):  # (the tables keep the write)
            return
        missing = "the gradient round of the batch it was training had begun" if self._update_open else None
        if missing is None:
            try:
                missing = self._join(self._post(self._exchange.apply_arrived))
            except Exception as e:  # noqa: BLE001 - said below
                missing = f"applying the deferred gradients failed ({e!r})"
        if missing is not None:
            raise RuntimeError(f"TrainPipelinePEC failed at step {self._step} ({self._failure!r}) with part of an update "
                               f"unapplied: {missing}. Its tables match no step of TrainPipelineSparseDist: restore "
                               "a checkpoint instead of saving this state") from self._failure
        self._failure_flushed = True

    def close(self) -> None:
        """Applies deferred gradients (flush), stops the worker and the communicator and gives the
        sharded modules their forward back. After a failure the communicator stops first, so a
        worker blocked on a peer returns at once."""
        if self._closed:
            return
        error: Optional[BaseException] = None  # what applying the updates hit (a dead peer): raised at the end
        if self._failure is None:
            try:
                self.flush()
            except BaseException as e:  # noqa: BLE001 - still release everything below
                self._failure = error = e
            for future in (self._asked_next, *self._micro_rows):  # read ahead, never to be trained: waited for,
                if future is not None and self._failure is None:  # their errors are not the tables'
                    try:
                        self._join(future)
                    except BaseException:  # noqa: BLE001
                        logger.debug("a read-ahead round failed while closing", exc_info=True)
        self._closed = True
        try:
            if self._failure is not None:
                self._comm.close()
                self._worker.shutdown(wait=True, cancel_futures=True)
            else:
                self._worker.shutdown(wait=True)
                self._comm.close()
            self._streams.drain()
        finally:  # the model is the user's again whatever happened above
            self._give_back_the_model()
        if error is not None:
            raise error

    def _give_back_the_model(self) -> None:
        """Removes every hook, wrapper and registry entry this pipeline put on the model."""
        for hook in self._hooks:
            hook.remove()
        for holder, name, method in self._wrapped:
            if vars(holder).get(name) is method:
                del vars(holder)[name]
        for info in self._catalog.modules:
            if _driver_of(info.module) is self:
                del _driven[info.module]
        for hooks in self._balanced:
            hooks.remove()


def _micro_batch_refusal(catalog: Any, micro_batches: Optional[int]) -> Optional[str]:
    """Why this rank's shards cannot take micro-batches, or None. Gradient clipping: micro-batches
    send each row's gradient summed over its uses, and FBGEMM clips what it is given, so the
    update would clip the sum where TrainPipelineSparseDist clips each use (a silently different
    training: weights ~1 % apart after 6 steps, row-wise Adagrad's state 13-29 %)."""
    if micro_batches is None:
        return None
    clipped = sorted({key[0] for key, shard in catalog.local.items()
                      if getattr(getattr(shard.tbe, "optimizer_args", None), "gradient_clipping", False)})
    if not clipped:
        return None
    return (f"micro_batches={micro_batches} with gradient clipping (tables {clipped}): micro-batches send each row's "
            "gradient summed over its uses and FBGEMM would clip that sum, where TrainPipelineSparseDist clips each "
            "use; pass micro_batches=None, or train without the fused optimizer's gradient_clipping")


def _agree(comm: Communicator, refusal: Optional[str], settings: dict[str, Any]) -> None:
    """One exchange at construction: ValueError on every rank if some rank refuses its own shards
    (`refusal`: why, on that rank), or naming the first of `settings` the ranks gave different
    values (each value's hash crosses)."""
    codes = [int(refusal is not None)] + [zlib.crc32(repr(value).encode()) for value in settings.values()]
    world = comm.world_size
    out = torch.empty(world * len(codes), dtype=torch.int64)
    comm.all_to_all_single(out, torch.tensor(codes * world, dtype=torch.int64))
    per_rank = out.view(world, len(codes)).tolist()
    refusing = [rank for rank, row in enumerate(per_rank) if row[0]]
    if refusal is not None:
        raise ValueError(refusal)
    if refusing:
        raise ValueError(f"ranks {refusing} cannot prioritize their own table shards (their own error says why): "
                         "every rank refuses the model")
    for i, (name, value) in enumerate(settings.items(), start=1):
        if len({row[i] for row in per_rank}) > 1:
            groups: dict[int, list[int]] = {}
            for rank, row in enumerate(per_rank):
                groups.setdefault(row[i], []).append(rank)
            raise ValueError(f"the ranks built TrainPipelinePEC with different {name} (ranks grouped by value: "
                             f"{sorted(groups.values())}; this rank, {comm.rank}: {value!r}): every rank must pass the "
                             "same, as every rank runs the same rounds")


def _balance_targets(model: nn.Module, balance: Optional[Mapping[str, CostModel]],
                     sharded: Mapping[str, nn.Module]) -> list[tuple[nn.Module, CostModel]]:
    """(submodule, cost model) per entry of `balance`; ValueError / TypeError naming a bad entry (a
    sharded module, or one holding one: balancing moves its ids, not the embeddings it outputs)."""
    if balance is None:
        return []
    if not isinstance(balance, Mapping):
        raise TypeError(f"balance must map submodule names to CostModels, got {type(balance).__name__}")
    targets = []
    for fqn, cost_model in balance.items():
        try:
            target = model.get_submodule(fqn)
        except AttributeError:
            raise ValueError(f"balance names {fqn!r}, which is not a submodule of the model") from None
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"balance[{fqn!r}] must be a freescale_comm.planner.CostModel, got {type(cost_model).__name__}")
        if getattr(target, "freescale_balance", None) is not None:
            raise ValueError(f"balance[{fqn!r}]: the module is already balanced by fc.balance")
        inside = [name for name in sharded if name == fqn or name.startswith(f"{fqn}.") or not fqn]
        if inside:
            raise ValueError(f"balance[{fqn!r}] holds the sharded module(s) {inside}: balance the module that takes "
                             "their output (e.g. the tower given the EmbeddingCollection's output), not them")
        targets.append((target, cost_model))
    return targets


def _same_input(kjt: Any, expected: Any) -> bool:
    """kjt is the input the pipeline read, rebuilt around the same tensors (a batch that builds its
    KeyedJaggedTensors on each read): same keys, samples, and the very values and lengths (or
    offsets) tensors; checked on the host, no device sync."""
    try:
        if type(kjt) is not type(expected) or kjt.keys() != expected.keys() or kjt.stride() != expected.stride():
            return False
        if not _same_tensor(kjt.values(), expected.values()):
            return False
        return any(a is not None and b is not None and _same_tensor(a, b)
                   for a, b in ((kjt.lengths_or_none(), expected.lengths_or_none()),
                                (kjt.offsets_or_none(), expected.offsets_or_none())))
    except (AttributeError, TypeError):
        return False


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)


def _grads_of(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each leaf's gradient (zeros where backward did not reach it)."""
    return [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]


class _NoGradient(torch.autograd.Function):
    """An empty micro-batch's loss: backward sends no gradient at all (not zeros: 0 x a NaN the loss
    holds is NaN), so no parameter's gradient changes, while every node below still runs (DDP's
    hooks fire; a collective in a backward, such as fc.balance's, still takes part)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        return None


class _DataError:
    """What reading a batch raised, carried to the worker that tells the peers before raising it."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _tell_peers(post: Callable[[], Any]) -> None:
    """Posts the message that makes every peer raise (CommError) instead of waiting for this rank;
    this rank raises its own error afterwards."""
    try:
        post()
    except Exception:  # noqa: BLE001 - the CommError every rank gets; this rank's own error follows
        pass


def _with_index(device: torch.device) -> torch.device:
    """cuda -> cuda:<current device>: the worker thread must use the same device as the caller."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device
