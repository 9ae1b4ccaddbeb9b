#!/usr/bin/env bash
# Run 83 (one device call), kernel at the cache order (stop 19): the Hq=32 grid (exact; the
# fp8-V columns of run 70 stand) and the generation benchmark (Llama-3-8B shapes, KIVI-2 G=128,
# implementation="auto").
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
mkdir -p "$OUT/g" "$OUT/e"
timeout 235 python3 bench/decode_attention.py --mode grid --hq 32 --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0 \
  --budget_s 210 --out "$OUT/g" 2>&1 | grep "^|"
timeout 200 python3 bench/generate.py --models llama-3-8b --points 16x4096,4x32768 \
  --caches kivi2 --impls auto --group-size 128 --no-max-batch --deadline 150 --out "$OUT/e" \
  2>&1 | tail -8
