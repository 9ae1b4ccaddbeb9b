#!/usr/bin/env bash
# Run 19 (one device call): GPU tests (incl. three warpgroups per block), then warpgroups per
# block at the anchor (B=8, T=128k, 32/8/128) with ptxas register counts.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
mkdir -p /tmp/ptx "$OUT/a" "$OUT/b"
MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 \
  python3 bench/probe_kernel.py --set wg --pairs 2:128 --out "$OUT/a" 2>&1 | grep "^|\\|cuDNN"
MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 \
  python3 bench/probe_kernel.py --set wg --pairs 4:128,2:32 --only "default,W3 S6,W3 S12" \
  --out "$OUT/b" 2>&1 | grep "^|\\|cuDNN"
