#!/bin/bash
# Run 69: copy_warp as the default with several warpgroups per block: the GPU tests of the
# kernel module (its W > 1 cases now take it; new cases: release_slots at W = 4 and at 4 bits
# with three stages, copy_warp off), and an A/B in one process (each variant twice) of the
# slots released through an mbarrier (`release_slots`) against the warpgroup barrier.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-69}
timeout 240 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -6 \
  | tee $OUT/pytest_gpu_${D}_run$R.txt
timeout 200 python3 bench/point_compare.py --points 8x131072,32x32768 --kbg 2:128 \
  --variants "default;release_slots=1;copy_warp=0;default;release_slots=1;copy_warp=0" 2>&1 \
  | grep "^|" | tee $OUT/ab_${D}_run$R.txt
timeout 80 python3 bench/point_compare.py --points 8x131072 --kbg 2:32 \
  --variants "default;release_slots=1;default;release_slots=1" 2>&1 | grep "^|" \
  | tail -n +2 | tee -a $OUT/ab_${D}_run$R.txt
