#!/usr/bin/env bash
# Run 62 (one device call): the Hq=32 grid and Hq=64 at B 1 and 8 with choose_tuning's
# defaults after runs 59-61 (the per-warp softmax in one-warpgroup blocks).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
mkdir -p "$OUT/g" "$OUT/h"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 290 python3 bench/decode_attention.py --mode grid --hq 32 --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0,1 \
  --budget_s 270 --out "$OUT/g" 2>&1 | grep "^|"
timeout 175 python3 bench/decode_attention.py --mode grid --hq 64 --batches 1,8 \
  --ts 8192,32768,131072 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0 \
  --budget_s 150 --out "$OUT/h" 2>&1 | grep "^|"
