#!/usr/bin/env bash
# Run 41 (one device call): the kernel's GPU tests natively with mma.sync products by default,
# then the Hq=32 grid (B 1/8/32, T 8k/32k/128k, 2/4-bit, G 32/128, choose_tuning's defaults,
# plus the fp8 value product at G = 128) against cuDNN fp16 in the same process.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
timeout ${GRID_S:-380} python3 bench/decode_attention.py --mode grid --hq ${HQ:-32} --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0,1 \
  --budget_s $(( ${GRID_S:-380} - 20 )) --out "$OUT" 2>&1 | grep "^|"
