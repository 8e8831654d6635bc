"""fc.TrainPipelinePEC on sharding plans, models and data beyond test_pec_pipeline.py's: each case
trains the same DMP model with TrainPipelineSparseDist and TrainPipelinePEC on the same batches
(plans_programs.compare) and wants equal outputs, weights and optimizer state, or a clear
ValueError at construction on every rank. Tiny tables, few steps; one spawn per rank count."""

from __future__ import annotations

import copy

import pytest

from freescale_comm.testing import spawn

pytestmark = pytest.mark.usefixtures("torchrec_installed")


def T(name, rows=10, dim=4, features=None, plan=("tw", 0), pooling="SUM"):
    return {"name": name, "rows": rows, "dim": dim, "features": features or [f"{name}_f"], "plan": list(plan),
            "pooling": pooling}


def ebc(*tables):
    return {"kind": "ebc", "tables": list(tables)}


def ec(*tables):
    return {"kind": "ec", "tables": list(tables)}


BASE = [ebc(T("p", plan=("rw",)), T("q", features=["q1", "q2"], plan=("tw", 1)), T("r", plan=("cw", [0, 1]))),
        ec(T("s", plan=("rw",)), T("u", features=["u1", "u2"], plan=("tw", 0)), T("v", plan=("cw", [1, 0])))]


def test_what_the_pipeline_cannot_serve_is_refused_on_every_rank():
    """Quantized embedding comms (qcomm_codecs_registry) and float16 lookups (output_dtype) were
    trained in float32, silently; a FeatureProcessedEmbeddingBagCollection was refused as "not in
    the sharding plan". Now each is a ValueError naming the module or table and why; float16
    lookups only rank 0's tables show (every table on rank 0) are refused on rank 1 too."""
    from fbgemm_gpu.split_embedding_configs import SparseType

    from plans_programs import many

    qcomm = {"modules": BASE, "qcomm": ("FP16", "FP16")}
    fp16 = {"modules": [ebc(T("p", plan=("tw", 0))), ec(T("s", plan=("tw", 0)))],
            "fused_extra": {"output_dtype": SparseType.FP16}}
    for rank, (quantized, half, weighted) in enumerate(spawn(many, 2, [
            ("construct_error", (qcomm,)), ("construct_error", (fp16,)), ("fp_ebc_refusal", ())], timeout_s=300)):
        assert quantized.startswith("ValueError") and "quantized comms" in quantized and "'m0'" in quantized, quantized
        assert half.startswith("ValueError"), half
        if rank == 0:
            assert "table 'p' in 'm0'" in half and "FP16" in half, half
        else:
            assert "ranks [0] cannot prioritize" in half, half
        assert weighted.startswith("ValueError") and "weighted" in weighted and "t_fp" in weighted, weighted


def _replanned(spec, plan):
    out = copy.deepcopy(spec)
    for m in out["modules"]:
        for t in m["tables"]:
            t["plan"] = list(plan)
    return out


# name -> (spec, reference spec or None (the same), tolerance); the state is compared where both use one plan
TWO_RANKS = {
    # column-wise in 4 shards on 2 ranks (each rank twice)
    "cw_4_shards": ({"modules": [ebc(T("p", rows=6, dim=8, plan=("cw", [0, 1, 0, 1]))),
                                 ec(T("s", rows=6, dim=8, plan=("cw", [1, 1, 0, 0])))], "optimizer": "adagrad"}, None, 0.0),
    # every table on rank 0: rank 1 owns nothing
    "tw_all_on_0": ({"modules": [ebc(T("p", plan=("tw", 0)), T("q", plan=("tw", 0))), ec(T("s", plan=("tw", 0)))],
                     "optimizer": "rowwise_adagrad"}, None, 0.0),
    # several EBCs / ECs, tables named alike in different modules, shared tables, one KJT for all
    "many_modules": ({"modules": [ebc(T("t", features=["a", "b"], plan=("rw",))),
                                  ec(T("t", features=["a", "c"], plan=("cw", [1, 0]))),
                                  ebc(T("t2", features=["c"], plan=("tw", 1)), T("t3", dim=12, plan=("tw", 1)))],
                      "inputs": [0, 0, 0], "optimizer": "rowwise_adagrad"}, None, 0.0),
    # ids repeated within bags, every rank's KJTs empty at steps 0, 2, 4, KJT keys in another order
    "repeats_and_empty": ({"modules": BASE, "optimizer": "adagrad", "steps": 5, "max_len": 6,
                           "empty_steps": [0, 2, 4], "kjt_order": "reversed", "extra_key": True}, None, 0.0),
    # 10^6 rows, a few ids at the shard edges
    "large_ids": ({"modules": [ebc(T("p", rows=10**6, plan=("rw",)), T("q", rows=10**6, plan=("cw", [0, 1]))),
                               ec(T("s", rows=10**6, plan=("rw",)))], "optimizer": "rowwise_adagrad",
                   "id_pool": {"p_f": [0, 499999, 500000, 999999], "q_f": [7, 999999], "s_f": [3, 500001]}}, None, 0.0),
}
for _form in ("int32", "offsets_int32", "noncontig", "padded"):  # KJT forms against plain int64 lengths
    _spec = {"modules": BASE, "optimizer": "rowwise_adagrad", "transform": _form}
    TWO_RANKS[f"kjt_{_form}"] = (_spec, {k: v for k, v in _spec.items() if k != "transform"}, 0.0)
# plans TorchRec 1.8 on CPU crashes on, against the same tables table-wise (tables filled alike)
_FILLED = {"weights": "row_col", "optimizer": "sgd", "max_len": 4}
for _name, _modules in (("rw_one_row", [ebc(T("p", rows=1, plan=("rw",))), ec(T("s", rows=1, plan=("rw",)))]),
                        ("cw_uneven_columns", [ebc(T("p", dim=12, plan=("cwsz", [4, 8]))),
                                               ec(T("s", dim=12, plan=("cwsz", [8, 4])))])):
    _spec = dict(_FILLED, modules=_modules)
    TWO_RANKS[_name] = (_spec, _replanned(_spec, ("tw", 1)), 1e-6)

THREE_RANKS = {
    # uneven row-wise shards (10 rows: 4, 4, 2), a table on rank 2 only
    "rw_uneven_3": ({"modules": [ebc(T("p", rows=10, plan=("rw",)), T("q", rows=7, plan=("tw", 2))),
                                 ec(T("s", rows=11, plan=("rw",)), T("u", rows=5, plan=("cw", [2, 0])))],
                     "optimizer": "rowwise_adagrad", "steps": 5}, None, 1e-6),
    # 3 column shards on 3 ranks, out of rank order
    "cw_3_shards_3": ({"modules": [ebc(T("p", rows=6, dim=12, plan=("cw", [2, 0, 1]))),
                                   ec(T("s", rows=6, dim=12, plan=("cw", [1, 2, 0])))],
                       "optimizer": "rowwise_adagrad"}, None, 0.0),
}
_spec = dict(_FILLED, modules=[ebc(T("p", rows=4, plan=("rw",))), ec(T("s", rows=4, plan=("rw",)))])
THREE_RANKS["rw_zero_row_shard"] = (_spec, _replanned(_spec, ("tw", 1)), 1e-6)  # a rank's shard has 0 rows


@pytest.mark.parametrize("world,cases", [(2, TWO_RANKS), (3, THREE_RANKS)], ids=["two_ranks", "three_ranks"])
def test_odd_plans_train_as_sparse_dist(world, cases):
    from plans_programs import many

    calls = [("compare", (dict({"steps": 4}, **spec), None, ref)) for spec, ref, _ in cases.values()]
    for reports in spawn(many, world, calls, timeout_s=600):
        for (name, (spec, ref, tol)), report in zip(cases.items(), reports):
            assert "pec_error" not in report and "sparse_dist_error" not in report, (name, report)
            same_plan = ref is None or ref["modules"] == spec["modules"]
            assert report["outputs"] <= tol and (not same_plan or report["worst_state"] <= tol), \
                (name, report["outputs"], {k: v for k, v in report["state"].items() if v > tol})


def test_mixed_sum_and_mean_pooling_by_hand():
    """One EBC with SUM and MEAN tables on every sharding (3 ranks, uneven shards), tables filled
    with their row index: each bag pools to the sum / mean of its ids (TorchRec 1.8 on CPU divides
    table- and column-wise MEAN bags, and a mixed EBC's table-wise SUM bags, by their length)."""
    from plans_programs import mean_by_hand

    spec = {"modules": [ebc(T("p", plan=("tw", 2), pooling="MEAN"), T("q", dim=12, plan=("cw", [2, 0, 1]), pooling="MEAN"),
                            T("r", rows=7, plan=("rw",), pooling="MEAN"), T("s", plan=("tw", 1)),
                            T("w", rows=8, plan=("rw",)))], "steps": 3, "max_len": 5}
    for worst in spawn(mean_by_hand, 3, spec, timeout_s=300):
        assert "error" not in worst, worst
        assert all(v <= 1e-5 for v in worst.values()), worst
