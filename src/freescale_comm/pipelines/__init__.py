"""TorchRec train pipelines that put FreeScale's policies into a user's DistributedModelParallel
model (imports torchrec lazily: only these need it)."""

from freescale_comm.pipelines.pec_pipeline import TrainPipelinePEC

__all__ = ["TrainPipelinePEC"]
