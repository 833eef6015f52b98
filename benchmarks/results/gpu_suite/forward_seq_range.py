"""Which sequence lengths does each family's one forward graph serve on this torch?

Captures each family's small test model in forward mode and prints the ranges of its input
shape, then exports the Llama forward with a sequence dimension from 1 (what capture asks for
first) and prints the error export raises, if any (capture then falls back to letting export
choose the range, and a length-1 input gets a sibling graph). Run from the repository root with
PYTHONPATH=.:tests.
"""
import torch
from torch.export import Dim

import ssmshard
from ssmshard.capture import _Forward, _capture_context, _example_ids
from ssmshard.families import family_of
from conftest import SIX_FAMILIES, small_model

print("torch", torch.__version__, flush=True)
for name in SIX_FAMILIES:
    program = ssmshard.capture(small_model(name))
    print(f"{name}: ranges {program.ranges}", flush=True)

model = small_model("llama")
with _capture_context(model, family_of(model)):
    args = (_example_ids(model, 2, 8, torch.device("cpu")),)
    try:
        torch.export.export(_Forward(model), args, dynamic_shapes=({0: Dim("batch", min=1), 1: Dim("seq", min=1)},),
                            strict=False)
        print("llama: export with seq from 1 succeeded")
    except torch._dynamo.exc.UserError as error:
        print("llama: export with seq from 1 raised:\n", str(error)[:4000])
