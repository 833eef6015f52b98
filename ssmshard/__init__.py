"""ssmshard: capture Hugging Face SSM, hybrid and Llama-style models as FX programs and rewrite them."""

from . import comm, ops  # noqa: F401  (register torch.ops.ssmshard.*)
from . import passes
from .capture import capture
from .families import FAMILIES, build_small_model, family_of
from .packing import PackedBatch, pack
from .plan import Plan, PlanError, Rule
from .program import Program
from .sensitivity import SensitivityReport, sensitivity
from .runtime import (CheckpointError, DistributedModule, SimulatedMesh, launch, parallelize,
                      parallelize_from_pretrained, release_cuda_graphs)

__all__ = ["FAMILIES", "CheckpointError", "DistributedModule", "PackedBatch", "Plan", "PlanError", "Program",
           "Rule", "SensitivityReport", "SimulatedMesh", "build_small_model", "capture", "family_of", "launch", "pack", "parallelize",
           "parallelize_from_pretrained", "passes", "release_cuda_graphs", "sensitivity"]
__version__ = "0.1.0"
