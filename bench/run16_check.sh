#!/usr/bin/env bash
# Run 16 (one device call): GPU tests and the anchor A/B after fold_v was specialized to its one
# case (G = D; same operations in the same order, expected to be unchanged).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
timeout 120 python3 bench/probe_kernel.py --set fv --pairs 2:128,4:128 --only "default,no fold_v" \
  --out "$OUT" 2>&1 | grep "^|\|cuDNN"
