"""TrainPipelinePEC with TorchRec's fused Adam, on a GPU (skipped without CUDA; gpu checklist item
9): FBGEMM has no CPU Adam, so CI cannot train it. Adam reads the TBE's step counter, so each part
of a batch's update (the gradients that go first, the deferred ones applied during the next batch)
must run at that batch's counter: equal to TrainPipelineSparseDist within 1e-6 (the CUDA TBE's
backward sums a row's gradients in its own order), far below the ~1e-2 a wrong counter gives."""

import pytest
import torch

from freescale_comm.testing import spawn

import pec_pipeline_programs

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_adam_matches_sparse_dist_on_cuda():
    (report,) = spawn(pec_pipeline_programs.adam_on_cuda, 1, 8, [0.0, 0.5, 1.0], backend="nccl", timeout_s=600)
    for collision, case in report.items():
        assert case["moments"] > 0, f"collision {collision}: Adam kept no state"
        assert case["outputs"] <= 1e-6, (collision, case["outputs"])
        worst = max(case["state"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, (collision, worst)
