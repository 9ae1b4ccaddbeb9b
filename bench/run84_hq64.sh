#!/usr/bin/env bash
# Run 84 (one device call), kernel at the cache order (stop 19): the Hq=64 grid (exact).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
mkdir -p "$OUT/h"
timeout 235 python3 bench/decode_attention.py --mode grid --hq 64 --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0 \
  --budget_s 205 --out "$OUT/h" 2>&1 | grep "^|"
