#!/usr/bin/env bash
# Greedy tokens at batch 64 (bf16, random weights): every way ssmshard computes them against its
# host loop, and Hugging Face's (benchmarks/greedy_agreement_gpu.py), in two processes one after
# the other on the same machine; then whether the two processes' tokens are equal.
# Run on the device: bash benchmarks/results/decode/run_greedy_agreement_gpu.sh
set -euo pipefail
export PYTHONPATH=$PWD
for process in first second; do
    python benchmarks/greedy_agreement_gpu.py --out "$OUT/$process" 2>&1 | grep -v "falling back" | tail -12
done
python - <<'PY'
import json, os
rows = {p: [json.loads(l) for l in open(os.path.join(os.environ["OUT"], p, "rows_rank0.jsonl"))] for p in ("first", "second")}
tokens = {p: {r["model"]: r["tokens"] for r in rs if r["kind"] == "tokens"} for p, rs in rows.items()}
for model in tokens["first"]:
    a, b = tokens["first"][model], tokens["second"].get(model)
    print(f"{model}: the two processes' tokens equal: {a == b}", flush=True)
PY
