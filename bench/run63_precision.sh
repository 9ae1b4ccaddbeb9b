#!/usr/bin/env bash
# Run 63 (one device call): the precision table on library-quantized K/V with the kernel after
# runs 59-61 (bench/lowbit_error.py; "default" takes the per-warp softmax at these shapes,
# "no warp_softmax" the previous loop), and Hq=64 at B=32 with these defaults.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
mkdir -p "$OUT/h"
timeout 220 python3 bench/lowbit_error.py --kernel --ts 8192,131072 --variants 0,8 2>&1 | grep "^|" \
  | tee "$OUT/lowbit_error_2026-12-01_run63.txt"
timeout 140 python3 bench/decode_attention.py --mode grid --hq 64 --batches 32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0 \
  --budget_s 120 --out "$OUT/h" 2>&1 | grep "^|"
