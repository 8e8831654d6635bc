"""Rank programs: TrainPipelinePEC's failures (test_pipeline_failures.py).

Each rank trains the small PEC pipeline model of pec_pipeline_programs on 2 ranks; one rank (the
victim) fails in a chosen way; every rank reports what it saw: the exception's type, code (CommError),
message, how long the failing call took, what close() did, and which pipeline threads are still alive.
The communicator's timeout is FREESCALE_TIMEOUT_S (set here, before the pipeline's Communicator)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DataParallelWrapper

import freescale_comm as fc
from pec_pipeline_programs import build, make_batches

VICTIM = 1

_CALLS = {"n": 0, "raise_at": -1}  # forwards run in this process; the one that raises Ctrl-C


@torch.fx.wrap  # a leaf under TorchRec's tracing: it runs in the real forward only
def _interrupted_at(label: torch.Tensor) -> torch.Tensor:
    _CALLS["n"] += 1
    if _CALLS["n"] == _CALLS["raise_at"]:
        raise KeyboardInterrupt(f"Ctrl-C in forward on rank {dist.get_rank()}")
    return label


class _NoWrap(DataParallelWrapper):
    """No DDP around the dense part: a survivor's backward must not wait in gloo for the victim (torch's
    own all-reduce, not the pipeline's), so what the survivor sees is the pipeline's."""

    def wrap(self, dmp, env, device) -> None:  # noqa: D401
        return None


def build_no_ddp(pg: dist.ProcessGroup) -> tuple:
    return build(pg, "sgd", data_parallel_wrapper=_NoWrap())


def _pec_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("freescale-pec") and t.is_alive()]


def _report(e: Optional[BaseException], elapsed: float) -> dict:
    if e is None:
        return {"error": None, "elapsed": elapsed}
    return {"error": type(e).__name__, "code": getattr(e, "code", None), "culprit": getattr(e, "culprit", None),
            "msg": str(e)[:600], "elapsed": round(elapsed, 2)}


def _close(pipe: Any) -> dict:
    start = time.monotonic()
    try:
        pipe.close()
        err = None
    except BaseException as e:  # noqa: BLE001 - reported
        err = e
    out = _report(err, time.monotonic() - start)
    out["failure_kept"] = repr(getattr(pipe, "_failure", None))[:300]
    time.sleep(0.2)
    out["threads_after_close"] = _pec_threads()
    return out


def _train(pipe: Any, feed, steps: int) -> tuple[Optional[BaseException], float, int]:
    """Up to `steps` progress() calls; returns the exception (None: all ran), how long the failing call
    took (s) and how many steps completed."""
    done = 0
    for _ in range(steps):
        start = time.monotonic()
        try:
            pipe.progress(feed)
        except StopIteration:
            return None, 0.0, done
        except BaseException as e:  # noqa: BLE001 - reported
            return e, time.monotonic() - start, done
        done += 1
    return None, 0.0, done


def scenario(info, name: str, timeout_s: float = 10.0, steps: int = 6, sigints: tuple = (2.0,)) -> dict:
    """die_before_close, sigint_blocked, raise_split, two_threads: see test_pipeline_failures."""
    os.environ["FREESCALE_TIMEOUT_S"] = str(timeout_s)
    pg = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    victim = rank == VICTIM
    batches = make_batches(steps + 2, world, 0.5, seed=3)
    mine = [b[rank] for b in batches]
    dmp, opt = build_no_ddp(pg)
    kwargs: dict = {}
    if name == "raise_split":
        kwargs["micro_batches"] = 2
        from freescale_comm.pipelines._micro_batches import select_samples
        seen = [0]

        def split(batch, samples):
            if victim and samples.numel() and seen[0] >= 8:
                raise ValueError("split_batch failed on purpose")
            seen[0] += 1
            from dmp_programs import Batch
            return Batch(select_samples(batch.pooled, samples), select_samples(batch.sequence, samples),
                         batch.label[samples])
        kwargs["split_batch"] = split
    pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, **kwargs)
    feed = iter(mine)
    out: dict = {"rank": rank}

    if name == "die_before_close" and victim:
        send = pipe._exchange.send_deferred
        count = [0]

        def dying_send():
            count[0] += 1
            if count[0] == 3:  # the third step's deferred gradients never leave: the victim dies
                time.sleep(2.0)
                os._exit(7)
            return send()
        pipe._exchange.send_deferred = dying_send

    if name == "die_before_close":
        e, elapsed, done = _train(pipe, feed, 3)
        if victim:
            time.sleep(30)  # its worker exits the process
        out["before_close"] = _report(e, elapsed)
        out["close"] = _close(pipe)
        return out
    elif name == "sigint_blocked":
        # the victim's dataloader is slow (longer than the timeout would be worth waiting): rank 0 is
        # blocked waiting for it and gets Ctrl-C 2 s in; KeyboardInterrupt should leave progress() at once
        def slow_feed():
            for k, b in enumerate(mine):
                if victim and k == 4:
                    time.sleep(timeout_s * 2)
                yield b
        feed = slow_feed()
        if not victim:
            e, elapsed, done = _train(pipe, feed, 2)
            quiesce, marks = pipe._quiesce, {}

            def timed_quiesce():
                marks["quiesce_entered"] = round(time.monotonic() - t0, 2)
                try:
                    return quiesce()
                finally:
                    marks["quiesce_left"] = round(time.monotonic() - t0, 2)
            pipe._quiesce = timed_quiesce
            t0 = time.monotonic()
            for at in sigints:  # Ctrl-C (and again, as a user does when the first seems ignored)
                threading.Timer(at, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
            e, elapsed, done = _train(pipe, feed, steps)
            out["raised_after"] = round(time.monotonic() - t0, 2)
            out.update(marks)
            out["done"] = done
        else:
            e, elapsed, done = _train(pipe, feed, steps)
    elif name == "two_threads":
        errors: list = []

        def run():
            try:
                for _ in range(steps):
                    pipe.progress(feed)
            except StopIteration:
                pass
            except BaseException as ex:  # noqa: BLE001 - reported
                errors.append(ex)
        start = time.monotonic()
        if victim:
            threads = [threading.Thread(target=run) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout_s * 4)
            out["hung_threads"] = sum(t.is_alive() for t in threads)
        else:
            run()
        e, elapsed = (errors[0] if errors else None), time.monotonic() - start
        out["all_errors"] = [f"{type(x).__name__}: {str(x)[:300]}" for x in errors]
    else:
        e, elapsed, done = _train(pipe, feed, steps)
        out["done"] = done
    out["progress"] = _report(e, elapsed)
    out["close"] = _close(pipe)
    return out


def disagreeing_arguments(info) -> dict:
    """Per argument, the victim builds the pipeline with another value than rank 0 (each of which
    works alone): what each rank's construction raised. Then both agree and one step trains."""
    from freescale_comm.planner import CostModel
    from pec_pipeline_programs import BalancedModel, build

    pg = dist.group.WORLD
    victim = dist.get_rank() == VICTIM
    dmp, opt = build(pg, "sgd", BalancedModel)
    tower = {"tower": CostModel(quadratic=1.0, linear=0.0, constant=1.0)}
    cases = {"micro_batches": ({"micro_batches": 2}, {}), "prefetch": ({"prefetch": "dual_buffer"}, {}),
             "balance": ({"balance": tower}, {}), "execute_all_batches": ({"execute_all_batches": False}, {}),
             "low_priority": ({"low_priority": 5}, {})}
    out = {}
    for name, (theirs, mine) in cases.items():
        try:
            fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, **(theirs if victim else mine)).close()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    pipe = fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=pg, micro_batches=2)
    batches = make_batches(2, dist.get_world_size(), 0.5, seed=3)
    out["trained"] = float(pipe.progress(iter([b[dist.get_rank()] for b in batches])).sum())
    pipe.close()
    return out


def ctrl_c_in_forward(info, at_step: int) -> dict:
    """Both ranks get Ctrl-C in the forward of step `at_step` (as torchrun delivers SIGINT), then read
    the model's state for a checkpoint: TrainPipelineSparseDist's holds every trained step's update;
    PEC's must equal it, or refuse (RuntimeError) where part of an update could not be applied.
    Before, it silently lacked the last trained batch's deferred gradients."""
    from pec_pipeline_programs import Model, _rel, _state

    class Interrupted(Model):
        def forward(self, batch):
            loss, logits = super().forward(batch)
            return loss + 0 * _interrupted_at(batch.label).sum(), logits

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(at_step + 2, world, 0.5, seed=13)
    states = {}
    for name in ("sparse_dist", "pec"):
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        dmp, opt = build(dist.group.WORLD, "sgd", model_cls=Interrupted, data_parallel_wrapper=_NoWrap())
        pipe = TrainPipelineSparseDist(dmp, opt, torch.device("cpu")) if name == "sparse_dist" else \
            fc.TrainPipelinePEC(dmp, opt, torch.device("cpu"), group=dist.group.WORLD)
        _CALLS.update(n=0, raise_at=at_step + 1)
        error, _, trained = _train(pipe, iter([b[rank] for b in batches]), at_step + 2)
        assert isinstance(error, KeyboardInterrupt) and trained == at_step, (name, error, trained)
        try:
            states[name] = _state(dmp, opt)
        except RuntimeError as e:
            states[name] = str(e)
        if name == "pec":
            pipe.close()
    pec = states["pec"]
    if isinstance(pec, str):
        return {"pec": "refused" if "part of an update unapplied" in pec else pec}
    worst = max(_rel(states["sparse_dist"][k], pec[k]) for k in states["sparse_dist"])
    return {"pec": "equal" if worst == 0.0 else f"differs by {worst:.3g}"}
