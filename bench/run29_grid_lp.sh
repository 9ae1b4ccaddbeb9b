#!/usr/bin/env bash
# Run 29 (one device call): the opt-in int8_keys + fp8_values kernel (choose_tuning's launch
# parameters) over the grid at G = 128, Hq 32 and 64, against cuDNN fp16 in the same process.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 380 python3 bench/decode_attention.py --mode grid --hq 32,64 --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128,4:128 --fp16 cudnn --no_twin --lp 1 --budget_s 320 \
  --out "$OUT" 2>&1 | grep "^|"
