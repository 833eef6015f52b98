"""Where eager Mamba-1's layout copies come from: one GPU, the Mamba-2.8B width cut to 2 layers,
batch 8 x 2048, eager program (``Plan(tp=1, training=False)``), random bf16 weights.

The forward runs the program on the module's parameters, which require grad, as
``DistributedModule.forward`` did under ``torch.no_grad`` before it bound views of them that do
not (``no_grad_views_gpu.py`` times the two). Prints every aten op of the forward that reads a tensor of at least 8 x 2048 x 1024 elements,
with the shapes, strides and dtypes of its tensor arguments and the shape and strides of its
result (a dispatch mode: ops inside ssmshard's custom kernels are not listed), then the
profiler's table grouped by input shape. The copies are the ``clone`` rows whose result strides
differ from their input's.

    PYTHONPATH=$PWD python benchmarks/results/compile/eager_copies_probe.py
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # benchmarks/
import ssmshard  # noqa: E402
from decode_gpu import GPU_MODELS  # noqa: E402
from generate_gpu import build_random_model  # noqa: E402

BATCH, LENGTH = 8, 2048


class LargeOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(t.numel() >= BATCH * LENGTH * 1024 for t in tensors):
            described = [(tuple(t.shape), t.stride(), str(t.dtype).removeprefix("torch.")) for t in tensors]
            result = (tuple(out.shape), out.stride()) if isinstance(out, torch.Tensor) else type(out).__name__
            print(f"{str(func):32s} {described[:3]} -> {result}")
        return out


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dist.init_process_group("gloo", rank=0, world_size=1)
    config = GPU_MODELS["mamba-2.8b"]()
    config.num_hidden_layers = 2
    dm = ssmshard.parallelize(build_random_model(config, "cuda", torch.bfloat16),
                              ssmshard.Plan(tp=1, training=False))
    ids = torch.randint(0, config.vocab_size, (BATCH, LENGTH), device="cuda")
    def forward():
        dm._bound(dm.program)  # the parameters themselves
        return dm.program(ids)

    with torch.no_grad():
        forward()  # compiles the kernels
        torch.cuda.synchronize()
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
        with LargeOps():
            forward()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            forward()
            torch.cuda.synchronize()
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="cuda_time_total", row_limit=30, max_name_column_width=60, max_shapes_column_width=80))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
