#!/usr/bin/env bash
# Run 82 (one device call), kernel at the cache order (stop 19): the attention and model
# modules' GPU kernel cases; at the anchor (B=8 T=128k, 32/8/128) what the per-group work costs
# now (skip=groups), vec64 again, and 4-bit G=128 against the previous kernel (27ba8ad).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
timeout 90 python3 -m pytest -q tests/test_attention.py -k "pallas_kernel or tuning" \
  tests/test_models.py -k "pallas_kernel or tuning or unstack or layout" 2>&1 | tail -2 \
  | tee "$OUT/pytest_gpu_attention_models_run82.txt"
timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32 \
  --variants "default;skip=groups;vec64=1;default;skip=groups;vec64=1" | tee "$OUT/ab_${D}_run82.txt"
timeout 120 python3 bench/point_compare.py --points 8x131072 --kbg 4:128 \
  --prev bench/scratch/kd_27ba8ad.py --variants "prev;default;prev;default" \
  | tee -a "$OUT/ab_${D}_run82.txt"
