#!/bin/bash
# Run 61: the per-warp softmax as choose_tuning's default for one-warpgroup blocks: A/B at
# W = 1 points in one process (warp_softmax=0 is the previous loop), the GPU tests of the
# kernel module, and the GPU tests of the attention and model modules.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-61}
V="default;warp_softmax=0;default;warp_softmax=0"
timeout 130 python3 bench/point_compare.py --points 8x131072,1x131072 --kbg 4:128 \
  --variants "$V" 2>&1 | grep "^|" | tee $OUT/ab_${D}_run$R.txt
timeout 110 python3 bench/point_compare.py --points 1x131072,8x8192 --kbg 2:128 \
  --variants "$V" 2>&1 | grep "^|" | tail -n +2 | tee -a $OUT/ab_${D}_run$R.txt
timeout 230 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -15 \
  | tee $OUT/pytest_gpu_${D}_run$R.txt
timeout 100 python3 -m pytest -q tests/test_attention.py -k "pallas_kernel or tuning" \
  tests/test_models.py -k "pallas_kernel or tuning or unstack or layout" 2>&1 | tail -2 \
  | tee $OUT/pytest_gpu_attention_models_run$R.txt
