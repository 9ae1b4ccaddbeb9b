#!/usr/bin/env bash
# Run 17 (one device call): GPU tests (incl. fold_k + reload_codes + lean_values natively), then
# fewer-register variants at the anchor (2-bit G=128) with ptxas register counts.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 110 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
mkdir -p /tmp/ptx; MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 110 \
  python3 bench/probe_kernel.py --set lean --pairs 2:128 --out "$OUT" 2>&1 | grep "^|\\|cuDNN"
