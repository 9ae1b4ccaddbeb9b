#!/usr/bin/env bash
# Run 56 (one device call): the Hq=32 grid with the kernel after runs 53-55 (choose_tuning's
# defaults unchanged), Hq=64 at B=32 (last measured in run 42 with older defaults), and the
# GPU tests of the attention and model modules.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
mkdir -p "$OUT/g" "$OUT/h"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 290 python3 bench/decode_attention.py --mode grid --hq 32 --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0,1 \
  --budget_s 270 --out "$OUT/g" 2>&1 | grep "^|"
timeout 130 python3 bench/decode_attention.py --mode grid --hq 64 --batches 32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0 \
  --budget_s 110 --out "$OUT/h" 2>&1 | grep "^|"
timeout 100 python3 -m pytest -q tests/test_attention.py -k "pallas_kernel or tuning" \
  tests/test_models.py -k "pallas_kernel or tuning or unstack or layout" 2>&1 | tail -2 \
  | tee "$OUT/pytest_gpu_attention_models.txt"
