#!/usr/bin/env bash
# Run 21 (one device call): GPU tests (new: int8_keys), the int8 precision table (kernel and
# twin against the exact twin), then int8_keys at the anchor (B=8, T=128k, 32/8/128).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -5 | tee "$OUT/pytest_gpu.txt"
timeout 120 python3 bench/int8_error.py --kernel --ts 8192,131072 2>&1 | tail -10 | tee "$OUT/int8_error.txt"
mkdir -p /tmp/ptx
MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 250 python3 bench/probe_kernel.py \
  --set i8 --pairs 2:128,4:128 --out "$OUT" 2>&1 | grep "^|\\|cuDNN"
