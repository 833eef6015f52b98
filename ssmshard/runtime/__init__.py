"""Running sharded programs: ``parallelize`` builds a rank's module (from a model in memory or a
safetensors checkpoint, ``checkpoint.py``); ``launch`` starts ranks locally."""

from .checkpoint import CheckpointError
from .cuda_graph import release_cuda_graphs
from .distributed import DistributedModule, parallelize, parallelize_from_pretrained
from .launch import launch
from .simulated import SimulatedMesh

__all__ = ["CheckpointError", "DistributedModule", "launch", "parallelize", "parallelize_from_pretrained",
           "release_cuda_graphs", "SimulatedMesh"]
