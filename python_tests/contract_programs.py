"""Rank functions: the same DMP model driven by TorchRec's TrainPipelineSparseDist and by
fc.TrainPipelinePEC through the patterns of a TorchRec training loop (epochs with
execute_all_batches=False, a train / eval / train loop, short dataloaders, a dataloader error then a
checkpoint, checkpoints mid-run whose optimizer state is read first, loading state, batches that
build their features on read); each returns what the two pipelines did."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import EvalPipelineSparseDist, TrainPipelineSparseDist
from torchrec.streamable import Pipelineable

import freescale_comm as fc
from pec_pipeline_programs import _rel, _state, build, make_batches



def _pipe(name: str, dmp, opt, **kwargs):
    if name == "sparse_dist":
        return TrainPipelineSparseDist(dmp, opt, torch.device("cpu"), **kwargs)
    return fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=dist.group.WORLD, **kwargs)


def _close(pipe) -> None:
    if hasattr(pipe, "close"):
        pipe.close()


def _diff(ref: dict, pec: dict) -> dict:
    """Worst differences of outputs (list of tensors) and state (dict of tensors)."""
    out = {"n_outputs": (len(ref["outputs"]), len(pec["outputs"]))}
    out["outputs"] = max((_rel(a, b) for a, b in zip(ref["outputs"], pec["outputs"])), default=0.0)
    out["state"] = {k: _rel(ref["state"][k], pec["state"][k]) for k in ref["state"] if k in pec["state"]}
    out["state_max"] = max(out["state"].values(), default=0.0)
    return out




def _epoch(pipe, feed) -> list:
    """progress(feed) until StopIteration, as a dataloader loop does: each step's output (a copy)."""
    outputs = []
    while True:
        try:
            outputs.append(pipe.progress(feed).clone())
        except StopIteration:
            return outputs


def no_execute_all_epochs(info, epochs: int, steps: int) -> dict:
    """Per pipeline: how many batches each epoch's loop trained (progress until StopIteration, a new
    iterator per epoch), with execute_all_batches=False."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(steps, world, 0.5, seed=3)
    out = {}
    for name in ("sparse_dist", "pec"):
        dmp, opt = build(dist.group.WORLD, "sgd")
        pipe = _pipe(name, dmp, opt, execute_all_batches=False)
        per_epoch = []
        for _ in range(epochs):
            per_epoch.append(len(_epoch(pipe, iter([b[rank] for b in batches]))))
        _close(pipe)
        out[name] = per_epoch
    return out


def train_eval_epochs(info, steps: int) -> dict:
    """TorchRec's DLRM example loop: a training epoch, an eval epoch (model.eval(), a new
    iterator), a training epoch, on one pipeline."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train = make_batches(steps, world, 0.5, seed=97)
    val = make_batches(steps // 2, world, 0.5, seed=98)
    runs = {}
    for name in ("sparse_dist", "pec"):
        dmp, opt = build(dist.group.WORLD, "rowwise_adagrad")
        pipe = _pipe(name, dmp, opt)
        outputs = []
        for data, mode in ((train, True), (val, False), (train, True)):
            dmp.train(mode)
            outputs += _epoch(pipe, iter([b[rank] for b in data]))
        runs[name] = {"outputs": outputs, "state": _state(dmp, opt)}
        _close(pipe)
    return _diff(runs["sparse_dist"], runs["pec"])



def fixed_count_epochs(info, epochs: int, steps: int) -> dict:
    """A loop of len(data) progress() calls per epoch on a new iterator each (StopIteration never
    reached), then an eval epoch to StopIteration. Before, the pipeline drained after each epoch's
    last batch and its next call raised StopIteration whatever iterator it got: every second
    epoch trained nothing and the eval epoch saw no batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train = make_batches(steps, world, 0.5, seed=71)
    val = make_batches(steps - 1, world, 0.5, seed=72)
    runs = {}
    for name in ("sparse_dist", "pec"):
        dmp, opt = build(dist.group.WORLD, "rowwise_adagrad")
        pipe = _pipe(name, dmp, opt)
        outputs = []
        for _ in range(epochs):
            feed = iter([b[rank] for b in train])
            outputs += [pipe.progress(feed).clone() for _ in range(len(train))]
        dmp.eval()
        outputs += _epoch(pipe, iter([b[rank] for b in val]))
        dmp.train()
        runs[name] = {"outputs": outputs, "state": _state(dmp, opt)}
        _close(pipe)
    return _diff(runs["sparse_dist"], runs["pec"])


def torchrec_eval_mid_epoch(info, steps: int) -> dict:
    """Half an epoch, an eval epoch through TorchRec's EvalPipelineSparseDist on the same model,
    the rest of the epoch, then an epoch on a new pipeline made without closing the last. Before:
    the eval read tables without the deferred gradients (1.6e-2 off, silently), the next
    progress() failed (TorchRec's rewritten forward had replaced the pipeline's), and a pipeline
    made after another refused ("already driven"). Also: a training forward outside progress()
    while batches are in flight is refused before any communication."""
    rank, world = dist.get_rank(), dist.get_world_size()
    train = make_batches(steps, world, 0.5, seed=41)
    val = make_batches(2, world, 0.5, seed=42)
    runs, refused = {}, None
    for name in ("sparse_dist", "pec"):
        dmp, opt = build(dist.group.WORLD, "sgd")
        pipe = _pipe(name, dmp, opt)
        feed = iter([b[rank] for b in train])
        outputs = [pipe.progress(feed).clone() for _ in range(steps // 2)]
        if name == "pec":
            try:
                dmp(val[0][rank])
            except RuntimeError as e:
                refused = str(e)
        dmp.eval()
        outputs += _epoch(EvalPipelineSparseDist(dmp, opt, torch.device("cpu")), iter([b[rank] for b in val]))
        dmp.train()
        outputs += _epoch(pipe, feed)
        last, pipe = pipe, _pipe(name, dmp, opt)  # the last one dropped, not closed
        if name == "pec":
            try:
                last.progress(iter([]))
            except RuntimeError as e:
                refused += f" | {e}"
        outputs += _epoch(pipe, iter([b[rank] for b in train]))
        runs[name] = {"outputs": outputs, "state": _state(dmp, opt)}
        _close(pipe)
    return {**_diff(runs["sparse_dist"], runs["pec"]), "refused": refused}


def short_loaders(info, lengths: list[int]) -> dict:
    """Per dataloader length (0, 1, 2...): two epochs, outputs and state compared."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for n in lengths:
        batches = make_batches(max(n, 1), world, 0.5, seed=61)[:n]
        runs = {}
        for name in ("sparse_dist", "pec"):
            dmp, opt = build(dist.group.WORLD, "rowwise_adagrad")
            pipe = _pipe(name, dmp, opt)
            outputs = []
            for _ in range(2):
                outputs += _epoch(pipe, iter([b[rank] for b in batches]))
            runs[name] = {"outputs": outputs, "state": _state(dmp, opt)}
            _close(pipe)
        out[n] = _diff(runs["sparse_dist"], runs["pec"])
    return out


def data_error_then_checkpoint(info, steps: int, bad: int, slow_worker_s: float = 0.0) -> dict:
    """Every rank's dataloader raises OSError when batch `bad` is read. The user catches it and
    takes a checkpoint (model state_dict, optimizer state): both pipelines' checkpoints compared,
    and what each raised. slow_worker_s: the PEC worker's deferred updates take that much longer
    (a busy device, a loaded host): the timing the checkpoint must not depend on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(steps, world, 0.5, seed=13)
    runs, raised = {}, {}
    for name in ("sparse_dist", "pec"):
        dmp, opt = build(dist.group.WORLD, "rowwise_adagrad")
        pipe = _pipe(name, dmp, opt)
        if name == "pec" and slow_worker_s:
            import threading
            import time

            apply = pipe._exchange.apply_deferred

            def slow_apply():
                if threading.current_thread().name.startswith("freescale-pec"):
                    time.sleep(slow_worker_s)
                apply()
            pipe._exchange.apply_deferred = slow_apply

        def feed_of():
            for i, b in enumerate(batches):
                if i == bad:
                    raise OSError("corrupt shard")
                yield b[rank]

        feed = feed_of()
        outputs = []
        try:
            while True:
                outputs.append(pipe.progress(feed).clone())
        except StopIteration:
            raised[name] = "StopIteration"
        except Exception as e:  # noqa: BLE001
            raised[name] = type(e).__name__
        runs[name] = {"outputs": outputs, "state": _state(dmp, opt)}
        _close(pipe)
    return {**_diff(runs["sparse_dist"], runs["pec"]), "raised": raised}


def _state_optimizer_first(dmp, opt) -> dict:
    """_state, but the optimizer's state_dict() read before the model's."""
    from pec_pipeline_programs import _local
    out = {}
    for param, state in opt.state_dict()["state"].items():
        for k, v in state.items():
            out[f"state:{param}:{k}"] = _local(v).clone()
    out.update({f"weight:{k}": _local(v).clone() for k, v in dmp.state_dict().items()})
    return out


def optimizer_state_mid_run(info, steps: int, stop_after: int) -> dict:
    """A checkpoint after `stop_after` steps whose code saves the optimizer first
    ({"optim": opt.state_dict(), "model": model.state_dict()}): compared with TorchRec's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(steps, world, 0.5, seed=77)
    runs = {}
    for name in ("sparse_dist", "pec"):
        dmp, opt = build(dist.group.WORLD, "rowwise_adagrad")
        pipe = _pipe(name, dmp, opt)
        feed = iter([b[rank] for b in batches])
        outputs = [pipe.progress(feed).clone() for _ in range(stop_after)]
        runs[name] = {"outputs": outputs, "state": _state_optimizer_first(dmp, opt)}
        _close(pipe)
    return _diff(runs["sparse_dist"], runs["pec"])


class PropertyBatch(Pipelineable):
    """A Pipelineable-style batch keeping plain tensors and building its KeyedJaggedTensors on each
    read (a property), as batches made from dense columns often do."""

    def __init__(self, pooled, sequence, label) -> None:
        self._p = (pooled.keys(), pooled.values(), pooled.lengths())
        self._s = (sequence.keys(), sequence.values(), sequence.lengths())
        self.label = label

    @property
    def pooled(self):
        from torchrec import KeyedJaggedTensor
        keys, values, lengths = self._p
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)

    @property
    def sequence(self):
        from torchrec import KeyedJaggedTensor
        keys, values, lengths = self._s
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)

    def to(self, device, non_blocking: bool = False) -> "PropertyBatch":
        return self

    def record_stream(self, stream) -> None:
        pass

    def pin_memory(self) -> "PropertyBatch":
        return self


def property_batches(info, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(steps, world, 0.5, seed=95)
    runs, errors = {}, {}
    for name in ("sparse_dist", "pec"):
        dmp, opt = build(dist.group.WORLD, "sgd")
        pipe = _pipe(name, dmp, opt)
        feed = iter([PropertyBatch(b[rank].pooled, b[rank].sequence, b[rank].label) for b in batches])
        outputs = []
        try:
            outputs = [pipe.progress(feed).clone() for _ in range(steps)]
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {e}"
        runs[name] = {"outputs": outputs, "state": _state(dmp, opt)}
        _close(pipe)
    return {**_diff(runs["sparse_dist"], runs["pec"]), "errors": errors}


def load_state(info, steps: int, save_at: int, load_mid_run_at: int) -> dict:
    """The model's state saved after `save_at` steps; loading it after `load_mid_run_at` steps (PEC:
    refused, batches in flight; TorchRec: loaded); then at the end of the epoch (StopIteration)
    loaded by both, and a second epoch trained: outputs and final state compared, and what the
    mid-run load raised."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(steps, world, 0.5, seed=23)
    runs, refused = {}, {}
    for name in ("sparse_dist", "pec"):
        dmp, opt = build(dist.group.WORLD, "sgd")
        pipe = _pipe(name, dmp, opt)
        outputs, saved = [], None
        for epoch in range(2):
            feed = iter([b[rank] for b in batches])
            while True:
                if epoch == 0 and len(outputs) == save_at:
                    saved = copy.deepcopy(dmp.state_dict())
                if epoch == 0 and len(outputs) == load_mid_run_at and name == "pec":
                    try:
                        dmp.load_state_dict(saved)
                        refused[name] = None
                    except RuntimeError as e:
                        refused[name] = str(e)
                    try:
                        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                        refused["optimizer"] = None
                    except RuntimeError as e:
                        refused["optimizer"] = str(e)
                try:
                    outputs.append(pipe.progress(feed).clone())
                except StopIteration:
                    break
            if epoch == 0:
                dmp.load_state_dict(saved)  # between epochs: nothing in flight
        runs[name] = {"outputs": outputs, "state": _state(dmp, opt)}
        _close(pipe)
    return {**_diff(runs["sparse_dist"], runs["pec"]), "refused": refused}


def load_through_the_inner_module(info, steps: int) -> dict:
    """dmp.module.load_state_dict mid-run, on a model whose dense head comes before its sharded
    modules: refused before anything loads. Before, the head had loaded when the sharded modules'
    hooks refused (a half-loaded model), as only they and the DMP wrapper were guarded."""
    from pec_pipeline_programs import Model

    class HeadFirst(Model):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._modules = {"head": self._modules["head"], **self._modules}  # (a plain dict)

    rank, world = dist.get_rank(), dist.get_world_size()
    dmp, opt = build(dist.group.WORLD, "sgd", model_cls=HeadFirst)
    pipe = _pipe("pec", dmp, opt)
    feed = iter([b[rank] for b in make_batches(steps, world, 0.5, seed=29)])
    for _ in range(2):
        pipe.progress(feed)
    state = dmp.module.state_dict()
    head = [k for k in state if k.startswith("head.")]
    before = {k: state[k].clone() for k in head}
    changed = {k: v + 1 for k, v in before.items()}
    try:
        dmp.module.load_state_dict({**state, **changed})
        refused = None
    except RuntimeError as e:
        refused = str(e)
    after = dmp.module.state_dict()
    pipe.close()
    return {"refused": refused, "head_keys": len(head),
            "head_changed": [k for k in head if not torch.equal(after[k], before[k])]}


def _pec_threads_left(within_s: float = 5.0) -> list[str]:
    """The pipeline worker threads still alive once none is left or `within_s` passed (a worker ends
    once its executor is collected or shut down)."""
    import threading

    def alive() -> list[str]:
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("freescale-pec"))
    for _ in range(int(within_s / 0.05)):
        if not alive():
            break
        threading.Event().wait(0.05)
    return alive()


def dropped_pipelines(info, steps: int) -> dict:
    """A pipeline dropped mid-epoch without close(), then an epoch on a new one: as TorchRec's (the
    dropped one's read-ahead never trains; its deferred gradients apply). Before, the new one was
    refused ("already driven ... close() that one first": the old one, kept alive by its hooks, could
    not be reached). Then a pipeline trained to StopIteration and dropped with its model, unclosed:
    both are freed and its worker thread ends (before, the module registry held the pipeline, and
    through it the model, for the life of the process)."""
    import gc
    import weakref

    rank, world = dist.get_rank(), dist.get_world_size()
    train = make_batches(steps, world, 0.5, seed=61)
    runs = {}
    for name in ("sparse_dist", "pec"):
        dmp, opt = build(dist.group.WORLD, "rowwise_adagrad")
        pipe = _pipe(name, dmp, opt)
        feed = iter([b[rank] for b in train])
        outputs = [pipe.progress(feed).clone() for _ in range(steps // 2)]
        del pipe  # mid-epoch, not closed
        pipe = _pipe(name, dmp, opt)
        outputs += _epoch(pipe, iter([b[rank] for b in train]))
        runs[name] = {"outputs": outputs, "state": _state(dmp, opt)}
        _close(pipe)
    out = _diff(runs["sparse_dist"], runs["pec"])
    dmp, opt = build(dist.group.WORLD, "sgd")
    pipe = _pipe("pec", dmp, opt)
    out["trained"] = len(_epoch(pipe, iter([b[rank] for b in train])))
    model = weakref.ref(dmp)
    del dmp, opt, pipe  # not closed
    gc.collect()
    out["model_freed"] = model() is None
    out["pec_threads"] = _pec_threads_left()  # its worker ends once its executor is collected
    return out


def constructor_failure(info, steps: int) -> dict:
    """The constructor failing late (here: wrapping the optimizer's state_dict), after the communicator,
    the worker and the module hooks were made: the error comes out, no pipeline thread stays, no hook
    stays on the model, and a new pipeline builds and trains. Before, the hooks stayed on the model
    and its registry named the half-built pipeline, which the next one then failed to close."""
    from freescale_comm.pipelines import pec_pipeline

    def hooks(model) -> int:
        return sum(len(m._forward_pre_hooks) + len(m._state_dict_pre_hooks) + len(m._load_state_dict_pre_hooks)
                   for m in model.modules())

    rank, world = dist.get_rank(), dist.get_world_size()
    dmp, opt = build(dist.group.WORLD, "sgd")
    hooks_before = hooks(dmp)
    real = pec_pipeline.TrainPipelinePEC._wrap

    def failing_wrap(*args, **kwargs):
        raise RuntimeError("wrap failed")
    pec_pipeline.TrainPipelinePEC._wrap = failing_wrap
    try:
        fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=dist.group.WORLD)
        raised = None
    except RuntimeError as e:
        raised = str(e)
    finally:
        pec_pipeline.TrainPipelinePEC._wrap = real
    out = {"raised": raised, "threads": _pec_threads_left(),
           "hooks_left": hooks(dmp) - hooks_before}
    try:
        pipe = _pipe("pec", dmp, opt)
        out["trained"] = len(_epoch(pipe, iter([b[rank] for b in make_batches(steps, world, 0.5, seed=31)])))
        pipe.close()
    except Exception as e:  # noqa: BLE001 - reported
        out["trained"] = f"{type(e).__name__}: {e}"
    return out


def training_loop_patterns(info) -> dict:
    """Each pattern on 2 ranks, tiny model, few steps (see the functions above)."""
    return {"epochs": no_execute_all_epochs(info, 3, 4), "train_eval_train": train_eval_epochs(info, 4),
            "short_loaders": short_loaders(info, [0, 1, 2]),
            "data_error": data_error_then_checkpoint(info, 8, 3, 0.5),
            "optimizer_first": optimizer_state_mid_run(info, 8, 5), "load": load_state(info, 6, 2, 3),
            "property_batches": property_batches(info, 3), "fixed_count": fixed_count_epochs(info, 3, 3),
            "torchrec_eval": torchrec_eval_mid_epoch(info, 4), "dropped": dropped_pipelines(info, 4),
            "inner_load": load_through_the_inner_module(info, 4), "ctor_failure": constructor_failure(info, 3)}
