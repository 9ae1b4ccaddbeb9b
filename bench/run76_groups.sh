#!/bin/bash
# Run 76: what the per-group key work costs (skip="groups": one group's vectors per step) and
# what the value product costs (skip="values") at the anchor; at G=32 (three warpgroups) the
# copies dealt over the warps (spread_copies) again, with and without release_slots.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-76}
timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "default;skip=groups;skip=values;skip=copies;default;skip=groups" 2>&1 \
  | grep "^|" | tee $OUT/ab_${D}_run$R.txt
timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:32 \
  --variants "default;skip=groups;spread_copies=1;spread_copies=1,release_slots=1;default;spread_copies=1;spread_copies=1,release_slots=1" \
  2>&1 | grep "^|" | tail -n +2 | tee -a $OUT/ab_${D}_run$R.txt
