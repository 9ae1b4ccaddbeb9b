#!/usr/bin/env bash
# Run 22 (one device call): int8_keys with the barrier-free per-thread prep
# (_int8_prep_native): its GPU tests, precision at 8k, timing at the anchor.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py -k "18 or 19 or 20" 2>&1 | tail -3 | tee "$OUT/pytest_gpu.txt"
timeout 60 python3 bench/int8_error.py --kernel --ts 8192 2>&1 | tail -6 | tee "$OUT/int8_error.txt"
mkdir -p /tmp/ptx
MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 bench/probe_kernel.py \
  --set i8 --pairs 2:128,4:128 --only "default,int8_keys,int8_keys W3" --out "$OUT" 2>&1 \
  | grep "^|\\|cuDNN"
