#!/usr/bin/env bash
# Run 94 (one device call; pack_planes on by default at 2-bit G=128): the kernel module's GPU
# cases and the dispatch tests natively (run 94 gave them 330 s and 90 s: too little on a cold
# compile cache), then the anchor A/B of the new default against pack_planes=0 (two pairs, one
# process).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kivi_decode_sm90.py 2>&1 \
  | tail -4 | tee "$OUT/pytest_gpu_${D}_run94.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_attention.py 2>&1 | tail -4 \
  | tee -a "$OUT/pytest_gpu_${D}_run94.txt"
timeout 100 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "default;pack_planes=0;default;pack_planes=0" | tee "$OUT/ab_${D}_run94.txt"
