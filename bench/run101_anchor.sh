#!/usr/bin/env bash
# Run 101 (one device call; stop 22): the anchor again after run 100's grid had 2-bit G=128 at
# 0.207 ms (point pairs of runs 97-99: 0.197-0.199): release_slots back on in three pairs, and
# at 2-bit G=32 with the new default four launch variants (no spread copies, 12 splits, the
# conditional rescale, release_slots).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R="default;release_slots=1"
timeout 130 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 --variants "$R;$R;$R" \
  | tee "$OUT/ab_${D}_run101.txt"
V="default;spread_copies=0;num_splits=12;lazy_rescale=1;release_slots=1"
timeout 160 python3 bench/point_compare.py --points 8x131072 --kbg 2:32 --variants "$V;$V" \
  | tee -a "$OUT/ab_${D}_run101.txt"
