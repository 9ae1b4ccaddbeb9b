#!/usr/bin/env bash
# Run 88 (one device call; needs commit ca538ef, whose kernel and bench/point_compare.py take the
# "vblock" variant; reverted after this run): V codes in 64-column blocks [.., Tq/(64 Pv), D, 64] (one contiguous
# 8 KiB block per 256 2-bit tokens instead of 128 rows of 64 bytes 32 KiB apart; runs 74-75 put
# the 2-bit load pipeline at 0.156 ms on it against 0.175-0.188): the kernel over both layouts
# (bit-identical, against the twin), an A/B at the anchor, the floors (skip=copies: compute
# without copies; skip=compute: the load pipeline alone), then an Nsight Compute instruction
# mix of the default at 2-bit G=128 (the byte-order kernel).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
timeout 150 python3 bench/scratch/vblock_check.py 2>&1 | grep -v Warn | tee "$OUT/vblock_check_${D}_run88.txt"
timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32,4:128 \
  --variants "default;vblock;default;vblock" | tee "$OUT/ab_${D}_run88.txt"
timeout 150 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32 \
  --variants "skip=copies;vblock:skip=copies;skip=compute;vblock:skip=compute" \
  | tee "$OUT/floors_${D}_run88.txt"
PAIRS="2:128" timeout 150 bash bench/ncu_sass.sh 2>&1 | tail -45
