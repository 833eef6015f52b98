"""Do the batch and sequence symbols survive capture and sharding? (the report's bytes per token)

Prints the first input's shape after capturing Llama-3-8B's dimensions (two layers, meta device)
and after sharding it for rank 1 of tp 2, the shape environment's replacements, and, each time a
number replaces a symbol, the replacement and the frames of the graph and of fake-tensor dispatch
that asked for it. Then runs ``ssmshard inspect mamba --tp 2 --mode decode``. Run from the
repository root with PYTHONPATH=. and filter with
``grep -E "^(REPLACE|==|captured|sharded|   )"``.
"""
import sys
import traceback

import torch
from torch.fx.experimental import symbolic_shapes

import ssmshard
from ssmshard.cli import main
from ssmshard.passes.shard import token_symbols
from ssmshard.runtime.pipeline import shard_program

sys.path.insert(0, "tests")
from test_report import _llama, _meta  # noqa: E402  (the report test's model)
from transformers import LlamaForCausalLM  # noqa: E402

_set_replacement = symbolic_shapes.ShapeEnv._set_replacement


def _print_number_replacements(self, symbol, target, *args, **kwargs):
    if getattr(target, "is_number", False):
        print(f"REPLACE {symbol} -> {target} {args}", flush=True)
        for frame in traceback.extract_stack():
            if any(where in frame.filename for where in ("eval_with_key", "ssmshard", "fake_tensor.py")):
                print(f"   {frame.filename.split('/')[-1]}:{frame.lineno} {frame.name}: {frame.line}")
    return _set_replacement(self, symbol, target, *args, **kwargs)


symbolic_shapes.ShapeEnv._set_replacement = _print_number_replacements


def show(tag, program):
    first = next(i.name for i in program.inputs if i.kind == "user")
    value = next(n.meta["val"] for n in program.graph.nodes if n.op == "placeholder" and n.name == first)
    print(tag, "input", first, [s.node.expr if isinstance(s, torch.SymInt) else s for s in value.shape])
    print(tag, "tokens", token_symbols(program))
    shape_env = value.fake_mode.shape_env
    print(tag, "replacements", dict(shape_env.replacements))
    print(tag, "example sizes", dict(shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val")
                                     else shape_env.var_to_val))


print("torch", torch.__version__, flush=True)
model = _meta(LlamaForCausalLM, _llama())
print("== capture llama forward", flush=True)
program = ssmshard.capture(model)
show("captured", program)
print("== shard", flush=True)
show("sharded", shard_program(program, model, ssmshard.Plan(tp=2), rank=1, group="report"))
print("== cli inspect mamba decode tp 2", flush=True)
main(["inspect", "mamba", "--tp", "2", "--mode", "decode", "-q"])
