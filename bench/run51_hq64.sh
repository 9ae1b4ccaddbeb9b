#!/usr/bin/env bash
# Run 51 (one short device call, the session's last device time): the Hq=64 grid shapes with the
# smallest margins over cuDNN (B 1 and 8, T 8k/32k/128k) with this session's defaults.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$OUT/g"
timeout 165 python3 bench/decode_attention.py --mode grid --hq 64 --batches 1,8 \
  --ts 8192,32768,131072 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0 \
  --budget_s 140 --out "$OUT/g" 2>&1 | grep "^|"
