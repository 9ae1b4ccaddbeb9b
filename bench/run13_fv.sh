#!/usr/bin/env bash
# Run 13 (one device call): GPU tests with the value scale folded into P (fold_v, default at
# G >= 64), fold_v A/B at the anchor, registers per kernel from ptxas.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
mkdir -p /tmp/ptx; MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 300 python3 bench/probe_kernel.py \
  --set fv --pairs 2:128,4:128,2:64 --out "$OUT" 2>&1 | grep "^|\|cuDNN"
