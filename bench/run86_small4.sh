#!/usr/bin/env bash
# Run 86 (one device call): 4-bit G=128 at B=1 (the grid cells of runs 83-84 that came out
# slower than runs 79-80: B=1 T=128k Hq=32, B=1 T=32k Hq=64), the cache order against the
# previous kernel (27ba8ad, bench/scratch/kd_27ba8ad.py) in one process.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
timeout 220 python3 bench/point_compare.py --points 1x131072,1x32768 --kbg 4:128 \
  --prev bench/scratch/kd_27ba8ad.py --variants "prev;default;prev;default" \
  | tee "$OUT/ab_${D}_run86.txt"
