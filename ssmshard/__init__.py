"""ssmshard: capture Hugging Face SSM, hybrid and Llama-style models as FX programs and rewrite them."""

from . import collectives, ops  # noqa: F401  (register torch.ops.ssmshard.*)
from . import passes
from .capture import capture
from .families import FAMILIES, build_small_model, family_of
from .program import Program

__all__ = ["FAMILIES", "Program", "build_small_model", "capture", "family_of", "passes"]
__version__ = "0.1.0"
