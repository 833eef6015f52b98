# One H200 (nvidia-h200): the several-row GEMV on narrow weights (Mamba-2.8B's x_proj, 192 x 5120)
# at 32 and 64 rows, every tiling of bench_gemv.py's sweep, now with 16-feature blocks and k split
# 16 or 32 ways, beside cuBLAS and the default tiling in the same run.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 python benchmarks/bench_gemv.py --out $OUT/narrow_split_k.json --shapes mamba-2.8b:x_proj \
    --rows 17 32 64 --sweep --sweep-rows 17 32 64 2>&1 | grep -v Warning | tail -8
python - "$OUT/narrow_split_k.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["rows"], "rows: cuBLAS", round(r["cublas_us"], 2), "us, default", r["default_config"], round(r["gemv_us"], 2), "us")
    for s in sorted((s for s in r.get("sweep", []) if "us" in s), key=lambda s: s["us"])[:6]:
        print(r["rows"], {k: s[k] for k in ("BLOCK_N", "BLOCK_K", "num_stages", "SPLIT_K")}, round(s["us"], 2))
PY
