#!/usr/bin/env bash
# Run 100 (one device call; stop 22): the Hq=32 grid with choose_tuning of stop 22 (fold_v_warp
# + vec64 at 2-bit G=32, no release_slots with packed planes), and the Hq=64 grid's 2-bit
# columns, the ones those choices touch (4-bit: run 84 stands).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
mkdir -p "$OUT/g32" "$OUT/g64"
timeout 250 python3 bench/decode_attention.py --mode grid --hq 32 --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0 \
  --budget_s 225 --out "$OUT/g32" 2>&1 | grep "^|"
timeout 200 python3 bench/decode_attention.py --mode grid --hq 64 --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32 --fp16 cudnn --no_twin --lp 0 \
  --budget_s 175 --out "$OUT/g64" 2>&1 | grep "^|"
