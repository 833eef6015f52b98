"""Does SDPA give the same bits with the additive mask `hoist_attention_mask` builds as with the
boolean mask HF passes? The decode-step shape of the GPU test (bf16, one query, 32 heads of 128,
200 keys, left padding up to 150), swept over seeds, batch sizes and grouped or full key/value
heads. For each case: whether the two outputs are equal, the kernel `torch._fused_sdp_choice`
names for each mask, whether each call repeats its own bits, and how many values differ by how
much. Then each kernel forced in turn (`sdpa_kernel`) on the first failing case, if any, to tell
a kernel choice from the mask's conversion. One line per case; a summary at the end.

    PYTHONPATH=. python benchmarks/results/gpu_suite/mask_bits.py [--seeds 40] [--extra-seed N]
"""

import argparse
import collections

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ssmshard.testing import masked_decode_attention

sdpa = torch.nn.functional.scaled_dot_product_attention


def compare(q, k, v, mask, additive, gqa):
    expected = sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa)
    got = sdpa(q, k, v, attn_mask=additive, enable_gqa=gqa)
    backends = [SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask=m, enable_gqa=gqa)).name
                for m in (mask, additive)]
    repeat = [all(torch.equal(sdpa(q, k, v, attn_mask=m, enable_gqa=gqa), first) for _ in range(3))
              for m, first in ((mask, expected), (additive, got))]
    differ = got != expected
    return {"equal": torch.equal(got, expected), "backends": backends, "repeat": repeat,
            "differ": int(differ.sum()), "max_diff": float((got.float() - expected.float()).abs().max())}


def forced(q, k, v, mask, additive, gqa):
    """Each kernel forced for both masks: equal bits per kernel, or why it cannot run."""
    out = {}
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH,
                    SDPBackend.FLASH_ATTENTION):
        try:
            with sdpa_kernel(backend):
                a = sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa)
                b = sdpa(q, k, v, attn_mask=additive, enable_gqa=gqa)
                again = sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa)
            out[backend.name] = (f"equal={torch.equal(a, b)} boolean-repeats={torch.equal(a, again)} "
                                 f"differ={int((a != b).sum())}")
        except RuntimeError as error:
            out[backend.name] = f"cannot run: {str(error).splitlines()[0][:80]}"
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--extra-seed", type=int, default=2239779494, help="the seed that failed")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}")
    tally = collections.Counter()
    first_failure = None
    for batch in (1, 16, 64):
        for gqa in (True, False):
            for seed in [args.extra_seed, *range(args.seeds)]:
                case = masked_decode_attention(seed, batch, gqa)  # the test's inputs
                result = compare(*case, gqa)
                tally[(batch, gqa, result["equal"])] += 1
                if not result["equal"] or seed == args.extra_seed:
                    print(f"batch {batch:2d} gqa {gqa!s:5} seed {seed}: {result}")
                if not result["equal"] and first_failure is None:
                    first_failure = (batch, gqa, seed, case)
    print("== summary: (batch, gqa) -> equal / differ")
    for batch in (1, 16, 64):
        for gqa in (True, False):
            print(f"batch {batch:2d} gqa {gqa!s:5}: {tally[(batch, gqa, True)]} equal, "
                  f"{tally[(batch, gqa, False)]} differ")
    if first_failure is not None:
        batch, gqa, seed, case = first_failure
        print(f"== each kernel forced, batch {batch} gqa {gqa} seed {seed}")
        for name, line in forced(*case, gqa).items():
            print(f"{name}: {line}")


if __name__ == "__main__":
    main()
