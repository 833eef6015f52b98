"""CPU check and timing: capture of a full-size config on the meta device with its layers copied
(``layer_repeat.py``) and traced whole, mode by mode.

    python benchmarks/capture_copied_layers.py [--model zamba2-2.7b] [--modes forward prefill decode static chunk]
    python benchmarks/capture_copied_layers.py --smoke    # an 11-layer small Zamba2, decode: checks the script

For each mode it captures the model twice in this process, copying layers and then with
``SSMSHARD_TRACE_ALL_LAYERS=1``, and prints both wall times, how many layers were traced, and
whether the two programs are the same: every op node's op and layer, block, role and module
tags in graph order, the weights in order, the state specs and the shape ranges (the comparison
tests/test_layer_repeat.py makes on small models). Exits 1 if any mode differs. ``static`` is
the decode step over static key/value buffers (attention families). The models are
benchmarks/decode_gpu.py's configs with bf16 weights on the meta device: nothing is allocated.
``--smoke``: a small-width Zamba2 of 11 layers (Mamba and hybrid layers alternating, two shared
blocks), decode only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_gpu import GPU_MODELS  # noqa: E402

import ssmshard  # noqa: E402
from ssmshard.families import BY_NAME, family_of  # noqa: E402
from ssmshard.testing import program_signature  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="zamba2-2.7b", choices=sorted(GPU_MODELS))
    parser.add_argument("--modes", nargs="+", default=["forward", "prefill", "decode", "static", "chunk"],
                        choices=["forward", "prefill", "decode", "static", "chunk"])
    parser.add_argument("--smoke", action="store_true", help="an 11-layer small Zamba2, decode only")
    args = parser.parse_args()
    import transformers

    if args.smoke:
        args.model, args.modes = "tiny-zamba2 (11 layers)", ["decode"]
        config = BY_NAME["zamba2"].make_config(num_hidden_layers=11, num_mem_blocks=2,
                                               layers_block_type=["mamba", "hybrid"] * 5 + ["mamba"])
    else:
        config = GPU_MODELS[args.model]()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    family = family_of(model)
    traced_counts = []  # the length of each prefix capture traces (one per plan it tries)
    capture_module = sys.modules["ssmshard.capture"]  # the module (ssmshard.capture is also the function)

    truncated = capture_module.truncated

    def counting_truncated(model, layers):
        traced_counts.append(layers)
        return truncated(model, layers)

    capture_module.truncated = counting_truncated
    print(f"{args.model} ({family.class_name}, {config.num_hidden_layers} layers), transformers "
          f"{transformers.__version__}, torch {torch.__version__}")
    differ = False
    for mode in args.modes:
        if mode == "static" and not family.has_attention:
            continue
        kwargs = {"static_kv": True} if mode == "static" else {}
        times, programs = [], []
        traced_counts.clear()
        for trace_all in ("0", "1"):
            os.environ["SSMSHARD_TRACE_ALL_LAYERS"] = trace_all
            started = time.perf_counter()
            programs.append(ssmshard.capture(model, mode="decode" if mode == "static" else mode, **kwargs))
            times.append(time.perf_counter() - started)
        os.environ.pop("SSMSHARD_TRACE_ALL_LAYERS")
        prefixes = list(traced_counts)
        same = program_signature(programs[0]) == program_signature(programs[1])
        differ |= not same
        print(f"{mode:8s} copied {times[0]:6.1f} s (prefixes traced: {prefixes or 'none'}), "
              f"traced whole {times[1]:6.1f} s, {programs[0].node_count()} ops, same program: {same}", flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
