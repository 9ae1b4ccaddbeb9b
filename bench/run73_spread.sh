#!/bin/bash
# Run 73: where a call's time goes (bench/overhead.py: the kernel alone against the whole
# call), then the copies dealt over the warpgroup's warps (`spread_copies`): its GPU cases and
# an A/B in one process (each variant twice) at the anchor for the three production block
# shapes (W = 4 2-bit G=128, W = 3 2-bit G=32, W = 1 4-bit G=128), with the compute-only and
# load-only ablations of the default at 2-bit G=128.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-73}
timeout 150 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py -k "46 or 47 or 48" \
  2>&1 | tail -4 | tee $OUT/pytest_gpu_${D}_run$R.txt
timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "default;spread_copies=1;skip=loads;skip=compute;default;spread_copies=1" 2>&1 \
  | grep "^|" | tee $OUT/ab_${D}_run$R.txt
timeout 150 python3 bench/point_compare.py --points 8x131072 --kbg 2:32,4:128 \
  --variants "default;spread_copies=1;default;spread_copies=1" 2>&1 | grep "^|" \
  | tail -n +2 | tee -a $OUT/ab_${D}_run$R.txt
