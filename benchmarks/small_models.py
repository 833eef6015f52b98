"""The small Llama, Mamba, Mamba-2 and Zamba2 configurations trained for accuracy measurements,
and the ssmshard program they are trained through.

``MODELS``: Hugging Face classes built from their config classes, hidden size 256, tied
embeddings, about 7M parameters each, so each bf16 checkpoint stays under 16 MiB (the most one
file may be to come back from the GPU machine; four of them fit its 64 MiB). Every dimension a
tensor-parallel plan splits divides by 8: vocabulary (the tokenizer's, 4096), attention and
key/value heads, MLP width, SSM channels and heads. Mamba-2 has one B/C group (replicated to
every rank, as in the public Mamba-2 checkpoints), Zamba2 eight (one per rank at tp 8). The
smoke configurations are the same families at hidden size 64.

Training runs through the captured program (on CUDA with the ``swap_kernels`` pass: Triton
scans and convolutions), because Hugging Face's Mamba-1 without the mamba-ssm kernels scans one
token at a time in Python. Capture drops the exported graph's dtype assertions
(``drop_tensor_asserts``), which would fail under ``torch.autocast``.
"""

from __future__ import annotations

import warnings

import torch

import ssmshard
from ssmshard.passes import run_pipeline

# name -> (HF class, config class, full-size config, smoke config); vocab_size is the tokenizer's.
_ZAMBA2_LAYERS = ["linear_attention", "linear_attention", "hybrid"]
MODELS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(hidden_size=256, intermediate_size=640, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=8, max_position_embeddings=2048),
              dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=8, max_position_embeddings=256)),
    "mamba": ("MambaForCausalLM", "MambaConfig",
              dict(hidden_size=256, state_size=16, num_hidden_layers=14, expand=2, conv_kernel=4),
              dict(hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)),
    "mamba2": ("Mamba2ForCausalLM", "Mamba2Config",
               dict(hidden_size=256, state_size=64, num_hidden_layers=14, expand=2, num_heads=8, head_dim=64,
                    n_groups=1, chunk_size=256, conv_kernel=4),
               dict(hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, num_heads=8, head_dim=16,
                    n_groups=1, chunk_size=16, conv_kernel=4)),
    "zamba2": ("Zamba2ForCausalLM", "Zamba2Config",
               dict(hidden_size=256, num_hidden_layers=9, layers_block_type=_ZAMBA2_LAYERS * 3, mamba_d_state=32,
                    mamba_expand=2, n_mamba_heads=8, mamba_ngroups=8, chunk_size=256, num_attention_heads=8,
                    num_key_value_heads=8, intermediate_size=512, num_mem_blocks=1,
                    use_shared_attention_adapter=True, adapter_rank=32, use_mem_rope=True,
                    max_position_embeddings=2048),
               dict(hidden_size=64, num_hidden_layers=3, layers_block_type=_ZAMBA2_LAYERS, mamba_d_state=16,
                    mamba_expand=2, n_mamba_heads=8, mamba_ngroups=8, chunk_size=16, num_attention_heads=8,
                    num_key_value_heads=8, intermediate_size=128, num_mem_blocks=1,
                    use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
                    max_position_embeddings=256)),
}


def model_config(name: str, vocab_size: int, smoke: bool):
    import transformers

    _, config_class, full, tiny = MODELS[name]
    # The end-of-text token (id 0) starts and ends documents; no padding id, so no embedding row
    # is frozen as a padding_idx.
    return getattr(transformers, config_class)(
        vocab_size=vocab_size, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=None,
        use_cache=False, **(tiny if smoke else full))


def build_model(name: str, vocab_size: int, smoke: bool, seed: int, device):
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, MODELS[name][0])(model_config(name, vocab_size, smoke))
    return model.float().train()


def training_program(model, precision: str):
    program = ssmshard.capture(model)
    steps = []  # capture already drops export's dtype asserts (they fail under autocast)
    if next(model.parameters()).is_cuda:
        steps.append(("swap_kernels", {"kernels": "triton"}))
    with warnings.catch_warnings(record=True) as caught:  # a node left on the reference path: recorded
        warnings.simplefilter("always")
        program = run_pipeline(program, steps) if steps else program
    for warning in caught:
        print(f"WARNING: {warning.message}", flush=True)
    kernels = sorted({f"{r['op']}: {r['kernel'] or 'reference (' + str(r['why']) + ')'}"
                      for r in getattr(program, "kernel_report", [])})
    return program, kernels


def forward_fn(program, precision: str, device):
    """``ids -> logits`` of the program, under autocast for bf16."""
    def run(ids):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            return program(ids, check_inputs=False)
    return run
