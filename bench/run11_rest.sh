#!/usr/bin/env bash
# Run 11 (one device call): the Hq=64, T=32k row of the grid (not reached in run 10) and the
# SmolLM2 end-to-end points with implementation="auto".
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$OUT/g64" "$OUT/gen"
timeout 130 python3 bench/decode_attention.py --mode grid --hq 64 --fp16 cudnn --no_twin \
  --ts 32768 --budget_s 120 --out "$OUT/g64" > "$OUT/g64/log.txt" 2>&1; grep "^|" "$OUT/g64/log.txt"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 100 python3 bench/generate.py --models smollm2-135m \
  --points 1x4096,16x4096,4x32768 --caches fp16,kivi2,kivi4 --impls auto --no-max-batch \
  --deadline 75 --out "$OUT/gen" > "$OUT/gen/log.txt" 2>&1; tail -12 "$OUT/gen/log.txt"
