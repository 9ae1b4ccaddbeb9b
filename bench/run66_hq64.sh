#!/usr/bin/env bash
# Run 66 (the session's last device time): Hq=64 at B 1 and 8 with the final defaults (the
# per-warp softmax from 16 steps per split, choose_tuning after run 65).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
mkdir -p "$OUT/h"
timeout 170 python3 bench/decode_attention.py --mode grid --hq 64 --batches 1,8 \
  --ts 8192,32768,131072 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0 \
  --budget_s 150 --out "$OUT/h" 2>&1 | grep "^|"
