"""Running sharded programs: ``parallelize`` builds a rank's module; ``launch`` starts ranks locally."""

from .distributed import DistributedModule, parallelize
from .launch import launch

__all__ = ["DistributedModule", "launch", "parallelize"]
