"""A batch-64 decode profile's kernel time by category beside the bytes each category must move.

    python benchmarks/results/decode_profile/batch64_budget.py DIR/decode_profile.json

Reads ``benchmarks/decode_profile.py``'s JSON (run with ``SSMSHARD_PDL=0``, so that the kernel times
add up) and prints, for its first variant and batch, a markdown table: each category's device time
per step, the bytes it must move at the least, the time those bytes take at the copy bandwidth
measured in the same run, and the ratio. Bytes per category:

  matmul     every weight read once (decode_gpu.py's floor: the embedding counts its looked-up rows)
  SSM step   the recurrent states (conv and SSM) read and written back: 2 x the floor's state bytes
  attention  the keys and values read (the floor's K/V bytes)

The floor counts states read, not written, so ``SSM step`` at the copy bandwidth already costs the
floor's state share twice; the last lines say what that leaves of 1.5x the floor.
"""

import json
import sys


def budget(path: str) -> str:
    with open(path) as f:
        data = json.load(f)
    variant, row = next(iter(data["results"].items()))
    batch, cell = next(iter(row["batches"].items()))
    bandwidth = data["copy_bandwidth_bytes_per_s"]

    def at_copy_us(nbytes):
        return 1e6 * nbytes / bandwidth

    must_move = {"matmul": cell["weight_bytes"], "SSM step": 2 * cell["recurrent_state_bytes"],
                 "attention": cell["kv_bytes"]}
    lines = [f"{data['model']} ({data['layers']} layers), {variant}, batch {batch}, {data['device']}, "
             f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, {data['date']}",
             f"the profile's TPOT {cell['tpot_ms']:.3f} ms ((T(n) - T(1)) / (n - 1), not a graphed step's time), kernels {cell['device_us']:.0f} us "
             f"({cell['kernels_per_step']:.0f} a step), floor {cell['floor_ms']:.3f} ms "
             f"(weights {cell['weight_bytes'] / 1e9:.2f} GB, states {cell['recurrent_state_bytes'] / 1e9:.2f} GB, "
             f"K/V {cell['kv_bytes'] / 1e9:.3f} GB)", "",
             "| category | us a step | bytes it must move GB | us at copy bandwidth | measured / bytes |",
             "|---|---:|---:|---:|---:|"]
    spent = cell["by_category_us"]
    for name in sorted(spent, key=lambda c: -spent[c]):
        nbytes = must_move.get(name)
        if nbytes:
            lines.append(f"| {name} | {spent[name]:.0f} | {nbytes / 1e9:.2f} | {at_copy_us(nbytes):.0f} | "
                         f"{spent[name] / at_copy_us(nbytes):.2f}x |")
        else:
            lines.append(f"| {name} | {spent[name]:.0f} | | | |")
    least = sum(at_copy_us(b) for b in must_move.values())
    target = 1.5 * cell["floor_ms"] * 1e3
    lines += ["", f"Every category at the copy bandwidth, nothing else: {least:.0f} us "
                  f"({least / (cell['floor_ms'] * 1e3):.2f}x the floor); 1.5x the floor: {target:.0f} us; "
                  f"measured kernels: {cell['device_us']:.0f} us ({cell['device_us'] / (cell['floor_ms'] * 1e3):.2f}x).",
              "", "Largest kernels (calls a step, us each, us a step):"]
    for k in sorted(cell["kernels"], key=lambda k: -k["us"])[:8]:
        lines.append(f"- {k['kernel'][:90]} [{k['category']}]: {k['calls']:g} x {k['us_each'] or 0:.2f} = {k['us']:.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(budget(path))
        print()
