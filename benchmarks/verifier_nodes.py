"""How many nodes the verifier's fake propagation runs, and its CPU time, while the prefill and
decode programs of a small model are sharded, with SSMSHARD_FULL_PROPAGATION=1 and without.

    python benchmarks/verifier_nodes.py FAMILY TP [LAYERS]   # e.g. zamba2 2, or mamba 1 64

Node counts do not depend on the machine's load; CPU time (``time.process_time``) less than
wall time does."""
import os, sys, time, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import ssmshard
from conftest import small_model
from ssmshard.runtime.pipeline import shard_program
from ssmshard.passes import manager
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

counts = {"nodes": 0, "cpu": 0.0}
orig_run = FakeTensorProp.run_node
def run_node(self, n):
    counts["nodes"] += 1
    return orig_run(self, n)
FakeTensorProp.run_node = run_node
orig_prop = manager.propagate_fake_values
def prop(*a):
    t = time.process_time(); orig_prop(*a); counts["cpu"] += time.process_time() - t
manager.propagate_fake_values = prop

fam, tp = sys.argv[1], int(sys.argv[2])
model, plan = small_model(fam, **({"num_hidden_layers": int(sys.argv[3])} if len(sys.argv) > 3 else {})), ssmshard.Plan(tp=tp)
for full in ("1", "0"):
    os.environ["SSMSHARD_FULL_PROPAGATION"] = full
    counts.update(nodes=0, cpu=0.0)
    pre = shard_program(ssmshard.capture(model, mode="prefill"), model, plan, rank=tp - 1, group="g")
    shard_program(ssmshard.capture(model, mode="decode"), model, plan, rank=tp - 1, group="g", prefill=pre)
    print(f"{fam} tp={tp} {'full' if full == '1' else 'changed-only'}: nodes propagated {counts['nodes']}, "
          f"verifier CPU {counts['cpu']:.2f} s")
