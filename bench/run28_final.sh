#!/usr/bin/env bash
# Run 28 (one device call): the kernel's GPU tests, the precision of the low-precision products
# on library-quantized K/V, and the anchor timing of each flag and of choose_tuning's
# int8_keys + fp8_values configuration.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 200 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
timeout 100 python3 -m pytest -q tests/test_attention.py -k "pallas_kernel or tuning" 2>&1 | tail -3 | tee -a "$OUT/pytest_gpu.txt"
timeout 100 python3 bench/lowbit_error.py --kernel --ts 8192,131072 2>&1 | tail -10 | tee "$OUT/lowbit_error.txt"
mkdir -p /tmp/ptx
MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 220 python3 bench/probe_kernel.py \
  --set f8c --pairs 2:128,4:128 --out "$OUT" 2>&1 | grep "^|\\|cuDNN"
