#!/usr/bin/env bash
# Run 24 (one device call): fp8_values (the value product on fp8 tensor cores): its GPU tests
# and every other GPU kernel test, the precision of the variants on library-quantized K/V,
# then the anchor timing of the variants with registers.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py ${PYK:+-k "$PYK"} 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
timeout 120 python3 bench/lowbit_error.py --kernel --ts ${TS:-8192,32768} 2>&1 | tail -10 | tee "$OUT/lowbit_error.txt"
mkdir -p /tmp/ptx
MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout ${PROBE_S:-200} python3 bench/probe_kernel.py \
  --set f8 --pairs ${PAIRS:-2:128,4:128} --only "${ONLY:-default,int8_keys,fp8_values,int8_keys fp8_values}" \
  --out "$OUT" 2>&1 | grep "^|\\|cuDNN"
