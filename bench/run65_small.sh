#!/bin/bash
# Run 65: the per-warp softmax at the grid's smallest shapes (few steps per split, where the
# epilogue's merge of the warps weighs most): A/B in one process, each variant twice.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-65}
timeout 250 python3 bench/point_compare.py --points 1x8192,1x32768,8x8192 --kbg 2:128,4:128 \
  --variants "default;warp_softmax=0;default;warp_softmax=0" 2>&1 | grep "^|" \
  | tee $OUT/ab_${D}_run$R.txt
