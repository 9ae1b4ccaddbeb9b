#!/usr/bin/env bash
# Run 45 (one device call): the precision of the mma.sync kernel (default and low_precision)
# against wgmma and the run-28 low_precision, on library-quantized K/V (bench/lowbit_error.py).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python3 bench/lowbit_error.py --kernel --ts 8192,131072 2>&1 | grep "^|" | tee "$OUT/lowbit_error_2026-11-29_run45.txt"
