#!/bin/bash
# Run 68: the TMA copies issued by one warp per warpgroup (`copy_warp`) where several
# warpgroups share a block: the new GPU test cases, and an A/B in one process (each variant
# twice) at the anchor (2-bit G=128 takes W=4, G=32 W=3) and at B=32 T=32k.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-68}
timeout 150 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py -k "gpu_matches and (43 or 44 or 45 or 39 or 42)" 2>&1 | tail -4 \
  | tee $OUT/pytest_gpu_${D}_run$R.txt
timeout 300 python3 bench/point_compare.py --points 8x131072,32x32768 --kbg 2:128,2:32 \
  --variants "default;copy_warp=1;default;copy_warp=1" 2>&1 | grep "^|" \
  | tee $OUT/ab_${D}_run$R.txt
