#!/usr/bin/env bash
# Run 42 (one device call): the Hq=64 half of the run-41 grid, then the generation loop
# (Llama-3-8B shapes, random bf16 weights, KIVI-2 G=128 R=128) with the mma.sync kernel.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
mkdir -p "$OUT/g" "$OUT/a"
timeout 250 python3 bench/decode_attention.py --mode grid --hq 64 --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0,1 \
  --budget_s 230 --out "$OUT/g" 2>&1 | grep "^|"
timeout 280 python3 bench/generate.py --models llama-3-8b --points 16x4096,4x32768 \
  --caches kivi2 --impls auto,auto-lowp --group-size 128 --no-max-batch --deadline 250 \
  --out "$OUT/a" 2>&1 | grep -v "^W0000\|^I0000" | tail -8
