#!/usr/bin/env bash
# Run 9 (one device call): GPU tests of the kernel (widen8 default), widen8 A/B at the anchor
# for 2/4-bit x G 128/32, SASS instruction mix of the new default (2-bit G=128).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 python3 bench/probe_kernel.py \
  --set w8 --pairs 2:128,2:32,4:128,4:32 --out "$OUT" 2>&1 | tail -10
[ "${NCU:-0}" = 1 ] && PAIRS="${PAIRS:-2:128}" timeout 150 bash bench/ncu_sass.sh
